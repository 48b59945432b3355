"""FP4 dequantization with bounded memory: byte-table lookups into a preallocated float32 output.

Both functions give the same values as :meth:`fp4pass.formats.MXFP4Tensor.dequantize` and
:meth:`fp4pass.formats.NVFP4Tensor.dequantize` (the one definition of each format), bit for bit, but never
hold a temporary wider than a chunk:

- the output, float32 [..., K], is allocated once;
- the packed codes are read ``chunk_elements`` output values at a time (whole rows; for expert weights
  [E, N, K/2] a chunk is a run of rows of one or a few experts). Each byte b (two E2M1 codes, element 2i in
  the low nibble, 2i+1 in the high) and the scale code s of its block form one int32 index ``s * 256 + b``
  into a table of 256 x 256 value pairs ``(e2m1(b & 15) * m(s), e2m1(b >> 4) * m(s))``, m(s) the block's
  multiplier in FP32; the pairs are gathered straight into the output's rows, each pair of float32 moved as
  one 8-byte word (a float64 view used as a bit container, never computed with). One gather per value and no
  pass over the output afterwards; the table (512 KiB, :mod:`fp4pass.formats.byte_tables`) is built once for
  MXFP4, once per global-scale group for NVFP4.

Peak extra memory: the output plus about ``chunk_elements`` x 2 bytes of index (8 MiB by default) and the
table. The scales are multipliers applied on dequantize:

- MXFP4: ``x = e2m1(code) * 2^(s - 127)``, s the E8M0 code of each 32-block (code 255, NaN, is refused);
- NVFP4: ``x = e2m1(code) * (e4m3(s) * G)``, s the E4M3 code of each 16-block and G the FP32 global scale
  (shape [] or the leading dims), the product ``e4m3(s) * G`` rounded to FP32 first, as the ONNX two-DQ
  form and ``NVFP4Tensor.dequantize`` do.
"""

from __future__ import annotations

import math

import torch

from fp4pass.errors import FormatError, ShapeError
from fp4pass.formats import MX_BLOCK_SIZE, NV_BLOCK_SIZE
from fp4pass.formats.codecs import check_e8m0
from fp4pass.formats.byte_tables import mxfp4_scaled_pairs, scaled_pairs

__all__ = ["dequantize_mxfp4", "dequantize_nvfp4", "CHUNK_ELEMENTS"]

#: output values dequantized per step: an int32 index of half as many entries (8 MiB) is the temporary
CHUNK_ELEMENTS = 1 << 22

#: NVFP4 global-scale groups up to which each gets its own table (one per expert); more (a scale per row) fall
#: back to a multiply pass over the output
_MAX_TABLES = 256


def _e4m3_values(device: torch.device) -> torch.Tensor:
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float().to(device)


def _check(codes: torch.Tensor, scales: torch.Tensor, block: int, name: str) -> tuple[int, int]:
    """(rows, K) of packed ``codes`` [..., K/2] with ``scales`` [..., K/block]; ShapeError when they do not fit."""
    if codes.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ShapeError(f"{name}: codes and scales must be uint8, got {codes.dtype} and {scales.dtype}")
    if codes.dim() == 0 or codes.shape[:-1] != scales.shape[:-1]:
        raise ShapeError(f"{name}: codes {tuple(codes.shape)} and scales {tuple(scales.shape)} differ in leading "
                         "dims")
    k = codes.shape[-1] * 2
    if k != scales.shape[-1] * block:
        raise ShapeError(f"{name}: K={k} from codes {tuple(codes.shape)} does not match {scales.shape[-1]} "
                         f"scales x block {block}")
    return math.prod(codes.shape[:-1]), k


def _fill(out_rows: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, table: torch.Tensor, block: int,
          chunk_elements: int) -> None:
    """Write ``out_rows`` [R, K] from ``codes`` [R, K/2] and ``scales`` [R, K/block] through ``table``."""
    rows, k = out_rows.shape
    if rows == 0 or k == 0:
        return
    step = max(1, chunk_elements // k)
    per_block = block // 2  # bytes of codes under one scale
    index = torch.empty(min(rows, step) * (k // 2), dtype=torch.int32, device=codes.device)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        n = (r1 - r0) * (k // 2)
        scale_part = scales[r0:r1].to(torch.int32).mul_(256).unsqueeze(-1)  # [r, K/block, 1]
        torch.add(codes[r0:r1].view(r1 - r0, k // block, per_block), scale_part,
                  out=index[:n].view(r1 - r0, k // block, per_block))
        torch.index_select(table, 0, index[:n], out=out_rows[r0:r1].view(torch.float64).reshape(-1))


def dequantize_mxfp4(codes: torch.Tensor, scales: torch.Tensor, *, chunk_elements: int = CHUNK_ELEMENTS,
                     name: str = "mxfp4") -> torch.Tensor:
    """float32 [..., K] = e2m1(code) * 2^(scale - 127) from packed ``codes`` [..., K/2], E8M0 ``scales``
    [..., K/32] (module docstring)."""
    rows, k = _check(codes, scales, MX_BLOCK_SIZE, name)
    check_e8m0(scales, f"{name} scales")
    out = torch.empty((*codes.shape[:-1], k), dtype=torch.float32, device=codes.device)
    _fill(out.view(rows, k), codes.reshape(rows, k // 2), scales.reshape(rows, -1),
          mxfp4_scaled_pairs(codes.device),
          MX_BLOCK_SIZE, chunk_elements)
    return out


def dequantize_nvfp4(codes: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor, *,
                     chunk_elements: int = CHUNK_ELEMENTS, name: str = "nvfp4") -> torch.Tensor:
    """float32 [..., K] = e2m1(code) * (e4m3(scale) * G) from packed ``codes`` [..., K/2], E4M3 ``scales``
    [..., K/16] and FP32 ``global_scale`` G of shape [] or ``codes.shape[:d]`` (module docstring)."""
    rows, k = _check(codes, scales, NV_BLOCK_SIZE, name)
    g = torch.as_tensor(global_scale, dtype=torch.float32, device=codes.device)
    lead = codes.shape[:-1]
    if tuple(g.shape) != tuple(lead[:g.dim()]):
        raise ShapeError(f"{name}: global scale of shape {tuple(g.shape)} does not fit codes {tuple(codes.shape)}; "
                         "it must be [] or the leading dims")
    if not bool(torch.isfinite(g).all()) or not bool((g > 0).all()):
        raise FormatError(f"{name}: global scale must be finite and > 0, got {g.flatten()[:4].tolist()}")
    out = torch.empty((*lead, k), dtype=torch.float32, device=codes.device)
    groups = max(1, g.numel())
    if rows == 0:
        return out
    per_group = rows // groups  # the leading dims of g come first: each group is a run of whole rows
    flat_g, e4m3 = g.reshape(-1), _e4m3_values(codes.device)
    flat_out, flat_codes, flat_scales = out.view(rows, k), codes.reshape(rows, k // 2), scales.reshape(rows, -1)
    if groups > _MAX_TABLES:  # a global scale per row or so: multiply the rows instead of a table per group
        ones = scaled_pairs(torch.ones(256, device=codes.device))
        _fill(flat_out, flat_codes, torch.zeros_like(flat_scales), ones, NV_BLOCK_SIZE, chunk_elements)
        per_row = flat_g.repeat_interleave(per_group).reshape(rows, 1)
        step = max(1, chunk_elements // k)
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            scale = e4m3[flat_scales[r0:r1].to(torch.int64)] * per_row[r0:r1]  # fp32(e4m3(s) * G)
            flat_out[r0:r1].view(r1 - r0, -1, NV_BLOCK_SIZE).mul_(scale.unsqueeze(-1))
        return out
    for i in range(groups):
        table = scaled_pairs(e4m3 * flat_g[i])  # fp32(e4m3(s) * G) per scale code, as the format rounds it
        r0, r1 = i * per_group, (i + 1) * per_group
        _fill(flat_out[r0:r1], flat_codes[r0:r1], flat_scales[r0:r1], table, NV_BLOCK_SIZE, chunk_elements)
    return out
