"""Input forms real producers write that the patterns must take: a FLOAT-scale FP4 weight read by two
DequantizeLinear nodes, initializers also listed as graph inputs; and declines that name the op type.
Oracles: onnx.reference on the original and the converted graph, onnx.checker."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import graph_variants as V
from fp4pass.onnx import convert

RNG = np.random.default_rng(21)


def _float_scaled(model: onnx.ModelProto, dtype=np.float32) -> onnx.ModelProto:
    """The same graph with every E8M0 scale initializer stored as float 2^(code-127) (the torch exporter's form)."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    for i, t in enumerate(model.graph.initializer):
        if t.data_type == TensorProto.FLOAT8E8M0:
            codes = np.frombuffer(t.raw_data, np.uint8).reshape(tuple(t.dims))
            values = np.exp2(codes.astype(np.float64) - 127).astype(dtype)
            model.graph.initializer[i].CopyFrom(numpy_helper.from_array(values, t.name))
    for node in model.graph.node:
        if node.op_type == "DequantizeLinear":
            for a in list(node.attribute):
                if a.name == "output_dtype":
                    node.attribute.remove(a)
    return model


def test_float_scale_weight_read_by_two_dequantize_nodes_converts_once():
    e8m0 = V.shared_weight()
    original = _float_scaled(e8m0)
    onnx.checker.check_model(original, full_check=True)
    out, report = convert(original)
    onnx.checker.check_model(out, full_check=True)
    assert report["declined"] == [] and len(report["tensors"]) == 1
    tensor = report["tensors"][0]
    assert tensor["pattern"] == "dq_float" and "read by 2 dequantize nodes" in tensor["form_note"]
    assert sum(n.op_type == "DequantizeLinear" and n.input[0] == "W" for n in out.graph.node) == 2
    feeds = {"xa": RNG.standard_normal((3, 64)).astype(np.float32),
             "xb": RNG.standard_normal((3, 64)).astype(np.float32)}
    for a, b in zip(ReferenceEvaluator(original).run(None, feeds), ReferenceEvaluator(out).run(None, feeds)):
        assert a.tobytes() == b.tobytes()  # power-of-two scales: lossless, the same bytes out
    # the same weights in E8M0 form convert to the same initializers
    out_e8m0, _ = convert(e8m0)
    inits = {t.name: t.raw_data for t in out.graph.initializer}
    assert {t.name: t.raw_data for t in out_e8m0.graph.initializer} == inits


def test_float_scale_weight_read_by_something_else_is_still_declined():
    model = _float_scaled(V.shared_weight())
    model.graph.node.append(helper.make_node("Identity", ["W"], ["W_raw"], name="peek"))
    model.graph.output.append(helper.make_tensor_value_info("W_raw", TensorProto.FLOAT4E2M1, [48, 64]))
    _, report = convert(model)
    assert report["tensors"] == [] and report["declined"]
    assert all("'peek' (Identity)" in d["reason"] for d in report["declined"])


def _bf16_scale_dq(output_dtype: int | None) -> onnx.ModelProto:
    """y = DequantizeLinear(W FP4 [8, 64], S BFLOAT16 [8, 2], block 32): arbitrary (not power-of-two) scales."""
    import ml_dtypes

    rng = np.random.default_rng(4)
    codes = rng.choice(np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -.5, -1.5, -6], np.float32), size=(8, 64))
    scales = (rng.uniform(0.01, 3.0, size=(8, 2))).astype(ml_dtypes.bfloat16)
    attrs = {"axis": -1, "block_size": 32}
    out_type = TensorProto.BFLOAT16
    if output_dtype is not None:
        attrs["output_dtype"] = output_dtype
        out_type = output_dtype
    node = helper.make_node("DequantizeLinear", ["W", "S"], ["y"], name="dq", **attrs)
    graph = helper.make_graph([node], "g", [], [helper.make_tensor_value_info("y", out_type, [8, 64])],
                              initializer=[numpy_helper.from_array(codes.astype(ml_dtypes.float4_e2m1fn), "W"),
                                           numpy_helper.from_array(scales, "S")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)], ir_version=11)


@pytest.mark.parametrize("output_dtype", [None, TensorProto.FLOAT])
def test_bf16_scales_lower_to_a_kernel_onnxruntime_cpu_has_exactly(output_dtype):
    import onnx_ir as ir
    import onnxruntime as ort

    from fp4pass.onnx.lower import lower

    import ml_dtypes

    model = _bf16_scale_dq(output_dtype)
    onnx.checker.check_model(model, full_check=True)
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    exact = inits["W"].astype(np.float32) * np.repeat(inits["S"].astype(np.float32), 32, axis=-1)
    # DequantizeLinear: the exact product, rounded once to the output type (float32 holds it exactly)
    expected = exact.astype(ml_dtypes.bfloat16 if output_dtype is None else np.float32)
    lowered, report = lower(ir.serde.deserialize_model(model))
    assert report.declined == [] and sum(report.lowered.values()) == 1
    proto = ir.serde.serialize_model(lowered)
    gather = next(n for n in proto.graph.node if n.op_type == "GatherBlockQuantized")
    scale = next(t for t in proto.graph.initializer if t.name == gather.input[2])
    assert scale.data_type == TensorProto.FLOAT
    assert proto.graph.output[0].type.tensor_type.elem_type == (output_dtype or TensorProto.BFLOAT16)
    # onnxruntime's Python API returns no bfloat16 arrays: widen y to float32 (exact) in the graph to read it
    proto.graph.node.append(helper.make_node("Cast", ["y"], ["y_f32"], to=TensorProto.FLOAT))
    proto.graph.output[0].CopyFrom(helper.make_tensor_value_info("y_f32", TensorProto.FLOAT, [8, 64]))
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {})
    assert got.tobytes() == expected.astype(np.float32).tobytes()


@pytest.mark.parametrize("provider", ["auto", "cpu"])
def test_diff_falls_back_to_onnx_reference_where_onnxruntime_has_no_kernel(provider):
    import fp4pass

    import ml_dtypes

    bf16 = _float_scaled(V.mlp(TensorProto.BFLOAT16), ml_dtypes.bfloat16)  # torch's bf16 form: bf16 scales
    result = fp4pass.onnx.diff(bf16, bf16, provider=provider)
    assert result.provider == "reference" and result.passed
    assert result.notes[0].startswith("onnxruntime has no kernel for MatMul")
    assert all(m.identical for m in result.outputs)


def _initializers_as_inputs() -> onnx.ModelProto:
    """The linear MXFP4 model with every initializer also listed as a graph input (ModelOpt's exporter, the
    TorchScript exporter with keep_initializers_as_inputs)."""
    import onnx_builders as B

    model = B.linear_model()
    for t in model.graph.initializer:
        model.graph.input.append(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    onnx.checker.check_model(model, full_check=True)
    return model


def test_initializers_listed_as_inputs_convert_and_diff_as_initializers(tmp_path, capsys):
    import json

    from fp4pass.cli import main

    src = tmp_path / "in.onnx"
    onnx.save(_initializers_as_inputs(), src)
    out, report = tmp_path / "out.onnx", tmp_path / "report.json"
    assert main(["convert", str(src), "-o", str(out), "--report", str(report)]) == 0
    assert "initializers also listed as graph inputs, taken as initializers: W, W_scale" in capsys.readouterr().out
    data = json.loads(report.read_text())
    assert data["declined"] == [] and [t["name"] for t in data["tensors"]] == ["W"]
    assert data["initializer_inputs"]["names"] == ["W", "W_scale"]
    written = onnx.load(out)
    onnx.checker.check_model(written, full_check=True)
    assert [i.name for i in written.graph.input] == ["x"]
    capsys.readouterr()
    assert main(["diff", str(src), str(out), "--json", str(tmp_path / "d.json")]) == 0
    err = capsys.readouterr().err
    assert "2 initializers also listed as graph inputs ('W', 'W_scale') and not fed" in err
    assert json.loads((tmp_path / "d.json").read_text())["provider"] in ("cpu", "cuda")  # lowered, not a fallback
    # inspect sees the weight too, and leaves an onnx_ir model it is given as it was
    import onnx_ir as ir

    from fp4pass.onnx.inspection import inspect

    model = ir.load(src)
    assert [t["name"] for t in inspect(model)["tensors"]] == ["W"]
    assert [v.name for v in model.graph.inputs] == ["x", "W", "W_scale"]


def test_declines_name_the_operator(tmp_path, capsys):
    """An INT4 GatherBlockQuantized: the report, `inspect` and `convert` name the operator, not only the pattern."""
    import json

    from fp4pass.cli import main

    data = numpy_helper.from_array(np.zeros((32, 32), np.uint8), "table")
    scales = numpy_helper.from_array(np.ones((32, 2), np.float32), "scales")
    node = helper.make_node("GatherBlockQuantized", ["table", "ids", "scales"], ["emb"], domain="com.microsoft",
                            name="node_embedding_Q4", bits=4, block_size=32, quantize_axis=1, gather_axis=0)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, [3])],
                              [helper.make_tensor_value_info("emb", TensorProto.FLOAT, [3, 64])],
                              initializer=[data, scales])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    path = tmp_path / "gbq.onnx"
    onnx.save(model, path)
    report = tmp_path / "r.json"
    assert main(["convert", str(path), "-o", str(tmp_path / "o.onnx"), "--report", str(report), "--allow-invalid"]) == 0
    out = capsys.readouterr().out
    assert "declined com.microsoft::GatherBlockQuantized node 'node_embedding_Q4' (tensor 'table')" in out
    (entry,) = json.loads(report.read_text())["declined"]
    assert entry["op_type"] == "com.microsoft::GatherBlockQuantized" and entry["pattern"] == "gbq_int4"
    assert main(["inspect", str(path), "--allow-invalid"]) == 0
    assert "declined com.microsoft::GatherBlockQuantized node 'node_embedding_Q4'" in capsys.readouterr().out
