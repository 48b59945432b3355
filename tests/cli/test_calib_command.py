"""``fp4pass calibrate`` end to end: SCALES.json written atomically, exit 2 with one line on bad input."""

from __future__ import annotations

import json

import numpy as np
import onnx

from calib_builders import float_mlp, nvfp4_linear
from fp4pass.cli import main


def test_calibrate_writes_scales(tmp_path, capsys):
    onnx.save(nvfp4_linear()[0], tmp_path / "m.onnx")
    x = np.random.default_rng(0).standard_normal((16, 64)).astype(np.float32)
    np.savez(tmp_path / "d.npz", x=x)
    code = main(["calibrate", str(tmp_path / "m.onnx"), "--data", str(tmp_path / "d.npz"), "-o",
                 str(tmp_path / "s.json"), "--calibrator", "headroom", "--rho", "4096", "--provider", "cpu",
                 "--report", str(tmp_path / "r.json")])
    assert code == 0
    scales = json.loads((tmp_path / "s.json").read_text())
    assert scales["calibrator"] == "headroom" and list(scales["tensors"]) == ["a"]
    assert scales["tensors"]["a"]["amax"] == float(np.maximum(x, 0).max())
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["tensors"][0]["name"] == "a" and "snr_db" in report["tensors"][0]
    assert "a" in capsys.readouterr().out


def test_calibrate_bad_input_exit_2(tmp_path, capsys):
    onnx.save(float_mlp(), tmp_path / "m.onnx")
    np.savez(tmp_path / "d.npz", wrong=np.ones((2, 64), np.float32))
    args = ["calibrate", str(tmp_path / "m.onnx"), "--data", str(tmp_path / "d.npz"), "-o", str(tmp_path / "s.json"),
            "--activation", "h", "--provider", "cpu"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'x'" in err[0] and "d.npz" in err[0]
    bad = np.ones((2, 64), np.float32)
    bad[0, 0] = np.inf
    np.savez(tmp_path / "d.npz", x=bad)
    assert main(args) == 2
    assert "inf" in capsys.readouterr().err
    assert not (tmp_path / "s.json").exists()
    assert main(args[:4] + ["-o", str(tmp_path / "m.onnx")] + args[6:]) == 2  # never over the input
