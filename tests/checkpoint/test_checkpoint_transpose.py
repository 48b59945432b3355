"""fp4pass.checkpoint.byte_transpose: the strip-blocked byte transposition equals numpy's plain transpose, byte for
byte (nibbles inside a byte unchanged), for every strip size, ragged last strips and non-contiguous sources."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from fp4pass.checkpoint.byte_transpose import STRIP_ROWS, transpose_bytes, transpose_read


@pytest.mark.parametrize("rows,cols,strip", [(5, 3, 1), (7, 9, 2), (300, 45, 64), (257, 180, STRIP_ROWS),
                                             (513, 11, STRIP_ROWS), (40, 33, 1000), (1, 1, 4)])
def test_equals_numpy_transpose(rows, cols, strip):
    rng = np.random.default_rng(rows * 1000 + cols)
    src = rng.integers(0, 256, (rows, cols), dtype=np.uint8)
    out = np.full((cols, rows), 0xA5, dtype=np.uint8)
    assert transpose_bytes(src, out, strip) is out
    np.testing.assert_array_equal(out, np.ascontiguousarray(src.T))
    assert out[0, rows - 1] == src[rows - 1, 0] and out[cols - 1, 0] == src[0, cols - 1]


def test_nibbles_stay_inside_their_byte():
    src = np.array([[0x21, 0x43, 0x65], [0x87, 0xA9, 0xCB]], dtype=np.uint8)
    out = np.empty((3, 2), dtype=np.uint8)
    transpose_bytes(src, out, strip=1)
    assert out.tolist() == [[0x21, 0x87], [0x43, 0xA9], [0x65, 0xCB]]


def test_strided_source():
    rng = np.random.default_rng(5)
    big = rng.integers(0, 256, (600, 100), dtype=np.uint8)
    src = big[::2, 10:90]  # rows 2 apart, columns offset: not contiguous
    out = np.empty((80, 300), dtype=np.uint8)
    transpose_bytes(src, out, strip=STRIP_ROWS)
    np.testing.assert_array_equal(out, np.ascontiguousarray(src.T))


@pytest.mark.parametrize("src_shape,out_shape,dtype", [((4, 6), (4, 6), np.uint8), ((4, 6), (6, 4), np.int16),
                                                        ((2, 3, 4), (4, 6), np.uint8)])
def test_refuses_wrong_shapes_and_dtypes(src_shape, out_shape, dtype):
    with pytest.raises(ValueError):
        transpose_bytes(np.zeros(src_shape, dtype=dtype), np.zeros(out_shape, dtype=np.uint8))


@pytest.mark.parametrize("rows,strip", [(1000, 64), (513, STRIP_ROWS), (100, STRIP_ROWS), (3, 1), (9, 2)])
def test_split_between_two_threads(rows, strip):
    rng = np.random.default_rng(rows)
    src = rng.integers(0, 256, (rows, 37), dtype=np.uint8)
    out = np.zeros((37, rows), dtype=np.uint8)
    with ThreadPoolExecutor(1) as pool:
        transpose_bytes(src, out, strip, pool=pool)
    np.testing.assert_array_equal(out, np.ascontiguousarray(src.T))


@pytest.mark.parametrize("rows,cols,strip,threads", [(300, 45, 64, 1), (300, 45, 64, 2), (513, 19, STRIP_ROWS, 2),
                                                     (7, 3, 1, 2), (40, 33, 1000, 2), (5, 8, 2, 1)])
def test_transpose_read_from_a_file(tmp_path, rows, cols, strip, threads):
    """The source read strip by strip from a file (at an offset, as a tensor inside a shard)."""
    rng = np.random.default_rng(rows + cols)
    src = rng.integers(0, 256, (rows, cols), dtype=np.uint8)
    path = tmp_path / "src.bin"
    path.write_bytes(b"\x5a" * 13 + src.tobytes() + b"\xc3" * 7)
    calls = []
    with open(path, "rb") as f:
        def read(begin, stop, buffer):
            calls.append((begin, stop))
            assert buffer.shape == (stop - begin, cols)
            f_data = os.pread(f.fileno(), (stop - begin) * cols, 13 + begin * cols)
            buffer[...] = np.frombuffer(f_data, dtype=np.uint8).reshape(stop - begin, cols)

        out = np.full((cols, rows), 0xEE, dtype=np.uint8)
        with ThreadPoolExecutor(1) as pool:
            transpose_read(read, out, strip, pool=pool if threads == 2 else None)
    np.testing.assert_array_equal(out, np.ascontiguousarray(src.T))
    assert sorted(calls)[0][0] == 0 and sum(b - a for a, b in calls) == rows  # every row read once


class _CountingPool(ThreadPoolExecutor):
    """A one-thread pool that counts the work given to it."""

    def __init__(self):
        super().__init__(1)
        self.given = 0
        self.ranges = []  # (begin, end) of the source rows given

    def submit(self, fn, *args, **kwargs):
        self.given += 1
        self.ranges.append(args)
        return super().submit(fn, *args, **kwargs)


def _reader(src):
    def read(begin, stop, buffer):
        buffer[...] = src[begin:stop]
    return read


@pytest.mark.parametrize("rows", [1, 2, 3])
def test_transpose_read_of_one_to_three_rows(rows):
    src = np.arange(rows * 5, dtype=np.uint8).reshape(rows, 5) + 1
    out = np.zeros((5, rows), dtype=np.uint8)
    transpose_read(_reader(src), out, strip=2)
    np.testing.assert_array_equal(out, src.T)


@pytest.mark.parametrize("how", ["bytes", "read"])
def test_a_pool_gets_the_first_half_of_a_tall_source(how):
    rng = np.random.default_rng(9)
    src = rng.integers(0, 256, (4 * STRIP_ROWS + 3, 20), dtype=np.uint8)
    out = np.zeros((20, len(src)), dtype=np.uint8)
    with _CountingPool() as pool:
        if how == "bytes":
            transpose_bytes(src, out, pool=pool)
        else:
            transpose_read(_reader(src), out, pool=pool)
    assert pool.ranges == [(0, 2 * STRIP_ROWS)]  # 4 whole strips and a ragged one: the pool takes the first two
    np.testing.assert_array_equal(out, src.T)


@pytest.mark.parametrize("rows,strip,given", [
    (1, 1, []), (2, 1, [(0, 1)]), (3, 1, [(0, 2)]), (5, 2, [(0, 2)]), (6, 2, [(0, 4)]),
    (STRIP_ROWS, STRIP_ROWS, []), (STRIP_ROWS + 1, STRIP_ROWS, [(0, STRIP_ROWS)]),
])
def test_the_pools_half_is_whole_strips_and_never_all_or_nothing(rows, strip, given):
    """The pool gets the first ceil(strips / 2) whole strips when that leaves rows for this thread, else no
    work at all."""
    src = np.arange(rows * 3, dtype=np.uint8).reshape(rows, 3)
    for how in ("bytes", "read"):
        out = np.zeros((3, rows), dtype=np.uint8)
        with _CountingPool() as pool:
            if how == "bytes":
                transpose_bytes(src, out, strip, pool=pool)
            else:
                transpose_read(_reader(src), out, strip, pool=pool)
        assert pool.ranges == given, how
        np.testing.assert_array_equal(out, src.T)


def test_refusals_say_what_was_expected():
    src = np.zeros((4, 6), dtype=np.uint8)
    with pytest.raises(ValueError, match=r"^transpose_bytes: source \(4, 6\) into \(4, 6\)$"):
        transpose_bytes(src, np.zeros((4, 6), dtype=np.uint8))
    strided = np.zeros((6, 8), dtype=np.uint8)[:, ::2]  # [6, 4], the right shape, not contiguous
    with pytest.raises(ValueError, match=r"^transpose_bytes: uint8 arrays and a C-contiguous output expected$"):
        transpose_bytes(src, strided)
    with pytest.raises(ValueError, match=r"^transpose_bytes: strip 0 < 1$"):
        transpose_bytes(src, np.zeros((6, 4), dtype=np.uint8), strip=0)
    for out in (strided, np.zeros((6, 4), dtype=np.int8), np.zeros(24, dtype=np.uint8)):
        with pytest.raises(ValueError, match=r"^transpose_read: a C-contiguous 2-D uint8 output expected$"):
            transpose_read(_reader(src), out)
    with pytest.raises(ValueError, match=r"^transpose_read: strip 0 < 1$"):
        transpose_read(_reader(src), np.zeros((6, 4), dtype=np.uint8), strip=0)
