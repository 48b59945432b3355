"""Damaged or hostile .npz files given to ``calibrate --data``, ``convert --calib`` and ``diff --inputs``: one line,
exit 2, nothing written, never a hang; arrays refused from their .npy header before their data is inflated.

The archives are damaged with the zip format's own fields (local header: flags at byte 6, method at 8;
central directory: flags at 8, method at 10), independently of the reader under test."""

from __future__ import annotations

import io
import os
import shutil
import struct
import threading
import zipfile
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnx_builders as B
from fp4pass.onnx.calibrate import CalibrationDataError, iter_feeds
from cli_helpers import cli, one_line
from fp4pass.errors import UsageError
from fp4pass.npz import read_npz

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "models"
X = np.random.default_rng(5).standard_normal((4, 64)).astype(np.float32)


def good_npz(path: Path, compressed: bool = False) -> Path:
    (np.savez_compressed if compressed else np.savez)(path, x=X)
    return path


def patch_headers(path: Path, *, flags: int | None = None, method: int | None = None) -> None:
    """Set the general-purpose flags and/or the compression method of every member, in both headers."""
    data = bytearray(path.read_bytes())
    for signature, flag_at, method_at in ((b"PK\x03\x04", 6, 8), (b"PK\x01\x02", 8, 10)):
        start = 0
        while (at := data.find(signature, start)) >= 0:
            if flags is not None:
                data[at + flag_at:at + flag_at + 2] = struct.pack("<H", flags)
            if method is not None:
                data[at + method_at:at + method_at + 2] = struct.pack("<H", method)
            start = at + 4
    path.write_bytes(bytes(data))


def npy_header(shape, dtype="<f4") -> bytes:
    """A version 1.0 .npy header, written by hand (the format: magic, version, little-endian length, dict)."""
    text = f"{{'descr': '{dtype}', 'fortran_order': False, 'shape': {tuple(shape)!r}, }}"
    text += " " * (63 - (len(text) + 10) % 64) + "\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(text)) + text.encode()


def damage(kind: str, path: Path) -> Path:
    good_npz(path, compressed=kind in ("bad_crc_deflated",))
    raw = path.read_bytes()
    if kind == "truncated":
        path.write_bytes(raw[: len(raw) // 2])
    elif kind == "zero_bytes":
        path.write_bytes(b"")
    elif kind in ("bad_crc", "bad_crc_deflated"):
        data = bytearray(raw)
        header_end = raw.index(b"\n", raw.index(b"NUMPY")) + 1 if kind == "bad_crc" else len(raw) // 3
        data[header_end + 5] ^= 0x40
        path.write_bytes(bytes(data))
    elif kind == "encrypted":
        patch_headers(path, flags=0x1)
    elif kind == "deflate64":
        patch_headers(path, method=9)
    elif kind == "empty":
        with zipfile.ZipFile(path, "w"):
            pass
    elif kind == "plain_npy":
        with open(path, "wb") as f:
            np.save(f, X)
    elif kind == "object_array":
        with zipfile.ZipFile(path, "w") as archive:
            archive.writestr("x.npy", npy_header((4, 64), "|O") + b"\x00" * 16)
    elif kind == "header_lies_about_size":
        with zipfile.ZipFile(path, "w") as archive:  # right rank, 2^40 elements claimed, 16 bytes held
            archive.writestr("x.npy", npy_header((2**34, 64)) + b"\x00" * 16)
    elif kind == "duplicate_member":
        with zipfile.ZipFile(path, "w") as archive, pytest.warns(UserWarning):
            archive.writestr("x.npy", raw_npy(X))
            archive.writestr("x.npy", raw_npy(X * 2))
    elif kind == "dev_zero":
        path.unlink()
        path.symlink_to("/dev/zero")
    else:
        raise AssertionError(kind)
    return path


def raw_npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


KINDS = {
    "truncated": "not a readable .npz",
    "zero_bytes": "not a readable .npz",
    "bad_crc": "Bad CRC-32",
    "bad_crc_deflated": "not a readable .npz",
    "encrypted": "is encrypted",
    "deflate64": "compressed with deflate64",
    "empty": "holds no arrays",
    "plain_npy": "a plain .npy array",
    "object_array": "Python objects",
    "header_lies_about_size": "the file is damaged",
    "duplicate_member": "appears twice",
    "dev_zero": "only regular .npz files",
}


@pytest.fixture
def work(tmp_path):
    shutil.copy(MODELS / "tiny_mlp.onnx", tmp_path / "m.onnx")
    return tmp_path


def test_the_undamaged_file_is_read_by_every_command(work, capsys):
    """The control: each case below damages this very file."""
    data = good_npz(work / "d.npz")
    assert cli(capsys, "calibrate", work / "m.onnx", "--data", data, "-o", work / "s.json", "--quiet")[0] == 0
    assert cli(capsys, "diff", work / "m.onnx", work / "m.onnx", "--inputs", data, "--quiet")[0] == 0
    arrays, skipped = read_npz(data, error=UsageError)
    assert skipped == [] and np.array_equal(arrays["x"], X) and arrays["x"].flags.writeable


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_damaged_npz_is_one_line_and_exit_2_in_calibrate(work, capsys, kind):
    data = damage(kind, work / "d.npz")
    code, err = cli(capsys, "calibrate", work / "m.onnx", "--data", data, "-o", work / "s.json", "--quiet")
    assert code == 2, err
    line = one_line(err)
    assert "d.npz" in line and KINDS[kind] in line, line
    assert not (work / "s.json").exists()


@pytest.mark.parametrize("kind", ["truncated", "encrypted", "deflate64", "plain_npy", "empty"])
def test_a_damaged_npz_is_one_line_and_exit_2_in_convert_calib(work, capsys, kind):
    data = damage(kind, work / "d.npz")
    code, err = cli(capsys, "convert", work / "m.onnx", "-o", work / "o.onnx", "--calib", data, "--quiet")
    assert code == 2, err
    assert KINDS[kind] in one_line(err)
    assert not (work / "o.onnx").exists()


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_damaged_npz_is_one_line_and_exit_2_in_diff(work, capsys, kind):
    data = damage(kind, work / "d.npz")
    code, err = cli(capsys, "diff", work / "m.onnx", work / "m.onnx", "--inputs", data, "--quiet")
    assert code == 2, err
    assert KINDS[kind] in one_line(err)


def test_an_array_of_the_wrong_rank_is_refused_from_its_header(tmp_path, monkeypatch):
    """The header claims 2^32 float32 (16 GiB) of rank 1; the graph input is rank 2. Refused naming both ranks,
    and nothing of that size is allocated (numpy's allocator is never asked for more than a header's worth)."""
    path = tmp_path / "d.npz"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("x.npy", npy_header((2**32,)) + b"\x00" * 64)
    model = onnx_ir_model()
    inputs = {v.name: v for v in model.graph.inputs}
    requested = []
    real = np.frombuffer
    monkeypatch.setattr(np, "frombuffer", lambda *a, **k: requested.append(a) or real(*a, **k))
    with pytest.raises(CalibrationDataError, match=r"rank 1 \[4294967296\], graph input wants rank 2"):
        list(iter_feeds(path, inputs))
    assert requested == []


def onnx_ir_model():
    import onnx_ir as ir

    return ir.load(str(MODELS / "tiny_mlp.onnx"))


def test_arrays_that_are_not_inputs_are_never_inflated(tmp_path, caplog):
    """An extra member whose data is damaged does not matter: it is named in a warning, not read."""
    path = tmp_path / "d.npz"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("x.npy", raw_npy(X))
        archive.writestr("junk.npy", npy_header((2**34, 64)) + b"\x00")
    (where, feed), = list(iter_feeds(path, {v.name: v for v in onnx_ir_model().graph.inputs}))
    assert np.array_equal(feed["x"], X)
    assert "junk" in caplog.text and "not graph inputs" in caplog.text


def test_fortran_order_arrays_read_back_the_same(tmp_path):
    np.savez(tmp_path / "f.npz", x=np.asfortranarray(X), y=X.astype(np.float16)[:, :3])
    arrays, _ = read_npz(tmp_path / "f.npz", error=UsageError)
    assert np.array_equal(arrays["x"], X) and np.array_equal(arrays["y"], X.astype(np.float16)[:, :3])


# -- folders ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("special", ["fifo", "dev_zero", "dir"])
def test_a_special_file_among_the_data_folder_is_refused_without_blocking(work, capsys, special):
    """A FIFO named b.npz used to block calibrate forever. It is refused from its type before any file is
    read; the run happens in a thread, and the FIFO is opened for writing afterwards so that a regression
    fails this test instead of hanging the suite."""
    folder = work / "data"
    folder.mkdir()
    good_npz(folder / "a.npz")
    odd = folder / "b.npz"
    if special == "fifo":
        os.mkfifo(odd)
    elif special == "dir":
        odd.mkdir()
    else:
        odd.symlink_to("/dev/zero")
    result = {}
    thread = threading.Thread(target=lambda: result.update(code=cli(capsys, "calibrate", work / "m.onnx", "--data",
                                                                    folder, "-o", work / "s.json", "--quiet")))
    thread.start()
    thread.join(60)
    if thread.is_alive() and special == "fifo":
        os.close(os.open(odd, os.O_WRONLY | os.O_NONBLOCK))  # unblock the reader, then fail
        thread.join(10)
    assert "code" in result and not thread.is_alive(), "calibrate blocked on a special file"
    code, err = result["code"]
    assert code == 2 and "b.npz" in one_line(err) and "only regular .npz files" in err
    assert not (work / "s.json").exists()


# -- token ids out of the vocabulary ----------------------------------------------------------------------


def embedding_model(vocab: int = 16) -> onnx.ModelProto:
    """ids -> Gather(table [vocab, 64]) -> MatMul with an MXFP4 weight: onnxruntime refuses ids >= vocab."""
    table = np.random.default_rng(2).standard_normal((vocab, 64)).astype(np.float32)
    nodes = [helper.make_node("Gather", ["table", "ids"], ["e"], name="embed"), B.dq_node("W"),
             helper.make_node("Transpose", ["W_dq"], ["W_t"], name="t", perm=[1, 0]),
             helper.make_node("MatMul", ["e", "W_t"], ["y"], name="mm")]
    inits = [numpy_helper.from_array(table, "table"), *B.mx_inits("W", B.weight((32, 64)))]
    return B.make(nodes, [B.vi("ids", ["b", "t"], TensorProto.INT64)], [B.vi("y", ["b", "t", 32])], inits)


@pytest.mark.parametrize("command", ["calibrate", "convert", "diff"])
def test_token_ids_out_of_the_vocabulary_are_exit_2_in_every_command(tmp_path, capsys, command):
    onnx.save(embedding_model(), tmp_path / "m.onnx")
    ids = np.array([[1, 2, 1000]], np.int64)
    np.savez(tmp_path / "ids.npz", ids=ids)
    argv = {"calibrate": ["calibrate", tmp_path / "m.onnx", "--data", tmp_path / "ids.npz", "-o", tmp_path / "s.json"],
            "convert": ["convert", tmp_path / "m.onnx", "-o", tmp_path / "o.onnx", "--calib", tmp_path / "ids.npz"],
            "diff": ["diff", tmp_path / "m.onnx", tmp_path / "m.onnx", "--inputs", tmp_path / "ids.npz"]}[command]
    code, err = cli(capsys, *argv, "--quiet")
    assert code == 2, err
    line = one_line(err)
    assert "1000" in line or "out of" in line or "bounds" in line, line
    np.savez(tmp_path / "ids.npz", ids=ids % 16)  # the control: the same ids within the vocabulary
    assert cli(capsys, *argv, "--quiet")[0] == 0


# -- a small archive that inflates to gigabytes -----------------------------------------------------------


@pytest.mark.slow
def test_a_real_4_gib_deflated_member_of_the_wrong_rank_is_refused_before_inflating(work, capsys):
    """A deflated member of 2^30 float32 zeros (4 GiB inflated, ~4 MB on disk), rank 1 where the input is
    rank 2: refused from the header (the run stays far below 4 GiB: it would otherwise need it twice)."""
    import resource

    path = work / "bomb.npz"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as archive:
        with archive.open("x.npy", "w", force_zip64=True) as member:
            member.write(npy_header((2**30,)))
            chunk = bytes(1 << 24)
            for _ in range(2**32 // len(chunk)):
                member.write(chunk)
    assert path.stat().st_size < 64 << 20
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    code, err = cli(capsys, "calibrate", work / "m.onnx", "--data", path, "-o", work / "s.json", "--quiet")
    assert code == 2 and "rank 1" in one_line(err)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 1 << 20  # KiB: under 1 GiB more

