"""Checkpoint calibration under hostile input: a config.json that lies about the model, text that is no Unicode,
one huge row of text, sequences whose attention cannot fit.

Each refusal is exit 2 with one line naming the field, row or flag, before the layer runner allocates anything
(the runner is replaced by one that fails the test), with nothing written, in ``calibrate`` and in
``convert --calib``. The memory figures are checked against the formula written out here; the tokens of a cut
row against the ``tokenizers`` package's own encoding of the whole row.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from cli_helpers import cli, one_line

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

ROOT = Path(__file__).resolve().parents[2] / "models" / "checkpoints"
TOKENS = ROOT / "calib_tokens.npz"


@pytest.fixture
def no_runner(monkeypatch):
    """The layer runner, replaced by one that fails: a refusal must come before it allocates anything."""
    import fp4pass.checkpoint.calibration as calibration

    def refuse(*args, **kwargs):
        raise AssertionError("the layer runner was built: the refusal came after the model was allocated")

    monkeypatch.setattr(calibration, "LayerRunner", refuse)


def lying_copy(tmp_path: Path, family: str, **fields) -> Path:
    src = shutil.copytree(ROOT / family, tmp_path / f"{family}_lies")
    config = json.loads((src / "config.json").read_text())
    config.update(fields)
    (src / "config.json").write_text(json.dumps(config))
    return src


def refused_by_both(capsys, tmp_path, src, data, *pieces, extra=()):
    """``calibrate`` and ``convert --calib``: exit 2, one line holding every piece, nothing written."""
    code, err = cli(capsys, "calibrate", src, "--data", data, "-o", tmp_path / "s.json", "--device", "cpu", *extra)
    line = one_line(err)
    assert code == 2 and all(p in line for p in pieces), line
    assert not (tmp_path / "s.json").exists()
    code, err = cli(capsys, "convert", src, "-o", tmp_path / "out", "--calib", data, "--device", "cpu", *extra)
    line2 = one_line(err)
    assert code == 2 and all(p in line2 for p in pieces), line2
    assert not (tmp_path / "out").exists()
    return line


@pytest.mark.parametrize("family,fields,pieces", [
    ("deepseek_v3", {"num_hidden_layers": 0}, ("config.json: num_hidden_layers is 0", "at least 1")),
    ("deepseek_v3", {"num_attention_heads": 0}, ("num_attention_heads is 0",)),
    ("gpt_oss", {"num_key_value_heads": 0}, ("num_key_value_heads is 0",)),
    ("gpt_oss", {"num_experts_per_tok": 0}, ("num_experts_per_tok is 0",)),
    ("deepseek_v3", {"num_hidden_layers": "2"}, ("num_hidden_layers is '2'", "whole number")),
    ("deepseek_v3", {"hidden_size": True}, ("hidden_size is True",)),
    ("deepseek_v3", {"num_experts_per_tok": 4}, ("num_experts_per_tok 4 is more than the 3 experts (n_routed_experts)",)),
    ("gpt_oss", {"num_experts_per_tok": 4}, ("num_experts_per_tok 4", "3 experts (num_local_experts)")),
    ("gpt_oss", {"num_attention_heads": 4, "num_key_value_heads": 3},
     ("num_attention_heads 4 is not a multiple of num_key_value_heads 3",)),
    ("deepseek_v3", {"hidden_act": "swishy"}, ("hidden_act 'swishy' is no activation transformers has", "silu")),
    ("deepseek_v3", {"num_hidden_layers": 10 ** 9}, ("num_hidden_layers 1000000000, but the shards hold 2 decoder",)),
    ("deepseek", {"num_hidden_layers": 3}, ("num_hidden_layers 3, but the shards hold 2 decoder",)),
    ("deepseek_v3", {"vocab_size": 10 ** 9}, ("config.json: vocab_size 1000000000:", "embed_tokens.weight [1000000000, 64]",
                                       "the shards hold [32, 64]", "(model.embed_tokens.weight)")),
    ("deepseek", {"vocab_size": 33}, ("config.json: vocab_size 33:", "[33, 64]", "[32, 64]")),
    ("deepseek_v3", {"hidden_size": 10 ** 9}, ("config.json: hidden_size 1000000000:",)),
    ("gpt_oss", {"intermediate_size": 10 ** 9}, ("config.json: intermediate_size 1000000000:",
                                                 "layers.0.mlp.experts.gate_up_proj [3, 64, 2000000000]")),
    ("deepseek_v3", {"moe_intermediate_size": 10 ** 6}, ("config.json: moe_intermediate_size 1000000:",)),
    ("deepseek_v3", {"n_routed_experts": 10 ** 6}, ("config.json: n_routed_experts 1000000:",
                                             "the shards hold [3, 64, 64]")),
    ("gpt_oss", {"head_dim": 10 ** 6}, ("config.json: head_dim 1000000:", "q_proj.weight [4000000, 64]")),
    ("deepseek", {"hc_mult": 10 ** 6}, ("transformers cannot build the deepseek_v4 model", "hc_mult 1000000")),
    ("deepseek_v3", {"n_group": 0}, ("n_group is 0",)),
    ("deepseek_v3", {"n_group": 2}, ("n_routed_experts 3 does not split into n_group 2 equal groups",)),
    ("deepseek_v3", {"topk_group": 2}, ("topk_group 2 is more than the n_group 1 groups",)),
    ("deepseek_v3", {"n_group": 3, "topk_group": 1},
     ("num_experts_per_tok 2 is more than the 1 experts of the topk_group 1 groups",)),
    ("deepseek_v3", {"rms_norm_eps": "x"}, ("transformers' deepseek_v3 config refuses it", "rms_norm_eps")),
])
def test_a_config_that_lies_is_refused_naming_the_field(tmp_path, capsys, no_runner, family, fields, pieces):
    src = lying_copy(tmp_path, family, **fields)
    line = refused_by_both(capsys, tmp_path, src, TOKENS, *pieces)
    assert str(src) in line
    if "the model it describes needs" in line:  # the fields blamed are the ones that lie, and only those
        blamed = line.split("config.json: ", 1)[1].split(": ")[0]
        assert {part.split()[0] for part in blamed.split(", ")} == set(fields), line


def test_a_config_that_tells_the_truth_gets_to_the_runner(no_runner):
    """The same checks pass the bundled examples (exactly as many layers and elements as the shards hold)."""
    import fp4pass.checkpoint

    for family in ("gpt_oss", "deepseek_v3", "deepseek"):
        with pytest.raises(AssertionError, match="the layer runner was built"):
            fp4pass.checkpoint.calibrate(ROOT / family, TOKENS, device="cpu")


def test_the_layer_bound_counts_tensors_where_no_name_has_a_layer_index():
    from fp4pass.checkpoint.model_limits import layers_held

    assert layers_held(["model.layers.10.w", "model.layers.9.w", "model.layers.1.w"]) == 11
    assert layers_held(["h.0.w", "h.1.w", "wte"]) == 3
    assert layers_held(["model.sublayers.5.w"]) == 1


# -- text ----------------------------------------------------------------------------------------------------------


def test_a_lone_surrogate_is_refused_naming_its_row(tmp_path, capsys, no_runner):
    """A JSON escape ``\\ud800`` makes a str that is no Unicode text (a .txt cannot hold one: it is UTF-8)."""
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "fine"}\n\n{"text": "a\\ud800b"}\n')
    refused_by_both(capsys, tmp_path, ROOT / "gpt_oss", data, f"{data}: row 3:", "lone surrogate",
                    extra=("--seq-len", "2"))


class _CountingTokenizer:
    """The tokenizers package's tokenizer, counting the characters each ``encode`` is given."""

    def __init__(self, inner):
        self.inner, self.encoded = inner, []

    def get_vocab(self, **kw):
        return self.inner.get_vocab(**kw)

    def encode(self, text, **kw):
        self.encoded.append(len(text))
        return self.inner.encode(text, **kw)


@pytest.fixture
def counting(monkeypatch):
    from tokenizers import Tokenizer

    made = []

    def from_file(path):
        made.append(_CountingTokenizer(Tokenizer.from_file(path)))
        return made[-1]

    monkeypatch.setattr("tokenizers.Tokenizer", type("T", (), {"from_file": staticmethod(from_file)}))
    return made


def _words(count: int, seed: int = 3) -> str:
    words = ["the", "model", "routing", "of", "experts", "a", "token", "layer,", "hidden", "state."]
    rng = np.random.default_rng(seed)
    return " ".join(words[i] for i in rng.integers(0, len(words), count))


@pytest.mark.parametrize("suffix", [".jsonl", ".txt"])
def test_one_huge_row_is_tokenized_only_as_far_as_the_samples_need(tmp_path, counting, caplog, suffix):
    """A 1.2 MB one-row text, 3 samples of 40 tokens: the tokenizer sees at most 120 x (its longest entry) + the
    slack of characters, and the tokens are the first 120 of the tokenizers package's encoding of the whole row;
    a note says the row was cut."""
    from tokenizers import Tokenizer

    from fp4pass.checkpoint.calib_data import CUT_SLACK, load_batches

    text = _words(200_000)
    data = tmp_path / f"d{suffix}"
    data.write_text(json.dumps({"text": text}) + "\n" if suffix == ".jsonl" else text)
    tokenizer = Tokenizer.from_file(str(ROOT / "gpt_oss" / "tokenizer.json"))
    longest = max(len(piece) for piece in tokenizer.get_vocab(with_added_tokens=True))
    with caplog.at_level(logging.INFO, logger="fp4pass"):
        batches = load_batches(data, ROOT / "gpt_oss", 32, seq_len=40, num_samples=3, batch_size=2)
    assert counting[-1].encoded == [120 * longest + CUT_SLACK] and 120 * longest + CUT_SLACK < len(text) // 100
    whole = tokenizer.encode(text, add_special_tokens=False).ids
    got = np.concatenate([b.input_ids.numpy() for b in batches])
    assert np.array_equal(got, np.asarray(whole[:120]).reshape(3, 40))
    notes = [r.getMessage() for r in caplog.records if "characters are tokenized" in r.getMessage()]
    assert len(notes) == 1 and f"row 1: only its first {120 * longest + CUT_SLACK}" in notes[0], notes


def test_rows_after_a_cut_start_where_the_tokens_still_wanted_leave_off(tmp_path, counting):
    """Three long rows and 2 samples of 30 tokens: the first row is cut at what 60 tokens can need, and no later
    row is read; then 2000 samples (more than the rows hold): every row whole, no cut."""
    from tokenizers import Tokenizer

    from fp4pass.checkpoint.calib_data import CUT_SLACK, load_batches

    rows = [_words(3000, seed) for seed in (1, 2, 3)]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": r}) + "\n" for r in rows))
    tokenizer = Tokenizer.from_file(str(ROOT / "gpt_oss" / "tokenizer.json"))
    longest = max(len(piece) for piece in tokenizer.get_vocab(with_added_tokens=True))
    load_batches(data, ROOT / "gpt_oss", 32, seq_len=30, num_samples=2)
    assert counting[-1].encoded == [60 * longest + CUT_SLACK]
    batches = load_batches(data, ROOT / "gpt_oss", 32, seq_len=30, num_samples=2000, batch_size=5000)
    assert counting[-1].encoded == [len(r) for r in rows]
    stream = [i for r in rows for i in tokenizer.encode(r, add_special_tokens=False).ids]
    n = len(stream) // 30
    assert np.array_equal(batches[0].input_ids.numpy(), np.asarray(stream[: n * 30]).reshape(n, 30))


@pytest.mark.slow
def test_a_48_mb_one_line_jsonl_keeps_memory_near_its_own_size(tmp_path):
    """Peak RSS of reading 2 samples of 16 tokens from a 48 MB one-line .jsonl, in a child process: before this
    rule the row was tokenized whole (the whole calibrate run peaked at 9.15 GB); now the line itself (bytes,
    its text, its JSON string) is the most held: under 300 MB over the process's size before the read."""
    text = _words(8_000_000)[:48_000_000]
    data = tmp_path / "big.jsonl"
    data.write_text(json.dumps({"text": text}) + "\n")
    del text
    script = (
        "import resource, sys\n"
        "from fp4pass.checkpoint.calib_data import load_batches\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        f"b = load_batches({str(data)!r}, {str(ROOT / 'gpt_oss')!r}, 32, seq_len=16, num_samples=2)\n"
        "print(b[0].input_ids.shape[0], (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == "2" and int(out[1]) < 300, out


# -- attention memory ----------------------------------------------------------------------------------------------


def test_sequences_whose_attention_cannot_fit_are_refused_naming_the_seq_len_that_fits(tmp_path, capsys, no_runner):
    """2 rows of 200,000 tokens, 4 heads: 2 x 4 x 200000^2 x 8 bytes = 2.56 TB, past any machine."""
    data = tmp_path / "long.npz"
    np.savez(data, input_ids=np.ones((2, 200_000), np.int64))
    line = refused_by_both(capsys, tmp_path, ROOT / "gpt_oss", data, f"{data}: eager attention over 2 sequence(s) "
                           "of 200000 tokens needs 2 x 4 heads x 200000 x 200000 x 8 bytes", "--seq-len ")
    from fp4pass.checkpoint.model_limits import available_bytes

    fits = int(line.split("--seq-len ")[1].split()[0])
    expect = math.isqrt(available_bytes(torch.device("cpu")) // (2 * 4 * 8))
    assert abs(fits - expect) <= 0.02 * expect  # the memory available may change meanwhile


@pytest.mark.parametrize("rows,tokens,available,fits_len,fits_rows", [
    (2, 32, 2 * 4 * 32 * 32 * 8, None, None),  # exactly fits
    (2, 32, 2 * 4 * 32 * 32 * 8 - 1, 31, 1),
    (4, 32, 3 * 4 * 32 * 32 * 8 + 5, 27, 3),
    (1, 32, 4 * 8 - 1, 0, 0),
])
def test_the_attention_bound_and_what_fits(rows, tokens, available, fits_len, fits_rows):
    from fp4pass.checkpoint.calib_data import Batch
    from fp4pass.checkpoint.model_limits import check_attention_memory
    from fp4pass.safetensors.files import CheckpointError

    cfg = type("Cfg", (), {"num_attention_heads": 4})()
    batches = [Batch("a", torch.zeros(1, 8, dtype=torch.int64)),
               Batch("b", torch.zeros(rows, tokens, dtype=torch.int64))]
    if fits_len is None:
        check_attention_memory(cfg, batches, torch.device("cpu"), "d.npz", available=available)
        return
    with pytest.raises(CheckpointError) as info:
        check_attention_memory(cfg, batches, torch.device("cpu"), "d.npz", available=available)
    text = str(info.value)
    assert text.startswith(f"d.npz: eager attention over {rows} sequence(s) of {tokens} tokens needs {rows} x 4 heads")
    assert (f"--seq-len {fits_len} fits" in text) == (fits_len > 0)
    assert ("no --seq-len fits" in text) == (fits_len == 0)
    assert (f"batches of {fits_rows} sequence(s)" in text) == (fits_rows > 0)


@pytest.mark.slow
def test_the_seq_len_named_then_runs(tmp_path, capsys, monkeypatch):
    """With 40,000 bytes available the bundled gpt-oss on 2 x 32 tokens is refused naming --seq-len 25
    (2 x 4 x 25^2 x 8 = 40,000); with --seq-len 25 it runs."""
    import fp4pass.checkpoint.calibration as calibration
    from fp4pass.checkpoint import model_limits

    monkeypatch.setattr(model_limits, "available_bytes", lambda device: 40_000)
    data = tmp_path / "d.npz"
    np.savez(data, input_ids=np.load(TOKENS)["input_ids"][:2])
    code, err = cli(capsys, "calibrate", ROOT / "gpt_oss", "--data", data, "-o", tmp_path / "s.json",
                    "--device", "cpu")
    assert code == 2 and "--seq-len 25 fits" in one_line(err)
    assert calibration.check_attention_memory is model_limits.check_attention_memory
    code, err = cli(capsys, "calibrate", ROOT / "gpt_oss", "--data", data, "-o", tmp_path / "s.json",
                    "--device", "cpu", "--seq-len", "25")
    assert code == 0, err
    assert json.loads((tmp_path / "s.json").read_text())["tensors"]


def test_a_jsonl_row_past_the_row_limit_and_a_txt_past_the_text_limit(tmp_path, monkeypatch):
    """A .jsonl row is read whole (one JSON object): a row of more than ROW_LIMIT bytes is refused naming it, one
    of exactly ROW_LIMIT bytes (newline included) is read. A .txt is read whole only without --num-samples: past
    TEXT_LIMIT bytes that is refused naming --num-samples, and with --num-samples it is read as far as needed."""
    from fp4pass.calib.errors import CalibrationDataError
    from fp4pass.checkpoint import calib_data

    monkeypatch.setattr(calib_data, "ROW_LIMIT", 64)
    monkeypatch.setattr(calib_data, "TEXT_LIMIT", 100)
    fits = json.dumps({"text": "a" * (63 - len(json.dumps({"text": ""})))}) + "\n"
    assert len(fits) == 64
    data = tmp_path / "d.jsonl"
    data.write_text(fits + json.dumps({"text": "b" * 60}) + "\n")
    assert calib_data.load_batches(data, ROOT / "gpt_oss", 32, seq_len=4, num_samples=1)[0].input_ids.shape == (1, 4)
    with pytest.raises(CalibrationDataError) as info:
        calib_data.load_batches(data, ROOT / "gpt_oss", 32, seq_len=4)
    assert str(info.value) == (f"{data}: row 2 is longer than 64 bytes (one JSON object is parsed whole: split the "
                               "text into rows)")
    text = tmp_path / "d.txt"
    text.write_text("the model " * 11)
    with pytest.raises(CalibrationDataError) as info:
        calib_data.load_batches(text, ROOT / "gpt_oss", 32, seq_len=4)
    assert str(info.value) == f"{text}: 110 bytes, more than the 100 read whole; give --num-samples (only what its " \
                              "samples need is read)"
    assert calib_data.load_batches(text, ROOT / "gpt_oss", 32, seq_len=4, num_samples=2)[0].input_ids.shape == (2, 4)
    text.write_text("the model " * 10)
    whole = calib_data.load_batches(text, ROOT / "gpt_oss", 32, seq_len=4, batch_size=100)
    assert whole[0].input_ids.shape == (25, 4)  # 100 bytes: read whole (the bundled tokenizer spells letters)
