"""fx.calibrate and fx.convert on the graphs torch.export really makes: an activation with a float reader beside
its FP4 matmul, and ``nn.Linear`` with a bias decomposed to ``aten.addmm(bias, x, W.t())``.

Oracles: numpy NVFP4 fake quantization (tests/support/calib_builders.py) and the weights decoded from their bytes with
ml_dtypes (tests/support/fx_builders.py); the float reader's value is compared with the same program before calibration.
"""

from __future__ import annotations

import numpy as np
import torch

import fp4pass.fx
from calib_builders import nv_fake_quant_np
from fp4pass import MXFP4Tensor
from fp4pass.fx.calibration import calibration_targets
from fx_builders import mxfp4_weight, nvfp4_weight

FAKE_QUANT = torch.ops.fp4pass.fake_quantize_nvfp4.default
ADDMM = torch.ops.aten.addmm.default


class ResidualFP4(torch.nn.Module):
    """h = relu(x); y = h @ dq(W).T (FP4) and r = h + 0.25 (a float reader of the same h): outputs (y, r)."""

    def __init__(self, n: int = 32, k: int = 64, seed: int = 0):
        super().__init__()
        mx = MXFP4Tensor.quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)))
        self.register_buffer("codes", mx.codes)
        self.register_buffer("scales", mx.scales)

    def forward(self, x):
        h = torch.relu(x)
        y = h @ torch.ops.fp4pass.dequantize_mxfp4(self.codes, self.scales).T
        return y, h + 0.25


class BiasLinear(torch.nn.Module):
    """nn.Linear with a bias whose weight is MXFP4 bytes: F.linear(x, dq(W), b) (addmm once decomposed)."""

    def __init__(self, n: int = 32, k: int = 64, seed: int = 1):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        mx = MXFP4Tensor.quantize(torch.randn(n, k, generator=generator))
        self.register_buffer("codes", mx.codes)
        self.register_buffer("scales", mx.scales)
        self.bias = torch.nn.Parameter(torch.randn(n, generator=generator))

    def forward(self, x):
        w = torch.ops.fp4pass.dequantize_mxfp4(self.codes, self.scales)
        return torch.nn.functional.linear(x, w, self.bias)


def _batches(seed: int = 3, count: int = 3):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(8, 64, generator=generator) * 2 for _ in range(count)]


def test_calibrate_rewires_only_the_fp4_matmul_not_the_float_reader():
    model = ResidualFP4()
    program = torch.export.export(model, (torch.randn(8, 64),))
    calibrated, scales = fp4pass.fx.calibrate(program, _batches())
    (quantizer,) = [n for n in calibrated.graph.nodes if n.target == FAKE_QUANT]
    h = quantizer.args[0]
    readers = {u.name: u for u in h.users if u is not quantizer}
    assert [u.name for u in quantizer.users] == ["matmul"]
    assert "add" in readers and "matmul" not in readers
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(7)) * 3
    with torch.no_grad():
        y, r = calibrated.module()(x)
    h_np = np.maximum(x.numpy(), 0)
    # the float reader sees h itself: exactly what the program computed before calibration
    np.testing.assert_array_equal(r.numpy(), (h_np + np.float32(0.25)).astype(np.float32))
    # the FP4 matmul reads h fake-quantized to NVFP4 (numpy oracle), then the MXFP4 weight from its bytes
    quantized = nv_fake_quant_np(h_np, scales.tensors[h.name].input_scale)
    assert not np.array_equal(quantized, h_np)  # the quantizer changes h: a misrouted reader would show
    w = mxfp4_weight(model.codes, model.scales)
    bound = 1e-5 * (np.abs(quantized) @ np.abs(w.T)) + 1e-30
    assert (np.abs(y.numpy() - quantized @ w.T) <= bound).all()
    assert (np.abs(y.numpy() - h_np @ w.T) > bound).any()


def test_decomposed_addmm_linear_is_calibrated_and_converted():
    model = BiasLinear()
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(5))
    program = torch.export.export(model, (x,)).run_decompositions()
    (addmm,) = [n for n in program.graph.nodes if n.target == ADDMM]
    targets, declined = calibration_targets(program)
    assert declined == []
    assert [(t.name, t.consumers) for t in targets] == [(addmm.args[1].name, [addmm.name])]
    calibrated, scales = fp4pass.fx.calibrate(program, _batches())
    (quantizer,) = [n for n in calibrated.graph.nodes if n.target == FAKE_QUANT]
    assert [u.target for u in quantizer.users] == [ADDMM]

    converted, report = fp4pass.fx.convert(calibrated)
    assert report["declined"] == [] and report["summary"]["tensors_converted"] == 1
    (entry,) = report["tensors"]
    assert entry["blocks16_requantized"] == 0  # one Linear of normal values: lossless
    dequants = [n for n in converted.graph.nodes if n.target == torch.ops.fp4pass.dequantize_nvfp4.default]
    assert len(dequants) == 1 and not [n for n in converted.graph.nodes
                                       if n.target == torch.ops.fp4pass.dequantize_mxfp4.default]
    state = {**converted.state_dict, **converted.constants}
    codes, scale, global_scale = (state[converted.graph_signature.inputs_to_buffers.get(a.name, a.name)]
                                  for a in dequants[0].args)
    np.testing.assert_array_equal(nvfp4_weight(codes, scale, global_scale), mxfp4_weight(model.codes, model.scales))
    with torch.no_grad():
        out = converted.module()(x)
    quantized = nv_fake_quant_np(x.numpy(), scales.tensors[quantizer.args[0].name].input_scale)
    w = mxfp4_weight(model.codes, model.scales)
    expected = quantized @ w.T + model.bias.detach().numpy()
    bound = 1e-5 * (np.abs(quantized) @ np.abs(w.T) + np.abs(model.bias.detach().numpy()))
    assert (np.abs(out.numpy() - expected) <= bound).all()
