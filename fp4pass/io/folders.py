"""Whole output folders (rule 8 of :mod:`fp4pass.io`): written beside the target, marked, renamed into place;
``--overwrite`` replaces only what fp4pass wrote."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
from pathlib import Path
from typing import Iterator

from fp4pass.errors import UsageError
from fp4pass.io import outputs
from fp4pass.io.outputs import RESULT, _inside, _umask, _fsync_path, fsync_folder, same_file
from fp4pass.io.stale import TMP_PREFIX, make_temp_folder, remove_stale

#: the file that marks a folder fp4pass wrote (:func:`atomic_folder`): only such a folder is replaced (overwrite)
OUTPUT_MARKER = ".fp4pass-output.json"


def _fsync_tree(folder: Path) -> None:
    """Give every file the umask's mode and fsync it, then every folder (the deepest first, the top last)."""
    mode = 0o666 & ~_umask()
    for root, dirs, files in os.walk(folder):
        for name in files:
            os.chmod(Path(root) / name, mode)
            _fsync_path(Path(root) / name)
        for name in dirs:
            fsync_folder(Path(root) / name)
    fsync_folder(folder)


def written_by_fp4pass(folder: str | os.PathLike) -> bool:
    """Whether ``folder`` holds :data:`OUTPUT_MARKER` as a regular file whose JSON names fp4pass as its writer."""
    marker = Path(folder) / OUTPUT_MARKER
    try:
        if not stat.S_ISREG(os.lstat(marker).st_mode):
            return False
        return json.loads(marker.read_text(encoding="utf-8")).get("written_by") == "fp4pass"
    except (OSError, ValueError, AttributeError):
        return False


def _write_output_marker(folder: Path) -> None:
    (folder / OUTPUT_MARKER).write_text(json.dumps({
        "written_by": "fp4pass",
        "note": "an output folder of fp4pass; fp4pass convert --overwrite replaces only folders holding this file",
    }, indent=2) + "\n")


def _replaceable(target: Path, path, overwrite: bool) -> bool:
    """Whether ``target`` is an existing, non-empty folder that may be replaced; raises UsageError when it may not."""
    if not (target.is_dir() and any(os.scandir(target))):
        return False
    if not overwrite:
        raise UsageError(f"{path}: exists and is not empty; give a new or an empty folder (--overwrite replaces a "
                         "folder fp4pass wrote)")
    if not written_by_fp4pass(target):
        raise UsageError(f"{path}: exists and was not written by fp4pass (it holds no {OUTPUT_MARKER}); "
                         "--overwrite replaces only fp4pass's own output folders: give another folder, or remove it")
    return True


def check_output_folder(path: str | os.PathLike, overwrite: bool = False) -> bool:
    """Refuse (UsageError) an output folder :func:`atomic_folder` would refuse, before any work; returns whether
    an existing folder is to be replaced (``overwrite`` and it holds :data:`OUTPUT_MARKER`)."""
    target = Path(path)
    if str(path) == "" or target.name in ("", ".", ".."):
        raise UsageError(f"{path!r}: not a folder name")
    if target.name.startswith(TMP_PREFIX):
        raise UsageError(f"{path}: names starting with {TMP_PREFIX} are fp4pass's temporary files")
    if not target.parent.is_dir():
        raise UsageError(f"{path}: folder {target.parent} does not exist")
    if target.is_symlink() or (target.exists() and not target.is_dir()):
        raise UsageError(f"{path}: exists and is not a folder")
    return _replaceable(target, path, overwrite)


@contextlib.contextmanager
def atomic_folder(path: str | os.PathLike, inputs: tuple = (), overwrite: bool = False) -> Iterator[Path]:
    """Yield a fresh temporary folder beside ``path``; on success mark it (:data:`OUTPUT_MARKER`), fsync it whole
    and rename it onto ``path``.

    ``path`` must not exist, or be an empty folder (replaced by the rename); with ``overwrite``, it may also be
    a folder fp4pass wrote (it holds the marker), replaced once the new one is complete (module docstring,
    rule 8). The yielded folder lies inside a temporary folder (:func:`make_temp_folder`, with its marker), so
    :func:`remove_stale` and ``fp4pass clean`` know it. On any exception the temporary folder is removed and
    ``path`` stays as it was.
    ``inputs``: folders ``path`` must be neither inside nor hold (by path, and by device and inode: a bind
    mount); the sweep of stale temporaries never removes them.

    The rename is the block's last step: whatever must be in place with the folder (a report beside it) is
    written inside the block. The rename is recorded in the :class:`OutputSession` before it is made, so a
    failure or a signal after it (in this function or in the caller) takes ``path`` back out; an empty
    folder that stood at ``path`` is made again then.
    """
    target = Path(path)
    replacing = check_output_folder(path, overwrite)
    parent = target.parent
    was_empty_folder = target.is_dir() and not replacing
    for given in inputs:
        if same_file(target, given) or _inside(target, given) or _inside(given, target):
            raise UsageError(f"{path}: is, is inside, or holds the input folder {given}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"{path}: folder {parent} is not writable")
    remove_stale(parent, keep=inputs)
    staging = make_temp_folder(target)
    tmp = staging / target.name
    try:
        os.mkdir(tmp, stat.S_IRWXU)  # private while it is written
        yield tmp
        _write_output_marker(tmp)
        os.chmod(tmp, 0o777 & ~_umask())
        _fsync_tree(tmp)
        st = os.lstat(tmp)
        identity = (st.st_dev, st.st_ino)
        if outputs._session is not None:
            outputs._session.record(target, RESULT, identity)
            if was_empty_folder:
                outputs._session.emptied.add(target)
        aside = staging / f"{target.name}.replaced"  # never the name of the new folder beside it
        # the old folder aside, checked again: it may have changed while the new one was written
        replacing = replacing and _replaceable(target, path, overwrite)
        if replacing:
            os.rename(target, aside)
        try:
            os.replace(tmp, target)
            fsync_folder(parent)
        except BaseException:
            _remove_folder_if(target, identity, was_empty_folder)
            if replacing:
                with contextlib.suppress(OSError):
                    os.rename(aside, target)
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _remove_folder_if(target: Path, identity: tuple[int, int], make_empty: bool) -> None:
    """Remove the folder at ``target`` if it is the inode ``identity`` (ours); then an empty folder again
    where one stood before."""
    try:
        st = os.lstat(target)
    except OSError:
        return
    if (st.st_dev, st.st_ino) == identity and stat.S_ISDIR(st.st_mode):
        shutil.rmtree(target, ignore_errors=True)
        if make_empty:
            with contextlib.suppress(OSError):
                os.mkdir(target)
