"""MXFP4 weights decoded into the model's bf16 tensors: one Linear, or an expert stack straight into its slots.

The decode is exact: bf16 holds every MXFP4 value (:func:`mx_dequantize`), so the layer runs on the numbers
``MXFP4Tensor.dequantize()`` gives. A byte pair is looked up as its four bf16 values in one table per device
(:mod:`fp4pass.formats.byte_tables`), then multiplied in place by its block's power of two; a stack is decoded expert by expert on the device that
holds it, so only the packed bytes cross the bus (:func:`decode_experts`).
"""

from __future__ import annotations

import sys
import threading

import torch

from fp4pass.formats import MXFP4Tensor
from fp4pass.formats.byte_tables import word_values

__all__ = ["mx_dequantize", "decode_experts", "LoadCancelled"]


class LoadCancelled(Exception):
    """A fill stopped by its loader's ``cancel`` event
    (:attr:`fp4pass.checkpoint.layerwise.model.WeightLoader.cancel`)."""


def mx_dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, name: str,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """MXFP4 codes [N, K/2] + E8M0 scales [N, K/32] -> [N, K] in ``dtype``, exact, on the codes' device.

    bf16 holds every MXFP4 value e2m1 * 2^(code-127) that float32 holds (same exponent range; 2^-128 is a bf16
    subnormal), so for bf16 each pair of bytes is looked up as its four bf16 values (a 65536-entry table, low
    nibble first) and multiplied in place by the power of two in bf16: the numbers of
    ``MXFP4Tensor.dequantize()`` cast to bf16, in two passes instead of six, the same operations on the CPU and
    on a GPU. ``out``: a contiguous tensor of ``dtype`` and N*K elements on the codes' device to decode into
    (an expert of a parameter: no temporary copy). Other dtypes go through ``MXFP4Tensor.dequantize()``
    (float32). Scale code 255 (NaN) is refused, naming the tensor.
    """
    tensor = MXFP4Tensor.from_codes(codes, scales, name=name)  # checks shapes and NaN scales
    k = codes.shape[-1] * 2
    shape = (*codes.shape[:-1], k)
    if out is not None and (out.numel() != codes.numel() * 2 or out.dtype != dtype or not out.is_contiguous()
                            or out.device != codes.device):
        raise ValueError(f"{name}: cannot decode {list(shape)} into {out.dtype} {list(out.shape)} on {out.device}")
    if dtype != torch.bfloat16 or sys.byteorder != "little" or codes.shape[-1] % 2:
        value = tensor.dequantize().to(dtype)
        if out is None:
            return value
        out.copy_(value.reshape(out.shape))
        return out
    table = word_values(codes.device, torch.bfloat16).view(torch.int64).reshape(65536)
    words = codes.contiguous().view(torch.uint16).reshape(-1).to(torch.int32)
    if out is None:
        out = torch.empty(shape, dtype=torch.bfloat16, device=codes.device)
    torch.index_select(table, 0, words, out=out.view(-1).view(torch.int64))
    # from_codes has refused code 255 (NaN): every other E8M0 code is a power of two that bf16 holds
    out.view(*scales.shape, 32).mul_(scales.view(torch.float8_e8m0fnu).to(torch.bfloat16).unsqueeze(-1))
    return out.view(shape) if out.shape != shape else out


def decode_experts(codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, transposed: bool, name: str,
                   cancel: threading.Event | None = None) -> None:
    """MXFP4 expert stack: codes [E, N, K/2] + E8M0 scales [E, N, K/32] (any device) -> ``out`` [E, N, K], or
    [E, K, N] when ``transposed``, in place, by :func:`mx_dequantize` expert by expert on ``out``'s device.

    On a GPU the packed codes and scales (4.25 bits a weight) cross the bus once and are decoded there, not the
    16-bit values; on the CPU each expert decodes straight into its slot of ``out`` (each operation spread over
    torch's intra-op threads). A transposed ``out`` stored in the checkpoint's order (a [E, K, N] view of
    [E, N, K] memory: :func:`store_in_checkpoint_order`) is decoded straight into; another transposed one
    through one reused [N, K] buffer. The numbers are those of the CPU decode on every device (a table lookup
    and a multiplication by a power of two, both exact).
    ``cancel``: checked before each expert; when set, :class:`LoadCancelled` is raised.
    """
    device = out.device
    codes, scales = codes.to(device), scales.to(device)
    e, n = codes.shape[0], codes.shape[1]
    direct = transposed and out[0].t().is_contiguous()
    buffer = torch.empty(n, codes.shape[2] * 2, dtype=out.dtype, device=device) if transposed and not direct else None
    for i in range(e):
        if cancel is not None and cancel.is_set():
            raise LoadCancelled
        if direct:
            mx_dequantize(codes[i], scales[i], out.dtype, f"{name}[{i}]", out=out[i].t())
        elif transposed:
            out[i].copy_(mx_dequantize(codes[i], scales[i], out.dtype, f"{name}[{i}]", out=buffer).t())
        elif out[i].is_contiguous():
            mx_dequantize(codes[i], scales[i], out.dtype, f"{name}[{i}]", out=out[i])
        else:
            out[i].copy_(mx_dequantize(codes[i], scales[i], out.dtype, f"{name}[{i}]"))
