"""Encoding the 16-halves of lossy groups by *pattern*: the float work once per kind of half, two passes.

A 16-half of group g holds 16 E2M1 codes c_i at MX exponent k, exact values v_i = e2m1(c_i) * 2^k. At a global
scale S and E4M3 block code s, with t = fp32(e4m3(s) * S), its reconstruction and error are those of
``halves.encode_halves`` (the float operations of ``NVFP4Tensor.quantize``/``dequantize``)::

    q_i = rne_e2m1(v_i / t),   x_hat_i = fp32(e2m1(q_i) * t),   SSE = sum_i (v_i - x_hat_i)^2   (float64)

Everything there depends on the half only through its *pattern* ``(g, k, counts)``, counts_j the number of its
16 elements of magnitude code j (0..7): its largest magnitude j_max (hence amax = e2m1(j_max) * 2^k and the
standard code s0 = e4m3(clamp(amax / (6 S), 2^-9, 448))), and SSE = sum_j counts_j * E[g, k, j_max, S, s, j]
with E the squared error of one element of magnitude j. A pattern is one int64 (``pattern_ids``)::

    id = (g_local * nk + (e8m0 - code0)) * 17^8 + sum_i 17^(c_i & 7)

Pass 1 (``collect``) computes the ids of every half (a 65536-entry table over 2-byte words) and keeps, per row
chunk, the distinct ids and each half's index among them. The search then runs on the distinct patterns only
(a few 10^5 on a gpt-oss expert stack of 10^7 halves, however many candidates): for each group and candidate
global scale S_c, total SSE = sum over patterns of multiplicity * min over codes s_i of SSE; the S of least
total wins (first minimum), then each pattern's code. Pass 2 (``encode``) writes each half: its E4M3 code and
its bytes through a 256-entry byte table of its pattern's choice (magnitude map, sign bits kept).

The statistics (SSE, max |error|, signal, verbatim halves) come out of the patterns too: no pass that
dequantizes both tensors. A half is *verbatim* at S when some E4M3 value s_v has fp32(s_v * S) == 2^k (its
nibbles kept, error 0; all-zero halves are verbatim under any S); verbatim may be disallowed (``requant``).
Values that overflow float32 (E8M0 code 254 or 253 with large magnitudes) can only stay verbatim: a pattern
that holds one and is not verbatim at S makes S infeasible (SSE inf); when nothing feasible remains, that is
an error naming the tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fp4pass.convert.layout import exact_pow2
from fp4pass.errors import NonFiniteError
from fp4pass.formats import E2M1_MAX, E2M1_VALUES, E4M3_MAX, E4M3_MIN_SUBNORMAL, decode_e4m3, encode_e2m1
from fp4pass.formats.constants import E4M3_MAX_CODE, E8M0_BIAS, E8M0_MAX_EXP, E8M0_MIN_EXP

__all__ = ["Patterns", "collect", "Choice", "choose", "encode", "COUNT_BASE"]

COUNT_BASE = 17**8  # counts_j in 0..16, eight digits base 17
E4M3_CODE_MAX = E4M3_MAX_CODE
E4M3_CODE_MIN = 0x01  # 2^-9
#: patterns per step of the search: C * I * 8 float64 each (25 * 5 * 8 * 8 B = 8 KB): about 50 MB a step
PATTERNS_PER_STEP = 1 << 12
_WORD_TABLES: dict = {}


def _word_table(device: torch.device) -> torch.Tensor:
    """int64 [65536]: for a little-endian 2-byte word (4 nibbles), sum of 17^(magnitude) over its nibbles."""
    table = _WORD_TABLES.get(device)
    if table is None:
        nib = torch.arange(16, dtype=torch.int64)
        per_nibble = 17 ** (nib & 7)
        per_byte = (per_nibble.reshape(1, 16) + per_nibble.reshape(16, 1)).reshape(256)  # byte = hi*16 + lo
        table = (per_byte.reshape(1, 256) + per_byte.reshape(256, 1)).reshape(65536).to(device)
        _WORD_TABLES[device] = table
    return table


def pattern_ids(packed: torch.Tensor, e8m0: torch.Tensor, row_local: torch.Tensor, code0: int, nk: int,
                halves_per_block: int) -> torch.Tensor:
    """Pattern id int64 [n * K/16] of each half of rows ``packed`` uint8 [n, K/2] (module docstring)."""
    n = packed.shape[0]
    words = packed.contiguous().view(torch.int16).to(torch.int32).bitwise_and_(0xFFFF)  # [n, K/4]
    counts = _word_table(packed.device)[words].reshape(n, -1, 4).sum(-1)  # [n, K/16]
    block = e8m0.to(torch.int64) - code0
    if halves_per_block > 1:
        block = block.repeat_interleave(halves_per_block, dim=-1)
    block += (row_local * nk).unsqueeze(-1)
    return (block * COUNT_BASE + counts).reshape(-1)


@dataclass
class Patterns:
    """Pass 1 over rows: the distinct patterns and where every half's pattern sits.

    ids: int64 [P] sorted distinct pattern ids; multiplicity: float64 [P]; chunks: per row chunk (lo, hi,
    index of each half's pattern in ``ids``, int32 [(hi - lo) * K/16]).
    """

    ids: torch.Tensor
    multiplicity: torch.Tensor
    chunks: list
    code0: int
    nk: int

    def decode(self):
        """(local group int64 [P], E8M0 code int64 [P], counts float64 [P, 8], j_max int64 [P])."""
        gk, rest = torch.div(self.ids, COUNT_BASE, rounding_mode="floor"), self.ids % COUNT_BASE
        local, code = torch.div(gk, self.nk, rounding_mode="floor"), gk % self.nk + self.code0
        powers = 17 ** torch.arange(8, dtype=torch.int64, device=self.ids.device)
        counts = torch.div(rest.unsqueeze(-1), powers, rounding_mode="floor") % 17
        j = torch.arange(8, device=self.ids.device)
        jmax = torch.where(counts > 0, j, torch.zeros_like(j)).amax(-1)
        return local, code, counts.double(), jmax


def collect(codes: torch.Tensor, scales: torch.Tensor, layout, chunks, row_local_of, code0: int,
            nk: int) -> Patterns:
    """Pass 1 over the row chunks ``chunks``; ``row_local_of(lo, hi)``: local group of each row, int64."""
    per_chunk = []
    for lo, hi in chunks:
        ids = pattern_ids(codes[lo:hi], scales[lo:hi], row_local_of(lo, hi), code0, nk, layout.halves_per_block)
        distinct, where, count = torch.unique(ids, return_inverse=True, return_counts=True)
        per_chunk.append((lo, hi, distinct, where.to(torch.int32), count))
    device = codes.device
    if not per_chunk:
        empty = torch.zeros(0, dtype=torch.int64, device=device)
        return Patterns(empty, empty.double(), [], code0, nk)
    ids = torch.unique(torch.cat([c[2] for c in per_chunk]))
    multiplicity = torch.zeros(ids.numel(), dtype=torch.float64, device=device)
    chunks_out = []
    for lo, hi, distinct, where, count in per_chunk:
        to_global = torch.searchsorted(ids, distinct).to(torch.int32)
        multiplicity.index_add_(0, to_global.long(), count.double())
        chunks_out.append((lo, hi, to_global[where.long()]))
    return Patterns(ids, multiplicity, chunks_out, code0, nk)


def _magnitudes(device) -> torch.Tensor:
    return torch.tensor(E2M1_VALUES[:8], dtype=torch.float32, device=device)


@dataclass
class _Tables:
    """Per kind (group, k, j_max) x candidate S x code step: see ``_tables``."""

    sse: torch.Tensor  # float64 [T, C, I, 8]
    abs_err: torch.Tensor  # float64 [T, C, I, 8]
    block_codes: torch.Tensor  # uint8 [T, C, I]
    q: torch.Tensor  # uint8 [T, C, I, 8], magnitude code of magnitude j
    verbatim: torch.Tensor  # bool [T, C]
    verbatim_codes: torch.Tensor  # uint8 [T, C]
    overflow: torch.Tensor  # bool [T]: e2m1(j_max) * 2^k is not a float32


def _tables(S: torch.Tensor, k: torch.Tensor, jmax: torch.Tensor, steps, allow_verbatim: bool) -> _Tables:
    """Error tables of kinds (k int64 [T], j_max [T]) at candidates S float32 [T, C] and code steps ``steps``.

    Formed with the float32 operations of ``encode_halves``; values v_j = e2m1(j) * 2^k that overflow float32
    (j above j_max, or a kind that overflows) are replaced by 0 before any arithmetic, and an overflowing kind
    gets SSE inf wherever it is not verbatim.
    """
    device = S.device
    T, C = S.shape
    mags = _magnitudes(device)
    pow2k = exact_pow2(k.clamp(E8M0_MIN_EXP, E8M0_MAX_EXP)).reshape(T, 1)
    v = mags.reshape(1, 8) * pow2k  # [T, 8] exact (inf where it overflows)
    amax = v.gather(1, jmax.reshape(T, 1))  # [T, 1]
    overflow = ~torch.isfinite(amax.squeeze(-1))
    present = torch.arange(8, device=device).reshape(1, 8) <= jmax.reshape(T, 1)
    v = torch.where(present & torch.isfinite(v), v, torch.zeros((), device=device))
    amax = torch.where(torch.isfinite(amax), amax, torch.zeros((), device=device))
    Sf = S.float()
    s0 = (amax / (E2M1_MAX * Sf)).clamp(E4M3_MIN_SUBNORMAL, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    codes = torch.stack([(s0.to(torch.int16) + d).clamp(E4M3_CODE_MIN, E4M3_CODE_MAX) for d in steps], -1)
    codes = codes.to(torch.uint8)  # [T, C, I]
    t = decode_e4m3(codes) * Sf.unsqueeze(-1)  # fp32(e4m3 * S)
    vv = v.reshape(T, 1, 1, 8)
    q = encode_e2m1(vv / t.unsqueeze(-1)) & 0x07
    recon = mags[q.long()] * t.unsqueeze(-1)
    err = vv.double() - recon.double()
    err = torch.where(present.reshape(T, 1, 1, 8), err, torch.zeros((), dtype=err.dtype, device=device))
    abs_err, sse = err.abs(), err.square()
    bad = overflow.reshape(T, 1, 1, 1) | ~torch.isfinite(sse)
    sse = torch.where(bad, torch.full((), float("inf"), dtype=sse.dtype, device=device), sse)
    abs_err = torch.where(bad, torch.full((), float("inf"), dtype=sse.dtype, device=device), abs_err)
    if allow_verbatim:
        target = pow2k  # [T, 1]
        s_v = (target / Sf).clamp(0, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
        exact = (decode_e4m3(s_v) * Sf == target) & (s_v != 0)
        verbatim = exact | (jmax == 0).reshape(T, 1)
        verbatim_codes = torch.where(exact, s_v, s0)
        zero = torch.zeros((), dtype=sse.dtype, device=device)
        sse = torch.where(verbatim[..., None, None], zero, sse)
        abs_err = torch.where(verbatim[..., None, None], zero, abs_err)
    else:
        verbatim = torch.zeros(T, C, dtype=torch.bool, device=device)
        verbatim_codes = s0
    return _Tables(sse, abs_err, codes, q.to(torch.uint8), verbatim, verbatim_codes, overflow)


@dataclass
class Choice:
    """The search's outcome: the global scale per local group and each pattern's encoding, with statistics.

    global_scale: float32 [L]; block_code: uint8 [P]; byte_table: uint8 [1 + T*C*I, 256] (row 0 the identity,
    then one per kind, candidate and code);
    table_row: int64 [P], the byte table of each pattern; and per local group (float64 [L]): sse, signal,
    max_abs_err, verbatim (halves whose nibbles are kept and reproduced exactly).
    """

    global_scale: torch.Tensor
    block_code: torch.Tensor
    byte_table: torch.Tensor
    table_row: torch.Tensor
    sse: torch.Tensor
    signal: torch.Tensor
    max_abs_err: torch.Tensor
    verbatim: torch.Tensor


def _byte_tables(q: torch.Tensor) -> torch.Tensor:
    """Magnitude maps uint8 [R, 8] -> byte tables uint8 [R, 256]: each nibble's magnitude mapped, sign kept."""
    b = torch.arange(256, device=q.device)
    lo, hi = b & 0x0F, b >> 4
    qi = q.to(torch.int64)
    new_lo = qi[:, lo & 7] | (lo & 8)
    new_hi = qi[:, hi & 7] | (hi & 8)
    return (new_lo | (new_hi << 4)).to(torch.uint8)


def choose(patterns: Patterns, candidates, steps, *, allow_verbatim: bool, name: str) -> Choice:
    """Pick each local group's global scale among ``candidates(amax [L]) -> S float32 [L, C]``, then each
    pattern's code among ``steps`` (offsets from s0, s0 first). Ties go to the earlier candidate and step."""
    device = patterns.ids.device
    local, code, counts, jmax = patterns.decode()
    L = int(local.max()) + 1 if local.numel() else 0
    k = code - E8M0_BIAS
    mags64 = torch.tensor(E2M1_VALUES[:8], dtype=torch.float64, device=device)
    pattern_amax = (mags64[jmax] * torch.exp2(k.double()))
    amax = torch.zeros(L, dtype=torch.float64, device=device).scatter_reduce_(0, local, pattern_amax, "amax")
    S = candidates(amax.float().clamp(max=torch.finfo(torch.float32).max))  # [L, C]
    # kinds (group, k, j_max): the tables are per kind, patterns point at theirs
    kind_id = (local * 256 + code) * 8 + jmax
    kinds, kind_of = torch.unique_consecutive(kind_id, return_inverse=True)  # ids sorted: kinds are runs
    kind_local = torch.div(kinds, 256 * 8, rounding_mode="floor")
    tab = _tables(S[kind_local], torch.div(kinds, 8, rounding_mode="floor") % 256 - E8M0_BIAS, kinds % 8, steps,
                  allow_verbatim)
    Tn, C, I, _ = tab.sse.shape
    total = torch.zeros(L, C, dtype=torch.float64, device=device)
    flat = tab.sse.permute(0, 3, 2, 1).reshape(Tn, 8, I * C)  # [T, 8, I*C], code-major: min over I per C
    # patterns are sorted by id, hence by kind: each kind is one run, and its patterns' SSE one matmul
    starts = torch.cat([torch.zeros(1, dtype=torch.long, device=device),
                        torch.bincount(kind_of, minlength=Tn).cumsum(0)]).tolist()
    mult = patterns.multiplicity
    for t in range(Tn):
        for a in range(starts[t], starts[t + 1], PATTERNS_PER_STEP * 16):
            b = min(a + PATTERNS_PER_STEP * 16, starts[t + 1])
            per = torch.mm(counts[a:b], flat[t]).reshape(b - a, I, C).amin(1)  # [n, C]
            total[kind_local[t]] += torch.mv(per.T, mult[a:b])
    # 0 * inf (a magnitude absent from a pattern, at an infeasible S) is NaN: infeasible too. Not nan_to_num,
    # whose default maps +inf to the largest float64 and so turned an infeasible S into a finite choice.
    total = torch.where(torch.isnan(total), torch.full((), float("inf"), dtype=total.dtype, device=device), total)
    best_c = total.argmin(-1)  # first minimum
    if L and not bool(torch.isfinite(total.gather(1, best_c.unsqueeze(-1))).all()):
        raise NonFiniteError(f"{name}: MXFP4 values overflow float32 (E8M0 codes >= 253 with large magnitudes): "
                             "cannot requantize them; keep them verbatim (method hybrid or auto)")
    chosen_S = S.gather(1, best_c.unsqueeze(-1)).squeeze(-1)
    # each pattern at its group's chosen S
    c_p = best_c[kind_local][kind_of]  # [P]
    kc = kind_of * C + c_p
    sse_i = torch.einsum("pij,pj->pi", tab.sse.reshape(Tn * C, I, 8)[kc], counts)  # [P, I]
    best_i = sse_i.argmin(-1)
    sse_p = sse_i.gather(1, best_i.unsqueeze(-1)).squeeze(-1)
    verbatim_p = tab.verbatim.reshape(-1)[kc]
    row = kc * I + best_i
    q = tab.q.reshape(Tn * C * I, 8)[row]  # [P, 8]
    block = torch.where(verbatim_p, tab.verbatim_codes.reshape(-1)[kc], tab.block_codes.reshape(-1)[row])
    present = counts > 0
    abs_err = tab.abs_err.reshape(Tn * C * I, 8)[row]
    err_p = torch.where(present, abs_err, torch.zeros_like(abs_err)).amax(-1)
    identity = torch.arange(8, dtype=torch.uint8, device=device)
    same = ((q == identity) | ~present).all(-1)
    exact_p = verbatim_p | (same & (sse_p == 0))
    # byte tables: row 0 identity (verbatim patterns), then one per (kind, candidate, step) in use
    table_of = torch.where(verbatim_p, torch.zeros_like(row), row + 1)
    byte_table = _byte_tables(torch.cat([identity.unsqueeze(0), tab.q.reshape(Tn * C * I, 8)]))
    v2 = (mags64.square().unsqueeze(0) * torch.exp2(2 * k.double()).unsqueeze(-1) * counts).sum(-1)
    mult = patterns.multiplicity
    sse = torch.zeros(L, dtype=torch.float64, device=device).index_add_(0, local, sse_p * mult)
    signal = torch.zeros(L, dtype=torch.float64, device=device).index_add_(0, local, v2 * mult)
    max_err = torch.zeros(L, dtype=torch.float64, device=device).scatter_reduce_(0, local, err_p, "amax")
    verbatim = torch.zeros(L, dtype=torch.float64, device=device).index_add_(0, local, exact_p.double() * mult)
    return Choice(chosen_S, block, byte_table, table_of, sse, signal, max_err, verbatim)


def encode(patterns: Patterns, choice: Choice, codes: torch.Tensor, out_codes: torch.Tensor,
           out_scales: torch.Tensor, halves_per_row: int) -> None:
    """Pass 2: write every half of the collected rows into out_codes [rows, K/2] and out_scales [rows, K/16]."""
    for lo, hi, where in patterns.chunks:
        p = where.long()
        out_scales[lo:hi] = choice.block_code[p].reshape(hi - lo, halves_per_row)
        base = (choice.table_row[p] * 256).reshape(hi - lo, halves_per_row, 1)
        packed = codes[lo:hi].reshape(hi - lo, halves_per_row, 8).long()
        out_codes[lo:hi] = choice.byte_table.reshape(-1)[base + packed].reshape(hi - lo, -1)
