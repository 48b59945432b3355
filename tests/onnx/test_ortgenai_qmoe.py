"""The gpt-oss QMoE that onnxruntime-genai 0.18.0's builder writes: inspect, convert, lower, diff, calibrate.

Fixtures (tests/fixtures/make_ortgenai_gptoss.py, which ran the real builder): ``model.onnx`` + data and the
checkpoint's expert tensors. The oracle is the checkpoint decoded by the gpt-oss reference
(``gpt_oss.torch.weights``), compared with the NVFP4 weights decoded from fp4pass's output by this test's
own numpy decoder of the CUDA kernel layout (tests/support/oracles.py), never by fp4pass's reader.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch
from onnx import numpy_helper

from fp4pass.cli import main
from fp4pass.onnx import convert, inspect
from fp4pass.onnx.lower import lower
from fp4pass.onnx.numerics import diff
from fp4pass.onnx.runtime import make_session
import conversion_oracle as O
from oracles import E2M1_VALUES, qmoe_kernel_codes, qmoe_nvfp4_kernel_dequant

FIXTURES = Path(__file__).parents[1] / "fixtures"
MAIN, H64 = FIXTURES / "ortgenai_gptoss", FIXTURES / "ortgenai_gptoss_h64"
LAYERS = 2
LOSSLESS_EXPERTS = (0, 1, 2)  # the fixture's expert 3 has an E8M0 spread of 30 in both projections
PROJ = {"fc1": "gate_up_proj", "fc2": "down_proj"}
CONVERSIONS = [(MAIN, "trt"), (MAIN, "ort"), (H64, "ort")]  # QMoE becomes 'nvfp4' under every target


def _reference(fixture: Path, layer: int, proj: str) -> np.ndarray:
    """The checkpoint's MXFP4 expert weight [E, N, K] decoded by the gpt-oss reference, in float64."""
    weights = pytest.importorskip("gpt_oss.torch.weights", reason="gpt-oss package not installed")
    ckpt = weights.Checkpoint(str(fixture / "checkpoint"), torch.device("cpu"))
    prefix = f"model.layers.{layer}.mlp.experts.{proj}"
    w = ckpt._get_mxfp4_tensor(f"{prefix}_blocks", f"{prefix}_scales", dtype=torch.float32)
    return w.double().numpy()


def _checkpoint_codes(fixture: Path, layer: int, proj: str) -> tuple[np.ndarray, np.ndarray]:
    """The checkpoint's own bytes of one expert weight: E2M1 element codes [E, N, K], E8M0 codes [E, N, K/32]."""
    from safetensors import safe_open

    prefix = f"model.layers.{layer}.mlp.experts.{proj}"
    with safe_open(str(fixture / "checkpoint" / "experts.safetensors"), "pt") as f:
        blocks, scales = f.get_tensor(f"{prefix}_blocks").numpy(), f.get_tensor(f"{prefix}_scales").numpy()
    return O.unpack(blocks.reshape(*blocks.shape[:2], -1)), scales


def _init(model: onnx.ModelProto, name: str) -> np.ndarray:
    return numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == name))


def _feeds(layers: int = LAYERS, past: int = 128) -> dict:
    """Inputs the builder's decoder takes (a 128-token sliding window needs a KV capacity of 128)."""
    ids = np.array([[3, 9, 17, 40, 63, 5, 22, 11]], np.int64)
    feeds = {"input_ids": ids,
             "attention_mask": np.concatenate([np.zeros((1, past), np.int64), np.ones_like(ids)], 1)}
    for layer in range(layers):
        for kind in ("key", "value"):
            feeds[f"past_key_values.{layer}.{kind}"] = np.zeros((1, 1, past, 64), np.float16)
    return feeds


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ortgenai")
    out = {}
    for fixture, target in CONVERSIONS:
        path = folder / f"{fixture.name}_{target}.onnx"
        _, report = convert(str(fixture / "model.onnx"), target=target, output=path)
        out[fixture.name, target] = (path, report)
    return out


@pytest.mark.parametrize("fixture", [MAIN, H64])
def test_builder_bytes_are_the_checkpoint_in_the_kernel_layout(fixture):
    """The fixture itself: the builder's QMoE weights decode (kernel layout) to the reference's values."""
    model = onnx.load(str(fixture / "model.onnx"))
    for layer in range(LAYERS):
        for fc, proj in PROJ.items():
            base = f"model.layers.{layer}.moe.experts.{proj}"
            codes = qmoe_kernel_codes(_init(model, f"{base}.qweight"))
            scales = np.asarray(_init(model, f"{base}.scales")).view(np.uint8).astype(np.int64) - 127
            values = E2M1_VALUES[codes] * np.exp2(np.repeat(scales, 32, -1))
            np.testing.assert_array_equal(values, _reference(fixture, layer, proj))
            np.testing.assert_array_equal(_init(model, f"{base}.global_scales"), np.ones(4, np.float32))


@pytest.mark.parametrize("fixture, ambiguous", [(MAIN, "fc1"), (H64, "fc2")])
def test_inspect_names_the_kernel_layout(fixture, ambiguous, capsys):
    info = inspect(str(fixture / "model.onnx"))
    assert not info["declined"] and info["summary"]["tensors"] == 2 * LAYERS
    for t in info["tensors"]:
        assert t["pattern"] == "qmoe" and t["layout_read"] == "kernel" and t["layout_written"] == "kernel"
        assert t["layout_read_shape"] == "[E, K, N/2]" and f"{ambiguous} alone fits both" in t["layout_reason"]
        assert [p["lossless"] for p in t["per_expert"]] == [True, True, True, False]
    assert main(["inspect", str(fixture / "model.onnx")]) == 0
    assert "layout read: kernel [E, K, N/2]" in capsys.readouterr().out


@pytest.mark.parametrize("fixture, target", CONVERSIONS)
def test_convert_writes_nvfp4_in_the_kernel_layout_against_the_reference(converted, fixture, target):
    path, report = converted[fixture.name, target]
    out = onnx.load(str(path))
    nodes = [n for n in out.graph.node if n.op_type == "QMoE"]
    assert len(nodes) == LAYERS and not report["declined"]
    entries = {t["name"]: t for t in report["tensors"]}
    for layer, node in enumerate(nodes):
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs["quant_type"] == b"nvfp4" and attrs["block_size"] == 16
        assert {p.key: p.value for p in node.metadata_props} == {"fp4pass.qmoe_weight_layout": "kernel"}
        for fc, proj in PROJ.items():
            wi, si, gi = {"fc1": (2, 3, 15), "fc2": (5, 6, 16)}[fc]
            weights, scales, glob = (_init(out, node.input[i]) for i in (wi, si, gi))
            reference = _reference(fixture, layer, proj)
            e, n, k = reference.shape
            assert weights.dtype == np.uint8 and weights.shape == (e, k, n // 2)  # [E, K, N/2]
            assert scales.dtype == onnx.helper.tensor_dtype_to_np_dtype(onnx.TensorProto.FLOAT8E4M3FN)
            assert scales.shape == (e, n, k // 16) and glob.dtype == np.float32 and glob.shape == (e,)
            ours = qmoe_nvfp4_kernel_dequant(weights, scales, glob)
            entry = entries[node.input[wi]]
            assert entry["layout_read"] == "kernel" and entry["layout_written"] == "kernel"
            for expert in LOSSLESS_EXPERTS:
                np.testing.assert_array_equal(ours[expert], reference[expert])
            err = np.abs(ours - reference)
            assert 0 < err[3].max() <= entry["max_abs_err"]
            np.testing.assert_allclose(np.mean(err ** 2), entry["mse"], rtol=1e-9)
            # the per-expert errors the report gives are the ones measured here against the reference
            assert [p["lossless"] for p in entry["per_expert"]] == [x in LOSSLESS_EXPERTS for x in range(e)]
            for p in entry["per_expert"]:
                assert p["max_abs_err"] == err[p["expert"]].max()
                np.testing.assert_allclose(p["mse"], np.mean(err[p["expert"]] ** 2), rtol=1e-9, atol=0)
            # the lossy expert is within the independent oracle's bound, min(Algo 1, Algo 3) for that expert
            codes, e8m0 = _checkpoint_codes(fixture, layer, proj)
            mx = O.mx_dequant(codes[3], e8m0[3])
            np.testing.assert_array_equal(mx, reference[3])
            bound = min(O.mse(O.hybrid(codes[3], e8m0[3]), mx), O.mse(O.requant(codes[3], e8m0[3]), mx))
            assert 0 < O.mse(ours[3], mx) <= bound * (1 + 1e-9)


@pytest.mark.parametrize("fixture", [MAIN, H64])
def test_lowering_decodes_both_inputs_like_the_reference(converted, fixture):
    """The float MoE weights of the lowered builder model and of the converted model, run in onnxruntime."""
    for path in (fixture / "model.onnx", converted[fixture.name, "ort"][0]):
        model = ir.load(path)
        lowered, report = lower(model)
        assert report.lowered == {"QMoE FP4 -> MoE": LAYERS} and not report.declined
        weights = [n for n in lowered.graph if n.op_type == "Cast" and "/fc" in n.name]
        assert len(weights) == 2 * LAYERS  # fp16 activations: the dequantized weights are cast to fp16
        lowered.graph.outputs.extend(n.outputs[0] for n in weights)
        session, provider, _ = make_session(lowered, "cpu")
        values = dict(zip([o.name for o in session.get_outputs()], session.run(None, _feeds())))
        out = onnx.load(str(path))
        for node in weights:
            layer = int(node.name.split("layers.")[1].split("/")[0])
            fc = node.name.split("/")[-2]
            got = values[node.outputs[0].name].astype(np.float64)
            qmoe = [n for n in out.graph.node if n.op_type == "QMoE"][layer]
            wi, si, gi = {"fc1": (2, 3, 15), "fc2": (5, 6, 16)}[fc]
            if path.name == "model.onnx":  # the builder's MXFP4: exactly the reference, rounded to fp16
                expected = _reference(fixture, layer, PROJ[fc])
            else:
                expected = qmoe_nvfp4_kernel_dequant(*(_init(out, qmoe.input[i]) for i in (wi, si, gi)))
            np.testing.assert_array_equal(got, expected.astype(np.float16).astype(np.float64))


def test_diff_builder_model_against_converted_runs_on_cpu(converted, tmp_path):
    """In these tiny builds the builder feeds lm_head from layer 0's post-attention norm, so the logits do not
    see any MoE: the QMoE outputs are compared as intermediates."""
    inputs = tmp_path / "inputs.npz"
    np.savez(inputs, **_feeds())
    path, _ = converted[MAIN.name, "ort"]
    result = diff(str(MAIN / "model.onnx"), str(path), inputs=str(inputs), provider="cpu", intermediates=True)
    data = result.to_json()
    assert data["provider"] == "cpu"
    logits = next(o for o in data["outputs"] if o["name"] == "logits")
    assert logits["nan"] == 0 and logits["inf"] == 0
    assert logits["snr_db"] is None or logits["snr_db"] > 60
    moe = [t for t in data["intermediates"] if t["name"].endswith("/QMoE/output_0")]
    assert len(moe) == LAYERS
    for t in moe:  # expert 3 is lossy at ~1e-8 relative: identical in fp16, or a finite SNR far above 60 dB
        assert t["nan"] == 0 and (t["snr_db"] is None or 60 < t["snr_db"] < float("inf"))


@pytest.mark.slow
def test_diff_of_a_requantized_model_gives_a_finite_snr(tmp_path):
    out = tmp_path / "rq.onnx"
    inputs = tmp_path / "inputs.npz"
    np.savez(inputs, **_feeds())
    assert main(["convert", str(MAIN / "model.onnx"), "-o", str(out), "--method", "requant", "--quiet"]) == 0
    report = tmp_path / "diff.json"
    main(["diff", str(MAIN / "model.onnx"), str(out), "--inputs", str(inputs), "--intermediates",
          "--json", str(report), "--provider", "cpu", "--quiet"])
    data = json.loads(report.read_text())
    moe = [t for t in data["intermediates"] if t["name"].endswith("/QMoE/output_0")]
    assert moe and all(10 < t["snr_db"] < 60 for t in moe)


@pytest.mark.slow
def test_calibrate_and_convert_with_calibration_run_on_cpu(tmp_path):
    data = tmp_path / "calib.npz"
    np.savez(data, **_feeds())
    scales = tmp_path / "scales.json"
    assert main(["calibrate", str(MAIN / "model.onnx"), "--data", str(data), "-o", str(scales), "--quiet"]) == 0
    tensors = json.loads(scales.read_text())["tensors"]
    assert sorted(tensors) == [f"/model/layers.{i}/post_attention_layernorm/output_0" for i in range(LAYERS)]
    assert all(np.isfinite(t["g_amax"]) and t["g_amax"] > 0 for t in tensors.values())
    out = tmp_path / "calibrated.onnx"
    _, report = convert(str(MAIN / "model.onnx"), calib=str(data), check=True, output=out, provider="cpu")
    assert len(report["activations"]) == LAYERS and report["check"]["provider"] == "cpu"
    logits = next(o for o in report["check"]["outputs"] if o["name"] == "logits")
    assert logits["nan"] == 0 and (logits["snr_db"] is None or np.isfinite(logits["snr_db"]))
