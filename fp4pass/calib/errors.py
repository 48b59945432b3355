"""The calibration's own error: data that does not fit the model, raised by every door's calibration run.

It lives here, below the three doors (``fp4pass.onnx.calibrate``, ``fp4pass.fx.calibration``,
``fp4pass.checkpoint.calibration``), so that each raises the same type (exit 2) without importing another.
"""

from __future__ import annotations

from fp4pass.errors import FP4PassError

__all__ = ["CalibrationDataError"]


class CalibrationDataError(FP4PassError):
    """Calibration data that does not fit the model: a missing input, a wrong dtype, NaN/Inf, no files."""
