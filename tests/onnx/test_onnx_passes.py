"""The ONNX passes as onnx_ir passes: they walk subgraphs (If branches) and function bodies, return a PassResult
that says whether they changed the model, and what they lower computes what onnx.reference computes on the
unlowered model (an independent oracle)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx.reference import ReferenceEvaluator

from fp4pass.onnx.lower import (LowerFP4DequantizeLinear, LowerQMoEFP4, LowerTRTFP4DynamicQuantize, LoweringReport,
                                SetOrtVersions, lower)
from fp4pass.onnx.passes import all_nodes
import onnx_builders as B

GBQ = "FP4 DequantizeLinear -> GatherBlockQuantized"


def _feeds(proto: onnx.ModelProto) -> list[dict]:
    """x on a grid of quarters: every product with an FP4 weight and every partial sum of a 64-long row is exact
    in float32, so a MatMul gives the same bits whatever order onnxruntime's and numpy's kernels add in."""
    x = (np.random.default_rng(7).integers(-8, 9, (3, 64)) / 4).astype(np.float32)
    if len(proto.graph.input) == 2:
        return [{"x": x, "cond": np.array(True)}, {"x": x, "cond": np.array(False)}]
    return [{"x": x}]


def _ort(model: ir.Model):
    proto = ir.serde.serialize_model(model)
    onnx.checker.check_model(proto, full_check=True)
    return ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])


def _fp4_dqs(model: ir.Model) -> list[ir.Node]:
    return [n for n in all_nodes(model) if n.op_type == "DequantizeLinear" and n.inputs[0].name.startswith("W")
            and "scale" not in n.inputs[0].name]


@pytest.mark.parametrize("builder", [B.if_branch_model, B.function_model])
def test_lowering_reaches_if_branches_and_function_bodies_and_runs_as_the_reference(builder):
    proto = builder()
    lowered, report = lower(ir.serde.deserialize_model(proto))
    assert report.lowered == {GBQ: 2 if builder is B.if_branch_model else 1} and not report.declined
    assert not _fp4_dqs(lowered)
    session = _ort(lowered)
    outputs = set()
    for feeds in _feeds(proto):
        expected = ReferenceEvaluator(proto).run(None, feeds)[0]
        got = session.run(None, feeds)[0]
        np.testing.assert_array_equal(got, expected)
        outputs.add(float(np.abs(expected).max()))
    assert len(outputs) == len(_feeds(proto))  # the two branches really compute different things


def test_lowering_rewrites_a_branch_node_in_its_branch_and_imports_the_ms_opset():
    lowered, _ = lower(ir.serde.deserialize_model(B.if_branch_model()))
    branches = [attr.value for attr in lowered.graph.node(0).attributes.values()]
    for branch in branches:
        assert [n.op_type for n in branch] == ["GatherBlockQuantized", "Transpose", "MatMul"]
        assert branch.initializers  # the gather's index constant lives in the branch that reads it
    assert lowered.opset_imports["com.microsoft"] == 1
    # the E8M0 scales (outer-scope initializers) are no longer read: they go
    assert not any(v.dtype == ir.DataType.FLOAT8E8M0 for g in lowered.graphs() for v in g.initializers.values())


def test_lowering_in_a_function_body_uses_constant_nodes_and_the_function_imports_the_ms_opset():
    lowered, _ = lower(ir.serde.deserialize_model(B.function_model()))
    (function,) = lowered.functions.values()
    assert function.opset_imports["com.microsoft"] == 1 and lowered.opset_imports["com.microsoft"] == 1
    ops = [n.op_type for n in function]
    assert ops.count("GatherBlockQuantized") == 1 and "DequantizeLinear" not in ops
    assert ops.count("Constant") == 3  # codes, FP32 scales, gather indices (the E8M0 Constant is gone)


def test_the_quantizer_lowering_raises_the_opset_its_emulation_needs():
    """SetOrtVersions is configured with the quantizer lowering's result: TensorRT's quantizer in an opset-19
    graph (or an opset-19 function's body), lowered to standard ops, leaves the model (and that function) at the
    emulation's opset (21)."""
    import numpy as np

    from fp4pass.onnx.act_quant import trt_quantizer
    from fp4pass.onnx.emulate import MIN_OPSET

    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2, 32]))
    g = ir.Value(name="g", const_value=ir.tensor(np.array(0.05, dtype=np.float32), name="g"))
    nodes, x_hat = trt_quantizer(x, g, g, "q")
    graph = ir.Graph([x], [x_hat], nodes=nodes, initializers=[g], opset_imports={"": 19, "trt": 1})
    lowered, report = lower(ir.Model(graph, ir_version=10))
    assert report.lowered == {LowerTRTFP4DynamicQuantize.name: 1}
    assert lowered.opset_imports[""] == MIN_OPSET == 21

    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2, 32]))
    constant = ir.node("Constant", [], attributes={"value": ir.tensor(np.array(0.05, dtype=np.float32), name="g")})
    nodes, x_hat = trt_quantizer(x, constant.outputs[0], constant.outputs[0], "q")
    body = ir.Graph([x], [x_hat], nodes=[constant, *nodes], opset_imports={"": 19, "trt": 1})
    function = ir.Function("local", "Quantize", graph=body, attributes=[])
    x_in = ir.Value(name="x_in", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2, 32]))
    call = ir.node("Quantize", [x_in], domain="local")
    call.outputs[0].name, call.outputs[0].type = "y", ir.TensorType(ir.DataType.FLOAT)
    graph = ir.Graph([x_in], [call.outputs[0]], nodes=[call], opset_imports={"": 19, "local": 1})
    lowered, _ = lower(ir.Model(graph, ir_version=10, functions=[function]))
    (body_after,) = lowered.functions.values()
    assert body_after.opset_imports[""] == lowered.opset_imports[""] == MIN_OPSET


def test_each_lowering_pass_says_whether_it_changed_the_model():
    model = ir.serde.deserialize_model(B.if_branch_model())
    dq_pass = LowerFP4DequantizeLinear()
    first = dq_pass(model)
    assert first.modified is True and first.model is model
    assert first.lowered == 2 and first.declined == [] and first.functions == []  # one DQ in each branch
    assert dq_pass(model).modified is False  # nothing left to lower
    assert LowerTRTFP4DynamicQuantize()(model).modified is False
    assert LowerQMoEFP4()(model).modified is False
    assert LoweringReport.of([first]).lowered == {LowerFP4DequantizeLinear.name: 2}
    versions = SetOrtVersions()
    assert versions(model).modified is True  # IR capped and com.microsoft imported
    assert versions(model).modified is False


def _weight_passes(proto, calibrated=False, scale_form="dq"):
    """(model, (rewrite, fold_quark, versions, group), declined): the passes of stages 4 and 5; ``versions`` is
    built from the rewrite's result (``versions(wrote_dq)``), as run_weight_passes does."""
    from fp4pass.onnx.pipeline import FoldQuarkFakeQuants, GroupInitializers, RewriteMXFP4Weights, SetOpsetAndIR
    from fp4pass.onnx.rewrite_common import WeightConversion
    from fp4pass.onnx.sharing import find_weights

    model = ir.serde.deserialize_model(proto)
    records, declined = find_weights(model)
    convs = [WeightConversion(r, "auto") for r in records]
    passes = (RewriteMXFP4Weights(records, convs, scale_form), FoldQuarkFakeQuants(calibrated, declined),
              SetOpsetAndIR, GroupInitializers(records))
    return model, passes, declined


def test_each_convert_pass_says_whether_it_changed_the_model():
    from graph_variants import mlp

    model, (rewrite, fold_quark, versions, group), _ = _weight_passes(mlp(onnx.TensorProto.FLOAT))
    rewritten = rewrite(model)
    assert rewritten.modified is True and len(rewritten.done) == 2 and rewritten.wrote_dq
    folded = fold_quark(model)
    assert folded.modified is False and folded.entries == []  # no Quark node in this model
    # opset 24, IR 12 (E8M0 scales stay for nothing: IR 11 needed)
    assert versions(rewritten.wrote_dq)(model).modified is False
    assert group(model).modified is True  # W1's scales moved up next to W1
    names = list(model.graph.initializers)
    assert names.index("W1_scale_e4m3") == names.index("W1") + 1
    assert group(model).modified is False
    empty, (rewrite, *_), _ = _weight_passes(B.function_model())  # its weight is declined (inside a function)
    result = rewrite(empty)
    assert result.modified is False and result.done == []


def test_weight_stages_report_through_their_results_in_the_order_they_ran():
    """The opset pass learns from the rewrite's result that an FP4 DQ was written (opset 21 -> 23); each
    stage's report comes back in its own result."""
    from fp4pass.onnx.pipeline import run_weight_passes
    from fp4pass.onnx.rewrite_common import WeightConversion
    from fp4pass.onnx.sharing import find_weights
    from graph_variants import mlp

    model = ir.serde.deserialize_model(mlp(onnx.TensorProto.FLOAT))
    model.opset_imports[""] = model.graph.opset_imports[""] = 21
    records, declined = find_weights(model)
    stages = run_weight_passes(model, records, [WeightConversion(r, "auto") for r in records], "dq", False, declined)
    assert [r.name for r, *_ in stages.rewrite.done] == [r.name for r in records] and stages.rewrite.wrote_dq
    assert stages.quark.entries == [] and stages.quark.modified is False
    assert stages.versions.versions["before"]["opset"] == 21 and stages.versions.versions["after"]["opset"] == 23
    assert model.opset_imports[""] == 23 and stages.grouped.modified is True


def test_set_opset_and_ir_raises_the_opset_once_and_keeps_functions_in_step():
    from fp4pass.onnx.rewrite_cleanup import SetOpsetAndIR

    proto = B.function_model()
    model = ir.serde.deserialize_model(proto)
    model.opset_imports[""] = 21
    next(iter(model.functions.values())).opset_imports[""] = 21
    first = SetOpsetAndIR(wrote_fp4_dq=True)(model)
    assert first.modified is True
    # opset 23 alone needs IR 11; the FLOAT8E8M0 scales stored in the function's Constant node need IR 12
    assert first.versions == {"before": {"ir_version": 12, "opset": 21}, "after": {"ir_version": 12, "opset": 23}}
    assert next(iter(model.functions.values())).opset_imports[""] == 23
    assert SetOpsetAndIR(wrote_fp4_dq=True)(model).modified is False


def test_fold_quark_pass_reports_a_change_on_a_quark_model():
    from pathlib import Path

    proto = onnx.load(str(Path(__file__).parents[1] / "fixtures" / "quark_mlp.onnx"))
    model, (rewrite, fold_quark, *_), declined = _weight_passes(proto)
    rewrite(model)
    result = fold_quark(model)
    assert result.modified is True and any(e["kind"] == "constant" for e in result.entries)
    assert any(d.pattern == "quark" for d in declined)  # activations stay, declined, without calibration


# -- convert on If branches and functions (end to end) ------------------------------------------------------

def _nodes_in_branches(proto: onnx.ModelProto) -> dict[str, list[onnx.NodeProto]]:
    (if_node,) = [n for n in proto.graph.node if n.op_type == "If"]
    return {a.name: list(a.g.node) for a in if_node.attribute}


def _assert_lowered_runs_as_reference(converted: onnx.ModelProto, feeds_list, exact: bool = True) -> None:
    """lower + onnxruntime CPU on the converted model == onnx.reference on the converted model, unlowered.

    ``exact=False`` where a quantized activation (arbitrary float32 global scale) meets the weight: the MatMul's
    products are then inexact and the two runtimes' summation orders differ in the last bits, so the bound is
    float32 rounding of the row sums (1e-5 of the output's range), far below any FP4 code or scale fault."""
    from graph_variants import run_reference

    lowered, report = lower(ir.serde.deserialize_model(converted))
    assert not report.declined
    session = _ort(lowered)
    for feeds in feeds_list:
        got, expected = session.run(None, feeds)[0], run_reference(converted, feeds)[0]
        if exact:
            np.testing.assert_array_equal(got, expected)
        else:
            np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5 * float(np.abs(expected).max()))


@pytest.mark.parametrize("scale_form", ["dq", "alpha"])
@pytest.mark.parametrize("shared", [False, True])
def test_convert_rewrites_the_mxfp4_weight_of_each_if_branch(scale_form, shared):
    from fp4pass.pipeline import convert

    proto = B.if_branch_model(shared=shared)
    converted, report = convert(proto, scale_form=scale_form)
    assert sorted(t["name"] for t in report["tensors"]) == (["W_then"] if shared else ["W_else", "W_then"])
    assert report["declined"] == [] and report["summary"]["lossless"] == len(report["tensors"])
    onnx.checker.check_model(converted, full_check=True)
    for nodes in _nodes_in_branches(converted).values():  # each branch now dequantizes NVFP4 (block 16)
        blocks = [a.i for n in nodes if n.op_type == "DequantizeLinear" for a in n.attribute if a.name == "block_size"]
        assert blocks == [16]
    feeds = _feeds(proto)
    _assert_lowered_runs_as_reference(converted, feeds)
    for f in feeds:  # lossless: the converted model computes what the input computes, in both branches
        np.testing.assert_array_equal(ReferenceEvaluator(converted).run(None, f)[0],
                                      ReferenceEvaluator(proto).run(None, f)[0])


def test_diff_runs_on_a_converted_if_model():
    from fp4pass.onnx import diff
    from fp4pass.pipeline import convert

    proto = B.if_branch_model()
    converted, _ = convert(proto)
    result = diff(proto, converted, provider="cpu")
    assert result.passed and len(result.outputs) == 1


def test_convert_declines_an_mxfp4_weight_inside_a_function_and_says_what_converts_it():
    import onnx.inliner
    from onnx_ir.passes.common import LiftConstantsToInitializersPass

    from fp4pass.pipeline import convert

    proto = B.function_model()
    converted, report = convert(proto)
    assert report["tensors"] == []
    (declined,) = report["declined"]
    assert declined["tensor"] == "W" and declined["pattern"] == "dq"
    assert f"function {B.FUNCTION_DOMAIN}::Linear" in declined["reason"] and "inline" in declined["reason"]
    onnx.checker.check_model(converted, full_check=True)
    _assert_lowered_runs_as_reference(converted, _feeds(proto))
    # what the reason says: inlined, constants lifted, the weight converts
    model = ir.serde.deserialize_model(onnx.inliner.inline_local_functions(proto))
    LiftConstantsToInitializersPass(size_limit=0)(model)
    _, report = convert(model)
    assert report["summary"]["tensors_converted"] == report["summary"]["lossless"] == 1 and report["declined"] == []


@pytest.mark.parametrize("target", ["trt", "ort"])
def test_activation_quantizers_go_into_each_branch_that_reads_the_outer_activation(target, tmp_path):
    from fp4pass.pipeline import convert

    proto = B.if_branch_model()
    calib = tmp_path / "calib.npz"
    np.savez(calib, **_feeds(proto)[0])
    converted, report = convert(proto, target=target, calib=str(calib))
    (entry,) = report["activations"]
    assert entry["activation"] == "x" and entry["inserted"] and entry["reason"] is None
    assert sorted(entry["consumers"]) == ["else_mm", "then_mm"]
    onnx.checker.check_model(converted, full_check=True)
    for branch, nodes in _nodes_in_branches(converted).items():
        mm = next(i for i, n in enumerate(nodes) if n.op_type == "MatMul")
        quantized = nodes[mm].input[0]  # the MatMul now reads the quantizer's output, made before it in the branch
        assert quantized != "x" and quantized in {o for n in nodes[:mm] for o in n.output}
    _assert_lowered_runs_as_reference(converted, _feeds(proto), exact=False)


def test_an_activation_consumer_inside_a_function_is_declined_with_the_reason():
    from fp4pass.onnx.calibrate import calibration_targets
    from fp4pass.onnx.act_quant import InsertActivationQuantizers

    proto = B.nvfp4_function_model()
    model = ir.serde.deserialize_model(proto)
    targets, declined = calibration_targets(model)
    assert targets == [] and "function local.fp4::Linear" in declined[0]["reason"]
    result = InsertActivationQuantizers({"x": 0.01}, target="reference")(model)
    assert result.modified is False
    (entry,) = result.entries
    assert not entry["inserted"] and "function local.fp4::Linear" in entry["reason"]


def test_insert_activation_quantizers_pass_says_whether_it_inserted():
    from fp4pass.onnx.act_quant import InsertActivationQuantizers
    from fp4pass.pipeline import convert

    converted, _ = convert(B.if_branch_model())
    model = ir.serde.deserialize_model(converted)
    assert InsertActivationQuantizers({"not_an_activation": 0.01})(model).modified is False
    assert InsertActivationQuantizers({"x": 0.01})(model).modified is True


def test_run_passes_lets_a_pass_own_error_through():
    from fp4pass.errors import ModelError
    from fp4pass.onnx.passes import run_passes

    class Refuses(ir.passes.InPlacePass):
        def call(self, model):
            raise ModelError("this model is refused")

    model = ir.serde.deserialize_model(B.if_branch_model())
    with pytest.raises(ModelError, match="refused"):  # not onnx_ir's PassError around it
        run_passes([LowerFP4DequantizeLinear(), Refuses()], model)
