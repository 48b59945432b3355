"""Output files: checked against the inputs before any work, written atomically, taken back on failure
(rules 1 to 5 and 7 of :mod:`fp4pass.io`)."""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from fp4pass.errors import UsageError
from fp4pass.io.jsonio import json_text
from fp4pass.io.stale import TMP_PREFIX, make_temp_folder, remove_stale

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


def inside(path: str | os.PathLike, folder: str | os.PathLike) -> bool:
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


#: the most entries of an input folder looked at for where its files really lie (:func:`input_places`)
INPUT_ENTRIES_MAX = 100_000


def input_places(given: str | os.PathLike) -> list[str]:
    """Where the input ``given`` really lies: itself and, for a folder, what its entries' symlinks resolve to
    outside it: the file each names, and for a Hugging Face cache snapshot (``<repo>/snapshots/<rev>``) the
    repository's ``blobs/`` folder its links lead into, each once. An output there could overwrite an input
    through a path that names neither (``diff --json BLOB``)."""
    places = [os.fspath(given)]
    if not os.path.isdir(given):
        return places
    own = os.path.realpath(given)
    blobs = os.path.join(os.path.dirname(os.path.dirname(own)), "blobs")
    hub = os.path.basename(os.path.dirname(own)) == "snapshots"
    seen = {own}
    try:
        with os.scandir(given) as entries:
            for i, entry in enumerate(entries):
                if i >= INPUT_ENTRIES_MAX:
                    break
                if not entry.is_symlink():
                    continue
                real = os.path.realpath(entry.path)
                if inside(real, own):
                    continue
                where = blobs if hub and os.path.dirname(real) == blobs else real
                if where not in seen:
                    seen.add(where)
                    places.append(where)
    except OSError:
        pass
    return places


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
            if Path(given).is_dir() and inside(out, given):
                raise UsageError(f"{label} {out}: is inside the input folder {given} ({in_label})")
            for place in input_places(given)[1:]:
                if same_file(out, place) or (os.path.isdir(place) and inside(out, place)):
                    raise UsageError(f"{label} {out}: lies in {place}, where the files of the input {given} "
                                     f"({in_label}) are stored (its links lead there); refusing to write there")
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


def current_session() -> OutputSession | None:
    """The :func:`output_session` the caller runs in, or None outside one."""
    return _session


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


def current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_folder(folder: str | os.PathLike) -> None:
    """Make a rename in ``folder`` durable (a no-op where folders cannot be opened)."""
    with contextlib.suppress(OSError):
        fsync_path(Path(folder))


def finish(tmp: Path, target: Path, kind: str = RESULT) -> None:
    """fsync ``tmp``, give it the umask's mode, rename it onto ``target``, fsync the folder, record it.

    ``target`` is :func:`output_target`'s answer, asked again here: what stands at the name now decides.
    The rename is recorded before it is made (module docstring, rule 7).
    """
    target = output_target(target)
    fsync_path(tmp)
    os.chmod(tmp, 0o666 & ~current_umask())
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

