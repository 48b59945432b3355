"""Small torch models for the fx calibrate / diff / export tests, and their weights decoded independently.

Weights are made with ``MXFP4Tensor.quantize`` / ``NVFP4Tensor.quantize`` (bytes only); the oracles decode
those bytes with ml_dtypes and numpy, sharing no fp4pass code.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch

from fp4pass import MXFP4Tensor, NVFP4Tensor
import fp4pass.fx  # noqa: F401  (registers torch.ops.fp4pass.*)


class MXFP4MLP(torch.nn.Module):
    """x -> relu(x @ W0.T) -> relu(. @ W1.T) -> linear(., W2): three MXFP4 weights held as codes/scales buffers."""

    def __init__(self, shapes=((64, 64), (64, 64), (32, 64)), seed: int = 0):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.layers = len(shapes)
        for i, (n, k) in enumerate(shapes):
            mx = MXFP4Tensor.quantize(torch.randn(n, k, generator=generator))
            self.register_buffer(f"codes{i}", mx.codes)
            self.register_buffer(f"scales{i}", mx.scales)

    def weight(self, i: int) -> torch.Tensor:
        return torch.ops.fp4pass.dequantize_mxfp4(getattr(self, f"codes{i}"), getattr(self, f"scales{i}"))

    def forward(self, x):
        h = x
        for i in range(self.layers - 1):
            h = torch.relu(h @ self.weight(i).T)
        return torch.nn.functional.linear(h, self.weight(self.layers - 1))


class NVFP4Experts(torch.nn.Module):
    """bmm against per-expert NVFP4 weights [E, N, K] (one global scale per expert), then a 2-D NVFP4 matmul."""

    def __init__(self, experts: int = 3, n: int = 32, k: int = 64, out: int = 16, seed: int = 0):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        spread = torch.tensor([10.0 ** (2 * e - experts) for e in range(experts)]).view(experts, 1, 1)
        nv = NVFP4Tensor.quantize(torch.randn(experts, n, k, generator=generator) * spread, group_dims=1)
        self.register_buffer("codes", nv.codes)
        self.register_buffer("scales", nv.scales)
        self.register_buffer("global_scale", nv.global_scale)
        nv2 = NVFP4Tensor.quantize(torch.randn(out, n, generator=generator))
        self.register_buffer("codes2", nv2.codes)
        self.register_buffer("scales2", nv2.scales)
        self.register_buffer("global_scale2", nv2.global_scale)

    def forward(self, x):  # x [E, T, K]
        w = torch.ops.fp4pass.dequantize_nvfp4(self.codes, self.scales, self.global_scale)
        h = torch.bmm(x, w.transpose(1, 2))
        w2 = torch.ops.fp4pass.dequantize_nvfp4(self.codes2, self.scales2, self.global_scale2)
        return h @ w2.T


def e2m1_values(codes: np.ndarray) -> np.ndarray:
    """Packed E2M1 bytes [..., B] -> float32 [..., 2B], low nibble first (ml_dtypes decode)."""
    pairs = np.stack([codes & 0x0F, codes >> 4], -1).reshape(*codes.shape[:-1], -1)
    return pairs.astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)


def mxfp4_weight(codes: torch.Tensor, scales: torch.Tensor) -> np.ndarray:
    """e2m1(code) * 2^(e8m0 - 127), from the bytes alone."""
    values = e2m1_values(codes.numpy())
    k = scales.numpy().astype(np.int32) - 127
    return np.ldexp(values.reshape(*k.shape, 32), k[..., None]).reshape(values.shape).astype(np.float32)


def nvfp4_weight(codes: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor) -> np.ndarray:
    """e2m1(code) * (e4m3(scale) * global_scale), FP32 products in that order."""
    values = e2m1_values(codes.numpy())
    s = scales.numpy().view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    g = global_scale.numpy().astype(np.float32).reshape(global_scale.shape + (1,) * (s.ndim - global_scale.dim()))
    return (values.reshape(*s.shape, 16) * (s * g)[..., None]).reshape(values.shape)


def buffer_node(graph, buffer: str):
    """The dequant node of a graph that reads the buffer named ``buffer`` (get_attr or lifted placeholder)."""
    for node in graph.nodes:
        if node.op == "call_function" and "dequantize" in str(node.target):
            source = node.args[0]
            if source.target in (buffer, f"b_{buffer}") or source.name in (buffer, f"b_{buffer}"):
                return node
    raise LookupError(buffer)
