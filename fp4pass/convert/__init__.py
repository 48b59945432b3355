"""MXFP4 -> NVFP4 conversion: ``mxfp4_to_nvfp4(mx, method, group_dims, reference) -> (NVFP4Tensor, stats)``.

The methods and their math are in :mod:`fp4pass.convert.methods`; how tensors are cut into groups (one FP32
global scale each, per expert by default for 3-D weights) in :mod:`fp4pass.convert.layout`; the per-16-half
encoding in :mod:`fp4pass.convert.halves`; the statistics in :mod:`fp4pass.convert.stats`.

Everything runs in torch on the tensor's own device, chunked over rows (about 4M elements per chunk) so that
memory stays bounded on large expert tensors. Groups whose exponent spread is <= 17 (all of them, in most
real checkpoints) convert losslessly without unpacking a single code: the E4M3 scales come straight from the
E8M0 exponents and the packed nibbles are copied.
"""

from __future__ import annotations

import logging

import torch

from fp4pass.convert.layout import EMPTY_K, GroupLayout, exact_pow2, exponent_range
from fp4pass.convert.methods import (
    auto_candidates,
    choose_m,
    encode_rows,
    group_amax,
    select_scales,
    verbatim_scales,
)
from fp4pass.convert.stats import ConversionStats, lossless_stats, measure_stats
from fp4pass.errors import ShapeError, UsageError
from fp4pass.formats import MXFP4Tensor, NVFP4Tensor, global_scale_from_amax

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
    k_max, k_min = exponent_range(codes, scales, layout, LOSSLESS_SPREAD if method == "auto" else None)
    empty = k_max == EMPTY_K
    lossless = empty | (k_max - k_min <= LOSSLESS_SPREAD)
    # verbatim nibbles are shared with the input, never copied; methods that re-encode write a copy
    out_codes = codes if method == "verbatim" or bool(lossless.all()) and method != "requant" else codes.clone()
    halves = layout.k // 16

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
        out_scales = verbatim_scales(scales, m.repeat_interleave(layout.rows_per_group), layout.halves_per_block)
        proven_lossless = bool(lossless.all())
    else:  # hybrid and auto share the lossless path: m = k_max - 8
        m = torch.where(empty, torch.zeros_like(k_max), k_max - 8)
        global_scale = exact_pow2(m)
        out_scales = verbatim_scales(scales, m.repeat_interleave(layout.rows_per_group), layout.halves_per_block)
        lossy = (~lossless).nonzero().squeeze(-1)
        proven_lossless = lossy.numel() == 0
        if not proven_lossless:
            lossy_list = lossy.tolist()
            if method == "auto":
                amax = group_amax(codes, scales, layout, lossy_list, chunks_of(lossy_list))
                candidates = auto_candidates(k_max[lossy], amax[lossy])
                chosen, sse = select_scales(codes, scales, layout, lossy, candidates, chunks_of)
                global_scale = global_scale.clone()
                global_scale[lossy] = chosen
                log.debug("%s: auto candidate SSE per lossy group: %s", mx.name, sse.tolist())
            row_scale = global_scale.repeat_interleave(layout.rows_per_group)
            for lo, hi in chunks_of(lossy_list):
                out_codes[lo:hi], out_scales[lo:hi], _ = encode_rows(
                    codes, scales, layout, lo, hi, row_scale[lo:hi],
                    allow_verbatim=True, neighbours=1 if method == "auto" else 0)

    lead = layout.group_shape
    global_scale = global_scale.reshape(lead)
    nv = NVFP4Tensor(
        out_codes.reshape(mx.codes.shape),
        out_scales.reshape(*mx.shape[:-1], halves),
        global_scale,
        name=mx.name,
    )
    if proven_lossless and reference is None:
        stats = lossless_stats(layout.total_rows * halves, global_scale, method)
    else:
        row_scale = global_scale.reshape(-1).repeat_interleave(layout.rows_per_group)
        stats = measure_stats(codes, scales, layout.mx_block, out_codes, out_scales, row_scale,
                              reference, method, global_scale, chunks_of(all_groups))
    return nv, stats
