"""The fx front door keeps a program's input names: whatever ``forward``'s argument is called (``input``, the name
``nn.Sequential`` uses and a Python builtin, or ``x``, ``self_1``, ``args_0``), convert, calibrate and diff run,
and the calibrated activation is named as the program names its input.

Oracles: the MXFP4 weights decoded from their bytes with ml_dtypes (tests/support/fx_builders.py), the forward computed
with numpy, and the batch's own absolute maximum.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.export.graph_signature import InputKind

import fp4pass.fx
from fx_builders import mxfp4_weight

NAMES = ["input", "x", "self_1", "args_0", "list"]


def _sequential(seed: int = 0) -> torch.nn.Sequential:
    """Linear(64, 64) -> ReLU -> Linear(64, 32), weights MXFP4 (fp4pass.fx.MXFP4Linear), biases distinct."""
    generator = torch.Generator().manual_seed(seed)
    seq = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))
    with torch.no_grad():
        for layer in (seq[0], seq[2]):
            layer.weight.copy_(torch.randn(layer.weight.shape, generator=generator))
            layer.bias.copy_(torch.randn(layer.bias.shape, generator=generator))
    return fp4pass.fx.quantize_linears(seq)


def _named(argument: str) -> torch.nn.Module:
    """A module whose ``forward(self, <argument>)`` runs :func:`_sequential`."""
    namespace: dict = {}
    exec(f"def forward(self, {argument}):\n    return self.seq({argument})\n", namespace)
    module_type = type(f"Forward_{argument}", (torch.nn.Module,), {"forward": namespace["forward"]})
    module = module_type()
    module.seq = _sequential()
    return module


def _oracle_forward(seq: torch.nn.Sequential, x: torch.Tensor) -> np.ndarray:
    """relu(x W0^T + b0) W1^T + b1 in float64, W decoded from the MXFP4 bytes alone."""
    def weight(layer):
        codes = layer.weight_blocks.flatten(-2)  # gpt-oss layout [out, blocks, 16] -> [out, K/2]
        return mxfp4_weight(codes, layer.weight_scales).astype(np.float64)

    h = np.maximum(x.double().numpy() @ weight(seq[0]).T + seq[0].bias.detach().double().numpy(), 0.0)
    return h @ weight(seq[2]).T + seq[2].bias.detach().double().numpy()


def _user_inputs(program) -> list[str]:
    return [s.arg.name for s in program.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]


def test_sequential_converts_with_its_input_named_input():
    seq = _sequential()
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    program = torch.export.export(seq, (x,))
    assert _user_inputs(program) == ["input"]  # the name a copy of the graph would change
    converted, report = fp4pass.fx.convert(program)
    assert report["summary"]["tensors_converted"] == 2 and report["summary"]["lossless"] == 2
    assert _user_inputs(converted) == ["input"]
    out = converted.module()(x).detach().double().numpy()
    np.testing.assert_allclose(out, _oracle_forward(seq, x), rtol=1e-5, atol=1e-4)


def test_sequential_without_mxfp4_weights_comes_back_unconverted():
    program = torch.export.export(torch.nn.Sequential(torch.nn.Linear(32, 16)), (torch.randn(2, 32),))
    converted, report = fp4pass.fx.convert(program)
    assert report["summary"]["tensors_converted"] == 0
    assert _user_inputs(converted) == ["input"]


@pytest.mark.parametrize("argument", NAMES)
def test_convert_calibrate_diff_keep_the_input_name(argument):
    module = _named(argument)
    generator = torch.Generator().manual_seed(2)
    batches = [(torch.randn(4, 64, generator=generator) * scale,) for scale in (1.0, 3.0)]
    program = torch.export.export(module, batches[0])
    assert _user_inputs(program) == [argument]

    converted, report = fp4pass.fx.convert(program)
    assert report["summary"]["tensors_converted"] == 2
    assert _user_inputs(converted) == [argument]

    calibrated, scales = fp4pass.fx.calibrate(converted, batches)
    assert _user_inputs(calibrated) == [argument]
    assert argument in scales.tensors  # the first Linear's activation is the program's input itself
    amax = max(float(batch.abs().max()) for (batch,) in batches)
    assert scales.tensors[argument].amax == pytest.approx(amax, rel=1e-6)
    quantizers = [n for n in calibrated.graph.nodes if n.op == "call_function" and "fake_quantize" in str(n.target)]
    assert sorted(n.args[0].name for n in quantizers) == sorted([argument, "relu"])

    x = batches[1][0]
    result = fp4pass.fx.diff(program, calibrated, (x,))
    (row,) = result.outputs
    expected = calibrated.module()(x).detach().double().numpy()
    reference = _oracle_forward(module.seq, x)
    snr = 10 * np.log10(np.sum(reference ** 2) / np.sum((expected - reference) ** 2))
    assert row.snr_db == pytest.approx(snr, abs=0.05)


def test_export_of_a_calibrated_sequential_names_its_onnx_input_input(tmp_path):
    """The whole front door on nn.Sequential: convert, calibrate, export (TensorRT's FP4 forms)."""
    import onnx

    seq = _sequential()
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(3))
    converted, _ = fp4pass.fx.convert(torch.export.export(seq, (x,)))
    calibrated, _ = fp4pass.fx.calibrate(converted, [(x,)])
    fp4pass.fx.export(calibrated, (x,), tmp_path / "seq.onnx")
    model = onnx.load(tmp_path / "seq.onnx")
    assert [i.name for i in model.graph.input] == ["input"]
    consumers = [node.op_type for node in model.graph.node if "input" in node.input]
    assert consumers and all("Quantize" in op for op in consumers), consumers  # the input's FP4 quantizer
