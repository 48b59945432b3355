"""fp4pass.onnx.diff and make_session: figures checked against numpy on onnx.reference outputs."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import onnx_ir as ir
import pytest
from onnx.reference import ReferenceEvaluator

import fp4pass
from fp4pass.errors import ModelError, UsageError
from fp4pass.onnx import runtime
from fp4pass.onnx.numerics import DiffResult, make_inputs
from onnx_models import e2m1, float_matmul_model, mx_matmul_model, random_fp4, save

KEYS = {"name", "shape", "max_abs_err", "mean_abs_err", "rel_l2", "snr_db", "cosine", "p99_abs_err", "nan", "inf"}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A: MXFP4 DQ -> MatMul -> Relu; B: the same with the exact float weight; C: a perturbed weight."""
    folder = tmp_path_factory.mktemp("models")
    rng = np.random.default_rng(0)
    codes, scales = random_fp4(rng, (32, 64), 32, "e8m0", e8m0_range=(124, 129))
    weight = e2m1(codes) * np.repeat(scales.view(ml_dtypes.float8_e8m0fnu).astype(np.float32), 32, -1)
    noisy = (weight + 0.05 * rng.standard_normal(weight.shape)).astype(np.float32)
    return {
        "a": save(mx_matmul_model(codes, scales), folder / "a.onnx"),
        "b": save(float_matmul_model(weight), folder / "b.onnx"),
        "c": save(float_matmul_model(noisy), folder / "c.onnx"),
        "c_proto": float_matmul_model(noisy),
    }


def _reference(path, x):
    import onnx

    evaluator = ReferenceEvaluator(onnx.load(path))
    return evaluator.run(None, {"x": x}, intermediate=True)


def test_identical_models_pass_with_zero_error(pair):
    result = fp4pass.onnx.diff(pair["a"], pair["a"], intermediates=True, snr_min=200)
    assert isinstance(result, DiffResult) and result.passed and result.first_divergent is None
    assert result.provider in ("cpu", "cuda")
    for m in [*result.outputs, *result.intermediates]:
        assert m.snr_db is None and m.max_abs_err == 0 and m.rel_l2 == 0
    js = result.to_json()
    assert set(js) == {"provider", "outputs", "intermediates", "first_divergent", "passed", "notes", "provider_options",
                       "placement"}
    assert all(set(e) == KEYS and e["snr_db"] is None for e in js["outputs"] + js["intermediates"])
    assert {e["name"] for e in js["intermediates"]} >= {"h", "w_t"}


def test_lossy_pair_figures_match_numpy_on_reference_outputs(pair):
    x = np.random.default_rng(7).standard_normal((5, 64)).astype(np.float32)
    result = fp4pass.onnx.diff(pair["a"], pair["c_proto"], inputs={"x": x}, intermediates=True)
    ref_a, ref_c = _reference(pair["a"], x), _reference(pair["c"], x)
    for name, m in {m.name: m for m in [*result.outputs, *result.intermediates]}.items():
        a, b = ref_a[name].astype(np.float64), ref_c[name].astype(np.float64)
        e = (a - b).ravel()
        assert m.shape == a.shape
        assert m.snr_db == pytest.approx(20 * math.log10(np.linalg.norm(a) / np.linalg.norm(e)), abs=1e-3)
        assert m.rel_l2 == pytest.approx(np.linalg.norm(e) / np.linalg.norm(a), rel=1e-4)
        assert m.max_abs_err == pytest.approx(np.abs(e).max(), rel=1e-4, abs=1e-6)
        assert m.mean_abs_err == pytest.approx(np.abs(e).mean(), rel=1e-4)
        assert m.p99_abs_err == pytest.approx(np.percentile(np.abs(e), 99), rel=1e-3, abs=1e-6)
        assert m.cosine == pytest.approx(a.ravel() @ b.ravel() / (np.linalg.norm(a) * np.linalg.norm(b)), abs=1e-9)


def test_lossless_pair_is_identical_or_nearly(pair):
    x = np.random.default_rng(8).standard_normal((3, 64)).astype(np.float32)
    result = fp4pass.onnx.diff(pair["a"], pair["b"], inputs={"x": x}, intermediates=True, snr_min=100)
    assert result.passed
    w_t = next(m for m in result.intermediates if m.name == "w_t")
    assert w_t.snr_db is None and w_t.max_abs_err == 0  # the dequantized weight is exactly the float one


def test_threshold_first_divergent_and_pass_fail(pair):
    result = fp4pass.onnx.diff(pair["a"], pair["c"], intermediates=True, snr_min=80)
    snr = result.outputs[0].snr_db
    assert not result.passed and snr < 80
    # w_t (the weight) is the first tensor in topological order that diverges
    assert result.first_divergent["tensor"] == "w_t" and result.first_divergent["op_type"] == "Transpose"
    loose = fp4pass.onnx.diff(pair["a"], pair["c"], snr_min=snr - 1)
    assert loose.passed
    table = result.format_table()
    assert "FAILED" in table and "first divergent" in table


def test_chunked_intermediates_give_the_same_figures(pair):
    whole = fp4pass.onnx.diff(pair["a"], pair["c"], intermediates=True)
    chunked = fp4pass.onnx.diff(pair["a"], pair["c"], intermediates=True, intermediate_budget_bytes=1)
    # exposing other outputs may change onnxruntime's kernels (constant folding, prepacking): float-order noise
    assert [m.name for m in whole.intermediates] == [m.name for m in chunked.intermediates]
    for w, c in zip([*whole.intermediates, *whole.outputs], [*chunked.intermediates, *chunked.outputs]):
        assert c.snr_db == pytest.approx(w.snr_db, abs=0.05) and c.shape == w.shape


def test_random_inputs_are_seeded_and_symbolic_dims_noted(pair):
    model = ir.load(pair["a"])
    notes = []
    feeds = make_inputs(model, seed=3, notes=notes)
    assert feeds["x"].shape == (1, 64) and "symbolic" in notes[0]
    np.testing.assert_array_equal(feeds["x"], make_inputs(model, seed=3)["x"])
    assert make_inputs(model, seed=3, shapes={"x": (4, 64)})["x"].shape == (4, 64)
    with pytest.raises(UsageError, match="not graph inputs"):
        make_inputs(model, {"nope": np.zeros(1)})
    with pytest.raises(UsageError, match="the input has 2"):
        make_inputs(model, shapes={"x": (1, 2, 3)})


def test_bfloat16_inputs_drawn_or_given_as_npz_raw_bytes(tmp_path):
    """A bfloat16 input: drawn at random (drawn in float32, rounded once), or given in an .npz, which stores an
    ml_dtypes array as raw 2-byte items ('V2'): read back as the same bfloat16 values. An array that cannot be
    cast is one UsageError naming the input."""
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.BFLOAT16, [2, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.BFLOAT16, [2, 8])])
    model = ir.serde.deserialize_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]))
    drawn = make_inputs(model, seed=1)["x"]
    expected = np.random.default_rng(1).standard_normal((2, 8), dtype=np.float32).astype(ml_dtypes.bfloat16)
    assert drawn.dtype == ml_dtypes.bfloat16 and np.array_equal(drawn.view(np.uint16), expected.view(np.uint16))
    np.savez(tmp_path / "x.npz", x=expected)
    raw = np.load(tmp_path / "x.npz")["x"]
    assert raw.dtype.kind == "V"  # what np.load gives back for ml_dtypes arrays
    notes = []
    given = make_inputs(model, {"x": raw}, notes=notes)["x"]
    assert given.dtype == ml_dtypes.bfloat16 and np.array_equal(given.view(np.uint16), expected.view(np.uint16))
    assert "raw 2-byte items" in notes[0]
    with pytest.raises(UsageError, match="input 'x': the given <U1 array cannot be cast"):
        make_inputs(model, {"x": np.full((2, 8), "a")})


def test_bad_models_raise_model_errors(tmp_path, pair):
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"this is not protobuf \xff\xff")
    with pytest.raises(ModelError, match="junk.onnx"):
        fp4pass.onnx.diff(pair["a"], junk)
    with pytest.raises(ModelError, match="no such file"):
        fp4pass.onnx.diff(pair["a"], tmp_path / "missing.onnx")


def test_cuda_requested_without_it_falls_back_with_a_note(pair, monkeypatch):
    monkeypatch.setattr(runtime, "cuda_available", lambda: (False, "no GPU here"))
    session, used, note = runtime.make_session(pair["b"], "cuda")
    assert used == "cpu" and "CUDA requested" in note and "CPU" in note
    assert session.get_providers() == ["CPUExecutionProvider"]
    _, used, note = runtime.make_session(pair["b"], "auto")
    assert used == "cpu" and note is None
    with pytest.raises(UsageError):
        runtime.make_session(pair["b"], "tpu")
    result = fp4pass.onnx.diff(pair["a"], pair["b"], provider="cuda")
    assert result.provider == "cpu" and any("CUDA requested" in n for n in result.notes)


def test_make_session_through_external_data(pair, monkeypatch):
    monkeypatch.setattr(runtime, "_INLINE_LIMIT", 0)  # pretend the model is over 2 GB
    session, _, _ = runtime.make_session(ir.load(pair["b"]), "cpu")
    x = np.ones((2, 64), np.float32)
    expected = ReferenceEvaluator(pair["b"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(session.run(None, {"x": x})[0], expected, rtol=1e-5, atol=1e-4)


@pytest.mark.ort_cuda
def test_cuda_provider_used_where_present(pair):
    result = fp4pass.onnx.diff(pair["a"], pair["b"], provider="cuda")
    assert result.provider == "cuda"


def test_make_session_finds_external_data_beside_the_model_from_any_folder(tmp_path, monkeypatch):
    """An in-memory model whose weight lives in a file beside its .onnx runs wherever the process stands (the
    weight, 8 KiB, is above the size that make_session reads into the model itself)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = np.arange(4 * 512, dtype=np.float32).reshape(4, 512) / 7
    assert w.nbytes > runtime._SMALL_EXTERNAL_BYTES
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 512])],
        [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    folder = tmp_path / "model"
    folder.mkdir()
    onnx.save(model, folder / "m.onnx", save_as_external_data=True, location="m.data", size_threshold=0)
    loaded = ir.load(folder / "m.onnx")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # relative external paths must not be read from the working folder
    session, _, _ = runtime.make_session(loaded, "cpu")
    x = np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4)
    np.testing.assert_allclose(session.run(None, {"x": x})[0], x.astype(np.float64) @ w, rtol=1e-6)


def test_reference_provider_agrees_with_onnxruntime_on_a_w4a4_model(tmp_path):
    """The example MoE with TensorRT activation quantizers: onnx.reference (FP4 DequantizeLinear run as it is,
    the TRT quantizer lowered to standard ops) and onnxruntime CPU (everything lowered) give the same figures
    within float32 summation order; calibration refuses the reference provider with the reason."""
    from pathlib import Path

    from fp4pass.pipeline import convert

    models = Path(__file__).resolve().parents[2] / "models"
    out = tmp_path / "w4a4.onnx"
    convert(str(models / "moe.onnx"), calib=str(models / "calib.npz"), output=str(out), provider="cpu")
    feeds = {"x": np.load(models / "calib.npz")["x"][:16]}
    by_ort = fp4pass.onnx.diff(models / "moe.onnx", out, inputs=feeds, provider="cpu", intermediates=True)
    by_reference = fp4pass.onnx.diff(models / "moe.onnx", out, inputs=feeds, provider="reference",
                                      intermediates=True)
    assert by_reference.provider == "reference" and by_ort.provider == "cpu"
    (o_ort,), (o_ref,) = by_ort.outputs, by_reference.outputs
    assert 10 < o_ref.snr_db < 40 and o_ref.snr_db == pytest.approx(o_ort.snr_db, abs=0.01)
    assert {m.name for m in by_reference.intermediates} >= {"h_act"}
    with pytest.raises(UsageError, match="calibration needs onnxruntime"):
        convert(str(models / "moe.onnx"), calib=str(models / "calib.npz"), provider="reference")
