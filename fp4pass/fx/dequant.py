"""FP4 dequantization with bounded memory: byte-table lookups into a preallocated float32 output.

Both functions give the same values as :meth:`fp4pass.formats.MXFP4Tensor.dequantize` and
:meth:`fp4pass.formats.NVFP4Tensor.dequantize` (the one definition of each format), bit for bit, but never
hold a temporary wider than a chunk:

- the output, float32 [..., K], is allocated once;
- the packed codes are read ``chunk_elements`` output values at a time (whole rows; for expert weights
  [E, N, K/2] a chunk is a run of rows of one or a few experts): each byte b (two E2M1 codes, element 2i in
  the low nibble, 2i+1 in the high) is widened to an int32 index into a 256-entry table of value pairs
  ``(e2m1(b & 15), e2m1(b >> 4))``, gathered straight into the output's rows (each pair of float32 moved as
  one 8-byte word: a float64 view used as a bit container, never computed with);
- the block scales of the chunk come from a 256-entry table too, and multiply the rows in place.

Peak extra memory: the output plus about ``chunk_elements`` x 2 bytes of index (8 MiB by default) and the
chunk's scales. The scales are multipliers applied on dequantize:

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
from fp4pass.formats.constants import E2M1_VALUES, E8M0_BIAS

__all__ = ["dequantize_mxfp4", "dequantize_nvfp4", "CHUNK_ELEMENTS"]

#: output values dequantized per step: an int32 index of half as many entries (8 MiB) is the temporary
CHUNK_ELEMENTS = 1 << 22

_TABLES: dict[tuple[str, torch.device], torch.Tensor] = {}


def _table(kind: str, device: torch.device) -> torch.Tensor:
    key = (kind, device)
    if key not in _TABLES:
        codes = torch.arange(256, dtype=torch.int32)
        if kind == "pairs":  # byte -> (low-nibble value, high-nibble value)
            lut = torch.tensor(E2M1_VALUES, dtype=torch.float32)
            table = torch.stack([lut[codes & 15], lut[codes >> 4]], dim=1)
        elif kind == "e8m0":  # 2^(code - 127); code 255 (NaN) never reaches the table
            table = torch.ldexp(torch.ones(256), (codes - E8M0_BIAS).clamp(max=127).float())
        else:  # e4m3fn codes -> float32
            table = codes.to(torch.uint8).view(torch.float8_e4m3fn).float()
        _TABLES[key] = table.contiguous().to(device)
    return _TABLES[key]


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


def _dequantize(codes: torch.Tensor, row_scales, rows: int, k: int, block: int, chunk_elements: int) -> torch.Tensor:
    """The shared loop: ``row_scales(r0, r1)`` gives float32 [r1 - r0, K/block] multipliers of those rows."""
    out = torch.empty((*codes.shape[:-1], k), dtype=torch.float32, device=codes.device)
    if out.numel() == 0:
        return out
    pairs = _table("pairs", codes.device).view(torch.float64).reshape(256)  # 8-byte words, bits only
    flat_codes = codes.reshape(rows, k // 2)
    flat_out = out.view(rows, k)
    step = max(1, chunk_elements // k)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        index = flat_codes[r0:r1].reshape(-1).to(torch.int32)
        torch.index_select(pairs, 0, index, out=flat_out[r0:r1].view(torch.float64).reshape(-1))
        del index
        flat_out[r0:r1].view(r1 - r0, k // block, block).mul_(row_scales(r0, r1).unsqueeze(-1))
    return out


def dequantize_mxfp4(codes: torch.Tensor, scales: torch.Tensor, *, chunk_elements: int = CHUNK_ELEMENTS,
                     name: str = "mxfp4") -> torch.Tensor:
    """float32 [..., K] = e2m1(code) * 2^(scale - 127) from packed ``codes`` [..., K/2], E8M0 ``scales``
    [..., K/32] (module docstring)."""
    rows, k = _check(codes, scales, MX_BLOCK_SIZE, name)
    check_e8m0(scales, f"{name} scales")
    table = _table("e8m0", codes.device)
    flat_scales = scales.reshape(rows, -1)

    def row_scales(r0: int, r1: int) -> torch.Tensor:
        return table[flat_scales[r0:r1].to(torch.int64)]

    return _dequantize(codes, row_scales, rows, k, MX_BLOCK_SIZE, chunk_elements)


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
    per_row = g.reshape(*g.shape, *([1] * (len(lead) - g.dim()))).expand(lead).reshape(rows, 1)
    table = _table("e4m3", codes.device)
    flat_scales = scales.reshape(rows, -1)

    def row_scales(r0: int, r1: int) -> torch.Tensor:
        return table[flat_scales[r0:r1].to(torch.int64)] * per_row[r0:r1]

    return _dequantize(codes, row_scales, rows, k, NV_BLOCK_SIZE, chunk_elements)
