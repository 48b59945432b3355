"""Inputs of the wrong kind redirect the user (exit 2, one line saying what to give instead), and inputs that
are NVFP4 already are recognised: ``convert`` says so, ``inspect`` shows and checks an NVFP4 ONNX model's
weights and activation quantizers (their scales read back with onnx's own numpy_helper).

Every command runs in-process through ``fp4pass.cli.main`` on the bundled models."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from cli_helpers import cli, one_line, run_cli

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "models"
MOE, CALIB = MODELS / "moe.onnx", MODELS / "calib.npz"
KIMI = MODELS / "checkpoints" / "deepseek_v3"
TEXT = MODELS / "checkpoints" / "calib_text.jsonl"


@pytest.fixture
def work(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


# -- inputs of the wrong kind ----------------------------------------------------------------------------------


@pytest.mark.parametrize("argv", [
    ("convert", "{shard}", "-o", "out"),
    ("inspect", "{shard}"),
    ("calibrate", "{shard}", "--data", CALIB, "-o", "s.json"),
    ("convert", "{index}", "-o", "out"),
])
def test_a_checkpoint_file_given_for_its_folder_names_the_folder(work, capsys, argv):
    folder = work / "ckpt.v1"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes((KIMI / "model.safetensors").read_bytes())
    (folder / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    argv = [str(a).format(shard=folder / "model.safetensors", index=folder / "model.safetensors.index.json")
            for a in argv]
    code, err = cli(capsys, *argv)
    line = one_line(err)
    assert code == 2 and "one file of a safetensors checkpoint; give the checkpoint folder" in line
    assert line.endswith(f"({folder})")
    assert not (work / "out").exists() and not (work / "s.json").exists()


@pytest.mark.parametrize("argv", [
    ("convert", MOE, "-o", "x.onnx", "--calib", "{text}"),
    ("convert", MOE, "-o", "x.onnx", "--check", "--inputs", "{text}"),
    ("calibrate", MOE, "--data", "{text}", "-o", "s.json"),
])
@pytest.mark.parametrize("suffix", [".jsonl", ".txt"])
def test_text_data_for_an_onnx_model_says_what_it_takes(work, capsys, argv, suffix):
    text = work / f"prompts{suffix}"
    text.write_text(TEXT.read_text())
    code, err = cli(capsys, *[str(a).format(text=text) for a in argv])
    line = one_line(err)
    assert code == 2 and "text is calibration data for checkpoint folders" in line
    assert "one array per graph input (x)" in line
    assert not (work / "x.onnx").exists() and not (work / "s.json").exists()


@pytest.mark.parametrize("command", ["convert", "calibrate"])
def test_an_npz_naming_no_graph_input_names_its_arrays_and_the_inputs(work, capsys, command):
    np.savez(work / "other.npz", input_ids=np.zeros((2, 8), np.int64), xs=np.ones((4, 64), np.float32))
    where = ("-o", "x.onnx", "--calib", "other.npz") if command == "convert" else ("--data", "other.npz", "-o",
                                                                                 "s.json")
    code, err = cli(capsys, command, MOE, *where)
    line = one_line(err)
    assert code == 2 and "other.npz: none of its arrays (input_ids, xs) names a graph input" in line
    assert line.endswith("the model's inputs are 'x'")


def _scales_file(path: Path, keys: list[str]) -> Path:
    tensors = {key: {"amax": 2.0 + i, "g_amax": 2.0 + i, "input_scale": (2.0 + i) / 2688, "b_min": 0.5,
                     "b_max": 2.0 + i,
                     "blocks": 8} for i, key in
               enumerate(keys)}
    path.write_text(json.dumps({"calibrator": "max", "tensors": tensors}))
    return path


@pytest.mark.parametrize("keys, whose", [
    ([f"model.layers.{i}.mlp.experts.{p}" for i in (1, 10) for p in ("gate_up_proj", "down_proj")], "gpt-oss's"),
    (["layers.1.ffn.experts.11.w1", "layers.1.ffn.experts.11.w3", "layers.10.ffn.experts.0.w2"], "DeepSeek-V4's"),
    (["x_e", "h_act"], "an ONNX model's activations"),
])
def test_a_scales_file_of_another_model_says_whose_it_looks_like(work, capsys, keys, whose):
    scales = _scales_file(work / "SCALES.json", keys)
    code, err = cli(capsys, "convert", KIMI, "-o", "out", "--scales", scales)
    line = one_line(err)
    assert code == 2 and f"none of its {len(keys)} keys match this checkpoint; they look like {whose}" in line
    assert "model.layers.0.mlp.experts.0.w1" in line and not (work / "out").exists()


def test_a_scales_file_with_one_matching_key_is_taken(work, capsys):
    """One key of this checkpoint among others: the rest are listed as unmatched, as before."""
    ours = [f"model.layers.{i}.{m}" for i in (0, 1) for m in ("mlp.experts.0.w1", "mlp.experts.0.w2",
                                                                "self_attn.o_proj")]
    scales = _scales_file(work / "SCALES.json", [*ours, "model.layers.1.mlp.experts.gate_up_proj"])
    code, err = cli(capsys, "convert", KIMI, "-o", "out", "--scales", scales, "--report", "r.json", "--quiet")
    assert code == 0, err
    report = json.loads((work / "r.json").read_text())
    assert report["input_scales"]["unmatched_keys"] == ["model.layers.1.mlp.experts.gate_up_proj"]


# -- NVFP4 inputs recognised ----------------------------------------------------------------------------------


def _nvfp4_onnx(work, capsys, name: str, *flags) -> Path:
    out = work / name
    code, err = cli(capsys, "convert", MOE, "-o", out, "--quiet", *flags)
    assert code == 0, err
    return out


def _initializers(path: Path) -> dict:
    """name -> numpy array of every initializer, read with onnx's own numpy_helper (not fp4pass's reader)."""
    import onnx
    from onnx import numpy_helper

    return {t.name: numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}


def _quantizer_scales(path: Path) -> dict:
    """activation -> input_scale of each TRT_FP4DynamicQuantize node, read from the proto with onnx alone."""
    import onnx

    model = onnx.load(str(path))
    values = _initializers(path)
    return {n.input[0]: float(values[n.input[1]]) for n in model.graph.node if n.op_type == "TRT_FP4DynamicQuantize"}


@pytest.mark.parametrize("flags, form, scheme", [
    ((), "dq", "W4A16"),
    (("--calib", CALIB), "dq", "W4A4"),
    (("--calib", CALIB, "--scale-form", "alpha"), "alpha", "W4A4"),
    (("--calib", CALIB, "--target", "reference"), "dq", "W4A4"),
])
def test_convert_of_an_nvfp4_onnx_model_says_it_is_nvfp4_already(work, capsys, flags, form, scheme):
    model = _nvfp4_onnx(work, capsys, "m.nvfp4.onnx", *flags)
    code, err = cli(capsys, "convert", model, "-o", "again.onnx")
    line = one_line(err)
    assert code == 2 and f"already NVFP4 ({form} form, {scheme}); nothing to convert" in line
    assert f"check it with `fp4pass inspect {model}`" in line and not (work / "again.onnx").exists()


def test_activation_quantizers_are_added_to_nvfp4_weights_once(work, capsys):
    """A weight-only NVFP4 model takes --calib (its activation quantizers); a W4A4 one refuses a second set."""
    w4a16 = _nvfp4_onnx(work, capsys, "w.onnx")
    w4a4 = work / "wa.onnx"
    assert cli(capsys, "convert", w4a16, "-o", w4a4, "--calib", CALIB, "--quiet")[0] == 0
    assert sorted(_quantizer_scales(w4a4)) == ["h_act", "x_e"]
    code, err = cli(capsys, "convert", w4a4, "-o", "again.onnx", "--calib", CALIB)
    assert code == 2 and "already NVFP4 (dq form, W4A4); its activations are quantized already" in one_line(err)


@pytest.mark.parametrize("flags", [(), ("--calib", CALIB), ("--calib", CALIB, "--scale-form", "alpha"),
                                   ("--calib", CALIB, "--target", "reference")])
def test_inspect_of_an_nvfp4_onnx_model_shows_its_scales(work, capsys, flags):
    model = _nvfp4_onnx(work, capsys, "m.nvfp4.onnx", *flags)
    code, out, err = run_cli(capsys, "inspect", model, "--json")
    assert code == 0, err
    info = json.loads(out)["nvfp4"]
    values = _initializers(model)
    weights = {w["name"]: w for w in info["weights"]}
    assert sorted(weights) == ["experts.w1", "experts.w2"]
    alpha = "--scale-form" in flags
    for name, w in weights.items():
        assert w["experts"] == 4 and w["form"] == ("alpha" if alpha else "dq")
        stored = values[f"{name}_alpha" if alpha else f"{name}_global_scale"].reshape(-1)
        assert w["global_scale"] == [float(v) for v in stored]
    assert info["scheme"] == ("W4A4" if flags else "W4A16") and info["problems"] == []
    if "--target" in flags:  # the standard-op emulation: its scale is the calibration's, as the trt form's is
        trt = _quantizer_scales(_nvfp4_onnx(work, capsys, "trt.onnx", "--calib", CALIB))
        assert {q["activation"]: q["input_scale"] for q in info["activations"]} == trt
    elif flags:
        assert {q["activation"]: q["input_scale"] for q in info["activations"]} == _quantizer_scales(model)
    text = run_cli(capsys, "inspect", model)[1]
    assert "NVFP4 (" in text and "experts.w1" in text and "0 MXFP4 tensors" not in text


def _planted(work, capsys, edit) -> Path:
    """A W4A4 NVFP4 model with one initializer changed by ``edit(name -> array)`` through onnx alone."""
    import onnx
    from onnx import numpy_helper

    source = _nvfp4_onnx(work, capsys, "clean.onnx", "--calib", CALIB)
    model = onnx.load(str(source))
    for tensor in model.graph.initializer:
        array = numpy_helper.to_array(tensor).copy()
        changed = edit(tensor.name, array)
        if changed is not None:
            tensor.CopyFrom(numpy_helper.from_array(changed, tensor.name))
    out = work / "planted.onnx"
    onnx.save(model, str(out))
    return out


def _set(name: str, where, value):
    def edit(tensor: str, array):
        if tensor == name:
            array.reshape(-1)[where] = value
            return array
        return None
    return edit


@pytest.mark.parametrize("edit, kind, words", [
    (_set("experts.w1_global_scale", 2, 0.0), "zero_scale", "experts.w1 global scale: 0.0 is 0"),
    (_set("experts.w2_global_scale", 3, -0.25), "negative_scale", "experts.w2 global scale: -0.25 is negative"),
    (_set("experts.w1_global_scale", 1, np.nan), "nonfinite_scale", "first expert 1"),
    (_set("x_e_nvfp4/input_scale", 0, 0.0), "zero_scale", "activation x_e input_scale: 0.0 is 0"),
    (_set("h_act_nvfp4/input_scale", 0, np.inf), "nonfinite_scale", "activation h_act input_scale: inf"),
])
def test_inspect_names_a_broken_nvfp4_scale_and_exits_1(work, capsys, edit, kind, words):
    model = _planted(work, capsys, edit)
    code, out, err = run_cli(capsys, "inspect", model, "--json")
    problems = json.loads(out)["nvfp4"]["problems"]
    assert code == 1 and [p["kind"] for p in problems] == [kind]
    assert words in problems[0]["message"] and "fix:" in problems[0]["message"]
    code, out, _ = run_cli(capsys, "inspect", model)
    assert code == 1 and f"1 problem(s):\n  {kind}: " in out


@pytest.mark.parametrize("code_value, kind", [(0x7F, "nonfinite_scale"), (0xFF, "nonfinite_scale"),
                                              (0x88, "negative_scale")])
def test_inspect_names_a_nan_or_negative_block_scale(work, capsys, code_value, kind):
    def edit(tensor: str, array):
        if tensor == "experts.w2_scale_e4m3":
            raw = array.view(np.uint8)
            raw.reshape(-1)[37] = code_value
            return raw.view(array.dtype)
        return None

    model = _planted(work, capsys, edit)
    code, out, _ = run_cli(capsys, "inspect", model, "--json")
    problems = json.loads(out)["nvfp4"]["problems"]
    assert code == 1 and [p["kind"] for p in problems] == [kind]
    assert problems[0]["tensor"] == "experts.w2" and "1 E4M3 block scale(s)" in problems[0]["message"]
    assert "index [0, 4, 5]" in problems[0]["message"]  # element 37 of [4, 64, 8]


def test_convert_of_an_nvfp4_checkpoint_says_it_is_nvfp4_already(work, capsys):
    for out, flags, what in (("ct", ("--format", "compressed-tensors"), "compressed-tensors, W4A16"),
                             ("mo", ("--input-scale", "0.01"), "modelopt, W4A4")):
        assert cli(capsys, "convert", KIMI, "-o", out, "--quiet", *flags)[0] == 0
        code, err = cli(capsys, "convert", out, "-o", "again", "--allow-partial")
        line = one_line(err)
        assert code == 2 and f"{out}: already NVFP4 ({what}); nothing to convert" in line
        assert f"check it with `fp4pass inspect {out}`" in line and not (work / "again").exists()


def test_inspect_and_convert_know_an_nvfp4_qmoe_model(work, capsys):
    """onnxruntime-genai's gpt-oss (QMoE fp4) converted for onnxruntime: QMoE nvfp4, whose per-expert global
    scales are the node's inputs 15 (fc1) and 16 (fc2), read here from the proto with onnx alone."""
    import onnx

    source = ROOT / "tests" / "fixtures" / "ortgenai_gptoss" / "model.onnx"
    model = work / "q.onnx"
    assert cli(capsys, "convert", source, "-o", model, "--target", "ort", "--quiet")[0] == 0
    values = _initializers(model)
    want = {}
    for node in onnx.load(str(model)).graph.node:
        if node.op_type == "QMoE":
            for w, g in ((2, 15), (5, 16)):
                want[node.input[w]] = [float(v) for v in values[node.input[g]].reshape(-1)]
    code, out, err = run_cli(capsys, "inspect", model, "--json")
    assert code == 0, err
    info = json.loads(out)["nvfp4"]
    assert info["forms"] == ["qmoe-nvfp4"] and info["scheme"] == "W4A16" and len(want) == 4
    assert {w["name"]: w["global_scale"] for w in info["weights"]} == want
    code, err = cli(capsys, "convert", model, "-o", "again.onnx", "--target", "ort")
    assert code == 2 and "already NVFP4 (qmoe-nvfp4 form, W4A16)" in one_line(err)
