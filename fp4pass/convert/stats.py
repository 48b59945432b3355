"""The statistics of one conversion (the report's keys, below), measured on the tensors actually produced.

``measure_stats`` dequantizes both tensors (verbatim, and any method given a ``reference``); requant, hybrid
and auto otherwise take the same figures from their pattern search (``fp4pass.convert.patterns``).

- ``mse``: mean of (x_nv - x_mx)^2 over all elements, x_mx = ``mx.dequantize()`` (float64 accumulation).
- ``max_abs_err``: max |x_nv - x_mx|.
- ``snr_db``: 10 log10(sum x_mx^2 / sum (x_nv - x_mx)^2); None when the conversion is lossless.
- ``blocks16_verbatim``: 16-halves whose E2M1 nibbles were kept and whose values are reproduced exactly;
  ``blocks16_requantized``: the rest (requantized, or for ``verbatim`` snapped to a clamped scale).
- ``global_scale``: the FP32 global scales (dequant multipliers), flattened, one per group.
- ``mse_vs_reference``: mean (x_nv - reference)^2, only when a reference tensor was given.

``groups`` (not a report key): the same figures per group (one :class:`ConversionStats` each, in group order)
where the conversion has them without measuring again (lossless groups, and groups searched by pattern); None
where it does not (``verbatim``, or a ``reference`` given): callers then measure per group themselves.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import math

import numpy as np
import torch

from fp4pass.formats import MXFP4Tensor, NVFP4Tensor, NV_BLOCK_SIZE, decode_e2m1, decode_e8m0
from fp4pass.formats.constants import E8M0_BIAS
from fp4pass.metrics import snr_db

__all__ = ["ConversionStats", "measure_stats", "signal_energy"]


@dataclass
class ConversionStats:
    blocks16_total: int
    blocks16_verbatim: int
    blocks16_requantized: int
    global_scale: list[float]
    mse: float
    max_abs_err: float
    snr_db: float | None
    method_used: str
    mse_vs_reference: float | None = None
    extra: dict = field(default_factory=dict, repr=False)  # diagnostics, not part of the report's keys
    groups: list | None = field(default=None, repr=False, compare=False)  # per group (module docstring)

    def to_json(self) -> dict:
        out = {
            "blocks16_total": self.blocks16_total,
            "blocks16_verbatim": self.blocks16_verbatim,
            "blocks16_requantized": self.blocks16_requantized,
            "global_scale": list(self.global_scale),
            "mse": self.mse,
            "max_abs_err": self.max_abs_err,
            "snr_db": self.snr_db,
            "method_used": self.method_used,
        }
        if self.mse_vs_reference is not None:
            out["mse_vs_reference"] = self.mse_vs_reference
        return out

    def __getitem__(self, key: str):  # dict-style access: stats read as a mapping
        return self.to_json()[key]

    def keys(self):
        return self.to_json().keys()


def lossless_stats(total_halves: int, global_scale: list[float], method: str) -> ConversionStats:
    """Stats of a conversion proven lossless by construction (every half verbatim): nothing to measure.

    ``global_scale``: the FP32 global scales as host floats, flattened.
    """
    return ConversionStats(total_halves, total_halves, 0, list(global_scale), 0.0, 0.0, None, method)


#: 4 * e2m1(m)^2 for the magnitudes m = 0..7 (0, 0.5, 1, 1.5, 2, 3, 4, 6): integers
_E2M1_SQUARE_X4 = np.array([0, 1, 4, 9, 16, 36, 64, 144], dtype=np.uint16)
_BYTE = np.arange(256)
#: 4 * (e2m1(low nibble)^2 + e2m1(high nibble)^2) of a packed byte (<= 288); the sign bits do not count
BYTE_ENERGY_X4 = _E2M1_SQUARE_X4[_BYTE & 7] + _E2M1_SQUARE_X4[(_BYTE >> 4) & 7]
_PAIR = np.arange(1 << 16)
#: the same for two bytes read as one uint16 (<= 576): half as many lookups, in a 128 KiB table
PAIR_ENERGY_X4 = (BYTE_ENERGY_X4[_PAIR % 256] + BYTE_ENERGY_X4[_PAIR >> 8]).astype(np.uint16)
_LANES = np.uint64(0x0001000100010001)


def signal_energy(codes: torch.Tensor, scales: torch.Tensor, mx_block: int, chunks) -> float:
    """sum x^2 over the MXFP4 values of rows ``chunks`` (row ranges of the flat codes [n, K/2], scales [n, K/B]).

    x = e2m1(c) * 2^k, so sum x^2 = sum_k 4^k * E_k / 4 with E_k = sum over the blocks at exponent k of
    sum_i 4 e2m1(c_i)^2, an integer. The E_k are summed exactly (integers well under 2^53 in float64), by table
    lookups on the packed bytes and no float dequantization; the one rounding is in the final sum over the
    exponents (at most 255 terms, ``math.fsum``). Finite for every E8M0 code below 255.

    On CPU the table is read two bytes at a time, and a block's energies (four uint16 lanes per 64-bit word)
    are added lane-wise, then across the lanes by one multiply (the sum stays below 2^16).
    """
    per_block = mx_block // 2
    hist = np.zeros(256, dtype=np.float64)
    if codes.device.type == "cpu":
        words = per_block // 8  # 64-bit words of codes per block
        lanes = words > 0 and per_block % 8 == 0 and 288 * per_block < (1 << 16)
        for lo, hi in _small(chunks, codes.shape[1]):
            raw = codes[lo:hi].numpy()
            if lanes:
                index = raw.view(np.uint16).astype(np.intp)
                energy = np.take(PAIR_ENERGY_X4, index).view(np.uint64).reshape(-1, words)
                lane_sum = energy[:, 0].copy()
                for w in range(1, words):  # column adds: numpy's sum over a short axis is far slower
                    lane_sum += energy[:, w]
                block = (lane_sum * _LANES) >> np.uint64(48)
            else:
                block = np.take(BYTE_ENERGY_X4.astype(np.uint32), raw).reshape(-1, per_block).sum(-1)
            hist += np.bincount(scales[lo:hi].numpy().reshape(-1), weights=block, minlength=256)
    else:
        table = torch.from_numpy(BYTE_ENERGY_X4.astype(np.float64)).to(codes.device)
        total = torch.zeros(256, dtype=torch.float64, device=codes.device)
        for lo, hi in chunks:
            block = table[codes[lo:hi].long()].reshape(-1, per_block).sum(-1)
            total.index_add_(0, scales[lo:hi].reshape(-1).long(), block)
        hist = total.cpu().numpy()
    return math.fsum(math.ldexp(float(e), 2 * (c - E8M0_BIAS) - 2) for c, e in enumerate(hist.tolist()) if e)


def _small(chunks, row_bytes: int, max_bytes: int = 1 << 18):
    """The row ranges of ``chunks`` cut to about ``max_bytes`` of codes each (what the lookups make stays in
    cache)."""
    step = max(1, max_bytes // max(row_bytes, 1))
    for lo, hi in chunks:
        for start in range(lo, hi, step):
            yield start, min(start + step, hi)


def measure_stats(
    mx_codes: torch.Tensor,
    mx_scales: torch.Tensor,
    mx_block: int,
    nv_codes: torch.Tensor,
    nv_scales: torch.Tensor,
    row_global_scale: torch.Tensor,
    reference: torch.Tensor | None,
    method: str,
    global_scale: torch.Tensor,
    chunks,
) -> ConversionStats:
    """Dequantize both sides chunk by chunk (rows ``chunks`` of the flat 2-D views) and compare."""
    sse = signal = ref_sse = 0.0
    max_err = 0.0
    verbatim = 0
    total = 0
    for lo, hi in chunks:
        x_mx = _mx_values64(MXFP4Tensor(mx_codes[lo:hi], mx_scales[lo:hi], mx_block))
        g = row_global_scale[lo:hi].unsqueeze(-1)
        half_vals = _nv_values64(NVFP4Tensor(nv_codes[lo:hi], nv_scales[lo:hi], g.reshape(-1)))
        err = half_vals - x_mx
        sse += float(err.square().sum())
        signal += float(x_mx.square().sum())
        max_err = max(max_err, float(err.abs().max())) if err.numel() else max_err
        same = (nv_codes[lo:hi] == mx_codes[lo:hi]).reshape(hi - lo, -1, NV_BLOCK_SIZE // 2).all(-1)
        exact = (err == 0).reshape(hi - lo, -1, NV_BLOCK_SIZE).all(-1)
        verbatim += int((same & exact).sum())
        total += same.numel()
        if reference is not None:
            ref = reference.reshape(-1, reference.shape[-1])[lo:hi].to(half_vals.device).double()
            ref_sse += float((half_vals - ref).square().sum())
    n = total * NV_BLOCK_SIZE
    mse = sse / n if n else 0.0
    snr = snr_db(signal, sse)
    return ConversionStats(
        total, verbatim, total - verbatim, global_scale.flatten().tolist(), mse, max_err, snr, method,
        (ref_sse / n if n else 0.0) if reference is not None else None,
    )


def _mx_values64(mx: MXFP4Tensor) -> torch.Tensor:
    """float64 [..., K]: ``mx.dequantize()`` (exact), and e2m1(code) * 2^k where float32 overflows (k >= 126)."""
    x = mx.dequantize()
    values = decode_e2m1(mx.element_codes()).double().reshape(*mx.scales.shape, mx.block_size)
    scale = decode_e8m0(mx.scales, what=f"{mx.name} scales").double()
    return _beyond_float32(x, (values * scale.unsqueeze(-1)).reshape(mx.shape))


def _nv_values64(nv: NVFP4Tensor) -> torch.Tensor:
    """float64 [..., K]: ``nv.dequantize()``, and where that overflows float32, e2m1(code) * fp32(e4m3 * S) in
    float64 (exact: an E2M1 value times a float32), so that a half kept verbatim at 2^126 or 2^127 measures
    error 0, not inf - inf. Rows of ``nv`` carry one global scale each."""
    x = nv.dequantize()
    values = decode_e2m1(nv.element_codes()).double().reshape(*nv.scales.shape, NV_BLOCK_SIZE)
    full_scale = (nv.block_scales() * nv.global_scale.reshape(-1, 1)).double()
    return _beyond_float32(x, (values * full_scale.unsqueeze(-1)).reshape(nv.shape))


def _beyond_float32(x32: torch.Tensor, x64: torch.Tensor) -> torch.Tensor:
    """x32 in float64, with x64 where x32 is not finite."""
    x = x32.double()
    return x if bool(torch.isfinite(x32).all()) else torch.where(torch.isfinite(x32), x, x64)
