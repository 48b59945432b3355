"""Seeded mutations of the example models, for the fuzz campaign (tests/campaigns/test_fuzz.py).

``make_case(seed, folder)`` writes one mutated model (and its external data, when the mutation needs it)
into ``folder`` and returns ``(model_path, description)``. Every mutation is a pure function of the seed.

Mutations (one or two per case):
- bytes: flip 1-8 random bytes of the serialized model; truncate it at a random length;
- proto fields: an initializer's dims (grown, shrunk, zeroed, negative), data_type (any enum value,
  UNDEFINED, unknown numbers), raw_data length (cut or extended), a node attribute (value, type, removed),
  names (a node output or graph output duplicated, an input renamed away, a name made non-UTF-8);
- external data: the model saved with one data file or one file per tensor, then its location
  (``..``, absolute, missing, empty, non-UTF-8), offset or length (non-numeric, too large) changed, or the
  data file truncated;
- E8M0 code 255 in a scale tensor.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx

ROOT = Path(__file__).resolve().parents[2]
BASES = (ROOT / "models" / "tiny_mlp.onnx", ROOT / "models" / "moe.onnx")
_BASE_BYTES = {p: p.read_bytes() for p in BASES}

FIELD_MUTATIONS = ("dims", "data_type", "raw_length", "attribute", "duplicate_output", "duplicate_graph_output",
                   "rename_input", "non_utf8_name", "e8m0_255")
EXTERNAL_MUTATIONS = ("location_dotdot", "location_absolute", "location_missing", "location_empty",
                      "location_non_utf8", "offset_text", "offset_huge", "length_text", "length_wrong",
                      "truncate_data", "none")
KINDS = ("flip", "truncate", "field", "field", "field", "external", "external", "e8m0_255")


def _initializers_with_raw(model: onnx.ModelProto):
    return [t for t in model.graph.initializer if t.HasField("raw_data")]


def _field(model: onnx.ModelProto, rng: np.random.Generator, which: str) -> str:
    inits = list(model.graph.initializer)
    tensor = inits[rng.integers(len(inits))]
    if which == "dims":
        dims = list(tensor.dims)
        i = int(rng.integers(len(dims))) if dims else 0
        choice = rng.integers(5)
        if not dims or choice == 0:
            tensor.dims.append(int(rng.integers(1, 4)))
        elif choice == 1:
            tensor.dims[i] = 0
        elif choice == 2:
            tensor.dims[i] = -int(rng.integers(1, 5))
        elif choice == 3:
            tensor.dims[i] = dims[i] + int(rng.integers(1, 40))
        else:
            del tensor.dims[i]
        return f"dims of {tensor.name} -> {list(tensor.dims)}"
    if which == "data_type":
        values = [v for _, v in onnx.TensorProto.DataType.items()] + [0, 31, 99, -3]
        tensor.data_type = int(values[rng.integers(len(values))])
        return f"data_type of {tensor.name} -> {tensor.data_type}"
    if which == "raw_length":
        raws = _initializers_with_raw(model)
        tensor = raws[rng.integers(len(raws))]
        raw = tensor.raw_data
        tensor.raw_data = raw[: int(rng.integers(len(raw)))] if rng.random() < 0.5 else raw + bytes(int(rng.integers(1, 9)))
        return f"raw_data of {tensor.name} -> {len(tensor.raw_data)} bytes"
    if which == "attribute":
        nodes = [n for n in model.graph.node if n.attribute]
        node = nodes[rng.integers(len(nodes))]
        attr = node.attribute[rng.integers(len(node.attribute))]
        choice = rng.integers(4)
        if choice == 0:
            node.attribute.remove(attr)
            return f"attribute {attr.name} of {node.name or node.op_type} removed"
        if choice == 1 and attr.type == onnx.AttributeProto.INT:
            attr.i = int(rng.choice([0, -1, 1, 3, 7, 16, 31, 33, 64, 2**40]))
        elif choice == 2:
            attr.type = int(rng.choice([onnx.AttributeProto.FLOAT, onnx.AttributeProto.STRING, onnx.AttributeProto.INTS]))
        else:
            attr.name = str(rng.choice(["axis", "block_size", "output_dtype", "perm", "transB", "bogus"]))
        return f"attribute {attr.name} of {node.name or node.op_type} changed"
    if which == "duplicate_output":
        nodes = list(model.graph.node)
        a, b = rng.choice(len(nodes), 2, replace=False)
        nodes[b].output[0] = nodes[a].output[0]
        return f"node {nodes[b].name or nodes[b].op_type} output duplicated"
    if which == "duplicate_graph_output":
        model.graph.output.append(model.graph.output[0])
        return "graph output duplicated"
    if which == "rename_input":
        nodes = [n for n in model.graph.node if n.input]
        node = nodes[rng.integers(len(nodes))]
        node.input[int(rng.integers(len(node.input)))] = "nowhere"
        return f"an input of {node.name or node.op_type} renamed to 'nowhere'"
    if which == "e8m0_255":
        scales = [t for t in _initializers_with_raw(model) if t.data_type == onnx.TensorProto.FLOAT8E8M0]
        tensor = scales[rng.integers(len(scales))]
        raw = bytearray(tensor.raw_data)
        raw[int(rng.integers(len(raw)))] = 255
        tensor.raw_data = bytes(raw)
        return f"E8M0 255 in {tensor.name}"
    raise ValueError(which)


def _replace_bytes(data: bytes, old: bytes, rng: np.random.Generator) -> bytes:
    """Make one occurrence of ``old`` non-UTF-8 (same length, so the protobuf stays well framed)."""
    i = data.find(old)
    if i < 0 or not old:
        return data
    return data[:i] + b"\xff" + data[i + 1:]


def _external(model: onnx.ModelProto, folder: Path, rng: np.random.Generator, which: str) -> tuple[Path, str]:
    path = folder / "m.onnx"
    one_file = rng.random() < 0.6
    onnx.save(model, path, save_as_external_data=True, all_tensors_to_one_file=one_file,
              location="m.onnx.data" if one_file else None, size_threshold=0)
    if which == "none":
        return path, f"external data ({'one file' if one_file else 'file per tensor'})"
    proto = onnx.load(path, load_external_data=False)
    externals = [t for t in proto.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    tensor = externals[rng.integers(len(externals))]
    entries = {e.key: e for e in tensor.external_data}
    if which == "truncate_data":
        data_file = folder / entries["location"].value
        size = data_file.stat().st_size
        with open(data_file, "r+b") as f:
            f.truncate(int(rng.integers(size)) if size else 0)
        return path, f"external data {data_file.name} truncated"
    if which == "location_non_utf8":
        marker = entries["location"].value.encode()
        onnx.save(proto, path)
        path.write_bytes(_replace_bytes(path.read_bytes(), marker, rng))
        return path, f"external location of {tensor.name} non-UTF-8"
    if which.startswith("location"):
        (folder.parent / "secret.bin").write_bytes(bytes(4096))
        entries["location"].value = {"location_dotdot": "../secret.bin",
                                     "location_absolute": str(folder.parent / "secret.bin"),
                                     "location_missing": "absent.data", "location_empty": ""}[which]
    elif which in ("offset_text", "offset_huge"):
        entry = entries.get("offset") or tensor.external_data.add(key="offset")
        entry.value = "12a" if which == "offset_text" else str(2**40)
    elif which in ("length_text", "length_wrong"):
        entry = entries.get("length") or tensor.external_data.add(key="length")
        entry.value = " 7" if which == "length_text" else str(int(rng.integers(0, 10_000)))
    onnx.save(proto, path)
    return path, f"external {which} on {tensor.name}"


def make_case(seed: int, folder: Path) -> tuple[Path, str]:
    """Write the mutated model of ``seed`` into ``folder`` (which must exist); returns (path, description)."""
    rng = np.random.default_rng(seed)
    base = BASES[seed % len(BASES)]
    data = _BASE_BYTES[base]
    kind = KINDS[rng.integers(len(KINDS))]
    path = folder / "m.onnx"
    label = f"seed {seed} {base.name}: "
    if kind == "flip":
        raw = bytearray(data)
        for _ in range(int(rng.integers(1, 9))):
            raw[int(rng.integers(len(raw)))] ^= 1 << int(rng.integers(8))
        path.write_bytes(bytes(raw))
        return path, label + "bytes flipped"
    if kind == "truncate":
        path.write_bytes(data[: int(rng.integers(len(data)))])
        return path, label + "truncated"
    model = onnx.load_from_string(data)
    if kind == "e8m0_255":
        return _save(model, path, label + _field(model, rng, "e8m0_255"))
    if kind == "field":
        which = FIELD_MUTATIONS[rng.integers(len(FIELD_MUTATIONS))]
        if which == "non_utf8_name":
            names = [n.op_type for n in model.graph.node] + [t.name for t in model.graph.initializer]
            name = names[rng.integers(len(names))]
            path.write_bytes(_replace_bytes(data, name.encode(), rng))
            return path, label + f"name {name!r} made non-UTF-8"
        text = _field(model, rng, which)
        if rng.random() < 0.3:  # a second field mutation on top
            text += "; " + _field(model, rng, FIELD_MUTATIONS[rng.integers(len(FIELD_MUTATIONS) - 2)])
        return _save(model, path, label + text)
    which = EXTERNAL_MUTATIONS[rng.integers(len(EXTERNAL_MUTATIONS))]
    if rng.random() < 0.3:
        _field(model, rng, FIELD_MUTATIONS[rng.integers(5)])
    try:
        path, text = _external(model, folder, rng, which)
    except Exception:  # noqa: BLE001 - onnx cannot save this mutation with external data: keep it inline
        for leftover in folder.iterdir():
            leftover.unlink()
        return _save(model, folder / "m.onnx", label + f"{which} (inline: onnx could not externalize it)")
    return path, label + text


def _save(model: onnx.ModelProto, path: Path, text: str) -> tuple[Path, str]:
    path.write_bytes(model.SerializeToString())
    return path, text


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (relative path -> bytes), to prove inputs unchanged and nothing added."""
    found = {}
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            full = Path(root) / name
            rel = str(full.relative_to(folder))
            found[rel] = full.read_bytes() if full.is_file() and not full.is_symlink() else b"<dir>"
    return found
