"""What docs/ says about the code, checked against the code."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from fp4pass.cli import main
from fp4pass.convert.methods import AMAX_CODES, MANTISSAS, auto_candidates

ROOT = Path(__file__).resolve().parents[2]


def test_conversion_doc_lists_autos_candidates_per_effort():
    doc = (ROOT / "docs" / "conversion.md").read_text()
    count = int(re.search(r"Other groups try (\d+)\s+candidate global scales", doc).group(1))
    for effort in ("best", "fast"):
        assert auto_candidates(torch.tensor([3]), torch.tensor([5.0]), effort).shape[-1] == count
    codes = re.search(r"amax / \(6 · s\) for the E4M3 block codes s = ([\d, ]+) \(", doc).group(1)
    assert [int(c) for c in codes.split(",")] == [int(c) for c in AMAX_CODES]
    best = doc.split("`--effort best`", 1)[1].split("`--effort fast`", 1)[0]
    assert f"c = {MANTISSAS[0]}..{MANTISSAS[-1]}" in best and "s0 ± 2" in best


def test_runtime_doc_on_the_no_cuda_note(tmp_path, capsys):
    """docs/runtime.md: --provider cuda without a CUDA EP gives one note on stderr and, for convert --check,
    the same words in the report's check.notes."""
    from fp4pass.onnx.runtime import cuda_available

    ok, why = cuda_available()
    if ok:
        pytest.skip("onnxruntime's CUDA provider loads here: there is no fallback to note")
    doc = (ROOT / "docs" / "runtime.md").read_text()
    assert "under `check.notes`" in doc and "in the report names" not in doc
    report = tmp_path / "r.json"
    assert main(["convert", str(ROOT / "models" / "moe.onnx"), "-o", str(tmp_path / "o.onnx"), "--check",
                 "--provider", "cuda", "--report", str(report)]) == 0
    err = capsys.readouterr().err
    assert err.count(why) == 1
    assert any(why in note for note in json.loads(report.read_text())["check"]["notes"])
