"""fp4pass.safetensors.files.ShardWriter: the writeback hints a long shard gives the kernel.

Every WRITEBACK_STEP bytes the writer starts the disk writeback of the bytes written since the last step and drops
the pages of the step before (written by then); the bytes read back are what was written, whichever way they
arrived (one write, parts, a file-to-file copy). The expected calls are spelled out position by position.
"""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest
from safetensors.numpy import load_file

from checkpoint_oracles import require_direct_writes
from fp4pass.safetensors import files as safetensors_io
from fp4pass.safetensors.files import OutputSpec, ShardWriter

STEP = 4096
DONTNEED = os.POSIX_FADV_DONTNEED if hasattr(os, "posix_fadvise") else None
pytestmark = pytest.mark.skipif(DONTNEED is None, reason="no posix_fadvise on this platform")


@pytest.fixture
def fadvise_calls(monkeypatch):
    monkeypatch.setattr(safetensors_io, "WRITEBACK_STEP", STEP)
    calls = []
    real = os.posix_fadvise

    def record(fd, offset, length, advice):
        calls.append((offset, length, advice))
        real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", record)
    return calls


def test_each_step_starts_its_writeback_and_drops_the_step_before(tmp_path, fadvise_calls):
    rng = np.random.default_rng(7)
    t0, t1, t2, t3 = (rng.integers(0, 256, STEP, dtype=np.uint8) for _ in range(4))
    source = tmp_path / "source.bin"
    source.write_bytes(b"x" * 100 + t1.tobytes())  # t1 arrives by a file-to-file copy from offset 100
    specs = [OutputSpec(f"t{i}", "U8", (STEP,)) for i in range(4)] + [OutputSpec("tail", "U8", (10,))]
    writer = ShardWriter(tmp_path / "shard.safetensors", specs)
    with open(tmp_path / "shard.safetensors", "rb") as f:  # the header is written at once (its 8-byte length first)
        header = 8 + int.from_bytes(f.read(8), "little")
    assert 0 < header < STEP and fadvise_calls == []

    writer.write("t0", t0)  # position header + STEP: the first step, nothing before it to drop
    assert fadvise_calls == [(0, header + STEP, DONTNEED)]
    fd = os.open(source, os.O_RDONLY)
    try:
        writer.copy_from("t1", fd, 100, STEP)
    finally:
        os.close(fd)
    writer.write_part("t2", t2[:STEP // 2])  # half a step: no call
    assert len(fadvise_calls) == 3
    writer.write_part("t2", t2[STEP // 2:])
    writer.write("t3", t3)
    writer.write("tail", np.arange(10, dtype=np.uint8))  # 10 bytes: under a step, left to the fsync
    writer.close()

    a, b, c, d = (header + k * STEP for k in range(1, 5))
    assert fadvise_calls == [
        (0, a, DONTNEED),
        (a, b - a, DONTNEED), (0, a, DONTNEED),  # start t1's writeback, drop t0's pages (and the header's)
        (b, c - b, DONTNEED), (a, b - a, DONTNEED),
        (c, d - c, DONTNEED), (b, c - b, DONTNEED),
    ]
    back = load_file(tmp_path / "shard.safetensors")
    for name, want in (("t0", t0), ("t1", t1), ("t2", t2), ("t3", t3), ("tail", np.arange(10, dtype=np.uint8))):
        np.testing.assert_array_equal(back[name], want)


def test_a_short_shard_gives_no_hint(tmp_path, fadvise_calls):
    writer = ShardWriter(tmp_path / "shard.safetensors", [OutputSpec("w", "U8", (STEP // 2,))])
    writer.write("w", np.ones(STEP // 2, dtype=np.uint8))
    writer.close()
    assert fadvise_calls == []


def test_a_refused_hint_changes_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(safetensors_io, "WRITEBACK_STEP", STEP)

    def refuse(fd, offset, length, advice):
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(os, "posix_fadvise", refuse)
    data = [np.full(STEP, i, dtype=np.uint8) for i in range(3)]
    writer = ShardWriter(tmp_path / "shard.safetensors", [OutputSpec(f"t{i}", "U8", (STEP,)) for i in range(3)])
    for i, d in enumerate(data):
        writer.write(f"t{i}", d)
    writer.close()
    back = load_file(tmp_path / "shard.safetensors")
    assert [int(back[f"t{i}"][0]) for i in range(3)] == [0, 1, 2]


def _writer(tmp_path, sizes=(4, 6)):
    return ShardWriter(tmp_path / "shard.safetensors", [OutputSpec(f"t{i}", "U8", (n,)) for i, n in enumerate(sizes)])


def test_tensors_arrive_in_plan_order_only(tmp_path):
    writer = _writer(tmp_path)
    with pytest.raises(RuntimeError, match=r"shard.safetensors: wrote 't1' where the plan has 't0'"):
        writer.write("t1", np.zeros(6, dtype=np.uint8))
    writer.write("t0", np.zeros(4, dtype=np.uint8))
    writer.write("t1", np.zeros(6, dtype=np.uint8))
    with pytest.raises(RuntimeError, match=r"wrote 't1' where the plan has None"):  # past the last tensor
        writer.write_part("t1", np.zeros(1, dtype=np.uint8))
    writer.close()


def test_no_tensor_takes_more_or_fewer_bytes_than_planned(tmp_path):
    writer = _writer(tmp_path)
    with pytest.raises(RuntimeError, match=r"'t0' got more than its 4 bytes"):
        writer.write("t0", np.zeros(5, dtype=np.uint8))
    with pytest.raises(RuntimeError, match=r"'t0' is shorter than its 4 bytes"):
        writer.write("t0", np.zeros(3, dtype=np.uint8))
    writer.abort()


def test_close_names_how_many_tensors_never_came(tmp_path):
    writer = _writer(tmp_path, sizes=(4, 6, 2))
    writer.write("t0", np.zeros(4, dtype=np.uint8))
    with pytest.raises(RuntimeError, match=r"^shard.safetensors: 2 tensors never written$"):
        writer.close()


def test_a_failed_fsync_is_one_line_naming_the_shard(tmp_path, monkeypatch):
    writer = _writer(tmp_path, sizes=(4,))
    writer.write("t0", np.zeros(4, dtype=np.uint8))

    def fail(fd):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fsync", fail)
    with pytest.raises(safetensors_io.CheckpointError, match=r"^shard.safetensors: fsync failed \(Input/output error\)$"):
        writer.close()
    assert writer._fd == -1  # closed all the same


def test_a_copy_must_fill_exactly_its_planned_tensor(tmp_path):
    source = tmp_path / "source.bin"
    source.write_bytes(bytes(range(10)))
    writer = _writer(tmp_path)
    fd = os.open(source, os.O_RDONLY)
    try:
        with pytest.raises(RuntimeError, match=r"copy of 't0' does not fit the plan"):
            writer.copy_from("t0", fd, 0, 5)  # the plan has 4 bytes
        with pytest.raises(RuntimeError, match=r"copy of 't1' does not fit the plan"):
            writer.copy_from("t1", fd, 0, 6)  # not the next tensor
        writer.write_part("t0", np.zeros(2, dtype=np.uint8))
        with pytest.raises(RuntimeError, match=r"copy of 't0' does not fit the plan"):
            writer.copy_from("t0", fd, 0, 4)  # half written already
        writer.write_part("t0", np.zeros(2, dtype=np.uint8))
        writer.copy_from("t1", fd, 3, 6)
    finally:
        os.close(fd)
    writer.close()
    assert load_file(tmp_path / "shard.safetensors")["t1"].tolist() == [3, 4, 5, 6, 7, 8]


@pytest.mark.parametrize("refusal", ["missing", "zero", errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP])
def test_a_copy_the_kernel_will_not_do_goes_through_memory(tmp_path, monkeypatch, refusal):
    """Without copy_file_range (another platform), with a call that copies nothing, or with one refused for
    another file system, the bytes are read and written instead; they arrive the same."""
    payload = bytes(range(256)) * 40
    source = tmp_path / "source.bin"
    source.write_bytes(b"ab" + payload)
    if refusal == "missing":
        monkeypatch.delattr(os, "copy_file_range")
    else:
        def refuse(*args):
            if refusal == "zero":
                return 0
            raise OSError(refusal, os.strerror(refusal))
        monkeypatch.setattr(os, "copy_file_range", refuse)
    writer = _writer(tmp_path, sizes=(len(payload),))
    fd = os.open(source, os.O_RDONLY)
    try:
        writer.copy_from("t0", fd, 2, len(payload))
    finally:
        os.close(fd)
    writer.close()
    assert load_file(tmp_path / "shard.safetensors")["t0"].tobytes() == payload


@pytest.mark.parametrize("trouble,message", [
    ("shrank", r"its source shrank while copied"),  # 8 bytes where the plan expects 10, read through memory
    ("EIO", r"write failed \(Input/output error\)"),  # the kernel's copy fails
])
def test_a_failed_copy_is_one_line_naming_shard_and_tensor(tmp_path, monkeypatch, trouble, message):
    source = tmp_path / "source.bin"
    source.write_bytes(bytes(8))
    if trouble == "shrank":
        monkeypatch.delattr(os, "copy_file_range")
    else:
        def fail(*args):
            raise OSError(errno.EIO, "Input/output error")
        monkeypatch.setattr(os, "copy_file_range", fail)
    writer = _writer(tmp_path, sizes=(10,))
    fd = os.open(source, os.O_RDONLY)
    try:
        with pytest.raises(safetensors_io.CheckpointError, match=rf"^shard.safetensors: tensor 't0': {message}$"):
            writer.copy_from("t0", fd, 0, 10)
    finally:
        os.close(fd)
        writer.abort()


def test_short_kernel_copies_resume_where_they_stopped(tmp_path, monkeypatch):
    """copy_file_range may copy fewer bytes than asked: 1000 at a time here, then nothing (the rest goes through
    memory). The tensor sits between other bytes in its source, and exactly its bytes arrive."""
    payload = np.random.default_rng(3).integers(0, 256, 5000, dtype=np.uint8).tobytes()
    source = tmp_path / "source.bin"
    source.write_bytes(b"head" * 10 + payload + b"tail" * 10)
    real = os.copy_file_range
    calls = []

    def short(src, dst, count, offset_src=None, offset_dst=None):
        calls.append((count, offset_src))
        return real(src, dst, min(count, 1000), offset_src) if len(calls) <= 3 else 0

    monkeypatch.setattr(os, "copy_file_range", short)
    writer = _writer(tmp_path, sizes=(len(payload), 3))
    fd = os.open(source, os.O_RDONLY)
    try:
        writer.copy_from("t0", fd, 40, len(payload))
    finally:
        os.close(fd)
    writer.write("t1", np.array([7, 8, 9], dtype=np.uint8))
    writer.close()
    assert calls == [(5000, 40), (4000, 1040), (3000, 2040), (2000, 3040)]
    back = load_file(tmp_path / "shard.safetensors")
    assert back["t0"].tobytes() == payload and back["t1"].tolist() == [7, 8, 9]


def test_a_copy_must_name_the_next_tensor_even_when_sizes_agree(tmp_path):
    source = tmp_path / "source.bin"
    source.write_bytes(bytes(8))
    writer = _writer(tmp_path, sizes=(4, 4))
    fd = os.open(source, os.O_RDONLY)
    try:
        with pytest.raises(RuntimeError, match=r"copy of 't1' does not fit the plan"):
            writer.copy_from("t1", fd, 0, 4)
        writer.copy_from("t0", fd, 0, 4)
        writer.copy_from("t1", fd, 4, 4)
        with pytest.raises(RuntimeError, match=r"copy of 't1' does not fit the plan"):  # past the last tensor
            writer.copy_from("t1", fd, 4, 4)
    finally:
        os.close(fd)
    writer.close()


@pytest.mark.parametrize("how", ["write", "copy through memory"])
def test_a_failed_write_names_the_shard_and_the_tensor(tmp_path, monkeypatch, how):
    writer = _writer(tmp_path, sizes=(4, 6))
    writer.write("t0", np.zeros(4, dtype=np.uint8))
    source = tmp_path / "source.bin"
    source.write_bytes(bytes(6))

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    fd = os.open(source, os.O_RDONLY)
    try:
        with pytest.raises(safetensors_io.CheckpointError,
                           match=r"^shard.safetensors: tensor 't1': write failed \(No space left on device\)$"):
            if how == "write":
                writer.write("t1", np.zeros(6, dtype=np.uint8))
            else:
                monkeypatch.delattr(os, "copy_file_range")
                writer.copy_from("t1", fd, 0, 6)
    finally:
        os.close(fd)
        writer.abort()


def test_short_writes_resume_where_they_stopped(tmp_path, monkeypatch):
    """os.write may write fewer bytes than given: 1000 at a time here; every byte arrives once, in order."""
    real = os.write
    calls = []

    def short(fd, data):
        calls.append(len(data))
        if len(calls) > 100:
            raise AssertionError("the writer does not advance")
        return real(fd, bytes(data)[:1000])

    monkeypatch.setattr(os, "write", short)
    payload = np.random.default_rng(5).integers(0, 256, 4500, dtype=np.uint8)
    writer = _writer(tmp_path, sizes=(4500,))
    header_calls = len(calls)
    writer.write("t0", payload)
    writer.close()
    assert calls[header_calls:] == [4500, 3500, 2500, 1500, 500]
    np.testing.assert_array_equal(load_file(tmp_path / "shard.safetensors")["t0"], payload)


@pytest.mark.parametrize("name", ["w", "layer.0.w", "a" * 13, "b" * 30])
def test_data_starts_on_an_8_byte_boundary_and_the_shard_is_private_while_written(tmp_path, name):
    """The header is padded with spaces so that the tensors start 8-byte aligned (what safetensors' own writer
    does, so readers can view the bytes in place); until the finished folder gets its final modes, only the
    owner can read a shard."""
    path = tmp_path / "shard.safetensors"
    writer = ShardWriter(path, [OutputSpec(name, "F32", (3,))])
    assert os.stat(path).st_mode & 0o777 == 0o600
    writer.write(name, np.array([1.5, -2.0, 3.25], dtype=np.float32))
    writer.close()
    raw = path.read_bytes()
    header_len = int.from_bytes(raw[:8], "little")
    assert (8 + header_len) % 8 == 0 and raw[8:8 + header_len].rstrip(b" ").endswith(b"}")
    assert load_file(path)[name].tolist() == [1.5, -2.0, 3.25]


@pytest.mark.parametrize("refusal", [errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS])
def test_a_file_system_without_preallocation_is_written_all_the_same(tmp_path, monkeypatch, refusal):
    asked = []

    def refuse(fd, offset, length):
        asked.append((offset, length))
        raise OSError(refusal, os.strerror(refusal))

    monkeypatch.setattr(os, "posix_fallocate", refuse)
    writer = _writer(tmp_path, sizes=(4, 6))
    writer.write("t0", np.arange(4, dtype=np.uint8))
    writer.write("t1", np.arange(6, dtype=np.uint8))
    writer.close()
    size = (tmp_path / "shard.safetensors").stat().st_size
    assert asked == [(0, size)]  # the whole shard, header included, was asked for at once
    assert load_file(tmp_path / "shard.safetensors")["t1"].tolist() == list(range(6))


def test_no_room_for_the_shard_is_one_line_before_any_byte(tmp_path, monkeypatch):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    writes = []
    monkeypatch.setattr(os, "write", lambda fd, data: writes.append(len(data)) or len(data))
    open_before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(safetensors_io.CheckpointError) as info:
        _writer(tmp_path, sizes=(4, 6, 2))
    assert len(os.listdir("/proc/self/fd")) == open_before  # the shard's file was closed
    size_asked = int(str(info.value).split("no room for ")[1].split(" bytes")[0])
    assert str(info.value) == (f"shard.safetensors: tensor 't0' and the 2 after it: no room for {size_asked} bytes "
                               "(No space left on device)")
    assert (size_asked - 12) % 8 == 0 and size_asked > 12 and writes == []  # header + the 12 bytes


BLOCK = safetensors_io.DIRECT_ALIGN


@pytest.fixture
def takes_direct(tmp_path):
    require_direct_writes(tmp_path)


@pytest.fixture
def direct_writes(monkeypatch, takes_direct):
    """The byte counts written past the page cache (``os.pwrite`` is used for nothing else)."""
    sizes = []
    real = os.pwrite

    def spy(fd, data, offset):
        sizes.append(len(data))
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", spy)
    return sizes


def _payloads(sizes, seed=11):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]


def test_aligned_view_puts_its_first_byte_at_the_phase_asked(tmp_path):
    backing = np.empty(3 * BLOCK + BLOCK, dtype=np.uint8)
    for phase in (0, 1, 100, BLOCK - 1):
        view = safetensors_io.aligned_view(backing, 3 * BLOCK, phase)
        assert len(view) == 3 * BLOCK and view.ctypes.data % BLOCK == phase
        assert backing.ctypes.data <= view.ctypes.data
        assert view.ctypes.data + len(view) <= backing.ctypes.data + len(backing)
    with pytest.raises(ValueError, match="need a uint8 backing"):
        safetensors_io.aligned_view(backing, 3 * BLOCK + 1, 0)


@pytest.mark.parametrize("sizes", [(3 * BLOCK + 123, 5 * BLOCK, 2 * BLOCK + 1, 7), (9 * BLOCK - 5, 4 * BLOCK + 77)])
def test_buffers_placed_as_in_the_file_go_to_the_disk_directly_and_arrive_whole(tmp_path, direct_writes, sizes):
    """Parts written from :func:`aligned_view` buffers at their file phase: their whole blocks go past the page
    cache, the head and tail bytes through it, and the file holds every byte where the header says."""
    payloads = _payloads(sizes)
    names = [f"t{i}" for i in range(len(sizes))]
    specs = [OutputSpec(n, "U8", (len(p),)) for n, p in zip(names, payloads)]
    writer = ShardWriter(tmp_path / "shard.safetensors", specs)
    expected_direct = 0
    for name, payload in zip(names, payloads):
        half = len(payload) // 2
        for begin, stop in ((0, half), (half, len(payload))):  # two parts each, the second at another phase
            phase = (writer.file_offset(name) + begin) % BLOCK
            buf = safetensors_io.aligned_view(np.empty(stop - begin + BLOCK, dtype=np.uint8), stop - begin, phase)
            buf[:] = payload[begin:stop]
            if len(buf) >= 2 * BLOCK:
                expected_direct += (len(buf) - (-phase % BLOCK)) // BLOCK * BLOCK
            writer.write_part(name, buf)
    writer.close()
    assert sum(direct_writes) == expected_direct and expected_direct > 0
    back = load_file(tmp_path / "shard.safetensors")
    for name, payload in zip(names, payloads):
        np.testing.assert_array_equal(back[name], payload)


def test_buffers_out_of_phase_go_through_the_page_cache(tmp_path, direct_writes):
    (payload,) = _payloads([6 * BLOCK])
    open_before = len(os.listdir("/proc/self/fd"))
    writer = ShardWriter(tmp_path / "shard.safetensors", [OutputSpec("t", "U8", (len(payload),))])
    phase = (writer.file_offset("t") + 1) % BLOCK  # one byte off
    buf = safetensors_io.aligned_view(np.empty(len(payload) + BLOCK, dtype=np.uint8), len(payload), phase)
    buf[:] = payload
    writer.write("t", buf)
    assert len(os.listdir("/proc/self/fd")) == open_before + 2  # the shard, for buffered and for direct writes
    writer.close()
    assert len(os.listdir("/proc/self/fd")) == open_before and direct_writes == []
    np.testing.assert_array_equal(load_file(tmp_path / "shard.safetensors")["t"], payload)


@pytest.mark.parametrize("how", ["refused", "no O_DIRECT"])
def test_without_direct_writes_every_byte_goes_through_the_page_cache(tmp_path, monkeypatch, takes_direct, how):
    """A file system that refuses O_DIRECT writes (EINVAL at the first one) or a platform without them: the same
    bytes, all through the page cache, and no second try for the later tensors of the shard."""
    tries = []

    def refuse(fd, data, offset):
        tries.append(len(data))
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(os, "pwrite", refuse)
    if how == "no O_DIRECT":
        monkeypatch.delattr(os, "O_DIRECT", raising=False)
    payloads = _payloads([4 * BLOCK + 9, 3 * BLOCK])
    writer = ShardWriter(tmp_path / "shard.safetensors", [OutputSpec(f"t{i}", "U8", (len(p),))
                                                          for i, p in enumerate(payloads)])
    for i, payload in enumerate(payloads):
        phase = writer.file_offset(f"t{i}") % BLOCK
        buf = safetensors_io.aligned_view(np.empty(len(payload) + BLOCK, dtype=np.uint8), len(payload), phase)
        buf[:] = payload
        writer.write(f"t{i}", buf)
    writer.close()
    assert len(tries) == (1 if how == "refused" else 0)
    back = load_file(tmp_path / "shard.safetensors")
    for i, payload in enumerate(payloads):
        np.testing.assert_array_equal(back[f"t{i}"], payload)


def test_a_failed_direct_write_names_the_shard_and_the_tensor(tmp_path, monkeypatch, takes_direct):
    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    writer = ShardWriter(tmp_path / "shard.safetensors", [OutputSpec("big", "U8", (4 * BLOCK,))])
    phase = writer.file_offset("big") % BLOCK
    buf = safetensors_io.aligned_view(np.zeros(5 * BLOCK, dtype=np.uint8), 4 * BLOCK, phase)
    with pytest.raises(safetensors_io.CheckpointError,
                       match=r"^shard.safetensors: tensor 'big': write failed \(No space left on device\)$"):
        writer.write("big", buf)
    writer.abort()
