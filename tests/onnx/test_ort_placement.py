"""onnxruntime's CUDA EP as a numerics check sees it: TF32 off on every CUDA session (and read back), where each
node ran (from onnxruntime's profile), and a diff's notes kept in its JSON and its table.

The CPU tests use onnxruntime's real profile format: a CPU session's own profile, and synthetic events shaped
as onnxruntime writes them for a CUDA session (``"<node>_kernel_time"`` events of category "Node" whose
``args.provider`` is the EP). The ``ort_cuda`` tests run where onnxruntime's CUDA EP loads (tests/gpu_check.sh).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

import fp4pass
from fp4pass.onnx import numerics, runtime
from fp4pass.onnx.numerics import DiffResult
from fp4pass.onnx.runtime import Placement, node_placement

ROOT = Path(__file__).resolve().parents[2]
MOE = str(ROOT / "models" / "moe.onnx")
CALIB = str(ROOT / "models" / "calib.npz")
CUDA, CPU = "CUDAExecutionProvider", "CPUExecutionProvider"


def _weighted_model(extra_nodes=(), extra_inits=(), name="mm") -> onnx.ModelProto:
    """y = Relu(x @ W + b): W [64, 64] (4096 elements: a weight), b [64] (below the weight size)."""
    rng = np.random.default_rng(3)
    w = numpy_helper.from_array(rng.standard_normal((64, 64)).astype(np.float32), "W")
    b = numpy_helper.from_array(rng.standard_normal(64).astype(np.float32), "b")
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"], name=name),
             helper.make_node("Add", ["h", "b"], ["hb"], name="bias"),
             helper.make_node("Relu", ["hb"], ["y"], name="relu"), *extra_nodes]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 64])]
    outputs += [helper.make_tensor_value_info(n.output[0], TensorProto.FLOAT, None) for n in extra_nodes]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 64])],
                              outputs, [w, b, *extra_inits])
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=9)


def _event(node: str, op: str, provider: str, cat: str = "Node") -> dict:
    """One node event as onnxruntime's profiler writes it (the args fp4pass reads, and a few it does not)."""
    return {"cat": cat, "pid": 1, "tid": 1, "dur": 5, "ts": 10, "ph": "X", "name": f"{node}_kernel_time",
            "args": {"op_name": op, "provider": provider, "node_index": "0", "parameter_size": "0",
                     "activation_size": "512", "output_size": "512"}}


class _FakeSession:
    """Stands in for ``ort.InferenceSession``: records what it was built with, reports the CUDA EP."""

    made: list = []

    def __init__(self, source, options, providers):
        self.providers = providers
        _FakeSession.made.append(self)

    def get_providers(self):
        return [CUDA, CPU]

    def get_provider_options(self):
        return {CUDA: {"use_tf32": "0", "device_id": "0"}, CPU: {}}


def test_cuda_sessions_are_built_with_tf32_off(monkeypatch):
    monkeypatch.setattr(runtime, "cuda_available", lambda: (True, None))
    monkeypatch.setattr(runtime.ort, "InferenceSession", _FakeSession)
    _FakeSession.made.clear()
    session, used, note = runtime.make_session(_weighted_model(), "cuda")
    assert used == "cuda" and note is None
    assert session.providers == [(CUDA, {"use_tf32": "0"}), CPU]
    assert runtime.provider_options(session) == {"use_tf32": "0"}  # read back, only the keys fp4pass sets
    runtime.make_session(_weighted_model(), "auto")
    assert _FakeSession.made[-1].providers[0] == (CUDA, {"use_tf32": "0"})
    runtime.make_session(_weighted_model(), "cpu")
    assert _FakeSession.made[-1].providers == [CPU]


def test_the_cuda_probe_preloads_the_cuda_libraries_first_and_quietly(monkeypatch, capsys):
    """onnxruntime-gpu finds the nvidia-* packages' CUDA libraries only after preload_dlls() (or torch's own
    loading): the probe calls it before its first CUDA session. What preload_dlls prints (the libraries it
    could not load, a link) stays off the user's terminal: the probe's reason says it once."""
    calls = []

    class FakeOrt:
        def get_available_providers(self):
            return [CUDA, CPU]

        def preload_dlls(self):
            calls.append("preload")
            print("Failed to load libcublasLt.so.13: cannot open shared object file")
            print("Please follow https://onnxruntime.ai/docs/install/#cuda-and-cudnn", file=sys.stderr)

        def SessionOptions(self):  # noqa: N802 - onnxruntime's name
            return SimpleNamespace(log_severity_level=0)

        def set_default_logger_severity(self, level):
            calls.append(f"severity {level}")

        def InferenceSession(self, source, options, providers):  # noqa: N802
            calls.append("session")
            raise RuntimeError("no GPU")

    monkeypatch.setattr(runtime, "ort", FakeOrt())
    monkeypatch.setattr(runtime, "_warn_if_both_installed", lambda: None)
    ok, why = runtime.cuda_available.__wrapped__()
    assert not ok and "failed to start (no GPU)" in why
    assert calls.index("preload") < calls.index("session")
    assert capsys.readouterr() == ("", "")


def test_provider_options_of_a_cpu_session_are_empty():
    session, used, _ = runtime.make_session(_weighted_model(), "cpu")
    assert used == "cpu" and runtime.provider_options(session) == {}


def _model_ir(proto: onnx.ModelProto) -> ir.Model:
    return ir.serde.deserialize_model(proto)


def test_placement_counts_each_node_once_and_leaves_memcpy_out():
    model = _model_ir(_weighted_model())
    run = [_event("mm", "MatMul", CUDA), _event("bias", "Add", CUDA), _event("relu", "Relu", CUDA),
           _event("Memcpy_token_1", "MemcpyFromHost", CUDA), _event("Memcpy_token_2", "MemcpyToHost", CPU)]
    session_event = {"cat": "Session", "name": "model_run", "args": {}}
    placement = node_placement([session_event, *run, *run], model)  # two runs in one profile
    assert placement.nodes == {"cuda": 3}
    assert placement.weight_nodes == 1 and placement.weight_nodes_on_cpu == [] and placement.on_cpu == []
    assert placement.provider_label() == "cuda"


def test_shape_nodes_on_the_cpu_keep_the_label_cuda():
    model = _model_ir(_weighted_model())
    events = [_event("mm", "MatMul", CUDA), _event("bias", "Add", CPU), _event("relu", "Relu", CPU)]
    placement = node_placement(events, model)
    assert placement.nodes == {"cuda": 1, "cpu": 2} and placement.on_cpu == [("bias", "Add"), ("relu", "Relu")]
    assert placement.provider_label() == "cuda"  # the weight node ran on the GPU
    assert placement.to_json() == {"nodes": {"cuda": 1, "cpu": 2}, "on_cpu": ["bias (Add)", "relu (Relu)"],
                                   "weight_nodes": 1, "weight_nodes_on_cpu": []}


def test_a_weight_node_on_the_cpu_names_every_cpu_node_in_the_label():
    model = _model_ir(_weighted_model())
    events = [_event("mm", "MatMul", CPU), _event("bias", "Add", CUDA), _event("relu", "Relu", CPU)]
    placement = node_placement(events, model)
    assert placement.weight_nodes_on_cpu == ["mm"]
    assert placement.provider_label() == "cuda (2 nodes on cpu)"


def test_weight_nodes_are_matched_by_whole_name():
    """'layers.1' reads the weight; 'layers.10' (an elementwise node onnxruntime added) does not: a node whose
    name only starts like a weight node's is not one."""
    model = _model_ir(_weighted_model(name="layers.1"))
    placement = node_placement([_event("layers.10", "Relu", CPU), _event("layers.1", "MatMul", CUDA)], model)
    assert placement.weight_nodes == 1 and placement.weight_nodes_on_cpu == []
    assert placement.provider_label() == "cuda"
    placement = node_placement([_event("layers.1", "MatMul", CPU)], model)
    assert placement.weight_nodes_on_cpu == ["layers.1"]


def test_a_node_reading_a_weight_through_constant_only_nodes_reads_weights():
    """x @ Transpose(Cast(W)) and Shape(x): the Cast and Transpose of the weight (constant-only: onnxruntime may
    fold them) and the MatMul at the end read weights; Shape, reading the activation, does not. So does a node
    reading a large Constant node's value; a small one is not a weight."""
    w = numpy_helper.from_array(np.ones((64, 64), np.float16), "W16")
    nodes = [helper.make_node("Cast", ["W16"], ["w32"], to=TensorProto.FLOAT, name="cast"),
             helper.make_node("Transpose", ["w32"], ["wt"], name="transpose"),
             helper.make_node("MatMul", ["x", "wt"], ["y"], name="matmul"),
             helper.make_node("Shape", ["x"], ["s"], name="shape"),
             helper.make_node("Constant", [], ["big"], name="const_big",
                              value=numpy_helper.from_array(np.ones((32, 64), np.float32))),
             helper.make_node("Constant", [], ["small"], name="const_small",
                              value=numpy_helper.from_array(np.ones(64, np.float32))),
             helper.make_node("Add", ["y", "big"], ["z"], name="add_big"),
             helper.make_node("Add", ["z", "small"], ["out"], name="add_small")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [32, 64])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [32, 64]),
                               helper.make_tensor_value_info("s", TensorProto.INT64, [2])], [w])
    model = _model_ir(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9))
    readers, names = runtime.weight_nodes(model)
    assert readers == {"cast", "transpose", "matmul", "add_big"}
    assert names == {n.name for n in nodes}


def test_nodes_onnxruntime_fused_count_as_weight_nodes_by_op_type():
    """A fusion names its node anew (MatMul + Add -> Gemm "mm_bias_fused"): no node of the graph has that name,
    so its op type decides; a renamed elementwise node does not read weights."""
    model = _model_ir(_weighted_model())
    events = [_event("mm/Gemm_fused", "Gemm", CPU), _event("relu_fused", "Relu", CPU)]
    placement = node_placement(events, model)
    assert placement.weight_nodes == 1 and placement.weight_nodes_on_cpu == ["mm/Gemm_fused"]


def _profiled_cpu_run(folder, optimize: bool) -> list[dict]:
    import onnxruntime as ort

    options = ort.SessionOptions()
    if not optimize:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    runtime.profiling(options, folder)
    session = ort.InferenceSession(_weighted_model().SerializeToString(), options, providers=[CPU])
    for _ in range(2):
        session.run(None, {"x": np.ones((4, 64), np.float32)})
    events = runtime.end_profile(session)
    assert list(Path(folder).iterdir()) == []  # the profile file is removed after reading
    return events


def test_placement_of_a_real_cpu_session_profile(tmp_path):
    """onnxruntime's own profile of two CPU runs, graph as given: every node on the CPU EP, the MatMul the one
    weight node."""
    placement = node_placement(_profiled_cpu_run(tmp_path, optimize=False), _model_ir(_weighted_model()))
    assert placement.nodes == {"cpu": 3}
    assert sorted(placement.on_cpu) == [("bias", "Add"), ("mm", "MatMul"), ("relu", "Relu")]
    assert placement.weight_nodes == 1 and placement.weight_nodes_on_cpu == ["mm"]


def test_placement_of_a_real_profile_after_onnxruntime_fused_the_weight_node(tmp_path):
    """With onnxruntime's default optimizations MatMul + Add + Relu run as one FusedGemm under a new name: it
    still counts as the weight node."""
    placement = node_placement(_profiled_cpu_run(tmp_path, optimize=True), _model_ir(_weighted_model()))
    assert placement.nodes == {"cpu": 1} and [op for _, op in placement.on_cpu] == ["FusedGemm"]
    assert placement.weight_nodes == 1 and placement.weight_nodes_on_cpu == [placement.on_cpu[0][0]]


def test_placement_of_the_bundled_moe_lowered_as_diff_runs_it(tmp_path):
    """The bundled MoE lowered for onnxruntime (MXFP4 DQ -> GatherBlockQuantized -> Transpose -> MatMul per
    projection), profiled on the CPU: the two dequantizations and the two expert products (fused by onnxruntime
    with their Transposes, under new names) read weights; the router's MatMul (a [64, 4] weight, below the
    weight size), the activation and the routing arithmetic do not."""
    import onnxruntime as ort

    from fp4pass.onnx.loading import load
    from fp4pass.onnx.lower import lower

    lowered, _ = lower(load(MOE).model)
    options = ort.SessionOptions()
    runtime.profiling(options, tmp_path)
    session, _, _ = runtime.make_session(lowered, "cpu", options=options)
    session.run(None, {"x": np.load(CALIB)["x"][:4]})
    placement = node_placement(runtime.end_profile(session), lowered)
    ops = dict(placement.on_cpu)
    assert placement.weight_nodes == 4 and len(placement.weight_nodes_on_cpu) == 4
    assert sorted(ops[n] for n in placement.weight_nodes_on_cpu) == [
        "FusedMatMul", "FusedMatMul", "GatherBlockQuantized", "GatherBlockQuantized"]
    assert "router" in ops and "router" not in placement.weight_nodes_on_cpu


def _runner(label: str, placement: Placement | None, provider: str = "cuda"):
    return SimpleNamespace(label=label, placement=placement, provider=provider)


def test_diff_provider_says_how_many_nodes_fell_back_and_notes_which():
    on_gpu = Placement({"cuda": 3, "cpu": 1}, [("shape", "Shape")], 1, [])
    fell_back = Placement({"cuda": 1, "cpu": 2}, [("layers.10/qmm", "DynamicQuantizeMatMul"), ("relu", "Relu")],
                          2, ["layers.10/qmm"])
    notes: list[str] = []
    provider, placement = numerics._placement(_runner("a.onnx", on_gpu), _runner("b.onnx", fell_back), notes)
    assert provider == "cuda (2 nodes on cpu)"
    assert placement == {"original": on_gpu.to_json(), "rewritten": fell_back.to_json()}
    assert notes == ["b.onnx: 1 of its 2 nodes that read weights ran on the CPU EP (no CUDA kernel): 'layers.10/qmm'"]
    notes.clear()
    provider, _ = numerics._placement(_runner("a.onnx", on_gpu), _runner("b.onnx", on_gpu), notes)
    assert provider == "cuda" and notes == []
    assert numerics._placement(_runner("a", None, "cpu"), _runner("b", None, "cpu"), notes) == ("cpu", None)


def test_a_cpu_diff_reports_no_placement_and_no_cuda_options():
    result = fp4pass.onnx.diff(MOE, MOE, provider="cpu")
    data = result.to_json()
    assert data["provider"] == "cpu" and data["placement"] is None and data["provider_options"] == {}


@pytest.fixture(scope="module")
def alpha_diff(tmp_path_factory):
    """The README's Python example: the bundled MoE converted in the alpha form with 4-bit activations, diffed
    with intermediates."""
    model, _ = fp4pass.onnx.convert(MOE, scale_form="alpha", calib=CALIB, provider="cpu")
    return fp4pass.onnx.diff(MOE, model, inputs=CALIB, intermediates=True, provider="cpu")


def test_notes_are_in_the_json_and_the_table(alpha_diff):
    alpha_notes = [n for n in alpha_diff.notes if "alpha form" in n]
    assert alpha_notes, alpha_diff.notes
    assert alpha_diff.to_json()["notes"] == alpha_diff.notes
    table = alpha_diff.format_table()
    lines = table.splitlines()
    for note in alpha_diff.notes:
        assert f"note: {note}" in lines
    assert lines[-1].startswith(("PASSED", "FAILED"))  # the verdict stays last
    assert not any(line.startswith("note: ") for line in alpha_diff.format_table(notes=False).splitlines())


def test_a_table_without_notes_has_no_note_lines():
    from fp4pass.metrics import compare

    a = np.linspace(1, 2, 8)
    result = DiffResult("cpu", [compare("y", a, a + 1e-3)], [], None, True)
    assert "note:" not in result.format_table()
    result.notes.append("input 'x' dim 0 (batch) is symbolic; used 1")
    assert result.format_table().splitlines()[-2] == "note: input 'x' dim 0 (batch) is symbolic; used 1"


# --- onnxruntime's CUDA EP (tests/gpu_check.sh runs these) ---------------------------------------------------


def _dynamic_quantize_matmul_model() -> onnx.ModelProto:
    """The weighted model plus com.microsoft DynamicQuantizeMatMul (int8 weight [64, 64]), which onnxruntime
    runs on the CPU EP only."""
    rng = np.random.default_rng(5)
    b_q = numpy_helper.from_array(rng.integers(-127, 128, (64, 64)).astype(np.int8), "Bq")
    scale = numpy_helper.from_array(np.array([0.01], np.float32), "Bq_scale")
    node = helper.make_node("DynamicQuantizeMatMul", ["y", "Bq", "Bq_scale"], ["q"], domain="com.microsoft",
                            name="layers.10/qmm")
    return _weighted_model([node], [b_q, scale])


@pytest.mark.ort_cuda
def test_tf32_is_off_on_the_cuda_ep():
    """A float32 MatMul of K = 4096 on the CUDA EP keeps float32's precision (relative error ~1e-6 against
    float64); the same session with TF32 on loses ~3 digits (TF32 keeps 10 mantissa bits)."""
    import onnxruntime as ort

    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 4096)).astype(np.float32)
    w = rng.standard_normal((4096, 256)).astype(np.float32)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [256, 256])],
                              [numpy_helper.from_array(w, "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    exact = x.astype(np.float64) @ w.astype(np.float64)

    def rel_err(y):
        return np.linalg.norm(y - exact) / np.linalg.norm(exact)

    session, used, _ = runtime.make_session(model, "cuda")
    assert used == "cuda" and session.get_providers()[0] == CUDA
    assert runtime.provider_options(session) == {"use_tf32": "0"}
    off = rel_err(session.run(None, {"x": x})[0])
    tf32 = ort.InferenceSession(model.SerializeToString(), providers=[(CUDA, {"use_tf32": "1"}), CPU])
    on = rel_err(tf32.run(None, {"x": x})[0])
    assert off < 1e-5, off
    assert on > 10 * off, (on, off)


@pytest.mark.ort_cuda
def test_a_weight_op_without_a_cuda_kernel_is_reported():
    proto = _dynamic_quantize_matmul_model()
    result = fp4pass.onnx.diff(proto, proto, provider="cuda")
    assert result.provider.startswith("cuda (") and result.provider.endswith(" nodes on cpu)"), result.provider
    assert result.placement["original"]["weight_nodes_on_cpu"] == ["layers.10/qmm"]
    assert any("'layers.10/qmm'" in note and "ran on the CPU EP" in note for note in result.notes)
    assert result.provider_options == {"use_tf32": "0"}
    plain = fp4pass.onnx.diff(_weighted_model(), _weighted_model(), provider="cuda")
    assert plain.provider == "cuda" and plain.placement["original"]["nodes"].get("cuda", 0) >= 1


def _bundled_onnx() -> list[str]:
    """Every ONNX model in models/ and tests/fixtures/ (the producers' real files included)."""
    found = sorted(str(p) for p in (ROOT / "models").glob("*.onnx"))
    found += sorted(str(p) for p in (ROOT / "tests" / "fixtures").rglob("*.onnx"))
    return found


def _close_in_db(cpu: float | None, cuda: float | None) -> bool:
    """Two SNRs agree: within 0.5 dB, or both above 60 dB (float32 rounding noise: any order of sums)."""
    high = [s is None or s == math.inf or s > 60 for s in (cpu, cuda)]
    if all(high):
        return True
    return None not in (cpu, cuda) and abs(cpu - cuda) <= 0.5


@pytest.mark.ort_cuda
@pytest.mark.parametrize("path", _bundled_onnx(), ids=lambda p: str(Path(p).relative_to(ROOT)))
def test_cuda_diff_of_each_bundled_model_and_its_conversion_agrees_with_the_cpu(path, tmp_path):
    converted = tmp_path / "converted.onnx"
    try:
        fp4pass.onnx.convert(path, output=str(converted), provider="cpu")
    except fp4pass.FP4PassError as exc:
        pytest.skip(f"fp4pass does not convert it: {exc}")
    pairs = {"itself": (path, path), "converted": (path, str(converted))}
    for what, (a, b) in pairs.items():
        try:
            on_cpu = fp4pass.onnx.diff(a, b, provider="cpu")
        except fp4pass.FP4PassError as exc:  # AMD Quark's custom ops need Quark's own library
            pytest.skip(f"onnxruntime cannot run it on the CPU either: {exc}")
        on_cuda = fp4pass.onnx.diff(a, b, provider="cuda")
        assert on_cuda.provider == "cuda", (what, on_cuda.provider, on_cuda.placement)
        assert on_cuda.provider_options == {"use_tf32": "0"}
        cpu_snr = {m.name: m.snr_db for m in on_cpu.outputs}
        for m in on_cuda.outputs:
            assert _close_in_db(cpu_snr[m.name], m.snr_db), (what, m.name, cpu_snr[m.name], m.snr_db)


@pytest.mark.ort_cuda
def test_diff_json_on_cuda_reports_the_options_and_the_placement(tmp_path):
    import json

    from fp4pass.cli import main

    report = tmp_path / "diff.json"
    assert main(["diff", MOE, MOE, "--provider", "cuda", "--inputs", CALIB, "--json", str(report)]) == 0
    data = json.loads(report.read_text())
    assert data["provider"] == "cuda" and data["provider_options"] == {"use_tf32": "0"}
    assert set(data["placement"]) == {"original", "rewritten"}
    assert data["placement"]["original"]["weight_nodes"] >= 1
    assert data["placement"]["original"]["weight_nodes_on_cpu"] == []
