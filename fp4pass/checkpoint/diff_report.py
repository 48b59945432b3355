"""The checkpoint diff's result (:func:`fp4pass.checkpoint.numerics.diff`), as scripts and readers take it.

:class:`CheckpointDiff` holds the figures (:mod:`fp4pass.checkpoint.numerics` says what each is) and says what
failed: ``failed`` lists each check once with its value, threshold, layer and where in the checkpoint, for a
script to read without parsing text; ``format_table()`` gives one ``FAILED`` line each (what ``--quiet``
keeps). ``to_json()`` is strict JSON (a figure that is not finite is null) and lists every routed expert; the
table lists the :data:`WORST_EXPERTS` worst. A run without a next token to score (rows of one token) has no
perplexity: null, and ``n/a`` in the table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["CheckpointDiff", "WORST_EXPERTS", "model_label"]

#: experts the table lists, the worst first (every routed expert when fewer); the JSON lists every one
WORST_EXPERTS = 10


def _json_db(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(value) else round(value, 4)


@dataclass
class CheckpointDiff:
    """The figures of :func:`diff` (module docstring); ``to_json()`` and ``format_table()`` like the ONNX diff."""

    layers: list[dict]
    experts: list[dict]  # every routed expert, the worst first
    unrouted: list[dict]
    logits: dict
    run: dict
    notes: list[str] = field(default_factory=list)
    snr_min: float | None = None
    kl_max: float | None = None
    #: NVFP4 global and input scales that hold NaN or Inf, the first layer first (``diff_checks.nonfinite_scales``)
    nonfinite_scales: list[dict] = field(default_factory=list)

    @property
    def first_below(self) -> int | None:
        if self.snr_min is None:
            return None
        for row in self.layers:
            snr = row["snr_db_local"]
            if snr is not None and snr < self.snr_min:
                return row["index"]
        return None

    @property
    def failed(self) -> list[dict]:
        """Each check that failed, once: ``{"limit", "value", "threshold", "layer", "where", "found"}``. ``limit``:
        ``finite`` (NaN/Inf in a scale, a layer's outputs or the KL: always checked), ``snr_min`` (the first
        layer under it), ``kl_max``; ``where``: the checkpoint's tensor or module (``logits`` for the KL)."""
        return self._nonfinite_failures() + self._limit_failures()

    def _nonfinite_failures(self) -> list[dict]:
        out = []
        if self.nonfinite_scales:
            first, more = self.nonfinite_scales[0], len(self.nonfinite_scales) - 1
            out.append(_failure("finite", first["layer"], first["tensor"],
                                first["found"] + (f" (and {more} more)" if more else "")))
        bad = next((r for r in self.layers if r.get("nonfinite_local") or r.get("nonfinite_end_to_end")), None)
        if bad is not None:
            count = max(bad.get("nonfinite_local", 0), bad.get("nonfinite_end_to_end", 0))
            expert = f" (first from expert {bad['nonfinite_expert']})" if "nonfinite_expert" in bad else ""
            out.append(_failure("finite", bad["index"], bad.get("nonfinite_module") or bad.get("checkpoint_module"),
                                f"{count} NaN/Inf values in the layer's output{expert}"))
        kl = self.logits.get("kl_mean")
        if self.logits and not (kl is not None and math.isfinite(kl)):
            out.append(_failure("finite", None, "logits", f"KL mean {kl}"))
        return out

    def _limit_failures(self) -> list[dict]:
        out = []
        below = self.first_below
        if below is not None:
            row = next(r for r in self.layers if r["index"] == below)
            out.append(_failure("snr_min", below, row.get("checkpoint_module"),
                                f"local SNR {_db(row['snr_db_local'])} dB under {self.snr_min:g} dB",
                                _json_db(row["snr_db_local"]), self.snr_min))
        kl = self.logits.get("kl_mean")
        finite_kl = kl is not None and math.isfinite(kl)
        if self.kl_max is not None and (not finite_kl or kl > self.kl_max):
            out.append(_failure("kl_max", None, "logits", f"KL mean {_num(kl)} over {self.kl_max:g} nats",
                                kl if finite_kl else None, self.kl_max))
        return out

    @property
    def passed(self) -> bool:
        return not self.failed

    def worst_experts(self, count: int = WORST_EXPERTS) -> list[dict]:
        return self.experts[:max(count, WORST_EXPERTS)]

    def to_json(self) -> dict:
        def row(r: dict) -> dict:
            return {k: (_json_db(v) if k.startswith("snr_db") else v) for k, v in r.items()}

        logits = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in self.logits.items()}
        failed = [{k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in f.items()}
                  for f in self.failed]
        return {"layers": [row(r) for r in self.layers], "experts": [row(r) for r in self.experts],
                "unrouted_experts": self.unrouted, "logits": logits, "first_below": self.first_below,
                "snr_min": self.snr_min, "kl_max": self.kl_max, "passed": not failed, "failed": failed,
                "nonfinite_scales": self.nonfinite_scales, "run": self.run, "notes": self.notes}

    def format_table(self, experts: int = WORST_EXPERTS) -> str:
        lines = [f"{'layer':>5} {'local SNR dB':>13} {'end-to-end SNR dB':>18}"]
        for r in self.layers:
            mark = "  <- first under --snr-min" if r["index"] == self.first_below else ""
            lines.append(f"{r['index']:>5} {_db(r['snr_db_local']):>13} {_db(r['snr_db_end_to_end']):>18}{mark}")
        worst = self.worst_experts(experts)
        if worst:
            lines += ["", f"worst experts ({len(worst)} of {len(self.experts)} routed; --json lists all)",
                      f"{'layer':>5} {'expert':>6} {'SNR dB':>9} {'tokens':>7}  checkpoint module"]
            lines += [f"{r['layer']:>5} {r['expert']:>6} {_db(r['snr_db']):>9} {r['tokens']:>7}  "
                      f"{r.get('checkpoint_module', r['module'])}" for r in worst]
        if self.unrouted:
            lines.append(f"unrouted experts (no token of the data reached them): {len(self.unrouted)}")
        lg = self.logits
        if lg:
            lines += ["", f"logits: KL mean {_num(lg['kl_mean'])}, max {_num(lg['kl_max'])} (nats); top-1 agreement "
                          f"{lg['top1_agreement']:.2%}; perplexity source {_num(lg['ppl_source'])}, nvfp4 "
                          f"{_num(lg['ppl_nvfp4'])}"]
            if lg.get("ppl_source") is None:
                lines.append("(no perplexity: no row has a next token to score; --seq-len 2 or more gives one)")
        r = self.run
        lines.append(f"{r['tokens']} tokens in {r['batches']} batches, {r['layers']} layers of {model_label(r)}, "
                     f"NVFP4 {r['nvfp4_form']} {r['activations']}, on {r['device']} in {r['seconds']:.1f} s")
        lines += [f"note: {n}" for n in self.notes]
        limits = [f"--snr-min {self.snr_min}" if self.snr_min is not None else None,
                  f"--kl-max {self.kl_max}" if self.kl_max is not None else None]
        limits = [x for x in limits if x]
        failed = self.failed
        for f in failed:  # one line each, every one saying FAILED (what --quiet keeps)
            flag = {"snr_min": f"--snr-min {self.snr_min}", "kl_max": f"--kl-max {self.kl_max}"}.get(f["limit"],
                                                                                                  "NaN/Inf")
            at = f"layer {f['layer']} ({f['where']})" if f["layer"] is not None else f["where"]
            lines.append(f"FAILED {flag}: {at}: {f['found']}")
        if limits and not failed:
            lines.append(f"passed ({', '.join(limits)})")
        return "\n".join(lines)


def _failure(limit: str, layer: int | None, where: str | None, found: str, value=None, threshold=None) -> dict:
    return {"limit": limit, "value": value, "threshold": threshold, "layer": layer, "where": where, "found": found}


def _db(value) -> str:
    if value is None:
        return "identical"
    return "NaN/Inf" if not math.isfinite(value) else f"{value:.2f}"


def _num(value) -> str:
    """A figure of the logits line: ``n/a`` where there is none (no next token to score)."""
    return "n/a" if value is None else f"{value:.4g}"


def model_label(run: dict) -> str:
    """The model as its user knows it: the source's name (the folder, or the Hub model ID) and its config's own
    model type, with the transformers architecture that runs it where that differs (Kimi runs as deepseek_v3)."""
    own, runs = run.get("config_model_type") or run["model_type"], run["model_type"]
    kind = own if own == runs else f"{own}, run as {runs}"
    name = run.get("model")
    return f"{name} ({kind})" if name and name != own else kind
