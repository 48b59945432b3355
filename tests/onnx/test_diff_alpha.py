"""The diff compares like with like on alpha-form models and names the first node of the original that truly
diverges (the bundled MoE: MXFP4 DQ -> Transpose -> MatMul per expert, fc1 then fc2)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

import fp4pass
from fp4pass.cli import main
from fp4pass.onnx.alpha_scope import missing_global_scale
from fp4pass.onnx.loading import load
from fp4pass.pipeline import convert

MODELS = Path(__file__).resolve().parents[2] / "models"
MOE = str(MODELS / "moe.onnx")
CALIB = str(MODELS / "calib.npz")


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    folder = tmp_path_factory.mktemp("alpha")
    out = {}
    for name, kwargs in {"alpha": {"scale_form": "alpha"}, "dq": {},
                         "alpha_w4a4": {"scale_form": "alpha", "calib": CALIB},
                         "dq_w4a4": {"calib": CALIB}}.items():
        path = folder / f"{name}.onnx"
        convert(MOE, output=str(path), provider="cpu", **kwargs)
        out[name] = str(path)
    return out


def _feeds():
    return {"x": np.load(CALIB)["x"][:32]}


def test_weight_only_alpha_names_nothing_and_no_dq_tensor_diverges(converted):
    result = fp4pass.onnx.diff(MOE, converted["alpha"], inputs=_feeds(), intermediates=True, snr_min=30)
    assert result.passed and result.first_divergent is None
    assert not [m.name for m in result.intermediates if m.below(30)]
    assert not any(m.name.startswith("experts.") for m in result.intermediates)
    assert any("experts.w1_dq" in n and "without the global scale" in n for n in result.notes)
    # the consumers' outputs carry the scale again and are compared
    assert {"h", "h_act", "o"} <= {m.name for m in result.intermediates}


def test_w4a4_alpha_names_fc1_like_the_dq_form(converted):
    alpha = fp4pass.onnx.diff(MOE, converted["alpha_w4a4"], inputs=_feeds(), intermediates=True, snr_min=30)
    dq = fp4pass.onnx.diff(MOE, converted["dq_w4a4"], inputs=_feeds(), intermediates=True, snr_min=30)
    for result in (alpha, dq):
        assert result.first_divergent["node"] == "fc1" and result.first_divergent["tensor"] == "h"
        assert result.first_divergent["op_type"] == "MatMul"


def test_a_wrong_alpha_is_still_caught_at_its_consumer(converted, tmp_path):
    """Leaving the alpha-form weights out must not hide a fault: fc1's alpha doubled shows at fc1."""
    proto = onnx.load(converted["alpha"])
    init = next(t for t in proto.graph.initializer if t.name == "experts.w1_alpha")
    values = onnx.numpy_helper.to_array(init) * 2
    init.CopyFrom(onnx.numpy_helper.from_array(values.astype(np.float32), init.name))
    broken = tmp_path / "broken.onnx"
    onnx.save(proto, broken)
    result = fp4pass.onnx.diff(MOE, str(broken), inputs=_feeds(), intermediates=True, snr_min=30)
    assert not result.passed and result.first_divergent["node"] == "fc1"


def test_missing_global_scale_finds_the_alpha_path_only(converted):
    alpha = missing_global_scale(load(converted["alpha"]).model)
    assert set(alpha) == {"experts.w1_dq", "experts.w1_t", "h_unscaled", "experts.w2_dq", "experts.w2_t",
                          "o_unscaled"}
    assert alpha["experts.w1_t"] == "fc1_alpha" and alpha["o_unscaled"] == "fc2_alpha"
    assert missing_global_scale(load(converted["dq"]).model) == {}
    assert missing_global_scale(load(MOE).model) == {}


def test_first_divergent_names_the_original_node_not_the_lowering(tmp_path):
    """A weight off by a little: the node named is the DequantizeLinear the user wrote, not the lowering's."""
    proto = onnx.load(MOE)
    init = next(t for t in proto.graph.initializer if t.name == "experts.w1_scale")
    raw = bytearray(init.raw_data)
    raw[0] = (raw[0] + 1) % 255  # one block's scale doubled
    init.raw_data = bytes(raw)
    changed = tmp_path / "changed.onnx"
    onnx.save(proto, changed)
    result = fp4pass.onnx.diff(MOE, str(changed), inputs=_feeds(), intermediates=True, snr_min=200)
    assert result.first_divergent["node"] == "experts.w1_dq"
    assert result.first_divergent["op_type"] == "DequantizeLinear"


def test_intermediates_alone_name_the_first_node_that_differs(converted, capsys):
    code = main(["diff", MOE, converted["dq"], "--intermediates"])
    out = capsys.readouterr().out
    assert code == 0
    # w1 converts losslessly (identical); w2 does not: its dequantize is the first to differ
    assert "first divergent (differs at all; no --snr-min): node 'experts.w2_dq'" in out
    same = fp4pass.onnx.diff(MOE, MOE, intermediates=True)
    assert same.first_divergent is None


def _nvfp4_graph(tail: list, outputs: list, scale_one: float = 1.0) -> "ir.Model":
    """x @ DQ(W FP4, DQ(S E4M3, g))^T followed by ``tail`` nodes (built with onnx.helper)."""
    import ml_dtypes
    import onnx_ir as ir
    from onnx import TensorProto, helper, numpy_helper

    codes = np.ones((8, 32), np.float32).astype(ml_dtypes.float4_e2m1fn)
    scales = np.ones((8, 2), np.float32).astype(ml_dtypes.float8_e4m3fn)
    nodes = [helper.make_node("DequantizeLinear", ["S", "g"], ["s"], name="dq_s"),
             helper.make_node("DequantizeLinear", ["W", "s"], ["W_dq"], name="dq_w", axis=-1, block_size=16),
             helper.make_node("Transpose", ["W_dq"], ["W_t"], name="t", perm=[1, 0]),
             helper.make_node("MatMul", ["x", "W_t"], ["h"], name="mm"), *tail]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 32])],
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs],
                              initializer=[numpy_helper.from_array(codes, "W"), numpy_helper.from_array(scales, "S"),
                                           numpy_helper.from_array(np.float32(scale_one), "g"),
                                           numpy_helper.from_array(np.float32(3.0), "k")])
    return ir.serde.deserialize_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24)]))


def test_a_dq_form_weight_whose_global_scale_is_one_is_compared():
    """DQ(S, 1) is also what the dq form writes when G = 1: without the alpha multiply after the consumer, no
    tensor is claimed, however far downstream a Mul by a constant sits."""
    from onnx import helper

    relu_then_scale = [helper.make_node("Relu", ["h"], ["r"], name="relu"),
                       helper.make_node("Mul", ["r", "k"], ["y"], name="scale")]
    assert missing_global_scale(_nvfp4_graph(relu_then_scale, ["y"])) == {}
    alpha = [helper.make_node("Mul", ["h", "k"], ["y"], name="mm_alpha")]
    assert set(missing_global_scale(_nvfp4_graph(alpha, ["y"]))) == {"W_dq", "W_t", "h"}
    assert missing_global_scale(_nvfp4_graph(alpha, ["y"], scale_one=2.0)) == {}  # the scale is in the DQ
