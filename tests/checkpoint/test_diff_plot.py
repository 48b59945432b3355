"""The diff plot: SNR capped so a few tensors far above float rounding (~780 dB seen on real models) cannot
squash the useful range, identical and capped tensors marked, and every point named on the x axis."""

from __future__ import annotations

import numpy as np
import pytest

from fp4pass.metrics import compare
from fp4pass.onnx.numerics import PLOT_SNR_CAP, DiffResult, plot_diff, plot_points


def _metrics(name, a, b):
    return compare(name, np.asarray(a, np.float64), np.asarray(b, np.float64))


@pytest.fixture()
def result():
    a = np.linspace(1, 2, 64)
    rows = {
        "embed_out": _metrics("embed_out", a, a),  # identical
        "huge_exact": _metrics("huge_exact", a, np.r_[np.nextafter(a[0], 3), a[1:]]),  # one ulp: ~330 dB
        "fc1_out": _metrics("fc1_out", a, a + 0.01 * np.sin(np.arange(64))),  # ~45 dB
        "logits": _metrics("logits", a, a + 0.1 * np.cos(np.arange(64))),  # ~25 dB
    }
    assert rows["huge_exact"].snr_db > 300
    outputs = [rows.pop("logits")]
    return DiffResult("cpu", outputs, list(rows.values()), None, True, [], 30.0,
                      ["embed_out", "huge_exact", "fc1_out", "logits"], np.abs(np.cos(np.arange(64))))


def test_points_are_capped_and_marked(result):
    points = plot_points(result)
    assert points.names == ["embed_out", "huge_exact", "fc1_out", "logits"]
    assert points.kind == ["identical", "capped", "measured", "measured"]
    assert max(points.snr) == PLOT_SNR_CAP
    assert points.snr[2] == pytest.approx(result.intermediates[2].snr_db)


def test_the_figure_names_the_tensors_and_keeps_the_range(result, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib", reason="the plot extra")
    import matplotlib.pyplot as plt

    figures = []
    real_close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: figures.append(fig))
    plot_diff(result, tmp_path / "snr.png")
    assert (tmp_path / "snr.png").stat().st_size > 0
    (fig,) = figures
    ax = fig.axes[0]  # the 330 dB tensor does not set the scale
    assert [t.get_text() for t in ax.get_xticklabels()] == ["embed_out", "huge_exact", "fc1_out", "logits"]
    assert ax.get_ylim()[1] <= PLOT_SNR_CAP + 10
    labels = ax.get_legend_handles_labels()[1]
    assert "identical" in labels and any(label.startswith("above") for label in labels)
    real_close(fig)
