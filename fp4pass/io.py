"""Writing outputs safely: checked before any work, never a partial file, never an input overwritten.

The rules every file fp4pass writes follows (``docs/bad-input.md`` states them for users):

1. **Checked first.** :func:`check_outputs` runs before a command does any work. For every output path it
   refuses: a path that is an input (the same path, through ``..`` or a symlink, or a hardlink: the same
   ``st_dev``/``st_ino``); two outputs that are the same file; a folder that does not exist or is not
   writable; a path that is an existing directory; an output inside an input folder (a calibration DIR).
2. **Atomic.** :func:`atomic_output` yields a temporary path in the target's own folder (same filesystem),
   named ``.fp4pass-tmp-<pid>-<random>-<name>``; only a writer that finished is fsynced and renamed onto
   the target, then the folder is fsynced. A crash, an error or a signal leaves the target as it was.
3. **Mode.** A finished output gets ``0o666 & ~umask``, like any file a program creates (the temporary file
   is private while it is written).
4. **Nothing left on failure.** Each rename is recorded in the current :class:`OutputSession`; the CLI
   rolls the session back on a non-zero exit, removing what was renamed in (see :meth:`OutputSession.rollback`
   for what exit 1 keeps).
5. **Stale temporaries.** A killed run (SIGKILL) cannot clean up; its temporaries carry its pid. The next
   :func:`atomic_output` in that folder, or ``fp4pass clean DIR``, removes those whose process is gone
   (:func:`remove_stale`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import secrets
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from fp4pass.errors import UsageError

__all__ = [
    "TMP_PREFIX",
    "atomic_output",
    "check_outputs",
    "fsync_folder",
    "OutputSession",
    "refuse_overwrite",
    "remove_stale",
    "same_file",
    "temp_name",
    "write_json",
]

TMP_PREFIX = ".fp4pass-tmp-"
_TMP_RE = re.compile(r"^\.fp4pass-tmp-(\d+)-")

# kinds of output: a "result" (the model and its data, SCALES.json) or a "report" that explains the result
RESULT, REPORT = "result", "report"


# -- checks before any work -------------------------------------------------------------------------------


def _stat(path: Path) -> os.stat_result | None:
    try:
        return os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        raise UsageError(f"{path}: cannot be read ({exc.strerror})") from None


def same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether two paths name one file: equal once resolved (``..``, symlinks), or one inode (hardlinks)."""
    pa, pb = Path(os.path.realpath(a)), Path(os.path.realpath(b))
    if pa == pb:
        return True
    sa, sb = _stat(pa), _stat(pb)
    return sa is not None and sb is not None and (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def _inside(path: str | os.PathLike, folder: str | os.PathLike) -> bool:
    real, base = os.path.realpath(path), os.path.realpath(folder)
    return real != base and os.path.commonpath([real, base]) == base


def refuse_overwrite(output: str | os.PathLike, *inputs: str | os.PathLike) -> None:
    """Raise :class:`UsageError` if ``output`` is one of ``inputs`` (the same file, by path or inode)."""
    for given in inputs:
        if same_file(output, given):
            raise UsageError(f"{output}: refusing to write over the input {given}")


def check_outputs(outputs: dict[str, str | os.PathLike | None],
                  inputs: dict[str, str | os.PathLike | None] | None = None) -> None:
    """Check every output of a command before it starts (module docstring, rule 1).

    ``outputs`` and ``inputs`` map a label for messages (a flag such as ``--report``, or "the model") to a
    path; ``None`` entries are skipped. Raises :class:`UsageError` naming the path, the flag and the reason.
    """
    inputs = {k: v for k, v in (inputs or {}).items() if v is not None}
    outputs = {k: v for k, v in outputs.items() if v is not None}
    seen: list[tuple[str, str | os.PathLike]] = []
    for label, out in outputs.items():
        path = Path(out)
        if str(out) == "" or path.name in ("", ".", ".."):
            raise UsageError(f"{label} {str(out)!r}: not a file name")
        if path.is_dir():
            raise UsageError(f"{label} {out}: is a directory; give a file name")
        if path.name.startswith(TMP_PREFIX):
            raise UsageError(f"{label} {out}: names starting with {TMP_PREFIX} are fp4pass's temporary files")
        folder = path.parent
        if not folder.is_dir():
            raise UsageError(f"{label} {out}: folder {folder} does not exist")
        if not os.access(folder, os.W_OK | os.X_OK):
            raise UsageError(f"{label} {out}: folder {folder} is not writable")
        if path.exists() and not path.is_file():
            raise UsageError(f"{label} {out}: exists and is not a regular file")
        for in_label, given in inputs.items():
            if same_file(out, given):
                raise UsageError(f"{label} {out}: refusing to write over the input {given} ({in_label})")
            if Path(given).is_dir() and _inside(out, given):
                raise UsageError(f"{label} {out}: is inside the input folder {given} ({in_label})")
        for other_label, other in seen:
            if same_file(out, other):
                raise UsageError(f"{label} {out}: the same file as {other_label} {other}")
        seen.append((label, out))


# -- the outputs of one run -------------------------------------------------------------------------------


@dataclass
class OutputSession:
    """The outputs one command renamed into place, so that a failed command can take them back."""

    written: list[tuple[Path, str]] = field(default_factory=list)

    def record(self, path: Path, kind: str) -> None:
        self.written.append((Path(path), kind))

    def rollback(self, code: int, keep_results: bool = False) -> list[Path]:
        """Remove this run's outputs after exit ``code`` != 0; returns what was removed.

        Exit 1 (a numeric check below its threshold) keeps the reports (``--report``, ``--json``, ``--plot``:
        they say what failed) and removes the results (model, external data, SCALES.json) unless
        ``keep_results`` (``--keep-unchecked``). Every other non-zero exit removes everything, except the
        results when ``keep_results`` is given (a check that could not run).
        """
        removed = []
        for path, kind in reversed(self.written):
            if kind == REPORT and code == 1:
                continue
            if kind == RESULT and keep_results:
                continue
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                removed.append(path)
        self.written.clear()
        return removed


_session: OutputSession | None = None


@contextlib.contextmanager
def output_session() -> Iterator[OutputSession]:
    """Record every :func:`atomic_output` rename made inside the block (the CLI wraps each command in one)."""
    global _session
    previous, _session = _session, OutputSession()
    try:
        yield _session
    finally:
        _session = previous


# -- atomic writes ----------------------------------------------------------------------------------------


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def remove_stale(folder: str | os.PathLike) -> list[Path]:
    """Remove the fp4pass temporaries in ``folder`` whose process no longer runs; returns what was removed."""
    removed = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    for entry in entries:
        match = _TMP_RE.match(entry.name)
        if not match or _pid_alive(int(match.group(1))):
            continue
        path = Path(entry.path)
        try:
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(path)
            else:
                path.unlink()
            removed.append(path)
        except OSError:
            pass  # another run removed it first, or we may not: leave it
    return removed


def temp_name(target: str | os.PathLike, suffix: str = "") -> Path:
    """A fresh temporary path beside ``target``: ``.fp4pass-tmp-<pid>-<random>-<name><suffix>``."""
    target = Path(target)
    return target.parent / f"{TMP_PREFIX}{os.getpid()}-{secrets.token_hex(4)}-{target.name}{suffix}"


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_folder(folder: str | os.PathLike) -> None:
    """Make a rename in ``folder`` durable (a no-op where folders cannot be opened)."""
    with contextlib.suppress(OSError):
        _fsync_path(Path(folder))


def finish(tmp: Path, target: Path, kind: str = RESULT) -> None:
    """fsync ``tmp``, give it the umask's mode, rename it onto ``target``, fsync the folder, record it."""
    _fsync_path(tmp)
    os.chmod(tmp, 0o666 & ~_umask())
    os.replace(tmp, target)
    fsync_folder(target.parent)
    if _session is not None:
        _session.record(target, kind)


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike, suffix: str = "", kind: str = RESULT) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; rename it onto ``path`` only if the block finishes.

    ``kind``: "result" or "report" (what :meth:`OutputSession.rollback` keeps after exit 1).
    """
    target = Path(path)
    folder = target.parent
    if not folder.is_dir():
        raise UsageError(f"{path}: folder {folder} does not exist")
    if target.is_dir():
        raise UsageError(f"{path}: is a directory; give a file name")
    remove_stale(folder)
    tmp = temp_name(target, suffix)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise UsageError(f"{path}: cannot write in {folder} ({exc.strerror})") from None
        raise
    os.close(fd)
    try:
        yield tmp
        if tmp.exists():
            finish(tmp, target, kind)
    finally:
        with contextlib.suppress(FileNotFoundError):
            if tmp.is_dir() and not tmp.is_symlink():
                shutil.rmtree(tmp)
            else:
                tmp.unlink()


def write_json(path: str | os.PathLike, data, kind: str = REPORT) -> None:
    """Write ``data`` as indented JSON, atomically (non-finite numbers refused: they are not JSON)."""
    text = json.dumps(data, indent=2, allow_nan=False) + "\n"
    with atomic_output(path, kind=kind) as tmp:
        tmp.write_text(text)


# -- a whole output folder --------------------------------------------------------------------------------


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


@contextlib.contextmanager
def atomic_folder(path: str | os.PathLike, inputs: tuple = ()) -> Iterator[Path]:
    """Yield a fresh temporary folder beside ``path``; on success fsync it whole and rename it onto ``path``.

    ``path`` must not exist, or be an empty folder (replaced by the rename). A temporary folder carries
    :data:`TMP_PREFIX` and the pid, so :func:`remove_stale` and ``fp4pass clean`` know it. On any exception
    the temporary folder is removed and ``path`` stays as it was. ``inputs``: folders ``path`` must be neither
    inside nor hold. The rename is not recorded in the :class:`OutputSession` (a folder is not a file).
    """
    target = Path(path)
    if str(path) == "" or target.name in ("", ".", ".."):
        raise UsageError(f"{path!r}: not a folder name")
    if target.name.startswith(TMP_PREFIX):
        raise UsageError(f"{path}: names starting with {TMP_PREFIX} are fp4pass's temporary files")
    parent = target.parent
    if not parent.is_dir():
        raise UsageError(f"{path}: folder {parent} does not exist")
    if target.is_symlink() or (target.exists() and not target.is_dir()):
        raise UsageError(f"{path}: exists and is not a folder")
    if target.is_dir() and any(os.scandir(target)):
        raise UsageError(f"{path}: exists and is not empty; give a new or an empty folder")
    for given in inputs:
        if same_file(target, given) or _inside(target, given) or _inside(given, target):
            raise UsageError(f"{path}: is, is inside, or holds the input folder {given}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"{path}: folder {parent} is not writable")
    remove_stale(parent)
    tmp = temp_name(target)
    os.mkdir(tmp, 0o700)
    try:
        yield tmp
        os.chmod(tmp, 0o777 & ~_umask())
        _fsync_tree(tmp)
        os.replace(tmp, target)
        fsync_folder(parent)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
