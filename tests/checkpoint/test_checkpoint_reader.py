"""fp4pass.safetensors.files.SafetensorsFile: the shard reader refuses, in one line naming the shard and
the tensor, every header that does not describe its file; it reads a good one as safetensors itself does.

The files are written here byte by byte (an 8-byte little-endian length, the JSON header, the data), so each
test states exactly what is on disk; safetensors' own writer is the oracle for the good file.
"""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest
from safetensors.numpy import save_file

from fp4pass.safetensors.files import MAX_HEADER, CheckpointError, SafetensorsFile


def shard(path, header, data: bytes = b"", length: int | None = None, raw: bytes | None = None):
    text = raw if raw is not None else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text) if length is None else length) + text + data)
    return path


def refused(path, message: str) -> None:
    with pytest.raises(CheckpointError) as info:
        SafetensorsFile(path)
    assert str(info.value) == f"{path.name}: {message}"


def u8(begin, end, shape=None):
    return {"dtype": "U8", "shape": [end - begin] if shape is None else shape, "data_offsets": [begin, end]}


def test_a_good_file_reads_as_safetensors_wrote_it(tmp_path):
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.array([7, 8, 9], dtype=np.uint8)
    save_file({"a": a, "b": b}, str(tmp_path / "good.safetensors"), metadata={"format": "pt"})
    with SafetensorsFile(tmp_path / "good.safetensors") as f:
        assert f.metadata == {"format": "pt"}
        assert f.entries["a"].shape == (2, 3) and f.entries["a"].dtype == "F32"
        assert f.entries["a"].end - f.entries["a"].begin == 24 and f.entries["b"].end - f.entries["b"].begin == 3
        assert f.read("a").numpy().tolist() == a.tolist() and f.read("b").numpy().tolist() == [7, 8, 9]
        view = np.zeros(2, dtype=np.uint8)
        f.read_bytes("b", 1, view)
        assert view.tolist() == [8, 9]
        with pytest.raises(ValueError, match=r"^b: bytes 2\.\.4 of 3$"):
            f.read_bytes("b", 2, np.zeros(2, dtype=np.uint8))
        with pytest.raises(ValueError, match=r"^b: bytes -1\.\.1 of 3$"):
            f.read_bytes("b", -1, np.zeros(2, dtype=np.uint8))
    f.close()  # closed already by the with: a second close is harmless


@pytest.mark.parametrize("extra", [{}, {"__metadata__": None}])
def test_no_metadata_or_null_is_an_empty_one(tmp_path, extra):
    header = {**extra, "t": u8(0, 2)}
    with SafetensorsFile(shard(tmp_path / "s.safetensors", header, b"\x01\x02")) as f:
        assert f.metadata == {} and f.entries["t"].begin == 8 + len(json.dumps(header))
        assert f.read("t").numpy().tolist() == [1, 2]


def test_file_level_refusals(tmp_path):
    path = tmp_path / "s.safetensors"
    path.write_bytes(b"\x05\x00\x00\x00\x00")
    refused(path, "not a safetensors file (5 bytes, shorter than the 8-byte header length)")
    shard(path, {}, length=MAX_HEADER + 1)
    refused(path, f"header length {MAX_HEADER + 1} is over the {MAX_HEADER}-byte limit: not a safetensors file")
    shard(path, {}, raw=b"{}", length=50)
    refused(path, "truncated: the header says 50 bytes, the file has 2 after the length")
    shard(path, None, raw=b"[1, 2]")
    refused(path, "header is not a JSON object")
    shard(path, {"__metadata__": ["a"]})
    refused(path, "__metadata__ is not an object")
    shard(path, {"__metadata__": []})
    refused(path, "__metadata__ is not an object")
    missing = tmp_path / "missing.safetensors"
    with pytest.raises(CheckpointError) as info:
        SafetensorsFile(missing)
    assert str(info.value) == f"{missing}: no such file"


@pytest.mark.parametrize("raw,why", [(b'{"t": ', "Expecting value"), (b'{"t": 1, "t": 2}', "duplicate key 't'"),
                                     (b'{"\xff": 1}', "invalid start byte")])
def test_a_header_that_is_not_json(tmp_path, raw, why):
    path = shard(tmp_path / "s.safetensors", None, raw=raw)
    with pytest.raises(CheckpointError, match=rf"^s.safetensors: header is not valid JSON \(.*{why}"):
        SafetensorsFile(path)


@pytest.mark.parametrize("info,message", [
    ([1], "header entry is not an object"),
    ({"dtype": "Q8", "shape": [2], "data_offsets": [0, 2]}, "unknown dtype 'Q8'"),
    ({"dtype": None, "shape": [2], "data_offsets": [0, 2]}, "unknown dtype None"),
    ({"dtype": "U8", "shape": 2, "data_offsets": [0, 2]}, "shape 2 is not a list of non-negative integers"),
    ({"dtype": "U8", "shape": [-2], "data_offsets": [0, 2]}, "shape [-2] is not a list of non-negative integers"),
    ({"dtype": "U8", "shape": [True, 2], "data_offsets": [0, 2]},
     "shape [True, 2] is not a list of non-negative integers"),
    ({"dtype": "U8", "shape": [2.0], "data_offsets": [0, 2]}, "shape [2.0] is not a list of non-negative integers"),
    ({"dtype": "U8", "shape": [2], "data_offsets": "0,2"}, "data_offsets '0,2' are not [begin, end] with begin <= end"),
    ({"dtype": "U8", "shape": [2], "data_offsets": [0, 2, 4]},
     "data_offsets [0, 2, 4] are not [begin, end] with begin <= end"),
    ({"dtype": "U8", "shape": [2], "data_offsets": [0]}, "data_offsets [0] are not [begin, end] with begin <= end"),
    ({"dtype": "U8", "shape": [2], "data_offsets": [-1, 1]},
     "data_offsets [-1, 1] are not [begin, end] with begin <= end"),
    ({"dtype": "U8", "shape": [0], "data_offsets": [2, 1]},
     "data_offsets [2, 1] are not [begin, end] with begin <= end"),
    ({"dtype": "U8", "shape": [2], "data_offsets": [False, 2]},
     "data_offsets [False, 2] are not [begin, end] with begin <= end"),
    ({"dtype": "F32", "shape": [2], "data_offsets": [0, 2]},
     "data_offsets span 2 bytes, but F32 [2] needs 8: the header lies"),
    ({"dtype": "U8", "shape": [3], "data_offsets": [0, 2]}, "data_offsets span 2 bytes, but U8 [3] needs 3: the header lies"),
])
def test_an_entry_that_does_not_describe_its_tensor(tmp_path, info, message):
    refused(shard(tmp_path / "s.safetensors", {"t": info}, b"\x00\x00"), f"tensor 't': {message}")


def test_offsets_must_tile_the_data_exactly(tmp_path):
    path = tmp_path / "s.safetensors"
    refused(shard(path, {"a": u8(0, 4), "b": u8(2, 6)}, bytes(6)),
            "tensor 'b': data_offsets overlaps the tensor before it: the header does not describe the file")
    refused(shard(path, {"a": u8(0, 2), "b": u8(5, 6)}, bytes(6)),
            "tensor 'b': data_offsets leaves a gap of 3 bytes: the header does not describe the file")
    refused(shard(path, {"a": u8(1, 2)}, bytes(2)),
            "tensor 'a': data_offsets leaves a gap of 1 bytes: the header does not describe the file")
    refused(shard(path, {"b": u8(4, 9), "a": u8(0, 4)}, bytes(7)),
            "tensor 'b': truncated: its data ends at byte {}, the file has {}".format(
                8 + len(json.dumps({"b": u8(4, 9), "a": u8(0, 4)})) + 9,
                8 + len(json.dumps({"b": u8(4, 9), "a": u8(0, 4)})) + 7))
    refused(shard(path, {"a": u8(0, 4)}, bytes(7)),
            "3 bytes after the last tensor: the header does not describe the file")
    with SafetensorsFile(shard(path, {"b": u8(4, 6), "a": u8(0, 4)}, bytes(range(6)))) as f:  # any order in the header
        assert f.read("b").numpy().tolist() == [4, 5] and f.read("a").numpy().tolist() == [0, 1, 2, 3]


def test_a_file_that_shrinks_while_read_is_one_line(tmp_path):
    path = shard(tmp_path / "s.safetensors", {"t": u8(0, 6)}, bytes(6))
    with SafetensorsFile(path) as f:
        os.truncate(path, os.path.getsize(path) - 4)
        with pytest.raises(CheckpointError, match=r"^s.safetensors: changed since its header was read \(74 bytes "
                                                  r"then, 70 now, or another file\): the file shrank"):
            f.read("t")


def test_a_file_that_shrinks_during_a_read_is_one_line(tmp_path, monkeypatch):
    path = shard(tmp_path / "s.safetensors", {"t": u8(0, 6)}, bytes(6))
    monkeypatch.setattr(os, "preadv", lambda fd, buffers, offset: 0)
    with SafetensorsFile(path) as f:
        with pytest.raises(CheckpointError, match=r"^s.safetensors: tensor 't': truncated while reading \(the file "
                                                  r"shrank\)$"):
            f.read("t")


def test_a_refused_file_is_closed(tmp_path):
    path = shard(tmp_path / "s.safetensors", {"t": u8(0, 2)}, bytes(3))
    before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(CheckpointError):
        SafetensorsFile(path)
    assert len(os.listdir("/proc/self/fd")) == before


def test_read_into_a_buffer_of_its_bytes_and_a_scalar(tmp_path):
    import torch

    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    save_file({"a": a, "s": np.array(2.5, dtype=np.float32)}, str(tmp_path / "g.safetensors"))
    with SafetensorsFile(tmp_path / "g.safetensors") as f:
        flat = torch.zeros(24, dtype=torch.uint8)  # the right bytes, another dtype and shape: viewed back
        got = f.read("a", out=flat)
        assert got.shape == (2, 3) and got.dtype == torch.float32 and got.tolist() == a.tolist()
        scalar = f.read("s")
        assert scalar.shape == () and float(scalar) == 2.5
        with pytest.raises(ValueError, match=r"^a: buffer of 20 bytes for 24$"):
            f.read("a", out=torch.zeros(5, dtype=torch.float32))
        with pytest.raises(ValueError, match=r"^a: buffer of 24 bytes for 24$"):
            f.read("a", out=torch.zeros(3, 2, dtype=torch.float32).t())  # not contiguous


def test_short_reads_resume_where_they_stopped(tmp_path, monkeypatch):
    payload = bytes(range(200, 250))
    path = shard(tmp_path / "s.safetensors", {"x": u8(0, 7), "t": u8(7, 57)}, b"\xee" * 7 + payload)
    real = os.preadv
    offsets = []

    def short(fd, buffers, offset):
        offsets.append(offset)
        (buf,) = buffers
        return real(fd, [memoryview(buf)[:16]], offset)

    monkeypatch.setattr(os, "preadv", short)
    with SafetensorsFile(path) as f:
        assert f.read("t").numpy().tobytes() == payload
        start = f.entries["t"].begin
    assert offsets == [start, start + 16, start + 32, start + 48]


def test_a_failed_read_is_one_line(tmp_path, monkeypatch):
    path = shard(tmp_path / "s.safetensors", {"t": u8(0, 4)}, bytes(4))

    def fail(fd, buffers, offset):
        raise OSError(5, "Input/output error")

    with SafetensorsFile(path) as f:
        monkeypatch.setattr(os, "preadv", fail)
        with pytest.raises(CheckpointError, match=r"^s.safetensors: tensor 't': read failed \(Input/output error\)$"):
            f.read("t")


def test_a_header_listing_more_tensors_than_its_data_can_hold_is_refused_before_parsing(tmp_path, monkeypatch):
    """A 99 MB header listing 1.5 million empty tensors took a minute and gigabytes: the count is capped by the
    size of the data area (TENSORS_FREE, and one per BYTES_PER_TENSOR bytes), on the raw header before the
    JSON is parsed, and on the parsed header (the slots told apart: 100 free, 16 bytes per tensor)."""
    from fp4pass.safetensors import files as safetensors_io

    monkeypatch.setattr(safetensors_io, "TENSORS_FREE", 100)
    assert safetensors_io.max_tensors(160) == 110
    path = tmp_path / "s.safetensors"
    empty = {"dtype": "U8", "shape": [0], "data_offsets": [160, 160]}
    listed = {f"t{i}": empty for i in range(109)} | {"data": u8(0, 160)}
    shard(path, listed, bytes(160))
    with SafetensorsFile(path) as f:
        assert len(f.entries) == 110
    shard(path, listed | {"t109": empty}, bytes(160))
    parsed = []
    real = safetensors_io.strict_json
    monkeypatch.setattr(safetensors_io, "strict_json", lambda raw: parsed.append(raw) or real(raw))
    with pytest.raises(CheckpointError, match=r"^s.safetensors: the header lists 111 tensors, more than 160 bytes"):
        SafetensorsFile(path)
    shard(path, listed | {f"x{i}": empty for i in range(200)}, bytes(160))
    parsed.clear()
    with pytest.raises(CheckpointError, match=r"^s.safetensors: the header lists more than 110 tensors, more than "
                                              r"160 bytes of data hold \(100, and one per 16 bytes beyond\)$"):
        SafetensorsFile(path)
    assert parsed == []  # refused before the parse


def test_a_million_empty_tensors_are_refused_in_a_second(tmp_path):
    import time

    path = tmp_path / "s.safetensors"
    text = b"{" + b",".join(b'"t%d":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}' % i for i in range(1_000_000)) + b"}"
    path.write_bytes(struct.pack("<Q", len(text)) + text)
    start = time.perf_counter()
    with pytest.raises(CheckpointError, match="the header lists more than 65536 tensors"):
        SafetensorsFile(path)
    assert time.perf_counter() - start < 5.0


@pytest.mark.parametrize("raw, why", [
    (b'{"t": {"dtype": "U8", "shape": [NaN], "data_offsets": [0, 0]}}', "NaN is not a JSON number"),
    (b'{"t\\ud800": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}}', "lone surrogate"),
    (b'{"__metadata__": {"k": "\\udfff"}}', "lone surrogate")])
def test_what_no_json_writer_writes_back_is_refused(tmp_path, raw, why):
    path = shard(tmp_path / "s.safetensors", None, raw=raw)
    with pytest.raises(CheckpointError, match=why):
        SafetensorsFile(path)
