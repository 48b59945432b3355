"""Activation calibration for NVFP4: streamed statistics, calibrators (max, percentile, headroom, mse)."""

from fp4pass.calib.calibrators import (
    CALIBRATORS,
    Calibrator,
    HeadroomCalibrator,
    MaxCalibrator,
    MSECalibrator,
    PercentileCalibrator,
    make_calibrator,
)
from fp4pass.calib.runner import CalibrationDataError, calibrate_model, calibration_targets
from fp4pass.calib.scales import ActivationScale, ActivationScales, ScalesFileError, input_scale_from_g_amax
from fp4pass.calib.stats import ActivationStats

__all__ = [
    "CALIBRATORS",
    "ActivationScale",
    "ActivationScales",
    "ActivationStats",
    "CalibrationDataError",
    "Calibrator",
    "HeadroomCalibrator",
    "MSECalibrator",
    "MaxCalibrator",
    "PercentileCalibrator",
    "ScalesFileError",
    "calibrate_model",
    "calibration_targets",
    "input_scale_from_g_amax",
    "make_calibrator",
]
