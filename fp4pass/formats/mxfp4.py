"""MXFP4 (OCP Microscaling v1.0): E2M1 values, one E8M0 power-of-two scale per block of 32.

A block of 32 consecutive values along the last axis shares the scale X = 2^k, k = code - 127::

    x_hat[i] = e2m1(code[i]) * 2^k

How k is chosen from the block's largest magnitude ``amax`` differs between producers; every rule below is
accepted on input (the converter takes any valid E8M0 code) and can be chosen on output (docs/formats.md):

=======  ===========================  =======================================
rule     k                            used by
=======  ===========================  =======================================
FLOOR    floor(log2(amax)) - 2        OCP spec, torchao default
CEIL     ceil(log2(amax)) - 2         torchao CEIL
EVEN     floor(log2(round1(amax))) - 2  torchao EVEN (amax rounded to 1 mantissa bit, half up)
RCEIL    ceil(log2(amax / 6))         torchao RCEIL, ModelOpt, NVIDIA hardware
=======  ===========================  =======================================

Values are then rounded to nearest even on the E2M1 grid and saturated at ±6 (FLOOR and EVEN can put the
block maximum up to 8·2^k, which saturates; CEIL and RCEIL never saturate). An all-zero block gets k = -127.
All exponents are found from the float32 bits (frexp), never from a rounded log2.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from fp4pass.errors import ShapeError
from fp4pass.formats.codecs import (
    check_e8m0,
    check_finite,
    decode_e2m1,
    decode_e8m0,
    encode_e2m1,
    encode_e8m0,
    pow2,
)
from fp4pass.formats.constants import E8M0_BIAS, E8M0_MAX_EXP, E8M0_MIN_EXP, MX_BLOCK_SIZE
from fp4pass.formats.packing import pack_nibbles, unpack_nibbles

__all__ = ["ScaleRule", "MXFP4Tensor", "MX_BLOCK_SIZE"]

_E2M1_EMAX = 2  # exponent of E2M1's largest power of two (4 = 2^2)


class ScaleRule(str, enum.Enum):
    """How an MX block's power-of-two scale is derived from the block's amax (see the module table)."""

    FLOOR = "floor"
    CEIL = "ceil"
    EVEN = "even"
    RCEIL = "rceil"


def shared_exponent(amax: torch.Tensor, rule: ScaleRule | str = ScaleRule.FLOOR) -> torch.Tensor:
    """Block amax (float32, >= 0) -> unbiased E8M0 exponent k (int32) under ``rule``, clamped to [-127, 127].

    With amax = m·2^f, m in [1, 2): FLOOR k = f-2; CEIL adds 1 when m > 1; EVEN when m >= 1.75;
    RCEIL (smallest k with 6·2^k >= amax) when m > 1.5.
    """
    rule = ScaleRule(rule)
    mantissa, exponent = torch.frexp(amax.float())  # amax = mantissa * 2^exponent, mantissa in [0.5, 1)
    m = 2 * mantissa
    k = exponent.to(torch.int32) - 1 - _E2M1_EMAX
    if rule is ScaleRule.CEIL:
        k = k + (m > 1).to(torch.int32)
    elif rule is ScaleRule.EVEN:
        k = k + (m >= 1.75).to(torch.int32)
    elif rule is ScaleRule.RCEIL:
        k = k + (m > 1.5).to(torch.int32)
    k = torch.where(amax > 0, k, torch.full_like(k, E8M0_MIN_EXP))
    return k.clamp(E8M0_MIN_EXP, E8M0_MAX_EXP)


@dataclass(frozen=True)
class MXFP4Tensor:
    """An MXFP4 tensor of logical shape [..., K].

    Attributes:
        codes: uint8 [..., K/2], two E2M1 codes per byte, low nibble first.
        scales: uint8 [..., K/block_size], E8M0 codes (scale = 2^(code-127), a multiplier on dequant).
        block_size: elements per scale along the last axis (32 in MXFP4).
        name: what error messages call this tensor.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    block_size: int = MX_BLOCK_SIZE
    name: str = "mxfp4"

    @classmethod
    def from_codes(
        cls, codes: torch.Tensor, scales: torch.Tensor, block_size: int = MX_BLOCK_SIZE, *, name: str = "mxfp4"
    ) -> "MXFP4Tensor":
        """Wrap existing bytes after checking dtypes, shapes and that no scale is E8M0 NaN (code 255)."""
        codes, scales = torch.as_tensor(codes), torch.as_tensor(scales)
        if codes.dtype != torch.uint8 or scales.dtype != torch.uint8:
            raise ShapeError(f"{name}: codes and scales must be uint8, got {codes.dtype} and {scales.dtype}")
        if codes.dim() == 0 or codes.shape[:-1] != scales.shape[:-1]:
            raise ShapeError(f"{name}: codes {tuple(codes.shape)} and scales {tuple(scales.shape)} differ in leading dims")
        k = codes.shape[-1] * 2
        if k != scales.shape[-1] * block_size:
            raise ShapeError(
                f"{name}: K={k} from codes {tuple(codes.shape)} does not match {scales.shape[-1]} scales "
                f"x block {block_size}"
            )
        check_e8m0(scales, f"{name} scales")
        return cls(codes, scales, block_size, name)

    @classmethod
    def from_gpt_oss(cls, blocks: torch.Tensor, scales: torch.Tensor, *, name: str = "mxfp4") -> "MXFP4Tensor":
        """gpt-oss checkpoint layout: blocks uint8 [..., K/32, 16], scales uint8 [..., K/32]."""
        if blocks.dim() < 2 or blocks.shape[-1] != MX_BLOCK_SIZE // 2:
            raise ShapeError(f"{name}: gpt-oss blocks must be [..., K/32, 16], got {tuple(blocks.shape)}")
        return cls.from_codes(blocks.reshape(*blocks.shape[:-2], -1), scales, MX_BLOCK_SIZE, name=name)

    @classmethod
    def quantize(
        cls,
        x: torch.Tensor,
        block_size: int = MX_BLOCK_SIZE,
        scale_rule: ScaleRule | str = ScaleRule.FLOOR,
        *,
        name: str = "mxfp4",
    ) -> "MXFP4Tensor":
        """Quantize float ``x`` [..., K] (K a multiple of ``block_size``) with the given scale rule."""
        x = torch.as_tensor(x).float()
        check_finite(x, name)
        if x.dim() == 0 or x.shape[-1] % block_size:
            raise ShapeError(f"{name}: last dim of {tuple(x.shape)} is not a multiple of block {block_size}")
        blocks = x.reshape(*x.shape[:-1], -1, block_size)
        k = shared_exponent(blocks.abs().amax(-1), scale_rule)
        codes = encode_e2m1(blocks * pow2(-k).unsqueeze(-1), what=name)
        return cls(pack_nibbles(codes.reshape(x.shape)), encode_e8m0(k), block_size, name)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.codes.shape[:-1], self.codes.shape[-1] * 2))

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def exponents(self) -> torch.Tensor:
        """Unbiased scale exponents k = code - 127 (int32), shape [..., K/block_size]."""
        return self.scales.to(torch.int32) - E8M0_BIAS

    def element_codes(self) -> torch.Tensor:
        """E2M1 codes unpacked to one per byte, [..., K]."""
        return unpack_nibbles(self.codes)

    def dequantize(self) -> torch.Tensor:
        """float32 [..., K]: e2m1(code) * 2^(scale-127), exact."""
        values = decode_e2m1(self.element_codes()).reshape(*self.scales.shape, self.block_size)
        scale = decode_e8m0(self.scales, what=f"{self.name} scales")
        return (values * scale.unsqueeze(-1)).reshape(self.shape)

    def to(self, device: torch.device | str) -> "MXFP4Tensor":
        return MXFP4Tensor(self.codes.to(device), self.scales.to(device), self.block_size, self.name)

    def __repr__(self) -> str:
        return f"MXFP4Tensor(name={self.name!r}, shape={tuple(self.shape)}, block_size={self.block_size}, device={self.device})"
