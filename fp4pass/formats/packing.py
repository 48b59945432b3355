"""Nibble packing: two E2M1 codes per byte, element 2i in the LOW nibble, 2i+1 in the high nibble.

ONNX FLOAT4E2M1, gpt-oss checkpoints, ModelOpt and onnxruntime's QMoE all agree on this order. Packing runs
along the last axis; an odd count pads the last high nibble with 0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["pack_nibbles", "unpack_nibbles"]


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., K] (values 0..15) -> packed uint8 [..., ceil(K/2)]."""
    codes = codes.to(torch.uint8)
    if codes.shape[-1] % 2:
        codes = F.pad(codes, (0, 1))
    pairs = codes.reshape(*codes.shape[:-1], -1, 2)
    return (pairs[..., 0] & 0x0F) | ((pairs[..., 1] & 0x0F) << 4)


def unpack_nibbles(packed: torch.Tensor, count: int | None = None) -> torch.Tensor:
    """packed uint8 [..., B] -> codes uint8 [..., count] (count defaults to 2*B; an odd count drops the pad)."""
    pairs = torch.stack((packed & 0x0F, packed >> 4), dim=-1)
    codes = pairs.reshape(*packed.shape[:-1], packed.shape[-1] * 2)
    if count is not None and count != codes.shape[-1]:
        codes = codes[..., :count]
    return codes
