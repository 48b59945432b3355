"""The result of an ONNX diff (:func:`fp4pass.onnx.numerics.diff`, and the fx diff that reuses it): the figures
per output and intermediate, the first divergent node, the verdict and the notes; ``fp4pass diff --json``'s keys
(:meth:`DiffResult.to_json`) and its table (:meth:`DiffResult.format_table`), worst first
(:func:`worst_first`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from fp4pass.metrics import TensorMetrics
from fp4pass.onnx.tables import aligned

__all__ = ["DiffResult", "worst_first"]


def worst_first(m: TensorMetrics) -> tuple:
    """Worst first: new NaN/Inf, then lowest SNR; identical tensors last."""
    snr = math.inf if m.snr_db is None else m.snr_db
    return (not m.new_nonfinite, snr, -m.max_abs_err)


@dataclass
class DiffResult:
    """What :func:`diff` found. ``to_json`` gives the JSON keys of ``fp4pass diff --json`` (the notes included); the
    rest is for tables and plots."""

    provider: str
    outputs: list[TensorMetrics]
    intermediates: list[TensorMetrics]
    first_divergent: dict | None
    passed: bool
    notes: list[str] = field(default_factory=list)
    snr_min: float | None = None
    order: list[str] = field(default_factory=list)  # compared tensors, topological order of the original
    worst_output_errors: np.ndarray | None = None  # sample of |a-b| of the worst output
    provider_notes: list[str] = field(default_factory=list)  # the runtime's words on the provider (also in notes)
    provider_options: dict = field(default_factory=dict)  # the CUDA EP's options as the session took them
    placement: dict | None = None  # per model ("original", "rewritten"): Placement.to_json() of a CUDA run

    def to_json(self) -> dict:
        return {
            "provider": self.provider,
            "outputs": [m.to_json() for m in self.outputs],
            "intermediates": [m.to_json() for m in self.intermediates],
            "first_divergent": self.first_divergent,
            "passed": self.passed,
            "notes": list(self.notes),
            "provider_options": dict(self.provider_options),
            "placement": self.placement,
        }

    def format_table(self, limit: int = 20, notes: bool = True) -> str:
        """Outputs, then the worst ``limit`` intermediates, each worst first; the first divergent node; the notes
        (``notes``: one line each, "note: ..."); then the verdict."""

        def fmt(value, spec):
            return "-" if value is None else format(value, spec)

        header = ("tensor", "shape", "snr_db", "rel_l2", "cosine", "max_abs", "mean_abs", "p99_abs", "nan", "inf", "")
        lines = []

        def section(title, rows):
            table = [header]
            for m in rows:
                snr = ("identical" if m.identical else "NaN" if m.nan and m.snr_db is None
                       else fmt(m.snr_db, ".2f"))
                cosine = "-" if m.nan and m.snr_db is None else fmt(m.cosine, ".6f")
                table.append((m.name, str(list(m.shape)), snr, fmt(m.rel_l2, ".3e"), cosine,
                              fmt(m.max_abs_err, ".3e"), fmt(m.mean_abs_err, ".3e"), fmt(m.p99_abs_err, ".3e"),
                              m.nan, m.inf, "<" if m.below(self.snr_min) else ""))
            lines.append(title)
            lines.extend(aligned(table, right=set(range(2, 10))))  # names whole, columns sized to their cells

        section(f"outputs ({len(self.outputs)}), provider {self.provider}:", sorted(self.outputs, key=worst_first))
        if self.intermediates:
            worst = sorted(self.intermediates, key=worst_first)[:limit]
            section(f"intermediates (worst {len(worst)} of {len(self.intermediates)}):", worst)
        if self.first_divergent:
            fd = self.first_divergent
            what = "first divergent" if self.snr_min is not None else "first divergent (differs at all; no --snr-min)"
            snr = "identical" if fd["snr_db"] is None else f"{fd['snr_db']:.2f} dB"
            lines.append(f"{what}: node {fd['node']!r} ({fd['op_type']}) tensor {fd['tensor']!r} snr {snr}")
        if notes:
            lines.extend(f"note: {note}" for note in self.notes)
        threshold = (" (no SNR threshold applied: --snr-min not given; only NaN/Inf fail)" if self.snr_min is None
                     else f" (snr-min {self.snr_min:g} dB)")
        lines.append(("PASSED" if self.passed else "FAILED") + threshold)
        return "\n".join(lines)
