"""Damaged checkpoints: random byte flips, truncations and header edits of a shard or the index. Every case
ends in exit 0 (the damage hit bytes a conversion may hold) or exit 2 with one line and no OUT_DIR, never a
traceback or exit 3; the source folder is never written."""

from __future__ import annotations

import json
import os
import random
import shutil
import struct

import pytest

from checkpoint_oracles import tree_hash
from fp4pass.cli import main
from fp4pass.examples.checkpoints import build_checkpoint
from fp4pass.io import TMP_PREFIX

pytest.importorskip("safetensors")
CASES = int(os.environ.get("FP4PASS_FUZZ_CASES", "60"))  # case 51: a dtype that is a JSON list


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    return {form: build_checkpoint(root / form, form, layers=1, experts=2, hidden=64, intermediate=32, seed=2,
                                   shard_bytes=20_000)
            for form in ("gpt-oss", "compressed-tensors", "deepseek")}


def _damage(folder, rng: random.Random) -> str:
    shards = sorted(folder.glob("*.safetensors"))
    shard = rng.choice(shards)
    data = bytearray(shard.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    kind = rng.choice(["flip-header", "flip-data", "truncate", "length", "edit-entry", "index"])
    if kind == "flip-header":
        for _ in range(rng.randint(1, 4)):
            data[8 + rng.randrange(n)] = rng.randrange(256)
    elif kind == "flip-data":
        for _ in range(rng.randint(1, 64)):
            data[8 + n + rng.randrange(len(data) - 8 - n)] = rng.randrange(256)
    elif kind == "truncate":
        data = data[: rng.randrange(len(data))]
    elif kind == "length":
        data[:8] = struct.pack("<Q", rng.choice([0, n - 1, n + 1, 2**63, len(data)]))
    elif kind == "edit-entry":
        header = json.loads(data[8:8 + n])
        name = rng.choice([k for k in header if k != "__metadata__"])
        field = rng.choice(["dtype", "shape", "data_offsets"])
        header[name][field] = rng.choice([None, "F4", [], [1, 2, 3], [-1, 4], "x", 7, [0, 2**40]])
        text = json.dumps(header).encode()
        data = bytearray(struct.pack("<Q", len(text)) + text + bytes(data[8 + n:]))
    else:
        index = folder / "model.safetensors.index.json"
        entries = json.loads(index.read_text())
        key = rng.choice(list(entries["weight_map"]))
        entries["weight_map"][key] = rng.choice(["missing.safetensors", "/etc/passwd", shard.name, "", 5])
        index.write_text(json.dumps(entries))
        return kind
    shard.write_bytes(bytes(data))
    return kind


@pytest.mark.parametrize("case", range(CASES))
def test_damaged_checkpoint_is_refused_cleanly(pristine, tmp_path, capsys, case):
    rng = random.Random(case)
    form = ("gpt-oss", "compressed-tensors", "deepseek")[case % 3]
    src = shutil.copytree(pristine[form], tmp_path / "src")
    kind = _damage(src, rng)
    before = tree_hash(src)
    out = tmp_path / "out"
    code = main(["convert", str(src), "-o", str(out), "--format", "modelopt"])
    err = capsys.readouterr().err
    assert code in (0, 2), (kind, err)
    assert "Traceback" not in err and "internal error" not in err, (kind, err)
    if code == 2:
        assert len(err.strip().splitlines()) == 1 and not out.exists(), (kind, err)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(TMP_PREFIX)]
    assert tree_hash(src) == before
