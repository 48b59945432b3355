"""The ONNX checker gate (fp4pass.onnx.loading.checker_failure): what real producers write passes, the rest fails."""

from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from fp4pass.onnx.loading import checker_failure

FIXTURES = Path(__file__).parents[1] / "fixtures"


def _model(op_type="SimplifiedLayerNormalization", domain="", value_info=(), w_name="w"):
    nodes = [helper.make_node(op_type, ["x", "g"], ["y"], axis=-1, epsilon=1e-5, domain=domain),
             helper.make_node("MatMul", ["y", w_name], ["z"])]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 64])],
        [helper.make_tensor_value_info("z", onnx.TensorProto.FLOAT, [2, 64])],
        [numpy_helper.from_array(np.ones((64, 64), np.float32), "w"),
         numpy_helper.from_array(np.ones(64, np.float32), "g")], value_info=list(value_info))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    return model


def test_onnxruntime_genai_builder_models_pass():
    for name in ("ortgenai_gptoss", "ortgenai_gptoss_h64"):
        assert checker_failure(FIXTURES / name / "model.onnx") is None


def test_operator_onnxruntime_registers_passes_and_external_data_resolves_from_any_folder(tmp_path, monkeypatch):
    model = _model()
    try:
        onnx.checker.check_model(model, full_check=True)
        raise AssertionError("the plain ONNX checker accepted SimplifiedLayerNormalization")
    except onnx.checker.ValidationError:
        pass
    assert checker_failure(model) is None
    onnx.save(model, tmp_path / "m.onnx", save_as_external_data=True, location="m.data", size_threshold=0)
    monkeypatch.chdir("/")
    assert checker_failure(tmp_path / "m.onnx") is None


def test_unknown_operator_dangling_input_and_bad_annotation_types_fail():
    assert "Bogus" in checker_failure(_model(op_type="Bogus"))
    assert checker_failure(_model(w_name="missing")) is not None
    # a stale shape annotation is dropped on the second look, a type that contradicts the graph is not
    stale = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 64, 1])
    assert checker_failure(_model(value_info=[stale])) is None
    wrong = _model(op_type="Add")  # Add(x [2, 64], g [64]) is fine; then MatMul with w [3, 5] cannot be
    wrong.graph.initializer[0].CopyFrom(numpy_helper.from_array(np.ones((3, 5), np.float32), "w"))
    wrong.graph.node[0].ClearField("attribute")
    assert checker_failure(wrong) is not None
