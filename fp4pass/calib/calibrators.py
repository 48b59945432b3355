"""Calibrators: from an activation's running statistics to its NVFP4 global amax ``g_amax``.

The activation is then quantized with ``global_scale = input_scale = g_amax / (6*448)``, so a block with amax
b gets the E4M3 block scale b * 448 / g_amax. That scale is a normal E4M3 number while
B_max <= g_amax <= 28672 * B_min (28672 = 448 / 2^-6); above g_amax blocks saturate (hard clipping), below
g_amax / 28672 they go subnormal (graceful), below g_amax / 229376 they vanish (docs/formats.md).

Each calibrator is a small class: its docstring states its math, ``compute(stats) -> (g_amax, note)``,
``needs_abs_histogram`` / ``reservoir`` say which statistics it needs collected.
"""

from __future__ import annotations

import logging
import math

import torch

from fp4pass.calib.stats import ActivationStats
from fp4pass.errors import NonFiniteError, UsageError
from fp4pass.formats import NVFP4Tensor, global_scale_from_amax
from fp4pass.formats.constants import E4M3_NORMAL_WINDOW

__all__ = ["Calibrator", "MaxCalibrator", "PercentileCalibrator", "HeadroomCalibrator", "MSECalibrator",
           "CALIBRATORS", "make_calibrator", "quantization_error", "E4M3_NORMAL_WINDOW"]

log = logging.getLogger(__name__)



def quantization_error(blocks: torch.Tensor, weights: torch.Tensor, g_amax: float) -> tuple[float, float]:
    """(signal, error): weighted sums of x^2 and (x - nvfp4(x))^2 over 16-blocks at global amax ``g_amax``.

    ``nvfp4(x)`` is ``NVFP4Tensor.quantize(x, global_scale=g_amax/(6*448)).dequantize()``, the same numbers
    the inserted activation quantizer produces.
    """
    if blocks.numel() == 0:
        return 0.0, 0.0
    global_scale = global_scale_from_amax(g_amax)
    x_hat = NVFP4Tensor.quantize(blocks, global_scale=global_scale).dequantize()
    signal = float((weights * blocks.double().square().sum(1)).sum())
    error = float((weights * (blocks - x_hat).double().square().sum(1)).sum())
    return signal, error


class Calibrator:
    """Base: ``compute(stats)`` returns (g_amax, note). Subclasses state their math."""

    name = "base"
    needs_abs_histogram = False
    reservoir = 4096  # blocks kept for the report's SNR (and the mse sweep)
    top_k = 64

    def options(self) -> dict:
        return {}

    def compute(self, stats: ActivationStats) -> tuple[float, str]:
        raise NotImplementedError


class MaxCalibrator(Calibrator):
    """``g_amax = amax``: the literal max |x| over the calibration data (within about 0.1 dB SNR of
    the MSE-optimal global scale on LLM-like activations: docs/formats.md)."""

    name = "max"

    def compute(self, stats):
        return stats.amax_value, ""


class PercentileCalibrator(Calibrator):
    """``g_amax = p-th percentile of |x|`` over every element (zeros included), from a log2 histogram of
    8192 bins (0.7% resolution, interpolated in log2). p = 100 is the literal max. p99..p99.99
    undershoot inference-time outliers (several dB SNR lost); p99.999 comes close to amax."""

    name = "percentile"
    needs_abs_histogram = True

    def __init__(self, percentile: float = 99.999):
        if not 0 < percentile <= 100:
            raise UsageError(f"percentile must be in (0, 100], got {percentile}")
        self.percentile = percentile

    def options(self):
        return {"percentile": self.percentile}

    def compute(self, stats):
        value = stats.abs_percentile(self.percentile)
        return (value or 0.0), f"p{self.percentile:g} of |x|"


class HeadroomCalibrator(Calibrator):
    """B_min-anchored headroom (ModelOpt NVFP4ActHeadroomCalibrator's recipe, docs/formats.md)::

        B_max = p_{b_max_percentile} of the per-16-block amaxes (default p99.99; 100 => the literal max)
        B_min = p_{b_min_percentile} (default p1) of the block amaxes, ignoring bins below B_max / 1e6
        g_amax = max(rho * B_min, margin * B_max)      rho in (0, 28672), default 16384; margin default 1
        if B_max / B_min > 28672 (no g_amax keeps both ends normal): warn, g_amax = margin * B_max

    It spends E4M3's normal window as headroom above B_max, so unseen outliers degrade instead of clipping.
    """

    name = "headroom"

    def __init__(self, rho: float = 16384.0, margin: float = 1.0, b_min_percentile: float = 1.0,
                 b_max_percentile: float = 99.99):
        for label, value in (("rho", rho), ("margin", margin)):
            if not math.isfinite(value):
                raise NonFiniteError(f"headroom calibrator: {label} must be finite, got {value}")
        if not 0 < rho < E4M3_NORMAL_WINDOW:
            raise UsageError(f"headroom calibrator: rho must be in (0, 28672), got {rho}")
        if margin <= 0:
            raise UsageError(f"headroom calibrator: margin must be > 0, got {margin}")
        if not 0 <= b_min_percentile < b_max_percentile <= 100:
            raise UsageError("headroom calibrator: need 0 <= b_min_percentile < b_max_percentile <= 100")
        self.rho, self.margin = rho, margin
        self.b_min_percentile, self.b_max_percentile = b_min_percentile, b_max_percentile

    def options(self):
        return {"rho": self.rho, "margin": self.margin, "b_min_percentile": self.b_min_percentile,
                "b_max_percentile": self.b_max_percentile}

    def bounds(self, stats: ActivationStats) -> tuple[float | None, float | None]:
        b_max = stats.block_percentile(self.b_max_percentile)
        if b_max is None:
            return None, None
        return stats.block_percentile(self.b_min_percentile, floor=b_max / 1e6), b_max

    def compute(self, stats):
        b_min, b_max = self.bounds(stats)
        if b_max is None:
            return 0.0, "all-zero activation"
        if b_max / b_min > E4M3_NORMAL_WINDOW:
            log.warning("activation %s: B_max/B_min = %.4g exceeds 28672; headroom falls back to B_max",
                        stats.name, b_max / b_min)
            return self.margin * b_max, f"B_max/B_min = {b_max / b_min:.4g} > 28672: used margin*B_max"
        if self.rho * b_min >= self.margin * b_max:
            return self.rho * b_min, "rho*B_min"
        return self.margin * b_max, "margin*B_max"


class MSECalibrator(Calibrator):
    """``g_amax = argmin_g sum (x - nvfp4_g(x))^2`` over the held calibration sample (the MSE oracle).

    The sample (:class:`~fp4pass.calib.stats.BlockSample`) is the top ``top_k`` blocks by amax, exactly, plus
    a uniform reservoir of ``reservoir`` blocks weighted to stand for the rest. Candidates:
    g = amax * 2^t, a coarse sweep t in [-12, 1] step 1/4, then a fine one step 1/64 within ±1/4 of the best.
    """

    name = "mse"

    def __init__(self, reservoir: int = 16384, top_k: int = 1024):
        self.reservoir, self.top_k = reservoir, top_k

    def options(self):
        return {"reservoir": self.reservoir, "top_k": self.top_k}

    def compute(self, stats):
        amax = stats.amax_value
        if amax == 0:
            return 0.0, "all-zero activation"
        blocks, weights = stats.sample.weighted()

        def sweep(offsets):
            errors = [quantization_error(blocks, weights, amax * 2.0 ** t)[1] for t in offsets]
            best = min(range(len(offsets)), key=lambda i: (errors[i], abs(offsets[i])))
            return offsets[best]

        coarse = sweep([i / 4 for i in range(-48, 5)])
        fine = sweep([coarse + i / 64 for i in range(-16, 17)])
        return amax * 2.0 ** fine, f"g_amax = amax * 2^{fine:+.4f}"


CALIBRATORS = {cls.name: cls for cls in (MaxCalibrator, PercentileCalibrator, HeadroomCalibrator, MSECalibrator)}


def make_calibrator(calibrator: "str | Calibrator" = "max", **options) -> Calibrator:
    """A calibrator by name (max, percentile, headroom, mse) with its options; an instance passes through."""
    if isinstance(calibrator, Calibrator):
        return calibrator
    if calibrator not in CALIBRATORS:
        raise UsageError(f"unknown calibrator {calibrator!r}; choose one of {', '.join(CALIBRATORS)}")
    try:
        return CALIBRATORS[calibrator](**{k: v for k, v in options.items() if v is not None})
    except TypeError as exc:
        raise UsageError(f"calibrator {calibrator!r}: {exc}") from None
