"""Converting one unit of a checkpoint (a Linear, a gate/up pair, a gpt-oss expert stack) with fp4pass.convert.

Every unit goes through :func:`fp4pass.convert.mxfp4_to_nvfp4` with ONE group (``group_dims=0``), so it gets
one FP32 global scale S (a dequant multiplier, ModelOpt's ``weight_scale_2``):

- a Linear: S from its own blocks; per-expert models thus get a per-expert S, and one expert far from the
  others stays lossless;
- a gate/up pair (w1, w3 of one expert): both are read into one [2, N, K/2] buffer and converted as one group,
  so S comes from k_max over both (``auto``'s lossless path: S = 2^(k_max - 8)) and the two share it, as
  serving engines require;
- a gpt-oss stack [E, N, K]: ModelOpt's gpt-oss layout has one ``weight_scale_2`` for all experts, so S comes
  from the whole stack (lossless while the stack's exponent spread is <= 17).

Where the group is lossless (the usual case), the codes are the input's bytes (never unpacked) and the E4M3
block scales 2^(k_b - m) come from the E8M0 exponents by integer arithmetic. Elsewhere ``auto`` searches S and
re-encodes only the 16-halves that cannot stay verbatim. Per-expert figures for a pair or a stack that is not
lossless are measured here against the MXFP4 values (:func:`measure`).

:func:`convert_experts` converts an [E, N, K] stack with one S per expert, expert by expert, so that a lossy
expert never takes its lossless neighbours off the fast path.
"""

from __future__ import annotations

import math

import torch

from fp4pass.checkpoint.detect import FusedExperts, Linear
from fp4pass.safetensors.files import CheckpointError
from fp4pass.convert import lossless_range, mxfp4_to_nvfp4
from fp4pass.errors import FP4PassError
from fp4pass.formats import MXFP4Tensor, NVFP4Tensor
from fp4pass.formats.constants import E4M3_POW2_MAX_EXP, E8M0_BIAS, E8M0_NAN
from fp4pass.metrics import snr_db

__all__ = ["Converted", "convert_linears", "convert_fused", "convert_experts", "measure", "stats_entry"]

MEASURE_ROWS_ELEMENTS = 1 << 21


class Converted:
    """The NVFP4 result of one unit: codes [n, N, K/2], E4M3 codes [n, N, K/16], S, and figures per part.

    ``codes`` is None when the unit took ``auto``'s lossless path, whose codes are the source's bytes: the
    writer then copies them from the source file (:meth:`ShardWriter.copy_from`) without reading them here.
    """

    def __init__(self, codes: torch.Tensor | None, scales: torch.Tensor, global_scale: float, parts: list[dict]):
        self.codes, self.scales, self.global_scale, self.parts = codes, scales, global_scale, parts


_PLACEHOLDER = {"buffer": torch.empty(0, dtype=torch.uint8)}


def _placeholder(nbytes: int) -> torch.Tensor:
    """An uninitialised uint8 buffer of ``nbytes`` (grown as needed, never written): codes the lossless path
    does not read. Its pages are never touched, so it costs no memory."""
    if _PLACEHOLDER["buffer"].numel() < nbytes:
        _PLACEHOLDER["buffer"] = torch.empty(nbytes, dtype=torch.uint8)
    return _PLACEHOLDER["buffer"][:nbytes]


def takes_lossless_path(scales: torch.Tensor, method: str) -> bool:
    """Whether ``mxfp4_to_nvfp4(.., method, group_dims=0)`` takes its lossless path on these E8M0 codes, where it
    reads the scales only: ``auto``, every code below 255, spread of the codes <= 17, and a top exponent whose
    global scale 2^(k_max - 8) is a normal float32 (k_max - 8 >= -126)."""
    if method != "auto" or scales.numel() == 0:
        return False
    flat = scales.reshape(-1).numpy()
    lo, hi = int(flat.min()), int(flat.max())
    return hi != E8M0_NAN and lossless_range(lo, hi) and hi - E8M0_BIAS - E4M3_POW2_MAX_EXP >= -126


def stats_entry(stats) -> dict:
    """The report's keys of a :class:`fp4pass.convert.ConversionStats`, and ``lossless``."""
    d = stats.to_json()
    d["lossless"] = d["blocks16_requantized"] == 0
    return d


def measure(mx: MXFP4Tensor, nv: NVFP4Tensor, method: str) -> dict:
    """Figures of ``nv`` against the MXFP4 values of ``mx`` (float64, chunked over rows); same keys as the engine's.

    ``blocks16_verbatim``: 16-halves whose codes are kept and whose values are reproduced exactly.
    """
    k = mx.shape[-1]
    codes_mx, scales_mx = mx.codes.reshape(-1, k // 2), mx.scales.reshape(-1, k // mx.block_size)
    codes_nv, scales_nv = nv.codes.reshape(-1, k // 2), nv.scales.reshape(-1, k // 16)
    g = nv.global_scale.reshape(-1)
    if g.numel() != 1:
        raise ValueError("measure: one global scale expected")
    step = max(1, MEASURE_ROWS_ELEMENTS // k)
    sse = signal = 0.0
    max_err = 0.0
    verbatim = total = 0
    for lo in range(0, codes_mx.shape[0], step):
        hi = min(lo + step, codes_mx.shape[0])
        x = MXFP4Tensor(codes_mx[lo:hi], scales_mx[lo:hi], mx.block_size).dequantize().double()
        y = NVFP4Tensor(codes_nv[lo:hi], scales_nv[lo:hi], g.reshape(())).dequantize().double()
        err = y - x
        sse += float(err.square().sum())
        signal += float(x.square().sum())
        if err.numel():
            max_err = max(max_err, float(err.abs().max()))
        same = (codes_nv[lo:hi] == codes_mx[lo:hi]).reshape(hi - lo, -1, 8).all(-1)
        exact = (err == 0).reshape(hi - lo, -1, 16).all(-1)
        verbatim += int((same & exact).sum())
        total += same.numel()
    n = total * 16
    requant = total - verbatim
    return {"blocks16_total": total, "blocks16_verbatim": verbatim, "blocks16_requantized": requant,
            "global_scale": [float(g)], "mse": sse / n if n else 0.0, "max_abs_err": max_err,
            "snr_db": snr_db(signal, sse) if requant else None, "method_used": method, "lossless": requant == 0}


def _lossless_part(halves: int, global_scale: float, method: str) -> dict:
    return {"blocks16_total": halves, "blocks16_verbatim": halves, "blocks16_requantized": 0,
            "global_scale": [global_scale], "mse": 0.0, "max_abs_err": 0.0, "snr_db": None, "method_used": method,
            "lossless": True}


def _convert(mx: MXFP4Tensor, method: str, where: list, options: dict) -> tuple[NVFP4Tensor, object]:
    """mxfp4_to_nvfp4 with one group (``options``: its effort and threads); an error names the source tensors'
    shard and name."""
    try:
        return mxfp4_to_nvfp4(mx, method, group_dims=0, **options)
    except FP4PassError as exc:
        for entry, buffer in where:
            bad = (buffer == E8M0_NAN).nonzero()
            if bad.numel():
                index = tuple(int(i) for i in bad[0].tolist())
                raise CheckpointError(f"{entry.shard}: tensor {entry.name!r}: E8M0 code 255 (NaN) at index "
                                      f"{index}") from None
        raise CheckpointError(f"{where[0][0].shard}: tensor {where[0][0].name!r}: {exc}") from None


def convert_linears(catalog, linears: list[Linear], method: str, **options) -> Converted:
    """Convert one Linear or a gate/up pair (one shared S) read from ``catalog``.

    On ``auto``'s lossless path (decided from the scales, :func:`takes_lossless_path`) the codes are not read:
    the engine gets a placeholder it does not look at, and the result's ``codes`` is None (copy them).
    """
    first = linears[0]
    n, rows, cols = len(linears), first.rows, first.cols
    scales = torch.empty((n, rows, cols // 32), dtype=torch.uint8)
    for i, lin in enumerate(linears):
        catalog.read(lin.scales.name, out=scales[i])
    lossless = takes_lossless_path(scales, method)
    if lossless:
        codes = _placeholder(n * rows * cols // 2).reshape(n, rows, cols // 2)
    else:
        codes = torch.empty((n, rows, cols // 2), dtype=torch.uint8)
        for i, lin in enumerate(linears):
            catalog.read(lin.codes.name, out=codes[i])
    mx = MXFP4Tensor(codes.reshape(n * rows, cols // 2), scales.reshape(n * rows, cols // 32), 32,
                     name=first.codes.name)
    nv, stats = _convert(mx, method, [(lin.scales, scales[i]) for i, lin in enumerate(linears)], options)
    if lossless and (nv.codes.data_ptr() != codes.data_ptr() or stats.blocks16_requantized):
        raise RuntimeError(f"{first.codes.name}: the engine did not keep the codes on its lossless path")
    s = float(nv.global_scale.reshape(()))
    out_codes = nv.codes.reshape(n, rows, cols // 2)
    out_scales = nv.scales.reshape(n, rows, cols // 16)
    if n == 1:
        parts = [stats_entry(stats)]
    elif stats.blocks16_requantized == 0:
        parts = [_lossless_part(rows * cols // 16, s, stats.method_used) for _ in linears]
    else:
        parts = [measure(MXFP4Tensor(codes[i], scales[i], 32), NVFP4Tensor(out_codes[i], out_scales[i],
                 nv.global_scale.reshape(())), stats.method_used) for i in range(n)]
    return Converted(None if lossless else out_codes, out_scales, s, parts)


def convert_fused(catalog, unit: FusedExperts, method: str, **options) -> Converted:
    """Convert a gpt-oss stack [E, N, K] with one S for all experts; figures per expert."""
    e, rows, cols = unit.experts, unit.rows, unit.cols
    scales = torch.empty((e, rows, cols // 32), dtype=torch.uint8)
    catalog.read(unit.scales.name, out=scales)
    lossless = takes_lossless_path(scales, method)
    if lossless:  # the codes are only transposed: the writer streams them from the source, expert by expert
        codes = _placeholder(e * rows * cols // 2).reshape(e, rows, cols // 2)
    else:
        codes = torch.empty((e, rows, cols // 2), dtype=torch.uint8)
        catalog.read(unit.codes.name, out=codes)
    mx = MXFP4Tensor(codes, scales, 32, name=unit.codes.name)
    nv, stats = _convert(mx, method, [(unit.scales, scales)], options)
    if lossless and (nv.codes.data_ptr() != codes.data_ptr() or stats.blocks16_requantized):
        raise RuntimeError(f"{unit.codes.name}: the engine did not keep the codes on its lossless path")
    s = float(nv.global_scale.reshape(()))
    if stats.blocks16_requantized == 0:
        parts = [_lossless_part(rows * cols // 16, s, stats.method_used) for _ in range(e)]
    else:
        parts = [measure(MXFP4Tensor(codes[i], scales[i], 32), NVFP4Tensor(nv.codes[i], nv.scales[i],
                 nv.global_scale.reshape(())), stats.method_used) for i in range(e)]
    return Converted(None if lossless else nv.codes, nv.scales, s, parts)


def convert_experts(mx: MXFP4Tensor, method: str = "auto", **options) -> tuple[NVFP4Tensor, list[dict]]:
    """An expert stack [E, N, K] with one S per expert: ``mxfp4_to_nvfp4(mx, method, group_dims=1)``, whose
    experts convert as each would alone (a lossy expert never takes its lossless neighbours off the scale-only
    path), and its figures per expert. Methods without figures per group (``verbatim``) go expert by expert.
    """
    if method != "verbatim":
        nv, stats = mxfp4_to_nvfp4(mx, method, group_dims=1, **options)
        if stats.groups is not None:
            return nv, [stats_entry(part) for part in stats.groups]
    e = mx.shape[0]
    codes = torch.empty_like(mx.codes)
    scales = torch.empty((*mx.shape[:-1], mx.shape[-1] // 16), dtype=torch.uint8)
    global_scale = torch.empty(e, dtype=torch.float32)
    parts = []
    for i in range(e):
        one = MXFP4Tensor(mx.codes[i], mx.scales[i], mx.block_size, name=f"{mx.name}[{i}]")
        nv, stats = mxfp4_to_nvfp4(one, method, group_dims=0, **options)
        codes[i], scales[i] = nv.codes, nv.scales
        global_scale[i] = nv.global_scale.reshape(())
        parts.append(stats_entry(stats))
    return NVFP4Tensor(codes, scales, global_scale, name=mx.name), parts


def reciprocal(value: float) -> float:
    """1/value rounded to float32 (compressed-tensors' divisors); exact for powers of two."""
    out = float(torch.tensor(1.0, dtype=torch.float32) / torch.tensor(value, dtype=torch.float32))
    if not math.isfinite(out) or out <= 0:
        raise CheckpointError(f"the reciprocal of {value!r} is not a finite positive float32")
    return out
