"""Fuzz campaign over checkpoint folders: damaged shards, headers that lie, configs and indexes of every wrong
kind, special files where files belong; ``fp4pass inspect`` and ``fp4pass convert`` on each case.

Invariants of every case: exit 0, 1 or 2 (never 3, never a traceback); the source folder unchanged, byte for
byte; on a non-zero exit no OUT_DIR and no temporary left beside it; with exit 0 every output shard opens with
the ``safetensors`` package (a reader fp4pass did not write) and its tensors have the dtypes and shapes the
header promises. 24 cases run by default, 300 under ``-m slow`` (``FP4PASS_CKPT_FUZZ_CASES`` /
``FP4PASS_CKPT_FUZZ_SLOW_CASES`` change the counts).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import struct
from pathlib import Path

import pytest

from fp4pass.cli import main
from fp4pass.examples.checkpoints import build_checkpoint

safetensors = pytest.importorskip("safetensors")

FORMS = {"gpt-oss": "modelopt", "compressed-tensors": "compressed-tensors", "deepseek": "modelopt"}
DEFAULT_CASES = int(os.environ.get("FP4PASS_CKPT_FUZZ_CASES", "24"))
SLOW_CASES = int(os.environ.get("FP4PASS_CKPT_FUZZ_SLOW_CASES", "300"))


def _shards(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def _header(path: Path) -> tuple[dict, int]:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n]), n


def _write_header(path: Path, header: dict) -> None:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    body = data[8 + n:]
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + body)


def _tensor_names(header: dict) -> list[str]:
    return [k for k in header if k != "__metadata__"]


# -- the mutations: each changes the folder in one way a real checkpoint can be wrong -------------------------


def m_flip_header_byte(rng, folder):
    path = rng.choice(_shards(folder))
    data = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    i = rng.randrange(0, 8 + n)
    data[i] ^= 1 << rng.randrange(8)
    path.write_bytes(bytes(data))


def m_truncate_shard(rng, folder):
    path = rng.choice(_shards(folder))
    data = path.read_bytes()
    path.write_bytes(data[: rng.randrange(0, len(data))])


def m_flip_data_byte(rng, folder):
    """A random byte of the tensor data: a code, a scale (maybe E8M0 255), a bf16 weight."""
    path = rng.choice(_shards(folder))
    data = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    if len(data) > 8 + n:
        i = rng.randrange(8 + n, len(data))
        data[i] = rng.choice([255, 0, data[i] ^ 0x80])
        path.write_bytes(bytes(data))


def _scale_names(header: dict) -> list[str]:
    return [k for k in _tensor_names(header) if k.endswith(("_scales", ".weight_scale", ".scale"))]


def m_e8m0_nan(rng, folder):
    path = rng.choice([p for p in _shards(folder) if _scale_names(_header(p)[0])])
    header, n = _header(path)
    scales = _scale_names(header)
    entry = header[rng.choice(scales)]
    start, end = entry["data_offsets"]
    data = bytearray(path.read_bytes())
    data[8 + n + rng.randrange(start, end)] = 255
    path.write_bytes(bytes(data))


def m_lying_header(rng, folder):
    path = rng.choice(_shards(folder))
    header, _ = _header(path)
    name = rng.choice(_tensor_names(header))
    entry = header[name]
    choice = rng.randrange(6)
    if choice == 0:
        entry["dtype"] = rng.choice(["F8_E8M0", "U8", "I8", "BF16", "F32", "F64", "XYZ", "", 7, ["U8"], None])
    elif choice == 1:
        entry["shape"] = [d * rng.choice([2, 3]) if d else 1 for d in entry["shape"]] or [2]
    elif choice == 2:
        entry["shape"] = rng.choice([[], [-1, 4], [2**62, 2**62], "x", [0]])
    elif choice == 3:
        start, end = entry["data_offsets"]
        entry["data_offsets"] = rng.choice([[end, start], [start, end + 64], [start + 1, end], [0, 2**62], [-8, end]])
    elif choice == 4:
        del header[name]  # the tensor vanishes (a missing scales tensor, a missing bias)
    else:
        header[name + rng.choice(["_x", ".bak", ""])] = dict(entry)  # a duplicate or extra entry
    _write_header(path, header)


def m_rename_tensor(rng, folder):
    """A scales tensor under another name (so its codes have none), or codes named like a different form."""
    path = rng.choice(_shards(folder))
    header, _ = _header(path)
    name = rng.choice(_tensor_names(header))
    new = name.replace("_scales", "_scale").replace("weight_scale", "weight_scales").replace(".scale", ".scales")
    if new == name:
        new = name.replace("experts", "expert")
    header[new] = header.pop(name)
    _write_header(path, header)


def m_config(rng, folder):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    choice = rng.randrange(6)
    if choice == 0:
        path.write_text(rng.choice(["", "{", "[]", "null", "\"text\"", "{\"a\": 1, \"a\": 2}", "1" * 5000]))
    elif choice == 1:
        key = rng.choice(list(config))
        config[key] = rng.choice([None, "x", -1, 0, [], {}, 1e308, True])
        path.write_text(json.dumps(config))
    elif choice == 2:
        config["quantization_config"] = rng.choice([None, "mxfp4", [], {"quant_method": "fp8"}, {"quant_method": 3}])
        path.write_text(json.dumps(config))
    elif choice == 3:
        path.unlink()
    elif choice == 4:
        path.unlink()
        path.symlink_to("/dev/zero")
    else:
        path.unlink()
        os.mkfifo(path)


def m_index(rng, folder):
    index = folder / "model.safetensors.index.json"
    shards = _shards(folder)
    if not index.exists():
        weight_map = {}
        for shard in shards:
            header, _ = _header(shard)
            weight_map.update({k: shard.name for k in _tensor_names(header)})
        index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    data = json.loads(index.read_text())
    weight_map = data["weight_map"]
    name = rng.choice(list(weight_map))
    choice = rng.randrange(5)
    if choice == 0:
        weight_map[name] = rng.choice(["../outside.safetensors", "/etc/passwd", "missing.safetensors", "", 3])
    elif choice == 1:
        del weight_map[name]
    elif choice == 2:
        weight_map["ghost.weight"] = shards[0].name
    elif choice == 3:
        other = [s.name for s in shards if s.name != weight_map[name]]
        if other:
            weight_map[name] = rng.choice(other)
    else:
        index.write_text(rng.choice(["{", "[]", json.dumps({"weight_map": []}), json.dumps({"metadata": 1})]))
        return
    index.write_text(json.dumps(data))


def m_special_file(rng, folder):
    """A FIFO or a link to a device among the files that are copied (a tokenizer file, a shard)."""
    path = rng.choice([p for p in folder.iterdir() if p.is_file()])
    path.unlink()
    if rng.random() < 0.5:
        os.mkfifo(path)
    else:
        path.symlink_to(rng.choice(["/dev/zero", "/dev/null"]))


MUTATIONS = [m_flip_header_byte, m_truncate_shard, m_flip_data_byte, m_e8m0_nan, m_lying_header, m_rename_tensor,
             m_config, m_index, m_special_file]


def _snapshot(folder: Path) -> dict:
    found = {}
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder).as_posix()
        if path.is_symlink():
            found[rel] = ("link", os.readlink(path))
        elif path.is_fifo():
            found[rel] = ("fifo",)
        elif path.is_file():
            found[rel] = ("file", hashlib.sha256(path.read_bytes()).hexdigest())
    return found


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout()


def _run(argv, capsys, seconds=120):
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(seconds)
    try:
        code = main(argv)
    except _Timeout:
        pytest.fail(f"{argv} did not finish within {seconds} s (blocked on a special file?)")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    return code, capsys.readouterr().err


def _case(seed: int, root: Path, capsys) -> None:
    rng = random.Random(seed)
    form = rng.choice(sorted(FORMS))
    src = build_checkpoint(root / "src", form, layers=1, experts=2, hidden=64, intermediate=32, seed=seed,
                           dense=rng.random() < 0.3, shard_bytes=rng.choice([None, 20_000]))
    mutation = rng.choice(MUTATIONS)
    mutation(rng, src)
    before = _snapshot(src)
    out = root / "out"
    fmt = FORMS[form]
    for argv in (["inspect", str(src), "--json"],
                 ["convert", str(src), "-o", str(out), "--format", fmt, *(["--check"] if rng.random() < 0.5 else []),
                  *(["--input-scale", "1.0"] if rng.random() < 0.5 else [])]):
        code, err = _run(argv, capsys)
        label = f"seed {seed} ({form}, {mutation.__name__}): {' '.join(argv[:1])}"
        assert code in (0, 1, 2), f"{label}: exit {code}: {err[-800:]}"
        assert "Traceback" not in err, f"{label}: {err[-800:]}"
        if code != 0:
            assert err.strip(), f"{label}: exit {code} with nothing said"
        assert _snapshot(src) == before, f"{label}: the source folder changed"
        leftovers = [p.name for p in root.iterdir() if p.name.startswith(".fp4pass-tmp-")]
        assert leftovers == [], f"{label}: temporaries left: {leftovers}"
        if argv[0] == "convert":
            if code != 0:
                assert not out.exists(), f"{label}: exit {code} left {out}"
            else:
                from safetensors import safe_open

                for shard in _shards(out):
                    header, _ = _header(shard)
                    with safe_open(str(shard), "pt") as f:
                        for name in f.keys():
                            assert list(f.get_slice(name).get_shape()) == header[name]["shape"], f"{label}: {name}"


@pytest.mark.parametrize("seed", range(DEFAULT_CASES))
def test_checkpoint_fuzz_default(seed, tmp_path, capsys):
    _case(seed, tmp_path, capsys)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(DEFAULT_CASES, DEFAULT_CASES + SLOW_CASES))
def test_checkpoint_fuzz_slow(seed, tmp_path, capsys):
    _case(seed, tmp_path, capsys)


@pytest.mark.parametrize("dtype", [["U8"], None, 7, {"U8": 1}, "u8", ""])
def test_a_header_dtype_of_any_json_kind_is_exit_2(dtype, tmp_path, capsys):
    """A regression the campaign found: a dtype that is a JSON list (unhashable) was exit 3."""
    src = build_checkpoint(tmp_path / "src", "deepseek", layers=1, experts=1, hidden=64, intermediate=32)
    path = _shards(src)[0]
    header, _ = _header(path)
    header[next(k for k in _tensor_names(header) if k.endswith(".scale"))]["dtype"] = dtype
    _write_header(path, header)
    code, err = _run(["convert", str(src), "-o", str(tmp_path / "out"), "--format", "modelopt"], capsys)
    assert code == 2 and "unknown dtype" in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()
