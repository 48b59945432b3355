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
6. **Stale temporaries.** Every temporary is a folder (``.fp4pass-tmp-<pid>-h<host>-<random>-<name>``,
   :func:`make_temp_folder`) holding a marker file, :data:`MARKER`: the pid, that process's start time
   (``/proc/PID/stat``), a token of the machine, boot and pid namespace it ran in (:func:`host_token`) and the
   folder's own device and inode. A killed run (SIGKILL) cannot clean up; the next :func:`atomic_output` or
   :func:`atomic_folder` in that folder, or ``fp4pass clean DIR``, removes the temporaries whose marker says
   they were made here by a process that is gone (the pid is not running, or runs with another start time)
   (:func:`remove_stale`). Only a real folder (not a symlink) whose marker checks out is ever removed: a file,
   a folder without the marker (a user's folder named like a temporary, an input), a copy of a temporary
   (another inode) or the input of the current run are never removed. A pid means nothing on another host
   or in another pid namespace sharing the folder: such temporaries go only with ``fp4pass clean
   --older-than HOURS``, and a run alive here is left alone even then.
7. **The rename is the last step.** :func:`atomic_folder` and :func:`finish` record the inode they rename in
   the :class:`OutputSession` before the rename, so a failure or a signal at any moment after it takes the
   output back out (the CLI rolls the session back); :func:`atomic_folder` also removes its folder itself
   when the rename's own aftermath (the folder's fsync) fails or is interrupted.
8. **Output folders are marked.** Every folder :func:`atomic_folder` writes holds :data:`OUTPUT_MARKER`; with
   ``overwrite`` it replaces an existing folder only when that holds the marker (a folder fp4pass wrote), and
   only once the new folder is complete: the old one is moved aside into the temporary, the new one renamed
   in, then the old one removed (moved back if the rename fails).
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
    "json_text",
    "finite_json",
    "MARKER",
    "OUTPUT_MARKER",
    "check_output_folder",
    "written_by_fp4pass",
    "make_temp_folder",
    "copy_regular_file",
    "pseudo_filesystem",
    "inside_folder",
    "open_regular",
    "read_exact",
]

TMP_PREFIX = ".fp4pass-tmp-"
#: the file that marks a folder fp4pass wrote (:func:`atomic_folder`): only such a folder is replaced (overwrite)
OUTPUT_MARKER = ".fp4pass-output.json"
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
    if real != base and os.path.commonpath([real, base]) == base:
        return True
    return inside_folder(path, folder)


def inside_folder(path: str | os.PathLike, folder: str | os.PathLike) -> bool:
    """Whether a folder above ``path`` (which need not exist yet) is ``folder``, by device and inode: a bind
    mount or a second mount of ``folder`` shows the same ``st_dev``/``st_ino`` under another path, which no
    comparison of paths sees."""
    try:
        base = os.stat(folder)
    except OSError:
        return False
    if not stat.S_ISDIR(base.st_mode):
        return False
    here = Path(os.path.abspath(path)).parent
    while True:
        try:
            st = os.stat(here)
        except OSError:
            st = None
        if st is not None and (st.st_dev, st.st_ino) == (base.st_dev, base.st_ino):
            return True
        if here.parent == here:
            return False
        here = here.parent


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
    emptied: set[Path] = field(default_factory=set)  # output folders that replaced an empty folder

    def record(self, path: Path, kind: str, identity: tuple[int, int] | None = None) -> None:
        """Note that this run put ``path`` there: the inode ``identity`` (recorded before the rename, which
        keeps the inode, so that a signal right after it still finds the entry), else what is there now."""
        if identity is None:
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
                continue  # another run wrote this path since (or the rename never happened): not ours
            with contextlib.suppress(FileNotFoundError):
                if stat.S_ISDIR(st.st_mode):  # an output folder (atomic_folder): all of it is this run's
                    shutil.rmtree(path)
                    if path in self.emptied:
                        with contextlib.suppress(OSError):
                            os.mkdir(path)
                else:
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


#: the marker file inside every temporary folder: JSON naming the process that made it (module rule 6)
MARKER = ".fp4pass-run"
_MARKER_MAX = 4096


def process_start(pid: int) -> str | None:
    """The start time of process ``pid`` (clock ticks after boot, field 22 of ``/proc/PID/stat``); None when
    there is no such process or no ``/proc``."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            text = f.read(4096).decode("ascii", errors="replace")
    except (OSError, ValueError, OverflowError):
        return None
    fields = text[text.rfind(")") + 1:].split()  # the command name, in parentheses, may hold spaces
    return fields[19] if len(fields) > 19 else None


def write_marker(folder: str | os.PathLike, pid: int | None = None, host: str | None = None,
                 start: str | None = None) -> None:
    """Write :data:`MARKER` into the fresh temporary ``folder``: this process (or the ``pid`` given, for
    tests), its start time, the host token and the folder's device and inode."""
    pid = os.getpid() if pid is None else pid
    st = os.lstat(folder)
    data = {"fp4pass": 1, "pid": pid, "start": process_start(pid) if start is None else start,
            "host": host_token() if host is None else host, "dev": st.st_dev, "ino": st.st_ino}
    fd = os.open(Path(folder) / MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, json.dumps(data).encode())
    finally:
        os.close(fd)


def _marker(folder: Path, st: os.stat_result) -> dict | None:
    """The marker of the temporary ``folder`` (``st``: its lstat), or None when it is not one fp4pass made
    there: no marker, not a small regular file, not the marker's JSON, or made for another inode (a copy)."""
    try:
        fd = os.open(folder / MARKER, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > _MARKER_MAX:
            return None
        data = json.loads(os.read(fd, _MARKER_MAX + 1))
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    if not isinstance(data, dict) or data.get("fp4pass") != 1:
        return None
    if type(data.get("pid")) is not int or data["pid"] < 1 or not isinstance(data.get("host"), str):
        return None
    if (data.get("dev"), data.get("ino")) != (st.st_dev, st.st_ino):
        return None
    return data


def _alive_here(marker: dict) -> bool:
    """Whether the process that wrote ``marker`` (on this host) still runs: its pid is alive and, where the
    start time can be read, it is the same process (not a later one that got the pid again)."""
    pid = marker["pid"]
    if not _pid_alive(pid):
        return False
    if pid == os.getpid():
        return True
    now = process_start(pid)
    return now is None or marker.get("start") is None or now == marker.get("start")


def _newest_mtime(folder: Path, st: os.stat_result) -> float:
    newest = st.st_mtime
    with contextlib.suppress(OSError):
        for entry in os.scandir(folder):
            with contextlib.suppress(OSError):
                newest = max(newest, entry.stat(follow_symlinks=False).st_mtime)
    return newest


def _is_stale(entry: os.DirEntry, token: str, older_than: float | None) -> bool:
    """Whether a temporary may go (module docstring, rule 6): a real folder with fp4pass's marker, made here
    by a process that is gone, or (``older_than`` seconds given) made anywhere by a process not alive here and
    untouched for that long."""
    if not _TMP_RE.match(entry.name):
        return False
    path = Path(entry.path)
    try:
        st = os.lstat(path)
    except OSError:
        return False
    if not stat.S_ISDIR(st.st_mode):
        return False
    marker = _marker(path, st)
    if marker is None:
        return False
    here = marker["host"] == token
    if here and _alive_here(marker):
        return False
    if here:
        return True
    if older_than is None:
        return False
    return time.time() - _newest_mtime(path, st) > older_than


def remove_stale(folder: str | os.PathLike, older_than: float | None = None, keep: tuple = ()) -> list[Path]:
    """Remove the fp4pass temporaries in ``folder`` that no run still writes (module docstring, rule 6);
    returns what was removed. ``older_than``: also remove the temporaries of another host, pid namespace (or
    an fp4pass that cannot be asked) untouched for that many seconds. ``keep``: paths never removed (the
    inputs of the run that sweeps), by path or inode."""
    removed = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    token = host_token()
    kept = set()
    for given in keep:
        with contextlib.suppress(OSError, TypeError, ValueError):
            st = os.stat(given)
            kept.add((st.st_dev, st.st_ino))
    for entry in entries:
        if not _is_stale(entry, token, older_than):
            continue
        path = Path(entry.path)
        try:
            st = os.lstat(path)
            if (st.st_dev, st.st_ino) in kept:
                continue
            shutil.rmtree(path)
            removed.append(path)
        except OSError:
            pass  # another run removed it first, or we may not: leave it
    return removed


def make_temp_folder(target: str | os.PathLike, suffix: str = "", error: type[Exception] = UsageError) -> Path:
    """A fresh private temporary folder beside ``target`` (:func:`temp_name`) holding its :data:`MARKER`."""
    tmp = temp_name(target, suffix)
    try:
        os.mkdir(tmp, stat.S_IRWXU)
    except OSError as exc:
        raise error(f"{target}: cannot write in {Path(target).parent} ({exc.strerror})") from None
    try:
        write_marker(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tmp


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
    The rename is recorded before it is made (module docstring, rule 7).
    """
    target = output_target(target)
    _fsync_path(tmp)
    os.chmod(tmp, 0o666 & ~_umask())
    if _session is not None:
        st = os.lstat(tmp)
        _session.record(target, kind, (st.st_dev, st.st_ino))
    os.replace(tmp, target)
    fsync_folder(target.parent)


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike, suffix: str = "", kind: str = RESULT) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; rename it onto ``path`` only if the block finishes.

    The temporary path lies in a temporary folder (:func:`make_temp_folder`) beside ``path`` and keeps
    ``path``'s name (and ``suffix``). ``kind``: "result" or "report" (what :meth:`OutputSession.rollback`
    keeps after exit 1).
    """
    folder = Path(path).parent
    if not folder.is_dir():
        raise UsageError(f"{path}: folder {folder} does not exist")
    target = output_target(path)
    remove_stale(folder)
    staging = make_temp_folder(target, ".d")
    tmp = staging / (target.name + suffix if not target.name.endswith(suffix) else target.name)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.close(fd)
        yield tmp
        if tmp.exists():
            finish(tmp, target, kind)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


#: the key under which :func:`json_text` lists the places of the non-finite numbers it wrote as null
NON_FINITE_NOTE = "non_finite_as_null"
_NOTE_PLACES = 100


def finite_json(data, path: str = "$") -> tuple[object, list[str]]:
    """(``data`` with every non-finite float (NaN, Infinity, -Infinity; numpy's float64 too) replaced by None,
    the places replaced as ``$.modules[3].global_scale: nan``). Dicts, lists and tuples are copied where they
    hold one; everything else is returned as it is."""
    places: list[str] = []

    def walk(value, where: str):
        if isinstance(value, float):
            if value != value or value in (float("inf"), float("-inf")):
                places.append(f"{where}: {value!r}")
                return None
            return value
        if isinstance(value, dict):
            return {k: walk(v, f"{where}.{k}") for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [walk(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return value

    return walk(data, path), places


def json_text(data, indent: int | None = 2) -> str:
    """``data`` as strict JSON (RFC 8259: no NaN or Infinity, which strict readers refuse): each non-finite
    number is written as null, and an object gets the key :data:`NON_FINITE_NOTE` listing where (at most
    100 places, then how many more)."""
    clean, places = finite_json(data)
    if places and isinstance(clean, dict):
        more = [f"... and {len(places) - _NOTE_PLACES} more"] if len(places) > _NOTE_PLACES else []
        clean[NON_FINITE_NOTE] = places[:_NOTE_PLACES] + more
    return json.dumps(clean, indent=indent, allow_nan=False)


def write_json(path: str | os.PathLike, data, kind: str = REPORT) -> None:
    """Write ``data`` as indented strict JSON (:func:`json_text`: a non-finite number is null, with a note),
    atomically. A file system that refuses the write (full, read-only) is a :class:`UsageError` naming
    ``path``."""
    text = json_text(data) + "\n"
    try:
        with atomic_output(path, kind=kind) as tmp:
            tmp.write_text(text)
    except OSError as exc:
        raise UsageError(f"{path}: cannot be written ({exc.strerror or exc})") from None


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


#: file systems whose "files" the kernel makes up as they are read (sizes say 0 or 4096 whatever they hold):
#: never read as a checkpoint's or a flag's file
PSEUDO_FILESYSTEMS = frozenset({
    "proc", "sysfs", "devtmpfs", "devpts", "debugfs", "tracefs", "securityfs", "configfs", "pstore", "bpf",
    "efivarfs", "fusectl", "mqueue", "binfmt_misc", "nsfs", "rpc_pipefs", "selinuxfs", "cgroup", "cgroup2",
    "autofs", "hugetlbfs",
})


def _mount_types() -> dict[int, str]:
    """``st_dev`` -> file system type of every mount (``/proc/self/mountinfo``); empty where there is none."""
    found: dict[int, str] = {}
    try:
        with open("/proc/self/mountinfo", "rb") as f:
            text = f.read(1 << 24).decode("utf-8", errors="replace")
    except OSError:
        return found
    for line in text.splitlines():
        fields = line.split()
        try:
            sep = fields.index("-", 6)
            major, minor = fields[2].split(":")
            found[os.makedev(int(major), int(minor))] = fields[sep + 1]
        except (ValueError, IndexError, OverflowError):
            continue
    return found


def pseudo_filesystem(info: os.stat_result) -> str | None:
    """The type of the pseudo file system (procfs, sysfs, devtmpfs, ...: :data:`PSEUDO_FILESYSTEMS`) the file
    of ``info`` lies on, else None. Found by the file's device in the mount table; where no mount table can
    be read (or the device is not in it), by comparing the device with those of ``/proc``, ``/sys``, ``/dev``.
    """
    kind = _mount_types().get(info.st_dev)
    if kind is not None:
        return kind if kind in PSEUDO_FILESYSTEMS else None
    for root, name in (("/proc", "proc"), ("/sys", "sysfs"), ("/dev", "devtmpfs")):
        with contextlib.suppress(OSError):
            if os.stat(root).st_dev == info.st_dev:
                return name
    return None


def open_regular(path: str | os.PathLike, error: type[Exception], what: str = "files",
                  expect: os.stat_result | None = None) -> tuple[int, os.stat_result]:
    """Open ``path`` for reading when it is a regular file on a real file system: (descriptor, its fstat).

    The type is checked before the open (a FIFO would block it) and on the descriptor. ``expect``: the file
    must be that one still (device, inode, size), not one swapped in since it was checked.
    """
    info = regular_file_status(path, error, what)
    kind = pseudo_filesystem(info)
    if kind is not None:
        raise error(f"{path}: lies on {kind}, a pseudo file system whose files are made up as they are read; "
                    f"only regular {what} are read")
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)
                     | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise error(f"{path}: cannot be read ({exc.strerror})") from None
    try:
        opened = os.fstat(fd)
        if not stat.S_ISREG(opened.st_mode):
            raise error(f"{path}: {_file_kind(opened.st_mode)}; only regular {what} are read")
        kind = pseudo_filesystem(opened)  # the file opened decides (it may have been swapped since the stat)
        if kind is not None:
            raise error(f"{path}: lies on {kind}, a pseudo file system whose files are made up as they are "
                        f"read; only regular {what} are read")
        if expect is not None and (opened.st_dev, opened.st_ino, opened.st_size) != (
                expect.st_dev, expect.st_ino, expect.st_size):
            raise error(f"{path}: is not the file it was when the folder was read (replaced or resized since)")
    except BaseException:
        os.close(fd)
        raise
    return fd, opened


def read_exact(fd: int, size: int, path, error: type[Exception]) -> bytes:
    """The ``size`` bytes of ``fd`` (just opened: read from its start), then EOF; a file that ends early or goes
    on is refused (its content does not match its size: it changed, or it is made up as it is read)."""
    chunks, done = [], 0
    try:
        while done < size:
            chunk = os.read(fd, min(1 << 20, size - done))
            if not chunk:
                raise error(f"{path}: ends after {done} of its {size} bytes (it changed while read)")
            chunks.append(chunk)
            done += len(chunk)
        if os.read(fd, 1):
            raise error(f"{path}: holds more than the {size} bytes its size says (it changed while read, or "
                        "its content is made up as it is read)")
    except OSError as exc:
        raise error(f"{path}: cannot be read ({exc.strerror})") from None
    return b"".join(chunks)


def read_regular_file(path: str | os.PathLike, limit: int, error: type[Exception] = UsageError) -> bytes:
    """The bytes of ``path`` when it is a regular file (symlinks followed) of at most ``limit`` bytes.

    Anything else raises ``error`` naming the path: a FIFO (opening it would wait for a writer), a device such
    as ``/dev/zero`` (reading it never ends), a socket, a directory, a missing file, a file on a pseudo file
    system (``/proc/self/environ``: :func:`pseudo_filesystem`), or a file over ``limit``. The type is checked
    before the file is opened and again on the open descriptor; exactly ``st_size`` bytes are read, and a
    file whose content is shorter or longer than its size is refused.
    """
    fd, info = open_regular(path, error)
    try:
        if info.st_size > limit:
            raise error(f"{path}: {info.st_size} bytes; at most {limit} are read from such a file")
        return read_exact(fd, info.st_size, path, error)
    finally:
        os.close(fd)


def copy_regular_file(src: str | os.PathLike, dst: str | os.PathLike, error: type[Exception] = UsageError,
                      expect: os.stat_result | None = None) -> int:
    """Copy the regular file ``src`` (rules of :func:`read_regular_file`, no size limit) to the new file
    ``dst``: exactly ``st_size`` bytes (in the kernel where it can, ``os.copy_file_range``), then ``src`` must
    be at its end. ``expect``: the stat ``src`` had when it was checked (:func:`open_regular`). Returns the
    bytes copied."""
    fd, info = open_regular(src, error, expect=expect)
    try:
        try:
            out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
        except OSError as exc:
            raise error(f"{dst}: cannot be written ({exc.strerror})") from None
        try:
            size, done = info.st_size, 0
            fast = hasattr(os, "copy_file_range")
            while done < size:
                try:
                    got = os.copy_file_range(fd, out, min(size - done, 1 << 30), done) if fast else 0
                    if got == 0:
                        fast = False
                        piece = os.pread(fd, min(size - done, 1 << 24), done)
                        if not piece:
                            raise error(f"{src}: ends after {done} of its {size} bytes (it changed while copied)")
                        view, got = memoryview(piece), 0
                        while got < len(view):
                            got += os.write(out, view[got:])
                except OSError as exc:
                    if fast and exc.errno in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                        fast = False
                        continue
                    raise error(f"{src}: cannot be copied to {dst} ({exc.strerror})") from None
                done += got
            try:
                extra = os.pread(fd, 1, size)
            except OSError as exc:
                raise error(f"{src}: cannot be read ({exc.strerror})") from None
            if extra:
                raise error(f"{src}: holds more than the {size} bytes its size says (it changed while copied, "
                            "or its content is made up as it is read)")
        finally:
            os.close(out)
    finally:
        os.close(fd)
    return size


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
        if _session is not None:
            _session.record(target, RESULT, identity)
            if was_empty_folder:
                _session.emptied.add(target)
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
