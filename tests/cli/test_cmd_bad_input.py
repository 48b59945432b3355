"""Bad input on the command line: one line, exit 2, no traceback; values checked; external data from anywhere."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnx_builders as B
from cli_helpers import cli, one_line
from fp4pass.cli import main

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "models"


@pytest.fixture
def work(tmp_path):
    shutil.copy(MODELS / "tiny_mlp.onnx", tmp_path / "m.onnx")
    shutil.copy(MODELS / "calib.npz", tmp_path / "calib.npz")
    return tmp_path


# -- external data, from another working folder ---------------------------------------------------------------


@pytest.mark.parametrize("one_file", [True, False], ids=["one_data_file", "file_per_tensor"])
@pytest.mark.parametrize("name", ["tiny_mlp", "moe"])
def test_external_data_resolves_against_the_models_folder(tmp_path, capsys, monkeypatch, one_file, name):
    """Every tensor external (size_threshold=0), the small shape constants of moe.onnx (Unsqueeze axes)
    included, which onnxruntime needs while it resolves the graph; run from another folder."""
    model_dir, elsewhere = tmp_path / "model", tmp_path / "elsewhere"
    model_dir.mkdir()
    elsewhere.mkdir()
    source = onnx.load(MODELS / f"{name}.onnx")
    onnx.save(source, model_dir / "m.onnx", save_as_external_data=True,
              all_tensors_to_one_file=one_file, location="m.onnx.data" if one_file else None, size_threshold=0)
    assert len(os.listdir(model_dir)) == (2 if one_file else 1 + len(source.graph.initializer))
    monkeypatch.chdir(elsewhere)
    m, calib = model_dir / "m.onnx", MODELS / "calib.npz"
    assert cli(capsys, "diff", m, MODELS / f"{name}.onnx", "--quiet")[0] == 0
    assert cli(capsys, "calibrate", m, "--data", calib, "-o", "s.json", "--quiet")[0] == 0
    code, err = cli(capsys, "convert", m, "-o", "o.onnx", "--check")
    assert code == 0 and "check passed" in err
    code, err = cli(capsys, "convert", m, "-o", "c.onnx", "--calib", calib, "--check")
    assert code == 0 and "check passed" in err
    assert cli(capsys, "diff", m, "o.onnx", "--quiet")[0] == 0


# -- malformed files: one line, exit 2 ------------------------------------------------------------------------


def _mutated(path: Path, mutate) -> Path:
    model = onnx.load(MODELS / "tiny_mlp.onnx")
    mutate(model)
    path.write_bytes(model.SerializeToString())
    return path


def _set(tensor_name, **fields):
    def mutate(model):
        t = next(t for t in model.graph.initializer if t.name == tensor_name)
        for key, value in fields.items():
            if key == "dims":
                del t.dims[:]
                t.dims.extend(value)
            else:
                setattr(t, key, value)
    return mutate


MALFORMED = {
    "fp4 dims vs raw_data": (_set("fc1.weight", dims=[128, 66]), "raw_data holds 4096 bytes"),
    "scale dims vs raw_data": (_set("fc1.weight_scale", dims=[128, 3]), "raw_data holds 256 bytes"),
    "UNDEFINED data type": (_set("fc2.bias", data_type=0), "data type UNDEFINED"),
    "unknown data type": (_set("fc2.bias", data_type=99), "data type unknown (99)"),
    "duplicate output": (lambda m: m.graph.node[3].output.__setitem__(0, m.graph.node[1].output[0]), "defined twice"),
    "duplicate graph output": (lambda m: m.graph.output.append(m.graph.output[0]), "listed twice"),
}


@pytest.mark.parametrize("case", MALFORMED)
@pytest.mark.parametrize("command", ["inspect", "convert"])
def test_malformed_model_is_one_line_exit_2(work, capsys, case, command):
    mutate, message = MALFORMED[case]
    path = _mutated(work / "bad.onnx", mutate)
    extra = ["-o", work / "o.onnx"] if command == "convert" else []
    code, err = cli(capsys, command, path, *extra)
    assert code == 2 and message in one_line(err) and not (work / "o.onnx").exists()


def _external_fields(work: Path, key: str, value: bytes) -> Path:
    path = work / "ext.onnx"
    onnx.save(onnx.load(MODELS / "tiny_mlp.onnx"), path, save_as_external_data=True,
              all_tensors_to_one_file=True, location="ext.onnx.data", size_threshold=0)
    data = path.read_bytes()
    if key == "location":
        data = data.replace(b"ext.onnx.data", value, 1)
    else:
        model = onnx.load(path, load_external_data=False)
        for entry in model.graph.initializer[0].external_data:
            if entry.key == key:
                entry.value = value.decode()
        data = model.SerializeToString()
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("key, value, message", [
    ("location", b"ext.onnx.dat\xff", "not valid UTF-8"),
    ("length", b"4o96", "length '4o96' is not a non-negative integer"),
    ("offset", b"-1", "offset '-1' is not a non-negative integer"),
    ("offset", b"99999999", "truncated"),
])
def test_bad_external_data_fields_are_one_line_exit_2(work, capsys, key, value, message):
    path = _external_fields(work, key, value)
    for argv in (["inspect", path], ["convert", path, "-o", work / "o.onnx"]):
        code, err = cli(capsys, *argv)
        assert code == 2 and message in one_line(err)
    assert not (work / "o.onnx").exists()


def test_non_utf8_op_type_is_one_line_exit_2(work, capsys):
    data = (MODELS / "tiny_mlp.onnx").read_bytes().replace(b"Relu", b"R\xffl\xfe", 1)
    (work / "bad.onnx").write_bytes(data)
    code, err = cli(capsys, "convert", work / "bad.onnx", "-o", work / "o.onnx")
    assert code == 2 and "not valid UTF-8" in one_line(err) and not (work / "o.onnx").exists()


def test_invalid_model_refused_unless_allow_invalid(work, capsys):
    model = onnx.load(MODELS / "tiny_mlp.onnx")
    model.graph.node[3].input[0] = "nowhere"  # Relu reads a tensor nothing produces
    onnx.save(model, work / "bad.onnx")
    code, err = cli(capsys, "inspect", work / "bad.onnx")
    assert code == 2 and "fails the ONNX checker" in one_line(err) and "--allow-invalid" in err
    assert cli(capsys, "inspect", work / "bad.onnx", "--allow-invalid")[0] == 0


def test_int64_initializer_with_external_data_always_gives_a_valid_model(tmp_path, capsys):
    model = B.linear_model()
    shape = numpy_helper.from_array(np.array([-1, 48], np.int64), "y_shape")
    model.graph.initializer.append(shape)
    out_name = model.graph.output[0].name
    model.graph.node.append(helper.make_node("Reshape", [out_name, "y_shape"], ["y2"], name="reshape"))
    model.graph.output.append(helper.make_tensor_value_info("y2", TensorProto.FLOAT, [None, 48]))
    onnx.save(model, tmp_path / "m.onnx")
    onnx.checker.check_model(str(tmp_path / "m.onnx"), full_check=True)
    code, err = cli(capsys, "convert", tmp_path / "m.onnx", "-o", tmp_path / "o.onnx", "--external-data", "always",
                    "--check")
    assert code == 0, err
    onnx.checker.check_model(str(tmp_path / "o.onnx"), full_check=True)


def test_output_the_checker_refuses_is_a_bug_exit_3_nothing_written(work, capsys, monkeypatch):
    import onnx_ir as ir

    import fp4pass.onnx.loading as loading

    real_save = ir.save

    def corrupting_save(model, path, **kwargs):
        model.graph.node(0).op_type = "NoSuchOp"
        return real_save(model, path, **kwargs)

    monkeypatch.setattr(loading.ir, "save", corrupting_save)
    code, err = cli(capsys, "convert", work / "m.onnx", "-o", work / "o.onnx", "--report", work / "r.json")
    line = one_line(err)
    assert code == 3 and "fails the ONNX checker" in line and "bug" in line and "please report" in line
    assert sorted(os.listdir(work)) == ["calib.npz", "m.onnx"]


def _dangling_input(model):
    model.graph.node[-1].input[0] = "nowhere"


def _block_size_ints(model):
    (dq,) = [n for n in model.graph.node if n.op_type == "DequantizeLinear"][:1]
    (attr,) = [a for a in dq.attribute if a.name == "block_size"]
    attr.type = onnx.AttributeProto.INTS
    attr.ints.extend([32])


@pytest.mark.parametrize("mutate,message", [(_dangling_input, "not a valid graph"),
                                            (_block_size_ints, "attribute 'block_size' is INTS, not an INT")],
                         ids=["dangling_input", "block_size_ints"])
def test_invalid_model_allowed_in_is_exit_2_where_onnxruntime_runs_it(work, capsys, mutate, message):
    """--allow-invalid lets the model in; diff and --check, which lower it for onnxruntime, then give one
    line and exit 2 (never exit 3), and the unchecked model is not left."""
    bad = _mutated(work / "bad.onnx", mutate)
    code, err = cli(capsys, "diff", bad, MODELS / "tiny_mlp.onnx", "--allow-invalid", "--quiet")
    assert code == 2 and message in one_line(err)
    code, err = cli(capsys, "convert", bad, "-o", work / "o.onnx", "--allow-invalid", "--check", "--quiet")
    assert code == 2 and message in one_line(err) and not (work / "o.onnx").exists()


def test_unexpected_exception_exit_3_traceback_only_with_debug(work, capsys, monkeypatch):
    import fp4pass.onnx.inspection as inspection

    monkeypatch.setattr(inspection, "inspect", lambda path: {}["boom"])
    code, err = cli(capsys, "inspect", work / "m.onnx")
    assert code == 3 and "please report" in one_line(err) and "KeyError" in err
    code, err = cli(capsys, "inspect", work / "m.onnx", "--debug")
    assert code == 3 and "Traceback" in err


def test_unwritable_output_is_one_line_exit_2(work, capsys, monkeypatch):
    import fp4pass.io as fio

    monkeypatch.setattr(os, "access", lambda path, mode: False)
    code, err = cli(capsys, "convert", work / "m.onnx", "-o", work / "o.onnx")
    assert code == 2 and "is not writable" in one_line(err)
    monkeypatch.undo()

    import fp4pass.onnx.loading as loading

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(work / "o.onnx"))

    monkeypatch.setattr(loading.ir, "save", denied)
    code, err = cli(capsys, "convert", work / "m.onnx", "-o", work / "o.onnx")
    assert code == 2 and "Permission denied" in one_line(err) and not (work / "o.onnx").exists()


# -- values ----------------------------------------------------------------------------------------------------


def _scales(work: Path, **override) -> Path:
    assert main(["calibrate", str(work / "m.onnx"), "--data", str(work / "calib.npz"), "-o", str(work / "s.json"),
                 "--quiet"]) == 0
    data = json.loads((work / "s.json").read_text())
    for name, entry in list(data["tensors"].items()):
        if "rename" in override:
            data["tensors"]["no_such_tensor"] = data["tensors"].pop(name)
            break
        entry.update({k: v for k, v in override.items()})
    (work / "s.json").write_text(json.dumps(data))
    return work / "s.json"


@pytest.mark.parametrize("override, message", [
    ({"input_scale": 1e39}, "outside [2^-140, FP32 max / 448]"),
    ({"input_scale": 1e-50}, "outside [2^-140, FP32 max / 448]"),
    ({"input_scale": 0.0}, "input_scale must be > 0"),
    ({"g_amax": -1.0}, "g_amax >= 0"),
    ({"rename": True}, "is not an activation any FP4 consumer reads (known: "),
])
def test_scales_values_checked(work, capsys, override, message):
    path = _scales(work, **override)
    capsys.readouterr()
    code, err = cli(capsys, "convert", work / "m.onnx", "-o", work / "o.onnx", "--scales", path, "--check")
    assert code == 2 and message in one_line(err) and not (work / "o.onnx").exists()


def test_binary_scales_file(work, capsys):
    (work / "s.json").write_bytes(bytes(range(256)))
    code, err = cli(capsys, "convert", work / "m.onnx", "-o", work / "o.onnx", "--scales", work / "s.json")
    assert code == 2 and "not UTF-8" in one_line(err)


@pytest.mark.parametrize("arrays, message", [
    ({"x": np.zeros((0, 64), np.float32)}, "no rows"),
    ({"x": np.zeros((4, 8, 64), np.float32)}, "rank 3"),
    ({"x": np.zeros((4, 63), np.float32)}, "dim 1 is 63, graph input wants 64"),
])
def test_calibration_data_checked_before_onnxruntime(work, capsys, arrays, message):
    np.savez(work / "bad.npz", **arrays)
    for argv in (["calibrate", work / "m.onnx", "--data", work / "bad.npz", "-o", work / "s2.json"],
                 ["convert", work / "m.onnx", "--calib", work / "bad.npz", "-o", work / "o.onnx"]):
        code, err = cli(capsys, *argv)
        assert code == 2 and message in one_line(err)
    assert not (work / "s2.json").exists() and not (work / "o.onnx").exists()


def test_batch_size_zero_rejected(work, capsys):
    code, err = cli(capsys, "calibrate", work / "m.onnx", "--data", work / "calib.npz", "-o", work / "s.json",
                    "--batch-size", "0")
    assert code == 2 and "--batch-size" in err and not (work / "s.json").exists()


@pytest.mark.parametrize("argv, message", [
    (["--seed", "-1"], "--seed"),
    (["--shape", "x=99999999999,64"], "at most 1073741824"),
])
def test_diff_rejects_bad_seed_and_huge_shapes(work, capsys, argv, message):
    code, err = cli(capsys, "diff", work / "m.onnx", work / "m.onnx", *argv)
    assert code == 2 and message in err and "Traceback" not in err


def test_diff_never_calls_nan_identical(tmp_path, capsys):
    for name in ("a", "b"):
        graph = helper.make_graph(
            [helper.make_node("Div", ["x", "zero"], ["q"]), helper.make_node("Mul", ["q", "zero"], ["y"])], "g",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 8])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, 8])],
            [numpy_helper.from_array(np.zeros((), np.float32), "zero")])
        onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / f"{name}.onnx")
    code, _ = cli(capsys, "diff", tmp_path / "a.onnx", tmp_path / "b.onnx", "--json", tmp_path / "d.json")
    data = json.loads((tmp_path / "d.json").read_text())
    assert code == 1 and data["passed"] is False and data["outputs"][0]["nan"] == 64


def test_provider_cuda_without_cuda_is_stated_or_refused(work, capsys):
    from fp4pass.onnx.runtime import cuda_available

    if cuda_available()[0]:
        pytest.skip("CUDA runs here: nothing to fall back from")
    code, err = cli(capsys, "diff", work / "m.onnx", work / "m.onnx", "--provider", "cuda", "--quiet")
    assert code == 0 and "falling back to CPU" in err
    code, err = cli(capsys, "diff", work / "m.onnx", work / "m.onnx", "--provider", "cuda", "--strict")
    assert code == 2 and "--strict" in one_line(err)
