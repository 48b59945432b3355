"""How far ``auto``'s search is from the best NVFP4 encoding of a lossy group: a brute-force oracle.

Not collected by pytest (a script, minutes on CPU). Run from the repository root:

    PYTHONPATH=$PWD python tests/search_headroom.py                  # the study's lossy scenarios
    PYTHONPATH=$PWD python tests/search_headroom.py --experts 4      # and 4 gpt-oss-like lossy experts
    PYTHONPATH=$PWD python tests/search_headroom.py --per-octave 256 --refine 512

The oracle is numpy/float64 + ml_dtypes only; fp4pass is used to make the inputs (the study's scenarios,
MXFP4 quantization) and for the methods it compares against, whose SSE is measured here from their NVFP4
output (decoded independently).

For one group (one global scale S) of MXFP4 values v = e2m1(c) * 2^k, the NVFP4 decode is
x_hat_i = fp32(e2m1(q_i) * fp32(e4m3(s) * S)) per 16-half with block code s. For a fixed t = fp32(e4m3(s) * S)
the nearest E2M1 point per element (|v/t| clamped at 6) is optimal, and a half's SSE at t depends on the half
only through its exponent k and the counts of its 16 magnitudes: SSE = sum_j counts_j * err(k, j, t),
err(k, j, t) = min_q (e2m1(j) 2^k - fp32(e2m1(q) t))^2 (float64). A half kept verbatim is the case
t == 2^k, so it is one of the codes. The oracle, per group:

    best(S) = sum over halves of min over ALL 126 positive finite E4M3 codes s of SSE(half, fp32(e4m3(s) S))
    oracle  = min over S of best(S)

S runs over float32 values of 2^(k_max + x), x on a grid of ``--per-octave`` points per octave over
[-12, -4] (hybrid's S is 2^(k_max-8), requant's ~2^(k_max-8.8)), plus every 2^j / c (j integer in that range,
c an E4M3 mantissa 1..1.875: the scales at which some halves can be verbatim), plus requant's amax/2688.
``--refine N`` then re-searches N points within one grid step either side of the 5 best S: if that does
not lower the minimum, the grid is dense enough.

Besides the oracle, ``restricted(S, steps)`` evaluates one S with only auto's per-half options (verbatim where
exact, else s0 + steps): at auto's chosen S it must reproduce auto's SSE, which checks this evaluation.
"""

from __future__ import annotations

import argparse
import math
import time

import ml_dtypes
import numpy as np

E2M1_MAG = np.array([0, .5, 1, 1.5, 2, 3, 4, 6], dtype=np.float64)
E2M1 = np.concatenate([E2M1_MAG, -E2M1_MAG])
F32 = np.float32
CODES = np.arange(1, 127, dtype=np.uint8)  # positive finite E4M3: 2^-9 .. 448
CODE_VALUES = CODES.view(ml_dtypes.float8_e4m3fn).astype(np.float32)


# -- a group as patterns (k, counts of magnitudes 1..7) -------------------------------------------------------

def unpack(packed: np.ndarray) -> np.ndarray:
    """uint8 [..., B] -> element codes [..., 2B], low nibble first."""
    return np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)


class Group:
    """One group's 16-halves as distinct (k, counts_1..7) with multiplicities, and its exact values."""

    def __init__(self, packed: np.ndarray, e8m0: np.ndarray):
        codes = unpack(packed.reshape(-1, packed.shape[-1]))
        e8m0 = e8m0.reshape(codes.shape[0], -1).astype(np.int64)
        mags = (codes & 7).reshape(-1, 16)
        k_half = np.repeat(e8m0.reshape(-1) - 127, 32 // 16)
        counts = np.stack([(mags == j).sum(-1) for j in range(1, 8)], -1)
        holds = counts.any(-1)
        key = np.concatenate([k_half[holds, None], counts[holds]], -1)
        distinct, mult = np.unique(key, axis=0, return_counts=True)
        self.k = distinct[:, 0]
        self.counts = distinct[:, 1:].astype(np.float64)
        self.mult = mult.astype(np.float64)
        self.jmax = np.where(self.counts > 0, np.arange(1, 8), 0).max(-1)
        self.k_max, self.k_min = int(self.k.max()), int(self.k.min())
        self.elements = codes.size
        v = E2M1[codes].reshape(codes.shape[0], -1, 32) * np.exp2(e8m0.astype(np.float64) - 127)[..., None]
        self.values = v.reshape(-1)
        self.amax = float(np.abs(self.values).max())

    def err_table(self, S: np.ndarray) -> np.ndarray:
        """err[nS, K, 7, 126] float64 for distinct exponents ks (self.ks) at scales S float32 [nS]."""
        t = (CODE_VALUES[None, :] * S[:, None]).astype(np.float32)  # [nS, 126]
        x = (E2M1_MAG.astype(np.float32)[None, None, :] * t[..., None]).astype(np.float32).astype(np.float64)
        v = E2M1_MAG[1:][None, :] * np.exp2(self.ks.astype(np.float64))[:, None]  # [K, 7]
        out = np.empty((len(S), len(self.ks), 7, 126))
        for a in range(len(self.ks)):
            d = v[a][None, :, None, None] - x[:, None, :, :]  # [nS, 7, 126, 8]
            out[:, a] = np.square(d).min(-1)
        return out

    @property
    def ks(self):
        return np.unique(self.k)

    def best(self, S: np.ndarray, batch: int = 32, chunk_elems: int = 1 << 23) -> np.ndarray:
        """best(S) of the module docstring, float64 [nS]."""
        S = np.asarray(S, np.float32)
        out = np.zeros(len(S))
        ks = self.ks
        for a in range(0, len(S), batch):
            Sb = S[a:a + batch]
            err = self.err_table(Sb)  # [nb, K, 7, 126]
            for ki, kv in enumerate(ks):
                sel = np.nonzero(self.k == kv)[0]
                e = err[:, ki].transpose(1, 0, 2).reshape(7, -1)  # [7, nb*126]
                step = max(1, chunk_elems // e.shape[1])
                for lo in range(0, len(sel), step):
                    idx = sel[lo:lo + step]
                    per = (self.counts[idx] @ e).reshape(len(idx), len(Sb), 126).min(-1)
                    out[a:a + len(Sb)] += self.mult[idx] @ per
        return out

    def best_codes(self, S) -> tuple[float, np.ndarray, np.ndarray]:
        """At one S: (best SSE, each pattern's best code offset from s0 (int), each pattern's SSE)."""
        S = np.asarray([S], np.float32)
        err = self.err_table(S)[0]
        ks = list(self.ks)
        per = np.stack([self.counts[p] @ err[ks.index(self.k[p])] for p in range(len(self.k))])  # [P, 126]
        best = per.argmin(-1)
        amax = E2M1_MAG[self.jmax] * np.exp2(self.k.astype(np.float64))
        s0 = e4m3_code((amax / (6 * S[0].astype(np.float64))).astype(np.float32))
        offset = CODES[best].astype(np.int64) - s0.astype(np.int64)
        sse = per[np.arange(len(best)), best]
        return float(self.mult @ sse), offset, sse

    def restricted(self, S, steps=(0, -1, 1, -2, 2)) -> float:
        """SSE at S with auto's options only: verbatim where fp32(e4m3(s) S) == 2^k for some s, else the
        least-SSE code among s0 + steps (s0 = e4m3(clamp(amax/(6S), 2^-9, 448)), codes clamped to 1..126)."""
        S = F32(S)
        err = self.err_table(np.asarray([S], np.float32))[0]  # [K, 7, 126]
        ks = list(self.ks)
        amax = (E2M1_MAG[self.jmax] * np.exp2(self.k.astype(np.float64))).astype(np.float32)
        s0 = e4m3_code(np.clip((amax / (F32(6) * S)).astype(np.float32), F32(2.0**-9), F32(448))).astype(np.int64)
        t_code = (CODE_VALUES * S).astype(np.float32)
        total = 0.0
        for p in range(len(self.k)):
            e = err[ks.index(self.k[p])]
            if np.any(t_code == np.float32(2.0 ** self.k[p])):
                continue
            cand = np.clip(s0[p] + np.array(steps), 1, 126) - 1
            total += self.mult[p] * float((self.counts[p] @ e[:, cand]).min())
        return total


def e4m3_code(x: np.ndarray) -> np.ndarray:
    return np.clip(np.asarray(x, np.float32), -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def exact_scales(g: Group, lo: int = -12, hi: int = -4) -> np.ndarray:
    """S = 2^j r / c (float32) for j in k_max + [lo, hi], c an E4M3 mantissa 1..1.875 and r in 1, 3/2, 4/3: the
    scales at which some code s gives t = fp32(e4m3(s) S) = 2^k r, so that an element e2m1 * 2^k can be exact
    (ratios of E2M1 magnitudes are 2^a 3^b, b in -1, 0, 1). Near such an S the error of a large element is a
    steep parabola: the minimum over S can sit in a basin far narrower than any grid step, so these are searched
    as points of their own."""
    mant = np.array([1 + i / 8 for i in range(8)], np.float64)
    octaves = np.exp2(np.arange(g.k_max + lo, g.k_max + hi + 1, dtype=np.float64))
    return np.unique(np.concatenate([(octaves[:, None] * r / mant[None, :]).astype(np.float32).reshape(-1)
                                     for r in (1.0, 1.5, 4 / 3)]))


def grid(g: Group, per_octave: int, lo: int = -12, hi: int = -4) -> np.ndarray:
    """The S of the module docstring, float32, sorted: a log grid, ``exact_scales`` and requant's S."""
    x = g.k_max + lo + np.arange((hi - lo) * per_octave + 1) / per_octave
    dense = np.exp2(x).astype(np.float32)
    exact = exact_scales(g, lo, hi)
    requant = np.float32(max(F32(F32(g.amax) / F32(6 * 448)), F32(2.0**-140)))
    return np.unique(np.concatenate([dense, exact, [requant]]))


def oracle(g: Group, per_octave: int, refine: int, lo: int = -12, hi: int = -4) -> dict:
    """min over ``grid`` of best(S), then ``refine`` points within a grid step of the 5 best S."""
    S = grid(g, per_octave, lo, hi)
    b = g.best(S)
    i = int(b.argmin())
    out = {"S": float(S[i]), "sse": float(b[i]), "grid": len(S)}
    if refine:
        top = S[np.argsort(b)[:5]]
        fine = np.unique(np.concatenate([np.exp2(np.log2(s.astype(np.float64)) + np.linspace(-1, 1, refine) / per_octave)
                                         for s in top]).astype(np.float32))
        bf = g.best(fine)
        j = int(bf.argmin())
        out.update(refined_S=float(fine[j]), refined_sse=float(bf[j]))
    return out


# -- inputs and fp4pass's methods ------------------------------------------------------------------------------

def nv_sse(nv, values: np.ndarray) -> float:
    """SSE of an fp4pass NVFP4Tensor (one group) against exact values, decoded here: e2m1 * fp32(e4m3 * S)."""
    codes = unpack(nv.codes.numpy()).reshape(-1, 16)
    s = nv.scales.numpy().reshape(-1).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    full = (s * np.float32(nv.global_scale.reshape(-1)[0].item())).astype(np.float32)
    x = (E2M1[codes].astype(np.float32) * full[:, None]).astype(np.float32).astype(np.float64)
    return float(np.square(x.reshape(-1) - values).sum())


def methods(mx) -> dict:
    from fp4pass.convert import mxfp4_to_nvfp4

    out = {}
    for m in ("requant", "hybrid", "auto"):
        nv, stats = mxfp4_to_nvfp4(mx, m, group_dims=0)
        out[m] = nv
        out[m + "_S"] = float(stats.global_scale[0])
    return out


def study_groups():
    import torch  # noqa: F401
    from fp4pass.formats import MXFP4Tensor
    from fp4pass.study import SCENARIOS, make_tensor

    for sc in SCENARIOS:
        x = make_tensor(sc)
        mx = MXFP4Tensor.quantize(x, scale_rule="floor", name=sc.name)
        g = Group(mx.codes.numpy(), mx.scales.numpy())
        if g.k_max - g.k_min > 17:
            yield sc.name, mx, g


def expert_groups(n: int, seed: int = 0):
    """gpt-oss-like lossy experts [2880, 2880]: N(0, 0.02^2) with 1 + e outliers in expert e, of magnitudes
    5e3..2e4 (log-spaced) and random signs, so the MX exponent spread is 19..21."""
    import torch
    from fp4pass.formats import MXFP4Tensor

    torch.manual_seed(seed)
    for e in range(n):
        x = torch.randn(2880, 2880) * 0.02
        idx = torch.randint(0, x.numel(), (1 + e,))
        x.view(-1)[idx] = torch.logspace(3.7, 4.3, len(idx)) * torch.where(torch.rand(len(idx)) < .5, -1., 1.)
        mx = MXFP4Tensor.quantize(x)
        yield f"expert {e} (2880x2880, {1 + e} outliers)", mx, Group(mx.codes.numpy(), mx.scales.numpy())


def geomean(values) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--per-octave", type=int, default=128)
    ap.add_argument("--refine", type=int, default=256, help="points re-searched around the 5 best S (0: none)")
    ap.add_argument("--experts", type=int, default=0, help="also N gpt-oss-like lossy experts")
    ap.add_argument("--no-study", action="store_true")
    ap.add_argument("--lo", type=int, default=-12, help="grid from 2^(k_max + lo)")
    ap.add_argument("--hi", type=int, default=-4, help="grid to 2^(k_max + hi)")
    args = ap.parse_args(argv)
    sources = [] if args.no_study else [("study", study_groups())]
    if args.experts:
        sources.append(("experts", expert_groups(args.experts)))
    for label, groups in sources:
        rows = []
        print(f"\n{label}: MSE vs MXFP4 (per group); oracle = min over S grid, all 126 codes per half")
        print(f"{'group':<36} {'spread':>6} {'requant':>11} {'hybrid':>11} {'auto':>11} {'oracle':>11} "
              f"{'1-orc/auto':>10} {'1-@autoS':>9} {'log2 S/2^k':>10} {'1-refined':>9} {'sec':>5}")
        for name, mx, g in groups:
            t0 = time.perf_counter()
            nvs = methods(mx)
            sse = {m: nv_sse(nvs[m], g.values) for m in ("requant", "hybrid", "auto")}
            check = g.restricted(nvs["auto_S"])  # auto's options at auto's S: must equal auto
            assert math.isclose(check, sse["auto"], rel_tol=1e-6, abs_tol=1e-300), (name, check, sse["auto"])
            o = oracle(g, args.per_octave, args.refine, args.lo, args.hi)
            at_auto = g.best(np.asarray([nvs["auto_S"]], np.float32))[0]  # all codes, auto's S
            n = g.elements
            best = min(o["sse"], o.get("refined_sse", o["sse"]))
            row = dict(name=name, spread=g.k_max - g.k_min, **{m: sse[m] / n for m in sse}, oracle=best / n,
                       at_auto=at_auto / n, S=o["S"], k_max=g.k_max,
                       refined=min(1.0, o.get("refined_sse", o["sse"]) / o["sse"]) if o["sse"] else 1.0)
            rows.append(row)
            print(f"{name:<36} {row['spread']:>6} {row['requant']:>11.4e} {row['hybrid']:>11.4e} {row['auto']:>11.4e} "
                  f"{row['oracle']:>11.4e} {1 - row['oracle'] / row['auto']:>10.2e} {1 - row['at_auto'] / row['auto']:>9.2e} "
                  f"{math.log2(o['S']) - g.k_max:>10.4f} {1 - row['refined']:>9.2e} {time.perf_counter() - t0:>5.0f}",
                  flush=True)
        print(f"geomean MSE: requant {geomean([r['requant'] for r in rows]):.4e}, hybrid "
              f"{geomean([r['hybrid'] for r in rows]):.4e}, auto {geomean([r['auto'] for r in rows]):.4e}, oracle "
              f"{geomean([r['oracle'] for r in rows]):.4e}")
        print(f"geomean auto/min(requant, hybrid) "
              f"{geomean([r['auto'] / min(r['requant'], r['hybrid']) for r in rows]):.4f}, oracle/min(requant, hybrid) "
              f"{geomean([r['oracle'] / min(r['requant'], r['hybrid']) for r in rows]):.4f}, oracle/auto "
              f"{geomean([r['oracle'] / r['auto'] for r in rows]):.4f}")


if __name__ == "__main__":
    main()
