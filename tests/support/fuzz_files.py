"""Seeded mutations of the files around a model, for the fuzz campaign (tests/campaigns/test_fuzz.py).

``make_file_case(seed, folder)`` writes one case into ``folder`` and returns ``(argv_list, outputs, what)``:
the command lines to run (each must exit 0, 1 or 2 with no traceback), the output names they may write, and
a description. Every mutation is a pure function of the seed. Families (``seed % 4``):

- ``npz``: the calibration data of tiny_mlp (``models/calib.npz``, stored or deflated), then: bytes flipped,
  truncated, zip header fields (flags: encrypted; method: deflate64, bzip2, unknown), a member's .npy
  header rewritten (shape: rank, dims up to 2^40 elements; dtype: object, strings, other widths), members
  duplicated, renamed or added, an empty archive, a plain .npy, a FIFO or /dev/zero in its place, or beside
  it in a --data folder. Run through ``calibrate --data`` and ``diff --inputs``.
- ``scales``: a SCALES.json for tiny_mlp, then: a number replaced (integers of up to 5000 digits, NaN,
  Infinity, strings, nesting), a key given twice, truncated, bytes flipped (not UTF-8), deep nesting, a
  FIFO or /dev/zero in its place. Run through ``convert --scales``.
- ``dims``: a model whose input has static dims drawn from 0, 1, 2^k up to 2^63 - 1 (and symbolic ones with a
  ``--shape``); what is drawn stays at most 2^24 elements, so that each case stays fast: ``diff`` draws
  random inputs for it.
- ``qmoe``: a QMoE 'fp4' model (tests/support/onnx_builders.py) with its attributes (quant_type, block_size,
  swiglu_fusion, activation_type, k, expert_weight_bits, hidden_size, inter_size) changed, or its
  fc*_global_scale inputs (length, type, values, pointing at another input). Run through ``inspect``,
  ``diff`` (the lowering) and ``convert --target ort`` (whose output, on exit 0, must pass the full ONNX
  checker: tests/campaigns/test_fuzz.py).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import struct
import zipfile
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import onnx_builders as B

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "models" / "tiny_mlp.onnx"
CALIB = ROOT / "models" / "calib.npz"
FAMILIES = ("npz", "scales", "dims", "qmoe")
SCALE_ENTRY = {"amax": 3.9, "g_amax": 3.9, "input_scale": 3.9 / 2688, "b_min": 1.0, "b_max": 3.9, "blocks": 1024}


def family_of(seed: int) -> str:
    return FAMILIES[seed % len(FAMILIES)]


def make_file_case(seed: int, folder: Path) -> tuple[list[list[str]], list[str], str]:
    rng = np.random.default_rng([seed, 77])
    family = family_of(seed)
    return {"npz": _npz_case, "scales": _scales_case, "dims": _dims_case, "qmoe": _qmoe_case}[family](rng, folder)


# -- .npz -----------------------------------------------------------------------------------------------------


def _npy(shape, descr: str, payload: bytes) -> bytes:
    text = f"{{'descr': '{descr}', 'fortran_order': False, 'shape': {tuple(shape)!r}, }}"
    text += " " * (63 - (len(text) + 10) % 64) + "\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(text)) + text.encode() + payload


def _patch_zip(data: bytes, field: str, value: int) -> bytes:
    out = bytearray(data)
    offsets = {"flags": (6, 8), "method": (8, 10)}[field]
    for signature, at in zip((b"PK\x03\x04", b"PK\x01\x02"), offsets):
        start = 0
        while (pos := out.find(signature, start)) >= 0:
            out[pos + at:pos + at + 2] = struct.pack("<H", value)
            start = pos + 4
    return bytes(out)


def _npz_bytes(rng: np.random.Generator) -> tuple[bytes, str]:
    x = np.load(CALIB)["x"][: int(rng.integers(1, 9))]
    buffer = io.BytesIO()
    compressed = bool(rng.integers(2))
    (np.savez_compressed if compressed else np.savez)(buffer, x=x)
    data = buffer.getvalue()
    kind = rng.choice(["flip", "truncate", "flags", "method", "header", "members", "empty", "npy", "none"])
    what = f"npz ({'deflated' if compressed else 'stored'}) {kind}"
    if kind == "flip":
        out = bytearray(data)
        for _ in range(int(rng.integers(1, 6))):
            out[int(rng.integers(len(out)))] ^= int(rng.integers(1, 256))
        return bytes(out), what
    if kind == "truncate":
        return data[: int(rng.integers(0, len(data)))], what
    if kind == "flags":
        return _patch_zip(data, "flags", int(rng.choice([1, 0x41, 0x2001]))), what
    if kind == "method":
        method = int(rng.choice([9, 12, 14, 99]))
        return _patch_zip(data, "method", method), f"{what} {method}"
    if kind in ("header", "members"):
        shape = [(8, 64), (64,), (2, 4, 64), (2**34, 64), (2**20, 2**20), (0, 64), (4, 63), ()][int(rng.integers(8))]
        descr = ["<f4", "<f2", "<f8", "|O", "<U3", "<i8", "|b1", "|V2", ">f4"][int(rng.integers(9))]
        items = int(np.prod(shape, dtype=np.int64)) if len(shape) else 1
        width = {"<f4": 4, "<f2": 2, "<f8": 8, "<i8": 8, "|b1": 1, "|V2": 2, ">f4": 4, "<U3": 12}.get(descr, 8)
        real = items * width if items * width < 1 << 16 else int(rng.integers(0, 4096))
        member = _npy(shape, descr, bytes(real))
        out = io.BytesIO()
        with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED if compressed else zipfile.ZIP_STORED) as archive:
            if kind == "header":
                archive.writestr("x.npy", member)
            else:
                names = [["x.npy", "x.npy"], ["x.npy", "extra.npy"], ["y.npy"], ["x", "x.npy"], ["dir/x.npy"]]
                for name in names[int(rng.integers(len(names)))]:
                    good = _npy(x.shape, "<f4", x.tobytes())
                    archive.writestr(name, member if name != "x.npy" or rng.integers(2) else good)
        return out.getvalue(), f"{what} {list(shape)} {descr}"
    if kind == "empty":
        out = io.BytesIO()
        with zipfile.ZipFile(out, "w"):
            pass
        return out.getvalue(), what
    if kind == "npy":
        out = io.BytesIO()
        np.save(out, x)
        return out.getvalue(), what
    return data, what


def _npz_case(rng: np.random.Generator, folder: Path):
    shutil.copy(MODEL, folder / "m.onnx")
    data, what = _npz_bytes(rng)
    place = rng.choice(["file", "folder", "fifo", "dev_zero", "folder_fifo"])
    if place in ("file", "folder", "folder_fifo"):
        target = folder / "data" / "d.npz" if place != "file" else folder / "d.npz"
        target.parent.mkdir(exist_ok=True)
        target.write_bytes(data)
        if place == "folder_fifo":
            os.mkfifo(folder / "data" / "z.npz")
        given = target.parent if place != "file" else target
    elif place == "fifo":
        given = folder / "d.npz"
        os.mkfifo(given)
    else:
        given = folder / "d.npz"
        given.symlink_to("/dev/zero")
    argv = [["calibrate", str(folder / "m.onnx"), "--data", str(given), "-o", "{out}/s.json", "--quiet"]]
    if place in ("file", "fifo", "dev_zero"):
        argv.append(["diff", str(folder / "m.onnx"), str(folder / "m.onnx"), "--inputs", str(given), "--quiet"])
    return argv, ["s.json"], f"{what}, given as {place}"


# -- SCALES.json ----------------------------------------------------------------------------------------------


def _scales_text(rng: np.random.Generator) -> tuple[bytes, str]:
    entry = dict(SCALE_ENTRY)
    text = json.dumps({"calibrator": "max", "tensors": {"x": entry, "act": dict(entry)}})
    kind = rng.choice(["number", "duplicate", "truncate", "flip", "nesting", "type", "none"])
    if kind == "number":
        key = str(rng.choice(list(SCALE_ENTRY)))
        digits = int(rng.choice([1, 39, 40, 41, 300, 4301, 5000]))
        value = str(rng.choice(["9" * digits, "-" + "9" * digits, "NaN", "Infinity", "-Infinity", "1e999",
                                "0." + "0" * digits + "1", '"3"', "null", "true", "[]", "{}"]))
        text = text.replace(f'"{key}": {json.dumps(SCALE_ENTRY[key])}', f'"{key}": {value}', 1)
        return text.encode(), f"scales {key} = {value[:20]}... ({len(value)} chars)"
    if kind == "duplicate":
        key = str(rng.choice(list(SCALE_ENTRY) + ["x", "tensors"]))
        value = str(rng.choice(["NaN", "1.0", '"a"', "{}"]))
        if key in SCALE_ENTRY:
            text = text.replace(f'"{key}": ', f'"{key}": {value}, "{key}": ', 1)
        else:
            text = text.replace(f'"{key}": ', f'"{key}": {value}, "{key}": ', 1)
        return text.encode(), f"scales duplicate {key} ({value} first)"
    if kind == "truncate":
        return text.encode()[: int(rng.integers(0, len(text)))], "scales truncated"
    if kind == "flip":
        out = bytearray(text.encode())
        for _ in range(int(rng.integers(1, 4))):
            out[int(rng.integers(len(out)))] = int(rng.integers(128, 256))
        return bytes(out), "scales bytes flipped (not UTF-8)"
    if kind == "nesting":
        depth = int(rng.choice([10, 1000, 100000]))
        return ("[" * depth + "]" * depth).encode(), f"scales nested {depth} deep"
    if kind == "type":
        value = str(rng.choice(["[]", "1", '"s"', '{"tensors": []}', '{"tensors": {"x": 1}}', "null"]))
        return value.encode(), f"scales document {value}"
    return text.encode(), "scales unchanged"


def _scales_case(rng: np.random.Generator, folder: Path):
    shutil.copy(MODEL, folder / "m.onnx")
    text, what = _scales_text(rng)
    path = folder / "s.json"
    place = rng.choice(["file", "file", "fifo", "dev_zero", "dir"])
    if place == "file":
        path.write_bytes(text)
    elif place == "fifo":
        os.mkfifo(path)
    elif place == "dir":
        path.mkdir()
    else:
        path.symlink_to("/dev/zero")
    argv = [["convert", str(folder / "m.onnx"), "-o", "{out}/o.onnx", "--scales", str(path), "--quiet"]]
    return argv, ["o.onnx"], f"{what}, given as {place}"


# -- static dims ----------------------------------------------------------------------------------------------


def _dims_case(rng: np.random.Generator, folder: Path):
    dims = []
    for _ in range(int(rng.integers(1, 4))):
        dims.append(int(rng.choice([0, 1, 3, 2**6, 2**8, 2**31, 2**40, 2**62, 2**63 - 1])))  # at most 2^24 drawn
    symbolic = bool(rng.integers(2))
    declared = ["n", *dims[1:]] if symbolic else dims
    dtype = int(rng.choice([TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.INT64, TensorProto.BOOL]))
    node = helper.make_node("Identity", ["x"], ["y"], name="id")
    model = B.make([node], [B.vi("x", declared, dtype)], [B.vi("y", declared, dtype)], [])
    onnx.save(model, folder / "m.onnx")
    argv = ["diff", str(folder / "m.onnx"), str(folder / "m.onnx"), "--quiet", "--provider", "cpu"]
    if symbolic:
        argv += ["--shape", "x=" + ",".join(str(d) for d in dims)]
    return [argv], [], f"dims {declared} {TensorProto.DataType.Name(dtype)}" + (f" --shape {dims}" if symbolic else "")


# -- QMoE attributes and global scales ------------------------------------------------------------------------


def _qmoe_case(rng: np.random.Generator, folder: Path):
    model = B.qmoe_model(global_scale=[1.0, 0.5], fc2_global_scale=[2.0, 0.25])
    node = model.graph.node[0]
    changes = []
    for _ in range(int(rng.integers(1, 3))):
        kind = rng.choice(["attribute", "attribute", "global", "point"])
        if kind == "attribute":
            name = str(rng.choice(["quant_type", "block_size", "swiglu_fusion", "activation_type", "k",
                                   "expert_weight_bits", "hidden_size", "inter_size"]))
            value = {"quant_type": rng.choice(["fp4", "nvfp4", "int4", ""]),
                     "activation_type": rng.choice(["swiglu", "relu", "gelu", "silu"]),
                     }.get(name, int(rng.choice([-1, 0, 1, 2, 16, 32, 64, 2**31])))
            for attr in list(node.attribute):
                if attr.name == name:
                    node.attribute.remove(attr)
            if not rng.integers(4) == 0:  # else: removed
                node.attribute.append(helper.make_attribute(name, value if isinstance(value, int) else str(value)))
            changes.append(f"{name}={value}")
        elif kind == "global":
            slot = str(rng.choice(["fc1", "fc2"]))
            g = [np.ones(int(rng.integers(0, 4)), np.float32), np.array([1.0, np.nan], np.float32),
                 np.array([1.0, -2.0], np.float32), np.ones(2, np.float16), np.ones((2, 1), np.float32),
                 np.array(0.5, np.float32), np.array([0.0, 3.0], np.float32)][int(rng.integers(7))]
            B.init(model, f"{slot}.global_scale").CopyFrom(numpy_helper.from_array(g, f"{slot}.global_scale"))
            changes.append(f"{slot}.global_scale={g.tolist()} {g.dtype}")
        else:
            index = int(rng.choice([15, 16]))
            target = str(rng.choice(["fc1.weight", "fc2.weight", "fc1.scales", "fc1.global_scale", "fc2.global_scale",
                                     "x", "router", ""]))
            node.input[index] = target
            changes.append(f"input {index} -> {target!r}")
    onnx.save(model, folder / "m.onnx")
    model_path = str(folder / "m.onnx")
    argv = [["inspect", model_path, "--quiet"],
            ["convert", model_path, "-o", "{out}/o.onnx", "--target", "ort", "--quiet"],
            ["diff", model_path, model_path, "--quiet", "--provider", "cpu"]]
    return argv, ["o.onnx"], "qmoe " + "; ".join(changes)
