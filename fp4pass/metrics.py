"""Error metrics between a reference tensor ``a`` and a candidate ``b`` (pure numpy, no ONNX, no torch).

Shared by ``fp4pass.onnx.diff`` and the fx diff. Every figure is computed over the positions where both
tensors are finite, in float64 accumulators, with e = a - b:

==============  ======================================================  ============================
key             formula                                                 unit / convention
==============  ======================================================  ============================
max_abs_err     max |e|                                                 units of the tensor
mean_abs_err    mean |e|                                                units of the tensor
rel_l2          ||e||_2 / ||a||_2                                       ratio (inf if a = 0, b != 0)
snr_db          20 log10(||a||_2 / ||e||_2)                             dB, onnxruntime qdq_loss_debug's
                                                                        SQNR; None when e = 0 (identical)
cosine          <a, b> / (||a|| ||b||)                                  1.0 when both are all zero
p99_abs_err     99th percentile of |e| (numpy's linear interpolation)   units of the tensor
nan, inf        counts of NaN and of ±Inf in ``b`` (the rewritten one)  elements
==============  ======================================================  ============================

``a_nonfinite`` (NaN+Inf in ``a``) is kept so a check can tell "new" non-finite values in ``b`` from those the
original already had. Memory: the sums run over chunks; only |e| as float32 (for the percentile) is held.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["TensorMetrics", "compare", "snr_db", "JSON_KEYS"]

JSON_KEYS = ("name", "shape", "max_abs_err", "mean_abs_err", "rel_l2", "snr_db", "cosine", "p99_abs_err", "nan", "inf")

_CHUNK = 1 << 22  # elements per float64 accumulation step (32 MiB per float64 temporary)


def snr_db(signal_energy: float, error_energy: float) -> float | None:
    """10 log10(sum x^2 / sum e^2) in dB from the two energies; None when there is no error, -inf for no signal
    or an infinite error.

    The one SNR of fp4pass: diff, conversion statistics and the calibration report all use it.
    """
    if error_energy == 0:
        return None
    if signal_energy <= 0 or math.isinf(error_energy):  # an error energy past float range: no signal left
        return -math.inf
    return 10.0 * math.log10(signal_energy / error_energy)


def _json_float(value: float | None) -> float | None:
    """JSON has no Inf/NaN: those become null (the other keys tell why, e.g. rel_l2 null with a = 0)."""
    return None if value is None or not math.isfinite(value) else float(value)


@dataclass(frozen=True)
class TensorMetrics:
    """The error figures of one tensor pair (see the module docstring for each formula)."""

    name: str
    shape: tuple[int, ...]
    max_abs_err: float
    mean_abs_err: float
    rel_l2: float
    snr_db: float | None
    cosine: float
    p99_abs_err: float
    nan: int
    inf: int
    a_nonfinite: int = 0

    @property
    def identical(self) -> bool:
        """Equal everywhere and finite: NaN is never called identical (NaN == NaN proves nothing)."""
        return self.max_abs_err == 0.0 and self.nan + self.inf == 0 and self.a_nonfinite == 0

    @property
    def new_nonfinite(self) -> bool:
        """``b`` holds more NaN/Inf than ``a``: the rewrite produced non-finite values."""
        return self.nan + self.inf > self.a_nonfinite

    def below(self, snr_min: float | None) -> bool:
        """True when the SNR is under ``snr_min`` dB, ``b`` gained NaN/Inf, or ``b`` holds NaN at all."""
        if self.new_nonfinite or self.nan:
            return True
        if snr_min is None or self.snr_db is None:
            return False
        return self.snr_db < snr_min

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "shape": list(self.shape),
            "max_abs_err": _json_float(self.max_abs_err),
            "mean_abs_err": _json_float(self.mean_abs_err),
            "rel_l2": _json_float(self.rel_l2),
            "snr_db": _json_float(self.snr_db),
            "cosine": _json_float(self.cosine),
            "p99_abs_err": _json_float(self.p99_abs_err),
            "nan": int(self.nan),
            "inf": int(self.inf),
        }


def compare(name: str, a: np.ndarray, b: np.ndarray, *, keep_errors: bool = False):
    """Metrics of candidate ``b`` against reference ``a`` (same shape; any numeric dtype).

    Returns ``TensorMetrics``, or ``(TensorMetrics, abs_err float32 1-D)`` when ``keep_errors`` is set.
    Raises ``ValueError`` when the shapes differ (callers turn that into a user-facing error).
    """
    a = np.asarray(a)
    b = np.asarray(b)
    if a.shape != b.shape:
        raise ValueError(f"{name}: shapes differ, {a.shape} vs {b.shape}")
    flat_a, flat_b = a.reshape(-1), b.reshape(-1)
    n = flat_a.size
    sum_aa = sum_bb = sum_ab = sum_ee = sum_abs = 0.0
    max_abs = 0.0
    count = nan_b = inf_b = nonfinite_a = 0
    abs_err = np.empty(n, np.float32)
    kept = 0
    for start in range(0, max(n, 1), _CHUNK):
        ca = flat_a[start : start + _CHUNK].astype(np.float64)
        cb = flat_b[start : start + _CHUNK].astype(np.float64)
        if ca.size == 0:
            break
        fin_a, fin_b = np.isfinite(ca), np.isfinite(cb)
        nan_b += int(np.isnan(cb).sum())
        inf_b += int(np.isinf(cb).sum())
        nonfinite_a += int((~fin_a).sum())
        both = fin_a & fin_b
        if not both.all():
            ca, cb = ca[both], cb[both]
        err = ca - cb
        e_abs = np.abs(err)
        sum_aa += float(ca @ ca)
        sum_bb += float(cb @ cb)
        sum_ab += float(ca @ cb)
        sum_ee += float(err @ err)
        sum_abs += float(e_abs.sum())
        if e_abs.size:
            max_abs = max(max_abs, float(e_abs.max()))
        abs_err[kept : kept + e_abs.size] = e_abs
        kept += e_abs.size
        count += e_abs.size
    abs_err = abs_err[:kept]
    norm_a, norm_e = math.sqrt(sum_aa), math.sqrt(sum_ee)
    snr = snr_db(sum_aa, sum_ee)
    rel = 0.0 if sum_ee == 0.0 else (math.inf if sum_aa == 0.0 else norm_e / norm_a)
    if sum_aa == 0.0 and sum_bb == 0.0:
        cosine = 1.0
    elif sum_aa == 0.0 or sum_bb == 0.0:
        cosine = 0.0
    else:
        cosine = sum_ab / (norm_a * math.sqrt(sum_bb))
    metrics = TensorMetrics(
        name=name,
        shape=tuple(int(d) for d in a.shape),
        max_abs_err=max_abs,
        mean_abs_err=sum_abs / count if count else 0.0,
        rel_l2=rel,
        snr_db=snr,
        cosine=cosine,
        p99_abs_err=float(np.percentile(abs_err, 99)) if kept else 0.0,
        nan=nan_b,
        inf=inf_b,
        a_nonfinite=nonfinite_a,
    )
    return (metrics, abs_err) if keep_errors else metrics
