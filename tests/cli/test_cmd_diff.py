"""``fp4pass diff``: exit codes, JSON, table, plot, and one-line errors."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest

from fp4pass.cli import main
from fp4pass.commands.diff import parse_shape
from fp4pass.errors import UsageError
from onnx_models import e2m1, float_matmul_model, mx_matmul_model, random_fp4, save


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cmd_diff")
    rng = np.random.default_rng(0)
    codes, scales = random_fp4(rng, (16, 64), 32, "e8m0", e8m0_range=(124, 129))
    weight = e2m1(codes) * np.repeat(scales.view(ml_dtypes.float8_e8m0fnu).astype(np.float32), 32, -1)
    noisy = (weight + 0.05 * rng.standard_normal(weight.shape)).astype(np.float32)
    return {
        "a": save(mx_matmul_model(codes, scales), folder / "a.onnx"),
        "c": save(float_matmul_model(noisy), folder / "c.onnx"),
        "folder": folder,
    }


def test_identical_exit_0_with_json(models, tmp_path, capsys):
    report = tmp_path / "r.json"
    assert main(["diff", models["a"], models["a"], "--json", str(report), "--snr-min", "300"]) == 0
    data = json.loads(report.read_text())
    assert set(data) == {"fp4pass", "provider", "outputs", "intermediates", "first_divergent", "passed", "notes",
                         "provider_options", "placement"}  # fp4pass: the version and command that wrote it
    assert data["passed"] is True and data["outputs"][0]["snr_db"] is None and data["outputs"][0]["max_abs_err"] == 0
    assert "PASSED" in capsys.readouterr().out


def test_below_threshold_exit_1(models, tmp_path, capsys):
    report = tmp_path / "r.json"
    code = main(["diff", models["a"], models["c"], "--snr-min", "90", "--intermediates",
                 "--json", str(report), "--shape", "x=4,64"])
    assert code == 1
    data = json.loads(report.read_text())
    assert data["passed"] is False and data["outputs"][0]["shape"] == [4, 16]
    assert data["first_divergent"]["tensor"] == "w_t"
    out = capsys.readouterr().out
    assert "FAILED" in out and out.index("outputs") < out.index("intermediates")
    assert main(["diff", models["a"], models["c"], "--snr-min", "10", "--quiet"]) == 0


def test_plot_writes_a_png(models, tmp_path):
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib (the 'plot' extra)")
    plot = tmp_path / "snr.png"
    code = main(["diff", models["a"], models["c"], "--snr-min", "90", "--intermediates", "--plot", str(plot),
                 "--shape", "x=4,64", "--quiet"])
    assert code == 1 and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_inputs_npz_and_seed_change_results(models, tmp_path):
    npz = tmp_path / "in.npz"
    np.savez(npz, x=np.ones((2, 64), np.float32))
    r1, r2 = tmp_path / "1.json", tmp_path / "2.json"
    assert main(["diff", models["a"], models["c"], "--inputs", str(npz), "--json", str(r1), "--quiet"]) == 0
    assert main(["diff", models["a"], models["c"], "--seed", "5", "--json", str(r2), "--quiet"]) == 0
    assert json.loads(r1.read_text())["outputs"][0]["shape"] == [2, 16]
    assert json.loads(r1.read_text())["outputs"] != json.loads(r2.read_text())["outputs"]


@pytest.mark.parametrize("case", ["missing", "not_onnx", "bad_shape", "bad_npz_name"])
def test_bad_input_exit_2_one_line(models, tmp_path, capsys, case):
    junk = tmp_path / "junk.onnx"
    junk.write_text("hello, not a model")
    npz = tmp_path / "in.npz"
    np.savez(npz, nope=np.ones(3, np.float32))
    args = {
        "missing": [models["a"], str(tmp_path / "absent.onnx")],
        "not_onnx": [models["a"], str(junk)],
        "bad_shape": [models["a"], models["c"], "--shape", "x=1,a"],
        "bad_npz_name": [models["a"], models["c"], "--inputs", str(npz)],
    }[case]
    assert main(["diff", *args, "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fp4pass diff: error:")
    assert "Traceback" not in err[0]


def test_parse_shape():
    assert parse_shape("input_ids=1,128") == ("input_ids", (1, 128))
    assert parse_shape("a=b=2x3") == ("a=b", (2, 3))
    for bad in ("x", "=1", "x=", "x=-1"):
        with pytest.raises(UsageError):
            parse_shape(bad)
