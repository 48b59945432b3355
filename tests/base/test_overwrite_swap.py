"""``--overwrite`` replaces only what fp4pass wrote and never loses a folder: the marker's file list, the inputs
rule, the two-rename swap with a fault in each step (raised, and a process killed outright) and its recovery.

The oracle of every test is the folder's own bytes, read by the test (``_tree``), never fp4pass's word."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from fp4pass import io as fio
from fp4pass.errors import UsageError
from fp4pass.io import swap as fswap


def _tree(folder: Path) -> dict:
    return {p.relative_to(folder).as_posix(): (p.read_bytes() if p.is_file() else "dir")
            for p in sorted(folder.rglob("*"))}


def _write(out: Path, files: dict, overwrite: bool = False, inputs=()) -> None:
    with fio.atomic_folder(out, inputs=inputs, overwrite=overwrite) as tmp:
        for rel, data in files.items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp / rel).write_bytes(data)


def _temporaries(folder: Path) -> list[str]:
    return [p.name for p in folder.iterdir() if p.name.startswith(fio.TMP_PREFIX)]


OLD = {"model.safetensors": b"old weights " * 7, "sub/config.json": b'{"old": 1}'}
NEW = {"model.safetensors": b"new", "tokenizer.json": b"{}"}


@pytest.fixture
def old(tmp_path) -> Path:
    out = tmp_path / "out"
    _write(out, OLD)
    return out


def test_the_marker_lists_every_file_written_with_its_size(old):
    marker = json.loads((old / fio.OUTPUT_MARKER).read_text())
    assert marker["written_by"] == "fp4pass"
    assert marker["files"] == {rel: len(data) for rel, data in OLD.items()}


@pytest.mark.parametrize("plant", ["a-file", "changed-size", "empty-folder", "symlink", "nested-file"])
def test_overwrite_refuses_a_folder_holding_a_file_of_the_user_and_names_the_first(old, plant):
    if plant == "a-file":  # two of the user's: the first in name order is named
        (old / "zz-mine.txt").write_text("mine")
        (old / "a-mine.txt").write_text("mine too")
        first = "a-mine.txt"
    elif plant == "changed-size":
        (old / "model.safetensors").write_bytes(b"the user's own weights, another size")
        first = "model.safetensors"
    elif plant == "empty-folder":
        (old / "notes").mkdir()
        first = "notes/"
    elif plant == "symlink":
        (old / "link.json").symlink_to(old / "sub" / "config.json")
        first = "link.json"
    else:
        (old / "sub" / "mine.json").write_text("{}")
        first = "sub/mine.json"
    before = _tree(old)
    with pytest.raises(UsageError, match=f"holds {first} "):
        _write(old, NEW, overwrite=True)
    assert _tree(old) == before and _temporaries(old.parent) == []


def test_a_copied_marker_does_not_make_the_users_folder_replaceable(old, tmp_path):
    """``cp -a out/. mine/``: the marker came along, but it lists fp4pass's files, not the user's."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    (mine / fio.OUTPUT_MARKER).write_bytes((old / fio.OUTPUT_MARKER).read_bytes())
    with pytest.raises(UsageError, match="holds thesis.tex "):
        _write(mine, NEW, overwrite=True)
    assert (mine / "thesis.tex").read_text() == "years of work"


def test_a_marker_without_a_file_list_is_refused(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / fio.OUTPUT_MARKER).write_text('{"written_by": "fp4pass"}')
    (out / "model.safetensors").write_bytes(b"x")
    with pytest.raises(UsageError, match="lists no files"):
        _write(out, NEW, overwrite=True)
    assert (out / "model.safetensors").read_bytes() == b"x"


@pytest.mark.parametrize("kind", ["huge", "deep"])
def test_the_marker_is_read_with_a_size_and_a_depth_bound(old, monkeypatch, kind):
    """A marker past the bound is no marker: refused as a folder fp4pass did not write, not read whole."""
    marker = json.loads((old / fio.OUTPUT_MARKER).read_text())
    if kind == "huge":
        monkeypatch.setattr(fio.folders, "OUTPUT_MARKER_MAX", 64)
        text = json.dumps(marker) + " " * 64
    else:
        text = json.dumps({**marker, "deep": [[[[[1]]]]]})
    (old / fio.OUTPUT_MARKER).write_text(text)
    assert fio.written_by_fp4pass(old) is False
    with pytest.raises(UsageError, match="was not written by fp4pass"):
        _write(old, NEW, overwrite=True)
    assert json.dumps(json.loads(text)) and (old / "model.safetensors").read_bytes() == OLD["model.safetensors"]


def test_the_marker_at_its_bound_is_read(old, monkeypatch):
    size = (old / fio.OUTPUT_MARKER).stat().st_size
    monkeypatch.setattr(fio.folders, "OUTPUT_MARKER_MAX", size)
    assert fio.written_by_fp4pass(old) is True


def test_an_input_inside_the_folder_or_the_folder_inside_an_input_is_refused(old, tmp_path):
    """``--scales OUT/s.json``: even a file fp4pass listed there is an input of this run, and stays."""
    _write(old, {**OLD, "s.json": b'{"scales": 1}'}, overwrite=True)
    before = _tree(old)
    with pytest.raises(UsageError, match=r"holds the input .*s\.json \(--scales\)"):
        _write(old, NEW, overwrite=True, inputs={"--scales": old / "s.json"})
    with pytest.raises(UsageError, match="holds the input folder"):
        _write(old, NEW, overwrite=True, inputs={"--calib": old / "sub"})
    assert _tree(old) == before
    with pytest.raises(UsageError, match="is, is inside, or holds the input folder"):
        _write(old / "sub" / "new", NEW, inputs=(old,))
    assert fio.check_output_folder(old, overwrite=True, inputs={"--scales": tmp_path / "elsewhere.json"}) is True


def test_a_folder_whose_input_files_are_links_into_a_blobs_folder_is_kept(tmp_path):
    """A Hub snapshot's files are links into ``blobs/``: replacing ``blobs/`` replaces the input."""
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / ("a" * 40)
    snap.mkdir(parents=True)
    _write(blobs, {"0123": b"weights"})
    (snap / "model.safetensors").symlink_to(blobs / "0123")
    with pytest.raises(UsageError, match="where its files are stored"):
        _write(blobs, NEW, overwrite=True, inputs={"CKPT_DIR": snap})
    assert (blobs / "0123").read_bytes() == b"weights"


def test_the_last_check_before_the_swap_reads_the_old_folder(old):
    """A file of the user's put into the old folder while the new one was being written stops the swap."""
    with pytest.raises(UsageError, match="holds late.txt "):
        with fio.atomic_folder(old, overwrite=True) as tmp:
            (tmp / "model.safetensors").write_bytes(b"new")
            (old / "late.txt").write_text("written meanwhile")
    assert (old / "late.txt").read_text() == "written meanwhile"
    assert (old / "model.safetensors").read_bytes() == OLD["model.safetensors"] and _temporaries(old.parent) == []


def test_a_replaced_folder_stays_when_the_session_rolls_back(old):
    """The old folder is gone once the new one is in: a later failure of the run must not remove the new."""
    with fio.output_session() as session:
        _write(old, NEW, overwrite=True)
        session.rollback(2)
    assert (old / "tokenizer.json").read_bytes() == b"{}" and (old / "model.safetensors").read_bytes() == b"new"


def test_the_python_api_never_overwrites_unless_asked(old):
    with pytest.raises(UsageError, match="exists and is not empty"):
        with fio.atomic_folder(old) as tmp:  # the default, not given
            (tmp / "model.safetensors").write_bytes(b"new")
    assert (old / "model.safetensors").read_bytes() == OLD["model.safetensors"]


class Planted(Exception):
    pass


def _fail_at(monkeypatch, step: str, action):
    """Make swap ``step`` run ``action`` instead of (write_state, rename) or after (replace, fsync) itself."""
    real_rename, real_replace, real_fsync = os.rename, os.replace, fswap._fsync
    if step == "state":
        monkeypatch.setattr(fswap, "write_state", lambda *a: action())
    elif step == "aside":
        monkeypatch.setattr(fswap.os, "rename", lambda a, b: action() if Path(b).name == fswap.ASIDE
                            else real_rename(a, b))
    elif step == "in":
        monkeypatch.setattr(fswap.os, "replace", lambda a, b: (real_replace(a, b), action()))
    elif step == "between":  # the old folder is aside, the new one not yet in
        monkeypatch.setattr(fswap.os, "rename", lambda a, b: (real_rename(a, b), Path(b).name == fswap.ASIDE
                                                              and action()))
    else:  # the fsync of the folder after the swap
        monkeypatch.setattr(fswap, "_fsync", lambda p: action() if p == STATE["parent"] else real_fsync(p))


STATE: dict = {}


@pytest.mark.parametrize("step", ["state", "aside", "between", "in", "fsync"])
@pytest.mark.parametrize("fault", [OSError, KeyboardInterrupt])
def test_a_fault_in_each_step_of_the_swap_leaves_the_old_folder_whole(old, monkeypatch, step, fault):
    STATE["parent"] = old.parent
    before = _tree(old)

    def action():
        raise fault(5, "planted") if fault is OSError else fault()

    _fail_at(monkeypatch, step, action)
    with pytest.raises(fault):
        _write(old, NEW, overwrite=True)
    monkeypatch.undo()
    assert _tree(old) == before and _temporaries(old.parent) == []


@pytest.mark.parametrize("step,survivor", [("state", OLD), ("between", OLD), ("in", NEW)])
def test_a_run_killed_in_the_swap_leaves_old_or_new_and_clean_finishes_it(old, monkeypatch, capsys, step,
                                                                          survivor):
    """SIGKILL at a step (the child exits on the spot, no handler runs): ``fp4pass clean`` then puts the
    old folder back or keeps the new one; nothing of either is lost, no temporary stays."""
    from fp4pass.cli import main

    STATE["parent"] = old.parent
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        try:
            _fail_at(monkeypatch, step, lambda: os._exit(9))
            _write(old, NEW, overwrite=True)
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 9
    assert main(["clean", str(old.parent)]) == 0
    err = capsys.readouterr().err
    assert ("put back" in err) == (step == "between")
    assert {k: v for k, v in _tree(old).items() if k != fio.OUTPUT_MARKER and v != "dir"} == survivor
    assert _temporaries(old.parent) == []


def test_a_killed_swap_whose_place_was_taken_keeps_the_old_folder_in_its_temporary(old, monkeypatch):
    """The old folder is aside, and something else now stands at its name: the temporary stays, old inside."""
    STATE["parent"] = old.parent
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        try:
            _fail_at(monkeypatch, "between", lambda: os._exit(9))
            _write(old, NEW, overwrite=True)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    old.mkdir()
    (old / "new-file").write_text("someone's")
    assert fio.remove_stale(old.parent) == []
    [kept] = _temporaries(old.parent)
    assert (old.parent / kept / fswap.ASIDE / "model.safetensors").read_bytes() == OLD["model.safetensors"]


def test_a_swap_state_that_fp4pass_did_not_write_is_ignored(tmp_path):
    staging = tmp_path / "s"
    staging.mkdir()
    for text in ('{"target": "../x", "new": [1, 2]}', '{"target": "x", "new": [1]}', "[" * 100, "nope"):
        (staging / fswap.SWAP_STATE).write_text(text)
        assert fswap.read_state(staging) is None
    (staging / fswap.SWAP_STATE).write_text('{"target": "x", "new": [1, 2]}')
    assert fswap.read_state(staging) == {"target": "x", "new": (1, 2)}


KIMI = Path(__file__).resolve().parents[2] / "models" / "checkpoints" / "deepseek_v3"


def test_convert_overwrite_with_scales_inside_out_is_refused_and_keeps_them(tmp_path, capsys):
    from cli_helpers import cli, one_line

    out = tmp_path / "out"
    assert cli(capsys, "convert", KIMI, "-o", out, "--quiet")[0] == 0
    (out / "s.json").write_text('{"calibrator": "max", "tensors": {}}')
    before = _tree(out)
    code, err = cli(capsys, "convert", KIMI, "-o", out, "--overwrite", "--scales", out / "s.json")
    assert code == 2 and "(--scales)" in one_line(err) and "holds the input" in one_line(err)
    assert _tree(out) == before


def test_the_checkpoint_api_refuses_an_existing_output_unless_asked(tmp_path):
    from fp4pass.checkpoint import convert

    out = tmp_path / "out"
    convert(KIMI, out)
    before = _tree(out)
    with pytest.raises(UsageError, match="exists and is not empty"):
        convert(KIMI, out, format="compressed-tensors")
    assert _tree(out) == before
    convert(KIMI, out, format="compressed-tensors", overwrite=True)
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "compressed-tensors"


def test_a_temporarys_marker_nested_deep_is_no_marker_and_no_crash(tmp_path):
    """4 KB of ``[``: Python's json would raise RecursionError (exit 3 from fp4pass clean); it is not fp4pass's."""
    temp = tmp_path / f"{fio.TMP_PREFIX}{2 ** 22 + 7}-h{fio.host_token()}-abcd-x.d"
    temp.mkdir()
    (temp / fio.MARKER).write_text("[" * 4000)
    assert fio.remove_stale(tmp_path) == [] and temp.exists()


def test_a_link_out_of_an_input_folder_protects_its_file_not_the_folder_around_it(tmp_path):
    """An ONNX calibration folder may hold a link to ``../common.npz``: writing that file is refused, writing
    beside it is not (only a Hub snapshot's blobs/ folder is protected whole)."""
    data = tmp_path / "calib"
    data.mkdir()
    common = tmp_path / "common.npz"
    common.write_bytes(b"npz")
    (data / "a.npz").symlink_to(common)
    with pytest.raises(UsageError, match="where the files of the input"):
        fio.check_outputs({"-o": str(common)}, {"--calib": str(data)})
    fio.check_outputs({"-o": str(tmp_path / "SCALES.json")}, {"--calib": str(data)})
    with pytest.raises(UsageError, match="holds the input folder"):
        fio.check_output_folder(tmp_path, inputs={"--calib": data})


@pytest.mark.parametrize("name", ["/".join(["d"] * 40), "../escape", "a//b", "/abs", "x" * 5000])
def test_a_marker_listing_a_name_fp4pass_never_writes_is_refused(old, name):
    """A listed name 40 folders deep (a hostile one of millions would make the walk's prefixes quadratic),
    outside the folder, or absurdly long: the marker is not fp4pass's, nothing is walked or removed."""
    marker = json.loads((old / fio.OUTPUT_MARKER).read_text())
    marker["files"][name] = 1
    (old / fio.OUTPUT_MARKER).write_text(json.dumps(marker))
    before = _tree(old)
    with pytest.raises(UsageError, match="lists no files"):
        _write(old, NEW, overwrite=True)
    assert _tree(old) == before


def test_a_listed_file_in_nested_folders_is_fp4pass_s():
    """Names fp4pass could write pass the marker's rule: sub-folders up to 32 deep, plain parts."""
    assert fio.folders._plain_relative("/".join(["d"] * 32) + "/f")
    assert fio.folders._plain_relative("sub/config.json") and fio.folders._plain_relative(".hidden")
