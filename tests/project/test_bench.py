"""The benchmark group (`pytest -m benchmark -s`): runs every area's benchmarks at quick sizes and prints the
ratios. Figures are reported, never asserted against a time; the test fails only if a benchmark breaks or
yields a figure that is not a finite positive number."""

import json
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


def test_quick_convert_area_runs_from_the_command(capsys):
    """``fp4pass bench --quick`` at its smallest area: exit 0, each row printed once, on stdout only."""
    assert cli.main(["bench", "--quick", "--area", "convert", "--device", "cpu"]) == 0
    captured = capsys.readouterr()
    rows = [line for line in captured.out.splitlines() if line.startswith("convert ")]
    assert [r.split()[1] for r in rows] == ["auto", "auto", "auto-fast", "hybrid", "requant"]
    for row in rows:
        assert (captured.out + captured.err).count(row) == 1, row


def _fake_area(monkeypatch, bench):
    from fp4pass.bench import convert

    monkeypatch.setattr(convert, "BENCHMARKS", [bench])


@pytest.mark.parametrize("quick, verdict, met", [(True, "not judged at --quick size", None), (False, "MISSED", False)])
def test_a_full_size_goal_is_judged_only_at_full_size(monkeypatch, capsys, tmp_path, quick, verdict, met):
    from fp4pass.bench import BenchResult

    _fake_area(monkeypatch, lambda device, quick: [BenchResult("fake [cpu]", 3.0, "base", 1.0, goal=2.0)])
    out = tmp_path / "b.json"
    assert cli.main(["bench", "--area", "convert", "--device", "cpu", "--json", str(out)]
                    + (["--quick"] if quick else [])) == 0
    (row,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("fake")]
    assert verdict in row and ("MISSED" in row) == (not quick)
    assert json.loads(out.read_text())["results"][0]["met"] is met


def test_bad_input_raised_inside_a_benchmark_is_a_bug(monkeypatch, capsys):
    """The benchmarks build every input they pass: fp4pass refusing one is fp4pass's bug (exit 3), never exit 2."""
    from fp4pass.convert import mxfp4_to_nvfp4
    from fp4pass.formats import MXFP4Tensor

    def bench(device, quick):
        mxfp4_to_nvfp4(MXFP4Tensor.quantize(torch.ones(2, 32)), "auto", effort=None)
        return []

    _fake_area(monkeypatch, bench)
    assert cli.main(["bench", "--quick", "--area", "convert", "--device", "cpu"]) == 3
    err = capsys.readouterr().err
    assert "unknown effort None" in err and "a bug in fp4pass" in err


def test_peers_rows_are_printed_once(monkeypatch, capsys):
    from fp4pass.bench import BenchResult

    monkeypatch.setattr(peers, "peers_available", lambda: True)
    monkeypatch.setattr(peers, "bench_peers", lambda device, quick, rounds, log=None: [
        BenchResult("peers auto lossy [cpu]", 1.0, "ModelOpt cast", 2.0, 1.0, quick=quick)])
    assert cli.main(["bench", "--peers", "--quick", "--device", "cpu"]) == 0
    captured = capsys.readouterr()
    (row,) = [line for line in captured.out.splitlines() if line.startswith("peers auto")]
    assert (captured.out + captured.err).count(row) == 1 and "not judged at --quick size" in row


def test_startup_bench_times_both_commands_against_a_bare_interpreter():
    """The start-up rows: ``fp4pass --version`` and ``fp4pass convert --help``, each against ``python -c pass``
    run the same number of times in turns; none on CUDA (the same thing timed again)."""
    from fp4pass.bench import startup

    rows = startup.bench_startup(torch.device("cpu"), quick=True)
    assert [r.name for r in rows] == ["startup fp4pass --version", "startup fp4pass convert --help"]
    assert all(r.baseline == "python -c pass" and r.seconds > 0 and r.baseline_seconds > 0 for r in rows)
    assert len({r.baseline_seconds for r in rows}) == 1
    assert startup.bench_startup(torch.device("meta"), quick=True) == []
