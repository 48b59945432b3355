"""The FP4/FP8 number formats: codecs, nibble packing, ``MXFP4Tensor`` and ``NVFP4Tensor``, the E2M1 byte
tables (:mod:`~fp4pass.formats.byte_tables`) and the value rules of NVFP4 scales
(:mod:`~fp4pass.formats.scale_checks`).

One source of truth per format: the converter, the ONNX emulation subgraphs and the tests all derive from
these definitions.
"""

from fp4pass.formats.constants import (
    E2M1_MAX,
    E2M1_VALUES,
    E4M3_MAX,
    E4M3_MIN_NORMAL,
    E4M3_MIN_SUBNORMAL,
    E8M0_BIAS,
    LOSSLESS_SPREAD,
)
from fp4pass.formats.codecs import (
    decode_e2m1,
    decode_e4m3,
    decode_e8m0,
    encode_e2m1,
    encode_e4m3,
    encode_e8m0,
    pow2,
    round_e2m1,
    round_e4m3,
)
from fp4pass.formats.mxfp4 import MX_BLOCK_SIZE, MXFP4Tensor, ScaleRule, shared_exponent
from fp4pass.formats.nvfp4 import NV_BLOCK_SIZE, NVFP4Tensor, global_scale_from_amax
from fp4pass.formats.packing import pack_nibbles, unpack_nibbles
from fp4pass.formats.scale_checks import block_scale_problems, scale_value_problems

__all__ = [
    "E2M1_MAX",
    "E2M1_VALUES",
    "E4M3_MAX",
    "E4M3_MIN_NORMAL",
    "E4M3_MIN_SUBNORMAL",
    "E8M0_BIAS",
    "LOSSLESS_SPREAD",
    "MX_BLOCK_SIZE",
    "NV_BLOCK_SIZE",
    "MXFP4Tensor",
    "NVFP4Tensor",
    "ScaleRule",
    "block_scale_problems",
    "decode_e2m1",
    "decode_e4m3",
    "decode_e8m0",
    "encode_e2m1",
    "encode_e4m3",
    "encode_e8m0",
    "global_scale_from_amax",
    "pack_nibbles",
    "pow2",
    "round_e2m1",
    "round_e4m3",
    "scale_value_problems",
    "shared_exponent",
    "unpack_nibbles",
]
