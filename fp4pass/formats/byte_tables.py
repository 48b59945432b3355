"""Packed E2M1 bytes decoded by table lookup: one set of tables, built once per device, in one cache.

A packed FP4 byte holds two E2M1 codes, element 2i in its low nibble and 2i+1 in its high one (the order of
:func:`fp4pass.formats.packing.unpack_nibbles`). Decoding a tensor nibble by nibble costs a shift, a mask and a
gather per value; a table indexed by whole bytes (or by little-endian pairs of bytes) gathers two (or four)
values at once. Every such table of fp4pass is derived here from :data:`~fp4pass.formats.constants.E2M1_VALUES`
(the one definition of E2M1), so that the fx dequant, the checkpoint loader and the NVFP4 reader give the same
numbers as :func:`fp4pass.formats.codecs.decode_e2m1`, bit for bit:

- :func:`byte_values`: float32 [256, 2], byte b -> ``(e2m1(b & 15), e2m1(b >> 4))``;
- :func:`word_values`: [65536, 4] in float32 or bf16, the little-endian word ``b0 + 256 * b1`` -> the values
  of b0's low, b0's high, b1's low, b1's high nibble (what ``codes.view(int16)`` reads on a little-endian
  machine);
- :func:`scaled_pairs`: float64 words [256 * 256], entry ``s * 256 + b`` the float32 pair of byte b times a
  per-scale-code multiplier m(s), each product rounded once to FP32 (a float64 view used as an 8-byte bit
  container for the pair, never computed with); :func:`mxfp4_scaled_pairs` is the MXFP4 one, m(s) = 2^(s-127).

The cache is keyed by (table, device, dtype) and guarded by one lock: the checkpoint loader decodes from
prefetch threads, and a table built twice at once would only waste memory, but a half-filled dict entry must
never be read. The tables are small (float32 words: 1 MiB; the scaled pairs: 512 KiB) and live for the process.
"""

from __future__ import annotations

import threading

import torch

from fp4pass.formats.constants import E2M1_VALUES, E8M0_BIAS, E8M0_MAX_EXP

__all__ = ["byte_values", "word_values", "scaled_pairs", "mxfp4_scaled_pairs"]

_TABLES: dict[tuple, torch.Tensor] = {}
_LOCK = threading.RLock()  # a table may be built from another (the scaled pairs from the byte values)


def _cached(key: tuple, build) -> torch.Tensor:
    with _LOCK:
        table = _TABLES.get(key)
        if table is None:
            table = _TABLES[key] = build()
        return table


def _byte_values_cpu() -> torch.Tensor:
    codes = torch.arange(256)
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    return torch.stack([lut[codes & 0x0F], lut[codes >> 4]], dim=1)


def byte_values(device: torch.device | str = "cpu") -> torch.Tensor:
    """float32 [256, 2]: byte -> (e2m1(low nibble), e2m1(high nibble)), on ``device``."""
    device = torch.device(device)
    return _cached(("bytes", device, torch.float32), lambda: _byte_values_cpu().to(device))


def word_values(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``dtype`` [65536, 4]: the four E2M1 values of each little-endian pair of bytes, byte 0's low nibble
    first, on ``device``. bf16 holds every E2M1 value exactly, so the bf16 table is the float32 one cast."""
    device = torch.device(device)

    def build() -> torch.Tensor:
        pairs = _byte_values_cpu()
        word = torch.arange(65536)
        low, high = word % 256, word // 256  # byte 0, byte 1 of the little-endian pair
        return torch.cat([pairs[low], pairs[high]], dim=1).to(dtype).to(device)

    return _cached(("words", device, dtype), build)


def scaled_pairs(multipliers: torch.Tensor) -> torch.Tensor:
    """float64 words [256 * 256]: entry ``s * 256 + b`` holds the float32 pair of byte b times
    ``multipliers[s]`` (float32 [256], on the device the table is wanted on), each product rounded once in FP32.
    Not cached: an NVFP4 weight builds one per global-scale group."""
    pairs = byte_values(multipliers.device)
    table = pairs.unsqueeze(0) * multipliers.reshape(256, 1, 1)  # [s, b, 2]
    return table.contiguous().view(torch.float64).reshape(256 * 256)


def mxfp4_scaled_pairs(device: torch.device | str = "cpu") -> torch.Tensor:
    """:func:`scaled_pairs` of the MXFP4 multipliers 2^(s - 127), for every E8M0 code s (the table's row of
    code 255, NaN, holds 2^128 clamped to 2^127: a caller refuses code 255 before any lookup)."""
    device = torch.device(device)

    def build() -> torch.Tensor:
        exponents = (torch.arange(256) - E8M0_BIAS).clamp(max=E8M0_MAX_EXP).float()
        return scaled_pairs(torch.ldexp(torch.ones(256), exponents).to(device))

    return _cached(("mxfp4 pairs", device, torch.float64), build)
