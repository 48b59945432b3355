"""The checkpoint diff's report for scripts and readers: which limit failed and where (text and JSON), every
expert in the JSON, a run without next tokens (``--seq-len 1``), and the plot as a reader sees it at 1, 4 and
60 layers. Results are built here by hand, so each figure and slot has a value of its own; the runs themselves
are in tests/checkpoint/test_checkpoint_diff.py.
"""

from __future__ import annotations

import json
import math

import pytest

from fp4pass.checkpoint.numerics import WORST_EXPERTS, CheckpointDiff

RUN = {"model": "Kimi-K2-Instruct", "model_type": "deepseek_v3", "config_model_type": "kimi_k2",
       "architecture": "DeepseekV3ForCausalLM", "device": "cpu", "layers": 3, "batches": 2, "tokens": 64,
       "nvfp4_form": "compressed-tensors", "activations": "W4A4", "seconds": 1.5}
LOGITS = {"kl_mean": 0.0234, "kl_max": 0.5, "top1_agreement": 0.75, "ppl_source": 30.0, "ppl_nvfp4": 31.0,
          "tokens": 64, "scored_next_tokens": 62}


def _layers(*snrs) -> list[dict]:
    return [{"index": i, "snr_db_local": s, "snr_db_end_to_end": (s - 1 if s is not None else None),
             "checkpoint_module": f"model.layers.{i}"} for i, s in enumerate(snrs)]


def _experts(count: int) -> list[dict]:
    rows = [{"layer": i % 3, "expert": i, "snr_db": 40.0 - i * 0.5, "tokens": 7 + i,
             "module": f"layers.{i % 3}.mlp.experts", "checkpoint_module": f"model.layers.{i % 3}.mlp.experts.{i}"}
            for i in range(count)]
    return sorted(rows, key=lambda r: r["snr_db"])


def _result(layers, experts=(), logits=None, snr_min=None, kl_max=None, scales=()) -> CheckpointDiff:
    return CheckpointDiff(layers, list(experts), [], dict(LOGITS if logits is None else logits), dict(RUN), [],
                          snr_min, kl_max, list(scales))


def _strict(data: dict) -> dict:
    return json.loads(json.dumps(data, allow_nan=False))


def test_each_failed_limit_says_its_value_threshold_and_where():
    result = _result(_layers(25.0, 12.5, 11.0), snr_min=15.0, kl_max=0.01)
    assert result.failed == [
        {"limit": "snr_min", "value": 12.5, "threshold": 15.0, "layer": 1, "where": "model.layers.1",
         "found": "local SNR 12.50 dB under 15 dB"},
        {"limit": "kl_max", "value": 0.0234, "threshold": 0.01, "layer": None, "where": "logits",
         "found": "KL mean 0.0234 over 0.01 nats"}]
    data = _strict(result.to_json())
    assert data["passed"] is False and data["failed"] == result.failed
    lines = result.format_table().splitlines()
    assert lines[-2:] == ["FAILED --snr-min 15.0: layer 1 (model.layers.1): local SNR 12.50 dB under 15 dB",
                          "FAILED --kl-max 0.01: logits: KL mean 0.0234 over 0.01 nats"]


def test_only_the_limit_that_failed_is_listed():
    snr_only = _result(_layers(25.0, 12.5), snr_min=15.0, kl_max=0.05)
    assert [f["limit"] for f in snr_only.failed] == ["snr_min"]
    kl_only = _result(_layers(25.0, 12.5), snr_min=10.0, kl_max=0.02)
    assert [f["limit"] for f in kl_only.failed] == ["kl_max"]
    assert kl_only.format_table().splitlines()[-1] == "FAILED --kl-max 0.02: logits: KL mean 0.0234 over 0.02 nats"


def test_a_figure_at_its_limit_passes():
    """Under --snr-min and over --kl-max fail; exactly at either passes."""
    result = _result(_layers(25.0, 15.0), snr_min=15.0, kl_max=0.0234)
    assert result.failed == [] and result.passed
    assert result.format_table().splitlines()[-1] == "passed (--snr-min 15.0, --kl-max 0.0234)"
    assert _strict(result.to_json())["failed"] == []


def test_nonfinite_scales_outputs_and_kl_fail_without_any_limit():
    layers = _layers(25.0, -math.inf, -math.inf)
    layers[1].update(nonfinite_local=96, nonfinite_end_to_end=128, nonfinite_module="model.layers.1.mlp.experts",
                     nonfinite_expert=3)
    layers[2].update(nonfinite_local=5, nonfinite_end_to_end=5, nonfinite_module="model.layers.2.self_attn.o_proj")
    scales = [{"layer": 1, "tensor": "model.layers.1.mlp.experts.3.w2.weight_global_scale",
               "found": "global scale NaN"},
              {"layer": 2, "tensor": "model.layers.2.self_attn.o_proj.input_global_scale", "found": "input scale inf"}]
    result = _result(layers, logits={**LOGITS, "kl_mean": math.inf, "kl_max": math.inf}, scales=scales)
    assert not result.passed
    assert [(f["limit"], f["layer"], f["where"]) for f in result.failed] == [
        ("finite", 1, "model.layers.1.mlp.experts.3.w2.weight_global_scale"),
        ("finite", 1, "model.layers.1.mlp.experts"),
        ("finite", None, "logits")]
    assert result.failed[0]["found"] == "global scale NaN (and 1 more)"
    assert result.failed[1]["found"] == "128 NaN/Inf values in the layer's output (first from expert 3)"
    data = _strict(result.to_json())  # no NaN or Infinity in the JSON
    assert data["failed"][2]["found"] == "KL mean inf" and data["logits"]["kl_mean"] is None
    assert data["nonfinite_scales"] == scales
    table = result.format_table().splitlines()
    assert table[-3] == ("FAILED NaN/Inf: layer 1 (model.layers.1.mlp.experts.3.w2.weight_global_scale): global "
                         "scale NaN (and 1 more)")


def test_a_nonfinite_kl_over_kl_max_names_both_checks():
    result = _result(_layers(25.0), logits={**LOGITS, "kl_mean": math.inf}, kl_max=1.0)
    assert [(f["limit"], f["value"]) for f in result.failed] == [("finite", None), ("kl_max", None)]
    assert _strict(result.to_json())["failed"][1]["threshold"] == 1.0


def test_the_json_lists_every_expert_and_the_table_the_worst():
    result = _result(_layers(25.0, 24.0, 23.0), experts=_experts(WORST_EXPERTS + 18))
    data = _strict(result.to_json())
    assert len(data["experts"]) == WORST_EXPERTS + 18
    assert [r["snr_db"] for r in data["experts"]] == sorted(r["snr_db"] for r in data["experts"])
    assert {r["checkpoint_module"] for r in data["experts"]} == {
        f"model.layers.{i % 3}.mlp.experts.{i}" for i in range(WORST_EXPERTS + 18)}
    table = result.format_table().splitlines()
    head = table.index(f"worst experts ({WORST_EXPERTS} of {WORST_EXPERTS + 18} routed; --json lists all)")
    rows = table[head + 2: head + 2 + WORST_EXPERTS]
    assert [r.split()[-1] for r in rows] == [r["checkpoint_module"] for r in data["experts"][:WORST_EXPERTS]]


def test_no_next_token_to_score_gives_no_perplexity_and_no_error():
    """``--seq-len 1``: every row is one token, none has a next one: perplexities are null, the table says why."""
    logits = {**LOGITS, "ppl_source": None, "ppl_nvfp4": None, "scored_next_tokens": 0}
    result = _result(_layers(25.0), logits=logits)
    table = result.format_table()
    assert "perplexity source n/a, nvfp4 n/a" in table and "--seq-len 2" in table
    assert _strict(result.to_json())["logits"]["ppl_source"] is None


def test_the_table_names_the_model_as_its_user_knows_it():
    table = _result(_layers(25.0)).format_table()
    assert "3 layers of Kimi-K2-Instruct (kimi_k2, run as deepseek_v3), NVFP4 compressed-tensors W4A4" in table


# -- the plot ---------------------------------------------------------------------------------------------------

def _figure(result, tmp_path, monkeypatch):
    """Draw ``result`` and return its figure (kept open) and the PNG."""
    pytest.importorskip("matplotlib", reason="the plot extra")
    import matplotlib.pyplot as plt

    from fp4pass.checkpoint.diff_plot import plot_checkpoint_diff

    figures = []
    monkeypatch.setattr(plt, "close", lambda fig=None: figures.append(fig))
    path = tmp_path / "snr.png"
    plot_checkpoint_diff(result, path)
    assert path.stat().st_size > 1000
    (fig,) = figures
    return fig


def _points(ax) -> list[tuple[float, float]]:
    """Every drawn point in display coordinates (lines' and scatters')."""
    out = []
    for line in ax.get_lines():
        xy = [(x, y) for x, y in zip(line.get_xdata(), line.get_ydata()) if math.isfinite(y)]
        out += [tuple(p) for p in ax.transData.transform(xy)] if xy else []
    for coll in ax.collections:
        offsets = coll.get_offsets()
        if len(offsets):
            out += [tuple(p) for p in ax.transData.transform(offsets)]
    return out


@pytest.mark.parametrize("layers", [1, 4, 60])
def test_the_plot_reads_in_whole_layers_with_nothing_hidden(tmp_path, monkeypatch, layers):
    snrs = [20.0 + (i % 7) for i in range(layers)]
    experts = [{"layer": i, "expert": e, "snr_db": 15.0 + e, "tokens": 5, "module": "m", "checkpoint_module": "c"}
               for i in range(layers) for e in range(3)]
    fig = _figure(_result(_layers(*snrs), experts=sorted(experts, key=lambda r: r["snr_db"])), tmp_path,
                  monkeypatch)
    ax = fig.axes[0]
    fig.canvas.draw()
    low, high = ax.get_xlim()
    ticks = [t for t in ax.get_xticks() if low <= t <= high]
    assert ticks and all(float(t).is_integer() for t in ticks), ticks
    shown = [t.get_text() for t in ax.get_xticklabels() if low <= t.get_position()[0] <= high]
    assert shown == [str(int(t)) for t in ticks]
    if layers <= 32:
        assert [int(t) for t in ticks] == list(range(layers))
    box = ax.get_legend().get_window_extent(fig.canvas.get_renderer())
    inside = [p for p in _points(ax) if box.contains(*p)]
    assert not inside, inside  # layer 0's points above all
    assert "Kimi-K2-Instruct" in ax.get_title() and "kimi_k2" in ax.get_title()


def test_identical_and_nonfinite_layers_are_drawn_and_labelled(tmp_path, monkeypatch):
    from fp4pass.checkpoint.diff_plot import plot_series

    layers = _layers(None, 21.0, -math.inf, 95.0)
    result = _result(layers)
    series = plot_series(result)
    assert series["local"].kind == ["identical", "measured", "nonfinite", "capped"]
    top = series["local"].y[0]
    assert top == 35.0  # 10 dB over the highest SNR drawn (21), to the next 5: the range stays readable
    assert series["local"].y[3] == top and series["local"].y[2] < 0
    fig = _figure(result, tmp_path, monkeypatch)
    ax = fig.axes[0]
    labels = ax.get_legend_handles_labels()[1]
    assert any(label.startswith("identical") for label in labels), labels
    assert any(label.startswith("NaN/Inf") for label in labels) and any(label.startswith("above") for label in labels)
    fig.canvas.draw()
    names = {t.get_position()[1]: t.get_text() for t in ax.get_yticklabels()}
    assert names[top].startswith("identical")  # the top's tick is named, not a number
    assert all(not text.startswith("identical") for y, text in names.items() if y != top)
    assert ax.get_ylim()[1] < 60  # not squashed under an 80 dB cap
