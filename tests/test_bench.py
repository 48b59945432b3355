"""The benchmark group (`pytest -m benchmark -s`): runs every area's benchmarks at quick sizes and prints the
ratios. Figures are reported, never asserted against a time; the test fails only if a benchmark breaks or
yields a figure that is not a finite positive number."""

import math

import pytest
import torch

from fp4pass import cli
from fp4pass.bench import AREAS, format_table, peers, run_benchmarks


@pytest.mark.benchmark
@pytest.mark.parametrize("area", AREAS)
def test_benchmarks_run_and_report_ratios(area, capsys):
    results = run_benchmarks(torch.device("cpu"), quick=True, areas=(area,), log=lambda row: None)
    assert results, f"no benchmark in area {area}"
    for r in results:
        assert r.baseline_seconds > 0 and math.isfinite(r.ratio), r
    with capsys.disabled():
        print("\n" + format_table(results))


@pytest.mark.benchmark
@pytest.mark.skipif(not peers.peers_available(), reason="needs the 'peers' extra (nvidia-modelopt)")
def test_peers_run_and_report_finite_figures(capsys):
    results = peers.bench_peers(torch.device("cpu"), quick=True, rounds=1, log=lambda row: None)
    assert [r.name.split()[1] for r in results] == ["auto", "requant"]
    for r in results:
        assert r.seconds > 0 and r.baseline_seconds > 0 and math.isfinite(r.ratio), r
        assert math.isfinite(r.extra["mse"]) and math.isfinite(r.extra["peer_mse"]), r
    with capsys.disabled():
        print("\n" + format_table(results))


def test_peers_without_modelopt_says_how_to_install(monkeypatch, capsys):
    monkeypatch.setattr(peers, "peers_available", lambda: False)
    assert cli.main(["bench", "--peers", "--device", "cpu"]) == 2
    assert "pip install 'fp4pass[peers]'" in capsys.readouterr().err
