"""What a new user sees on the command line: the check's verdict and what it was held to, an input of the wrong
shape named with its index and both sizes, one rule for a model without MXFP4, every line printed once, and
the example builder's files readable like any other."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from fp4pass.cli import main

ROOT = Path(__file__).resolve().parents[2]
MOE = ROOT / "models" / "moe.onnx"
KIMI = ROOT / "models" / "checkpoints" / "deepseek_v3"


def _run(capsys, *argv):
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# -- --check says what it found and what it was held to -----------------------------------------------------


def test_w4a4_check_says_that_no_threshold_applied(tmp_path, capsys):
    code, out, _ = _run(capsys, "convert", MOE, "-o", tmp_path / "o.onnx", "--calib", ROOT / "models" / "calib.npz",
                        "--check")
    assert code == 0
    (verdict,) = [line for line in out.splitlines() if line.startswith("check on ")]
    assert verdict.endswith("PASSED (no SNR threshold applied: --snr-min not given; only NaN/Inf fail)")


def test_weight_only_check_names_its_threshold(tmp_path, capsys):
    code, out, _ = _run(capsys, "convert", MOE, "-o", tmp_path / "o.onnx", "--check", "--snr-min", "21.5")
    assert code == 0
    (verdict,) = [line for line in out.splitlines() if line.startswith("check on ")]
    assert verdict.endswith("PASSED (every output's SNR >= 21.5 dB)")


def test_diff_without_snr_min_says_no_threshold_applied(capsys):
    code, out, _ = _run(capsys, "diff", MOE, MOE)
    assert code == 0 and out.strip().splitlines()[-1] == \
        "PASSED (no SNR threshold applied: --snr-min not given; only NaN/Inf fail)"


def _safetensors_keys(folder: Path) -> list[str]:
    from safetensors import safe_open

    keys = []
    for shard in sorted(folder.glob("*.safetensors")):
        with safe_open(str(shard), framework="np") as f:
            keys += list(f.keys())
    return keys


def test_checkpoint_check_prints_its_verdict_and_every_line_once(tmp_path, capsys):
    pytest.importorskip("compressed_tensors", reason="the checkpoint extra")
    code, out, err = _run(capsys, "convert", KIMI, "-o", tmp_path / "o", "--format", "compressed-tensors", "--check")
    assert code == 0, err
    # every MXFP4 Linear of the source (one weight_packed each, read with safetensors) is compared once
    compared = sum(key.endswith(".weight_packed") for key in _safetensors_keys(KIMI))
    (line,) = [line for line in err.splitlines() if "check PASSED" in line]
    assert f"check PASSED: {compared} experts compared with their MXFP4 source" in line
    assert "decoded by compressed-tensors" in line
    summaries = [line for line in (out + err).splitlines() if "weights converted" in line]
    assert len(summaries) == 1 and summaries[0] in err.splitlines()  # once, on stderr, as for ONNX models
    rows = [line for line in out.splitlines() if line.strip()]
    assert rows and all(line.split()[0].endswith("weight") or "lossless" in line for line in rows)
    for row in rows:
        assert (out + err).count(row) == 1


# -- an input of the wrong shape: which dim, what it got, what the model wants --------------------------------


@pytest.fixture
def narrow_inputs(tmp_path):
    x = np.load(ROOT / "models" / "calib.npz")["x"]  # [256, 64]
    path = tmp_path / "narrow.npz"
    np.savez(path, x=x[:, :48])
    return path


def test_diff_names_the_dim_of_an_input_that_does_not_fit(capsys, narrow_inputs):
    code, _, err = _run(capsys, "diff", MOE, MOE, "--inputs", narrow_inputs)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "array 'x' dim 1 is 48, graph input wants 64" in err


def test_convert_check_names_the_dim_of_an_input_that_does_not_fit(tmp_path, capsys, narrow_inputs):
    code, _, err = _run(capsys, "convert", MOE, "-o", tmp_path / "o.onnx", "--check", "--inputs", narrow_inputs)
    assert code == 2 and "array 'x' dim 1 is 48, graph input wants 64" in err
    assert not (tmp_path / "o.onnx").exists()


def test_python_diff_names_the_dim_of_a_given_array():
    import fp4pass
    from fp4pass.errors import UsageError

    with pytest.raises(UsageError, match=r"input 'x': the given array dim 1 is 48, graph input wants 64"):
        fp4pass.onnx.diff(str(MOE), str(MOE), inputs={"x": np.zeros((4, 48), np.float32)})


def test_calibrate_words_the_same(tmp_path, capsys, narrow_inputs):
    code, _, err = _run(capsys, "calibrate", MOE, "--data", narrow_inputs, "-o", tmp_path / "s.json")
    assert code == 2 and "array 'x' dim 1 is 48, graph input wants 64" in err


# -- no MXFP4 in the input: one rule for ONNX files and checkpoint folders ------------------------------------


def _float_onnx(path: Path) -> Path:
    w = helper.make_tensor("w", TensorProto.FLOAT, [8, 4], np.arange(32, dtype=np.float32).tolist())
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "float",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])], [w])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), path)
    return path


def _float_checkpoint(folder: Path) -> Path:
    from safetensors.numpy import save_file

    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    save_file({"model.layers.0.mlp.down_proj.weight": np.ones((8, 8), np.float32)}, str(folder / "model.safetensors"))
    return folder


@pytest.mark.parametrize("kind", ["onnx", "checkpoint"])
def test_a_model_without_mxfp4_is_exit_2_with_nothing_written(tmp_path, capsys, kind):
    pytest.importorskip("safetensors")
    src = _float_onnx(tmp_path / "float.onnx") if kind == "onnx" else _float_checkpoint(tmp_path / "float")
    out = tmp_path / ("o.onnx" if kind == "onnx" else "o")
    code, _, err = _run(capsys, "convert", src, "-o", out, "--report", tmp_path / "r.json")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"{src}: no MXFP4 weights found" in err
    assert not out.exists() and not (tmp_path / "r.json").exists()


def test_activation_quantizers_alone_are_still_a_job(tmp_path, capsys):
    """A float model with --scales asks for activation quantizers only: not refused for lacking MXFP4 weights."""
    import fp4pass
    from fp4pass.errors import UsageError

    model = _float_onnx(tmp_path / "float.onnx")
    with pytest.raises(UsageError, match="no MXFP4 weights found"):
        fp4pass.onnx.convert(str(model))
    try:
        fp4pass.onnx.convert(str(model), scales={"calibrator": "max", "tensors": {}})
    except UsageError as exc:
        assert "no MXFP4 weights found" not in str(exc)


# -- the example builder writes files like any program --------------------------------------------------------


def test_example_checkpoint_files_follow_the_umask(tmp_path):
    """0o666 & ~umask, as for any file a program creates; umask 002 tells that from a fixed 0644 (or 0600)."""
    pytest.importorskip("safetensors")
    from fp4pass.examples.checkpoints import build_checkpoint

    before = os.umask(0o002)
    try:
        folder = build_checkpoint(tmp_path / "ck", "deepseek", layers=1, experts=2, shard_bytes=20_000)
    finally:
        os.umask(before)
    files = sorted(folder.iterdir())
    assert sum(p.suffix == ".safetensors" for p in files) > 1
    for path in files:
        assert stat.S_IMODE(path.stat().st_mode) == 0o664, path.name
