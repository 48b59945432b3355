"""Calibration inputs a stranger hands in, bounded: no tokenizer call sees more than ENCODE_CHARS characters
whatever the vocabulary holds, a --data folder's link out is refused, the memory check honours RLIMIT_AS and the
cgroup's limit, and a weight_scale_2 of the wrong shape is named by its shape only.

Oracles: the bundled tokenizer (one token per character) on the whole text; numbers written into a fake cgroup
tree; the validator's own problem list read for its codes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fp4pass.calib.errors import CalibrationDataError
from fp4pass.checkpoint import calib_data, model_limits
from fp4pass.checkpoint.calib_data import load_batches

ROOT = Path(__file__).resolve().parents[2]
KIMI = ROOT / "models" / "checkpoints" / "deepseek_v3"
VOCAB = 32


class SpyTokenizer:
    """The real tokenizer, recording how many characters each call is given."""

    calls: list[int] = []

    def __init__(self, real):
        self.real = real

    def encode(self, text, add_special_tokens=True):
        SpyTokenizer.calls.append(len(text))
        return self.real.encode(text, add_special_tokens=add_special_tokens)

    def get_vocab(self, with_added_tokens=True):
        return self.real.get_vocab(with_added_tokens=with_added_tokens)


@pytest.fixture
def spied(monkeypatch):
    import tokenizers

    real_from_file = tokenizers.Tokenizer.from_file
    SpyTokenizer.calls = []
    monkeypatch.setattr(tokenizers, "Tokenizer", type("T", (), {
        "from_file": staticmethod(lambda path: SpyTokenizer(real_from_file(path)))}))
    # a vocabulary with one entry of 8 million characters: the cut by tokens wanted no longer bounds a row
    monkeypatch.setattr(calib_data, "max_token_chars", lambda tokenizer: 8_000_000)
    monkeypatch.setattr(calib_data, "ENCODE_CHARS", 4096)
    return SpyTokenizer


def _text(n: int) -> str:
    words = ["the", "cat", "sat", "on", "a", "mat", "quickly", "zebra"]
    rng = np.random.default_rng(0)
    return " ".join(words[i] for i in rng.integers(0, len(words), n))


@pytest.mark.parametrize("num_samples", [3, None])
def test_no_tokenizer_call_sees_more_than_its_bound_and_the_tokens_are_the_whole_texts(tmp_path, spied,
                                                                                         num_samples):
    from tokenizers import Tokenizer as RealTokenizer  # noqa: F401 (the spy replaced it: read the file again)
    import tokenizers

    text = _text(12_000)  # ~55,000 characters: 14 pieces of 4096
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"text": text}) + "\n" + json.dumps({"text": "short tail"}) + "\n")
    seq_len = 997
    batches = load_batches(data, KIMI, VOCAB, seq_len=seq_len, num_samples=num_samples, batch_size=64)
    assert spied.calls and max(spied.calls) <= 4096
    got = np.concatenate([b.input_ids.numpy().reshape(-1) for b in batches])
    whole = tokenizers.Tokenizer.from_file(str(KIMI / "tokenizer.json")).real.encode(
        text + "short tail", add_special_tokens=False).ids
    assert got.tolist() == whole[:got.size]
    assert got.size == (num_samples * seq_len if num_samples else (len(whole) // seq_len) * seq_len)


def test_a_data_folders_link_to_a_file_outside_is_refused(tmp_path):
    outside = tmp_path / "outside.npz"
    np.savez(outside, input_ids=np.ones((2, 8), np.int64))
    folder = tmp_path / "data"
    folder.mkdir()
    np.savez(folder / "a.npz", input_ids=np.ones((2, 8), np.int64))
    (folder / "b.npz").symlink_to(outside)
    with pytest.raises(CalibrationDataError, match=r"b\.npz: is a symlink to .*outside\.npz, outside the data folder"):
        load_batches(folder, KIMI, VOCAB)
    (folder / "b.npz").unlink()
    (folder / "b.npz").symlink_to(folder / "a.npz")  # a link inside the folder is read
    assert sum(b.input_ids.shape[0] for b in load_batches(folder, KIMI, VOCAB)) == 4


def _cgroup(tmp_path: Path, v2: bool, levels: dict[str, tuple[str, str]]) -> tuple[str, str]:
    root = tmp_path / "cg"
    names = ("memory.max", "memory.current") if v2 else ("memory.limit_in_bytes", "memory.usage_in_bytes")
    base = root if v2 else root / "memory"
    for rel, (limit, usage) in levels.items():
        folder = base / rel if rel else base
        folder.mkdir(parents=True, exist_ok=True)
        (folder / names[0]).write_text(limit + "\n")
        (folder / names[1]).write_text(usage + "\n")
    membership = tmp_path / "cgroup"
    membership.write_text("0::/a/b\n" if v2 else "4:memory:/a/b\n3:cpu:/\n")
    return str(root), str(membership)


@pytest.mark.parametrize("v2", [True, False])
def test_the_cgroups_limit_less_its_usage_is_the_headroom_the_tightest_level_counting(tmp_path, v2):
    root, membership = _cgroup(tmp_path, v2, {"": ("max" if v2 else str(1 << 62), "0"),
                                              "a": (str(900 << 20), str(100 << 20)),  # 800 MiB left
                                              "a/b": (str(2 << 30), str(1 << 30))})  # 1 GiB left
    assert model_limits.cgroup_headroom(root, membership) == 800 << 20
    root, membership = _cgroup(tmp_path / "none", v2, {"a/b": ("max" if v2 else str(1 << 62), "5")})
    assert model_limits.cgroup_headroom(root, membership) is None


def test_the_memory_check_takes_the_least_of_the_machine_rlimit_and_cgroup(monkeypatch):
    import torch

    from fp4pass.safetensors.files import CheckpointError

    monkeypatch.setattr(model_limits, "_machine_bytes", lambda: 64 << 30)
    monkeypatch.setattr(model_limits, "rlimit_headroom", lambda: 3 << 30)
    monkeypatch.setattr(model_limits, "cgroup_headroom", lambda: 5 << 30)
    assert model_limits.available_bytes(torch.device("cpu")) == 3 << 30
    monkeypatch.setattr(model_limits, "cgroup_headroom", lambda: 2 << 30)
    assert model_limits.available_bytes(torch.device("cpu")) == 2 << 30
    monkeypatch.setattr(model_limits, "rlimit_headroom", lambda: None)
    monkeypatch.setattr(model_limits, "cgroup_headroom", lambda: None)
    assert model_limits.available_bytes(torch.device("cpu")) == 64 << 30
    cfg = type("Cfg", (), {"num_attention_heads": 4})()
    batch = calib_data.Batch("x", torch.zeros((8, 4096), dtype=torch.int64))
    monkeypatch.setattr(model_limits, "rlimit_headroom", lambda: 1 << 30)
    with pytest.raises(CheckpointError, match="more than the 1 GiB available"):
        model_limits.check_attention_memory(cfg, [batch], torch.device("cpu"), "d.npz")


def test_rlimit_as_headroom_is_the_soft_limit_less_the_address_space_in_use(monkeypatch):
    import resource

    monkeypatch.setattr(resource, "getrlimit", lambda which: (8 << 30, resource.RLIM_INFINITY))
    monkeypatch.setattr(model_limits, "_small_text", lambda path: "Name:\tx\nVmSize:\t 2097152 kB\n"
                        if path == "/proc/self/status" else None)
    assert model_limits.rlimit_headroom() == (8 << 30) - (2 << 30)
    monkeypatch.setattr(resource, "getrlimit", lambda which: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    assert model_limits.rlimit_headroom() is None


def test_a_weight_scale_2_of_the_wrong_shape_is_named_by_its_shape_only(tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    from fp4pass.checkpoint import convert
    from fp4pass.checkpoint.validate import validate

    out = tmp_path / "out"
    convert(KIMI, out)
    shard = out / "model.safetensors"
    tensors = load_file(shard)
    name = "model.layers.0.mlp.experts.0.w1.weight_scale_2"
    value = float(tensors[name])
    tensors[name] = torch.tensor([value, value], dtype=torch.float32)  # w3's is [value]: one of two equal values
    save_file(tensors, shard, metadata={"format": "pt"})
    codes = [p["kind"] for p in validate(out)["problems"]]
    assert codes == ["dtype_shape"], codes
