"""MXFP4 -> NVFP4 conversion: ``mxfp4_to_nvfp4(mx, method, group_dims, reference) -> (NVFP4Tensor, stats)``.

The methods and their math are in :mod:`fp4pass.convert.methods`; how tensors are cut into groups (one FP32
global scale each, per expert by default for 3-D weights) in :mod:`fp4pass.convert.layout`; the per-16-half
encoding in :mod:`fp4pass.convert.halves`; the statistics in :mod:`fp4pass.convert.stats`.

Everything runs in torch on the tensor's own device, chunked over rows (about 4M elements per chunk) so that
memory stays bounded on large expert tensors. Groups whose exponent spread is <= 17 (all of them, in most
real checkpoints) convert losslessly without unpacking a single code: one min/max pass over the E8M0 scales
(which also refuses code 255), the E4M3 scales by integer arithmetic on the E8M0 codes, and the packed
nibbles shared with the input (not copied). On CPU those integer steps run in numpy (``layout.on_host``).
hybrid and auto encode lossy groups by table (:mod:`fp4pass.convert.tables`): the float work is done once
per kind of 16-half (group, exponent, largest magnitude), not per half and candidate.
"""

from __future__ import annotations

import logging
import math

import torch

from fp4pass.convert.layout import EMPTY_K, GroupLayout, exact_pow2, exact_pow2_list, exponent_range, scale_code_range
from fp4pass.convert.methods import (
    auto_candidates,
    pow2_scale_codes,
    _decode,
    choose_m,
    encode_rows,
    group_amax,
)
from fp4pass.convert.tables import build_tables, candidate_sse, encode_at, group_amax_from_codes, half_keys
from fp4pass.convert.stats import ConversionStats, lossless_stats, measure_stats
from fp4pass.errors import ShapeError, UsageError
from fp4pass.formats import MXFP4Tensor, NVFP4Tensor, global_scale_from_amax, pack_nibbles

__all__ = ["mxfp4_to_nvfp4", "ConversionStats", "METHODS", "M_RULES", "LOSSLESS_SPREAD"]

log = logging.getLogger(__name__)

METHODS = ("requant", "verbatim", "hybrid", "auto")
M_RULES = ("midpoint", "search")
#: E4M3 holds the 18 exact powers of two 2^-9..2^8, so 18 consecutive exponents (spread 17) fit verbatim.
LOSSLESS_SPREAD = 17
CHUNK_ELEMENTS = 1 << 22


def mxfp4_to_nvfp4(
    mx: MXFP4Tensor,
    method: str = "auto",
    group_dims: int | None = None,
    reference: torch.Tensor | None = None,
    *,
    m_rule: str = "search",
    chunk_elements: int = CHUNK_ELEMENTS,
) -> tuple[NVFP4Tensor, ConversionStats]:
    """Convert ``mx`` to NVFP4 with ``method`` (requant | verbatim | hybrid | auto; see ``methods``).

    ``group_dims``: leading dims that get their own global scale (None: 1 for 3-D tensors, i.e. per expert,
    else 0). ``reference``: the original high-precision tensor, for ``stats.mse_vs_reference``.
    ``m_rule`` (verbatim only): "midpoint" or "search". Returns the NVFP4 tensor (global scale of shape
    ``shape[:group_dims]``, a dequant multiplier) and its :class:`ConversionStats`.
    """
    if method not in METHODS:
        raise UsageError(f"{mx.name}: unknown method {method!r}; choose one of {', '.join(METHODS)}")
    if m_rule not in M_RULES:
        raise UsageError(f"{mx.name}: unknown m_rule {m_rule!r}; choose one of {', '.join(M_RULES)}")
    if reference is not None and tuple(reference.shape) != tuple(mx.shape):
        raise ShapeError(f"{mx.name}: reference shape {tuple(reference.shape)} does not match {tuple(mx.shape)}")
    layout = GroupLayout.of(mx, group_dims)
    codes, scales = layout.flat(mx)
    device = codes.device

    def chunks_of(group_ids):
        return layout.row_chunks(group_ids, chunk_elements)

    all_groups = list(range(layout.groups))
    halves = layout.k // 16
    code_lo, code_hi = scale_code_range(scales, layout, mx.name)  # also refuses E8M0 code 255
    # auto only: hybrid's m is defined by the blocks that hold a value (seed Algo 3), which needs the codes
    fast_lossless = method == "auto" and all(u - l <= LOSSLESS_SPREAD for l, u in zip(code_lo, code_hi))
    if fast_lossless:
        # Every block (holding a value or not) is within 17 octaves of its group's top: m = k_max - 8 puts
        # them all in E4M3's exact window, nibbles shared with the input, scales straight from exponents.
        m = [u - 127 - 8 for u in code_hi]
        global_scale = exact_pow2_list(m, device)
        out_codes = codes
        out_scales = pow2_scale_codes(scales, layout, m, code_lo, code_hi)
        proven_lossless = True
    elif method != "requant":
        k_max, k_min = exponent_range(codes, scales, layout)
        empty = k_max == EMPTY_K
        lossless = empty | (k_max - k_min <= LOSSLESS_SPREAD)
        # verbatim nibbles are shared with the input, never copied; methods that re-encode write a copy
        out_codes = codes if method == "verbatim" or bool(lossless.all()) else codes.clone()
    else:
        out_codes = codes.clone()

    if method == "requant":
        amax = group_amax(codes, scales, layout, all_groups, chunks_of(all_groups))
        global_scale = global_scale_from_amax(amax)
        out_scales = torch.empty(layout.total_rows, halves, dtype=torch.uint8, device=device)
        row_scale = global_scale.repeat_interleave(layout.rows_per_group)
        for lo, hi in chunks_of(all_groups):
            out_codes[lo:hi], out_scales[lo:hi], _ = encode_rows(
                codes, scales, layout, lo, hi, row_scale[lo:hi], allow_verbatim=False, neighbours=0)
        proven_lossless = False
    elif method == "verbatim":
        m = choose_m(codes, scales, layout, k_max, k_min, m_rule, chunks_of(all_groups))
        global_scale = exact_pow2(m)
        out_scales = pow2_scale_codes(scales, layout, m.tolist(), code_lo, code_hi)
        proven_lossless = bool(lossless.all())
    elif not fast_lossless:  # hybrid and auto share the lossless path: m = k_max - 8
        m = torch.where(empty, torch.zeros_like(k_max), k_max - 8)
        global_scale = exact_pow2(m)
        out_scales = pow2_scale_codes(scales, layout, m.tolist(), code_lo, code_hi)
        lossy = (~lossless).nonzero().squeeze(-1)
        proven_lossless = lossy.numel() == 0
        if not proven_lossless:
            global_scale = global_scale.clone()
            global_scale[lossy] = _encode_lossy(codes, scales, layout, lossy, k_max, code_lo, code_hi, out_codes,
                                                out_scales, method, chunks_of, mx.name)

    lead = layout.group_shape
    global_scale = global_scale.reshape(lead)
    nv = NVFP4Tensor(
        out_codes.reshape(mx.codes.shape),
        out_scales.reshape(*mx.shape[:-1], halves),
        global_scale,
        name=mx.name,
    )
    if proven_lossless and reference is None:
        scale_list = [math.ldexp(1.0, e) for e in m] if fast_lossless else global_scale.flatten().tolist()
        stats = lossless_stats(layout.total_rows * halves, scale_list, method)
    else:
        row_scale = global_scale.reshape(-1).repeat_interleave(layout.rows_per_group)
        stats = measure_stats(codes, scales, layout.mx_block, out_codes, out_scales, row_scale,
                              reference, method, global_scale, chunks_of(all_groups))
    return nv, stats


def _encode_lossy(codes, scales, layout: GroupLayout, lossy: torch.Tensor, k_max, code_lo, code_hi, out_codes,
                  out_scales, method: str, chunks_of, name: str) -> torch.Tensor:
    """hybrid/auto on the lossy groups ``lossy`` [L]: writes their rows of out_codes/out_scales, returns S [L].

    hybrid: S = 2^(k_max - 8), every non-verbatim half at its standard code s0. auto: the candidate S of least
    total SSE (``methods.auto_candidates``), each half at the best of s0, s0 - 1, s0 + 1. Both by table
    (:mod:`fp4pass.convert.tables`), which repeats the float operations of ``halves.encode_halves`` exactly.
    """
    lossy_list = lossy.tolist()
    device = codes.device
    code0 = min(code_lo[g] for g in lossy_list)
    code1 = max(code_hi[g] for g in lossy_list)
    if code1 >= 253:  # 6 * 2^126 overflows float32: let the decoder name the rows
        for lo, hi in chunks_of(lossy_list):
            _decode(codes, scales, layout, lo, hi)
    local = torch.full((layout.groups,), -1, dtype=torch.long, device=device)
    local[lossy] = torch.arange(lossy.numel(), device=device)
    halves = layout.k // 16

    def keys_of(lo, hi, with_counts=True):
        row_local = local[torch.arange(lo, hi, device=device) // layout.rows_per_group]
        return row_local, half_keys(codes, scales, layout, lo, hi, row_local, code0, code1 - code0 + 1,
                                    with_counts=with_counts)

    hybrid = exact_pow2(k_max[lossy] - 8)
    if method == "auto":
        amax = group_amax_from_codes(codes, scales, layout, chunks_of(lossy_list))[lossy]
        candidates = auto_candidates(k_max[lossy], amax)
        tables = build_tables(candidates, code0, code1, neighbours=1)
        total = torch.zeros(candidates.shape, dtype=torch.float64, device=device)
        for lo, hi in chunks_of(lossy_list):
            row_local, (key, counts, _, _) = keys_of(lo, hi)
            candidate_sse(tables, key, counts, row_local.repeat_interleave(halves), total)
        best = total.argmin(-1)  # first minimum: hybrid's S wins ties
        chosen = candidates.gather(1, best.unsqueeze(-1)).squeeze(-1)
        log.debug("%s: auto candidate SSE per lossy group: %s", name, total.tolist())
    else:
        chosen = hybrid
    tables = build_tables(chosen.unsqueeze(-1), code0, code1, neighbours=1 if method == "auto" else 0)
    for lo, hi in chunks_of(lossy_list):
        _, (key, counts, mag, sign) = keys_of(lo, hi, with_counts=method == "auto")
        element, block = encode_at(tables, key, counts, mag, sign)
        out_codes[lo:hi] = pack_nibbles(element.reshape(hi - lo, layout.k))
        out_scales[lo:hi] = block.reshape(hi - lo, halves)
    return chosen
