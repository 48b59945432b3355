"""The conversion report: one entry per converted tensor (SPEC.md stats keys + pattern, form, seconds).

JSON shape::

    {"input", "output", "method", "scale_form", "target", "external_data",
     "tensors": [{"name", "node", "pattern", "slot", "shape", "experts", "target_form", "form_note",
                  "seconds", "blocks16_total", "blocks16_verbatim", "blocks16_requantized", "global_scale",
                  "mse", "max_abs_err", "snr_db", "method_used"}],
     "declined": [{"pattern", "node", "tensor", "reason"}],
     "model": {"before": {"ir_version", "opset"}, "after": {...}},
     "activations": [...] (when calibrated), "check": {...} (with --check),
     "summary": {"tensors_converted", "lossless", "declined", "worst_snr_db", "seconds"}}

A tensor is lossless when its NVFP4 dequantization equals the MXFP4 one bit for bit (``mse`` 0, ``snr_db``
null). ``worst_snr_db`` is the lowest SNR over lossy tensors (null when all are lossless).
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["jsonable", "tensor_entry", "summarize", "summary_line"]


def jsonable(value):
    """numpy / torch scalars and arrays -> plain JSON values; non-finite floats -> None."""
    if hasattr(value, "to_json"):
        value = value.to_json()
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if hasattr(value, "tolist"):
        return jsonable(value.tolist())
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        value = float(value)
        return value if math.isfinite(value) else None
    return value


def tensor_entry(record, conv, form: str, note: str | None) -> dict:
    stats = jsonable(conv.stats) if conv.stats is not None else {}
    return {
        "name": record.name,
        "node": record.node.name,
        "pattern": record.pattern,
        "slot": record.slot,
        "shape": list(record.shape),
        "experts": record.experts,
        "target_form": form,
        "form_note": note,
        "seconds": round(conv.seconds, 6),
        **stats,
    }


def _lossless(entry: dict) -> bool:
    return entry.get("mse") == 0 and entry.get("snr_db") is None


def summarize(tensors: list[dict], declined: list[dict], seconds: float) -> dict:
    lossy = [t["snr_db"] for t in tensors if not _lossless(t) and t.get("snr_db") is not None]
    return {
        "tensors_converted": len(tensors),
        "lossless": sum(_lossless(t) for t in tensors),
        "declined": len(declined),
        "worst_snr_db": min(lossy) if lossy else None,
        "seconds": round(seconds, 3),
    }


def summary_line(report: dict) -> str:
    s = report["summary"]
    worst = "all lossless" if s["worst_snr_db"] is None else f"worst SNR {s['worst_snr_db']:.2f} dB"
    if s["tensors_converted"] == 0:
        worst = "nothing to convert"
    declined = f", {s['declined']} declined" if s["declined"] else ""
    line = f"converted {s['tensors_converted']} tensors, {s['lossless']} lossless, {worst}{declined} in {s['seconds']:.2f}s"
    check = report.get("check")
    if check is not None:
        line += f"; check {'passed' if check.get('passed') else 'FAILED'} on {check.get('provider')}"
    return line
