"""What reaches a user's terminal: no library log lines unless -v/--debug, notes once, names whole, columns
that line up, and benchmark ratios that say which way is better."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

import onnx_builders as B
from fp4pass.cli import main

ROOT = Path(__file__).resolve().parents[2]
MOE = str(ROOT / "models" / "moe.onnx")
GENAI = str(ROOT / "tests" / "fixtures" / "ortgenai_gptoss" / "model.onnx")


def _fp4pass(*argv, cwd):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "fp4pass", *argv], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=300)


def test_no_library_log_lines_without_verbose(tmp_path):
    """onnx_ir's pass manager and onnxruntime's own logger stay quiet; -v lets them through."""
    done = _fp4pass("convert", GENAI, "-o", str(tmp_path / "o.onnx"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "PassManager" not in done.stderr and "second look" not in done.stderr
    assert [line for line in done.stderr.splitlines() if line.startswith("fp4pass:")] == []
    np.savez(tmp_path / "ids.npz", input_ids=np.zeros((2, 3), np.int64))  # GroupQueryAttention refuses it
    failed = _fp4pass("diff", GENAI, GENAI, "--inputs", str(tmp_path / "ids.npz"), "--past-length", "2",
                      cwd=tmp_path)
    assert failed.returncode == 2
    assert failed.stderr.count("\n") == 1 and failed.stderr.startswith("fp4pass diff: error: ")
    assert "onnxruntime:" not in failed.stderr.replace("onnxruntime failed", "")
    plain = tmp_path / "plain.onnx"  # nothing to lower: onnx_ir's pass manager logs that it changed nothing
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), plain)
    quiet = _fp4pass("diff", str(plain), str(plain), "--provider", "reference", cwd=tmp_path)
    assert quiet.returncode == 0 and "PassManager" not in quiet.stderr
    verbose = _fp4pass("diff", str(plain), str(plain), "--provider", "reference", "-v", cwd=tmp_path)
    assert verbose.returncode == 0 and "PassManager" in verbose.stderr


def test_inspect_and_convert_tables_keep_long_names_whole_and_aligned(tmp_path, capsys):
    model = B.linear_model()
    long_a = "m.model.layers.0.mlp.experts.gate_up_proj_blocks"
    long_b = "m.model.layers.0.mlp.experts.gate_up_proj_scales_x"
    assert long_a[:32] == long_b[:32]
    model.graph.initializer[0].name = long_a
    model.graph.initializer[1].name = long_b
    model.graph.node[0].input[:] = [long_a, long_b]
    path = tmp_path / "long.onnx"
    onnx.save(model, path)
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"\n{long_a}  dq" in out
    assert main(["convert", str(path), "-o", str(tmp_path / "o.onnx"), "--check"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.startswith("weight"))
    row = next(line for line in lines if line.startswith(long_a))
    # right-aligned numeric columns end where their header ends
    assert row.index("lossless") + len("lossless") == header.index("SNR dB") + len("SNR dB")
    check_header = next(line for line in lines if line.startswith("output"))
    check_row = next(line for line in lines if line.startswith("y "))
    assert check_row.index("identical") + len("identical") == check_header.index("SNR dB") + len("SNR dB")


def test_cuda_fallback_note_is_printed_once(capsys):
    from fp4pass.onnx.runtime import cuda_available

    if cuda_available()[0]:
        pytest.skip("onnxruntime's CUDA provider loads here: there is no fallback to note")
    assert main(["diff", MOE, MOE, "--provider", "cuda"]) == 0
    err = capsys.readouterr().err
    assert sum("CUDA" in line for line in err.splitlines()) == 1


def test_bench_table_says_lower_is_better():
    from fp4pass.bench import BenchResult, format_table

    table = format_table([BenchResult("x", 1.0, "clone", 2.0)])
    assert "lower is better" in table and "0.50x" in table


def test_diff_table_keeps_long_names_whole():
    from fp4pass.metrics import compare
    from fp4pass.onnx.numerics import DiffResult

    a = np.linspace(1, 2, 8)
    names = ["model.layers.0.mlp.experts.gate_up_proj_dequantized_weight_a",
             "model.layers.0.mlp.experts.gate_up_proj_dequantized_weight_b"]
    metrics = [compare(n, a, a + i * 1e-3) for i, n in enumerate(names)]
    table = DiffResult("cpu", metrics[:1], metrics[1:], None, True).format_table()
    for name in names:
        assert f"\n{name} " in table
