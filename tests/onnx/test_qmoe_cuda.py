"""The QMoE CUDA-kernel check (tests/qmoe_cuda_check.py): its one-node models and its float32 reference, checked
on the CPU against independent oracles (the float weights the bundled QMoE was built from, the kernel layout
decoded by tests/support/oracles.py, the MoE in float64 numpy); the kernel comparison itself runs where onnxruntime's
CUDA EP does (``ort_cuda``)."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, numpy_helper

from tests import qmoe_cuda_check as Q
from onnx_models import moe_np, qmoe_model
from oracles import E2M1_VALUES, qmoe_kernel_codes, qmoe_nvfp4_kernel_dequant


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(source, original, fp4pass's --target ort conversion) of the h64 builder fixture and the bundled QMoE."""
    import onnx

    chosen = {"ortgenai_gptoss_h64": onnx.load(str(Q.SOURCES["ortgenai_gptoss_h64"])),
              "bundled_qmoe_16x": Q.bundled_qmoe()}
    return {name: (a, b) for name, a, b in Q.pairs(chosen, tmp_path_factory.mktemp("qmoe"))}


def _init(model, name):
    return numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == name))


def _attrs(model) -> dict:
    node = model.graph.node[0]
    return {"k": Q._attr(node, "k"), "alpha": Q._attr(node, "activation_alpha"),
            "beta": Q._attr(node, "activation_beta"), "limit": Q._attr(node, "swiglu_limit")}


def _relative_error(reference: np.ndarray, got: np.ndarray) -> float:
    return float(np.linalg.norm(got.astype(np.float64) - reference) / np.linalg.norm(reference))


def test_the_bundled_fp4_node_in_kernel_layout_runs_as_the_weights_it_was_built_from(converted):
    """The bundled QMoE stores its weights in the schema layout; the one-node model repacks them for the kernel.
    fp4pass's float32 decode of it matches the MoE of the float weights the model was built from (float64)."""
    original, _ = converted["bundled_qmoe_16x"]
    _, w1, b1, w2, b2, _ = qmoe_model(np.random.default_rng(11), "fp4", experts=16, hidden=64, inter=64, tokens=8)
    one = Q.one_node(original, Q.qmoe_nodes(original)[0], TensorProto.FLOAT16)
    assert [i.name for i in one.graph.input] == ["x", "router"] and one.graph.input[0].type.tensor_type.elem_type == 10
    assert _init(one, "fc1_w").shape == (16, 64, 64)  # [E, K=H, N/2 = 2I/2]: the kernel layout
    codes = qmoe_kernel_codes(_init(one, "fc1_w"))
    scales = np.repeat(_init(one, "fc1_s").astype(np.float64), 32, axis=-1)
    np.testing.assert_array_equal(E2M1_VALUES[codes] * scales, w1)
    inputs = Q.feeds(one, 64, np.float16)
    got = Q.float32_reference(one, inputs)
    half = [b.astype(np.float16).astype(np.float64) for b in (b1, b2)]
    with np.errstate(over="ignore"):  # exp(-alpha * gate) of a large negative gate: inf, and SiLU's 0, as it must
        expected = moe_np(inputs["x"].astype(np.float64), inputs["router"].astype(np.float64), w1, half[0], w2,
                          half[1], **_attrs(one))
    assert got.dtype == np.float32 and _relative_error(expected, got) < 1e-5


def test_the_converted_builder_node_decodes_as_the_kernel_reads_it(converted):
    """The nvfp4 node fp4pass wrote for the builder's gpt-oss: bytes kept as written (kernel layout), and the
    float32 reference equals the MoE of the weights tests/support/oracles.py decodes from those bytes."""
    original, nvfp4_model = converted["ortgenai_gptoss_h64"]
    for node in Q.qmoe_nodes(nvfp4_model):
        assert Q._attr(node, "quant_type") == "nvfp4"
        one = Q.one_node(nvfp4_model, node, TensorProto.FLOAT16)
        np.testing.assert_array_equal(_init(one, "fc1_w"), _init(nvfp4_model, node.input[2]))
        w1, w2 = (qmoe_nvfp4_kernel_dequant(_init(one, f"{fc}_w"), _init(one, f"{fc}_s"), _init(one, f"{fc}_g"))
                  for fc in ("fc1", "fc2"))
        inputs = Q.feeds(one, 64, np.float16, seed=3)
        got = Q.float32_reference(one, inputs)
        b1, b2 = (_init(one, f"{fc}_b").astype(np.float64) for fc in ("fc1", "fc2"))
        with np.errstate(over="ignore"):
            expected = moe_np(inputs["x"].astype(np.float64), inputs["router"].astype(np.float64), w1, b1, w2, b2,
                              **_attrs(one))
        assert _relative_error(expected, got) < 1e-5, node.name


def test_check_node_reports_the_float32_agreement_and_a_kernel_refusal(converted):
    original, nvfp4_model = converted["ortgenai_gptoss_h64"]
    name = Q.qmoe_nodes(original)[1].name

    def refuses(model, inputs):
        raise RuntimeError("[ONNXRuntimeError] : 1 : FAIL : QMoE: nvfp4 layout not supported\nmore detail")

    result = Q.check_node("ortgenai_gptoss_h64", original, nvfp4_model, name, 32, run_cuda=refuses).to_json()
    assert result["error"] == "[ONNXRuntimeError] : 1 : FAIL : QMoE: nvfp4 layout not supported"
    assert result["node"] == name and result["experts"] == 4
    assert result["snr_db"]["float32_nvfp4_vs_float32_fp4"] > 100  # lossless experts, float32 order noise at most
    assert set(result["snr_db"]) == {"float32_nvfp4_vs_float32_fp4"}

    def float32_kernel(model, inputs):
        return Q.float32_reference(model, inputs)

    same = Q.check_node("ortgenai_gptoss_h64", original, nvfp4_model, name, 32, run_cuda=float32_kernel).to_json()
    assert same["error"] is None
    assert same["snr_db"]["cuda_nvfp4_vs_float32_nvfp4"] is None and same["snr_db"]["cuda_fp4_vs_float32_fp4"] is None
    assert same["snr_db"]["cuda_nvfp4_vs_cuda_fp4"] == same["snr_db"]["float32_nvfp4_vs_float32_fp4"]


def test_snr_of_identical_nonfinite_and_noisy_outputs():
    a = np.linspace(-1, 1, 100)
    assert Q.snr_db(a, a) is None
    assert np.isnan(Q.snr_db(a, np.where(a > 0.5, np.inf, a)))
    assert Q.snr_db(a, a * 1.01) == pytest.approx(40.0)


@pytest.mark.ort_cuda
def test_nvfp4_on_the_cuda_qmoe_kernel_matches_the_fp4_original_and_our_decode(tmp_path):
    results = []
    for name, original, nvfp4_model in Q.pairs(Q.sources(), tmp_path):
        for node in Q.qmoe_nodes(original):
            results.append(Q.check_node(name, original, nvfp4_model, node.name, 64))
    failures = [r.to_json() for r in results if r.error]
    assert not failures, failures
    for r in results:
        snr = r.snr_db
        # the kernel computes in float16: tens of dB, and about as close to our decode for nvfp4 as for fp4
        assert snr["cuda_nvfp4_vs_float32_nvfp4"] > 30, r.to_json()
        assert snr["cuda_nvfp4_vs_float32_nvfp4"] > snr["cuda_fp4_vs_float32_fp4"] - 3, r.to_json()
