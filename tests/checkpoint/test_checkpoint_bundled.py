"""The tiny example checkpoints committed under models/checkpoints/: rebuilt byte for byte by their builder, and
converted in every output form that applies with ``--check`` passing (compressed-tensors reads them back)."""

from __future__ import annotations

from pathlib import Path

import pytest

import fp4pass.checkpoint
from fp4pass.examples.checkpoints import BUNDLED, build_bundled

pytest.importorskip("safetensors")
ROOT = Path(__file__).resolve().parents[2] / "models" / "checkpoints"


def test_builder_rebuilds_the_committed_examples(tmp_path):
    build_bundled(tmp_path)
    for name in BUNDLED:
        committed = sorted(p.name for p in (ROOT / name).iterdir())
        assert committed == sorted(p.name for p in (tmp_path / name).iterdir())
        for file in committed:
            assert (ROOT / name / file).read_bytes() == (tmp_path / name / file).read_bytes(), f"{name}/{file}"


@pytest.mark.parametrize("name,fmt", [("gpt_oss", "modelopt"), ("deepseek_v3", "modelopt"), ("deepseek_v3", "compressed-tensors"),
                                      ("deepseek", "modelopt"), ("deepseek", "compressed-tensors"),
                                      ("kimi_k3", "modelopt"), ("kimi_k3", "compressed-tensors")])
def test_bundled_examples_convert_and_check(tmp_path, name, fmt):
    pytest.importorskip("compressed_tensors")
    report = fp4pass.checkpoint.convert(ROOT / name, tmp_path / "out", format=fmt, input_scale=1.0, check=True)
    check = report["check"]
    assert check["passed"] and check["experts_checked"] == report["summary"]["experts_total"]
    # one lossy expert (layer 1, expert 2: its w1, or its rows of both gpt-oss stacks; Kimi-K3: layer 2, expert
    # 11, its w1); the rest identical
    lossy = 2 if name == "gpt_oss" else 1
    assert check["experts_identical"] == check["experts_checked"] - lossy
    assert report["summary"]["experts_lossless"] == report["summary"]["experts_total"] - lossy
