"""Transposing a uint8 matrix [R, C] -> [C, R] into a preallocated output, cache-blocked.

ModelOpt's gpt-oss layout stores each expert's packed codes [N, K/2] as [K/2, N] and its E4M3 block scales
[N, K/16] as [K/16, N]: out[c, r] = src[r, c] byte for byte. The transposition moves whole bytes, so the two
E2M1 codes inside a byte stay as they are (even element in the low nibble).

numpy's plain ``np.copyto(out, src.T)`` walks the output row by row and reads the source with a stride of C
bytes; for a matrix of megabytes every read then touches a new cache line, and it runs at well under 1 GB/s.
Copying strips of :data:`STRIP_ROWS` source rows (out[:, i:i+b] = src[i:i+b].T) keeps the b source lines
that one output row reads in L1/L2 while the C output rows are filled, a few times faster on the shapes of
gpt-oss (N = 5760, K/2 = 1440). numpy releases the GIL in the copy, so :func:`transpose_bytes` can run in a
worker thread beside the file writes, and
split between two threads (``pool``).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor

import numpy as np

__all__ = ["transpose_bytes", "transpose_read", "STRIP_ROWS"]

STRIP_ROWS = 256  # 256 source lines of 64 bytes: 16 KiB, inside L1 beside the output's lines


def _strips(src: np.ndarray, out: np.ndarray, begin: int, end: int, strip: int) -> None:
    for i in range(begin, end, strip):
        stop = min(i + strip, end)
        np.copyto(out[:, i:stop], src[i:stop].T)


def transpose_bytes(src: np.ndarray, out: np.ndarray, strip: int = STRIP_ROWS, pool: Executor | None = None
                    ) -> np.ndarray:
    """``out[c, r] = src[r, c]`` for a 2-D uint8 ``src`` [R, C] and a C-contiguous uint8 ``out`` [C, R]; ``out``.

    With ``pool``, the first half of the source rows (whole strips) is transposed there while this thread does
    the second: the two write disjoint column ranges of ``out``.
    """
    if src.ndim != 2 or out.shape != (src.shape[1], src.shape[0]):
        raise ValueError(f"transpose_bytes: source {src.shape} into {out.shape}")
    if src.dtype != np.uint8 or out.dtype != np.uint8 or not out.flags.c_contiguous:
        raise ValueError("transpose_bytes: uint8 arrays and a C-contiguous output expected")
    rows = src.shape[0]
    if strip < 1:
        raise ValueError(f"transpose_bytes: strip {strip} < 1")
    _in_halves(lambda begin, end: _strips(src, out, begin, end, strip), rows, strip, pool)
    return out


def _read_strips(read: Callable[[int, int, np.ndarray], None], out: np.ndarray, begin: int, end: int,
                 strip: int) -> None:
    staging = np.empty((min(strip, end - begin), out.shape[0]), dtype=np.uint8)
    for i in range(begin, end, strip):
        stop = min(i + strip, end)
        rows = staging[:stop - i]
        read(i, stop, rows)
        np.copyto(out[:, i:stop], rows.T)


def transpose_read(read: Callable[[int, int, np.ndarray], None], out: np.ndarray, strip: int = STRIP_ROWS,
                   pool: Executor | None = None) -> np.ndarray:
    """:func:`transpose_bytes` of a source [R, C] that is not in memory: ``read(begin, stop, rows)`` fills the
    C-contiguous uint8 ``rows`` [stop - begin, C] with source rows begin..stop-1 (a file read).

    Each strip is read into a small buffer of its own (one per thread, a few hundred KiB) and transposed while
    it is still in the cache, so the source crosses main memory once instead of three times (read into a whole
    buffer, then read back strided). With ``pool``, the first half of the rows is read and transposed there.
    """
    if out.ndim != 2 or out.dtype != np.uint8 or not out.flags.c_contiguous:
        raise ValueError("transpose_read: a C-contiguous 2-D uint8 output expected")
    if strip < 1:
        raise ValueError(f"transpose_read: strip {strip} < 1")
    rows = out.shape[1]
    if rows == 0:
        return out
    _in_halves(lambda begin, end: _read_strips(read, out, begin, end, strip), rows, strip, pool)
    return out


def _in_halves(work: Callable[[int, int], None], rows: int, strip: int, pool: Executor | None) -> None:
    """``work(0, rows)``; with ``pool``, as two halves cut at a strip boundary, the first one in the pool."""
    half = (rows // strip + 1) // 2 * strip if pool is not None else 0
    if not 0 < half < rows:
        work(0, rows)
        return
    first = pool.submit(work, 0, half)
    try:
        work(half, rows)
    finally:
        first.result()
