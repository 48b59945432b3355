"""fp4pass.io: the checks before any work, atomic writes, umask modes, rollback and stale temporaries."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

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
            assert tmp.parent.name.startswith(fio.TMP_PREFIX + str(os.getpid()) + "-") and tmp.name == "out.json"
            assert json.loads((tmp.parent / fio.MARKER).read_text())["pid"] == os.getpid()
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


@pytest.mark.parametrize("code", [2, 3, 130, 143])
def test_rollback_after_any_other_failure_removes_reports_too(tmp_path, code):
    """Only exit 1 (a check below its threshold) keeps the reports that explain it; any other failure leaves
    nothing of the run, reports included (``--keep-unchecked`` keeps the model, never a stale report)."""
    with fio.output_session() as session:
        fio.write_json(tmp_path / "model.json", {}, kind=fio.RESULT)
        fio.write_json(tmp_path / "report.json", {}, kind=fio.REPORT)
        removed = session.rollback(code)
    assert os.listdir(tmp_path) == [] and len(removed) == 2
    with fio.output_session() as session:
        fio.write_json(tmp_path / "model.json", {}, kind=fio.RESULT)
        fio.write_json(tmp_path / "report.json", {}, kind=fio.REPORT)
        session.rollback(code, keep_results=True)
    assert os.listdir(tmp_path) == ["model.json"]


def _dead_pid() -> int:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(proc.stdout)


def _temporary(folder: Path, pid: int, host: str | None = None, marker: bool = True, start: str | None = None,
               name: str = "m.onnx") -> Path:
    """A temporary folder as a run of ``pid`` on ``host`` (default: here) leaves it, with its marker."""
    path = folder / f"{fio.TMP_PREFIX}{pid}-h{host or fio.host_token()}-abcd-{name}.d"
    path.mkdir()
    (path / name).write_bytes(b"x" * 10)
    if marker:
        fio.write_marker(path, pid=pid, host=host, start=start)
    return path


def test_stale_temporaries_of_dead_runs_are_removed_live_ones_kept(tmp_path):
    dead = _dead_pid()
    stale = _temporary(tmp_path, dead)
    live = _temporary(tmp_path, os.getppid(), name="l.onnx")
    (tmp_path / "user.onnx").write_bytes(b"x")
    removed = fio.remove_stale(tmp_path)
    assert removed == [stale]
    assert sorted(os.listdir(tmp_path)) == sorted([live.name, "user.onnx"])
    # the next write in that folder does the same
    stale = _temporary(tmp_path, dead, name="r.json")
    fio.write_json(tmp_path / "r.json", {})
    assert sorted(os.listdir(tmp_path)) == sorted([live.name, "user.onnx", "r.json"])


def _named_like_a_dead_run(folder: Path, dead: int) -> list[Path]:
    """What a user may have under a temporary's name: a file, a folder without the marker, a symlink to a
    temporary, a copy of a dead run's temporary (its marker names another inode)."""
    here = fio.host_token()
    a_file = folder / f"{fio.TMP_PREFIX}{dead}-h{here}-abcd-model.onnx"
    a_file.write_bytes(b"onnx")
    a_folder = folder / f"{fio.TMP_PREFIX}{dead}-h{here}-abcd-ckpt"
    a_folder.mkdir()
    (a_folder / "config.json").write_text("{}")
    elsewhere = folder.parent / "elsewhere"
    elsewhere.mkdir()
    a_link = folder / f"{fio.TMP_PREFIX}{dead}-h{here}-abcd-link"
    a_link.symlink_to(_temporary(elsewhere, dead))
    original = _temporary(elsewhere, dead, name="copied")
    a_copy = folder / original.name
    shutil.copytree(original, a_copy)
    return [a_file, a_folder, a_link, a_copy]


@pytest.mark.parametrize("older_than", [None, 0.0])
def test_only_fp4pass_temporaries_are_ever_removed(tmp_path, older_than):
    """A file or folder that merely looks like a dead run's temporary (a salvaged one, a checkpoint folder so
    named) is never removed, with --older-than 0 neither: only a real folder whose marker names its inode."""
    folder = tmp_path / "work"
    folder.mkdir()
    kept = _named_like_a_dead_run(folder, _dead_pid())
    assert fio.remove_stale(folder, older_than=older_than) == []
    assert all(os.path.lexists(p) for p in kept)
    assert (tmp_path / "elsewhere").exists() and len(os.listdir(tmp_path / "elsewhere")) == 2


def test_the_inputs_of_the_sweeping_run_are_kept(tmp_path):
    stale = _temporary(tmp_path, _dead_pid())
    assert fio.remove_stale(tmp_path, keep=(stale,)) == [] and stale.exists()
    assert fio.remove_stale(tmp_path) == [stale]


def test_a_live_pid_with_another_start_time_is_a_reused_pid(tmp_path):
    """The pid runs, but it is not the process that wrote the marker (its start time differs): stale."""
    reused = _temporary(tmp_path, os.getppid(), start="1")
    live = _temporary(tmp_path, os.getppid(), name="l.onnx")
    assert fio.remove_stale(tmp_path) == [reused] and live.exists()


def test_clean_older_than_0_leaves_a_live_run_alone(tmp_path, capsys):
    """`fp4pass clean --older-than 0`: other hosts' old temporaries go, a run alive here stays."""
    from fp4pass.cli import main

    live = _temporary(tmp_path, os.getppid())
    old = time.time() - 3 * 3600
    for path in (live, live / "m.onnx"):
        os.utime(path, (old, old))
    assert main(["clean", str(tmp_path), "--older-than", "0"]) == 0 and live.exists()
    assert (live / "m.onnx").read_bytes() == b"x" * 10


def test_temporaries_of_another_host_or_namespace_are_kept_whatever_their_pid(tmp_path):
    """A pid is only meaningful where it was issued: another host's (or container's) temporary with a pid that
    is dead here may belong to a live run there."""
    dead, here = _dead_pid(), fio.host_token()
    other = format((int(here, 16) + 1) % 16**8, "08x")
    foreign = _temporary(tmp_path, dead, host=other)
    ours = _temporary(tmp_path, dead, name="o.onnx")
    assert fio.remove_stale(tmp_path) == [ours]
    assert [p.name for p in tmp_path.iterdir()] == [foreign.name]
    # only an explicit age removes them, and only once they are that old (the newest file inside counts)
    assert fio.remove_stale(tmp_path, older_than=3600) == []
    old = time.time() - 7200
    os.utime(foreign, (old, old))
    assert fio.remove_stale(tmp_path, older_than=3600) == []
    os.utime(foreign / "m.onnx", (old, old))
    os.utime(foreign / fio.MARKER, (old, old))
    assert fio.remove_stale(tmp_path, older_than=3600) == [foreign]
    assert list(tmp_path.iterdir()) == []


def test_host_token_changes_with_the_host_name(monkeypatch):
    token = fio.host_token()
    monkeypatch.setattr(fio.stale.socket, "gethostname", lambda: "another-host")
    assert fio.host_token() != token


def test_clean_older_than_removes_foreign_temporaries(tmp_path, capsys):
    from fp4pass.cli import main

    stale = _temporary(tmp_path, 1, host="00000000")
    for path in (stale, stale / "m.onnx", stale / fio.MARKER):
        os.utime(path, (time.time() - 3 * 3600,) * 2)
    assert main(["clean", str(tmp_path)]) == 0 and stale.exists()
    assert main(["clean", str(tmp_path), "--older-than", "2"]) == 0 and not stale.exists()
    with pytest.raises(SystemExit) as exited:
        main(["clean", str(tmp_path), "--older-than", "nan"])
    assert exited.value.code == 2


@pytest.mark.parametrize("length", [200, 228, 240, 255])
def test_long_legal_output_names_get_a_temporary_that_fits(tmp_path, length):
    name = "é" * ((length - 5) // 2) + "x" * ((length - 5) % 2) + ".json"
    assert len(name.encode()) == length
    tmp = fio.temp_name(tmp_path / name, ".d")
    assert len(tmp.name.encode()) <= 255 and tmp.name.endswith(".d")
    tmp.name.encode().decode("utf-8")  # cut at a character boundary
    fio.write_json(tmp_path / name, {"a": 1})
    assert json.loads((tmp_path / name).read_text()) == {"a": 1}
    assert os.listdir(tmp_path) == [name]


# -- outputs that are not plain files of ours -----------------------------------------------------------------


def test_a_symlink_out_of_the_folder_is_refused_not_replaced(tmp_path):
    """``--report /dev/stdout`` with stdout redirected to a file: /dev/stdout is a symlink that resolves to a
    regular file elsewhere. Renaming over it would replace the system's symlink."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "log.txt").write_text("kept")
    out = tmp_path / "out"
    out.mkdir()
    (out / "stdout").symlink_to(elsewhere / "log.txt")
    for call in (lambda: fio.check_outputs({"--report": out / "stdout"}),
                 lambda: fio.write_json(out / "stdout", {"a": 1})):
        with pytest.raises(UsageError, match="symlink .*outside the output's folder"):
            call()
    assert (out / "stdout").is_symlink() and (elsewhere / "log.txt").read_text() == "kept"
    assert sorted(os.listdir(out)) == ["stdout"]


def test_a_symlink_to_a_sibling_folder_with_a_shared_prefix_is_outside(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out_evil").mkdir()
    (tmp_path / "out_evil" / "r.json").write_text("theirs")
    (tmp_path / "out" / "r.json").symlink_to(tmp_path / "out_evil" / "r.json")
    with pytest.raises(UsageError, match="outside the output's folder"):
        fio.write_json(tmp_path / "out" / "r.json", {})
    assert (tmp_path / "out_evil" / "r.json").read_text() == "theirs"


def test_a_symlink_inside_the_folder_is_written_through(tmp_path):
    (tmp_path / "real.json").write_text("old")
    (tmp_path / "link.json").symlink_to("real.json")
    fio.check_outputs({"--report": tmp_path / "link.json"})
    fio.write_json(tmp_path / "link.json", {"a": 2})
    assert (tmp_path / "link.json").is_symlink()
    assert json.loads((tmp_path / "real.json").read_text()) == {"a": 2}


@pytest.mark.parametrize("special", ["fifo", "device"])
def test_devices_and_fifos_are_refused(tmp_path, special):
    if special == "fifo":
        path = tmp_path / "pipe"
        os.mkfifo(path)
    else:
        path = Path("/dev/null")
    for call in (lambda: fio.check_outputs({"-o": path}), lambda: fio.write_json(path, {})):
        with pytest.raises(UsageError, match="not a regular file"):
            call()
    assert path.exists() and not path.is_file()


def test_dev_stdout_redirected_to_a_file_is_refused_by_the_cli(tmp_path):
    """The reported case end to end: as a user would type it, stdout redirected to a file."""
    log = tmp_path / "log.txt"
    with open(log, "w") as out:
        proc = subprocess.run([sys.executable, "-m", "fp4pass", "convert", "models/moe.onnx", "-o",
                               str(tmp_path / "m.onnx"), "--report", "/dev/stdout"], stdout=out,
                              stderr=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 2, proc.stderr
    assert "/dev/stdout" in proc.stderr and "Traceback" not in proc.stderr
    assert os.path.islink("/dev/stdout")
    assert sorted(os.listdir(tmp_path)) == ["log.txt"]


# -- what a failed run removes ----------------------------------------------------------------------------------


def test_rollback_removes_only_what_this_run_put_there(tmp_path):
    """Run A writes m.onnx and later fails its check; meanwhile run B wrote m.onnx again. A's rollback must
    not remove B's file."""
    with fio.output_session() as session:
        with fio.atomic_output(tmp_path / "m.onnx") as tmp:
            tmp.write_bytes(b"run A")
        with fio.atomic_output(tmp_path / "r.json", kind=fio.REPORT) as tmp:
            tmp.write_bytes(b"report A")
        other = tmp_path / "other"
        other.write_bytes(b"run B")
        os.replace(other, tmp_path / "m.onnx")  # run B's atomic rename
        removed = session.rollback(2)
    assert removed == [tmp_path / "r.json"]
    assert (tmp_path / "m.onnx").read_bytes() == b"run B"


def test_fsync_comes_before_the_rename_and_the_folder_after(tmp_path, monkeypatch):
    """A rename before the data is durable can leave an empty file under the final name after a crash."""
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", os.path.basename(dst)))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    fio.write_json(tmp_path / "r.json", {"a": 1})
    kinds = [kind for kind, _ in events]
    assert kinds == ["fsync", "replace", "fsync"], events
    assert Path(events[0][1]).parent.name.startswith(fio.TMP_PREFIX) and events[0][1].endswith("/r.json")
    assert events[2][1] == str(tmp_path)  # the folder, after the rename


def test_temporaries_of_this_process_and_of_other_users_live_processes_are_kept(tmp_path, monkeypatch):
    """A temporary of this process is one it is writing now; a pid that may not be signalled
    (PermissionError) is another user's live process: neither is stale."""
    ours = _temporary(tmp_path, os.getpid())
    assert fio.remove_stale(tmp_path) == [] and ours.exists()
    theirs = _temporary(tmp_path, _dead_pid(), name="t.onnx")

    def kill(pid, sig):
        assert sig == 0  # only asked, never signalled
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "kill", kill)
    monkeypatch.setattr(fio.stale, "process_start", lambda pid: None)
    assert fio.remove_stale(tmp_path) == [] and theirs.exists() and ours.exists()
    monkeypatch.undo()
    assert fio.remove_stale(tmp_path) == [theirs] and ours.exists()


def test_a_temporary_named_with_a_number_no_pid_can_be_is_stale_not_a_crash(tmp_path):
    """A pid too large for the kernel's pid type is no process: the temporary goes like a dead run's, and
    the writes in that folder go on (they used to fail with an OverflowError, exit 3)."""
    _temporary(tmp_path, 10**20)
    fio.write_json(tmp_path / "r.json", {"a": 3})
    assert os.listdir(tmp_path) == ["r.json"] and json.loads((tmp_path / "r.json").read_text()) == {"a": 3}


def test_importing_fp4pass_then_onnxruntime_writes_nothing_in_home_or_tmpdir(tmp_path):
    """onnxruntime 1.31 writes ~/.cache/Microsoft/DeveloperTools/.onnxruntime/ and $TMPDIR/.ses on import
    unless ORT_DISABLE_TELEMETRY is set; fp4pass sets it (a value the user gave is kept)."""
    pytest.importorskip("onnxruntime")
    home, tmp = tmp_path / "home", tmp_path / "tmp"
    home.mkdir()
    tmp.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "ORT_DISABLE_TELEMETRY"} | {"HOME": str(home), "TMPDIR": str(tmp)}
    code = "import fp4pass, onnxruntime, os; print(os.environ['ORT_DISABLE_TELEMETRY'])"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "1", proc.stderr
    assert list(home.iterdir()) == [] and list(tmp.iterdir()) == []
    proc = subprocess.run([sys.executable, "-c", code], env=env | {"ORT_DISABLE_TELEMETRY": "0"}, capture_output=True,
                          text=True, timeout=300)
    assert proc.stdout.strip() == "0"


@pytest.mark.parametrize("existed", [False, True])
def test_a_failure_right_after_a_folders_rename_takes_it_back_out(tmp_path, monkeypatch, existed):
    """Without the CLI's session too: the folder's fsync after the rename fails (or a signal lands there), and
    the folder goes again; an empty folder that stood there before is an empty folder again."""
    real = fio.fsync_folder

    def failing(folder):
        if Path(folder) == tmp_path:
            raise OSError(5, "Input/output error")
        return real(folder)

    monkeypatch.setattr(fio.folders, "fsync_folder", failing)
    if existed:
        (tmp_path / "out").mkdir()
    with pytest.raises(OSError):
        with fio.atomic_folder(tmp_path / "out") as tmp:
            (tmp / "f").write_text("x")
            assert json.loads((tmp.parent / fio.MARKER).read_text())["pid"] == os.getpid()
    assert [p.name for p in tmp_path.iterdir()] == (["out"] if existed else [])
    if existed:
        assert list((tmp_path / "out").iterdir()) == []


def test_a_live_run_whose_start_time_cannot_be_read_is_left_alone(tmp_path, monkeypatch):
    """No /proc to ask (or the process hides it): a live pid is taken for the run that wrote the marker."""
    live = _temporary(tmp_path, os.getppid(), start="12345")
    monkeypatch.setattr(fio.stale, "process_start", lambda pid: None)
    assert fio.remove_stale(tmp_path) == [] and live.exists()


@pytest.mark.parametrize("kind", ["fifo", "big", "symlink", "not-json", "pid-0", "list", "no-magic", "pid-text"])
def test_a_marker_that_is_not_fp4pass_s_keeps_its_folder(tmp_path, kind):
    """A FIFO in the marker's place is not waited on, and neither it nor a marker too big to be ours, a symlink
    to a dead run's marker elsewhere, text that is not the marker's JSON or a pid no process has makes the folder
    a temporary."""
    import signal

    dead = _dead_pid()
    folder = _temporary(tmp_path, dead, marker=False)
    marker = folder / fio.MARKER
    if kind == "fifo":
        os.mkfifo(marker)
    elif kind == "big":
        fio.write_marker(folder, pid=dead)
        marker.write_text(marker.read_text()[:-1] + ", \"pad\": \"" + "x" * 5000 + "\"}")
    elif kind == "symlink":
        elsewhere = tmp_path.parent / f"{tmp_path.name}-elsewhere"
        elsewhere.mkdir()
        other = _temporary(elsewhere, dead)
        marker.symlink_to(other / fio.MARKER)
    elif kind == "not-json":
        marker.write_text("pid 1")
    elif kind == "list":
        marker.write_text("[1]")
    elif kind in ("no-magic", "pid-text"):
        fio.write_marker(folder, pid=dead)
        data = json.loads(marker.read_text())
        data = {k: v for k, v in data.items() if k != "fp4pass"} if kind == "no-magic" else data | {"pid": str(dead)}
        marker.write_text(json.dumps(data))
    else:
        fio.write_marker(folder, pid=dead)
        data = json.loads(marker.read_text()) | {"pid": 0}
        marker.write_text(json.dumps(data))

    def hung(signum, frame):
        raise AssertionError("the sweep waited on the marker")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(10)
    try:
        assert fio.remove_stale(tmp_path) == [] and folder.exists()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_inside_folder_compares_devices_and_inodes_of_every_folder_above(tmp_path):
    """The walk up from a path that need not exist, by device and inode: a path through a symlink (as a bind
    mount would show it) is inside; a sibling, the folder itself, a file or a missing folder are not."""
    src = tmp_path / "src"
    src.mkdir()
    (tmp_path / "other").mkdir()
    (tmp_path / "via").symlink_to(src)
    (tmp_path / "file").write_text("x")
    assert fio.inside_folder(src / "a" / "b" / "out", src)
    assert fio.inside_folder(tmp_path / "via" / "out", src)
    assert not fio.inside_folder(tmp_path / "other" / "out", src)
    assert not fio.inside_folder(src, src)
    assert not fio.inside_folder(tmp_path / "file" / "x", tmp_path / "file")
    assert not fio.inside_folder(src / "out", tmp_path / "missing")


def test_read_regular_file_reads_exactly_its_size_and_says_when_it_does_not(tmp_path, monkeypatch):
    data = bytes(range(256)) * 10000 + b"tail"  # more than two reads of 1 MiB
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    assert fio.read_regular_file(path, len(data)) == data
    real = os.read
    monkeypatch.setattr(os, "read", lambda fd, n: real(fd, max(1, n // 2)))
    assert fio.read_regular_file(path, len(data)) == data  # short reads resume where they stopped
    monkeypatch.setattr(os, "read", lambda fd, n: b"")
    with pytest.raises(UsageError) as raised:
        fio.read_regular_file(path, len(data))
    assert str(raised.value) == f"{path}: ends after 0 of its {len(data)} bytes (it changed while read)"
    monkeypatch.setattr(os, "read", lambda fd, n: b"x" * n)
    with pytest.raises(UsageError) as raised:
        fio.read_regular_file(path, len(data))
    assert str(raised.value) == (f"{path}: holds more than the {len(data)} bytes its size says (it changed while "
                                 "read, or its content is made up as it is read)")
