"""The example models: deterministic builders, committed files equal to what the builders write."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import onnx
from onnx.reference import ReferenceEvaluator

from fp4pass.examples.moe import BUILDERS, EXPERT_EXPONENTS, build_moe


def test_builders_are_deterministic_and_match_the_committed_files(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "fp4pass.examples.moe", str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    for name in BUILDERS:
        built = (tmp_path / name).read_bytes()
        assert built == onnx.load_model_from_string(built).SerializeToString()
        assert built == open(f"models/{name}", "rb").read(), f"models/{name} differs from its builder"


def test_moe_experts_sit_at_different_exponent_ranges():
    model = build_moe()
    scales = next(t for t in model.graph.initializer if t.name == "experts.w1_scale")
    k = np.log2(onnx.numpy_helper.to_array(scales).astype(np.float64))
    medians = np.median(k.reshape(len(EXPERT_EXPONENTS), -1), axis=1)
    assert np.array_equal(np.diff(medians), np.diff(EXPERT_EXPONENTS))
    y = ReferenceEvaluator(model).run(None, {"x": np.ones((3, 64), np.float32)})[0]
    assert y.shape == (3, 64) and np.isfinite(y).all()
