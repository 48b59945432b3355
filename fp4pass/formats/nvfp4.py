"""NVFP4: E2M1 values, one E4M3 block scale per 16, and an FP32 global scale (per tensor or per group).

Convention (ModelOpt's, and the one every number fp4pass exports follows): every scale is a *multiplier
applied on dequantize*::

    x_hat[i] = e2m1(code[i]) * (e4m3(block_scale[b]) * global_scale[g])

``global_scale`` is ModelOpt's ``weights_scaling_factor_2`` / TensorRT's ``scale_2`` (compressed-tensors
stores its reciprocal). It has shape [] (one per tensor) or the tensor's first ``group_dims`` dims (one per
expert for [E, N, K]). The product ``block_scale * global_scale`` is formed in FP32 and never stored in E4M3
(that fold loses up to ~25% per block: docs/formats.md).

Quantization (:meth:`NVFP4Tensor.quantize`), ModelOpt's formulas in this exact order of float operations::

    global_scale = amax / (6 * 448)                                  (1.0 for an all-zero tensor/group)
    block_scale  = e4m3(clamp(block_amax / (6 * global_scale), 2^-9, 448))
    code         = rne_e2m1(x / (block_scale * global_scale))        (saturating at ±6)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fp4pass.errors import FormatError, ShapeError
from fp4pass.formats.codecs import (
    E2M1_MAX,
    E4M3_MAX,
    E4M3_MIN_SUBNORMAL,
    check_finite,
    decode_e2m1,
    decode_e4m3,
    encode_e2m1,
    encode_e4m3,
)
from fp4pass.formats.constants import GLOBAL_SCALE_MIN, NV_BLOCK_SIZE, NVFP4_AMAX_PER_GLOBAL_SCALE
from fp4pass.formats.packing import pack_nibbles, unpack_nibbles

__all__ = ["NVFP4Tensor", "NV_BLOCK_SIZE", "global_scale_from_amax"]



def global_scale_from_amax(amax):
    """ModelOpt's scale_2 = amax / (6*448), float32: the one place fp4pass computes a global scale (weights
    in the conversion, activations' ``input_scale`` in the calibration).

    Two edges the formula leaves undefined: 1.0 where amax is 0 (any positive scale is exact there), and the
    floor 2^-140 where amax is so tiny that amax/2688 would go below it (2^-140 is the least global scale whose
    product with the least E4M3 block scale 2^-9 is still a non-zero float32). ``amax``: a tensor (result of
    its shape, float32) or a number (result a Python float holding the float32 value: amax rounded to
    float32, then divided in float32).
    """
    if not isinstance(amax, torch.Tensor):
        return float(global_scale_from_amax(torch.tensor(float(amax), dtype=torch.float32)))
    amax = amax.float()
    scale = (amax / NVFP4_AMAX_PER_GLOBAL_SCALE).clamp_min(GLOBAL_SCALE_MIN)
    return torch.where(amax > 0, scale, torch.ones_like(amax))


def _as_global_scale(global_scale, lead: torch.Size, device: torch.device, name: str) -> torch.Tensor:
    g = torch.as_tensor(global_scale, dtype=torch.float32, device=device)
    if g.dim() and tuple(g.shape) != tuple(lead[: g.dim()]):
        raise ShapeError(f"{name}: global_scale of shape {tuple(g.shape)} does not match leading dims {tuple(lead)}")
    if not bool(torch.isfinite(g).all()) or not bool((g > 0).all()):
        raise FormatError(f"{name}: global_scale must be finite and > 0, got {g.flatten()[:4].tolist()}")
    return g


def _broadcast(g: torch.Tensor, ndim: int) -> torch.Tensor:
    """Append singleton dims so that a leading-dims global scale broadcasts against an ndim-d tensor."""
    return g.reshape(*g.shape, *([1] * (ndim - g.dim())))


@dataclass(frozen=True)
class NVFP4Tensor:
    """An NVFP4 tensor of logical shape [..., K].

    Attributes:
        codes: uint8 [..., K/2], two E2M1 codes per byte, low nibble first.
        scales: uint8 [..., K/16], E4M3FN codes of the block scales (not multiplied by the global scale).
        global_scale: float32, shape [] or the first ``global_scale.dim()`` dims of the tensor.
        name: what error messages call this tensor.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    global_scale: torch.Tensor
    name: str = "nvfp4"

    block_size = NV_BLOCK_SIZE

    @classmethod
    def from_codes(
        cls, codes: torch.Tensor, scales_e4m3: torch.Tensor, global_scale, *, name: str = "nvfp4"
    ) -> "NVFP4Tensor":
        """Wrap existing bytes after checking dtypes and shapes."""
        codes, scales = torch.as_tensor(codes), torch.as_tensor(scales_e4m3)
        if codes.dtype != torch.uint8 or scales.dtype != torch.uint8:
            raise ShapeError(f"{name}: codes and scales must be uint8, got {codes.dtype} and {scales.dtype}")
        if codes.dim() == 0 or codes.shape[:-1] != scales.shape[:-1]:
            raise ShapeError(f"{name}: codes {tuple(codes.shape)} and scales {tuple(scales.shape)} differ in leading dims")
        if codes.shape[-1] * 2 != scales.shape[-1] * NV_BLOCK_SIZE:
            raise ShapeError(
                f"{name}: K={codes.shape[-1] * 2} from codes does not match {scales.shape[-1]} scales x block 16"
            )
        g = _as_global_scale(global_scale, codes.shape[:-1], codes.device, name)
        return cls(codes, scales, g, name)

    @classmethod
    def quantize(
        cls, x: torch.Tensor, global_scale=None, *, group_dims: int = 0, name: str = "nvfp4"
    ) -> "NVFP4Tensor":
        """Quantize float ``x`` [..., K] (K a multiple of 16) with ModelOpt's formulas (module docstring).

        ``global_scale``: None to derive amax/(6*448) per tensor, or per group over the first
        ``group_dims`` dims; else a float / tensor of shape [] or the leading dims, used as given.
        """
        x = torch.as_tensor(x).float()
        check_finite(x, name)
        if x.dim() == 0 or x.shape[-1] % NV_BLOCK_SIZE:
            raise ShapeError(f"{name}: last dim of {tuple(x.shape)} is not a multiple of block 16")
        if global_scale is None:
            if not 0 <= group_dims < x.dim():
                raise ShapeError(f"{name}: group_dims={group_dims} must be in [0, {x.dim() - 1}]")
            amax = x.abs().amax(dim=tuple(range(group_dims, x.dim()))) if x.numel() else torch.zeros(())
            global_scale = global_scale_from_amax(amax)
        g = _as_global_scale(global_scale, x.shape[:-1], x.device, name)
        blocks = x.reshape(*x.shape[:-1], -1, NV_BLOCK_SIZE)
        g_b = _broadcast(g, blocks.dim() - 1)
        block_scale = (blocks.abs().amax(-1) / (E2M1_MAX * g_b)).clamp(E4M3_MIN_SUBNORMAL, E4M3_MAX)
        scales = encode_e4m3(block_scale, what=name)
        codes = encode_e2m1(blocks / (decode_e4m3(scales) * g_b).unsqueeze(-1), what=name)
        return cls(pack_nibbles(codes.reshape(x.shape)), scales, g, name)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.codes.shape[:-1], self.codes.shape[-1] * 2))

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def group_dims(self) -> int:
        return self.global_scale.dim()

    def element_codes(self) -> torch.Tensor:
        """E2M1 codes unpacked to one per byte, [..., K]."""
        return unpack_nibbles(self.codes)

    def block_scales(self) -> torch.Tensor:
        """float32 [..., K/16]: the decoded E4M3 block scales (global scale not applied)."""
        return decode_e4m3(self.scales)

    def dequantize(self) -> torch.Tensor:
        """float32 [..., K]: e2m1(code) * (e4m3(scale) * global_scale), rounded in that order (= ONNX's 2 DQs)."""
        values = decode_e2m1(self.element_codes()).reshape(*self.scales.shape, NV_BLOCK_SIZE)
        full_scale = self.block_scales() * _broadcast(self.global_scale, self.scales.dim())
        return (values * full_scale.unsqueeze(-1)).reshape(self.shape)

    def to(self, device: torch.device | str) -> "NVFP4Tensor":
        return NVFP4Tensor(self.codes.to(device), self.scales.to(device), self.global_scale.to(device), self.name)

    def __repr__(self) -> str:
        return (
            f"NVFP4Tensor(name={self.name!r}, shape={tuple(self.shape)}, "
            f"global_scale={tuple(self.global_scale.shape)}, device={self.device})"
        )
