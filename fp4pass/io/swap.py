"""Replacing an output folder with two renames whose state is on disk: an interrupted run leaves the old folder
or the new one whole, never neither (``convert --overwrite``: rule 8 of :mod:`fp4pass.io`).

The new folder is complete, fsynced and lies in its temporary folder (``STAGING/NAME``, beside ``TARGET``):

1. :data:`SWAP_STATE` is written into ``STAGING`` (fsynced): the target's name and the new folder's inode;
2. ``TARGET`` is renamed to ``STAGING/`` :data:`ASIDE` (the old folder, whole, in the temporary);
3. ``STAGING/NAME`` is renamed to ``TARGET``; the folder is fsynced;
4. the caller removes ``STAGING``, and the old folder with it.

A failure or a signal (an exception) at any step is undone at once (:func:`undo`): the new folder goes, the
old one comes back. A run killed outright (SIGKILL, power) leaves ``STAGING`` with its state; the next run in
that folder, or ``fp4pass clean``, calls :func:`recover` before it removes a stale temporary: the old folder
is renamed back when nothing stands at ``TARGET``, and the temporary is kept (never removed) when what stands
there is neither the old nor the new folder.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
from pathlib import Path

from fp4pass.io.names import TMP_PREFIX

#: the state of a swap, inside the temporary folder beside its marker
SWAP_STATE = ".fp4pass-swap"
#: the old folder's name inside the temporary folder (no output folder is named so: TMP_PREFIX is refused)
ASIDE = TMP_PREFIX + "replaced"
_STATE_MAX = 4096


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISDIR(st.st_mode) else None


def _fsync(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_state(staging: Path, target: Path, new: tuple[int, int]) -> None:
    """Step 1: the target's name and the new folder's device and inode, durable before any rename."""
    fd = os.open(staging / SWAP_STATE, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, json.dumps({"target": target.name, "new": list(new)}).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    _fsync(staging)


def read_state(staging: Path) -> dict | None:
    """The swap state of ``staging`` (:func:`write_state`), or None when it holds none or one fp4pass did not
    write (not a small regular file, not its JSON, a target name that is not a plain name)."""
    from fp4pass.io.jsonio import read_small_json

    data = read_small_json(staging / SWAP_STATE, _STATE_MAX, 2)
    if not isinstance(data, dict) or not isinstance(data.get("target"), str):
        return None
    name, new = data["target"], data.get("new")
    if name in ("", ".", "..") or "/" in name or "\0" in name or name.startswith(TMP_PREFIX):
        return None
    if not (isinstance(new, list) and len(new) == 2 and all(type(v) is int for v in new)):
        return None
    return {"target": name, "new": (new[0], new[1])}


def swap(staging: Path, new: Path, target: Path) -> None:
    """Steps 1 to 3 (module docstring); any exception is undone (:func:`undo`) and raised again."""
    identity = _identity(new)
    if identity is None:
        raise FileNotFoundError(2, "the new folder is gone", str(new))
    write_state(staging, target, identity)
    try:
        os.rename(target, staging / ASIDE)
        os.replace(new, target)
        _fsync(target.parent)
    except BaseException:
        undo(staging, target, identity)
        raise


def undo(staging: Path, target: Path, new: tuple[int, int]) -> bool:
    """Put the old folder back at ``target``: the new folder (inode ``new``) taken out first where it stands
    there. Decided by what is on disk, not by which step ran (a signal may land between a rename and the
    next line). Returns whether ``target`` holds the old folder, or never lost it."""
    aside = staging / ASIDE
    if _identity(aside) is None:
        return True  # step 2 never happened: the old folder is where it was
    if _identity(target) == new:
        shutil.rmtree(target, ignore_errors=True)
    if os.path.lexists(target):
        return False  # something else stands there: leave the old folder in the temporary
    os.rename(aside, target)
    _fsync(target.parent)
    return True


def recover(staging: Path) -> tuple[bool, Path | None]:
    """What a killed swap left in ``staging`` (a stale temporary): (whether ``staging`` may be removed now, the
    folder restored or None). The old folder comes back when nothing stands at the target; when the new
    folder stands there it is complete (step 3 happened) and the old one goes with ``staging``; anything else
    at the target keeps ``staging`` (and the old folder in it) for the user to look at."""
    state = read_state(staging)
    aside = staging / ASIDE
    if state is None or _identity(aside) is None:
        return True, None
    target = staging.parent / state["target"]
    if not os.path.lexists(target):
        try:
            os.rename(aside, target)
        except OSError:
            return False, None
        _fsync(staging.parent)
        return True, target
    return _identity(target) == state["new"], None
