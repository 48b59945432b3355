"""Small input files (SCALES.json, a checkpoint's config.json, genai_config.json): regular files only, with a
size cap, and strict JSON (no duplicate keys, no integers longer than any FP32 number needs)."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from fp4pass.calib import ActivationScales
from fp4pass.calib.scales import ScalesFileError
from fp4pass.cli import main
from fp4pass.errors import ModelError, UsageError
from fp4pass import io as fio
from fp4pass.io import read_regular_file

ROOT = Path(__file__).resolve().parents[2]
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



def test_read_regular_file_names_what_it_found_instead(tmp_path):
    """Each kind of special file is named as what it is, in the one line the user sees."""
    import socket
    import stat

    from fp4pass.io import file_kind

    (tmp_path / "d").mkdir()
    os.mkfifo(tmp_path / "p")
    sock = socket.socket(socket.AF_UNIX)
    cwd = os.getcwd()
    os.chdir(tmp_path)  # a short relative name: a socket's path is limited to about 100 bytes
    try:
        sock.bind("s")
    finally:
        os.chdir(cwd)
    try:
        for path, kind in ((tmp_path / "d", "a directory"), (tmp_path / "p", "a FIFO"),
                           ("/dev/null", "a character device"), (tmp_path / "s", "a socket")):
            with pytest.raises(UsageError) as raised:
                read_regular_file(path, 10)
            assert str(raised.value) == f"{path}: {kind}; only regular files are read"
    finally:
        sock.close()
    # no block device or unknown kind can be made without privileges: their names from the mode bits
    assert file_kind(stat.S_IFBLK | 0o600) == "a block device"
    assert file_kind(0o600) == "not a regular file"


def test_read_regular_file_reports_a_path_it_cannot_stat(tmp_path):
    loop = tmp_path / "loop.json"
    loop.symlink_to(loop.name)  # a symlink to itself: ELOOP, not "no such file"
    with pytest.raises(UsageError) as raised:
        read_regular_file(loop, 10)
    assert str(raised.value) == f"{loop}: cannot be read ({os.strerror(errno.ELOOP)})"


def test_a_fifo_swapped_in_after_the_check_is_refused_without_waiting(tmp_path, monkeypatch):
    """Between the type check and the open, the path may be replaced by a FIFO: opening it for reading
    must not wait for a writer (O_NONBLOCK), and a terminal must never become the controlling one
    (O_NOCTTY); the descriptor's own type is checked again."""
    import signal

    regular = tmp_path / "regular.json"
    regular.write_text("{}")
    fifo = tmp_path / "s.json"
    os.mkfifo(fifo)
    real_stat, real_open, flags = os.stat, os.open, []
    monkeypatch.setattr(os, "stat", lambda p, *a, **k: real_stat(regular if p == fifo else p, *a, **k))

    def opened(path, how, *rest):
        flags.append(how)
        return real_open(path, how, *rest)

    monkeypatch.setattr(os, "open", opened)

    def too_late(*_):
        raise TimeoutError("the open waited for a writer")

    previous = signal.signal(signal.SIGALRM, too_late)
    signal.setitimer(signal.ITIMER_REAL, 5)
    try:
        with pytest.raises(UsageError) as raised:
            read_regular_file(fifo, 10)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert str(raised.value) == f"{fifo}: a FIFO; only regular files are read"
    assert len(flags) == 1 and flags[0] & os.O_NONBLOCK and flags[0] & os.O_NOCTTY
    assert flags[0] & (os.O_WRONLY | os.O_RDWR) == 0


def _stat_as(monkeypatch, path, stand_in):
    """os.stat of ``path`` answers for ``stand_in``: the file changed between the check and the open."""
    real_stat = os.stat
    monkeypatch.setattr(os, "stat", lambda p, *a, **k: real_stat(stand_in if p == path else p, *a, **k))


@pytest.mark.parametrize("limit, extra", [(2 << 20, 1), ((1 << 20) + 10, 1), ((1 << 20) + 10, 3 << 20)])
def test_a_file_grown_past_the_cap_after_the_check_is_refused(tmp_path, monkeypatch, limit, extra):
    """The size is checked again on the file opened, before anything is read: nothing is read from a file that
    has grown past the cap."""
    small = tmp_path / "small.json"
    small.write_bytes(b"{}")
    grown = tmp_path / "grown.json"
    grown.write_bytes(b"y" * (limit + extra))
    _stat_as(monkeypatch, grown, small)
    real_read, sizes = os.read, []

    def read(fd, n):
        chunk = real_read(fd, n)
        sizes.append(len(chunk))
        return chunk

    monkeypatch.setattr(os, "read", read)
    with pytest.raises(UsageError) as raised:
        read_regular_file(grown, limit)
    assert str(raised.value) == f"{grown}: {limit + extra} bytes; at most {limit} are read from such a file"
    assert sum(sizes) == 0, sizes


def test_a_file_of_several_reads_comes_back_whole(tmp_path):
    path = tmp_path / "big.json"
    data = np.random.default_rng(3).integers(0, 256, (2 << 20) + 3, dtype=np.uint8).tobytes()
    path.write_bytes(data)
    assert read_regular_file(path, len(data)) == data


def test_a_file_removed_or_failing_after_the_check_is_one_line(tmp_path, monkeypatch):
    small = tmp_path / "small.json"
    small.write_bytes(b"{}")
    gone = tmp_path / "gone.json"
    _stat_as(monkeypatch, gone, small)
    with pytest.raises(UsageError) as raised:
        read_regular_file(gone, 10)
    assert str(raised.value) == f"{gone}: cannot be read ({os.strerror(errno.ENOENT)})"
    monkeypatch.undo()

    def failing_read(fd, n):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "read", failing_read)
    with pytest.raises(UsageError) as raised:
        read_regular_file(small, 10)
    assert str(raised.value) == f"{small}: cannot be read ({os.strerror(errno.EIO)})"
