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
from fp4pass.io.outputs import RESULT, inside, current_umask, fsync_path, fsync_folder, same_file
from fp4pass.io.stale import TMP_PREFIX, make_temp_folder, remove_stale
from fp4pass.io.swap import recover, swap

#: the file that marks a folder fp4pass wrote (:func:`atomic_folder`): only such a folder is replaced (overwrite)
OUTPUT_MARKER = ".fp4pass-output.json"


def _fsync_tree(folder: Path) -> None:
    """Give every file the umask's mode and fsync it, then every folder (the deepest first, the top last)."""
    mode = 0o666 & ~current_umask()
    for root, dirs, files in os.walk(folder):
        for name in files:
            os.chmod(Path(root) / name, mode)
            fsync_path(Path(root) / name)
        for name in dirs:
            fsync_folder(Path(root) / name)
    fsync_folder(folder)


#: the largest output marker read (a file list of 100,000 shards is about 10 MB)
OUTPUT_MARKER_MAX = 16 << 20
#: how deep an output marker nests: {"files": {name: size}}
_OUTPUT_MARKER_DEPTH = 4


def _read_output_marker(folder: Path) -> dict | None:
    """The JSON object of ``folder``'s :data:`OUTPUT_MARKER` when it is a regular file (not a link) of at most
    :data:`OUTPUT_MARKER_MAX` bytes, nested at most 4 deep, naming fp4pass as its writer; else None."""
    from fp4pass.io.jsonio import read_small_json

    data = read_small_json(folder / OUTPUT_MARKER, OUTPUT_MARKER_MAX, _OUTPUT_MARKER_DEPTH)
    if not isinstance(data, dict) or data.get("written_by") != "fp4pass":
        return None
    return data


def written_by_fp4pass(folder: str | os.PathLike) -> bool:
    """Whether ``folder`` holds :data:`OUTPUT_MARKER` as a regular file whose JSON names fp4pass as its writer."""
    return _read_output_marker(Path(folder)) is not None


def _written_files(folder: Path) -> dict[str, int]:
    """Every file under ``folder`` (but the marker) by its path relative to it, with its size."""
    found = {}
    for root, dirs, files in os.walk(folder):
        dirs.sort()
        for name in sorted(files):
            path = Path(root) / name
            rel = path.relative_to(folder).as_posix()
            if rel != OUTPUT_MARKER:
                found[rel] = os.lstat(path).st_size
    return found


def _write_output_marker(folder: Path) -> None:
    """The marker, listing every file fp4pass wrote into ``folder`` with its size: what ``--overwrite`` may
    remove; anything else found there later is the user's."""
    (folder / OUTPUT_MARKER).write_text(json.dumps({
        "written_by": "fp4pass",
        "note": "an output folder of fp4pass; fp4pass convert --overwrite replaces it only while it holds nothing "
                "but the files listed here, at these sizes",
        "files": _written_files(folder),
    }, indent=2) + "\n")


def _listed_files(target: Path, path) -> dict[str, int]:
    """The files ``target``'s marker lists; UsageError when it has no marker of fp4pass, or one without a list."""
    marker = _read_output_marker(target)
    if marker is None:
        raise UsageError(f"{path}: exists and was not written by fp4pass (it holds no {OUTPUT_MARKER}); "
                         "--overwrite replaces only fp4pass's own output folders: give another folder, or remove it")
    files = marker.get("files")
    if not (isinstance(files, dict) and all(type(v) is int and v >= 0 and _plain_relative(k)
                                            for k, v in files.items())):
        raise UsageError(f"{path}: its {OUTPUT_MARKER} lists no files (an older fp4pass wrote it, or it was copied "
                         "there), so fp4pass cannot tell its files from yours; --overwrite refuses it: give another "
                         "folder, or remove this one yourself")
    return files


#: the most folders deep a listed file may lie (fp4pass writes at the top, a sub-folder or two at most)
MAX_LISTED_DEPTH = 32


def _plain_relative(name) -> bool:
    """Whether ``name`` is a relative path fp4pass could have written: a string of at most 4096 characters,
    at most :data:`MAX_LISTED_DEPTH` folders deep, without empty, ``.`` or ``..`` parts (a hostile marker's
    names are never walked: the walk and its prefixes stay bounded)."""
    if not isinstance(name, str) or not 0 < len(name) <= 4096 or name.count("/") > MAX_LISTED_DEPTH:
        return False
    return all(part not in ("", ".", "..") for part in name.split("/"))


def first_foreign_file(target: Path, listed: dict[str, int]) -> str | None:
    """The first entry under ``target`` (in name order) that fp4pass did not write: not in ``listed``, of
    another size, not a regular file (a link, a FIFO), or a folder that holds no listed file; None when there
    is none. The walk stops at the first one, so it reads at most as many entries as the marker lists."""
    prefixes = {rel.rsplit("/", i)[0] for rel in listed for i in range(1, rel.count("/") + 1)}

    def walk(folder: Path, base: str) -> str | None:
        with os.scandir(folder) as it:
            entries = sorted(it, key=lambda e: e.name)
        for entry in entries:
            rel = f"{base}{entry.name}"
            if rel == OUTPUT_MARKER:
                continue
            st = entry.stat(follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                if rel not in prefixes:
                    return rel + "/"
                found = walk(Path(entry.path), rel + "/")
                if found is not None:
                    return found
            elif not stat.S_ISREG(st.st_mode) or listed.get(rel) != st.st_size:
                return rel
        return None

    return walk(target, "")


def _replaceable(target: Path, path, overwrite: bool) -> bool:
    """Whether ``target`` is an existing, non-empty folder that may be replaced; raises UsageError when it may
    not: no ``overwrite``, no marker of fp4pass, or a file in it that fp4pass did not write (named)."""
    if not (target.is_dir() and any(os.scandir(target))):
        return False
    if not overwrite:
        raise UsageError(f"{path}: exists and is not empty; give a new or an empty folder (--overwrite replaces a "
                         "folder fp4pass wrote)")
    listed = _listed_files(target, path)
    foreign = first_foreign_file(target, listed)
    if foreign is not None:
        why = "changed since fp4pass wrote it" if foreign in listed else "not among the files fp4pass wrote there"
        raise UsageError(f"{path}: holds {foreign} ({why}); --overwrite removes only fp4pass's own files, never "
                         "yours: move it out, or give another folder")
    return True


def refuse_inputs(target: Path, path, inputs) -> None:
    """UsageError when the folder ``target`` is an input, lies inside one, or holds one (``inputs``: a dict of
    label -> path, or paths), by path, link or inode, and where an input folder's links lead (a Hub cache's
    ``blobs/``: :func:`fp4pass.io.outputs.input_places`)."""
    from fp4pass.io.outputs import input_places

    labelled = inputs.items() if isinstance(inputs, dict) else ((None, given) for given in inputs)
    for label, given in labelled:
        if given is None:
            continue
        what = f" ({label})" if label else ""
        for place in input_places(given):
            if same_file(target, place) or inside(target, place) or inside(place, target):
                where = "" if place == os.fspath(given) else f" (at {place}, where its files are stored)"
                kind = "input folder" if os.path.isdir(given) else "input"
                raise UsageError(f"{path}: is, is inside, or holds the {kind} {given}{what}{where}; an output "
                                 "folder must hold no input of the run")


def check_output_folder(path: str | os.PathLike, overwrite: bool = False, inputs=None) -> bool:
    """Refuse (UsageError) an output folder :func:`atomic_folder` would refuse, before any work; returns whether
    an existing folder is to be replaced (``overwrite``, it holds :data:`OUTPUT_MARKER` and only the files that
    lists). ``inputs``: label -> path of every input of the run (:func:`refuse_inputs`)."""
    target = Path(path)
    if str(path) == "" or target.name in ("", ".", ".."):
        raise UsageError(f"{path!r}: not a folder name")
    if target.name.startswith(TMP_PREFIX):
        raise UsageError(f"{path}: names starting with {TMP_PREFIX} are fp4pass's temporary files")
    if not target.parent.is_dir():
        raise UsageError(f"{path}: folder {target.parent} does not exist")
    if target.is_symlink() or (target.exists() and not target.is_dir()):
        raise UsageError(f"{path}: exists and is not a folder")
    if inputs:
        refuse_inputs(target, path, inputs)
    return _replaceable(target, path, overwrite)


@contextlib.contextmanager
def atomic_folder(path: str | os.PathLike, inputs: tuple = (), overwrite: bool = False) -> Iterator[Path]:
    """Yield a fresh temporary folder beside ``path``; on success mark it (:data:`OUTPUT_MARKER`, listing its
    files), fsync it whole and rename it onto ``path``.

    ``path`` must not exist, or be an empty folder (replaced by the rename); with ``overwrite``, it may also be
    a folder fp4pass wrote that holds nothing else (checked first and again right before the swap), replaced
    once the new one is complete by :func:`fp4pass.io.swap.swap` (module docstring, rule 8). The yielded
    folder lies inside a temporary folder (:func:`make_temp_folder`, with its marker), so :func:`remove_stale`
    and ``fp4pass clean`` know it. On any exception the temporary folder is removed and ``path`` stays as it
    was. ``inputs``: paths (or label -> path) ``path`` must be neither nor inside nor hold
    (:func:`refuse_inputs`); the sweep of stale temporaries never removes them.

    The rename is the block's last step: whatever must be in place with the folder (a report beside it) is
    written inside the block. A new folder (nothing replaced) is recorded in the :class:`OutputSession` before
    its rename, so a failure or a signal after it takes ``path`` back out (an empty folder that stood there is
    made again). A folder that replaced another is never taken back out: the old one is gone by then, and the
    new one is complete.
    """
    target = Path(path)
    replacing = check_output_folder(path, overwrite, inputs)
    parent = target.parent
    was_empty_folder = target.is_dir() and not replacing
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"{path}: folder {parent} is not writable")
    keep = tuple(inputs.values()) if isinstance(inputs, dict) else tuple(inputs)
    remove_stale(parent, keep=tuple(k for k in keep if k is not None))
    staging = make_temp_folder(target)
    tmp = staging / target.name
    try:
        os.mkdir(tmp, stat.S_IRWXU)  # private while it is written
        yield tmp
        _write_output_marker(tmp)
        os.chmod(tmp, 0o777 & ~current_umask())
        _fsync_tree(tmp)
        st = os.lstat(tmp)
        identity = (st.st_dev, st.st_ino)
        # the old folder checked again (the target's own marker and files): it may have changed meanwhile
        replacing = replacing and _replaceable(target, path, overwrite)
        if replacing:
            swap(staging, tmp, target)
        else:
            session = outputs.current_session()
            if session is not None:
                session.record(target, RESULT, identity)
                if was_empty_folder:
                    session.emptied.add(target)
            try:
                os.replace(tmp, target)
                fsync_folder(parent)
            except BaseException:
                _remove_folder_if(target, identity, was_empty_folder)
                raise
    finally:
        if recover(staging)[0]:  # a swap that could not be undone keeps the old folder there, for the user
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
