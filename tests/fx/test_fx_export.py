"""fp4pass.fx.export: fp4pass ops -> DequantizeLinear-24 FP4/E8M0, the two-DQ NVFP4 form, the activation quantizers.

Oracles: onnx.reference.ReferenceEvaluator (runs FP4/E8M0 DequantizeLinear exactly), the weights decoded from
their bytes with ml_dtypes, and the ONNX side's own inspect / convert.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch
from onnx import numpy_helper
from onnx.reference import ReferenceEvaluator

import fp4pass.fx
from calib_builders import nv_fake_quant_np
from fp4pass.errors import FormatError, ModelError, UsageError
from fp4pass.formats import MXFP4Tensor, NVFP4Tensor
from fx_builders import MXFP4MLP, NVFP4Experts, mxfp4_weight, nvfp4_weight

FAKE_QUANT = torch.ops.fp4pass.fake_quantize_nvfp4.default


def _nodes(model: onnx.ModelProto, op_type: str) -> list:
    return [n for n in model.graph.node if n.op_type == op_type]


def _attrs(node) -> dict:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def _initializer(model: onnx.ModelProto, name: str) -> onnx.TensorProto:
    return next(t for t in model.graph.initializer if t.name == name)


@pytest.fixture(scope="module")
def mxfp4_export(tmp_path_factory):
    model = MXFP4MLP()
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(5))
    path = tmp_path_factory.mktemp("mx") / "mlp.onnx"
    fp4pass.fx.export(torch.export.export(model, (x,)), (x,), path)
    return model, x, path


def test_mxfp4_becomes_dequantize_linear_24_with_the_same_bytes(mxfp4_export):
    model, x, path = mxfp4_export
    proto = onnx.load(path)
    onnx.checker.check_model(proto, full_check=True)
    assert {o.domain: o.version for o in proto.opset_import} == {"": 24} and proto.ir_version == 12
    dqs = _nodes(proto, "DequantizeLinear")
    assert len(dqs) == 3
    for i, node in enumerate(dqs):
        assert list(node.input) == [f"codes{i}", f"scales{i}"]
        assert _attrs(node) == {"axis": -1, "block_size": 32, "output_dtype": onnx.TensorProto.FLOAT}
        codes, scales = _initializer(proto, f"codes{i}"), _initializer(proto, f"scales{i}")
        assert codes.data_type == onnx.TensorProto.FLOAT4E2M1 and scales.data_type == onnx.TensorProto.FLOAT8E8M0
        assert list(codes.dims) == [getattr(model, f"codes{i}").shape[0], 64]
        assert codes.raw_data == getattr(model, f"codes{i}").numpy().tobytes()
        assert scales.raw_data == getattr(model, f"scales{i}").numpy().tobytes()
    assert {t.name for t in proto.graph.initializer} == {f"{kind}{i}" for kind in ("codes", "scales") for i in range(3)}
    feeds = {"x": x.numpy()}
    results = ReferenceEvaluator(proto).run(None, feeds, intermediate=True)
    for i, name in enumerate(["dequantize_mxfp4", "dequantize_mxfp4_1", "dequantize_mxfp4_2"]):
        expected = mxfp4_weight(getattr(model, f"codes{i}"), getattr(model, f"scales{i}"))
        np.testing.assert_array_equal(results[name], expected)
    np.testing.assert_allclose(results["linear"], model(x).numpy(), rtol=1e-5, atol=1e-4)


def test_exported_mxfp4_is_inspected_and_converted_by_the_onnx_side(mxfp4_export, tmp_path):
    from fp4pass.onnx.inspection import inspect

    model, x, path = mxfp4_export
    info = inspect(path)
    assert [(t["name"], t["pattern"], t["shape"]) for t in info["tensors"]] == [
        ("codes0", "dq", [64, 64]), ("codes1", "dq", [64, 64]), ("codes2", "dq", [32, 64])]
    assert info["declined"] == []
    converted, report = fp4pass.onnx.convert(str(path))
    assert len(report["tensors"]) == 3
    proto = ir.serde.serialize_model(converted) if isinstance(converted, ir.Model) else converted
    assert not [n for n in proto.graph.node if n.op_type == "DequantizeLinear"
                and _attrs(n).get("block_size") == 32]


def test_nvfp4_export_equals_the_fx_model_under_onnx_reference():
    model = NVFP4Experts()
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(2))
    onnx_model = fp4pass.fx.export(model, (x,))
    proto = ir.serde.serialize_model(onnx_model)
    onnx.checker.check_model(proto, full_check=True)
    assert {o.domain: o.version for o in proto.opset_import} == {"": 23} and proto.ir_version == 11
    scale_dqs = [n for n in _nodes(proto, "DequantizeLinear") if n.input[0].startswith("scales")]
    weight_dqs = [n for n in _nodes(proto, "DequantizeLinear") if n.input[0].startswith("codes")]
    assert [_attrs(n) for n in scale_dqs] == [{"axis": 0}, {}]  # per-expert [E] global scale, then a scalar one
    assert [_attrs(n) for n in weight_dqs] == [{"axis": -1, "block_size": 16}] * 2
    assert [list(n.input[1:]) for n in scale_dqs] == [["global_scale"], ["global_scale2"]]
    assert _initializer(proto, "scales").data_type == onnx.TensorProto.FLOAT8E4M3FN
    results = ReferenceEvaluator(proto).run(None, {"x": x.numpy()}, intermediate=True)
    np.testing.assert_array_equal(results["dequantize_nvfp4"],
                                  nvfp4_weight(model.codes, model.scales, model.global_scale))
    np.testing.assert_array_equal(results["dequantize_nvfp4_1"],
                                  nvfp4_weight(model.codes2, model.scales2, model.global_scale2))
    (output_name,) = [o.name for o in proto.graph.output]
    np.testing.assert_allclose(results[output_name], model(x).numpy(), rtol=1e-5, atol=1e-4)


@pytest.fixture(scope="module")
def calibrated():
    model = MXFP4MLP()
    generator = torch.Generator().manual_seed(9)
    batches = [torch.randn(8, 64, generator=generator) for _ in range(3)]
    program, scales = fp4pass.fx.calibrate(torch.export.export(model, (batches[0],)), batches)
    return program, scales, batches[0] * 1.5


def test_fake_quant_reference_form_is_bit_exact_under_onnx_reference(calibrated):
    program, scales, x = calibrated
    proto = ir.serde.serialize_model(fp4pass.fx.export(program, (x,), target="reference"))
    onnx.checker.check_model(proto, full_check=True)
    assert not _nodes(proto, "TRT_FP4DynamicQuantize")
    results = ReferenceEvaluator(proto).run(None, {"x": x.numpy()}, intermediate=True)
    gm = program.module()
    fx_values = {}

    class Keep(torch.fx.Interpreter):
        def run_node(self, node):
            fx_values[node.name] = out = super().run_node(node)
            return out

    Keep(gm).run((x,), {})
    for name in ("x", "relu", "relu_1"):
        quantized = f"{name}_fake_quantize_nvfp4"
        np.testing.assert_array_equal(results[quantized], fx_values[quantized].numpy())
        np.testing.assert_array_equal(results[quantized],
                                      nv_fake_quant_np(results[name], scales.tensors[name].input_scale))
    np.testing.assert_allclose(results["linear"], fx_values["linear"].numpy(), rtol=1e-5, atol=1e-4)


def test_fake_quant_trt_form(calibrated, tmp_path):
    program, scales, x = calibrated
    fp4pass.fx.export(program, (x,), tmp_path / "trt.onnx", target="trt")
    proto = onnx.load(tmp_path / "trt.onnx")
    onnx.checker.check_model(proto)
    assert {o.domain: o.version for o in proto.opset_import} == {"": 24, "trt": 1}
    quantizers = _nodes(proto, "TRT_FP4DynamicQuantize")
    assert [q.input[0] for q in quantizers] == ["x", "relu", "relu_1"]
    for q in quantizers:
        assert q.domain == "trt"
        assert _attrs(q) == {"axis": -1, "block_size": 16, "scale_type": onnx.TensorProto.FLOAT8E4M3FN}
        g = _initializer(proto, q.input[1])
        assert list(g.dims) == [] and g.data_type == onnx.TensorProto.FLOAT
        assert float(onnx.numpy_helper.to_array(g)) == scales.tensors[q.input[0]].input_scale
        consumers = [n for n in proto.graph.node if q.output[1] in n.input]
        (scale_dq,) = consumers
        assert scale_dq.op_type == "DequantizeLinear" and list(scale_dq.input) == [q.output[1], q.input[1]]
        (x_dq,) = [n for n in proto.graph.node if q.output[0] in n.input]
        assert list(x_dq.input) == [q.output[0], scale_dq.output[0]]
        assert _attrs(x_dq) == {"axis": -1, "block_size": 16}
        assert x_dq.output[0] == f"{q.input[0]}_fake_quantize_nvfp4"


class _HalfActivation(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = MXFP4MLP(shapes=((32, 64),))

    def forward(self, x):
        h = torch.ops.fp4pass.fake_quantize_nvfp4(x.to(torch.bfloat16), 0.01)
        return h.float() @ self.inner.weight(0).T


def test_bfloat16_activation_is_cast_around_the_quantizer():
    x = torch.randn(4, 64)
    proto = ir.serde.serialize_model(fp4pass.fx.export(_HalfActivation(), (x,), target="reference"))
    (to_bf16,) = [n for n in _nodes(proto, "Cast") if n.input[0] == "x"]  # x.to(torch.bfloat16)
    activation = to_bf16.output[0]
    around = [(n.input[0], _attrs(n)["to"], n.output[0]) for n in _nodes(proto, "Cast")
              if n.name in (f"{activation}_nvfp4/to_float", f"{activation}_nvfp4/to_bfloat16")]
    assert around == [(activation, onnx.TensorProto.FLOAT, f"{activation}_nvfp4/x_float"),
                      (f"{activation}_nvfp4/fake_quant", onnx.TensorProto.BFLOAT16,
                       f"{activation}_fake_quantize_nvfp4")]


class _ComputedCodes(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = MXFP4MLP(shapes=((32, 64),))

    def forward(self, x):
        codes = self.inner.codes0 + x.sum().to(torch.uint8) * 0  # computed in the graph: no initializer
        return x @ torch.ops.fp4pass.dequantize_mxfp4(codes, self.inner.scales0).T


def test_codes_computed_in_the_graph_are_refused_naming_the_node():
    with pytest.raises(ModelError, match="MXFP4 codes .* not a constant of the program"):
        fp4pass.fx.export(_ComputedCodes(), (torch.randn(4, 64),))


def test_bad_target_is_a_usage_error():
    with pytest.raises(UsageError, match="target"):
        fp4pass.fx.export(MXFP4MLP(shapes=((32, 64),)), (torch.randn(4, 64),), target="ort")


def test_nan_e8m0_scale_is_refused_naming_the_tensor():
    model = MXFP4MLP(shapes=((32, 64),))
    x = torch.randn(4, 64)
    model.scales0[0, 0] = 255
    with pytest.raises(FormatError, match="codes0.*255"):
        fp4pass.fx.export(model, (x,))


def test_e8m0_bytes_decode_as_powers_of_two(mxfp4_export):
    model, _, path = mxfp4_export
    scales = onnx.numpy_helper.to_array(_initializer(onnx.load(path), "scales0"))
    expected = np.exp2(model.scales0.numpy().astype(np.float64) - 127)
    np.testing.assert_array_equal(np.asarray(scales, dtype=ml_dtypes.float8_e8m0fnu).astype(np.float64), expected)


class _BlockedCodes(torch.nn.Module):
    """Codes stored as [N, K/32, 16] blocks (the gpt-oss checkpoint layout), flattened before the dequant;
    large enough (16 KiB) that torch.onnx's optimizer leaves the Reshape unfolded."""

    def __init__(self, n: int = 512, k: int = 64):
        super().__init__()
        mx = MXFP4Tensor.quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(4)))
        self.register_buffer("w_blocks", mx.codes.reshape(n, k // 32, 16).clone())
        self.register_buffer("w_scales", mx.scales)

    def forward(self, x):
        w = torch.ops.fp4pass.dequantize_mxfp4(self.w_blocks.flatten(-2), self.w_scales)
        return x @ w.T


def test_reshaped_constant_codes_are_followed_and_keep_the_weight_name():
    model = _BlockedCodes()
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    proto = ir.serde.serialize_model(fp4pass.fx.export(model, (x,)))
    onnx.checker.check_model(proto, full_check=True)
    (dq,) = _nodes(proto, "DequantizeLinear")
    assert list(dq.input) == ["w_blocks", "w_scales"]
    codes = _initializer(proto, "w_blocks")
    assert codes.data_type == onnx.TensorProto.FLOAT4E2M1 and list(codes.dims) == [512, 64]
    assert codes.raw_data == model.w_blocks.numpy().tobytes()
    assert {t.name for t in proto.graph.initializer} == {"w_blocks", "w_scales"}  # the uint8 blocks are gone
    assert not _nodes(proto, "Reshape")
    results = ReferenceEvaluator(proto).run(None, {"x": x.numpy()}, intermediate=True)
    np.testing.assert_array_equal(results["dequantize_mxfp4"], mxfp4_weight(model.w_blocks.flatten(-2), model.w_scales))


class _EqualScales(torch.nn.Module):
    """Three NVFP4 weights: w0 and w1 have equal global scales (w1 is w0's rows reversed, same amax), w2 its
    own; all 2-D, one scalar global scale each."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(5)
        w0 = torch.randn(64, 64, generator=g)
        for i, w in enumerate((w0, w0.flip(0), torch.randn(32, 64, generator=g) * 3)):
            nv = NVFP4Tensor.quantize(w)
            self.register_buffer(f"codes{i}", nv.codes)
            self.register_buffer(f"scales{i}", nv.scales)
            self.register_buffer(f"global_scale{i}", nv.global_scale)

    def forward(self, x):
        for i in range(3):
            w = torch.ops.fp4pass.dequantize_nvfp4(getattr(self, f"codes{i}"), getattr(self, f"scales{i}"),
                                                   getattr(self, f"global_scale{i}"))
            x = torch.relu(x @ w.T)
        return x


def test_each_weight_keeps_its_own_named_global_scale():
    """torch.onnx merges initializers of equal value; the export gives each weight back its own global scale,
    named after the weight's, holding that weight's value, read by that weight's DequantizeLinear only."""
    model = _EqualScales()
    assert torch.equal(model.global_scale0, model.global_scale1)
    assert not torch.equal(model.global_scale0, model.global_scale2)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    proto = ir.serde.serialize_model(fp4pass.fx.export(model, (x,)))
    onnx.checker.check_model(proto, full_check=True)
    scale_dqs = {n.input[0]: n for n in _nodes(proto, "DequantizeLinear") if n.input[0].startswith("scales")}
    for i in range(3):
        name = f"global_scale{i}"
        assert list(scale_dqs[f"scales{i}"].input[1:]) == [name]
        np.testing.assert_array_equal(numpy_helper.to_array(_initializer(proto, name)),
                                      getattr(model, name).numpy())
    readers = [i for n in proto.graph.node for i in n.input if i.startswith("global_scale")]
    assert sorted(readers) == ["global_scale0", "global_scale1", "global_scale2"]  # one reader each
    results = ReferenceEvaluator(proto).run(None, {"x": x.numpy()})
    np.testing.assert_allclose(results[0], model(x).numpy(), rtol=1e-4, atol=1e-3)


class _TwoLinears(torch.nn.Module):
    """Two MXFP4 linears whose weights hold the same values in another row order: equal NVFP4 global scales."""

    def __init__(self):
        super().__init__()
        from fp4pass.fx.mxfp4 import MXFP4Linear

        g = torch.Generator().manual_seed(4)
        first = torch.nn.Linear(64, 64, bias=False)
        second = torch.nn.Linear(64, 64, bias=False)
        with torch.no_grad():
            first.weight.copy_(torch.randn(64, 64, generator=g))
            second.weight.copy_(first.weight.flip(0))
        self.a, self.b = MXFP4Linear.from_linear(first), MXFP4Linear.from_linear(second)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


@pytest.mark.parametrize("form", ["dq", "alpha"])
def test_a_converted_program_exports_each_weights_own_scales(form):
    """After fx.convert (whose node names torch.onnx renumbers), each weight's DQ and alpha Mul read the
    scales named after that weight: global_scale (dq), scale_one and alpha (alpha), with the program's values."""
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    program, _ = fp4pass.fx.convert(torch.export.export(_TwoLinears(), (x,)), scale_form=form)
    kinds = ["global_scale"] if form == "dq" else ["scale_one", "alpha"]
    state = program.state_dict
    for kind in kinds:
        assert torch.equal(state[f"a.weight_nvfp4_{kind}"], state[f"b.weight_nvfp4_{kind}"])  # merge bait
    proto = ir.serde.serialize_model(fp4pass.fx.export(program, (x,)))
    onnx.checker.check_model(proto, full_check=True)
    readers, initializers = {}, {t.name for t in proto.graph.initializer}
    for node in proto.graph.node:
        for name in node.input:
            if name in initializers and "_nvfp4_" in name and not name.endswith(("_codes", "_scales")):
                readers.setdefault(name, []).append(node)
    assert sorted(readers) == sorted(f"{w}.weight_nvfp4_{k}" for w in "ab" for k in kinds)
    for name, nodes in readers.items():
        assert len(nodes) == 1  # one reader each, its own weight's
        weight = name.split(".")[0]
        if name.endswith("_alpha"):
            assert nodes[0].op_type == "Mul"
        else:
            assert nodes[0].op_type == "DequantizeLinear" and nodes[0].input[0] == f"{weight}.weight_nvfp4_scales"
        np.testing.assert_array_equal(numpy_helper.to_array(_initializer(proto, name)), state[name].numpy())
    got = ReferenceEvaluator(proto).run(None, {"x": x.numpy()})[0]
    np.testing.assert_allclose(got, program.module()(x).detach().numpy(), rtol=1e-4, atol=1e-3)
