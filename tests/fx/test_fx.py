"""The fx pass: custom ops survive torch.export as one node, and the rewrite is exact where conversion is."""

import ml_dtypes
import numpy as np
import torch

import fp4pass.fx
from fp4pass import MXFP4Tensor


class ExpertLinear(torch.nn.Module):
    def __init__(self, mx: MXFP4Tensor):
        super().__init__()
        self.register_buffer("codes", mx.codes)
        self.register_buffer("scales", mx.scales)

    def forward(self, x):
        w = torch.ops.fp4pass.dequantize_mxfp4(self.codes, self.scales)
        return torch.matmul(x, w.transpose(-1, -2))


def _oracle_weight(mx: MXFP4Tensor) -> np.ndarray:
    """Dequantize with ml_dtypes + ldexp, from the bytes alone."""
    codes = mx.codes.numpy()
    pairs = np.stack([codes & 0x0F, codes >> 4], -1).reshape(*codes.shape[:-1], -1)
    values = pairs.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    k = mx.scales.numpy().astype(np.int32) - 127
    return np.ldexp(values.reshape(*k.shape, 32), k[..., None]).reshape(values.shape)


def _experts(spread_octaves: int) -> MXFP4Tensor:
    torch.manual_seed(0)
    w = torch.randn(2, 8, 64) * torch.tensor([1.0, 2.0**spread_octaves]).view(2, 1, 1)
    return MXFP4Tensor.quantize(w)


def _exported(mx: MXFP4Tensor, x: torch.Tensor) -> torch.fx.GraphModule:
    return torch.export.export(ExpertLinear(mx), (x,)).module()


def test_custom_op_survives_export_as_one_node():
    x = torch.randn(2, 3, 64)
    gm = _exported(_experts(4), x)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.fp4pass.dequantize_mxfp4.default in targets


def _oracle_nvfp4_weight(codes: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor) -> np.ndarray:
    codes = codes.numpy()
    pairs = np.stack([codes & 0x0F, codes >> 4], -1).reshape(*codes.shape[:-1], -1)
    values = pairs.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    s = scales.numpy().view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    g = global_scale.numpy().reshape(-1, *([1] * (s.ndim - 1)))
    return (values.reshape(*s.shape, 16) * (s * g)[..., None]).reshape(values.shape)


def test_fx_convert_is_exact_for_experts_twenty_octaves_apart():
    mx = _experts(20)
    x = torch.randn(2, 3, 64)
    gm = _exported(mx, x)
    before = gm(x)
    gm, report = fp4pass.fx.convert(gm, method="auto")
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.fp4pass.dequantize_nvfp4.default in targets
    assert torch.ops.fp4pass.dequantize_mxfp4.default not in targets
    (entry,) = report["tensors"]
    assert entry["mse"] == 0.0 and len(entry["global_scale"]) == 2
    buffers = dict(gm.named_buffers())
    weight = _oracle_nvfp4_weight(*(buffers[f"weight_nvfp4_{part}"] for part in ("codes", "scales", "global_scale")))
    assert "codes" not in buffers and "scales" not in buffers  # the MXFP4 bytes are gone
    np.testing.assert_array_equal(weight, _oracle_weight(mx))
    assert torch.equal(gm(x), before)


def test_fx_convert_declines_codes_that_are_inputs():
    def f(codes, scales):
        return torch.ops.fp4pass.dequantize_mxfp4(codes, scales)

    gm = torch.fx.symbolic_trace(f)
    gm, report = fp4pass.fx.convert(gm)
    assert report["tensors"] == []
    assert "codes is not a stored tensor: graph input" in report["declined"][0]["reason"]
