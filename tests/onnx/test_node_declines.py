"""Nodes that cannot be converted are declined one by one, with their reason, and the rest converts:
QMoE ``fc*_global_scale`` inputs that are not per-expert FP32 tensors of their own, GatherBlockQuantized
tables whose float scales are not powers of two. Plus the slots a QMoE rewrite could confuse (fc1's prior
global scale against fc2's), each given a value of its own."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnx_builders as B
from cli_helpers import cli, one_line
from fp4pass.examples.moe import mxfp4_quantize
from fp4pass.onnx import convert
from oracles import qmoe_nvfp4_kernel_dequant


def replace_init(model: onnx.ModelProto, name: str, array: np.ndarray) -> None:
    tensor = B.init(model, name)
    tensor.CopyFrom(numpy_helper.from_array(array, name))


def qmoe_dequant_in(model: onnx.ModelProto, name: str) -> np.ndarray:
    """e2m1(W) * 2^(S-127) * fc*_global_scale[e] from the 'fp4' input (schema layout), float64."""
    packed = numpy_helper.to_array(B.init(model, f"{name}.weight"))
    w = B.unpack_fp4(packed, [*packed.shape[:2], 2 * packed.shape[2]]).astype(np.float64)
    s = numpy_helper.to_array(B.init(model, f"{name}.scales")).astype(np.float64)
    g = numpy_helper.to_array(B.init(model, f"{name}.global_scale")).astype(np.float64)[:, None, None]
    return w * np.repeat(s, 32, -1) * g


# -- QMoE: fc1's and fc2's prior global scales are distinct slots ---------------------------------------------


@pytest.mark.parametrize("fc1_prior, fc2_prior", [([1.0, 0.5], [4.0, 0.125]), ([2.0, 1.0], [1.0, 1.0]),
                                                  ([1.0, 1.0], [0.25, 8.0]), ([2.0, 2.0], [0.5, 0.5])])
def test_each_qmoe_projection_keeps_its_own_prior_global_scale(fc1_prior, fc2_prior):
    """Every dequantized value after the rewrite equals the input's, per projection, with priors that differ
    between fc1 and fc2 (and one of them all ones, which the rewrite treats as absent): reading fc2's prior
    from fc1's input, or either from the other's, changes the values of at least one expert."""
    original = B.qmoe_model(global_scale=fc1_prior, fc2_global_scale=fc2_prior)
    out, report = convert(original, target="ort")
    onnx.checker.check_model(out, full_check=True)
    for name in ("fc1", "fc2"):
        before = qmoe_dequant_in(original, name)
        w_out = numpy_helper.to_array(B.init(out, f"{name}.weight"))
        s_out = numpy_helper.to_array(B.init(out, f"{name}.weight_scale_e4m3"))
        g_out = numpy_helper.to_array(B.init(out, f"{name}.global_scale"))
        assert np.array_equal(before, qmoe_nvfp4_kernel_dequant(w_out, s_out, g_out)), name
    assert [t["name"] for t in report["tensors"]] == ["fc1.weight", "fc2.weight"]
    assert not {"fc1.scales", "fc2.scales"} & {t.name for t in out.graph.initializer}  # E8M0 scales dropped


@pytest.mark.parametrize("inputs", [17, 15])
def test_the_rewritten_qmoe_values_carry_their_types_and_shapes(inputs):
    """Through the onnx_ir API the model comes back as an onnx_ir.Model: each value the rewrite set (the
    weights in the kernel layout, the E4M3 scales, the global scales, kept or added) has the type and shape
    of its tensor, as a later pass (or the caller) reads them."""
    import onnx_ir as ir

    proto = B.qmoe_model(e=3, global_scale=[1.0, 0.5, 2.0], fc2_global_scale=[2.0, 0.25, 1.0])
    del proto.graph.node[0].input[inputs:]
    model, _ = convert(ir.serde.deserialize_model(proto), target="ort")
    node = next(n for n in model.graph if n.op_type == "QMoE")
    want = {2: (ir.DataType.UINT8, [3, 64, 32]), 3: (ir.DataType.FLOAT8E4M3FN, [3, 64, 4]),
            5: (ir.DataType.UINT8, [3, 32, 32]), 6: (ir.DataType.FLOAT8E4M3FN, [3, 64, 2]),
            15: (ir.DataType.FLOAT, [3]), 16: (ir.DataType.FLOAT, [3])}
    for index, (dtype, shape) in want.items():
        value = node.inputs[index]
        assert value.dtype == dtype and value.shape is not None and list(value.shape) == shape, index
        assert list(value.const_value.shape) == shape and value.const_value.dtype == dtype, index


@pytest.mark.parametrize("inputs", [15, 16, 8])
def test_a_qmoe_without_trailing_global_scale_inputs_gets_them(inputs):
    """The node's input list may end before fc1_global_scale (15 inputs or fewer) or before fc2's (16): the
    rewrite appends the missing ones, and every value dequantizes as before (priors of 1 where absent)."""
    original = B.qmoe_model(global_scale=[1.0, 0.5], fc2_global_scale=[2.0, 0.25])
    node = original.graph.node[0]
    del node.input[inputs:]
    kept = {name for name in node.input}
    for tensor in list(original.graph.initializer):
        if tensor.name.endswith("global_scale") and tensor.name not in kept:
            original.graph.initializer.remove(tensor)
            original.graph.initializer.append(numpy_helper.from_array(np.ones(2, np.float32), tensor.name))
    out, report = convert(original, target="ort")
    onnx.checker.check_model(out, full_check=True)
    assert len(out.graph.node[0].input) == 17
    for name in ("fc1", "fc2"):
        before = qmoe_dequant_in(original, name)  # absent inputs read as the ones written above
        names = list(out.graph.node[0].input)
        g_name = names[15 if name == "fc1" else 16]
        w_out = numpy_helper.to_array(B.init(out, f"{name}.weight"))
        s_out = numpy_helper.to_array(B.init(out, f"{name}.weight_scale_e4m3"))
        g_out = numpy_helper.to_array(B.init(out, g_name))
        assert np.array_equal(before, qmoe_nvfp4_kernel_dequant(w_out, s_out, g_out)), name


# -- QMoE: the global scale inputs are validated, the node declined with the reason ---------------------------


def qmoe_with(change) -> onnx.ModelProto:
    model = B.qmoe_model(global_scale=[1.0, 0.5], fc2_global_scale=[2.0, 0.25])
    change(model)
    return model


def _point_input(index: int, name: str):
    def change(model):
        model.graph.node[0].input[index] = name
    return change


CASES = {
    "wrong_length": (lambda m: replace_init(m, "fc2.global_scale", np.ones(3, np.float32)),
                     "fc2 global scale 'fc2.global_scale' (input 16) has shape [3]; one FP32 scale per expert, [2]"),
    "two_dims": (lambda m: replace_init(m, "fc1.global_scale", np.ones((2, 1), np.float32)),
                 "fc1 global scale 'fc1.global_scale' (input 15) has shape [2, 1]"),
    "scalar": (lambda m: replace_init(m, "fc1.global_scale", np.array(1.0, np.float32)),
               "has shape []"),
    "float16": (lambda m: replace_init(m, "fc2.global_scale", np.ones(2, np.float16)), "is FLOAT16, not FLOAT"),
    "nan": (lambda m: replace_init(m, "fc1.global_scale", np.array([1.0, np.nan], np.float32)), "holds nan"),
    "names_own_weight": (_point_input(15, "fc1.weight"), "(input 15) is also input 2 of the node"),
    "names_other_weight": (_point_input(16, "fc1.weight"), "(input 16) is also input 2 of the node"),
    "names_scales": (_point_input(15, "fc2.scales"), "(input 15) is also input 6 of the node"),
    "one_for_both": (_point_input(16, "fc1.global_scale"), "fc1 global scale 'fc1.global_scale' (input 15) is also "
                                                             "input 16"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_qmoe_with_bad_global_scale_inputs_is_declined_with_its_reason(case):
    change, reason = CASES[case]
    model = qmoe_with(change)
    out, report = convert(model, target="ort")
    assert report["tensors"] == []
    (declined,) = report["declined"]
    assert declined["pattern"] == "qmoe" and declined["node"] == "moe"
    assert reason in declined["reason"], declined["reason"]
    assert [a.s for a in out.graph.node[0].attribute if a.name == "quant_type"] == [b"fp4"]


@pytest.mark.parametrize("case", ["wrong_length", "names_own_weight"])
def test_diff_leaves_such_a_qmoe_unlowered_and_exits_2(tmp_path, capsys, caplog, case):
    """diff lowers QMoE 'fp4' for onnxruntime; a global scale of the wrong size was an exit 3 there (a reshape
    error). It is left unlowered with the reason, and the runtime's refusal is the one error line."""
    onnx.save(qmoe_with(CASES[case][0]), tmp_path / "m.onnx")
    code, err = cli(capsys, "diff", tmp_path / "m.onnx", tmp_path / "m.onnx", "--quiet")
    assert code == 2 and "Traceback" not in err, err
    assert "m.onnx" in one_line(err)  # the runtime's refusal of the unlowered QMoE, in one line
    assert "values for 2 experts" in caplog.text  # the lowering's warning names the reason


def test_zero_experts_is_declined(tmp_path, capsys):
    model = B.qmoe_model(e=2)
    for name in ("fc1", "fc2"):
        for suffix in ("weight", "scales", "global_scale"):
            array = numpy_helper.to_array(B.init(model, f"{name}.{suffix}"))
            replace_init(model, f"{name}.{suffix}", array[:0])
    _, report = convert(model, target="ort")
    assert report["declined"][0]["reason"] == "the weights hold zero experts"
    onnx.save(model, tmp_path / "m.onnx")
    code, err = cli(capsys, "convert", tmp_path / "m.onnx", "-o", tmp_path / "o.onnx", "--target", "ort",
                    "--allow-invalid")
    assert code == 0 and "Traceback" not in err, err
    assert "declined" in err


def test_a_valid_qmoe_still_converts_through_the_cli(tmp_path, capsys):
    """The control of the declines above: the same model, unchanged, converts with the full checker passing."""
    onnx.save(qmoe_with(lambda m: None), tmp_path / "m.onnx")
    code, err = cli(capsys, "convert", tmp_path / "m.onnx", "-o", tmp_path / "o.onnx", "--target", "ort", "--quiet")
    assert code == 0, err
    onnx.checker.check_model(onnx.load(tmp_path / "o.onnx"), full_check=True)


# -- GatherBlockQuantized: float scales must be powers of two --------------------------------------------------


def gbq_and_linear_model(table_scale_values=None) -> onnx.ModelProto:
    """A GatherBlockQuantized table and an MXFP4 DQ -> MatMul weight beside it (the neighbour that must still
    convert). ``table_scale_values``: {flat index: value} written over the table's power-of-two scales."""
    codes, scales = mxfp4_quantize(B.weight((8, 64), 4))
    scales = scales.astype(np.float32)
    for index, value in (table_scale_values or {}).items():
        scales.reshape(-1)[index] = value
    inits = [numpy_helper.from_array(codes, "emb"), numpy_helper.from_array(scales, "emb_scale"),
             *B.mx_inits("W", B.weight((48, 64), 5))]
    nodes = [helper.make_node("GatherBlockQuantized", ["emb", "ids", "emb_scale"], ["e"], name="gather",
                              domain="com.microsoft", gather_axis=0, quantize_axis=1, block_size=32),
             B.dq_node("W"),
             helper.make_node("Transpose", ["W_dq"], ["W_t"], name="t", perm=[1, 0]),
             helper.make_node("MatMul", ["e", "W_t"], ["y"], name="mm")]
    return B.make(nodes, [B.vi("ids", ["t"], TensorProto.INT64)], [B.vi("y", ["t", 48])], inits, opsets=B.MS_OPSET)


@pytest.mark.parametrize("bad, shown", [(0.75, "0.75"), (3.0, "3.0"), (-0.5, "-0.5"), (0.0, "0.0"),
                                        (2.0**-130, "7.3"), (np.inf, "inf")])
def test_a_table_with_a_non_power_of_two_scale_is_declined_and_its_neighbour_converts(bad, shown):
    """0.75 is the case that must never become 0.5 with a lossless verdict: the table keeps its own scales,
    the report names the node, the scale and where (flat index 5 of [8, 2] is [2, 1]), and the MXFP4 weight
    beside it converts."""
    original = gbq_and_linear_model({5: bad})
    out, report = convert(original)
    assert [t["name"] for t in report["tensors"]] == ["W"]
    (declined,) = report["declined"]
    assert (declined["pattern"], declined["node"], declined["tensor"]) == ("gbq", "gather", "emb")
    assert "'emb_scale'" in declined["reason"] and shown in declined["reason"] and "[2, 1]" in declined["reason"]
    table_scales = numpy_helper.to_array(B.init(out, "emb_scale"))
    assert table_scales.reshape(-1)[5] == np.float32(bad) or (np.isnan(bad) and np.isnan(table_scales.reshape(-1)[5]))
    assert np.array_equal(B.mx_dequant(original, "W", "W_scale"), B.nv_dequant(out, "W"))


def test_the_cli_declines_the_table_and_exits_0(tmp_path, capsys):
    onnx.save(gbq_and_linear_model({1: 0.75}), tmp_path / "m.onnx")
    code, err = cli(capsys, "convert", tmp_path / "m.onnx", "-o", tmp_path / "o.onnx", "--quiet")
    assert code == 0, err
    out = onnx.load(tmp_path / "o.onnx")
    assert numpy_helper.to_array(B.init(out, "emb_scale")).reshape(-1)[1] == np.float32(0.75)


@pytest.mark.parametrize("k", [-127, -1, 0, 5, 127])
def test_power_of_two_table_scales_across_e8m0s_range_are_converted(k):
    """The other side of the rule: 2^k at both ends of E8M0's range is MXFP4 and converts; where the block
    exponents stay within E4M3's window (k = -1, 0, 5 here) the NVFP4 table dequantizes to the same values
    (from the output's own initializers, ml_dtypes)."""
    original = gbq_and_linear_model()
    scales = numpy_helper.to_array(B.init(original, "emb_scale")).copy()
    scales[0, 0] = np.float32(2.0**k)
    replace_init(original, "emb_scale", scales)
    out, report = convert(original)
    assert sorted(t["name"] for t in report["tensors"]) == ["W", "emb"] and report["declined"] == []
    if abs(k) < 100:
        assert np.array_equal(B.mx_dequant(original, "emb", "emb_scale"), B.nv_dequant(out, "emb"))
