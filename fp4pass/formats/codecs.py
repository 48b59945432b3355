"""Bit-exact codecs for the three number formats of MXFP4 and NVFP4, in plain torch (any device).

Codes are ``torch.uint8`` tensors holding one code per element (E2M1 codes in the low 4 bits); values are
``torch.float32``. The conventions (docs/formats.md):

===========  ============================================  =================================================
format       layout                                        values
===========  ============================================  =================================================
E2M1         sign bit 3, 2 exponent bits, 1 mantissa bit   ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}; no Inf/NaN
E4M3FN       bias 7, 3 mantissa bits                       max 448; subnormals k·2^-9; 0x7F/0xFF NaN; no Inf
E8M0         unsigned exponent, bias 127                   2^(code-127), code 0..254; 0xFF NaN; no zero
===========  ============================================  =================================================

Encoders round to nearest, ties to even, and saturate at the largest finite magnitude (E2M1 ±6, E4M3 ±448).
NaN cannot be encoded and raises :class:`~fp4pass.errors.NonFiniteError`; so does decoding E8M0 code 255.
"""

from __future__ import annotations

import torch

from fp4pass.errors import FormatError, NonFiniteError
from fp4pass.formats.constants import (E2M1_MAX, E2M1_VALUES, E4M3_MAX, E4M3_MIN_NORMAL, E4M3_MIN_SUBNORMAL,
                                       E8M0_BIAS, E8M0_MAX_EXP, E8M0_NAN)

__all__ = [
    "E2M1_MAX",
    "E2M1_VALUES",
    "E4M3_MAX",
    "E4M3_MIN_SUBNORMAL",
    "E4M3_MIN_NORMAL",
    "E8M0_BIAS",
    "E8M0_NAN",
    "decode_e2m1",
    "encode_e2m1",
    "round_e2m1",
    "decode_e4m3",
    "encode_e4m3",
    "round_e4m3",
    "decode_e8m0",
    "encode_e8m0",
    "pow2",
    "check_finite",
    "check_no_nan",
    "check_e8m0",
]


# Round-to-nearest-even on the E2M1 magnitude grid 0, .5, 1, 1.5, 2, 3, 4, 6 is a count of thresholds
# passed. At a midpoint the tie goes to the even code (mantissa bit 0): 0.25 -> 0, 0.75 -> 1.0,
# 1.25 -> 1.0, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4. A strict ">" keeps the tie on the lower code, ">=" moves
# it up. Anything above 5 lands on 6 (saturation).
_E2M1_STRICT = (0.25, 1.25, 2.5, 5.0)
_E2M1_INCLUSIVE = (0.75, 1.75, 3.5)


def _e2m1_lut(device: torch.device) -> torch.Tensor:
    return torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)


def _first_index(mask: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(i) for i in torch.nonzero(mask)[0].tolist())


def check_no_nan(x: torch.Tensor, what: str) -> None:
    """Raise :class:`NonFiniteError` naming ``what`` and the first NaN's index, if ``x`` holds a NaN."""
    nan = torch.isnan(x)
    if bool(nan.any()):
        raise NonFiniteError(f"{what}: NaN at index {_first_index(nan)}")


def check_finite(x: torch.Tensor, what: str) -> None:
    """Raise :class:`NonFiniteError` naming ``what`` and the first NaN/Inf's index, if there is one."""
    bad = ~torch.isfinite(x)
    if bool(bad.any()):
        index = _first_index(bad)
        raise NonFiniteError(f"{what}: non-finite value {x[index].item()} at index {index}")


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, low 4 bits used) -> float32 values."""
    return _e2m1_lut(codes.device)[(codes & 0x0F).long()]


def encode_e2m1(x: torch.Tensor, *, what: str = "tensor") -> torch.Tensor:
    """float -> E2M1 codes (uint8), round to nearest even, saturating at ±6.

    The sign bit is kept for values that round to zero (-0.1 -> code 8, i.e. -0.0), as ml_dtypes does.
    ``what`` names the tensor in the error raised for NaN.
    """
    x = x.float()
    check_no_nan(x, what)
    a = x.abs()
    code = torch.zeros(a.shape, dtype=torch.uint8, device=a.device)
    for t in _E2M1_STRICT:
        code += (a > t).to(torch.uint8)
    for t in _E2M1_INCLUSIVE:
        code += (a >= t).to(torch.uint8)
    return code | (torch.signbit(x).to(torch.uint8) << 3)


def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """float -> nearest E2M1 value as float32 (RNE, saturating): ``decode_e2m1(encode_e2m1(x))``."""
    return decode_e2m1(encode_e2m1(x))


def encode_e4m3(x: torch.Tensor, *, what: str = "tensor") -> torch.Tensor:
    """float -> E4M3FN codes (uint8), round to nearest even, saturating at ±448.

    torch's own cast does the rounding (it turns out-of-range values into NaN, hence the clamp first).
    """
    x = x.float()
    check_no_nan(x, what)
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def decode_e4m3(codes: torch.Tensor) -> torch.Tensor:
    """E4M3FN codes (uint8) -> float32 (0x7F/0xFF decode to NaN, as the format defines)."""
    return codes.view(torch.float8_e4m3fn).float()


def round_e4m3(x: torch.Tensor) -> torch.Tensor:
    """float -> nearest E4M3FN value as float32 (RNE, saturating at ±448)."""
    return decode_e4m3(encode_e4m3(x))


def decode_e8m0(codes: torch.Tensor, *, what: str = "scales") -> torch.Tensor:
    """E8M0 codes (uint8) -> float32 powers of two 2^(code-127). Code 255 (NaN) raises, naming the position."""
    check_e8m0(codes, what)
    return codes.view(torch.float8_e8m0fnu).float()


def check_e8m0(codes: torch.Tensor, what: str = "scales") -> None:
    """Raise :class:`FormatError` naming ``what`` and the position of the first E8M0 code 255 (NaN)."""
    nan = codes == E8M0_NAN
    if bool(nan.any()):
        raise FormatError(f"{what}: E8M0 code 255 (NaN) at index {_first_index(nan)}")


def encode_e8m0(exponent: torch.Tensor) -> torch.Tensor:
    """Unbiased integer exponent k -> E8M0 code k+127, saturated to the finite range [2^-127, 2^127]."""
    return (exponent.to(torch.int32) + E8M0_BIAS).clamp(0, E8M0_MAX_EXP + E8M0_BIAS).to(torch.uint8)


def pow2(exponent: torch.Tensor) -> torch.Tensor:
    """Integer exponents k in [-127, 127] -> exact float32 2^k (built from the E8M0 code, never via exp2)."""
    return decode_e8m0(encode_e8m0(exponent))
