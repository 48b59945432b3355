"""``fp4pass convert`` on the command line: success, and every Safety case: exit 2, one clear line, nothing written."""

from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import onnx_builders as B
from fp4pass.cli import main


def cli(capsys, *argv):
    code = main(list(argv))
    err = capsys.readouterr().err
    return code, err


def listing(folder):
    return sorted(os.listdir(folder))


def test_convert_moe_writes_report_and_summary(tmp_path, capsys):
    out, report = tmp_path / "moe.nvfp4.onnx", tmp_path / "report.json"
    code, err = cli(capsys, "convert", "models/moe.onnx", "-o", str(out), "--report", str(report))
    assert code == 0
    data = json.loads(report.read_text())
    assert data["summary"]["tensors_converted"] == 2 and data["summary"]["lossless"] == 1
    assert "converted 2 tensors, 1 lossless, worst SNR" in err
    onnx.checker.check_model(onnx.load(out), full_check=True)
    assert listing(tmp_path) == ["moe.nvfp4.onnx", "report.json"]


def _external_model(tmp_path, location="in.onnx.data", truncate=False):
    proto = B.linear_model()
    path = tmp_path / "in.onnx"
    onnx.save(proto, path, save_as_external_data=True, all_tensors_to_one_file=True, location="in.onnx.data",
              size_threshold=0)
    if truncate:
        data = (tmp_path / "in.onnx.data").read_bytes()
        (tmp_path / "in.onnx.data").write_bytes(data[: len(data) // 2])
    if location != "in.onnx.data":
        model = onnx.load(path, load_external_data=False)
        for t in model.graph.initializer:
            for entry in t.external_data:
                if entry.key == "location":
                    entry.value = location
        onnx.save(model, path)
    return path


def _bad_scale_model(tmp_path, code255=False, shape_mismatch=False, k=64):
    codes = np.zeros((8, k), ml_dtypes.float4_e2m1fn)
    scales = np.ones((8, -(-k // 32) + (1 if shape_mismatch else 0)), ml_dtypes.float8_e8m0fnu)
    raw = scales.view(np.uint8).copy()
    if code255:
        raw[3, 1] = 255
    inits = [numpy_helper.from_array(codes, "W"), numpy_helper.from_array(raw.view(ml_dtypes.float8_e8m0fnu), "W_scale")]
    model = B.make([B.dq_node("W")], [], [B.vi("W_dq", [8, k])], inits)
    path = tmp_path / "in.onnx"
    onnx.save(model, path)
    return path


@pytest.mark.parametrize("case, message", [
    ("not_onnx", "not an ONNX file"),
    ("truncated_file", "not an ONNX file or truncated"),
    ("truncated_data", "truncated"),
    ("dotdot", "leaves the model's folder"),
    ("absolute", "leaves the model's folder"),
    ("symlink", "outside the model's folder"),
    ("e8m0_255", "E8M0 code 255"),
    ("scale_shape", "expected [8, 2]"),
    ("k_not_multiple", "not a multiple of the MXFP4 block 32"),
])
def test_bad_input_exits_2_with_one_line_and_writes_nothing(tmp_path, capsys, case, message):
    src = tmp_path / "src"
    src.mkdir()
    if case == "not_onnx":
        path = src / "in.onnx"
        path.write_text("hello, I am not a model\n" * 10)
    elif case == "truncated_file":
        full = src / "full.onnx"
        onnx.save(B.linear_model(), full)
        path = src / "in.onnx"
        path.write_bytes(full.read_bytes()[:300])
        full.unlink()
    elif case == "truncated_data":
        path = _external_model(src, truncate=True)
    elif case == "dotdot":
        (tmp_path / "secret.bin").write_bytes(b"\0" * 4096)
        path = _external_model(src, location="../secret.bin")
    elif case == "absolute":
        path = _external_model(src, location=str(tmp_path / "secret.bin"))
    elif case == "symlink":
        os.replace(_external_model(src).with_suffix(".onnx.data"), tmp_path / "elsewhere.data")
        os.symlink(tmp_path / "elsewhere.data", src / "in.onnx.data")
        path = src / "in.onnx"
    elif case == "e8m0_255":
        path = _bad_scale_model(src, code255=True)
    elif case == "scale_shape":
        path = _bad_scale_model(src, shape_mismatch=True)
    else:
        path = _bad_scale_model(src, k=48)
    before = listing(src)
    out = tmp_path / "out"
    out.mkdir()
    code, err = cli(capsys, "convert", str(path), "-o", str(out / "o.onnx"), "--report", str(out / "r.json"))
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in err
    assert listing(out) == [] and listing(src) == before


def test_refuses_to_write_over_the_input(tmp_path, capsys):
    path = tmp_path / "m.onnx"
    onnx.save(B.linear_model(), path)
    before = path.read_bytes()
    code, err = cli(capsys, "convert", str(path), "-o", str(path))
    assert code == 2 and "refusing to write over the input" in err
    assert path.read_bytes() == before


def test_never_external_with_external_input_inlines_everything(tmp_path, capsys):
    path = _external_model(tmp_path)
    out = tmp_path / "o.onnx"
    code, _ = cli(capsys, "convert", str(path), "-o", str(out), "--external-data", "never")
    assert code == 0 and not (tmp_path / "o.onnx.data").exists()
    model = onnx.load(out)
    assert all(t.data_location == onnx.TensorProto.DEFAULT for t in model.graph.initializer)


def test_convert_calib_check_then_reuse_scales(tmp_path, capsys):
    """The README's main job: calibrate, insert TensorRT activation quantizers, check; --scales reproduces it."""
    out, report, scales = tmp_path / "a.onnx", tmp_path / "report.json", tmp_path / "scales.json"
    code, _ = cli(capsys, "convert", "models/moe.onnx", "-o", str(out), "--calib", "models/calib.npz",
                  "--check", "--report", str(report))
    assert code == 0
    data = json.loads(report.read_text())
    assert data["check"]["passed"] and data["check"]["outputs"][0]["shape"] == [256, 64]
    inserted = {a["activation"]: a for a in data["activations"] if a["inserted"]}
    assert set(inserted) == {"x_e", "h_act"}
    # max calibrator: g_amax is the calibration data's own amax for the first activation (x_e = x unsqueezed)
    x = np.load("models/calib.npz")["x"]
    assert inserted["x_e"]["g_amax"] == pytest.approx(float(np.abs(x).max()), rel=1e-6)
    model = onnx.load(out)
    quantizers = [n for n in model.graph.node if n.op_type == "TRT_FP4DynamicQuantize"]
    assert len(quantizers) == 2
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    for node in quantizers:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert node.domain == "trt" and attrs == {"axis": -1, "block_size": 16, "scale_type": 17}
        scale = inits[node.input[1]]
        assert scale.shape == () and scale.dtype == np.float32  # a scalar FP32 initializer
    expected_scale = np.float32(np.float32(inserted["x_e"]["g_amax"]) / np.float32(6 * 448))
    assert any(inits[n.input[1]] == expected_scale for n in quantizers)

    code, _ = cli(capsys, "calibrate", "models/moe.onnx", "--data", "models/calib.npz", "-o", str(scales))
    assert code == 0
    reused = tmp_path / "b.onnx"
    assert cli(capsys, "convert", "models/moe.onnx", "-o", str(reused), "--scales", str(scales))[0] == 0
    first = [n.input[1] for n in onnx.load(reused).graph.node if n.op_type == "TRT_FP4DynamicQuantize"]
    assert len(first) == 2


def test_convert_forwards_headroom_options(tmp_path, capsys):
    out, report = tmp_path / "h.onnx", tmp_path / "report.json"
    code, _ = cli(capsys, "convert", "models/moe.onnx", "-o", str(out), "--calib", "models/calib.npz",
                  "--calibrator", "headroom", "--rho", "2", "--report", str(report))
    assert code == 0
    data = json.loads(report.read_text())
    x_e = next(a for a in data["activations"] if a["activation"] == "x_e")
    # rho = 2 is far below B_max/B_min, so the margin * B_max floor sets g_amax: at most the literal amax
    assert x_e["g_amax"] <= float(np.abs(np.load("models/calib.npz")["x"]).max())
