"""Temporary folders and their markers: who made a temporary, and whether it may go (rule 6 of :mod:`fp4pass.io`).

Every temporary fp4pass makes is a folder ``.fp4pass-tmp-<pid>-h<host>-<random>-<name>`` holding
:data:`MARKER`; :func:`remove_stale` removes those whose maker is gone, and puts back an output folder a
killed ``--overwrite`` left aside (:mod:`fp4pass.io.swap`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import shutil
import socket
import stat
import time
from pathlib import Path

from fp4pass.errors import UsageError
from fp4pass.io.jsonio import read_small_json
from fp4pass.io.names import TMP_PREFIX

#: a temporary's pid and host token (``h`` + 8 hex digits); names without a token are from older versions
_TMP_RE = re.compile(r"^\.fp4pass-tmp-(\d+)-(?:h([0-9a-f]{8})-)?")


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
    data = read_small_json(folder / MARKER, _MARKER_MAX, 2)  # bounded: 4 KB of '[' is no RecursionError
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


def remove_stale(folder: str | os.PathLike, older_than: float | None = None, keep: tuple = (),
                 restored: list | None = None) -> list[Path]:
    """Remove the fp4pass temporaries in ``folder`` that no run still writes (module docstring, rule 6);
    returns what was removed. ``older_than``: also remove the temporaries of another host, pid namespace (or
    an fp4pass that cannot be asked) untouched for that many seconds. ``keep``: paths never removed (the
    inputs of the run that sweeps), by path or inode. A temporary that holds an output folder a killed
    ``--overwrite`` had moved aside puts it back first (:func:`fp4pass.io.swap.recover`; appended to
    ``restored``), or stays when it cannot."""
    from fp4pass.io.swap import recover

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
            may_go, back = recover(path)
            if back is not None and restored is not None:
                restored.append(back)
            if not may_go:
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

