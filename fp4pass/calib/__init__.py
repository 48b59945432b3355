"""Activation calibration for NVFP4, neutral to the front door: streamed statistics, calibrators (max,
percentile, headroom, mse), the compute stage (:func:`scale_for`) and SCALES.json.

The runs that feed it live beside their doors and import it: ``fp4pass.onnx.calibrate`` (onnxruntime),
``fp4pass.fx.calibration`` (torch.fx), ``fp4pass.checkpoint.calibration`` (safetensors, layer by layer).
Nothing here imports a door, so that calibrating a checkpoint never loads onnx_ir.
"""

from fp4pass.calib.calibrators import (
    CALIBRATORS,
    Calibrator,
    HeadroomCalibrator,
    MaxCalibrator,
    MSECalibrator,
    PercentileCalibrator,
    make_calibrator,
)
from fp4pass.calib.compute import scale_for
from fp4pass.calib.errors import CalibrationDataError
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
    "input_scale_from_g_amax",
    "make_calibrator",
    "scale_for",
]
