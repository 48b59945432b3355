"""The checkpoint diff's figure (``fp4pass diff SRC_DIR NVFP4_DIR --plot OUT.png``), drawn for a reader.

Per decoder layer its local and end-to-end SNR, and its routed experts' spread beside it (one dot each, the
worst ringed). What a reader needs to read it at 1 layer as at 60: the layer axis in whole layers; the legend
outside the axes, so it never hides a point (layer 0's least of all); values that are no number drawn where
they can be seen and said what they are in the legend: identical outputs (SNR infinite) and SNRs above
:data:`PLOT_SNR_CAP` at the top (a line 10 dB over the highest SNR drawn, its tick labelled ``identical``, not a
number), NaN/Inf at the bottom, each with its own marker and no line through it; the title names the model as
its user knows it (the source's folder or Hub ID, and its config's own model type: Kimi, not deepseek_v3).

:func:`plot_series` computes what is drawn (tested without matplotlib); :func:`plot_checkpoint_diff` draws it.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

__all__ = ["PLOT_SNR_CAP", "plot_checkpoint_diff", "plot_series", "bounds", "Series"]

#: SNR drawn for identical outputs and values above it (dB)
PLOT_SNR_CAP = 80.0
#: layers up to which every layer gets its own tick
EVERY_TICK = 32
#: experts' dots drawn this far right of their layer's point, so they do not hide it
EXPERT_OFFSET = 0.2


@dataclass
class Series:
    """One set of points: x, the drawn y, and what each is: measured | identical | capped | nonfinite."""

    x: list[float] = field(default_factory=list)
    y: list[float] = field(default_factory=list)
    kind: list[str] = field(default_factory=list)

    def where(self, kind: str) -> tuple[list[float], list[float]]:
        keep = [i for i, k in enumerate(self.kind) if k == kind]
        return [self.x[i] for i in keep], [self.y[i] for i in keep]


def bounds(result, cap: float = PLOT_SNR_CAP) -> tuple[float, float]:
    """(bottom, top) of what is drawn: NaN/Inf 5 dB under the lowest finite SNR (and under 0); identical outputs
    and SNRs over ``cap`` 10 dB over the highest finite SNR at or under ``cap``, to the next 5 dB (at most
    ``cap``: a tensor far above float rounding does not squash the useful range; ``cap`` when none is finite)."""
    values = [v for r in result.layers for v in (r["snr_db_local"], r["snr_db_end_to_end"])]
    values += [r["snr_db"] for r in result.experts]
    finite = [v for v in values if v is not None and math.isfinite(v)]
    shown = [v for v in finite if v <= cap]
    top = min(cap, 5 * math.ceil((max(shown) + 10) / 5)) if shown else cap
    return min(finite + [0.0]) - 5, top


def plot_series(result, cap: float = PLOT_SNR_CAP) -> dict[str, Series]:
    """``local``, ``end_to_end`` (x: the layer), ``experts`` and ``worst`` (x: the layer + EXPERT_OFFSET)."""
    floor, top = bounds(result, cap)

    def add(series: Series, x: float, value) -> None:
        if value is None:
            kind, y = "identical", top
        elif not math.isfinite(value):
            kind, y = "nonfinite", floor
        elif value > cap:
            kind, y = "capped", top
        else:
            kind, y = "measured", value
        series.x.append(x)
        series.y.append(y)
        series.kind.append(kind)

    out = {name: Series() for name in ("local", "end_to_end", "experts", "worst")}
    for r in result.layers:
        add(out["local"], r["index"], r["snr_db_local"])
        add(out["end_to_end"], r["index"], r["snr_db_end_to_end"])
    for r in result.experts:
        add(out["experts"], r["layer"] + EXPERT_OFFSET, r["snr_db"])
    for r in result.worst_experts():
        add(out["worst"], r["layer"] + EXPERT_OFFSET, r["snr_db"])
    return out


def _title(result) -> str:
    from fp4pass.checkpoint.diff_report import model_label

    run = result.run
    return f"{model_label(run)}: NVFP4 ({run['nvfp4_form']}, {run['activations']}) against its source"


def plot_checkpoint_diff(result, path) -> None:
    """Draw ``result`` (a :class:`~fp4pass.checkpoint.diff_report.CheckpointDiff`) into ``path`` (its suffix is the
    format): module docstring."""
    import logging

    from fp4pass.extras import require

    matplotlib = require("matplotlib", "plot", "plotting a diff")
    matplotlib.use("Agg")
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    series = plot_series(result)
    n = len(result.layers)
    fig, ax = plt.subplots(figsize=(max(7.0, min(24.0, 0.35 * n + 4)), 5))
    local, e2e = series["local"], series["end_to_end"]
    for line, style, color in ((local, "-", "C0"), (e2e, "--", "C1")):  # through measured points only
        ax.plot(line.x, [y if k == "measured" else math.nan for y, k in zip(line.y, line.kind)], style,
                color=color, linewidth=1, zorder=2)
    # the local point larger than the end-to-end one: at layer 0 the two are one value, both stay visible
    for line, marker, size, label in ((local, "o", 9, "layer, local (fed the source's input)"),
                                      (e2e, "s", 5, "layer, end to end (fed its own output)")):
        if line.where("measured")[0]:
            ax.plot(*line.where("measured"), marker, color="C0" if line is local else "C1", markersize=size,
                    linestyle="none", label=label, zorder=3)
    if series["experts"].x:
        experts = series["experts"]
        ax.scatter(experts.x, experts.y, s=10, color="0.5", alpha=0.6, label="routed experts (beside their layer)",
                   zorder=2)
        worst = series["worst"]
        ax.scatter(worst.x, worst.y, s=40, facecolors="none", edgecolors="red",
                   label=f"{len(worst.x)} worst experts", zorder=3)
    everything = [p for s in (local, e2e, series["experts"]) for p in zip(s.x, s.y, s.kind)]
    _, top = bounds(result)
    marks = (("identical", "*", "green", "identical (no error; drawn at the top)"),
             ("capped", "^", "purple", f"above {PLOT_SNR_CAP:g} dB (drawn at the top)"),
             ("nonfinite", "X", "red", "NaN/Inf (drawn at the bottom)"))
    for kind, marker, color, label in marks:
        points = [(x, y) for x, y, k in everything if k == kind]
        if points:
            ax.scatter(*zip(*points), marker=marker, s=70, color=color, label=label, zorder=4)
    at_top = [k for *_, k in everything if k in ("identical", "capped")]
    if result.snr_min is not None:
        ax.axhline(result.snr_min, color="red", linestyle="--", linewidth=0.8, label=f"--snr-min {result.snr_min:g}")
    ax.set_xlim(-0.5, n - 0.5 + EXPERT_OFFSET)
    if n <= EVERY_TICK:
        ax.set_xticks(range(n))
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, steps=[1, 2, 5, 10]))
    if at_top:  # the top is no number: its tick says what is drawn there (numbers near it would read as one)
        ax.axhline(top, color="green", linestyle=":", linewidth=0.8, zorder=1)
        low, high = ax.get_ylim()
        ticks = [t for t in ax.get_yticks() if low <= t <= high and t < top - 0.05 * (high - low)]
        if not any(k == "measured" for *_, k in everything):
            ticks = []  # nothing measured: no scale of dB to read
        name = "identical" if "capped" not in at_top else f"identical / > {PLOT_SNR_CAP:g}"
        ax.set_yticks(ticks + [top], [f"{t:g}" for t in ticks] + [name])
        ax.set_ylim(low, high)
    ax.set_xlabel("decoder layer")
    ax.set_ylabel("SNR (dB)")
    ax.grid(True, axis="y", linewidth=0.3)
    ax.set_title(_title(result), fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    fig.tight_layout()
    fig.savefig(path, format=os.path.splitext(os.fspath(path))[1].lstrip(".") or "png", bbox_inches="tight")
    plt.close(fig)
