"""The 27-scenario study: JSON shape, the qualitative findings (docs/conversion.md), the CLI command."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fp4pass import cli
from fp4pass.commands import study as study_command
from fp4pass.study import SCENARIOS, STUDY_METHODS, make_tensor, run_study
import conversion_oracle as oracle

BIG = {"QKV 4096x4096", "MLP 1024x4096", "embedding 2048x1024", "large flat 1024x4096"}
FAST = tuple(s for s in SCENARIOS if s.name not in BIG)
LOSSY = {"single extreme outlier", "mixed block scales (spread 25)", "spread 18", "spread 50", "subnormal-heavy (1e-8)"}


@pytest.fixture(scope="module")
def fast_study():
    return run_study("cpu", FAST, show_progress=False)


def check_findings(study: dict) -> None:
    rows = {r["name"]: r for r in study["scenarios"]}
    mse = {n: {m: r["methods"][m]["mse"] for m in STUDY_METHODS} for n, r in rows.items()}
    # hybrid lossless wherever the spread allows it, and lossy exactly where it does not
    for name, row in rows.items():
        assert (mse[name]["hybrid"] == 0) == (row["spread"] <= 17), name
        assert (mse[name]["verbatim_search"] == 0) == (row["spread"] <= 17), name
        assert mse[name]["auto"] <= min(mse[name]["requant"], mse[name]["hybrid"]), name
    lossy = {n for n in rows if mse[n]["hybrid"] > 0}
    assert lossy == LOSSY & set(rows)
    # requant beats hybrid only on the single extreme outlier
    assert {n for n in rows if mse[n]["requant"] < mse[n]["hybrid"]} == {"single extreme outlier"} & set(rows)
    # auto strictly beats both on most of the lossy scenarios
    strictly = {n for n in lossy if mse[n]["auto"] < min(mse[n]["requant"], mse[n]["hybrid"])}
    assert len(strictly) >= 3, strictly


def test_study_json_shape(fast_study):
    assert fast_study["device"] == "cpu"
    assert [r["name"] for r in fast_study["scenarios"]] == [s.name for s in FAST]
    for row in fast_study["scenarios"]:
        assert set(row) == {"name", "shape", "spread", "methods"}
        assert set(row["methods"]) == set(STUDY_METHODS)
        for entry in row["methods"].values():
            assert set(entry) == {"mse", "mse_vs_original", "blocks16_verbatim", "blocks16_total"}
            assert entry["blocks16_total"] == np.prod(row["shape"]) // 16
    json.dumps(fast_study, allow_nan=False)


def test_study_findings(fast_study):
    assert len(SCENARIOS) == 27
    check_findings(fast_study)


def test_lossy_summary_and_the_wide_search(fast_study):
    """lossy_summary against numpy; the wide search (effort "best") never worse than the narrow one per
    scenario, and better in geomean over the lossy scenarios."""
    import fp4pass
    from fp4pass.formats import MXFP4Tensor
    from fp4pass.study import lossy_summary

    rows = [r for r in fast_study["scenarios"] if r["name"] in LOSSY]
    best = [r["methods"]["auto"]["mse"] for r in rows]
    summary = lossy_summary(fast_study)
    assert summary["scenarios"] == len(LOSSY)
    assert summary["auto_geomean"] == pytest.approx(float(np.exp(np.mean(np.log(best)))), rel=1e-12)
    assert summary["auto_vs_best_peer"] <= 1.0
    by_name = {s.name: s for s in FAST}
    fast = []
    for row in rows:
        mx = MXFP4Tensor.quantize(make_tensor(by_name[row["name"]]), scale_rule="floor")
        fast.append(fp4pass.mxfp4_to_nvfp4(mx, "auto", group_dims=0, effort="fast")[1].mse)
    assert all(b <= f * (1 + 1e-12) for b, f in zip(best, fast)), (best, fast)  # sums in other orders
    assert np.exp(np.mean(np.log(best))) < 0.995 * np.exp(np.mean(np.log(fast)))


def test_study_spread_matches_oracle(fast_study):
    """The spread column, re-derived from the tensor with the numpy MXFP4 oracle (tests/support/oracles.py)."""
    from oracles import mx_quantize_np

    for scenario, row in zip(FAST, fast_study["scenarios"]):
        codes, e8m0 = mx_quantize_np(make_tensor(scenario).numpy())
        assert oracle.spread(codes, e8m0) == row["spread"], scenario.name


def test_study_command_writes_json(tmp_path, monkeypatch, capsys):
    few = (SCENARIOS[1], SCENARIOS[11])
    monkeypatch.setattr(study_command, "run_study", lambda device, show_progress=None: run_study(device, few, False))
    out = tmp_path / "study.json"
    assert cli.main(["study", "--json", str(out), "--device", "cpu"]) == 0
    data = json.loads(out.read_text())
    assert [r["name"] for r in data["scenarios"]] == ["gaussian", "single extreme outlier"]
    assert "single extreme outlier" in capsys.readouterr().out


def test_study_command_bad_device():
    with pytest.raises(SystemExit) as exc:
        cli.main(["study", "--device", "tpu"])
    assert exc.value.code == 2


@pytest.mark.slow
def test_full_study_findings():
    study = run_study("cpu", show_progress=False)
    assert len(study["scenarios"]) == 27
    check_findings(study)
    ties = sum(1 for r in study["scenarios"] if r["methods"]["hybrid"]["mse"] == r["methods"]["verbatim_search"]["mse"] == 0)
    assert ties == 22
