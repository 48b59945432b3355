"""Reading ``.npz`` array files (calibration data, diff inputs) without trusting them.

An ``.npz`` is a zip archive with one ``.npy`` member per array. ``numpy.load`` trusts the archive: it opens
whatever the path names (a FIFO blocks, ``/dev/zero`` never ends), allocates the array a member's header
asks for before reading a byte of it (a small archive can ask for gigabytes), and lets zipfile's own
exceptions through. :func:`read_npz` reads the same files, in this order, and refuses each problem with one
error naming the file and the member:

1. the path must be a regular file (symlinks followed), checked before it is opened;
2. the file must be a zip archive that Python's zipfile reads: not truncated, no member encrypted, every
   member stored or deflated (deflate64, bzip2 and lzma members are refused by name), no name twice; a plain
   ``.npy`` (arrays need names) and an archive with no array are refused;
3. each member's ``.npy`` header is read first (a few hundred bytes inflated): no object dtype (that would
   be a pickle), and the caller's ``check(name, shape, dtype)`` may refuse the array (a wrong rank, a
   static dim) before its data is inflated; the header's size must equal what the archive says the member
   inflates to;
4. only then is the data read, into one buffer of exactly that size; zipfile checks the CRC at its end.

Members the caller does not want (``names``) are listed, never inflated.
"""

from __future__ import annotations

import math
import os
import struct
import zipfile
import zlib
from pathlib import Path
from typing import Callable

import numpy as np

from fp4pass.io import regular_file_status

__all__ = ["read_npz", "NPY_MAGIC", "npz_files"]

NPY_MAGIC = b"\x93NUMPY"
_HEADER_LIMIT = 1 << 16  # bytes of .npy header read at most (numpy's own default is 10000)
_SUPPORTED = {zipfile.ZIP_STORED: "stored", zipfile.ZIP_DEFLATED: "deflate"}
_METHODS = {9: "deflate64", zipfile.ZIP_BZIP2: "bzip2", zipfile.ZIP_LZMA: "lzma"}
# what zipfile, zlib and the .npy header parser raise on a damaged archive
_READ_ERRORS = (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, zlib.error, OSError, ValueError, struct.error,
                NotImplementedError, RuntimeError, UnicodeDecodeError, SyntaxError)

Check = Callable[[str, tuple, np.dtype], None]


def _regular(path: Path, error: type[Exception]) -> None:
    regular_file_status(path, error, ".npz files")


def npz_files(folder: str | os.PathLike, error: type[Exception]) -> list[Path]:
    """The ``*.npz`` of ``folder`` in name order, every one checked to be a regular file first (a FIFO or a
    device among them is refused before any is read)."""
    files = sorted(Path(folder).glob("*.npz"))
    for file in files:
        _regular(file, error)
    return files


def _header(member, where: str, error: type[Exception]) -> tuple[tuple, bool, np.dtype, int]:
    """(shape, fortran_order, dtype, header bytes) of one .npy member, read from its first bytes."""
    fmt = np.lib.format
    version = fmt.read_magic(member)
    if version == (1, 0):
        shape, fortran, dtype = fmt.read_array_header_1_0(member, max_header_size=_HEADER_LIMIT)
    elif version == (2, 0):
        shape, fortran, dtype = fmt.read_array_header_2_0(member, max_header_size=_HEADER_LIMIT)
    else:
        raise error(f"{where}: .npy format version {version[0]}.{version[1]}; versions 1.0 and 2.0 are read")
    if dtype.hasobject:
        raise error(f"{where}: holds Python objects (dtype {dtype}); only numeric arrays are read, never pickles")
    return tuple(int(d) for d in shape), bool(fortran), dtype, member.tell()


def _read_exactly(member, size: int) -> bytearray:
    buffer = bytearray(size)
    view = memoryview(buffer)
    done = 0
    while done < size:
        n = member.readinto(view[done:])
        if not n:
            break
        done += n
    if done != size or member.read(1):
        raise EOFError(f"{done} bytes of data where the header says {size}")
    return buffer


def read_npz(path: str | os.PathLike, *, error: type[Exception], names=None,
             check: Check | None = None) -> tuple[dict[str, np.ndarray], list[str]]:
    """``({name: array}, skipped names)`` of the ``.npz`` at ``path`` (module docstring).

    ``error``: the :class:`~fp4pass.errors.FP4PassError` subclass raised, with one line naming the file (and
    member). ``names``: read only these arrays (others are listed in the result's second item, not inflated);
    None reads all. ``check(name, shape, dtype)``: raise to refuse an array from its header.
    """
    path = Path(path)
    _regular(path, error)
    with open(path, "rb") as file:
        if file.read(len(NPY_MAGIC)) == NPY_MAGIC:
            raise error(f"{path}: a plain .npy array, not an .npz; arrays are matched to inputs by name: save them "
                        "with numpy.savez(path, input_name=array)")
    arrays: dict[str, np.ndarray] = {}
    skipped: list[str] = []
    where = str(path)
    try:
        with zipfile.ZipFile(path) as archive:
            infos = [i for i in archive.infolist() if not i.is_dir()]
            seen: set[str] = set()
            for info in infos:
                if info.filename in seen:
                    raise error(f"{path}: member {info.filename!r} appears twice in the archive")
                seen.add(info.filename)
            for info in infos:
                name = info.filename[:-4] if info.filename.endswith(".npy") else info.filename
                where = f"{path}: array {name!r}"
                if names is not None and name not in names:
                    skipped.append(name)
                    continue
                if info.flag_bits & 0x1:
                    raise error(f"{where} is encrypted; save the arrays with numpy.savez, unencrypted")
                if info.compress_type not in _SUPPORTED:
                    method = _METHODS.get(info.compress_type, f"method {info.compress_type}")
                    raise error(f"{where} is compressed with {method}; numpy.savez / savez_compressed write "
                                "stored or deflate members, which are read")
                arrays[name] = _member(archive, info, name, where, error, check)
    except _READ_ERRORS as exc:
        raise error(f"{where}: not a readable .npz ({type(exc).__name__}: {_first_line(exc)})") from None
    if not arrays and not skipped:
        raise error(f"{path}: holds no arrays")
    return arrays, skipped


def _member(archive: zipfile.ZipFile, info: zipfile.ZipInfo, name: str, where: str, error,
            check: Check | None) -> np.ndarray:
    with archive.open(info) as member:
        shape, fortran, dtype, header = _header(member, where, error)
        if check is not None:
            check(name, shape, dtype)
        size = math.prod(shape) * dtype.itemsize
        if header + size != info.file_size:
            raise error(f"{where}: its header says {list(shape)} {dtype} ({size} bytes of data), the archive says the "
                        f"member holds {info.file_size - header}; the file is damaged")
        data = _read_exactly(member, size)
    array = np.frombuffer(data, dtype=dtype)
    return array.reshape(shape[::-1]).transpose() if fortran else array.reshape(shape)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else "no detail"
