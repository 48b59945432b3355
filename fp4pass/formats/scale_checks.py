"""The value rules of NVFP4 scales, stated once for every validator (ONNX models and checkpoints).

An NVFP4 weight dequantizes as ``e2m1(code) * e4m3(block scale) * global scale`` (``input_scale`` likewise for an
activation), so one bad scale breaks every value it multiplies:

- a float scale (global scale, alpha, input scale): ``nonfinite_scale`` (NaN or +-inf: every value NaN),
  ``zero_scale`` (every value 0, or inf where an engine inverts it), ``negative_scale`` (finite and < 0: every
  value's sign flipped), checked in that order;
- an E4M3FN block-scale byte: ``nonfinite_scale`` when its magnitude bits are 0x7F (0x7F and 0xFF are E4M3FN's
  NaN; it has no inf), ``negative_scale`` when the sign bit is set on a magnitude that is neither 0 (``-0`` is
  zero) nor NaN.

Each function returns ``(kind, mask)`` pairs, the masks shaped like the input: the caller words the message (which
tensor, which convention, which engine) and counts or locates the bad entries.
"""

from __future__ import annotations

import numpy as np

from fp4pass.formats.constants import E4M3_MAX_CODE

__all__ = ["scale_value_problems", "block_scale_problems", "E4M3_NAN_MAGNITUDE", "E4M3_SIGN"]

E4M3_NAN_MAGNITUDE = E4M3_MAX_CODE + 1  # 0x7F: E4M3FN's NaN magnitude, and the magnitude mask
E4M3_SIGN = 0x80


def scale_value_problems(values: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """``[(kind, mask)]`` of float scale values: non-finite, zero, negative (module docstring)."""
    values = np.asarray(values)
    finite = np.isfinite(values)
    return [("nonfinite_scale", ~finite), ("zero_scale", values == 0), ("negative_scale", finite & (values < 0))]


def block_scale_problems(codes: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """``[(kind, mask)]`` of E4M3FN block-scale bytes (uint8): NaN codes, then negative ones (module docstring)."""
    codes = np.asarray(codes)
    magnitude = codes & E4M3_NAN_MAGNITUDE
    nan = magnitude == E4M3_NAN_MAGNITUDE
    return [("nonfinite_scale", nan), ("negative_scale", (codes >= E4M3_SIGN) & (magnitude != 0) & ~nan)]
