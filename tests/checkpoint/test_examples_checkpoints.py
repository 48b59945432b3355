"""``python -m fp4pass.examples.checkpoints OUT --form F`` writes a checkpoint that calibrate (and so the diff, on
the same layer runner) runs through transformers' own model of the form; ``--names-only`` writes only what
conversion reads, which calibrate refuses in one line."""

from __future__ import annotations

from pathlib import Path

import pytest

import fp4pass.checkpoint
from cli_helpers import run_cli
from fp4pass.examples.checkpoints import FORMS, main as build

pytest.importorskip("safetensors")
TOKENS = Path(__file__).resolve().parents[2] / "models" / "checkpoints" / "calib_tokens.npz"


@pytest.mark.parametrize("form", FORMS)
def test_the_command_line_builds_what_calibrate_runs(tmp_path, form, capsys):
    assert build([str(tmp_path / "ex"), "--form", form, "--layers", "1", "--experts", "3"]) == 0
    scales = fp4pass.checkpoint.calibrate(tmp_path / "ex", TOKENS, num_samples=2, batch_size=2)
    assert scales.layers == 1 and scales.tokens > 0 and scales.tensors
    assert build([str(tmp_path / "bare"), "--form", form, "--layers", "1", "--experts", "3", "--names-only"]) == 0
    capsys.readouterr()
    code, _, err = run_cli(capsys, "calibrate", tmp_path / "bare", "--data", TOKENS, "-o", tmp_path / "s.json")
    assert code == 2 and len(err.strip().splitlines()) == 1 and not (tmp_path / "s.json").exists(), err
