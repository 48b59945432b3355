"""Small input files (SCALES.json, a checkpoint's config.json, genai_config.json): regular files only, with a
size cap, and strict JSON (no duplicate keys, no integers longer than any FP32 number needs)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from fp4pass.calib import ActivationScales
from fp4pass.calib.scales import ScalesFileError
from fp4pass.cli import main
from fp4pass.errors import ModelError, UsageError
from fp4pass.io import read_regular_file

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "models"

ENTRY = {"amax": 3.5, "g_amax": 3.5, "input_scale": 3.5 / 2688, "b_min": 1.0, "b_max": 3.5, "blocks": 1024}


def cli(capsys, *argv):
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    return code, err


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def scales_text(x_entry: str, act_entry: str | None = None) -> str:
    act = act_entry if act_entry is not None else json.dumps(ENTRY)
    return '{"calibrator": "max", "tensors": {"x": %s, "act": %s}}' % (x_entry, act)


@pytest.fixture
def work(tmp_path):
    shutil.copy(MODELS / "tiny_mlp.onnx", tmp_path / "m.onnx")
    return tmp_path


def test_a_well_formed_scales_file_converts(work, capsys):
    """The control for the cases below: the same file, with one value made bad, is what each refuses."""
    (work / "s.json").write_text(scales_text(json.dumps(ENTRY)))
    code, err = cli(capsys, "convert", work / "m.onnx", "-o", work / "o.onnx", "--scales", work / "s.json", "--quiet")
    assert code == 0, err


@pytest.mark.parametrize("digits", [300, 5000])
def test_integers_of_hundreds_or_thousands_of_digits_are_refused(work, capsys, digits):
    """300 digits overflow float (OverflowError), 5000 pass Python's int-from-string limit (ValueError): both
    were tracebacks; now one line naming the file."""
    entry = json.dumps(ENTRY).replace('"blocks": 1024', '"blocks": ' + "9" * digits)
    (work / "s.json").write_text(scales_text(entry))
    code, err = cli(capsys, "convert", work / "m.onnx", "-o", work / "o.onnx", "--scales", work / "s.json", "--quiet")
    assert code == 2
    line = one_line(err)
    assert "s.json" in line and f"{digits} digits" in line
    assert not (work / "o.onnx").exists()


def test_an_integer_as_long_as_fp32_max_is_read():
    """FP32's largest value written as an integer (39 digits) is still a number the file may hold."""
    big = str(int(3.4e38))
    data = ActivationScales.from_json(json.loads(scales_text(json.dumps(ENTRY).replace(
        '"amax": 3.5', f'"amax": {big}'))))
    assert data.tensors["x"].amax == float(big)


@pytest.mark.parametrize("first, second", [("NaN", "1.0"), ("1.0", "NaN"), ("2.0", "1.0")])
def test_a_key_given_twice_is_refused_whichever_value_comes_first(work, capsys, first, second):
    """json.loads keeps the last of two equal keys: a NaN amax followed by a good one was silently hidden."""
    entry = json.dumps(ENTRY).replace('"amax": 3.5', f'"amax": {first}, "amax": {second}')
    (work / "s.json").write_text(scales_text(entry))
    code, err = cli(capsys, "convert", work / "m.onnx", "-o", work / "o.onnx", "--scales", work / "s.json", "--quiet")
    assert code == 2
    line = one_line(err)
    assert "'amax' appears twice" in line and "s.json" in line


def test_duplicate_tensor_names_are_refused(tmp_path):
    path = tmp_path / "s.json"
    path.write_text('{"calibrator": "max", "tensors": {"x": %s, "x": %s}}' % (json.dumps(ENTRY), json.dumps(ENTRY)))
    with pytest.raises(ScalesFileError, match="'x' appears twice"):
        ActivationScales.load(path)


@pytest.mark.parametrize("special", ["/dev/zero", "/dev/null", "fifo", "dir"])
def test_scales_that_are_not_a_regular_file_are_refused_before_reading(work, capsys, special):
    """A symlink to /dev/zero was read forever; a FIFO blocked on open. Both are refused from their type."""
    link = work / "s.json"
    if special == "fifo":
        os.mkfifo(link)
    elif special == "dir":
        link.mkdir()
    else:
        link.symlink_to(special)
    code, err = cli(capsys, "convert", work / "m.onnx", "-o", work / "o.onnx", "--scales", link, "--quiet")
    assert code == 2
    line = one_line(err)
    assert str(link) in line and ("regular file" in line or "directory" in line)


def test_read_regular_file_caps_the_size(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"x" * 100)
    assert read_regular_file(path, 100) == b"x" * 100
    with pytest.raises(UsageError, match="100 bytes; at most 99"):
        read_regular_file(path, 99)
    with pytest.raises(ScalesFileError, match="no such file"):
        read_regular_file(tmp_path / "missing", 10, ScalesFileError)


def test_read_regular_file_refuses_a_character_device_without_reading_it():
    with pytest.raises(UsageError, match="character device"):
        read_regular_file("/dev/zero", 1 << 20)


def test_checkpoint_config_linked_to_dev_zero_is_refused(tmp_path):
    from fp4pass.fx.gpt_oss import read_config

    pytest.importorskip("transformers")
    (tmp_path / "config.json").symlink_to("/dev/zero")
    with pytest.raises(ModelError, match="config.json: a character device"):
        read_config(tmp_path)


def test_checkpoint_config_that_is_not_an_object_is_refused(tmp_path):
    from fp4pass.fx.gpt_oss import read_config

    pytest.importorskip("transformers")
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ModelError, match="expected a JSON object"):
        read_config(tmp_path)


@pytest.mark.parametrize("special", ["/dev/zero", "fifo"])
def test_genai_config_that_is_not_a_regular_file_is_no_hint(tmp_path, special):
    """genai_config.json beside a model is a layout hint; a FIFO or /dev/zero in its place is ignored, not read."""
    from fp4pass.onnx.qmoe_layout import Hints

    if special == "fifo":
        os.mkfifo(tmp_path / "genai_config.json")
    else:
        (tmp_path / "genai_config.json").symlink_to(special)
    assert Hints.of(None, tmp_path).genai_config is False
    (tmp_path / "genai_config.json").unlink()
    (tmp_path / "genai_config.json").write_text('{"model": {}}')
    assert Hints.of(None, tmp_path).genai_config is True

