"""Progress bars: items with a rate, bytes for conversion, nothing when quiet or not on a terminal."""

import re

import onnx

from fp4pass.examples.moe import build_moe
from fp4pass.progress import byte_progress, progress


def test_items_bar_counts_with_rate(capsys):
    assert list(progress(range(5), desc="calibrate", enabled=True, unit="batch")) == [0, 1, 2, 3, 4]
    err = capsys.readouterr().err
    assert "calibrate" in err and "5/5" in err and re.search(r"batch/s|s/batch", err)


def test_silent_when_quiet_or_not_a_terminal(capsys):
    assert list(progress(range(3), desc="x", enabled=False)) == [0, 1, 2]
    assert list(progress(range(3), desc="x", enabled=None)) == [0, 1, 2]  # capsys: stderr is not a TTY
    with byte_progress(10, "w", enabled=None) as bar:
        bar.update(10)
    assert capsys.readouterr().err == ""


def test_byte_bar_shows_bytes_and_rate(capsys):
    with byte_progress(3 * 1024 * 1024, "writing", enabled=True) as bar:
        bar.update(3 * 1024 * 1024)
    err = capsys.readouterr().err
    assert "writing" in err and "3.00M" in err and re.search(r"[KMG]?B/s", err)


def test_convert_reports_bytes_written(tmp_path, capsys):
    from fp4pass.pipeline import convert

    onnx.save(build_moe(), tmp_path / "m.onnx")
    convert(str(tmp_path / "m.onnx"), output=tmp_path / "o.onnx", show_progress=True)
    err = capsys.readouterr().err
    assert "converting and writing" in err and "100%" in err and re.search(r"[KMG]?B/s", err)
    convert(str(tmp_path / "m.onnx"), output=tmp_path / "q.onnx", show_progress=False)
    assert capsys.readouterr().err == ""
