"""The plot of an ONNX (or fx) diff: the SNR of every compared tensor in graph order, and the |a-b| histogram of
the worst output (``fp4pass diff --plot``). :func:`plot_points` says what is drawn, so that tests read it
without an image.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

from fp4pass.onnx.diff_result import DiffResult, worst_first

__all__ = ["plot_diff", "plot_points", "PlotPoints", "PLOT_SNR_CAP"]


#: SNR shown at most on the plot: float32 rounding noise sits near 140 dB, so anything above is "exact up to
#: rounding"; a few tensors at ~780 dB (errors of one ulp in huge values) would otherwise squash the rest
PLOT_SNR_CAP = 160.0
_NAMED_TICKS = 60  # tensors named on the x axis one by one up to this many; beyond, every k-th


@dataclass
class PlotPoints:
    """What :func:`plot_diff` draws for the per-tensor panel: one point per compared tensor, graph order.

    ``snr``: the value drawn, in dB (capped at ``cap``); ``kind``: "measured", "capped" (the SNR is above the
    cap, drawn at it), "identical" (no error, drawn at the cap) or "nonfinite" (no finite SNR, drawn under the
    lowest one)."""

    names: list[str]
    snr: list[float]
    kind: list[str]
    cap: float


def plot_points(result: DiffResult, cap: float = PLOT_SNR_CAP) -> PlotPoints:
    """The per-tensor SNR points of ``result`` (see :class:`PlotPoints`)."""
    by_name = {m.name: m for m in [*result.intermediates, *result.outputs]}
    names = [n for n in result.order if n in by_name]
    finite = [by_name[n].snr_db for n in names if by_name[n].snr_db is not None and math.isfinite(by_name[n].snr_db)]
    floor = min([*finite, cap]) - 10
    snr, kind = [], []
    for name in names:
        value = by_name[name].snr_db
        if value is None:
            snr.append(cap), kind.append("identical")
        elif not math.isfinite(value):
            snr.append(floor), kind.append("nonfinite")
        elif value > cap:
            snr.append(cap), kind.append("capped")
        else:
            snr.append(value), kind.append("measured")
    return PlotPoints(names, snr, kind, cap)


def plot_diff(result: DiffResult, path) -> None:
    """PNG: SNR (dB) of every compared tensor in graph order, named on the x axis, capped at
    :data:`PLOT_SNR_CAP` (identical and capped tensors marked), and the |a-b| histogram of the worst output."""
    from fp4pass.extras import require

    matplotlib = require("matplotlib", "plot", "plotting a diff")
    matplotlib.use("Agg")
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    import matplotlib.pyplot as plt

    points = plot_points(result)
    count = len(points.names)
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(max(10, min(40, 0.25 * count)), 8),
                                   gridspec_kw={"height_ratios": [3, 2]})
    xs = list(range(count))
    ax1.plot(xs, points.snr, color="0.6", linewidth=0.8, zorder=1)
    styles = {"measured": (".", "C0", "SNR"), "capped": ("^", "C1", f"above {points.cap:g} dB (drawn at it)"),
              "identical": ("^", "green", "identical"), "nonfinite": ("v", "red", "no finite SNR (NaN/Inf)")}
    for kind, (marker, color, label) in styles.items():
        idx = [i for i, k in enumerate(points.kind) if k == kind]
        if idx:
            ax1.scatter(idx, [points.snr[i] for i in idx], marker=marker, color=color, label=label, zorder=3, s=18)
    if result.snr_min is not None:
        ax1.axhline(result.snr_min, color="red", linestyle="--", linewidth=0.8, label=f"--snr-min {result.snr_min:g}")
    step = max(1, math.ceil(count / _NAMED_TICKS))
    ax1.set_xticks(xs[::step])
    ax1.set_xticklabels(points.names[::step], rotation=90, fontsize=6)
    ax1.set_xlabel("tensor (topological order of the original)" + (f", every {step}th named" if step > 1 else ""))
    ax1.set_ylabel(f"SNR (dB, capped at {points.cap:g})")
    ax1.set_ylim(top=points.cap + 5)
    ax1.set_title(f"per-tensor SNR, provider {result.provider}")
    if count:
        ax1.legend(fontsize=7, loc="lower left")
    worst = sorted(result.outputs, key=worst_first)[0] if result.outputs else None
    errors = result.worst_output_errors
    if worst is not None and errors is not None and errors.size and errors.max() > 0:
        ax2.hist(errors[errors > 0], bins=100, log=True)
        ax2.set_title(f"|a-b| of the worst output {worst.name!r} (non-zero errors)")
    else:
        ax2.set_title("no output differs")
    ax2.set_xlabel("|a - b|")
    fig.tight_layout()
    fig.savefig(path, format=Path(path).suffix.lstrip(".").lower() or "png", dpi=100)
    plt.close(fig)
