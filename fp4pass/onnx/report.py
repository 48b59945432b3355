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

__all__ = ["jsonable", "tensor_entry", "summarize", "summary_line", "format_report"]


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


def _num(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_report(report: dict) -> str:
    """The report as readable tables: weights, declined patterns, activations, and the check's outputs."""
    lines = [f"{'weight':<28} {'pattern':<8} {'shape':<16} {'form':<6} {'verbatim':>13} "
             f"{'mse':>10} {'SNR dB':>7} global_scale"]
    for t in report["tensors"]:
        scales = t.get("global_scale") or []
        shown = ", ".join(f"{g:.4g}" for g in scales[:4]) + (", ..." if len(scales) > 4 else "")
        verbatim = f"{t.get('blocks16_verbatim', 0)}/{t.get('blocks16_total', 0)}"
        snr = "lossless" if _lossless(t) else _num(t.get("snr_db"), ".2f")
        lines.append(f"{t['name']:<28} {t['pattern']:<8} {'x'.join(map(str, t['shape'])):<16} "
                     f"{t['target_form']:<6} {verbatim:>13} {_num(t.get('mse'), '.3g'):>10} {snr:>8} [{shown}]")
    for d in report.get("declined", []):
        lines.append(f"declined {d.get('pattern')} at {d.get('node')} ({d.get('tensor')}): {d.get('reason')}")
    activations = report.get("activations")
    if activations:
        lines += ["", f"{'activation':<28} {'g_amax':>11} {'input_scale':>12} {'form':<10} consumers"]
        for a in activations:
            form = f"{a.get('target')}/{a.get('scale_form')}" if a.get("inserted") else "skipped"
            lines.append(f"{a['activation']:<28} {_num(a.get('g_amax'), '.5g'):>11} "
                         f"{_num(a.get('input_scale'), '.4g'):>12} {form:<10} {', '.join(a.get('consumers', []))}"
                         + (f"  ({a['reason']})" if a.get("reason") else ""))
    check = report.get("check")
    if check:
        lines += ["", f"check on {check['provider']}: {'PASSED' if check['passed'] else 'FAILED'}",
                  f"{'output':<28} {'shape':<12} {'SNR dB':>8} {'max_abs_err':>12} {'rel_l2':>10} {'cosine':>9}"]
        for o in check["outputs"]:
            snr = ("identical" if o["snr_db"] is None and o["max_abs_err"] == 0 and not (o.get("nan") or o.get("inf"))
                   else _num(o["snr_db"], ".2f"))
            lines.append(f"{o['name']:<28} {'x'.join(map(str, o['shape'])):<12} {snr:>8} "
                         f"{_num(o['max_abs_err'], '.4g'):>12} {_num(o['rel_l2'], '.3g'):>10} {_num(o['cosine'], '.6f'):>9}")
    return "\n".join(lines)
