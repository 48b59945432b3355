"""Activation calibration for NVFP4: streamed statistics, calibrators (max, percentile, headroom, mse)."""
