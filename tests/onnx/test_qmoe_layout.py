"""``fp4pass.onnx.qmoe_layout``: which QMoE weight layout a node holds, the reasons, and the byte maps."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from fp4pass.onnx.lower import lower
from fp4pass.onnx.matching import find_mxfp4
from fp4pass.onnx.qmoe_layout import KERNEL, LAYOUT_KEY, SCHEMA, Hints, detect, kernel_to_schema, schema_to_kernel
from oracles import qmoe_kernel_codes


def _qmoe(hidden: int, inter: int, layout: str, fused: bool = True, experts: int = 2, producer: str = "",
          node_layout: str | None = None, bias: bool = True, codes=None, fusion_attribute: bool = True):
    """A QMoE 'fp4' model; weights written in ``layout`` by this test's own packing (no fp4pass code)."""
    rng = np.random.default_rng(0)
    n1 = 2 * inter if fused else inter
    inits, ins = [], ["x", "router"]
    logical = {}
    for fc, (n, k) in (("fc1", (n1, hidden)), ("fc2", (hidden, inter))):
        c = rng.integers(0, 16, (experts, n, k), dtype=np.uint8) if codes is None else codes[fc]
        logical[fc] = c
        if layout == SCHEMA:  # byte [e, n, j] = c[e, n, 2j] | c[e, n, 2j+1] << 4
            packed = c[:, :, 0::2] | (c[:, :, 1::2] << 4)
        else:  # byte [e, k, j] = c[e, 2j, k] | c[e, 2j+1, k] << 4
            t = c.transpose(0, 2, 1)
            packed = t[:, :, 0::2] | (t[:, :, 1::2] << 4)
        scales = rng.integers(120, 130, (experts, n, k // 32), dtype=np.uint8).view(ml_dtypes.float8_e8m0fnu)
        inits += [numpy_helper.from_array(np.ascontiguousarray(packed), f"{fc}.w"),
                  numpy_helper.from_array(scales, f"{fc}.s"),
                  numpy_helper.from_array(np.ones(experts, np.float32), f"{fc}.g")]
        if bias:
            inits.append(numpy_helper.from_array(np.zeros((experts, n), np.float32), f"{fc}.b"))
        ins += [f"{fc}.w", f"{fc}.s", f"{fc}.b" if bias else ""]
    ins += [""] * 7 + ["fc1.g", "fc2.g"]
    attrs = dict(k=1, activation_type="swiglu" if fused else "relu", expert_weight_bits=4, quant_type="fp4",
                 block_size=32)
    if fused and fusion_attribute:
        attrs["swiglu_fusion"] = 1
    node = helper.make_node("QMoE", ins, ["y"], name="moe", domain="com.microsoft", **attrs)
    if node_layout:
        node.metadata_props.add(key=LAYOUT_KEY, value=node_layout)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["t", hidden]),
                                            helper.make_tensor_value_info("router", TensorProto.FLOAT, ["t", experts])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["t", hidden])], initializer=inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24), helper.make_opsetid("com.microsoft", 1)],
                              ir_version=12, producer_name=producer)
    return ir.serde.deserialize_model(proto), logical


def _node(model):
    return next(n for n in model.graph if n.op_type == "QMoE")


@pytest.mark.parametrize("hidden, inter", [(128, 96), (128, 64), (64, 64), (64, 128)])
@pytest.mark.parametrize("layout", [SCHEMA, KERNEL])
def test_fused_swiglu_layout_is_told_by_the_shapes(hidden, inter, layout):
    model, _ = _qmoe(hidden, inter, layout)
    found = detect(_node(model), 32)
    assert found.layout == layout and found.dims == {"fc1": (2 * inter, hidden), "fc2": (hidden, inter)}
    if 2 * inter == hidden:
        assert "fc1 alone fits both" in found.reason
    if hidden == inter:
        assert "fc2 alone fits both" in found.reason


@pytest.mark.parametrize("layout", [SCHEMA, KERNEL])
def test_swiglu_without_the_fusion_attribute_is_fused(layout):
    """activation_type 'swiglu' alone means fc1 holds gate and up (onnxruntime reads swiglu_fusion 0 as 1):
    N1 = 2 x inter_size. Read as unfused, the sizes would not chain and the node would be declined."""
    model, _ = _qmoe(128, 96, layout, fusion_attribute=False)
    found = detect(_node(model), 32)
    assert found.layout == layout and found.dims == {"fc1": (192, 128), "fc2": (128, 96)}, found.reason


def test_unfused_square_node_is_declined_without_a_hint():
    model, _ = _qmoe(64, 64, KERNEL, fused=False)
    found = detect(_node(model), 32)
    assert found.layout is None and "ambiguous" in found.reason and LAYOUT_KEY in found.reason
    records, declined = find_mxfp4(model)
    assert records == [] and "ambiguous" in declined[0].reason
    lowered, report = lower(model)
    assert not report.lowered and "ambiguous" in report.declined[0]


@pytest.mark.parametrize("how", ["node", "producer", "genai_config", "model_metadata"])
def test_unfused_square_node_uses_the_hints(how, tmp_path):
    model, _ = _qmoe(64, 64, KERNEL, fused=False, node_layout=KERNEL if how == "node" else None,
                     producer="onnxruntime-genai" if how == "producer" else "")
    model_dir = None
    if how == "genai_config":
        (tmp_path / "genai_config.json").write_text(json.dumps({"model": {"type": "gpt_oss"}}))
        model_dir = tmp_path
    if how == "model_metadata":
        model.metadata_props[LAYOUT_KEY] = KERNEL
    found = detect(_node(model), 32, Hints.of(model, model_dir))
    assert found.layout == KERNEL and "shapes fit both layouts" in found.reason
    records, declined = find_mxfp4(model, model_dir)
    assert not declined and [r.layout for r in records] == [KERNEL, KERNEL]


def test_node_metadata_that_contradicts_the_shapes_is_declined():
    model, _ = _qmoe(128, 96, KERNEL, node_layout=SCHEMA)
    found = detect(_node(model), 32)
    assert found.layout is None and "contradicts" in found.reason


def test_shapes_that_fit_neither_layout_are_declined():
    model, _ = _qmoe(128, 96, SCHEMA)
    node = _node(model)
    wrong = ir.Value(name="bad", const_value=ir.tensor(np.full((2, 96, 4), 127, np.uint8)))  # [E, N, K/32] of fc2
    node.replace_input_with(3, wrong)
    found = detect(node, 32)
    assert found.layout is None and "fit neither" in found.reason


def test_bias_decides_against_a_layout_whose_sizes_chain_but_disagree():
    model, _ = _qmoe(128, 64, KERNEL)
    node = _node(model)
    node.replace_input_with(7, ir.Value(name="b2", const_value=ir.tensor(np.zeros((2, 96), np.float32))))
    found = detect(node, 32)
    assert found.layout is None and "bias" in found.reason


@pytest.mark.parametrize("n, k", [(64, 32), (32, 64), (64, 64)])
def test_byte_maps_against_an_independent_decode(n, k):
    rng = np.random.default_rng(n + k)
    kernel = rng.integers(0, 256, (3, k, n // 2), dtype=np.uint8)
    codes = qmoe_kernel_codes(kernel)  # [E, N, K]
    schema = kernel_to_schema(kernel, n, k)
    assert schema.shape == (3, n, k // 2)
    np.testing.assert_array_equal(schema & 0x0F, codes[:, :, 0::2])
    np.testing.assert_array_equal(schema >> 4, codes[:, :, 1::2])
    np.testing.assert_array_equal(schema_to_kernel(schema, n, k), kernel)


@pytest.mark.parametrize("layout", [SCHEMA, KERNEL])
@pytest.mark.parametrize("external", [False, True])
def test_lossless_conversion_writes_the_same_codes_in_the_kernel_layout(layout, external, tmp_path):
    """Every expert within 17 octaves: codes kept, written [E, K, N/2] (bytes equal to a kernel-layout input)."""
    from fp4pass.onnx import convert

    model, logical = _qmoe(128, 64, layout)
    source = model
    if external:
        source = tmp_path / "in.onnx"
        ir.save(model, source, external_data="in.onnx.data", size_threshold_bytes=0)
        model = ir.load(source)
    out_path = tmp_path / "out.onnx"
    _, report = convert(str(source) if external else model, target="ort", output=out_path)
    assert report["summary"]["lossless"] == 2
    out = ir.load(out_path)
    node = _node(out)
    for fc, wi in (("fc1", 2), ("fc2", 5)):
        written = node.inputs[wi].const_value.numpy()
        np.testing.assert_array_equal(qmoe_kernel_codes(written), logical[fc])
        if layout == KERNEL:
            np.testing.assert_array_equal(written, _node(model).inputs[wi].const_value.numpy())


# the hint sources in their documented order, highest first; the producer and genai_config.json only say kernel
_HINT_SOURCES = ["node", "model_metadata", "producer", "genai_config"]
_ONLY_KERNEL = ("producer", "genai_config")
_PRECEDENCE_CASES = [(high, low, says) for i, high in enumerate(_HINT_SOURCES) for low in _HINT_SOURCES[i + 1:]
                     if high not in _ONLY_KERNEL
                     for says in ((SCHEMA, KERNEL) if low not in _ONLY_KERNEL else (SCHEMA,))]


@pytest.mark.parametrize("high, low, high_says", _PRECEDENCE_CASES)
def test_a_higher_hint_wins_over_a_lower_one_that_contradicts_it(high, low, high_says, tmp_path):
    """Each pair of hint sources saying different layouts: the higher one in the documented order decides
    (node metadata, then the model's, then the producer, then genai_config.json), both ways where both can say
    either layout. The weights are written in the layout the higher one names."""
    low_says = KERNEL if high_says == SCHEMA else SCHEMA
    says = {high: high_says, low: low_says}
    model, _ = _qmoe(64, 64, high_says, fused=False, node_layout=says.get("node"),
                     producer="onnxruntime-genai" if "producer" in says else "")
    model_dir = None
    if "model_metadata" in says:
        model.metadata_props[LAYOUT_KEY] = says["model_metadata"]
    if "genai_config" in says:
        (tmp_path / "genai_config.json").write_text(json.dumps({"model": {"type": "gpt_oss"}}))
        model_dir = tmp_path
    found = detect(_node(model), 32, Hints.of(model, model_dir))
    assert found.layout == high_says, found.reason
    records, declined = find_mxfp4(model, model_dir)
    assert not declined and [r.layout for r in records] == [high_says, high_says]


@pytest.mark.parametrize("layout", [SCHEMA, KERNEL])
def test_a_node_whose_inputs_end_after_fc2s_scales_is_read(layout):
    """Inputs 7 (fc2 bias) and later are optional and may be cut off, not just left empty."""
    model, _ = _qmoe(128, 96, layout)
    node = _node(model)
    node.resize_inputs(7)
    found = detect(node, 32)
    assert found.layout == layout and found.dims == {"fc1": (192, 128), "fc2": (128, 96)}, found.reason


@pytest.mark.parametrize("what, reason", [
    ("features", "input has 80 features, not hidden_size=128"),
    ("hidden_size", "attribute hidden_size=130, not 128"),
    ("inter_size", "attribute inter_size=98, not 96"),
    ("fc1_bias", "fc1 bias has 190 outputs, not N=192"),
])
def test_the_sizes_a_node_states_elsewhere_must_agree(what, reason):
    """The input's last dim, the hidden_size / inter_size attributes and the biases each state a size the
    weights must agree with; one that disagrees declines the node, naming it (shapes that fit one layout)."""
    model, _ = _qmoe(128, 96, KERNEL)
    node = _node(model)
    if what == "features":
        node.inputs[0].shape = ir.Shape(["t", 80])
    elif what == "fc1_bias":
        node.inputs[4].const_value = ir.tensor(np.zeros((2, 190), np.float32))
    else:
        node.attributes[what] = ir.AttrInt64(what, 130 if what == "hidden_size" else 98)
    found = detect(node, 32)
    assert found.layout is None and reason in found.reason, found.reason


def test_the_reasons_name_what_decided():
    """The reason strings a report shows, in full, for the shapes alone, the shapes with one ambiguous
    projection, a genai_config.json hint, and shapes that fit neither layout."""
    model, _ = _qmoe(128, 96, KERNEL)
    assert detect(_node(model), 32).reason == "shapes"
    model, _ = _qmoe(128, 64, SCHEMA)
    assert detect(_node(model), 32).reason == "shapes; fc1 alone fits both layouts, the other projection decides"
    model, _ = _qmoe(64, 64, KERNEL, fused=False)
    assert detect(_node(model), 32, Hints(genai_config=True)).reason == (
        "shapes fit both layouts; genai_config.json beside the model (onnxruntime-genai writes the kernel layout)")
    model, _ = _qmoe(128, 96, KERNEL)
    node = _node(model)
    node.inputs[3].const_value = ir.tensor(np.zeros((2, 192, 3), np.uint8))  # fc1 scales: K/32 = 3, not 4
    assert detect(node, 32).reason == (
        "weights fit neither QMoE layout (fc1 weights [2, 128, 96] scales [2, 192, 3]; fc2 weights [2, 96, 64] "
        "scales [2, 128, 3]): schema [E, N, K/2]: fc1, fc2 shapes do not fit; kernel [E, K, N/2]: fc1 shapes do "
        "not fit")


@pytest.mark.parametrize("cut, reason", [
    ("inputs_5", "fc2 weights None / scales None are not 3-D"),
    ("inputs_6", "fc2 weights (2, 96, 64) / scales None are not 3-D"),
    ("no_fc1_weight", "fc1 weights None / scales (2, 192, 4) are not 3-D"),
    ("weight_2d", "fc1 weights (128, 96) / scales (2, 192, 4) are not 3-D"),
    ("experts_differ", "fc1 weights (2, 128, 96) / scales (3, 192, 4) are not 3-D"),
    ("symbolic", "fc1 weights None / scales (2, 192, 4) are not 3-D"),
])
def test_weights_of_unknown_or_wrong_shape_are_declined(cut, reason):
    """detect (also run by the lowering, before any pattern check) on nodes with weights or scales missing,
    cut off, 2-D, with different expert counts, or graph inputs of symbolic shape."""
    model, _ = _qmoe(128, 96, KERNEL)
    node = _node(model)
    if cut == "inputs_5":
        node.resize_inputs(5)
    elif cut == "inputs_6":
        node.resize_inputs(6)
    elif cut == "no_fc1_weight":
        node.replace_input_with(2, None)
    elif cut == "weight_2d":
        node.inputs[2].const_value = ir.tensor(np.zeros((128, 96), np.uint8))
    elif cut == "experts_differ":
        node.inputs[3].const_value = ir.tensor(np.zeros((3, 192, 4), np.uint8))
    else:
        w = ir.Value(name="w_in", shape=ir.Shape(["e", 128, 96]), type=ir.TensorType(ir.DataType.UINT8))
        model.graph.inputs.append(w)
        node.replace_input_with(2, w)
    found = detect(node, 32)
    assert found.layout is None and reason in found.reason, found.reason


def test_weights_given_as_graph_inputs_are_read_from_their_declared_shapes():
    """Weights that are graph inputs of static shape: the layout is told from the declared shapes (the
    pattern then declines them, as they are not stored; the lowering reads the layout the same way)."""
    model, _ = _qmoe(128, 96, KERNEL)
    node = _node(model)
    for index in (2, 5):
        old = node.inputs[index]
        w = ir.Value(name=f"{old.name}_in", shape=ir.Shape(list(old.const_value.shape)),
                     type=ir.TensorType(ir.DataType.UINT8))
        model.graph.inputs.append(w)
        node.replace_input_with(index, w)
    found = detect(node, 32)
    assert found.layout == KERNEL and found.dims == {"fc1": (192, 128), "fc2": (128, 96)}, found.reason


def test_a_scale_shape_that_fits_half_of_a_layouts_rule_is_no_fit():
    """The kernel rule needs both c == 2b and d * B == a: scales whose first dim fits (c == 2b) but whose
    last does not are refused, as are the schema rule's halves."""
    model, _ = _qmoe(128, 96, KERNEL)
    node = _node(model)
    node.inputs[3].const_value = ir.tensor(np.zeros((2, 192, 5), np.uint8))  # c = 192 = 2b; d * 32 = 160 != 128
    node.inputs[6].const_value = ir.tensor(np.zeros((2, 128, 5), np.uint8))  # c = 128 = 2b; d * 32 = 160 != 96
    found = detect(node, 32)
    assert found.layout is None and "fit neither" in found.reason, found.reason
