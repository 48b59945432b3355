"""fp4pass.io: the checks before any work, atomic writes, umask modes, rollback and stale temporaries."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from fp4pass import io as fio
from fp4pass.errors import UsageError


def test_check_outputs_refuses_every_way_of_naming_an_input(tmp_path):
    src = tmp_path / "m.onnx"
    src.write_bytes(b"model")
    (tmp_path / "sub").mkdir()
    os.symlink(src, tmp_path / "link.onnx")
    os.link(src, tmp_path / "hard.onnx")
    for alias in (src, tmp_path / "sub" / ".." / "m.onnx", tmp_path / "link.onnx", tmp_path / "hard.onnx"):
        with pytest.raises(UsageError, match="refusing to write over the input"):
            fio.check_outputs({"--report": str(alias)}, {"the model": str(src)})


def test_check_outputs_refuses_two_outputs_alike_dirs_and_missing_folders(tmp_path):
    with pytest.raises(UsageError, match="the same file as -o"):
        fio.check_outputs({"-o": str(tmp_path / "a.json"), "--report": str(tmp_path / "." / "a.json")})
    with pytest.raises(UsageError, match="is a directory"):
        fio.check_outputs({"-o": str(tmp_path)})
    with pytest.raises(UsageError, match="does not exist"):
        fio.check_outputs({"-o": str(tmp_path / "missing" / "a.json")})
    data = tmp_path / "calib"
    data.mkdir()
    with pytest.raises(UsageError, match="inside the input folder"):
        fio.check_outputs({"-o": str(data / "s.json")}, {"--data": str(data)})
    fio.check_outputs({"-o": str(tmp_path / "a.json"), "--report": str(tmp_path / "b.json")},
                      {"--data": str(data)})


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_check_outputs_refuses_a_read_only_folder(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        with pytest.raises(UsageError, match="not writable"):
            fio.check_outputs({"-o": str(ro / "a.json")})
    finally:
        ro.chmod(0o755)


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_outputs_follow_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        fio.write_json(tmp_path / "r.json", {"a": 1})
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "r.json").st_mode) == 0o666 & ~umask


def test_atomic_output_leaves_nothing_when_the_writer_fails(tmp_path):
    target = tmp_path / "out.json"
    target.write_text("old")
    with pytest.raises(RuntimeError):
        with fio.atomic_output(target) as tmp:
            assert tmp.name.startswith(fio.TMP_PREFIX + str(os.getpid()) + "-")
            tmp.write_text("half")
            raise RuntimeError("boom")
    assert os.listdir(tmp_path) == ["out.json"] and target.read_text() == "old"


def test_rollback_keeps_reports_on_exit_1_and_removes_results(tmp_path):
    with fio.output_session() as session:
        fio.write_json(tmp_path / "model.json", {}, kind=fio.RESULT)
        fio.write_json(tmp_path / "report.json", {}, kind=fio.REPORT)
        session.rollback(1)
    assert os.listdir(tmp_path) == ["report.json"]
    with fio.output_session() as session:
        fio.write_json(tmp_path / "model.json", {}, kind=fio.RESULT)
        session.rollback(2)
    assert os.listdir(tmp_path) == ["report.json"]


def _dead_pid() -> int:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(proc.stdout)


def test_stale_temporaries_of_dead_runs_are_removed_live_ones_kept(tmp_path):
    dead = _dead_pid()
    (tmp_path / f"{fio.TMP_PREFIX}{dead}-abcd-m.onnx").write_bytes(b"x")
    (tmp_path / f"{fio.TMP_PREFIX}{dead}-abcd-m.onnx.d").mkdir()
    (tmp_path / f"{fio.TMP_PREFIX}{dead}-abcd-m.onnx.d" / "m.onnx.data").write_bytes(b"x" * 10)
    live = tmp_path / f"{fio.TMP_PREFIX}{os.getppid()}-abcd-m.onnx"
    live.write_bytes(b"x")
    (tmp_path / "user.onnx").write_bytes(b"x")
    removed = fio.remove_stale(tmp_path)
    assert len(removed) == 2
    assert sorted(os.listdir(tmp_path)) == sorted([live.name, "user.onnx"])
    # the next write in that folder does the same
    (tmp_path / f"{fio.TMP_PREFIX}{dead}-ffff-r.json").write_bytes(b"x")
    fio.write_json(tmp_path / "r.json", {})
    assert sorted(os.listdir(tmp_path)) == sorted([live.name, "user.onnx", "r.json"])
