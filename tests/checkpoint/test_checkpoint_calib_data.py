"""Checkpoint calibration's data, command line and per-layer statistics, each against an independent oracle.

- DATA (``fp4pass.checkpoint.calib_data``): the batches against numpy slices of the arrays written, text against
  the ``tokenizers`` package's own encoding of the same text, every refusal's file, row and position against the
  values planted;
- the command line (``fp4pass calibrate CKPT_DIR``): its table and summary against the token counts that forward
  pre-hooks on transformers' own model record (``tests/checkpoint/test_checkpoint_calibrate.py``'s oracle);
- the statistics of one layer (``_LayerStats``): the scales of hand-made rows against numpy's max, the slots of
  two experts and of gate/up and down kept apart by giving each its own value.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from cli_helpers import cli, one_line, run_cli
from fp4pass.calib.errors import CalibrationDataError
from fp4pass.checkpoint.calib_data import DEFAULT_BATCH_SIZE, DEFAULT_SEQ_LEN, load_batches

ROOT = Path(__file__).resolve().parents[2] / "models" / "checkpoints"
TOKENS = ROOT / "calib_tokens.npz"
VOCAB = 32  # the bundled checkpoints' vocab_size


def ids_array(rows: int, cols: int, dtype=np.int32, seed: int = 3) -> np.ndarray:
    """Distinct rows (each row's first token is its index mod VOCAB), so a row out of place shows."""
    ids = np.random.default_rng(seed).integers(0, VOCAB, size=(rows, cols)).astype(dtype)
    ids[:, 0] = np.arange(rows) % VOCAB
    return ids


def refused(match: str, data, folder=None, vocab: int = VOCAB, **kw) -> str:
    with pytest.raises(CalibrationDataError) as info:
        load_batches(data, folder or data.parent, vocab, **kw)
    text = str(info.value)
    assert match in text, text
    return text


# -- .npz ---------------------------------------------------------------------------------------------------


def test_npz_rows_come_in_batches_in_order(tmp_path):
    ids = ids_array(10, 6)
    np.savez(tmp_path / "d.npz", input_ids=ids)
    batches = load_batches(tmp_path / "d.npz", tmp_path, VOCAB, batch_size=4)
    assert [b.where for b in batches] == [f"{tmp_path / 'd.npz'}[{a}:{b}]" for a, b in ((0, 4), (4, 8), (8, 10))]
    for batch, start in zip(batches, (0, 4, 8)):
        assert batch.input_ids.dtype == torch.int64 and batch.attention_mask is None
        assert np.array_equal(batch.input_ids.numpy(), ids[start:start + 4])
        assert batch.tokens == batch.input_ids.numel()
    assert [b.tokens for b in batches] == [24, 24, 12]


def test_default_batch_size_and_a_zero_batch_size(tmp_path):
    np.savez(tmp_path / "d.npz", input_ids=ids_array(DEFAULT_BATCH_SIZE * 2 + 3, 2))
    batches = load_batches(tmp_path / "d.npz", tmp_path, VOCAB)
    assert [b.input_ids.shape[0] for b in batches] == [DEFAULT_BATCH_SIZE, DEFAULT_BATCH_SIZE, 3]
    for flag, kw in (("--batch-size", {"batch_size": 0}), ("--seq-len", {"seq_len": 0}),
                     ("--num-samples", {"num_samples": 0}), ("--batch-size", {"batch_size": -2})):
        value = next(iter(kw.values()))
        text = refused(f"{flag} must be at least 1, got {value}", tmp_path / "d.npz", **kw)
        assert text == f"{flag} must be at least 1, got {value}"


def test_seq_len_cuts_rows_and_num_samples_caps_them(tmp_path):
    ids = ids_array(7, 9, dtype=np.uint8)
    np.savez(tmp_path / "d.npz", input_ids=ids)
    batches = load_batches(tmp_path / "d.npz", tmp_path, VOCAB, seq_len=5, num_samples=5, batch_size=2)
    got = np.concatenate([b.input_ids.numpy() for b in batches])
    assert np.array_equal(got, ids[:5, :5]) and got.dtype == np.int64
    assert [b.input_ids.shape[0] for b in batches] == [2, 2, 1]
    longer = load_batches(tmp_path / "d.npz", tmp_path, VOCAB, seq_len=50, batch_size=100)
    assert len(longer) == 1 and np.array_equal(longer[0].input_ids.numpy(), ids)


def test_mask_counts_only_its_ones_and_an_all_ones_batch_has_none(tmp_path):
    ids = ids_array(3, 5)
    mask = np.ones((3, 5), np.int64)
    mask[1, 3:] = 0
    np.savez(tmp_path / "d.npz", input_ids=ids, attention_mask=mask)
    one = load_batches(tmp_path / "d.npz", tmp_path, VOCAB, batch_size=1)
    assert one[0].attention_mask is None and one[2].attention_mask is None
    assert np.array_equal(one[1].attention_mask.numpy(), mask[1:2]) and one[1].attention_mask.dtype == torch.int64
    assert [b.tokens for b in one] == [5, 3, 5]
    capped = load_batches(tmp_path / "d.npz", tmp_path, VOCAB, num_samples=2)  # the mask is capped with the rows
    assert capped[0].tokens == 8 and np.array_equal(capped[0].attention_mask.numpy(), mask[:2])
    whole = load_batches(tmp_path / "d.npz", tmp_path, VOCAB, batch_size=3)
    assert whole[0].tokens == 13 and np.array_equal(whole[0].attention_mask.numpy(), mask)
    # a bool mask reads the same; a mask of ones only is none at all
    np.savez(tmp_path / "b.npz", input_ids=ids, attention_mask=mask.astype(bool))
    from_bool = load_batches(tmp_path / "b.npz", tmp_path, VOCAB)[0].attention_mask
    assert np.array_equal(from_bool.numpy(), mask) and from_bool.dtype == torch.int64
    np.savez(tmp_path / "o.npz", input_ids=ids, attention_mask=np.ones((3, 5), np.int8))
    assert load_batches(tmp_path / "o.npz", tmp_path, VOCAB)[0].attention_mask is None
    # padding cut away by seq_len: the rows left are all ones
    cut = load_batches(tmp_path / "d.npz", tmp_path, VOCAB, seq_len=3)
    assert cut[0].attention_mask is None and cut[0].tokens == 9


@pytest.mark.parametrize("bad,row,col", [(-1, 2, 3), (VOCAB, 1, 0), (VOCAB + 7, 3, 4)])
def test_a_token_outside_the_vocabulary_names_its_row_and_position(tmp_path, bad, row, col):
    ids = ids_array(4, 6, dtype=np.int64)
    ids[row, col] = bad
    ids[3, 5] = VOCAB + 100  # a later one: the first is named
    np.savez(tmp_path / "d.npz", input_ids=ids)
    text = refused("outside the vocabulary", tmp_path / "d.npz")
    assert text == (f"{tmp_path / 'd.npz'}: row {row}: token id {bad} at position {col} is outside the vocabulary "
                    f"[0, {VOCAB})")
    ids[row, col] = VOCAB - 1  # the largest id is in
    ids[3, 5] = 0
    np.savez(tmp_path / "d.npz", input_ids=ids)
    assert load_batches(tmp_path / "d.npz", tmp_path, VOCAB)[0].input_ids.max() == VOCAB - 1


@pytest.mark.parametrize("arrays,message", [
    ({"input_ids": np.ones((2, 3), np.float64)}, "input_ids is float64, not integer token ids"),
    ({"input_ids": np.ones((6,), np.int64)}, "input_ids has shape [6]; expected [N, T]"),
    ({"input_ids": np.ones((2, 3, 1), np.int64)}, "input_ids has shape [2, 3, 1]; expected [N, T]"),
    ({"input_ids": np.ones((3, 0), np.int64)}, "input_ids [3, 0] is empty"),
    ({"ids": np.ones((2, 3), np.int64)}, "no array named input_ids"),
    ({"input_ids": np.ones((2, 3), np.int64), "attention_mask": np.ones((2, 4), np.int64)},
     "attention_mask [2, 4] does not match input_ids [2, 3]"),
    ({"input_ids": np.ones((2, 3), np.int64), "attention_mask": np.array([[1, 2, 1], [1, 1, 1]])},
     "attention_mask must hold 0 and 1 only"),
    ({"input_ids": np.ones((2, 3), np.int64), "attention_mask": np.ones((2, 3), np.float32)},
     "attention_mask must hold 0 and 1 only"),
    ({"input_ids": np.ones((4, 3), np.int64), "attention_mask": np.array([[1, 1, 0], [1, 0, 0], [0, 0, 0],
                                                                          [0, 0, 0]])},
     "row 2: attention_mask is all 0 (no token to calibrate on)"),
])
def test_bad_npz_names_the_file_and_what_is_wrong(tmp_path, arrays, message):
    np.savez(tmp_path / "d.npz", **arrays)
    assert refused(message, tmp_path / "d.npz") == f"{tmp_path / 'd.npz'}: {message}"


def test_a_row_whose_kept_positions_are_all_padding(tmp_path):
    mask = np.array([[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 1, 1]])
    np.savez(tmp_path / "d.npz", input_ids=ids_array(3, 4), attention_mask=mask)
    text = refused("all 0", tmp_path / "d.npz", seq_len=2)
    assert text == f"{tmp_path / 'd.npz'} (first 2 positions): row 2: attention_mask is all 0 (no token to calibrate on)"
    assert len(load_batches(tmp_path / "d.npz", tmp_path, VOCAB, seq_len=3)) == 1


# -- folders and paths ----------------------------------------------------------------------------------------


def test_a_folder_reads_its_npz_in_name_order_and_stops_at_num_samples(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    b, a = ids_array(4, 5, seed=1), ids_array(3, 5, seed=2)  # 5 columns: a count of columns is no row count
    a[:, 0] = 20 + np.arange(3)  # rows of a and b differ in their first token
    np.savez(data / "b.npz", input_ids=b)  # written first, read second
    np.savez(data / "a.npz", input_ids=a)
    (data / "c.npz").write_bytes(b"not an archive")  # past num_samples: never read
    (data / "notes.txt").write_text("ignored")
    batches = load_batches(data, tmp_path, VOCAB, num_samples=5, batch_size=2)
    assert [x.where for x in batches] == [f"{data / 'a.npz'}[0:2]", f"{data / 'a.npz'}[2:3]",
                                          f"{data / 'b.npz'}[0:2]"]
    got = np.concatenate([x.input_ids.numpy() for x in batches])
    assert np.array_equal(got, np.concatenate([a, b[:2]]))
    exact = load_batches(data, tmp_path, VOCAB, num_samples=3, batch_size=8)  # a alone holds 3
    assert len(exact) == 1 and np.array_equal(exact[0].input_ids.numpy(), a)
    one_more = load_batches(data, tmp_path, VOCAB, num_samples=4, batch_size=8)
    assert [x.where for x in one_more] == [f"{data / 'a.npz'}[0:3]", f"{data / 'b.npz'}[0:1]"]
    both = load_batches(data, tmp_path, VOCAB, num_samples=7, batch_size=8)  # a and b hold 7: c is not read
    cut = load_batches(data, tmp_path, VOCAB, num_samples=4, seq_len=2)
    assert np.array_equal(np.concatenate([x.input_ids.numpy() for x in cut]), np.concatenate([a[:, :2], b[:1, :2]]))
    assert np.array_equal(np.concatenate([x.input_ids.numpy() for x in both]), np.concatenate([a, b]))
    refused("not a readable .npz", data, folder=tmp_path)  # without num_samples, c is read


def test_paths_that_are_not_data(tmp_path):
    assert refused("no such file", tmp_path / "none.npz") == f"{tmp_path / 'none.npz'}: no such file or folder"
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "x.txt").write_text("x")
    assert refused("no .npz", tmp_path / "empty") == f"{tmp_path / 'empty'}: folder holds no .npz files"
    (tmp_path / "d.csv").write_text("1,2,3\n")
    assert refused("must be", tmp_path / "d.csv") == (
        f"{tmp_path / 'd.csv'}: calibration data must be an .npz of input_ids, a folder of them, or text "
        "(.jsonl, .txt)")
    (tmp_path / "dangling.npz").symlink_to(tmp_path / "gone")
    refused("dangling.npz", tmp_path / "dangling.npz")


# -- text -----------------------------------------------------------------------------------------------------


@pytest.fixture
def ckpt(tmp_path):
    """A folder holding the bundled tokenizer.json, and the tokenizers package's own tokenizer of it."""
    from tokenizers import Tokenizer

    folder = tmp_path / "ckpt"
    folder.mkdir()
    shutil.copy(ROOT / "gpt_oss" / "tokenizer.json", folder)
    return folder, Tokenizer.from_file(str(folder / "tokenizer.json"))


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


def test_jsonl_records_are_joined_in_order_and_cut_into_sequences(tmp_path, ckpt):
    folder, tokenizer = ckpt
    texts = ["the quick brown fox", "jumps over the lazy dog", "and once more, with feeling"]
    data = tmp_path / "d.jsonl"
    data.write_text(f'{json.dumps({"text": texts[0]})}\n\n   \n{json.dumps({"text": texts[1], "id": 4})}\n'
                    f'{json.dumps({"text": texts[2]})}\n')
    stream = [i for t in texts for i in encode(tokenizer, t)]
    batches = load_batches(data, folder, VOCAB, seq_len=7, batch_size=3)
    rows = len(stream) // 7
    got = np.concatenate([b.input_ids.numpy() for b in batches])
    assert np.array_equal(got, np.asarray(stream[: rows * 7]).reshape(rows, 7))
    assert [b.where for b in batches][0] == f"{data}[0:3]" and all(b.attention_mask is None for b in batches)
    capped = load_batches(data, folder, VOCAB, seq_len=7, num_samples=2, batch_size=3)
    assert np.array_equal(capped[0].input_ids.numpy(), np.asarray(stream[:14]).reshape(2, 7))


def test_txt_is_one_text_and_the_default_sequence_length(tmp_path, ckpt):
    folder, tokenizer = ckpt
    text = "a line of text.\n" * 200  # over one default sequence
    (tmp_path / "d.txt").write_text(text)
    stream = encode(tokenizer, text)
    assert len(stream) >= DEFAULT_SEQ_LEN
    batches = load_batches(tmp_path / "d.txt", folder, VOCAB)
    rows = len(stream) // DEFAULT_SEQ_LEN
    got = np.concatenate([b.input_ids.numpy() for b in batches])
    assert np.array_equal(got, np.asarray(stream[: rows * DEFAULT_SEQ_LEN]).reshape(rows, DEFAULT_SEQ_LEN))


def test_text_stops_at_the_tokens_it_needs(tmp_path, ckpt):
    """Records after the wanted ``num_samples * seq_len`` tokens are never tokenized: a later token outside a
    smaller vocabulary is not reached, and counts only when it is."""
    folder, tokenizer = ckpt
    first, later = "aaaa", "zzzz"
    n = len(encode(tokenizer, first))
    top = max(encode(tokenizer, first))
    assert max(encode(tokenizer, later)) > top
    data = tmp_path / "d.jsonl"
    data.write_text(f'{json.dumps({"text": first})}\n{json.dumps({"text": later})}\n')
    batches = load_batches(data, folder, top + 1, seq_len=n, num_samples=1)  # the first record, exactly
    assert np.array_equal(batches[0].input_ids.numpy(), np.asarray([encode(tokenizer, first)]))
    text = refused("outside the model's vocabulary", data, folder=folder, vocab=top + 1, seq_len=n,
                   num_samples=2)
    bad = [i for i in encode(tokenizer, later) if i > top][0]
    assert text == (f"{data}: row 2: token id {bad} from tokenizer.json is outside the model's vocabulary "
                    f"[0, {top + 1})")


@pytest.mark.parametrize("content,message", [
    (b'{"text": "fine"}\n\nnot json\n', "row 3: not JSON"),
    (b'{"text": "fine"}\n["text"]\n', 'row 2: expected an object with a string "text"'),
    (b'{"text": 5}\n', 'row 1: expected an object with a string "text"'),
    (b'{"txt": "x"}\n', 'row 1: expected an object with a string "text"'),
    (b'{"text": "ok"}\n{"text": "\xff"}\n', "not UTF-8 text (byte 25)"),
])
def test_bad_jsonl_names_its_row(tmp_path, ckpt, content, message):
    folder, _ = ckpt
    (tmp_path / "d.jsonl").write_bytes(content)
    text = refused(message, tmp_path / "d.jsonl", folder=folder, seq_len=1)
    assert text.startswith(f"{tmp_path / 'd.jsonl'}: {message}")


def test_text_without_a_usable_tokenizer_or_enough_tokens(tmp_path, ckpt):
    folder, tokenizer = ckpt
    (tmp_path / "d.txt").write_text("the cat")
    n = len(encode(tokenizer, "the cat"))
    assert refused("fewer than", tmp_path / "d.txt", folder=folder, seq_len=n + 1) == (
        f"{tmp_path / 'd.txt'}: {n} tokens, fewer than one sequence of --seq-len {n + 1}")
    assert load_batches(tmp_path / "d.txt", folder, VOCAB, seq_len=n)[0].input_ids.shape == (1, n)
    bare = tmp_path / "bare"
    bare.mkdir()
    assert refused("no tokenizer.json", tmp_path / "d.txt", folder=bare, seq_len=1) == (
        f"{tmp_path / 'd.txt'}: text needs the checkpoint's tokenizer, and {bare} has no tokenizer.json (give "
        "token ids in an .npz instead)")
    (bare / "tokenizer.json").write_text("{}")
    text = refused("the tokenizers package cannot read it", tmp_path / "d.txt", folder=bare, seq_len=1)
    assert text.startswith(f"{bare / 'tokenizer.json'}: the tokenizers package cannot read it (")


# -- one layer's statistics -----------------------------------------------------------------------------------


class _Experts(torch.nn.Module):
    def __init__(self, num: int = 3, hidden: int = 32, inter: int = 32):
        super().__init__()
        self.num_experts = num
        self.gate_up_proj = torch.nn.Parameter(torch.zeros(num, 2 * inter, hidden))
        self.down_proj = torch.nn.Parameter(torch.zeros(num, hidden, inter))


def _layer(hidden: int = 32) -> torch.nn.Module:
    layer = torch.nn.Module()
    layer.mlp = torch.nn.Module()
    layer.mlp.experts = _Experts(hidden=hidden)
    layer.attn = torch.nn.Module()
    layer.attn.wo_b = torch.nn.Linear(hidden, hidden, bias=False)
    return layer


def _runner(fused: bool, layer: int = 1):
    """The sources' map of a layer (checkpoint module -> (model path, expert, kind)), and another layer's entries
    (which must be left alone). The dense Linear has DeepSeek-V4's name, which sorts before the experts'."""
    from types import SimpleNamespace

    quantized = {}
    for i in (layer - 1, layer):
        stack = f"layers.{i}.mlp.experts"
        if fused:  # gpt-oss: one module per stack
            quantized[f"model.{stack}.gate_up_proj"] = (stack, None, "gate_up")
            quantized[f"model.{stack}.down_proj"] = (stack, None, "down")
        else:  # DeepSeek: w1 and w3 share the gate/up input
            for e in range(3):
                for proj, kind in (("w1", "gate_up"), ("w3", "gate_up"), ("w2", "down")):
                    quantized[f"model.{stack}.{e}.{proj}"] = (stack, e, kind)
        quantized[f"model.layers.{i}.attn.wo_b"] = (f"layers.{i}.attn.wo_b", None, "dense")
    return SimpleNamespace(sources=SimpleNamespace(quantized=quantized))


def _rows(peak: float, n: int = 4, width: int = 32, seed: int = 0) -> torch.Tensor:
    """``n`` rows whose largest magnitude is ``peak`` (at row n-1), the rest below it."""
    x = torch.from_numpy(np.random.default_rng(seed).uniform(-0.5, 0.5, (n, width)).astype(np.float32))
    x[n - 1, width // 2] = -peak
    return x


def _np_amax(x: torch.Tensor) -> float:
    return float(np.abs(x.numpy()).max())


def _want_scale(amax: float) -> float:
    return float(np.float32(amax) / np.float32(2688))


def _stats(fused: bool, calibrator: str = "max", detailed: bool = False):
    from fp4pass.calib.calibrators import make_calibrator
    from fp4pass.checkpoint.calibration import _LayerStats

    layer = _layer()
    stats = _LayerStats(_runner(fused), 1, make_calibrator(calibrator), torch.device("cpu"), detailed)
    undo = stats.install(layer)
    return stats, layer, undo


def _feed(stats, valid=None):
    """Experts 0 and 1 routed (each with its own gate/up and down peaks; 0 leads gate/up, 1 leads down), expert 2
    not; tokens 0..5 of a batch of 6, padding where ``valid`` is False."""
    stats.valid = valid
    rel = "mlp.experts"
    idx0, idx1 = torch.tensor([0, 2, 3, 5]), torch.tensor([1, 4, 5])
    stats.record(rel, 0, "gate_up", _rows(7.0, 4, seed=1), idx0)
    stats.record(rel, 0, "down", _rows(2.0, 4, seed=2), idx0)
    stats.record(rel, 1, "gate_up", _rows(5.0, 3, seed=3), idx1)
    stats.record(rel, 1, "down", _rows(3.0, 3, seed=4), idx1)


def test_each_expert_keeps_its_own_gate_up_and_down_and_the_unrouted_have_no_key():
    from fp4pass.checkpoint.calibration import CheckpointScales

    stats, layer, undo = _stats(fused=False)
    _feed(stats)
    x = _rows(1.5, 6).reshape(2, 3, 32)
    layer.attn.wo_b(x)
    out = CheckpointScales("max")
    stats.results(out)
    stack = "model.layers.1.mlp.experts"
    want = {f"{stack}.0.w1": 7.0, f"{stack}.0.w3": 7.0, f"{stack}.0.w2": 2.0, f"{stack}.1.w1": 5.0,
            f"{stack}.1.w3": 5.0, f"{stack}.1.w2": 3.0, "model.layers.1.attn.wo_b": 1.5}
    assert {k: v.amax for k, v in out.tensors.items()} == want
    for name, amax in want.items():
        assert out.tensors[name].g_amax == amax and out.tensors[name].input_scale == _want_scale(amax)
    assert [(r["expert"], r["tokens"]) for r in out.experts] == [(0, 4), (1, 3), (2, 0)]
    assert out.experts[1]["gate_up_amax"] == 5.0 and out.experts[1]["down_amax"] == 3.0
    assert out.experts[1]["gate_up_input_scale"] == _want_scale(5.0)
    assert out.experts[1]["down_input_scale"] == _want_scale(3.0)
    assert out.experts[0]["checkpoint_modules"] == [f"{stack}.0.w1", f"{stack}.0.w3", f"{stack}.0.w2"]
    assert "gate_up_amax" not in out.experts[2]
    assert out.unrouted == [{"module": "layers.1.mlp.experts", "expert": 2,
                             "checkpoint_modules": [f"{stack}.2.w1", f"{stack}.2.w3", f"{stack}.2.w2"]}]
    assert out.dense == [{"module": "model.layers.1.attn.wo_b", "amax": 1.5,
                          "input_scale": _want_scale(1.5)}]
    stats.remove(undo)
    assert "forward" not in vars(layer.mlp.experts) and not layer.attn.wo_b._forward_pre_hooks


def test_a_gpt_oss_stack_takes_its_largest_expert_per_projection():
    from fp4pass.checkpoint.calibration import CheckpointScales

    stats, _, _ = _stats(fused=True)
    _feed(stats)
    out = CheckpointScales("max")
    stats.results(out)
    stack = "model.layers.1.mlp.experts"
    assert {k: v.amax for k, v in out.tensors.items() if "experts" in k} == {f"{stack}.gate_up_proj": 7.0,
                                                                            f"{stack}.down_proj": 3.0}
    assert out.tensors[f"{stack}.down_proj"].input_scale == _want_scale(3.0)
    assert [(r["expert"], r["tokens"], r.get("down_amax")) for r in out.experts] == [(0, 4, 2.0), (1, 3, 3.0),
                                                                                    (2, 0, None)]
    assert [r["expert"] for r in out.unrouted] == [2]
    assert out.unrouted[0]["checkpoint_modules"] == [f"{stack}.gate_up_proj", f"{stack}.down_proj"]


def test_padding_is_left_out_of_the_experts_and_the_dense_linear():
    from fp4pass.checkpoint.calibration import CheckpointScales

    stats, layer, _ = _stats(fused=False)
    valid = torch.tensor([True, True, True, False, True, False])  # token 3 (expert 0's peak row) and 5 padding
    _feed(stats, valid)
    x = _rows(1.5, 6)
    x[3, 0] = 9.0  # padding: never counted
    layer.attn.wo_b(x.reshape(2, 3, 32))
    out = CheckpointScales("max")
    stats.results(out)
    stack = "model.layers.1.mlp.experts"
    assert [(r["expert"], r["tokens"]) for r in out.experts] == [(0, 2), (1, 2), (2, 0)]
    assert out.tensors[f"{stack}.0.w1"].amax == _np_amax(_rows(7.0, 4, seed=1)[[0, 1]])
    assert out.tensors[f"{stack}.0.w2"].amax == _np_amax(_rows(2.0, 4, seed=2)[[0, 1]])
    assert out.tensors[f"{stack}.1.w1"].amax == _np_amax(_rows(5.0, 3, seed=3)[[0, 1]])
    kept = _np_amax(x[valid])
    assert kept < 1.5 and out.tensors["model.layers.1.attn.wo_b"].amax == kept  # row 5 held 1.5


def test_an_expert_whose_tokens_are_all_padding_is_unrouted():
    from fp4pass.checkpoint.calibration import CheckpointScales

    stats, _, _ = _stats(fused=False)
    _feed(stats, torch.tensor([True, False, True, True, False, True]))  # expert 1's tokens 1, 4 and 5
    stats.valid = torch.tensor([True, False, True, True, False, False])
    stats.record("mlp.experts", 1, "gate_up", _rows(6.0, 3, seed=6), torch.tensor([1, 4, 5]))
    out = CheckpointScales("max")
    stats.results(out)
    assert [(r["expert"], r["tokens"]) for r in out.experts] == [(0, 4), (1, 1), (2, 0)]
    stats, _, _ = _stats(fused=False)
    stats.valid = torch.tensor([True, False, True, True, False, False])
    stats.record("mlp.experts", 1, "gate_up", _rows(6.0, 3, seed=6), torch.tensor([1, 4, 5]))
    stats.record("mlp.experts", 1, "down", _rows(6.0, 3, seed=6), torch.tensor([1, 4, 5]))
    out = CheckpointScales("max")
    stats.results(out)
    assert [r["expert"] for r in out.unrouted] == [0, 1, 2] and not any("w" in k for k in out.tensors
                                                                      if "experts" in k)


@pytest.mark.parametrize("calibrator,options", [("max", {}), ("headroom", {}), ("percentile", {}),
                                                ("headroom", {"b_min_percentile": 20.0, "b_max_percentile": 90.0})])
def test_the_layer_scale_equals_the_reports_scale_without_its_detail(calibrator, options):
    """Without ``detailed`` the scale skips the report's fractions and SNR; everything else equals the
    ONNX calibration's ``scale_for`` of the same statistic (B_min and B_max at the headroom calibrator's own
    percentiles)."""
    from fp4pass.calib.calibrators import make_calibrator
    from fp4pass.calib import scale_for
    from fp4pass.calib.stats import ActivationStats

    method = make_calibrator(calibrator, **options)
    stats, _, _ = _stats(fused=False, calibrator=calibrator)
    stats.method = method
    x = torch.from_numpy(np.random.default_rng(9).standard_t(3, (64, 64)).astype(np.float32))
    x[:, :16] = 0  # zero blocks
    mine = ActivationStats("x", abs_histogram=method.needs_abs_histogram)
    mine.update(x)
    got, ref = stats.scale(mine), scale_for(mine, method)
    for key in ("amax", "g_amax", "input_scale", "b_min", "b_max", "blocks", "zero_blocks", "note"):
        assert getattr(got, key) == getattr(ref, key), key
    assert got.zero_blocks == 64 and got.blocks == 256 and got.b_min > 0
    assert got.snr_db is None and got.subnormal_fraction is None and ref.snr_db is not None
    detailed, _, _ = _stats(fused=False, calibrator=calibrator, detailed=True)
    kept = detailed.stats[("mlp.experts", 0, "gate_up")]
    kept.update(x)
    assert detailed.scale(kept).snr_db is not None


# -- the command line -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hooked(tmp_path_factory):
    """Per bundled family: {(layer, expert): (tokens, gate/up amax, down amax)} recorded by forward pre-hooks on
    transformers' own model (the oracle of ``tests/checkpoint/test_checkpoint_calibrate.py``), batches of 4 rows."""
    from test_checkpoint_calibrate import FAMILIES, oracle

    cache: dict = {}

    def get(name: str) -> dict:
        if name not in cache:
            model_type, dense, _ = FAMILIES[name]
            cache[name] = oracle(ROOT / name, model_type, dense, tmp_path_factory.mktemp(name))
        return cache[name]
    return get


def _table(out: str) -> tuple[dict, list[str]]:
    lines = out.strip().splitlines()
    assert lines[0].split() == ["module", "tokens", "amax", "input_scale"]
    rows, unrouted = {}, []
    for line in lines[1:]:
        if line.startswith("unrouted "):
            unrouted.append(line)
            continue
        name, count, amax, scale = line.split()
        rows[name] = (count, amax, scale)
    return rows, unrouted


def test_calibrate_table_counts_each_modules_routed_tokens(tmp_path, capsys, hooked):
    """DeepSeek-V4: an expert's w1, w3 and w2 rows show its own token count and amax, the dense Linear "all";
    the unrouted experts are listed by name; the summary's figures are the run's."""
    expected = hooked("deepseek")["experts"]
    capsys.readouterr()  # transformers' loading bar
    code, out, err = run_cli(capsys, "calibrate", ROOT / "deepseek", "--data", TOKENS, "-o", tmp_path / "s.json",
                             "--batch-size", 4, "--device", "cpu")
    assert code == 0, err
    rows, unrouted = _table(out)
    written = json.loads((tmp_path / "s.json").read_text())["tensors"]
    assert set(rows) == set(written)
    for (layer, e), (tokens, gate_up, down) in expected.items():
        for proj, amax in (("w1", gate_up), ("w3", gate_up), ("w2", down)):
            name = f"layers.{layer}.ffn.experts.{e}.{proj}"
            if not tokens:
                assert name not in rows
                continue
            assert rows[name][:2] == (str(tokens), format(amax, ".5g")), name
            assert rows[name][2] == format(written[name]["input_scale"], ".5g")
    dense = [name for name in rows if ".experts." not in name]
    assert dense and all(rows[name][0] == "all" for name in dense)
    none = sorted((layer, e) for (layer, e), v in expected.items() if v[0] == 0)
    assert none and unrouted == [
        f"unrouted (no token routed; the layer's max fills it): expert {e} of layers.{layer}.ffn.experts.{e}.w1, "
        f"layers.{layer}.ffn.experts.{e}.w3, layers.{layer}.ffn.experts.{e}.w2" for layer, e in none]
    line = one_line(err)
    head, tail = line.split(" in ", 1)
    assert head == (f"fp4pass calibrate: {len(written)} module scales from {16 * 32} tokens (4 batches) through 2 "
                    "layers of deepseek_v4 on cpu")
    assert tail.endswith(f" s; {len(none)} expert(s) unrouted (they take their layer's max) -> {tmp_path / 's.json'}")


def test_calibrate_table_of_a_gpt_oss_stack_and_the_report(tmp_path, capsys, hooked):
    """A gpt-oss stack's row counts the tokens of all its experts; the report lists every expert's count, the
    unrouted ones, and (asked for with --report) each scale's SNR."""
    expected = hooked("gpt_oss")["experts"]
    capsys.readouterr()  # transformers' loading bar
    code, out, err = run_cli(capsys, "calibrate", ROOT / "gpt_oss", "--data", TOKENS, "-o", tmp_path / "s.json",
                             "--batch-size", 4, "--device", "cpu", "--report", tmp_path / "r.json")
    assert code == 0, err
    rows, unrouted = _table(out)
    layers = sorted({layer for layer, _ in expected})
    for layer in layers:
        total = sum(v[0] for (l, _), v in expected.items() if l == layer)
        for proj, at in (("gate_up_proj", 1), ("down_proj", 2)):
            top = max(v[at] for (l, _), v in expected.items() if l == layer)
            assert rows[f"model.layers.{layer}.mlp.experts.{proj}"][:2] == (str(total), format(top, ".5g"))
    report = json.loads((tmp_path / "r.json").read_text())
    assert {k: report[k] for k in ("calibrator", "model_type", "device", "layers", "batches", "tokens",
                                   "hidden_states_spilled_batches")} == {
        "calibrator": "max", "model_type": "gpt_oss", "device": "cpu", "layers": 2, "batches": 4, "tokens": 512,
        "hidden_states_spilled_batches": 0}
    assert report["seconds"] > 0 and set(report["timings_s"]) >= {"embed", "load", "layers", "scales"}
    got = {(int(r["module"].split(".")[1]), r["expert"]): r["tokens"] for r in report["experts"]}
    assert got == {k: v[0] for k, v in expected.items()}
    for r in report["experts"]:
        assert r["module"] == f"layers.{r['module'].split('.')[1]}.mlp.experts"
    none = {k for k, v in expected.items() if v[0] == 0}
    assert {(int(r["module"].split(".")[1]), r["expert"]) for r in report["unrouted_experts"]} == none
    assert len(unrouted) == len(none)
    tensors = {t["name"]: t for t in report["tensors"]}
    assert set(tensors) == set(rows) and all(t["snr_db"] is not None for t in tensors.values())
    assert report["dense"] == []


class _Spy:
    """Stands in for ``fp4pass.checkpoint.calibrate``: records its arguments, returns a small result."""

    def __init__(self):
        self.calls: list = []

    def __call__(self, src, data, **kw):
        from fp4pass.calib.scales import ActivationScale
        from fp4pass.checkpoint.calibration import CheckpointScales

        self.calls.append((str(src), str(data), kw))
        scale = ActivationScale(amax=2.0, g_amax=2.0, input_scale=2.0 / 2688, b_min=0.1, b_max=1.0, blocks=4,
                                zero_blocks=0)
        return CheckpointScales("max", {"m.layers.0.mlp.experts.0.w1": scale}, batches=3, model_type="deepseek_v3",
                                layers=1, tokens=96, seconds=1.25,
                                experts=[{"module": "layers.0.mlp.experts", "expert": 0, "tokens": 96,
                                          "checkpoint_modules": ["m.layers.0.mlp.experts.0.w1"]},
                                         {"module": "layers.0.mlp.experts", "expert": 1, "tokens": 0}],
                                unrouted=[{"module": "layers.0.mlp.experts", "expert": 1, "checkpoint_modules": []}])


@pytest.mark.parametrize("argv,want", [
    ([], {"calibrator": "max", "device": "auto", "batch_size": None, "seq_len": None, "num_samples": None,
          "show_progress": None, "report_detail": False, "trust_remote_code": False}),
    (["--calibrator", "headroom", "--rho", "4096", "--margin", "1.5", "--device", "cpu", "--batch-size", "3",
      "--seq-len", "7", "--num-samples", "9", "--quiet", "--report", "r.json", "--trust-remote-code"],
     {"calibrator": "headroom", "rho": 4096.0, "margin": 1.5, "device": "cpu", "batch_size": 3, "seq_len": 7,
      "num_samples": 9, "show_progress": False, "report_detail": True, "trust_remote_code": True}),
    (["--calibrator", "percentile", "--percentile", "99.5"],
     {"calibrator": "percentile", "percentile": 99.5, "device": "auto", "batch_size": None, "seq_len": None,
      "num_samples": None, "show_progress": None, "report_detail": False, "trust_remote_code": False}),
])
def test_calibrate_passes_its_flags(tmp_path, capsys, monkeypatch, argv, want):
    import fp4pass.checkpoint

    spy = _Spy()
    monkeypatch.setattr(fp4pass.checkpoint, "calibrate", spy)
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(capsys, "calibrate", ROOT / "deepseek_v3", "--data", TOKENS, "-o", "s.json", *argv)
    assert code == 0, err
    assert spy.calls == [(str(ROOT / "deepseek_v3"), str(TOKENS), want)]
    assert json.loads((tmp_path / "s.json").read_text())["tensors"]["m.layers.0.mlp.experts.0.w1"]["amax"] == 2.0
    assert ("--quiet" in argv) == (out == "")
    if out:  # an expert with no checkpoint module of its own (none quantized) is named by its stack
        assert _table(out) == ({"m.layers.0.mlp.experts.0.w1": ("96", "2", format(2.0 / 2688, ".5g"))},
                               ["unrouted (no token routed; the layer's max fills it): expert 1 of "
                                "layers.0.mlp.experts"])
    assert ("--quiet" in argv) == (err == "")  # --quiet: warnings and errors only
    if err:
        assert one_line(err) == ("fp4pass calibrate: 1 module scales from 96 tokens (3 batches) through 1 layers of "
                                 "deepseek_v3 on cpu in 1.2 s; 1 expert(s) unrouted (they take their layer's max) -> "
                                 "s.json")


@pytest.mark.parametrize("argv,want", [
    ([], {"calibrator": "max", "device": "auto", "batch_size": None, "seq_len": None, "num_samples": None,
          "show_progress": None, "report_detail": False, "trust_remote_code": False}),
    (["--calib-batch-size", "5", "--seq-len", "6", "--num-samples", "2", "--device", "cpu", "--calibrator",
      "percentile", "--quiet"],
     {"calibrator": "percentile", "device": "cpu", "batch_size": 5, "seq_len": 6, "num_samples": 2,
      "show_progress": False, "report_detail": False, "trust_remote_code": False}),
])
def test_convert_calib_passes_its_flags_and_the_scales(tmp_path, capsys, monkeypatch, argv, want):
    import fp4pass.checkpoint
    import fp4pass.checkpoint as api

    spy = _Spy()
    monkeypatch.setattr(fp4pass.checkpoint, "calibrate", spy)
    seen = {}

    def convert(src, out, **kw):
        seen.update(kw)
        raise SystemExit(0)
    monkeypatch.setattr(api, "convert", convert)
    code, err = cli(capsys, "convert", ROOT / "deepseek_v3", "-o", tmp_path / "o", "--calib", TOKENS, *argv)
    assert code == 0, err
    assert spy.calls == [(str(ROOT / "deepseek_v3"), str(TOKENS), want)]
    assert list(seen["scales"].tensors) == ["m.layers.0.mlp.experts.0.w1"]
    assert ("--quiet" in argv) == (err == "")  # --quiet: warnings and errors only
    assert err == "" or err.strip().endswith(f"-> {tmp_path / 'o'}")


@pytest.mark.parametrize("flags,message", [
    (["--provider", "cuda"], "--provider applies to ONNX models, not to checkpoint folders"),
    (["--allow-invalid"], "--allow-invalid applies to ONNX models, not to checkpoint folders"),
    (["--activation", "x"], "--activation applies to ONNX models, not to checkpoint folders"),
])
def test_calibrate_refuses_onnx_flags_for_a_folder(tmp_path, capsys, flags, message):
    code, err = cli(capsys, "calibrate", ROOT / "deepseek_v3", "--data", TOKENS, "-o", tmp_path / "s.json", *flags)
    assert code == 2 and one_line(err) == f"fp4pass calibrate: error: {message}"
    assert not (tmp_path / "s.json").exists()


@pytest.mark.parametrize("flags,flag", [(["--device", "cpu"], "--device"), (["--seq-len", "4"], "--seq-len"),
                                        (["--num-samples", "2"], "--num-samples")])
def test_folder_flags_are_refused_for_an_onnx_model(tmp_path, capsys, flags, flag):
    model = Path(__file__).resolve().parents[2] / "models" / "tiny_mlp.onnx"
    code, err = cli(capsys, "calibrate", model, "--data", TOKENS, "-o", tmp_path / "s.json", *flags)
    assert code == 2 and one_line(err).endswith(f"{flag} applies to checkpoint folders; {model} is not one")


def test_calib_with_scales_is_refused(tmp_path, capsys):
    (tmp_path / "s.json").write_text('{"calibrator": "max", "tensors": {}}')
    code, err = cli(capsys, "convert", ROOT / "deepseek_v3", "-o", tmp_path / "o", "--calib", TOKENS, "--scales",
                    tmp_path / "s.json")
    assert code == 2 and one_line(err).endswith("give --calib, --scales or --input-scale, not two of them")
    assert not (tmp_path / "o").exists()


# -- torch.distributed: two gloo ranks --------------------------------------------------------------------------

_RANK = """
import json, sys
import torch, torch.distributed as dist
sys.path.insert(0, sys.argv[4])
from test_checkpoint_calib_data import _rows, _stats
from fp4pass.checkpoint.calibration import CheckpointScales
from fp4pass.checkpoint.layerwise.runner import share_batches
rank, store, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2)
stats, _, _ = _stats(fused=False)
for expert, kind, peak, n, seed in RECORDS[rank]:
    stats.record("mlp.experts", expert, kind, _rows(peak, n, seed=seed), torch.arange(n))
stats.reduce()
result = CheckpointScales("max")
stats.results(result)
json.dump({"share": share_batches(list(range(7))), "amax": {k: v.amax for k, v in result.tensors.items()},
           "tokens": [r["tokens"] for r in result.experts], "unrouted": [r["expert"] for r in result.unrouted]},
          open(out, "w"))
dist.destroy_process_group()
"""
#: per rank: (expert, kind, peak, rows, seed); expert 0's gate/up peak on rank 0, expert 1's down peak on rank 1
_RECORDS = {0: [(0, "gate_up", 7.0, 4, 1), (0, "down", 2.0, 4, 2), (1, "gate_up", 4.0, 2, 3), (1, "down", 1.0, 2, 4)],
            1: [(0, "gate_up", 1.0, 3, 5), (0, "down", 6.0, 3, 6), (1, "gate_up", 5.0, 5, 7), (1, "down", 8.0, 5, 8)]}


def test_two_ranks_share_the_batches_and_reduce_counts_and_amax(tmp_path):
    """Rank r takes batches r, r + 2, ...; after the all-reduce both ranks hold every expert's summed token count,
    the max over ranks of each amax, and the same unrouted expert."""
    import os
    import subprocess
    import sys

    here = Path(__file__).resolve().parent  # this file's folder (its helpers are imported), under tests/
    script = _RANK.replace("RECORDS", repr(_RECORDS))
    paths = [str(here.parents[1]), str(here.parent / "support"), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    here = str(here)
    ranks = [subprocess.Popen([sys.executable, "-c", script, str(r), str(tmp_path / "store"),
                               str(tmp_path / f"r{r}.json"), here], env=env) for r in range(2)]
    assert [p.wait(timeout=120) for p in ranks] == [0, 0]
    stack = "model.layers.1.mlp.experts"
    want = {f"{stack}.0.w1": 7.0, f"{stack}.0.w3": 7.0, f"{stack}.0.w2": 6.0, f"{stack}.1.w1": 5.0,
            f"{stack}.1.w3": 5.0, f"{stack}.1.w2": 8.0}
    for r in range(2):
        got = json.loads((tmp_path / f"r{r}.json").read_text())
        assert got["share"] == list(range(7))[r::2]
        assert {k: v for k, v in got["amax"].items() if "experts" in k} == want
        assert got["tokens"] == [4 + 3, 2 + 5, 0] and got["unrouted"] == [2]


def test_text_that_is_not_a_regular_file_and_a_txt_s_one_row(tmp_path, ckpt):
    """A .txt or .jsonl is read only as a regular file (refused as calibration data, naming it); a .txt is one
    record, row 1, even when it holds JSON lines."""
    folder, tokenizer = ckpt
    (tmp_path / "z.txt").symlink_to("/dev/zero")
    assert refused("only regular", tmp_path / "z.txt", folder=folder).startswith(f"{tmp_path / 'z.txt'}: ")
    text = '{"text": "aaaa"}\n{"text": "zzzz"}\n'
    (tmp_path / "d.txt").write_text(text)
    ids = encode(tokenizer, text)
    top = max(ids)
    assert refused("outside", tmp_path / "d.txt", folder=folder, vocab=top, seq_len=1) == (
        f"{tmp_path / 'd.txt'}: row 1: token id {top} from tokenizer.json is outside the model's vocabulary "
        f"[0, {top})")
    batches = load_batches(tmp_path / "d.txt", folder, top + 1, seq_len=len(ids))
    assert np.array_equal(batches[0].input_ids.numpy(), np.asarray([ids]))


def test_text_ids_at_both_ends_of_the_vocabulary_and_no_special_tokens(tmp_path, ckpt):
    """Id 0 (the tokenizer's unknown token) and vocab_size - 1 are in, vocab_size is out and named (the first
    of several); a tokenizer whose post-processor adds a BOS token adds none here (raw text is cut into
    sequences, so no sequence starts with one)."""
    from tokenizers.processors import TemplateProcessing

    folder, tokenizer = ckpt
    (tmp_path / "d.txt").write_text("a!bzyx")
    ids = encode(tokenizer, "a!bzyx")
    assert 0 in ids and ids[-3:] == sorted(ids[-3:], reverse=True)  # z > y > x: the first bad is the largest
    top = max(ids)
    assert np.array_equal(load_batches(tmp_path / "d.txt", folder, top + 1, seq_len=len(ids))[0].input_ids.numpy(),
                          np.asarray([ids]))
    second = sorted(set(ids))[-3]  # x: z and y are outside [0, x)
    assert refused("outside", tmp_path / "d.txt", folder=folder, vocab=second, seq_len=1).endswith(
        f"row 1: token id {top} from tokenizer.json is outside the model's vocabulary [0, {second})")
    tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", VOCAB - 2)])
    tokenizer.save(str(folder / "tokenizer.json"))
    assert tokenizer.encode("a!bzyx").ids[0] == VOCAB - 2 and encode(tokenizer, "a!bzyx") == ids
    batches = load_batches(tmp_path / "d.txt", folder, VOCAB, seq_len=len(ids))
    assert np.array_equal(batches[0].input_ids.numpy(), np.asarray([ids]))


def test_fewer_batches_than_ranks_is_refused_on_every_rank(monkeypatch):
    """Rank r of W takes batches r, r + W, ...; with fewer batches than ranks every rank refuses alike (a rank
    left without a batch would otherwise leave the others waiting in the all-reduce)."""
    import torch.distributed as dist

    import fp4pass.calib.distributed
    from fp4pass.checkpoint.layerwise.runner import share_batches

    monkeypatch.setattr(fp4pass.calib.distributed, "distributed_ready", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda *a: 3)
    for rank in range(3):
        monkeypatch.setattr(dist, "get_rank", lambda *a, r=rank: r)
        assert share_batches(list(range(8))) == list(range(8))[rank::3]
        assert share_batches(list(range(3))) == [rank]
        with pytest.raises(CalibrationDataError) as info:
            share_batches(list(range(2)))
        assert str(info.value) == ("2 calibration batch(es) for 3 ranks: each rank needs at least one (a smaller "
                                   "batch size gives more)")


@pytest.mark.parametrize("command", ["calibrate", "convert"])
def test_checkpoint_calibration_flags_in_help_and_their_refusals(tmp_path, capsys, command):
    """Each flag under its name and metavar, with its default in the help; a value below 1 or a device not in
    the list is argparse's exit 2 naming the flag; --calib-batch-size is convert's only."""
    import re

    head = ["calibrate", ROOT / "deepseek_v3", "--data", TOKENS, "-o", tmp_path / "s.json"] if command == "calibrate" else \
        ["convert", ROOT / "deepseek_v3", "-o", tmp_path / "o", "--calib", TOKENS]
    from fp4pass.cli import main

    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert exit_.value.code == 0
    for piece in ("--device {auto,cpu,cuda} checkpoint calibration: where each layer runs (auto: CUDA when torch has "
                  "a GPU)", "--seq-len T checkpoint calibration: tokens per sequence (text is cut into sequences "
                  "of T; default 512; longer .npz rows are cut)", "--num-samples N checkpoint calibration: at most "
                  "N sequences (default: all of DATA)"):
        assert piece in text, piece
    batch = "--calib-batch-size B checkpoint calibration: sequences per forward batch (default 8)"
    assert (batch in text) == (command == "convert")
    flags = [("--seq-len", "0"), ("--num-samples", "-1"), ("--device", "gpu")]
    flags += [("--calib-batch-size", "0")] if command == "convert" else []
    for flag, value in flags:
        code, err = cli(capsys, *head, flag, value)
        line = one_line(err.strip().splitlines()[-1])
        assert code == 2 and re.search(f"argument {flag}: .*{re.escape(value)}", line), line
    if command == "calibrate":
        code, err = cli(capsys, *head, "--calib-batch-size", "2")
        assert code == 2 and "unrecognized arguments: --calib-batch-size 2" in err
    assert not (tmp_path / "s.json").exists() and not (tmp_path / "o").exists()


@pytest.mark.parametrize("calibrator,detailed", [("max", False), ("max", True), ("percentile", False),
                                                 ("mse", False)])
def test_each_statistic_keeps_what_its_calibrator_reads(calibrator, detailed):
    """A block sample (reservoir and top blocks, the calibrator's sizes) only for the mse sweep or the report's
    SNR; a histogram of |x| only for the percentile calibrator; each statistic named after its module (an
    expert's: stack, expert and slot); 16-value blocks along the rows' last dimension."""
    from fp4pass.calib.calibrators import make_calibrator

    method = make_calibrator(calibrator)
    stats, layer, _ = _stats(fused=False, calibrator=calibrator, detailed=detailed)
    sampled = detailed or calibrator == "mse"
    for key, stat in stats.stats.items():
        assert stat.sample.capacity == (method.reservoir if sampled else 0), key
        assert stat.sample.top_k == (method.top_k if sampled else 0), key
        assert (stat.abs_histogram is not None) == (calibrator == "percentile"), key
    assert stats.stats[("mlp.experts", 2, "down")].name == "mlp.experts.2.down"
    assert stats.stats[("attn.wo_b", None, "dense")].name == "model.layers.1.attn.wo_b"
    assert stats.names[("mlp.experts", 2, "gate_up")] == ["model.layers.1.mlp.experts.2.w1",
                                                          "model.layers.1.mlp.experts.2.w3"]
    assert len(stats.stats) == 3 * 2 + 1  # layer 0's modules are not this layer's
    _feed(stats)
    layer.attn.wo_b(_rows(1.5, 6).reshape(2, 3, 32))
    assert stats.stats[("mlp.experts", 0, "gate_up")].blocks == 4 * 32 // 16
    assert stats.stats[("attn.wo_b", None, "dense")].blocks == 6 * 32 // 16
    assert stats.tokens == {("mlp.experts", 0): 4, ("mlp.experts", 1): 3, ("mlp.experts", 2): 0}


def test_calibrate_never_writes_over_its_inputs(tmp_path, capsys):
    """-o and --report are checked against CKPT_DIR, --data and each other before the run, each named by its
    flag; the data is left as it was."""
    ckpt = shutil.copytree(ROOT / "deepseek_v3", tmp_path / "ckpt")
    data = Path(shutil.copy(TOKENS, tmp_path / "d.npz"))
    before = data.read_bytes()
    for flags, message in [
        (["-o", data], f"-o {data}: refusing to write over the input {data} (--data)"),
        (["-o", tmp_path / "s.json", "--report", ckpt / "r.json"],
         f"--report {ckpt / 'r.json'}: is inside the input folder {ckpt} (CKPT_DIR)"),
        (["-o", tmp_path / "s.json", "--report", tmp_path / "s.json"],
         f"--report {tmp_path / 's.json'}: the same file as -o {tmp_path / 's.json'}"),
    ]:
        code, err = cli(capsys, "calibrate", ckpt, "--data", data, *flags)
        assert code == 2 and one_line(err).endswith(message), err
    assert data.read_bytes() == before and not (tmp_path / "s.json").exists() and not (ckpt / "r.json").exists()


def test_statistics_live_on_the_layers_device_and_only_quantized_stacks_are_hooked():
    """Each statistic is made on the device the layer runs on (here torch's meta device, which any other
    device tells apart); an expert stack the checkpoint does not quantize, met first, is left alone and the
    quantized one after it is still hooked."""
    from fp4pass.calib.calibrators import make_calibrator
    from fp4pass.checkpoint.calibration import _LayerStats

    stats = _LayerStats(_runner(fused=False), 1, make_calibrator("max"), torch.device("meta"), False)
    assert stats.stats and all(s.device.type == "meta" and s.amax.device.type == "meta" for s in stats.stats.values())
    layer = torch.nn.Module()
    layer.mlp = torch.nn.Module()
    layer.mlp.bf16_experts = _Experts()  # registered first: named_modules meets it first
    layer.mlp.experts = _Experts()
    layer.attn = torch.nn.Module()
    layer.attn.wo_b = torch.nn.Linear(32, 32, bias=False)
    fused = _LayerStats(_runner(fused=True), 1, make_calibrator("max"), torch.device("cpu"), False)
    undo = fused.install(layer)
    assert "forward" in vars(layer.mlp.experts) and "forward" not in vars(layer.mlp.bf16_experts)
    assert sorted(k for k in fused.stats if k[0] == "mlp.experts") == [
        ("mlp.experts", e, kind) for e in range(3) for kind in ("down", "gate_up")]
    fused.remove(undo)
    assert "forward" not in vars(layer.mlp.experts)


def test_arrays_beside_input_ids_are_never_read(tmp_path):
    """Only input_ids and attention_mask are read: another array, even one numpy would have to unpickle, is
    left alone."""
    ids = ids_array(2, 4)
    np.savez(tmp_path / "d.npz", input_ids=ids, meta=np.array([{"source": "web"}], dtype=object))
    assert np.array_equal(load_batches(tmp_path / "d.npz", tmp_path, VOCAB)[0].input_ids.numpy(), ids)


def test_an_expert_with_a_module_left_unquantized():
    """An expert whose down projection the checkpoint keeps unquantized: its rows still run and count, its
    gate/up modules get their scale, and no key or statistic appears for the missing one; the token count is
    the gate/up rows'."""
    from fp4pass.calib.calibrators import make_calibrator
    from fp4pass.checkpoint.calibration import CheckpointScales, _LayerStats

    runner = _runner(fused=False)
    del runner.sources.quantized["model.layers.1.mlp.experts.2.w2"]
    stats = _LayerStats(runner, 1, make_calibrator("max"), torch.device("cpu"), False)
    stats.install(_layer())
    assert ("mlp.experts", 2, "down") not in stats.stats
    stats.record("mlp.experts", 2, "gate_up", _rows(4.0, 5, seed=11), torch.arange(5))
    stats.record("mlp.experts", 2, "down", _rows(9.0, 5, seed=12), torch.arange(5))
    stats.record("mlp.experts", 0, "gate_up", _rows(3.0, 2, seed=13), torch.arange(2))  # no down rows at all
    out = CheckpointScales("max")
    stats.results(out)
    stack = "model.layers.1.mlp.experts"
    assert {k: v.amax for k, v in out.tensors.items() if ".2." in k} == {f"{stack}.2.w1": 4.0, f"{stack}.2.w3": 4.0}
    assert out.experts[2]["checkpoint_modules"] == [f"{stack}.2.w1", f"{stack}.2.w3"]
    assert [r["tokens"] for r in out.experts] == [2, 0, 5]


def test_a_special_file_among_the_data_folder_is_refused(tmp_path):
    """A FIFO named like an .npz is refused by name before any file of the folder is read (never opened: that
    would wait for a writer)."""
    import os

    data = tmp_path / "data"
    data.mkdir()
    np.savez(data / "a.npz", input_ids=ids_array(2, 3))
    os.mkfifo(data / "b.npz")
    assert refused("FIFO", data, folder=tmp_path).startswith(f"{data / 'b.npz'}: a FIFO")


def test_an_all_zero_statistic_and_a_stack_the_layer_lacks():
    """A statistic that saw only zeros: amax, B_min and B_max 0, as the ONNX calibration's ``scale_for`` gives;
    a quantized stack the built layer does not hold (never met by install) gives no expert rows."""
    from fp4pass.calib.calibrators import make_calibrator
    from fp4pass.calib import scale_for
    from fp4pass.calib.stats import ActivationStats
    from fp4pass.checkpoint.calibration import CheckpointScales, _LayerStats

    method = make_calibrator("max")
    stats = _LayerStats(_runner(fused=True), 1, method, torch.device("cpu"), False)
    zero = ActivationStats("z")
    zero.update(torch.zeros(4, 32))
    got, ref = stats.scale(zero), scale_for(zero, method)
    assert (got.amax, got.b_min, got.b_max, got.blocks, got.zero_blocks) == (0.0, 0.0, 0.0, 8, 8)
    assert (got.b_min, got.b_max, got.g_amax, got.note) == (ref.b_min, ref.b_max, ref.g_amax, ref.note)
    bare = torch.nn.Module()
    bare.attn = torch.nn.Module()
    bare.attn.wo_b = torch.nn.Linear(32, 32, bias=False)
    stats.install(bare)
    bare.attn.wo_b(_rows(2.5, 3))
    out = CheckpointScales("max")
    stats.results(out)
    assert out.experts == [] and out.unrouted == [] and list(out.tensors) == ["model.layers.1.attn.wo_b"]


def test_an_expert_whose_gate_up_is_unquantized_keeps_its_down_scale():
    from fp4pass.calib.calibrators import make_calibrator
    from fp4pass.checkpoint.calibration import CheckpointScales, _LayerStats

    runner = _runner(fused=False)
    for proj in ("w1", "w3"):
        del runner.sources.quantized[f"model.layers.1.mlp.experts.2.{proj}"]
    stats = _LayerStats(runner, 1, make_calibrator("max"), torch.device("cpu"), False)
    stats.install(_layer())
    stats.record("mlp.experts", 2, "gate_up", _rows(4.0, 5, seed=11), torch.arange(5))
    stats.record("mlp.experts", 2, "down", _rows(9.0, 5, seed=12), torch.arange(5))
    out = CheckpointScales("max")
    stats.results(out)
    stack = "model.layers.1.mlp.experts"
    assert {k: v.amax for k, v in out.tensors.items() if ".2." in k} == {f"{stack}.2.w2": 9.0}
    assert out.experts[2]["checkpoint_modules"] == [f"{stack}.2.w2"] and out.experts[2]["tokens"] == 5
    # none of an expert's modules quantized: it has no statistic, so it is listed as unrouted, with no module
    del runner.sources.quantized[f"{stack}.2.w2"]
    stats = _LayerStats(runner, 1, make_calibrator("max"), torch.device("cpu"), False)
    stats.install(_layer())
    out = CheckpointScales("max")
    stats.results(out)
    assert "checkpoint_modules" not in out.experts[2]
    assert out.unrouted[-1] == {"module": "layers.1.mlp.experts", "expert": 2, "checkpoint_modules": []}
