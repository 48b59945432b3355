"""fp4pass.checkpoint.safetensors_io.ShardWriter: the writeback hints a long shard gives the kernel.

Every WRITEBACK_STEP bytes the writer starts the disk writeback of the bytes written since the last step and drops
the pages of the step before (written by then); the bytes read back are what was written, whichever way they
arrived (one write, parts, a file-to-file copy). The expected calls are spelled out position by position.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from safetensors.numpy import load_file

from fp4pass.checkpoint import safetensors_io
from fp4pass.checkpoint.safetensors_io import OutputSpec, ShardWriter

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
