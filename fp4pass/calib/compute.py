"""The compute stage shared by the three calibration runs: one activation's statistics -> its scale and report.

Every door (``fp4pass.onnx.calibrate``, ``fp4pass.fx.calibration``, ``fp4pass.checkpoint.calibration``)
collects :class:`~fp4pass.calib.stats.ActivationStats` its own way and ends here, so that SCALES.json and the
report mean the same numbers whichever model they came from: the calibrator's ``g_amax``, B_min / B_max, the
fractions of 16-blocks that go subnormal (below ``g_amax / 28672``) or saturate (above ``g_amax``), and the
SNR of the quantized activation on the held sample.
"""

from __future__ import annotations

from fp4pass.calib.calibrators import HeadroomCalibrator, quantization_error
from fp4pass.calib.scales import ActivationScale, input_scale_from_g_amax
from fp4pass.calib.stats import ActivationStats
from fp4pass.formats.constants import E4M3_NORMAL_WINDOW
from fp4pass.metrics import snr_db

__all__ = ["scale_for"]


def scale_for(stats: ActivationStats, method) -> ActivationScale:
    """The calibrated scale of one activation and its report fields (B_min/B_max, fractions, SNR)."""
    g_amax, note = method.compute(stats)
    bounds = method if isinstance(method, HeadroomCalibrator) else HeadroomCalibrator()
    b_min, b_max = bounds.bounds(stats)
    nonzero = stats.block_histogram.total
    subnormal = saturated = snr = None
    if nonzero and g_amax > 0:
        subnormal = stats.block_histogram.fraction_below(g_amax / E4M3_NORMAL_WINDOW)
        saturated = 0.0 if g_amax >= stats.amax_value else 1.0 - stats.block_histogram.fraction_below(g_amax)
        blocks, weights = stats.sample.weighted()
        signal, error = quantization_error(blocks, weights, g_amax)
        snr = snr_db(float(signal), float(error))
    return ActivationScale(
        amax=stats.amax_value, g_amax=float(g_amax), input_scale=input_scale_from_g_amax(g_amax),
        b_min=float(b_min or 0.0), b_max=float(b_max or 0.0), blocks=stats.blocks,
        zero_blocks=int(stats.zero_blocks), subnormal_fraction=subnormal, saturated_fraction=saturated,
        snr_db=snr, note=note)
