"""The numbers of the FP4/FP8 formats and of the ONNX forms, in one place (docs/formats.md has the derivations).

Every module of fp4pass takes these from here; the tests check them against ml_dtypes and onnx.
"""

from __future__ import annotations

__all__ = [
    "E2M1_MAX", "E2M1_VALUES",
    "E4M3_MAX", "E4M3_MAX_CODE", "E4M3_MIN_NORMAL", "E4M3_MIN_NORMAL_EXP", "E4M3_MIN_SUBNORMAL",
    "E4M3_MIN_SUBNORMAL_EXP", "E4M3_POW2_MIN_EXP", "E4M3_POW2_MAX_EXP", "E4M3_NORMAL_WINDOW",
    "E8M0_BIAS", "E8M0_NAN", "E8M0_MIN_EXP", "E8M0_MAX_EXP",
    "MX_BLOCK_SIZE", "NV_BLOCK_SIZE", "LOSSLESS_SPREAD", "NVFP4_AMAX_PER_GLOBAL_SCALE", "GLOBAL_SCALE_MIN",
    "FP32_MAX", "FP4_MIN_IR_VERSION", "E8M0_MIN_IR_VERSION", "ORT_MAX_IR_VERSION",
    "MS_DOMAIN", "TRT_DOMAIN", "QUARK_DOMAIN",
]

# -- E2M1 (FP4): sign, 2 exponent bits, 1 mantissa bit -------------------------------------------------------
E2M1_MAX = 6.0
#: Value of each E2M1 code 0..15 (code 8 is -0.0).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

# -- E4M3FN (FP8): bias 7, 3 mantissa bits, no Inf, 0x7F / 0xFF NaN -----------------------------------------
E4M3_MAX = 448.0
E4M3_MAX_CODE = 0x7E  # 448; 0x7F is NaN
E4M3_MIN_NORMAL_EXP = -6
E4M3_MIN_NORMAL = 2.0**E4M3_MIN_NORMAL_EXP
E4M3_MIN_SUBNORMAL_EXP = -9
E4M3_MIN_SUBNORMAL = 2.0**E4M3_MIN_SUBNORMAL_EXP
#: E4M3 holds 2^e exactly for e in [-9, 8] (subnormal 2^-9..2^-7, normal 2^-6..2^8): 18 powers of two
E4M3_POW2_MIN_EXP = E4M3_MIN_SUBNORMAL_EXP
E4M3_POW2_MAX_EXP = 8
#: g_amax / b ratio over which a block scale b * 448 / g_amax stays a normal E4M3 number: 448 / 2^-6
E4M3_NORMAL_WINDOW = E4M3_MAX / E4M3_MIN_NORMAL

# -- E8M0: unsigned exponent, scale 2^(code - 127), code 255 NaN, no zero --------------------------------------
E8M0_BIAS = 127
E8M0_NAN = 255
E8M0_MIN_EXP = -E8M0_BIAS  # code 0
E8M0_MAX_EXP = 254 - E8M0_BIAS  # code 254

# -- blocks and scales ---------------------------------------------------------------------------------------
MX_BLOCK_SIZE = 32  # MXFP4: one E8M0 scale per 32 values
NV_BLOCK_SIZE = 16  # NVFP4: one E4M3 scale per 16 values
#: a group of MX blocks converts losslessly when its E8M0 exponents span at most 17 (the E4M3 window's 18
#: powers of two, minus one)
LOSSLESS_SPREAD = E4M3_POW2_MAX_EXP - E4M3_POW2_MIN_EXP
#: NVFP4 global scale = amax / (6 * 448) = amax / 2688 (ModelOpt's scale_2, TensorRT's input_scale)
NVFP4_AMAX_PER_GLOBAL_SCALE = E2M1_MAX * E4M3_MAX
#: least global scale: its product with the least E4M3 block scale 2^-9 is still a non-zero float32 (2^-149)
GLOBAL_SCALE_MIN = 2.0**-140
FP32_MAX = 3.4028234663852886e38

# -- ONNX -----------------------------------------------------------------------------------------------------
FP4_MIN_IR_VERSION = 11  # FLOAT4E2M1
E8M0_MIN_IR_VERSION = 12  # FLOAT8E8M0
ORT_MAX_IR_VERSION = 13  # the newest IR onnxruntime 1.31 loads
MS_DOMAIN = "com.microsoft"  # onnxruntime's contrib ops (QMoE, GatherBlockQuantized, MoE)
TRT_DOMAIN = "trt"  # TensorRT's importer ops (TRT_FP4DynamicQuantize)
QUARK_DOMAIN = "com.amd.quark"  # AMD Quark's custom ops (MXQuantizeDequantize)
