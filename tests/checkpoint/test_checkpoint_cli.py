"""``fp4pass convert CKPT_DIR -o OUT_DIR`` and ``fp4pass inspect CKPT_DIR``: exit codes, OUT_DIR rules, bad input.

Every failure is exit 2 with one line naming the shard and the tensor, no OUT_DIR and no temporary left beside
it, and the source folder unchanged (hashed before and after).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import struct

import pytest

from checkpoint_oracles import tree_hash
from cli_helpers import nothing_left, run_cli
from fp4pass.examples.checkpoints import build_checkpoint

pytest.importorskip("safetensors")


#: DeepSeek-V4's default output (its own FP8 config with NVFP4 experts) is W4A4 only: convert needs an input scale
W4A4 = ("--input-scale", "0.0123")


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = tmp_path_factory.mktemp("src")
    return {form: build_checkpoint(root / form, form, layers=1, experts=2, hidden=64, intermediate=64, seed=11)
            for form in ("gpt-oss", "compressed-tensors", "deepseek")}


@pytest.fixture
def ckpt(pristine, tmp_path):
    """A private copy of each example (a test may damage it)."""
    return {form: shutil.copytree(src, tmp_path / f"in-{form}") for form, src in pristine.items()}




def _fails(capsys, src, out_dir, *flags, expect=("",)):
    before = tree_hash(src)
    code, _, err = run_cli(capsys, "convert", src, "-o", out_dir, *flags)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    for piece in expect:
        assert piece in lines[0], lines[0]
    nothing_left(out_dir)
    assert tree_hash(src) == before
    return lines[0]


def test_convert_and_report(ckpt, tmp_path, capsys):
    report = tmp_path / "r.json"
    code, out, err = run_cli(capsys, "convert", ckpt["deepseek"], "-o", tmp_path / "o", "--format", "compressed-tensors",
                          "--input-scale", "1.0", "--check", "--report", report)
    assert code == 0, err
    data = json.loads(report.read_text())
    assert data["check"]["passed"] and data["check"]["experts_identical"] == data["summary"]["experts_total"]
    assert {"blocks16_total", "blocks16_verbatim", "mse", "snr_db", "global_scale"} <= set(data["tensors"][0])
    assert "lossless" in out and "weights converted" in err
    mode = os.stat(tmp_path / "o" / "model.safetensors").st_mode & 0o777
    assert mode == 0o666 & ~current_umask()


def current_umask():
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def test_inspect_json(ckpt, capsys):
    code, out, _ = run_cli(capsys, "inspect", ckpt["gpt-oss"], "--json")
    assert code == 0
    info = json.loads(out)
    assert info["summary"]["experts_total"] == 4 and info["input_forms"] == ["gpt-oss"]


def test_existing_empty_out_dir_is_used(ckpt, tmp_path, capsys):
    (tmp_path / "o").mkdir()
    code, _, err = run_cli(capsys, "convert", ckpt["deepseek"], "-o", tmp_path / "o", *W4A4)
    assert code == 0, err
    assert (tmp_path / "o" / "model.safetensors").exists()


def test_out_dir_not_empty(ckpt, tmp_path, capsys):
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "keep.txt").write_text("mine")
    code, _, err = run_cli(capsys, "convert", ckpt["deepseek"], "-o", tmp_path / "o", *W4A4)
    assert code == 2 and "not empty" in err
    assert os.listdir(tmp_path / "o") == ["keep.txt"]


@pytest.mark.parametrize("where", ["same", "inside"])
def test_out_dir_is_or_in_source(ckpt, capsys, where):
    src = ckpt["deepseek"]
    before = tree_hash(src)
    out = src if where == "same" else src / "nvfp4"
    code, _, err = run_cli(capsys, "convert", src, "-o", out)
    assert code == 2, err
    assert tree_hash(src) == before and not (src / "nvfp4").exists()


def test_gpt_oss_stacks_refused_in_compressed_tensors(ckpt, tmp_path, capsys):
    _fails(capsys, ckpt["gpt-oss"], tmp_path / "o", "--format", "compressed-tensors",
           expect=("_proj_blocks", "no standard compressed-tensors", "--format modelopt"))


def _shard(folder):
    return sorted(folder.glob("*.safetensors"))[0]


def test_truncated_shard(ckpt, tmp_path, capsys):
    shard = _shard(ckpt["deepseek"])
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    _fails(capsys, ckpt["deepseek"], tmp_path / "o", *W4A4, expect=(shard.name, "truncated", "tensor '"))


def test_header_that_lies(ckpt, tmp_path, capsys):
    shard = _shard(ckpt["compressed-tensors"])
    data = bytearray(shard.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    name = next(k for k in header if k.endswith("weight_scale"))
    header[name]["shape"] = [header[name]["shape"][0], 1]  # fewer bytes than its offsets span
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (n - len(text))
    assert len(text) == n
    shard.write_bytes(struct.pack("<Q", n) + text + bytes(data[8 + n:]))
    _fails(capsys, ckpt["compressed-tensors"], tmp_path / "o", expect=(shard.name, name, "header lies"))


def _rewrite(shard, drop=None, patch=None):
    """Rewrite a shard with the safetensors package: without tensor ``drop``, with ``patch(name, tensor)``."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(shard), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if k != drop}
    if patch:
        for k in list(tensors):
            tensors[k] = patch(k, tensors[k])
    save_file(tensors, str(shard))


def test_missing_scales_tensor(ckpt, tmp_path, capsys):
    src = ckpt["gpt-oss"]
    shard = _shard(src)
    _rewrite(shard, drop="model.layers.0.mlp.experts.down_proj_scales")
    _fails(capsys, src, tmp_path / "o", expect=(shard.name, "down_proj_blocks", "down_proj_scales"))


@pytest.mark.parametrize("form,tensor", [("deepseek", "layers.0.ffn.experts.1.w3.scale"),
                                         ("gpt-oss", "model.layers.0.mlp.experts.gate_up_proj_scales")])
def test_e8m0_nan(ckpt, tmp_path, capsys, form, tensor):
    import torch

    def patch(name, t):
        if name != tensor:
            return t
        t = t.clone()
        t.view(torch.uint8).view(-1)[5] = 255
        return t

    shard = _shard(ckpt[form])
    _rewrite(shard, patch=patch)
    flags = W4A4 if form == "deepseek" else ()
    _fails(capsys, ckpt[form], tmp_path / "o", *flags, expect=(shard.name, tensor, "255"))


def test_index_naming_a_file_outside(ckpt, tmp_path, capsys):
    src = ckpt["deepseek"]
    shard = _shard(src)
    shutil.copy(shard, tmp_path / "outside.safetensors")
    from safetensors import safe_open

    with safe_open(str(shard), framework="pt") as f:
        keys = list(f.keys())
    (src / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: "../outside.safetensors" for k in keys}}))
    _fails(capsys, src, tmp_path / "o", expect=("../outside.safetensors", "not a file name"))


@pytest.mark.parametrize("after", [0, 20_000])
def test_full_disk(ckpt, tmp_path, capsys, monkeypatch, after):
    """ENOSPC from the first write (the header) or in the middle of the shard: exit 2, nothing left."""
    real_write = os.write
    written = {"n": 0}

    def full(fd, data):
        if os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).endswith(".safetensors"):
            if written["n"] + len(data) > after:
                raise OSError(errno.ENOSPC, "No space left on device")
            written["n"] += len(data)
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", full)
    def no_room(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "copy_file_range", no_room)
    _fails(capsys, ckpt["deepseek"], tmp_path / "o", *W4A4, expect=("model.safetensors", "No space left", "tensor"))


def test_full_disk_at_preallocation(ckpt, tmp_path, capsys, monkeypatch):
    def no_room(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_room)
    _fails(capsys, ckpt["deepseek"], tmp_path / "o", *W4A4, expect=("model.safetensors", "No space left", "tensor"))


def test_failed_check_exits_1_and_writes_nothing(ckpt, tmp_path, capsys, monkeypatch):
    """A conversion that writes a wrong global scale is caught by --check: exit 1, no OUT_DIR, report kept."""
    pytest.importorskip("compressed_tensors")
    from fp4pass.checkpoint import engine

    real = engine.reciprocal
    monkeypatch.setattr(engine, "reciprocal", lambda v: real(v) * 2)
    code, _, err = run_cli(capsys, "convert", ckpt["deepseek"], "-o", tmp_path / "o", "--format", "compressed-tensors",
                        "--check", "--report", tmp_path / "r.json")
    assert code == 1 and "check FAILED" in err
    nothing_left(tmp_path / "o")
    assert not json.loads((tmp_path / "r.json").read_text())["check"]["passed"]


@pytest.mark.parametrize("flags,needle", [(["--calib", "x.npz"], "x.npz: no such file"),
                                          (["--input-scale", "0"], "positive"),
                                          (["--input-scale", "1", "--scales", "s.json"], "not both")])
def test_usage_errors(ckpt, tmp_path, capsys, flags, needle):
    _fails(capsys, ckpt["deepseek"], tmp_path / "o", *flags, expect=(needle,))


def test_scales_with_no_expert_of_a_layer(ckpt, tmp_path, capsys):
    path = tmp_path / "s.json"
    entry = {"amax": 1.0, "g_amax": 1.0, "input_scale": 0.5, "b_min": 0.0, "b_max": 1.0, "blocks": 1}
    path.write_text(json.dumps({"calibrator": "max", "tensors": {"layers.0.ffn.experts.0.w2": entry}}))
    _fails(capsys, ckpt["deepseek"], tmp_path / "o", "--scales", path, expect=("layers.0.ffn", "gate_up"))


def test_every_file_fsynced_before_the_rename(ckpt, tmp_path, monkeypatch):
    import fp4pass.checkpoint

    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(a, b):
        events.append(("replace", os.fspath(a), os.fspath(b)))
        return real_replace(a, b)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    out = tmp_path / "o"
    fp4pass.checkpoint.convert(ckpt["deepseek"], out, input_scale=0.0123)
    renames = [i for i, e in enumerate(events) if e[0] == "replace" and e[2] == str(out)]
    assert len(renames) == 1
    tmp = events[renames[0]][1]
    synced_before = {e[1] for e in events[: renames[0]] if e[0] == "fsync"}
    for name in os.listdir(out):
        assert os.path.join(tmp, name) in synced_before, name
    assert tmp in synced_before  # the folder itself
    assert ("fsync", str(tmp_path)) in events[renames[0]:]  # the parent, after the rename


def test_interrupted_run_leaves_nothing(ckpt, tmp_path, capsys, monkeypatch):
    from fp4pass.checkpoint import engine

    calls = {"n": 0}
    real = engine.convert_linears

    def interrupt(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(engine, "convert_linears", interrupt)
    code, _, err = run_cli(capsys, "convert", ckpt["deepseek"], "-o", tmp_path / "o", *W4A4)
    assert code == 130 and calls["n"] == 3
    nothing_left(tmp_path / "o")
