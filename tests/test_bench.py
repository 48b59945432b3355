"""The benchmark group (`pytest -m benchmark -s`): runs every area's benchmarks at quick sizes and prints the
ratios. Figures are reported, never asserted against a time; the test fails only if a benchmark breaks."""

import math

import pytest
import torch

from fp4pass.bench import AREAS, format_table, run_benchmarks


@pytest.mark.benchmark
@pytest.mark.parametrize("area", AREAS)
def test_benchmarks_run_and_report_ratios(area, capsys):
    results = run_benchmarks(torch.device("cpu"), quick=True, areas=(area,), log=lambda row: None)
    assert results, f"no benchmark in area {area}"
    for r in results:
        assert r.baseline_seconds > 0 and math.isfinite(r.ratio), r
    with capsys.disabled():
        print("\n" + format_table(results))
