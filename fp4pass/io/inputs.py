"""Reading the small files a stranger hands in: only regular files on real file systems, read exactly.

A FIFO would block the open, a device such as ``/dev/zero`` never ends, a file on procfs or sysfs is made up
as it is read (its size says nothing): each is refused naming the path before a byte is read.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat

from fp4pass.errors import UsageError

def file_kind(mode: int) -> str:
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
        raise error(f"{path}: {file_kind(info.st_mode)}; only regular {what} are read")
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
            raise error(f"{path}: {file_kind(opened.st_mode)}; only regular {what} are read")
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

