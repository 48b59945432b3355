"""The safetensors file format, read and written one tensor at a time.

A safetensors file is ``N`` (little-endian u64), ``N`` bytes of UTF-8 JSON (the header), then the data::

    {"__metadata__": {str: str}, NAME: {"dtype": "U8", "shape": [..], "data_offsets": [begin, end]}, ...}

Offsets count from the first data byte; the tensors cover the data area exactly, without gaps or overlaps,
and ``end - begin`` is the element count times the dtype's size. :class:`SafetensorsFile` checks all of that
(and that the file is as long as the header says) before any tensor is read, so a truncated shard or a header
that lies is refused with the shard and the tensor named, not discovered halfway through a conversion.

Limits on what a header may list (a 99 MB header listing 1.5 million empty tensors would otherwise take a
minute and gigabytes to read): at most :data:`MAX_HEADER` bytes of header, and at most
:func:`max_tensors` tensors for the size of the file's data area. Names and metadata must be valid UTF-8 (no lone surrogate,
which Python's json accepts from a ``\\ud800`` escape and every other reader refuses); NaN and Infinity are
not JSON and are refused too.

The file is opened only while a tensor is read (:meth:`SafetensorsFile.opened`), so a checkpoint of any
number of shards fits the usual 1024 open files; every opening checks that it is still the file whose header
was read (device, inode, size).

Tensors are read with ``os.preadv`` straight into a buffer the caller may provide (w1 and w3 of one expert
land in one [2, out, in/2] buffer without a copy), and written by :class:`ShardWriter`, which writes the header
first (the plan knows every output's name, dtype and shape) and then each tensor's bytes as it is produced:
no shard is ever held in memory. The header is padded with spaces to a multiple of 8 bytes, as the reference
writer does.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fp4pass.errors import FP4PassError
from fp4pass.io import open_regular
from fp4pass.io.jsonio import no_duplicate_keys, strict_json  # the one strict reader (re-exported)

__all__ = ["CheckpointError", "DTYPES", "TensorEntry", "SafetensorsFile", "OutputSpec", "ShardWriter", "tensor_bytes",
           "no_duplicate_keys", "strict_json", "max_tensors"]

#: safetensors dtype name -> (torch dtype, bytes per element)
DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "BOOL": (torch.bool, 1), "U8": (torch.uint8, 1), "I8": (torch.int8, 1),
    "I16": (torch.int16, 2), "U16": (torch.uint16, 2), "F16": (torch.float16, 2), "BF16": (torch.bfloat16, 2),
    "I32": (torch.int32, 4), "U32": (torch.uint32, 4), "F32": (torch.float32, 4),
    "I64": (torch.int64, 8), "U64": (torch.uint64, 8), "F64": (torch.float64, 8),
    "F8_E4M3": (torch.float8_e4m3fn, 1), "F8_E5M2": (torch.float8_e5m2, 1), "F8_E8M0": (torch.float8_e8m0fnu, 1),
    "F8_E4M3FNUZ": (torch.float8_e4m3fnuz, 1), "F8_E5M2FNUZ": (torch.float8_e5m2fnuz, 1),
    "C64": (torch.complex64, 8),
}
MAX_HEADER = 100 * 1024 * 1024  # the reference reader's own limit
#: tensors a shard may list whatever its data, and one more per this many bytes of its data area
TENSORS_FREE = 65536
BYTES_PER_TENSOR = 16
READ_CHUNK = 1 << 30  # preadv in pieces of at most 1 GiB (Linux caps one call near 2 GiB)
WRITE_CHUNK = 1 << 24  # os.write in pieces of 16 MiB (one huge write measured slower here)
WRITEBACK_STEP = 1 << 26  # start the disk writeback of every 64 MiB written
DIRECT_ALIGN = 4096  # O_DIRECT writes: memory address, file offset and length in whole 4 KiB blocks


class CheckpointError(FP4PassError):
    """A checkpoint folder or shard that cannot be read or converted (names the shard and the tensor)."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a shard: where its bytes are (absolute file offsets) and what they hold."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute offset in the file
    end: int
    shard: str  # the shard's file name, for messages

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype][0]


def max_tensors(data_bytes: int) -> int:
    """The most tensors a safetensors file whose data area (after the header) is ``data_bytes`` long may list:
    :data:`TENSORS_FREE`, plus one per :data:`BYTES_PER_TENSOR` bytes of data. Real shards hold kilobytes to
    gigabytes per tensor; a header of a million empty tensors is refused before it is parsed."""
    return TENSORS_FREE + max(data_bytes, 0) // BYTES_PER_TENSOR


class SafetensorsFile:
    """A shard's header, checked; tensors read on demand (``read``). Use as a context manager or ``close()``.

    ``expect``: the ``os.stat`` the file had when its folder was read; the file opened must still be that one.
    """

    def __init__(self, path: str | os.PathLike, expect: os.stat_result | None = None):
        self.path = Path(path)
        self.name = self.path.name
        fd, self._stat = open_regular(self.path, CheckpointError, "shards", expect=expect)
        try:
            self.entries, self.metadata = self._parse(fd)
        finally:
            os.close(fd)

    def _fail(self, message: str) -> CheckpointError:
        return CheckpointError(f"{self.name}: {message}")

    def _parse(self, fd: int) -> tuple[dict[str, TensorEntry], dict]:
        size = self._stat.st_size
        head = os.pread(fd, 8, 0)
        if len(head) < 8:
            raise self._fail(f"not a safetensors file ({size} bytes, shorter than the 8-byte header length)")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER:
            raise self._fail(f"header length {n} is over the {MAX_HEADER}-byte limit: not a safetensors file")
        if 8 + n > size:
            raise self._fail(f"truncated: the header says {n} bytes, the file has {size - 8} after the length")
        raw = os.pread(fd, n, 8)
        if len(raw) != n:
            raise self._fail(f"truncated while reading its header ({len(raw)} of {n} bytes)")
        data_bytes = size - 8 - n
        limit = max_tensors(data_bytes)
        if raw.count(b"{") > 2 * limit + 2:  # every entry is an object: refused before a long parse
            raise self._fail(f"the header lists more than {limit} tensors, more than {data_bytes} bytes of data "
                             f"hold ({TENSORS_FREE}, and one per {BYTES_PER_TENSOR} bytes beyond)")
        try:
            header = strict_json(raw)
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise self._fail(f"header is not valid JSON ({exc})") from None
        if not isinstance(header, dict):
            raise self._fail("header is not a JSON object")
        metadata = header.pop("__metadata__", None)
        metadata = {} if metadata is None else metadata  # null as safetensors reads it: no metadata
        if not isinstance(metadata, dict):
            raise self._fail("__metadata__ is not an object")
        if len(header) > limit:
            raise self._fail(f"the header lists {len(header)} tensors, more than {data_bytes} bytes of data hold "
                             f"(at most {limit}: {TENSORS_FREE}, and one per {BYTES_PER_TENSOR} bytes beyond)")
        data_start = 8 + n
        entries = {}
        spans = []
        for name, info in header.items():
            entry = self._entry(name, info, data_start)
            entries[name] = entry
            spans.append((entry.begin, entry.end, name))
        spans.sort()
        cursor = data_start
        for begin, end, name in spans:
            if begin != cursor:
                what = "overlaps the tensor before it" if begin < cursor else f"leaves a gap of {begin - cursor} bytes"
                raise self._fail(f"tensor {name!r}: data_offsets {what}: the header does not describe the file")
            cursor = end
        if cursor > size:
            last = spans[-1][2]
            raise self._fail(f"tensor {last!r}: truncated: its data ends at byte {cursor}, the file has {size}")
        if cursor < size:
            raise self._fail(f"{size - cursor} bytes after the last tensor: the header does not describe the file")
        return entries, metadata

    def _entry(self, name: str, info, data_start: int) -> TensorEntry:
        if not isinstance(info, dict):
            raise self._fail(f"tensor {name!r}: header entry is not an object")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise self._fail(f"tensor {name!r}: unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise self._fail(f"tensor {name!r}: shape {shape!r} is not a list of non-negative integers")
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int and o >= 0 for o in offsets)
                or offsets[1] < offsets[0]):
            raise self._fail(f"tensor {name!r}: data_offsets {offsets!r} are not [begin, end] with begin <= end")
        expected = math.prod(shape) * DTYPES[dtype][1]
        if offsets[1] - offsets[0] != expected:
            raise self._fail(f"tensor {name!r}: data_offsets span {offsets[1] - offsets[0]} bytes, but {dtype} "
                             f"{shape} needs {expected}: the header lies")
        return TensorEntry(name, dtype, tuple(shape), data_start + offsets[0], data_start + offsets[1], self.name)

    @contextlib.contextmanager
    def opened(self):
        """A descriptor of the shard for the block; the file must still be the one whose header was read
        (device, inode, size): a shard replaced or resized since is refused, naming it."""
        try:
            fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            raise self._fail(f"cannot be opened ({exc.strerror})") from None
        try:
            now = os.fstat(fd)
            if not stat.S_ISREG(now.st_mode) or (now.st_dev, now.st_ino, now.st_size) != (
                    self._stat.st_dev, self._stat.st_ino, self._stat.st_size):
                raise self._fail(f"changed since its header was read ({self._stat.st_size} bytes then, "
                                 f"{now.st_size} now, or another file): the file shrank, grew or was replaced")
            yield fd
        finally:
            os.close(fd)

    def read(self, name: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor ``name`` as its own dtype and shape; into ``out`` (contiguous, as many bytes) if given."""
        entry = self.entries[name]
        if out is None:
            out = torch.empty(entry.shape, dtype=entry.torch_dtype)
        elif out.numel() * out.element_size() != entry.nbytes or not out.is_contiguous():
            raise ValueError(f"{name}: buffer of {out.numel() * out.element_size()} bytes for {entry.nbytes}")
        if entry.nbytes:
            self.read_bytes(name, 0, memoryview(out.view(-1).view(torch.uint8).numpy()))
        return out.view(entry.torch_dtype).reshape(entry.shape) if entry.shape else out.view(entry.torch_dtype)

    def read_bytes(self, name: str, start: int, view) -> None:
        """Fill the writable buffer ``view`` with the bytes of tensor ``name`` from byte ``start`` of its data."""
        entry = self.entries[name]
        view = memoryview(view).cast("B")
        if start < 0 or start + len(view) > entry.nbytes:
            raise ValueError(f"{name}: bytes {start}..{start + len(view)} of {entry.nbytes}")
        if not len(view):
            return
        with self.opened() as fd:
            done = 0
            while done < len(view):
                piece = view[done:done + READ_CHUNK]
                try:
                    got = os.preadv(fd, [piece], entry.begin + start + done)
                except OSError as exc:
                    raise self._fail(f"tensor {name!r}: read failed ({exc.strerror})") from None
                if got == 0:
                    raise self._fail(f"tensor {name!r}: truncated while reading (the file shrank)")
                done += got

    def close(self) -> None:
        """Nothing to release: the file is open only while a tensor is read (kept for ``with``)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a tensor (made contiguous), as a flat memoryview (little-endian machines)."""
    t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


@dataclass(frozen=True)
class OutputSpec:
    """A tensor a shard will hold: its name, safetensors dtype and shape (the bytes come later)."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype][1]


def aligned_view(backing: np.ndarray, nbytes: int, phase: int) -> np.ndarray:
    """``nbytes`` of the uint8 array ``backing`` (at least ``nbytes + DIRECT_ALIGN`` long) whose first byte lies
    ``phase`` bytes past a DIRECT_ALIGN boundary of memory: a buffer whose address matches its place in a file
    (``phase = file offset % DIRECT_ALIGN``), so that :meth:`ShardWriter.write_part` can send its whole blocks to
    the disk directly."""
    if backing.dtype != np.uint8 or backing.ndim != 1 or len(backing) < nbytes + DIRECT_ALIGN:
        raise ValueError(f"aligned_view: {nbytes} bytes need a uint8 backing of {nbytes + DIRECT_ALIGN}")
    start = (phase - backing.ctypes.data) % DIRECT_ALIGN
    return backing[start:start + nbytes]


class ShardWriter:
    """Writes one shard: the header from ``specs`` at once, then each tensor's bytes in ``specs`` order.

    ``write(name, data)`` takes the next tensor (or ``write_part`` several pieces of it); ``close()`` checks
    every tensor arrived whole and fsyncs the file. An OSError (a full disk) names the shard and the tensor.

    Bytes go through the page cache, except the whole 4 KiB blocks of a buffer whose memory address matches
    its offset in the file (:func:`aligned_view`): those go to the disk directly (``O_DIRECT``, where the file
    system takes it), which spares the copy into the page cache and the kernel's writeback of it. Where the file
    system refuses, everything goes through the page cache.
    """

    def __init__(self, path: str | os.PathLike, specs: list[OutputSpec], metadata: dict[str, str] | None = None):
        self.path = Path(path)
        self.specs = list(specs)
        header: dict = {"__metadata__": dict(metadata)} if metadata else {}
        offset = 0
        for spec in self.specs:
            header[spec.name] = {"dtype": spec.dtype, "shape": list(spec.shape),
                                 "data_offsets": [offset, offset + spec.nbytes]}
            offset += spec.nbytes
        text = json.dumps(header, separators=(",", ":")).encode("utf-8")
        text += b" " * (-len(text) % 8)
        self.total = offset
        self._offsets = {spec.name: 8 + len(text) + header[spec.name]["data_offsets"][0] for spec in self.specs}
        self._index = 0
        self._written = 0  # bytes of the current tensor
        # bytes in the file; bytes whose writeback has been started; bytes whose pages have been dropped
        self._position = self._flushed = self._dropped = 0
        self._direct = -1
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        if hasattr(os, "posix_fallocate") and self.total:
            # the whole shard's blocks at once: a full disk shows now, and each append need not allocate
            try:
                os.posix_fallocate(self._fd, 0, 8 + len(text) + self.total)
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                    first = self.specs[0].name
                    self.abort()
                    raise CheckpointError(f"{self.path.name}: tensor {first!r} and the {len(self.specs) - 1} after "
                                          f"it: no room for {8 + len(text) + self.total} bytes "
                                          f"({exc.strerror})") from None
        self._direct = _open_direct(self.path)
        self._write_all(struct.pack("<Q", len(text)) + text, "(header)")

    def file_offset(self, name: str) -> int:
        """Where tensor ``name``'s first byte goes in the file."""
        return self._offsets[name]

    def _write_all(self, data, what: str) -> None:
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            try:
                done += os.write(self._fd, view[done:done + WRITE_CHUNK])
            except OSError as exc:
                raise CheckpointError(f"{self.path.name}: tensor {what}: write failed ({exc.strerror})") from None
        self._advance(len(view))

    def _write_direct(self, view: memoryview, what: str) -> None:
        """Write ``view`` (whole blocks, its address and the file's position aligned) past the page cache, then
        move the buffered descriptor past it. A file system that refuses (``EINVAL``) gets the rest through the
        page cache, this shard's later writes too."""
        done = 0
        while done < len(view) and self._direct >= 0:
            try:
                done += os.pwrite(self._direct, view[done:done + WRITE_CHUNK], self._position + done)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise CheckpointError(f"{self.path.name}: tensor {what}: write failed ({exc.strerror})") from None
                os.close(self._direct)
                self._direct = -1
        if done:
            os.lseek(self._fd, self._position + done, os.SEEK_SET)
            self._advance(done)
        self._write_all(view[done:], what)

    def _advance(self, nbytes: int) -> None:
        """Count bytes written; every WRITEBACK_STEP bytes, start writing them to disk and drop the step before.

        ``posix_fadvise(DONTNEED)`` on dirty pages starts their writeback without waiting (the pages stay cached
        until written), so the fsync before the final rename has little left to wait for. The same call one step
        later drops those pages once written (pages still being written are left alone): the shard keeps about
        two steps in the page cache whatever its size, and the next writes reuse the pages just freed instead
        of taking memory the kernel (or a virtual machine's host) must first provide.
        """
        self._position += nbytes
        if self._position - self._flushed >= WRITEBACK_STEP and hasattr(os, "posix_fadvise"):
            try:
                os.posix_fadvise(self._fd, self._flushed, self._position - self._flushed, os.POSIX_FADV_DONTNEED)
                if self._dropped < self._flushed:
                    os.posix_fadvise(self._fd, self._dropped, self._flushed - self._dropped,
                                     os.POSIX_FADV_DONTNEED)
            except OSError:
                pass
            self._dropped, self._flushed = self._flushed, self._position

    def write_part(self, name: str, data) -> None:
        """Append bytes (a tensor or a buffer) of tensor ``name``, which must be the next one in the plan."""
        spec = self.specs[self._index] if self._index < len(self.specs) else None
        if spec is None or spec.name != name:
            raise RuntimeError(f"{self.path.name}: wrote {name!r} where the plan has {spec and spec.name!r}")
        if isinstance(data, torch.Tensor):
            view = tensor_bytes(data)
        else:
            view = memoryview(np.ascontiguousarray(data)).cast("B")
        if self._written + len(view) > spec.nbytes:
            raise RuntimeError(f"{self.path.name}: {name!r} got more than its {spec.nbytes} bytes")
        if self._direct >= 0 and len(view) >= 2 * DIRECT_ALIGN and (
                np.frombuffer(view, dtype=np.uint8).ctypes.data % DIRECT_ALIGN == self._position % DIRECT_ALIGN):
            head = -self._position % DIRECT_ALIGN  # up to the first block boundary
            body = head + (len(view) - head) // DIRECT_ALIGN * DIRECT_ALIGN  # the end of the last whole block
            self._write_all(view[:head], repr(name))
            self._write_direct(view[head:body], repr(name))
            self._write_all(view[body:], repr(name))
        else:
            self._write_all(view, repr(name))
        self._written += len(view)
        if self._written == spec.nbytes:
            self._index += 1
            self._written = 0

    def copy_from(self, name: str, src_fd: int, offset: int, nbytes: int, source: str | None = None) -> None:
        """Write tensor ``name`` from ``nbytes`` bytes of an open file at ``offset``, inside the kernel where it can
        (``os.copy_file_range``: no copy through user memory), else in 64 MiB pieces. ``source``: the source
        file's name, for messages (a failed copy may be the read's fault or the write's)."""
        spec = self.specs[self._index] if self._index < len(self.specs) else None
        if spec is None or spec.name != name or spec.nbytes != nbytes or self._written:
            raise RuntimeError(f"{self.path.name}: copy of {name!r} does not fit the plan")
        done = 0
        fast = hasattr(os, "copy_file_range")
        while done < nbytes:
            try:
                if fast:
                    got = os.copy_file_range(src_fd, self._fd, min(nbytes - done, READ_CHUNK), offset + done)
                else:
                    got = 0
                if got == 0:
                    fast = False
                    piece = os.pread(src_fd, min(nbytes - done, 1 << 26), offset + done)
                    if not piece:
                        raise CheckpointError(f"{self.path.name}: tensor {name!r}: its source shrank while copied"
                                              if source is None else
                                              f"{source}: tensor {name!r}: shrank while copied to {self.path.name}")
                    self._write_all(piece, repr(name))
                    got = len(piece)
                else:
                    self._advance(got)
            except OSError as exc:
                if fast and exc.errno in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                    fast = False
                    continue
                if source is None:
                    raise CheckpointError(f"{self.path.name}: tensor {name!r}: write failed ({exc.strerror})") from None
                raise CheckpointError(f"{source}: tensor {name!r}: copy to {self.path.name} failed "
                                      f"({exc.strerror})") from None
            done += got
        self._index += 1

    def write(self, name: str, data) -> None:
        """Write the whole tensor ``name`` (the next one in the plan)."""
        before = self._index
        self.write_part(name, data)
        if self._index == before:
            raise RuntimeError(f"{self.path.name}: {name!r} is shorter than its {self.specs[before].nbytes} bytes")

    def close(self) -> None:
        """Check the shard is complete, fsync it and close it."""
        try:
            if self._index != len(self.specs):
                raise RuntimeError(f"{self.path.name}: {len(self.specs) - self._index} tensors never written")
            try:
                os.fsync(self._fd)
            except OSError as exc:
                raise CheckpointError(f"{self.path.name}: fsync failed ({exc.strerror})") from None
        finally:
            self.abort()

    def abort(self) -> None:
        if self._direct >= 0:
            os.close(self._direct)
            self._direct = -1
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _open_direct(path: Path) -> int:
    """A second, ``O_DIRECT`` descriptor of ``path``; -1 where the platform or the file system has none."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return -1
    try:
        return os.open(path, os.O_WRONLY | flag)
    except OSError:
        return -1
