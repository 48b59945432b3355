"""The inputs of ``convert --check`` and ``diff``: given (--inputs, --shape), made from the graph's own shapes
(KV-cache decoders: past length, head dim, attention mask), and a note whenever values are made up."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest

from fp4pass.cli import main
from fp4pass.onnx.feeds import plan_feeds
from fp4pass.onnx.numerics import make_inputs

ROOT = Path(__file__).resolve().parents[2]
GENAI = ROOT / "tests" / "fixtures" / "ortgenai_gptoss"
MOE = str(ROOT / "models" / "moe.onnx")


def _genai_config() -> dict:
    return json.loads((GENAI / "genai_config.json").read_text())["model"]["decoder"]


def test_kv_cache_feeds_follow_the_graph_and_the_given_ids():
    """Dims against the builder's own genai_config.json: head_size, kv heads, the sliding window's size."""
    config = _genai_config()
    model = ir.load(GENAI / "model.onnx")
    ids = np.arange(5, dtype=np.int64).reshape(1, 5)
    notes = []
    given, shapes = plan_feeds(model, {"input_ids": ids}, {}, past_length=3, notes=notes)
    head, kv_heads = config["head_size"], config["num_key_value_heads"]
    window = config["sliding_window"]["window_size"]
    assert shapes["past_key_values.1.key"] == (1, kv_heads, 3, head)  # full attention: the past length
    assert shapes["past_key_values.1.value"] == (1, kv_heads, 3, head)
    assert shapes["past_key_values.0.key"] == (1, kv_heads, window, head)  # sliding window: a ring buffer
    np.testing.assert_array_equal(given["attention_mask"], np.ones((1, 3 + 5), np.int64))
    assert "past length 3" in notes[-1]
    feeds = make_inputs(model, {"input_ids": ids}, past_length=3)
    assert feeds["past_key_values.1.key"].shape == (1, 1, 3, 64) and feeds["attention_mask"].shape == (1, 8)


def test_shared_dim_names_agree_and_open_ones_are_named_once():
    model = ir.load(GENAI / "model.onnx")
    notes = []
    feeds = make_inputs(model, notes=notes)
    assert feeds["input_ids"].shape == (1, 1) and feeds["attention_mask"].shape == (1, 1)
    assert feeds["past_key_values.1.key"].shape == (1, 1, 0, 64)
    assert sum("taken as 1" in n for n in notes) == 1 and "'batch_size', 'sequence_length'" in " ".join(notes)
    assert any("made up (random values, seed 0)" in n and "input_ids" in n for n in notes)


def test_convert_check_inputs_on_the_onnxruntime_genai_fixture(tmp_path, capsys):
    data = tmp_path / "ids.npz"
    np.savez(data, input_ids=np.array([[3, 1, 4, 1, 5, 9]], np.int64))
    out, report = tmp_path / "out.onnx", tmp_path / "report.json"
    code = main(["convert", str(GENAI / "model.onnx"), "-o", str(out), "--check", "--inputs", str(data),
                 "--report", str(report)])
    err = capsys.readouterr().err
    assert code == 0, err
    check = json.loads(report.read_text())["check"]
    assert check["passed"]
    logits = next(o for o in check["outputs"] if o["name"] == "logits")
    assert logits["shape"] == [1, 6, 64]  # the given ids ran, not a made-up token
    assert "past_key_values.1.key [1, 1, 0, 64]" in err and "all ones" in err
    # past length named by the user
    code = main(["convert", str(GENAI / "model.onnx"), "-o", str(out), "--check", "--inputs", str(data),
                 "--past-length", "2"])
    err = capsys.readouterr().err
    assert code == 0 and "past_key_values.1.key [1, 1, 2, 64]" in err and "[1, 8] all ones" in err


def test_convert_check_says_when_it_runs_on_made_up_inputs(tmp_path, capsys):
    out = tmp_path / "out.onnx"
    assert main(["convert", MOE, "-o", str(out), "--check"]) == 0
    err = capsys.readouterr().err
    assert "note: inputs ['x'] are not given: made up (random values" in err
    x = tmp_path / "x.npz"
    np.savez(x, x=np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32))
    assert main(["convert", MOE, "-o", str(out), "--check", "--inputs", str(x), "--shape", "x=4,64"]) == 0
    assert "made up" not in capsys.readouterr().err
    # --quiet: no note lines at all
    assert main(["convert", MOE, "-o", str(out), "--check", "--quiet"]) == 0
    assert "note:" not in capsys.readouterr().err
    assert main(["diff", MOE, MOE, "--quiet"]) == 0
    assert "note:" not in capsys.readouterr().err


@pytest.mark.parametrize("flag", [["--inputs", "x.npz"], ["--shape", "x=1,64"], ["--past-length", "4"]])
def test_check_input_flags_need_check(tmp_path, capsys, flag):
    code = main(["convert", MOE, "-o", str(tmp_path / "o.onnx"), *flag])
    err = capsys.readouterr().err
    assert code == 2 and f"{flag[0]} applies to --check" in err and not (tmp_path / "o.onnx").exists()


def test_a_ring_buffer_present_is_defined_beyond_the_new_rows():
    """Layer 0 of the genai fixture reads a 128-row sliding-window cache; onnxruntime writes only the 6 new rows of
    present.0.*. The rest must be the past's own values (numpy's feed, the oracle), the same on every run, not
    whatever the allocator held (zeros or garbage: never the random past)."""
    from fp4pass.onnx.loading import load
    from fp4pass.onnx.numerics import _Runner, make_inputs

    notes = []
    given = {"input_ids": np.array([[3, 1, 4, 1, 5, 9]], np.int64)}
    runner = _Runner(load(GENAI / "model.onnx").model, "cpu", "genai", notes, fed=given)
    feeds = make_inputs(runner.model, given, notes=notes)
    first, second = runner.run(feeds), runner.run(feeds)
    for kind in ("key", "value"):
        past, present = feeds[f"past_key_values.0.{kind}"], first[f"present.0.{kind}"]
        assert present.shape == past.shape == (1, 1, 128, 64)
        np.testing.assert_array_equal(present[:, :, 6:], past[:, :, 6:])
        assert not np.array_equal(present[:, :, :6], past[:, :, :6])  # the new rows were written
        np.testing.assert_array_equal(second[f"present.0.{kind}"], present)
        assert first[f"present.1.{kind}"].shape == (1, 1, 6, 64)  # the growing cache: its own buffer
    assert any("['present.0.key', 'present.0.value'] have their past input's shape" in n for n in notes)
