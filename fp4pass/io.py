"""Writing outputs safely: checked before any work, never a partial file, never an input overwritten.

The rules every file fp4pass writes follows (``docs/bad-input.md`` states them for users):

1. **Checked first.** :func:`check_outputs` runs before a command does any work. For every output path it
   refuses: a path that is an input (the same path, through ``..`` or a symlink, or a hardlink: the same
   ``st_dev``/``st_ino``); two outputs that are the same file; a folder that does not exist or is not
   writable; a path that is an existing directory; an output inside an input folder (a calibration DIR).
2. **Only regular files are replaced** (:func:`output_target`). An output that is a symlink to a file in
   its own folder is written through (the file it names is replaced, the link stays); a symlink that leads
   out of the folder (``/dev/stdout``), and a device, FIFO, socket or folder, are refused: renaming over
   them would replace a file that is not ours.
3. **Atomic.** :func:`atomic_output` yields a temporary path in the target's own folder (same filesystem),
   named ``.fp4pass-tmp-<pid>-h<host>-<random>-<name>`` (:func:`temp_name`; the name is shortened so that
   the whole stays a legal file name); only a writer that finished is fsynced, then renamed onto the target,
   then the folder is fsynced. A crash, an error or a signal leaves the target as it was.
4. **Mode.** A finished output gets ``0o666 & ~umask``, like any file a program creates (the temporary file
   is private while it is written).
5. **Nothing left on failure, nothing of others removed.** Each rename is recorded in the current
   :class:`OutputSession` with the device and inode it put there; the CLI rolls the session back on a
   non-zero exit, removing what this run renamed in, and only while that path still holds this run's file
   (another run may have written it since). :meth:`OutputSession.rollback` says what exit 1 keeps.
6. **Stale temporaries.** A killed run (SIGKILL) cannot clean up; its temporaries carry its pid and a token
   of the machine, boot and pid namespace it ran in (``h<host>``). The next :func:`atomic_output` in that
   folder, or ``fp4pass clean DIR``, removes those made here whose process is gone (:func:`remove_stale`).
   A pid means nothing on another host or in another pid namespace sharing the folder: such temporaries are
   never removed automatically, only by ``fp4pass clean --older-than HOURS``.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import secrets
import shutil
import socket
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from fp4pass.errors import UsageError

__all__ = [
    "TMP_PREFIX",
    "atomic_output",
    "check_outputs",
    "fsync_folder",
    "output_target",
    "read_regular_file",
    "regular_file_status",
    "OutputSession",
    "refuse_overwrite",
    "remove_stale",
    "same_file",
    "temp_name",
    "write_json",
]

TMP_PREFIX = ".fp4pass-tmp-"
#: a temporary's pid and host token (``h`` + 8 hex digits); names without a token are from older versions
_TMP_RE = re.compile(r"^\.fp4pass-tmp-(\d+)-(?:h([0-9a-f]{8})-)?")

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
        output_target(out, label)
        for in_label, given in inputs.items():
            if same_file(out, given):
                raise UsageError(f"{label} {out}: refusing to write over the input {given} ({in_label})")
            if Path(given).is_dir() and _inside(out, given):
                raise UsageError(f"{label} {out}: is inside the input folder {given} ({in_label})")
        for other_label, other in seen:
            if same_file(out, other):
                raise UsageError(f"{label} {out}: the same file as {other_label} {other}")
        seen.append((label, out))


def output_target(path: str | os.PathLike, label: str = "") -> Path:
    """The file an output at ``path`` replaces (module docstring, rule 2); raises :class:`UsageError` for a
    path that must not be renamed over.

    ``path`` itself, or, for a symlink to a file in ``path``'s own folder, the file it names (written through).
    Refused: a symlink that resolves outside that folder (``/dev/stdout`` -> ``/proc/self/fd/1``), and an
    existing device, FIFO, socket or folder.
    """
    given = Path(path)
    name = f"{label} {path}" if label else str(path)
    target = given
    if given.is_symlink():
        real = Path(os.path.realpath(given))
        if real.parent != Path(os.path.realpath(given.parent)):
            raise UsageError(f"{name}: is a symlink to {real}, outside the output's folder; refusing to replace "
                             "it (give a plain file name)")
        target = real
    try:
        mode = os.stat(target).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return target
    except OSError as exc:
        raise UsageError(f"{name}: cannot be read ({exc.strerror})") from None
    if stat.S_ISDIR(mode):
        raise UsageError(f"{name}: is a directory; give a file name")
    if not stat.S_ISREG(mode):
        raise UsageError(f"{name}: exists and is not a regular file (a device, FIFO or socket); refusing to "
                         "replace it")
    return target


# -- the outputs of one run -------------------------------------------------------------------------------


@dataclass
class OutputSession:
    """The outputs one command renamed into place, so that a failed command can take them back.

    Each entry is ``(path, kind, (st_dev, st_ino))``: the file this run put at ``path``.
    """

    written: list[tuple[Path, str, tuple[int, int] | None]] = field(default_factory=list)

    def record(self, path: Path, kind: str) -> None:
        try:
            st = os.lstat(path)
            identity = (st.st_dev, st.st_ino)
        except OSError:
            identity = None
        self.written.append((Path(path), kind, identity))

    def rollback(self, code: int, keep_results: bool = False) -> list[Path]:
        """Remove this run's outputs after exit ``code`` != 0; returns what was removed.

        Exit 1 (a numeric check below its threshold) keeps the reports (``--report``, ``--json``, ``--plot``:
        they say what failed) and removes the results (model, external data, SCALES.json) unless
        ``keep_results`` (``--keep-unchecked``). Every other non-zero exit removes everything, except the
        results when ``keep_results`` is given (a check that could not run).
        """
        removed = []
        for path, kind, identity in reversed(self.written):
            if kind == REPORT and code == 1:
                continue
            if kind == RESULT and keep_results:
                continue
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if identity is None or (st.st_dev, st.st_ino) != identity:
                continue  # another run wrote this path since: not ours to remove
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
        os.kill(pid, 0)  # pragma: no mutate (a mutated signal number would signal a live process)
    except (ProcessLookupError, OverflowError):  # OverflowError: a number no pid can be
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def _read_text(path: str) -> str:
    try:
        with open(path) as f:
            return f.read(200).strip()
    except OSError:
        return ""


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def host_token() -> str:
    """8 hex digits naming where this process's pids mean something: host name, boot, pid namespace."""
    where = "\0".join((socket.gethostname(), _read_text("/proc/sys/kernel/random/boot_id"), _pid_namespace()))
    return hashlib.sha256(where.encode()).hexdigest()[:8]


def _is_stale(entry: os.DirEntry, token: str, older_than: float | None) -> bool:
    """Whether a temporary may go: made here by a process that is gone, or (``older_than`` seconds given)
    made anywhere and untouched for that long."""
    match = _TMP_RE.match(entry.name)
    if not match:
        return False
    if match.group(2) == token and not _pid_alive(int(match.group(1))):
        return True
    if older_than is None:
        return False
    try:
        return time.time() - entry.stat(follow_symlinks=False).st_mtime > older_than
    except OSError:
        return False


def remove_stale(folder: str | os.PathLike, older_than: float | None = None) -> list[Path]:
    """Remove the fp4pass temporaries in ``folder`` that no run still writes (module docstring, rule 6);
    returns what was removed. ``older_than``: also remove any temporary (from another host, pid namespace or
    an older fp4pass) untouched for that many seconds."""
    removed = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    token = host_token()
    for entry in entries:
        if not _is_stale(entry, token, older_than):
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


#: the longest file name most filesystems allow, in bytes (where the folder's own limit cannot be asked)
NAME_MAX_FALLBACK = 255


def _name_max(folder: Path) -> int:
    try:
        return os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError, AttributeError):
        return NAME_MAX_FALLBACK


def temp_name(target: str | os.PathLike, suffix: str = "") -> Path:
    """A fresh temporary path beside ``target``: ``.fp4pass-tmp-<pid>-h<host>-<random>-<name><suffix>``,
    ``<name>`` cut (at a character boundary) so that the whole fits the folder's longest file name."""
    target = Path(target)
    head = f"{TMP_PREFIX}{os.getpid()}-h{host_token()}-{secrets.token_hex(4)}-"
    room = _name_max(target.parent) - len(head.encode()) - len(suffix.encode())
    name = target.name.encode()[:max(room, 0)].decode("utf-8", errors="ignore")
    return target.parent / f"{head}{name}{suffix}"


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
    """fsync ``tmp``, give it the umask's mode, rename it onto ``target``, fsync the folder, record it.

    ``target`` is :func:`output_target`'s answer, asked again here: what stands at the name now decides.
    """
    target = output_target(target)
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
    folder = Path(path).parent
    if not folder.is_dir():
        raise UsageError(f"{path}: folder {folder} does not exist")
    target = output_target(path)
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


# -- reading small input files ----------------------------------------------------------------------------


def _file_kind(mode: int) -> str:
    for test, kind in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return kind
    return "not a regular file"


def regular_file_status(path: str | os.PathLike, error: type[Exception] = UsageError,
                        what: str = "files") -> os.stat_result:
    """``os.stat(path)`` when it is a regular file (symlinks followed); else ``error`` naming the path and what
    it is instead (a FIFO, a device, a socket, a directory, nothing): "only regular {what} are read"."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise error(f"{path}: no such file") from None
    except OSError as exc:
        raise error(f"{path}: cannot be read ({exc.strerror})") from None
    if not stat.S_ISREG(info.st_mode):
        raise error(f"{path}: {_file_kind(info.st_mode)}; only regular {what} are read")
    return info


def read_regular_file(path: str | os.PathLike, limit: int, error: type[Exception] = UsageError) -> bytes:
    """The bytes of ``path`` when it is a regular file (symlinks followed) of at most ``limit`` bytes.

    Anything else raises ``error`` naming the path: a FIFO (opening it would wait for a writer), a device such
    as ``/dev/zero`` (reading it never ends), a socket, a directory, a missing file, or a file over ``limit``.
    The type is checked before the file is opened and again on the open descriptor, and at most ``limit + 1``
    bytes are read, so a file swapped or grown in between is refused too.
    """
    info = regular_file_status(path, error)
    if info.st_size > limit:
        raise error(f"{path}: {info.st_size} bytes; at most {limit} are read from such a file")
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    except OSError as exc:
        raise error(f"{path}: cannot be read ({exc.strerror})") from None
    try:
        opened = os.fstat(fd)
        if not stat.S_ISREG(opened.st_mode):
            raise error(f"{path}: {_file_kind(opened.st_mode)}; only regular files are read")
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as exc:
        raise error(f"{path}: cannot be read ({exc.strerror})") from None
    finally:
        os.close(fd)
    if size > limit:
        raise error(f"{path}: more than {limit} bytes; at most {limit} are read from such a file")
    return b"".join(chunks)


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
    os.mkdir(tmp, stat.S_IRWXU)  # private while it is written
    try:
        yield tmp
        os.chmod(tmp, 0o777 & ~_umask())
        _fsync_tree(tmp)
        os.replace(tmp, target)
        fsync_folder(parent)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
