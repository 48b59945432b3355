"""MXFP4 -> NVFP4 conversion: ``mxfp4_to_nvfp4(mx, method, group_dims, reference) -> (NVFP4Tensor, stats)``.

The methods and their math are in :mod:`fp4pass.convert.methods`; how tensors are cut into groups (one FP32
global scale each, per expert by default for 3-D weights) in :mod:`fp4pass.convert.layout`; the encoding of
16-halves, grouped by their pattern, in :mod:`fp4pass.convert.patterns`; the statistics in
:mod:`fp4pass.convert.stats`.

Everything runs in torch on the tensor's own device, chunked over rows (about 4M elements per chunk) so that
memory stays bounded on large expert tensors. Groups whose exponent spread is <= 17 (all of them, in most
real checkpoints) convert losslessly without unpacking a single code: one min/max pass over the E8M0 scales
(which also refuses code 255), the E4M3 scales by integer arithmetic on the E8M0 codes, and the packed
nibbles shared with the input (not copied). On CPU those integer steps run in numpy (``layout.on_host``).
requant, and hybrid and auto on lossy groups, encode by pattern (:mod:`fp4pass.convert.patterns`): one pass
collects the distinct 16-half patterns (group, exponent, magnitude counts), the search and the float work run
once per pattern, a second pass writes every half through a byte table; the statistics come from the
patterns (no dequantizing pass), except with ``reference`` (a pass against the reference tensor).

Every group converts as it would alone (``group_dims=0`` on that group): with ``auto``, a tensor whose groups
are partly within the lossless spread and partly not is converted apart (``_convert_apart``), the former on
the scale-only path, the latter searched together. ``stats.groups`` holds the figures per group wherever the
conversion has them without measuring again; the ONNX pass, the fx pass and the checkpoint engine report them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import math
from concurrent.futures import ThreadPoolExecutor

import torch

from fp4pass.convert.lossless import lossless_range
from fp4pass.convert.layout import EMPTY_K, GroupLayout, exact_pow2, exact_pow2_list, exponent_range, scale_code_range
from fp4pass.convert import patterns as pattern_mod
from fp4pass.convert.methods import AUTO_STEPS, auto_candidates, choose_m, pow2_scale_codes
from fp4pass.convert.stats import ConversionStats, lossless_stats, measure_stats, signal_energy
from fp4pass.choices import Effort, Method, MRule, values
from fp4pass.errors import ShapeError, UsageError
from fp4pass.formats import MXFP4Tensor, NVFP4Tensor, global_scale_from_amax
from fp4pass.formats.constants import E4M3_POW2_MAX_EXP, E8M0_BIAS, LOSSLESS_SPREAD
from fp4pass.metrics import snr_db

__all__ = ["mxfp4_to_nvfp4", "ConversionStats", "METHODS", "M_RULES", "EFFORTS", "LOSSLESS_SPREAD",
           "lossless_range", "DEFAULT_EFFORT", "DEFAULT_THREADS", "intra_op_threads", "max_threads", "check_threads"]

log = logging.getLogger(__name__)

METHODS = values(Method)
M_RULES = values(MRule)
EFFORTS = values(Effort)
DEFAULT_EFFORT = "best"
#: torch intra-op threads during a conversion. One measured fastest on a 2-core machine shared with other
#: work (the ops are short and memory-bound; a second thread mostly waits at barriers).
DEFAULT_THREADS = 1
#: E4M3 holds the 18 exact powers of two 2^-9..2^8, so 18 consecutive exponents (spread 17) fit verbatim.
CHUNK_ELEMENTS = 1 << 22


def mxfp4_to_nvfp4(
    mx: MXFP4Tensor,
    method: str = "auto",
    group_dims: int | None = None,
    reference: torch.Tensor | None = None,
    *,
    m_rule: str = "search",
    chunk_elements: int = CHUNK_ELEMENTS,
    effort: str = DEFAULT_EFFORT,
    threads: int | None = DEFAULT_THREADS,
) -> tuple[NVFP4Tensor, ConversionStats]:
    """Convert ``mx`` to NVFP4 with ``method`` (requant | verbatim | hybrid | auto; see ``methods``).

    ``group_dims``: leading dims that get their own global scale (None: 1 for 3-D tensors, i.e. per expert,
    else 0). ``reference``: the original high-precision tensor, for ``stats.mse_vs_reference``.
    ``m_rule`` (verbatim only): "midpoint" or "search". ``effort`` (auto only): "best" (the wide search)
    or "fast" (the narrow one); see ``methods``. ``threads``: torch intra-op threads during the call
    (restored afterwards; None leaves the caller's). Both are arguments of every call that converts (the ONNX
    pipeline, the fx pass, checkpoints), never process-wide settings. On CPU, a tensor whose lossless groups sit
    beside a lossy one copies their nibbles and sums their signal (table lookups) on one helper thread while the
    search runs (``_convert_apart``). Returns the NVFP4 tensor (global scale
    of shape ``shape[:group_dims]``, a dequant multiplier) and its :class:`ConversionStats`.
    """
    if effort not in EFFORTS:
        raise UsageError(f"{mx.name}: unknown effort {effort!r}; choose one of {', '.join(EFFORTS)}")
    if threads is not None and threads < 1:
        raise UsageError(f"{mx.name}: threads must be >= 1, got {threads}")
    if threads is not None:
        check_threads(threads, "threads")
    with intra_op_threads(threads):
        return _convert(mx, method, group_dims, reference, m_rule, chunk_elements, effort)


#: the most intra-op threads whatever the machine: far past where more threads stop helping
THREADS_CEILING = 1024


def max_threads() -> int:
    """The most torch intra-op threads a conversion may ask for: 4 per CPU this process may run on (more only
    wait for a core; OpenMP fails, or crashes, when the system refuses one of them), at most
    :data:`THREADS_CEILING`, and at most half of the processes and threads this user may start
    (``RLIMIT_NPROC``: the other half for what already runs)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    cap = min(THREADS_CEILING, 4 * max(cpus, 1))
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NPROC)
        if soft != resource.RLIM_INFINITY and soft > 0:
            cap = min(cap, max(1, soft // 2))
    except (ImportError, AttributeError, OSError, ValueError):
        pass
    return max(1, cap)


def check_threads(threads: int, flag: str = "--threads") -> int:
    """``threads`` when it is between 1 and :func:`max_threads`; else :class:`UsageError` naming ``flag``."""
    cap = max_threads()
    if type(threads) is not int or not 1 <= threads <= cap:
        raise UsageError(f"{flag} {threads!r}: give a whole number from 1 to {cap} (4 per CPU this process may "
                         f"use; more threads only wait, and the system may refuse to start them)")
    return threads


@contextlib.contextmanager
def intra_op_threads(threads: int | None):
    """Set torch's intra-op thread count for the block (None: leave it), and restore it afterwards."""
    before = torch.get_num_threads()  # "None: leave it" for callers that manage threads themselves
    if threads is not None and threads != before:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def _convert(mx, method, group_dims, reference, m_rule, chunk_elements, effort):
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
    if method == "auto" and reference is None and layout.groups > 1:
        near = [lossless_range(lo, hi) for lo, hi in zip(code_lo, code_hi)]
        if any(near) and not all(near):
            return _convert_apart(mx, layout, near, code_lo, code_hi, m_rule, chunk_elements, effort)
    # auto only: hybrid's m is defined by the blocks that hold a value (seed Algo 3), which needs the codes
    fast_lossless = method == "auto" and all(lossless_range(lo, hi) for lo, hi in zip(code_lo, code_hi))
    if fast_lossless:
        # Every block (holding a value or not) is within 17 octaves of its group's top: m = k_max - 8 puts
        # them all in E4M3's exact window, nibbles shared with the input, scales straight from exponents.
        m = [u - E8M0_BIAS - E4M3_POW2_MAX_EXP for u in code_hi]
        if min(m) < -126:
            # a float32-subnormal global scale (reciprocal inf): only right for a group that holds values;
            # an all-zero group (MX producers write E8M0 code 0 there) gets 1.0, as in every other method
            k_max_held, _ = exponent_range(codes, scales, layout)
            m = [0 if k == EMPTY_K else g for g, k in zip(m, k_max_held.tolist())]
        global_scale = exact_pow2_list(m, device)
        out_codes = codes
        out_scales = pow2_scale_codes(scales, layout, m, code_lo, code_hi)
        proven_lossless = True
    elif method != "requant":
        k_max, k_min = exponent_range(codes, scales, layout)
        empty = k_max == EMPTY_K
        lossless = empty | lossless_range(k_min, k_max)
        # verbatim nibbles are shared with the input, never copied; methods that re-encode write a copy
        out_codes = codes if method == "verbatim" or bool(lossless.all()) else codes.clone()
    else:
        out_codes = codes.clone()

    if method == "requant":
        global_scale = torch.empty(layout.groups, dtype=torch.float32, device=device)
        out_scales = torch.empty(layout.total_rows, halves, dtype=torch.uint8, device=device)
        engine = _encode_lossy(codes, scales, layout, torch.arange(layout.groups, device=device), None, code_lo,
                               code_hi, out_codes, out_scales, method, chunks_of, mx.name, effort)
        global_scale[:] = engine.global_scale
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
            engine = _encode_lossy(codes, scales, layout, lossy, k_max, code_lo, code_hi, out_codes, out_scales,
                                   method, chunks_of, mx.name, effort)
            global_scale[lossy] = engine.global_scale

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
        stats.groups = [lossless_stats(layout.rows_per_group * halves, [g], method) for g in scale_list]
    elif reference is None and method != "verbatim":  # the statistics come out of the pattern search
        stats = _engine_stats(engine, codes, scales, layout, lossy if method != "requant" else None, method,
                              global_scale, chunks_of)
    else:
        row_scale = global_scale.reshape(-1).repeat_interleave(layout.rows_per_group)
        stats = measure_stats(codes, scales, layout.mx_block, out_codes, out_scales, row_scale,
                              reference, method, global_scale, chunks_of(all_groups))
    return nv, stats


def _encode_lossy(codes, scales, layout: GroupLayout, lossy: torch.Tensor, k_max, code_lo, code_hi, out_codes,
                  out_scales, method: str, chunks_of, name: str, effort: str) -> pattern_mod.Choice:
    """requant/hybrid/auto on the groups ``lossy`` [L] by pattern (:mod:`fp4pass.convert.patterns`).

    Writes their rows of out_codes/out_scales; returns the search's :class:`~fp4pass.convert.patterns.Choice`
    (global scale per lossy group, statistics). requant: S = amax/(6*448), every half at s0, no verbatim.
    hybrid: S = 2^(k_max - 8), halves verbatim where exact, else s0. auto: ``methods.auto_candidates``.
    """
    lossy_list = lossy.tolist()
    device = codes.device
    code0 = min(code_lo[g] for g in lossy_list)
    code1 = max(code_hi[g] for g in lossy_list)
    local = torch.full((layout.groups,), -1, dtype=torch.long, device=device)
    local[lossy] = torch.arange(lossy.numel(), device=device)

    def row_local_of(lo, hi):
        return local[torch.arange(lo, hi, device=device) // layout.rows_per_group]

    found = pattern_mod.collect(codes, scales, layout, chunks_of(lossy_list), row_local_of, code0,
                                code1 - code0 + 1)
    if method == "requant":
        candidates, steps = (lambda amax: global_scale_from_amax(amax).unsqueeze(-1)), (0,)
    elif method == "hybrid":
        hybrid = exact_pow2(k_max[lossy] - 8).unsqueeze(-1)
        candidates, steps = (lambda amax: hybrid), (0,)
    else:
        k_top = k_max[lossy]
        candidates, steps = (lambda amax: auto_candidates(k_top, amax, effort)), AUTO_STEPS[effort]
    choice = pattern_mod.choose(found, candidates, steps, allow_verbatim=method != "requant", name=name)
    pattern_mod.encode(found, choice, codes, out_codes, out_scales, layout.k // 16)
    log.debug("%s: %s global scales of the lossy groups: %s", name, method, choice.global_scale.tolist())
    return choice


def _engine_stats(choice: pattern_mod.Choice, codes, scales, layout: GroupLayout, lossy, method: str,
                  global_scale, chunks_of) -> ConversionStats:
    """Statistics from the pattern search, tensor-wide and per group; groups not searched (lossless, ``lossy``
    given) add their signal (``signal_energy``: from the codes, no dequantization)."""
    rows_halves = layout.rows_per_group * (layout.k // 16)
    halves = layout.total_rows * (layout.k // 16)
    sse, signal = float(choice.sse.sum()), float(choice.signal.sum())
    verbatim = int(round(float(choice.verbatim.sum())))
    max_err = float(choice.max_abs_err.max()) if choice.max_abs_err.numel() else 0.0
    scale_list = global_scale.flatten().tolist()
    searched = list(range(layout.groups)) if lossy is None else lossy.tolist()
    groups: list = [None] * layout.groups
    g_sse, g_signal = choice.sse.tolist(), choice.signal.tolist()
    g_err, g_verbatim = choice.max_abs_err.tolist(), choice.verbatim.tolist()
    for local, g in enumerate(searched):
        n = rows_halves * 16
        kept = int(round(g_verbatim[local]))
        groups[g] = ConversionStats(rows_halves, kept, rows_halves - kept, [scale_list[g]],
                                    g_sse[local] / n if n else 0.0, g_err[local], snr_db(g_signal[local], g_sse[local]),
                                    method, extra={"sse": g_sse[local], "signal": g_signal[local]})
    rest = [g for g in range(layout.groups) if groups[g] is None]
    if rest:
        signal += signal_energy(codes, scales, layout.mx_block, chunks_of(rest))
        verbatim += len(rest) * rows_halves
        for g in rest:
            groups[g] = lossless_stats(rows_halves, [scale_list[g]], method)
    n = halves * 16
    return ConversionStats(halves, verbatim, halves - verbatim, scale_list, sse / n if n else 0.0, max_err,
                           snr_db(signal, sse), method, extra={"sse": sse, "signal": signal}, groups=groups)


def _convert_apart(mx: MXFP4Tensor, layout: GroupLayout, near: list[bool], code_lo, code_hi, m_rule, chunk_elements,
                   effort) -> tuple[NVFP4Tensor, ConversionStats]:
    """``auto`` on a tensor of several groups, some of them (``near``) with all their E8M0 codes within 17: each
    group converts as it would alone (``group_dims=0`` on that group), so that a lossy group never takes its
    lossless neighbours off the scale-only path.

    The ``near`` groups get m = k_max - 8 from their E8M0 codes, their block scales by integer arithmetic and
    their nibbles as they are (none is re-encoded); the others go through the search together (their codes
    copied out: a few groups as a rule). When some group is lossy, the output needs its own codes (a copy of
    the input's, the re-encoded groups written over it) and the tensor's SNR needs the signal of the ``near``
    groups (``signal_energy``, from their codes): on CPU these two memory passes run on one helper thread
    while the search runs, since neither depends on it.
    """
    groups, rows, halves = layout.groups, layout.rows_per_group, layout.k // 16
    codes, scales = layout.flat(mx)
    codes3 = codes.reshape(groups, rows, -1)
    scales3 = scales.reshape(groups, rows, -1)
    device = codes.device
    out_scales = torch.empty(groups, rows, halves, dtype=torch.uint8, device=device)
    global_scale = torch.empty(groups, dtype=torch.float32, device=device)
    per_group: list = [None] * groups
    m = {g: code_hi[g] - E8M0_BIAS - E4M3_POW2_MAX_EXP for g in range(groups) if near[g]}
    fast = [g for g in m if m[g] >= -126]
    tiny = [g for g in m if m[g] < -126]  # a subnormal 2^m: whether the group holds a value reads its codes
    searched = [g for g in range(groups) if not near[g]]
    searched_index = torch.tensor(searched, device=device)
    searched_codes = codes3.index_select(0, searched_index)
    searched_scales = scales3.index_select(0, searched_index)
    # lossy unless every searched group's blocks that hold a value lie within 17 octaves (then nothing is
    # re-encoded and the codes stay shared)
    searched_layout = GroupLayout(torch.Size((len(searched), rows, layout.k)), 1, len(searched), rows, layout.k,
                                  layout.mx_block, mx.name)
    k_max, k_min = exponent_range(*searched_layout.flat(MXFP4Tensor(searched_codes, searched_scales, layout.mx_block)),
                                  searched_layout)
    lossy = bool(((k_max != EMPTY_K) & ~lossless_range(k_min, k_max)).any())

    def lossless_side() -> tuple[torch.Tensor | None, float]:
        """The near groups' scales and global scales; for a lossy tensor, the output's codes and their signal."""
        if fast:
            index = torch.tensor(fast, device=device)
            sub = GroupLayout(torch.Size((len(fast), rows, layout.k)), 1, len(fast), rows, layout.k, layout.mx_block,
                              mx.name)
            part = scales3.index_select(0, index).reshape(len(fast) * rows, -1)
            ms = [m[g] for g in fast]
            remapped = pow2_scale_codes(part, sub, ms, [code_lo[g] for g in fast], [code_hi[g] for g in fast])
            out_scales.index_copy_(0, index, remapped.reshape(len(fast), rows, halves))
            global_scale.index_copy_(0, index, exact_pow2_list(ms, device))
            for g, e in zip(fast, ms):
                per_group[g] = lossless_stats(rows * halves, [math.ldexp(1.0, e)], "auto")
        if not lossy:
            return None, 0.0
        return codes.clone(), signal_energy(codes, scales, layout.mx_block, layout.row_chunks(fast, chunk_elements))

    def search() -> list:
        """The groups out of reach together (as in one call, group by group), each tiny one on its own."""
        changed = []
        runs = [(searched, searched_index, searched_codes, searched_scales)]
        for g in tiny:
            index = torch.tensor([g], device=device)
            runs.append(([g], index, codes3.index_select(0, index), scales3.index_select(0, index)))
        for run, index, sub_codes, sub_scales in runs:
            sub = MXFP4Tensor(sub_codes, sub_scales, layout.mx_block, name=mx.name)
            nv, sub_stats = _convert(sub, "auto", 1 if len(run) > 1 else 0, None, m_rule, chunk_elements, effort)
            out_scales.index_copy_(0, index, nv.scales.reshape(len(run), rows, halves))
            global_scale.index_copy_(0, index, nv.global_scale.reshape(-1))
            for g, st in zip(run, sub_stats.groups if len(run) > 1 else [sub_stats]):
                per_group[g] = st
            if nv.codes.data_ptr() != sub_codes.data_ptr():
                changed.append((index, nv.codes.reshape(len(run), rows, -1)))
        return changed

    if lossy and device.type == "cpu":
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="fp4pass-lossless-groups") as pool:
            side = pool.submit(lossless_side)
            try:
                changed = search()
            finally:
                out_codes, fast_signal = side.result()
    else:
        changed = search()
        out_codes, fast_signal = lossless_side()
    if changed:
        if out_codes is None:
            out_codes = codes.clone()
        for index, new in changed:
            out_codes.reshape(groups, rows, -1).index_copy_(0, index, new)
    else:
        out_codes = codes  # every group kept its nibbles: shared with the input, as on the lossless path
    nv = NVFP4Tensor(out_codes.reshape(mx.codes.shape), out_scales.reshape(*mx.shape[:-1], halves),
                     global_scale.reshape(layout.group_shape), name=mx.name)
    scale_list = global_scale.tolist()
    total = groups * rows * halves
    requantized = sum(st.blocks16_requantized for st in per_group)
    sse = sum(st.extra.get("sse", 0.0) for st in per_group)
    if requantized == 0 and sse == 0:
        stats = lossless_stats(total, scale_list, "auto")
    else:
        if not lossy:  # searched, yet not foreseen: the near groups' signal was not summed alongside
            fast_signal = signal_energy(codes, scales, layout.mx_block, layout.row_chunks(fast, chunk_elements))
        signal = fast_signal + sum(st.extra.get("signal", 0.0) for st in per_group)
        quiet = [g for g in range(groups) if g not in fast and "signal" not in per_group[g].extra]
        signal += signal_energy(codes, scales, layout.mx_block, layout.row_chunks(quiet, chunk_elements))
        n = total * 16
        stats = ConversionStats(total, total - requantized, requantized, scale_list, sse / n,
                                max(st.max_abs_err for st in per_group), snr_db(signal, sse), "auto",
                                extra={"sse": sse, "signal": signal})
    stats.groups = per_group
    return nv, stats
