"""The tiny gpt-oss end to end: checkpoint -> fx (convert, calibrate, diff) -> ONNX (export, inspect, convert).

``models/tiny_gpt_oss.onnx`` and ``models/tiny_gpt_oss_calib.npz`` are written by
``python -m fp4pass.examples.gpt_oss_tiny --onnx ... --calib ...`` from the checkpoint ``models/tiny_gpt_oss``.

Oracles: ``fp4pass inspect`` on the ONNX model (the ONNX side's forecast, for the torch side's result);
``fp4pass calibrate`` (onnxruntime) for ``fx.calibrate``; ``onnx.reference.ReferenceEvaluator`` for the export;
the weights decoded from the checkpoint's bytes with ml_dtypes; the torch model's own forward.
"""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

import fp4pass.fx
from fp4pass.examples.gpt_oss_tiny import tiny_calib_ids, tiny_program, write_tiny_calib
from fp4pass.fx.gpt_oss import CausalLMLogits
from fx_builders import mxfp4_weight

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
CHECKPOINT = ROOT / "models" / "tiny_gpt_oss"
ONNX_MODEL = ROOT / "models" / "tiny_gpt_oss.onnx"
CALIB = ROOT / "models" / "tiny_gpt_oss_calib.npz"
DEQUANT = torch.ops.fp4pass.dequantize_mxfp4.default


@pytest.fixture(scope="module")
def model():
    return fp4pass.fx.load_gpt_oss(CHECKPOINT)


@pytest.fixture(scope="module")
def ids():
    return torch.from_numpy(tiny_calib_ids()[:2, :16])


@pytest.fixture(scope="module")
def program(model, ids):
    return torch.export.export(CausalLMLogits(model), (ids,))


@pytest.fixture(scope="module")
def inspected():
    from fp4pass.onnx.inspection import inspect

    return inspect(ONNX_MODEL)


def test_inspect_finds_the_experts_of_the_export(inspected):
    names = [t["name"] for t in inspected["tensors"]]
    assert names == [f"m.model.layers.{n}.mlp.experts.{w}_blocks" for n in range(3) for w in ("gate_up_proj", "down_proj")]
    assert [t["shape"] for t in inspected["tensors"]] == [[4, 128, 64], [4, 64, 64]] * 3
    assert all(t["pattern"] == "dq" and t["experts"] == 4 for t in inspected["tensors"])
    assert inspected["declined"] == []
    lossy = [(t["name"], e["expert"]) for t in inspected["tensors"] for e in t["per_expert"] if not e["lossless"]]
    assert lossy == [("m.model.layers.1.mlp.experts.gate_up_proj_blocks", 3)]  # the builder's one wide expert


def test_fx_convert_is_lossless_where_inspect_forecasts_it(program, ids, inspected):
    """Per expert: fx.convert's result decodes to the MXFP4 weight bit for bit exactly where the ONNX
    inspect forecasts lossless. Names: the ONNX codes initializer is the program's ``{weight}_blocks``."""
    nvfp4, report = fp4pass.fx.convert(program, method="auto")
    forecast = {t["name"]: [e["lossless"] for e in t["per_expert"]] for t in inspected["tensors"]}
    assert report["declined"] == []
    mx = dict(program.named_buffers())
    nv = dict(nvfp4.named_buffers())
    reported = {t["name"]: t["per_expert"] for t in report["tensors"]}
    seen = set()
    for n in range(3):
        for w in ("gate_up_proj", "down_proj"):
            base = f"m.model.layers.{n}.mlp.experts.{w}"
            before = mxfp4_weight(mx[base + "_blocks"].flatten(-2), mx[base + "_scales"])
            codes, scales, g = (nv[f"{base}_nvfp4_{k}"] for k in ("codes", "scales", "global_scale"))
            after = torch.ops.fp4pass.dequantize_nvfp4(codes, scales, g).numpy()
            exact = [bool(np.array_equal(before[e], after[e])) for e in range(before.shape[0])]
            assert exact == forecast[base + "_blocks"], base
            # the report's per-expert figures are the measured ones (as the ONNX pass reports them)
            assert [p["lossless"] for p in reported[base]] == exact, base
            measured = [float(np.mean((after[e].astype(np.float64) - before[e]) ** 2)) for e in range(len(exact))]
            np.testing.assert_allclose([p["mse"] for p in reported[base]], measured, rtol=1e-6, atol=0)
            seen.add(base + "_blocks")
    assert seen == set(forecast)
    assert report["summary"]["tensors_converted"] == 6 and report["summary"]["lossless"] == 5
    out_a, out_b = program.module()(ids), nvfp4.module()(ids)
    assert torch.allclose(out_a, out_b, rtol=1e-4, atol=1e-4)  # only layer 1 expert 3 moved, by ~1e-7


def test_fx_diff_finds_a_bumped_block_scale_at_its_dequant_node(model, program, ids):
    """One E8M0 block scale of layer 1's down_proj, expert 2, plus one (x2): first_divergent is the dequant
    node that reads it (weight copies compared on request); every node before it is identical."""
    bumped = copy.deepcopy(model)
    scales = bumped.model.layers[1].mlp.experts.down_proj_scales
    scales[2, 5, 0] += 1
    other = torch.export.export(CausalLMLogits(bumped), (ids,))
    result = fp4pass.fx.diff(program, other, (ids,), snr_min=60.0, weights=True)
    reader = next(n for n in program.graph.nodes if n.target == DEQUANT
                  and "layers_1_mlp_experts_down_proj_scales" in n.args[1].name)
    assert result.first_divergent["node"] == reader.name
    assert result.first_divergent["op_type"] == "fp4pass.dequantize_mxfp4.default"
    order = [n.name for n in program.graph.nodes]
    before = [m for m in result.intermediates if order.index(m.name) < order.index(reader.name)]
    assert before and all(m.max_abs_err == 0 for m in before)
    assert not result.passed


def test_calib_file_is_the_seeded_draw(tmp_path):
    write_tiny_calib(tmp_path / "c.npz")
    assert (tmp_path / "c.npz").read_bytes() == CALIB.read_bytes()
    with np.load(CALIB) as data:
        assert list(data) == ["input_ids"] and data["input_ids"].dtype == np.int64
        assert data["input_ids"].shape == (8, 32) and 0 <= data["input_ids"].min() and data["input_ids"].max() < 256


@pytest.fixture(scope="module")
def dynamic_program():
    """The program the committed ONNX was exported from: same fx node names as its tensors."""
    return tiny_program(CHECKPOINT)[0]


@pytest.mark.slow
def test_committed_onnx_equals_a_rebuild(tmp_path):
    from fp4pass.examples.gpt_oss_tiny import export_tiny_gpt_oss_onnx

    rebuilt = export_tiny_gpt_oss_onnx(tmp_path / "m.onnx", checkpoint_dir=CHECKPOINT)
    a, b = onnx.load(ONNX_MODEL), onnx.load(rebuilt)
    assert [(t.name, t.data_type, list(t.dims), t.raw_data) for t in a.graph.initializer] == \
           [(t.name, t.data_type, list(t.dims), t.raw_data) for t in b.graph.initializer]
    assert a.graph.SerializeToString() == b.graph.SerializeToString()
    assert rebuilt.read_bytes() == ONNX_MODEL.read_bytes(), "regenerate: python -m fp4pass.examples.gpt_oss_tiny --onnx"


def test_fx_calibrate_equals_onnx_calibrate_on_the_export(dynamic_program):
    """Same data, same activations, amax / input_scale equal within rounding.

    Name mapping: torch.onnx re-runs decompositions, which renumbers some fx nodes (``mul_24`` in the program
    is ``mul_478`` in the ONNX model), so activations are matched through their consumer: the ONNX MatMul
    ``node_bmm_k`` is the program's ``bmm_k``, and its first input is the calibrated activation."""
    from fp4pass.onnx.calibrate import calibrate_model

    ids = torch.from_numpy(np.load(CALIB)["input_ids"])
    calibrated, fx_scales = fp4pass.fx.calibrate(dynamic_program, [(ids,)])
    onnx_scales = calibrate_model(ONNX_MODEL, CALIB, provider="cpu")
    graph = onnx.load(ONNX_MODEL).graph
    fx_nodes = {n.name: n for n in dynamic_program.graph.nodes}
    mapping = {}
    for name in onnx_scales.tensors:
        (consumer,) = [n.name for n in graph.node if name in n.input]
        bmm = fx_nodes[consumer.removeprefix("node_")]
        assert bmm.target == torch.ops.aten.bmm.default
        mapping[name] = bmm.args[0].name
    assert sorted(mapping.values()) == sorted(fx_scales.tensors) and len(mapping) == 6
    for onnx_name, fx_name in mapping.items():
        a, b = fx_scales.tensors[fx_name].to_json(), onnx_scales.tensors[onnx_name].to_json()
        assert a["amax"] == pytest.approx(b["amax"], rel=1e-5), (fx_name, onnx_name)
        assert a["input_scale"] == pytest.approx(b["input_scale"], rel=1e-5), (fx_name, onnx_name)
        assert a["input_scale"] == pytest.approx(a["amax"] / (6 * 448), rel=1e-6)
    quantizers = [n for n in calibrated.graph.nodes if n.target == torch.ops.fp4pass.fake_quantize_nvfp4.default]
    consumers = sorted({u.target for q in quantizers for u in q.users}, key=str)
    assert consumers == [torch.ops.aten.bmm.default]  # the experts' matmuls, nothing else


def test_export_round_trips_through_onnx_reference(model, dynamic_program):
    """ONNX logits == the fx model's within float tolerance; the MoE weights bit-exact with the checkpoint."""
    from onnx.reference import ReferenceEvaluator

    ids = tiny_calib_ids()[:2, :12]
    proto = onnx.load(ONNX_MODEL)
    results = ReferenceEvaluator(proto).run(None, {"input_ids": ids}, intermediate=True)
    expected = dynamic_program.module()(torch.from_numpy(ids)).detach().numpy()
    np.testing.assert_allclose(results["logits"], expected, rtol=1e-4, atol=1e-4)
    for n in range(3):
        experts = model.model.layers[n].mlp.experts
        for i, w in enumerate(("gate_up_proj", "down_proj")):
            name = "dequantize_mxfp4" + (f"_{2 * n + i}" if 2 * n + i else "")
            oracle = mxfp4_weight(getattr(experts, f"{w}_blocks").flatten(-2), getattr(experts, f"{w}_scales"))
            np.testing.assert_array_equal(results[name], oracle)


def test_fp4pass_convert_main_job_and_diff(tmp_path):
    """The README's main job: convert + calibrate + check on CPU; the result diffs cleanly."""
    import json

    out, report = tmp_path / "out.onnx", tmp_path / "r.json"
    cmd = [sys.executable, "-m", "fp4pass", "convert", str(ONNX_MODEL), "-o", str(out), "--calib", str(CALIB),
           "--check", "--report", str(report), "--provider", "cpu", "--quiet"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    r = json.loads(report.read_text())
    assert r["summary"]["tensors_converted"] == 6 and r["summary"]["lossless"] == 5 and r["declined"] == []
    lossy = [(t["name"], e["expert"]) for t in r["tensors"] for e in t["per_expert"] if not e["lossless"]]
    assert lossy == [("m.model.layers.1.mlp.experts.gate_up_proj_blocks", 3)]
    assert len(r["activations"]) == 6
    consumers = [c for a in r["activations"] for c in a["consumers"]]
    assert sorted(consumers) == sorted(f"node_bmm{s}" for s in ["", "_1", "_2", "_3", "_4", "_5"])
    assert r["check"]["passed"] is True
    diff = [sys.executable, "-m", "fp4pass", "diff", str(ONNX_MODEL), str(out), "--inputs", str(CALIB),
            "--provider", "cpu", "--json", str(tmp_path / "d.json"), "--quiet"]
    done = subprocess.run(diff, capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    d = json.loads((tmp_path / "d.json").read_text())
    (logits,) = d["outputs"]
    assert logits["name"] == "logits" and logits["nan"] == 0 and logits["inf"] == 0
    assert logits["cosine"] > 0.9  # W4A4 on random weights: a rough bound, not a quality claim


@pytest.mark.parametrize("convert", [False, True], ids=["mxfp4", "nvfp4"])
def test_bfloat16_model_exports_valid_onnx_that_computes_the_program(ids, convert, tmp_path):
    """A bf16 gpt-oss: torch.onnx writes RMSNormalization(X bf16, scale fp32) and a bf16 TopK at opset 23,
    both refused by the ONNX checker. The export widens X to FP32 (exact), lifts the opset to 24, and its
    onnx.reference logits follow the bf16 program (bf16 rounding apart: different op orders)."""
    from onnx.reference import ReferenceEvaluator

    bf16 = fp4pass.fx.load_gpt_oss(CHECKPOINT, dtype=torch.bfloat16)
    short = ids[:1, :8]
    program = torch.export.export(CausalLMLogits(bf16), (short,))
    if convert:
        program, _ = fp4pass.fx.convert(program)
    path = tmp_path / "bf16.onnx"
    fp4pass.fx.export(program, (short,), path)  # the checker runs before the file is written
    proto = onnx.load(path)
    onnx.checker.check_model(proto, full_check=True)
    assert {o.domain: o.version for o in proto.opset_import}[""] == 24
    widened = [n for n in proto.graph.node if n.op_type == "Cast" and n.name.endswith("_widen_x")]
    assert len(widened) == 2 * 3 + 1  # two norms per layer, one final
    got = ReferenceEvaluator(proto).run(None, {"input_ids": short.numpy()})[0].astype(np.float32).ravel()
    expected = program.module()(short).detach().float().numpy().ravel()
    cosine = float(got @ expected / np.linalg.norm(got) / np.linalg.norm(expected))
    assert cosine > 0.999, cosine
