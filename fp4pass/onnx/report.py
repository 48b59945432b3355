"""The conversion report: one entry per converted tensor (its conversion statistics + pattern, form, seconds).

JSON shape::

    {"input", "output", "method", "scale_form", "target", "external_data",
     "tensors": [{"name", "node", "pattern", "slot", "shape", "experts", "target_form", "form_note",
                  "seconds", "blocks16_total", "blocks16_verbatim", "blocks16_requantized", "global_scale",
                  "mse", "max_abs_err", "snr_db", "method_used",
                  "per_expert": [{"expert", "blocks16_total", "blocks16_verbatim", "mse", "max_abs_err",
                                  "snr_db", "lossless"}],
                  QMoE only: "layout_read", "layout_read_shape", "layout_reason", "layout_written",
                  "layout_written_shape"}],
     "declined": [{"pattern", "node", "op_type", "tensor", "reason"}],
     "model": {"before": {"ir_version", "opset"}, "after": {...}},
     "activations": [...] (when calibrated), "check": {...} (with --check),
     "summary": {"tensors_converted", "lossless", "declined", "worst_snr_db", "seconds"}}

``shape`` is the logical [E, N, K]; for QMoE the byte layouts are "schema" ([E, N, K/2]) and "kernel"
([E, K, N/2], what onnxruntime's CUDA kernel reads and every converted QMoE is written in).

A tensor is lossless when its NVFP4 dequantization equals the MXFP4 one bit for bit (``mse`` 0, ``snr_db``
null). ``worst_snr_db`` is the lowest SNR over lossy tensors (null when all are lossless).

``per_expert`` (one entry per group that has its own global scale: per expert of a 3-D ``[E, N, K]`` weight,
empty for a 2-D weight) bounds the error of each expert on its own, so that one damaged expert cannot hide
in a tensor-wide average. With x_mx the MXFP4 values of the expert and x_nv the NVFP4 ones (dequant of the
written codes, E4M3 scales and the expert's FP32 global scale)::

    mse               = mean (x_nv - x_mx)^2                      (float64 accumulation)
    max_abs_err       = max |x_nv - x_mx|
    snr_db            = 10 log10(sum x_mx^2 / sum (x_nv - x_mx)^2)  (null when the expert is lossless)
    blocks16_verbatim = 16-halves whose E2M1 nibbles are the input's AND whose values are reproduced exactly
    lossless          = every value reproduced exactly (mse == 0)

The values are compared before any prior per-expert scale the input applied (QMoE ``fc*_global_scale``),
as the tensor-wide keys are.
"""

from __future__ import annotations

import math

import numpy as np

from fp4pass.metrics import snr_db
from fp4pass.onnx.patterns import declined_line
from fp4pass.onnx.tables import aligned

__all__ = ["jsonable", "tensor_entry", "group_stats", "layout_entry", "summarize", "summary_line", "format_report"]

#: elements per chunk when measuring per-group statistics (bounded memory on large experts)
_CHUNK_ELEMENTS = 1 << 22


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


def _lossless_group(expert: int, halves: int) -> dict:
    return {"expert": expert, "blocks16_total": halves, "blocks16_verbatim": halves, "mse": 0.0,
            "max_abs_err": 0.0, "snr_db": None, "lossless": True}


def group_stats(mx, nv, group_dims: int, stats=None) -> list[dict]:
    """Per-group statistics of one conversion (module docstring): a list with one dict per group, [] when
    ``group_dims`` is 0 (one global scale for the whole tensor: the tensor-wide keys say it all).

    ``mx``: the MXFP4Tensor converted, ``nv``: the NVFP4Tensor written. ``stats``: the converter's tensor-wide
    statistics; when they say every 16-half was kept verbatim with zero error, nothing is measured again, nor
    when they carry the same figures per group (``stats.groups``, from the converter's pattern search).
    """
    if not group_dims:
        return []
    groups = int(np.prod(mx.shape[:group_dims]))
    k = mx.shape[-1]
    rows = int(np.prod(mx.shape[group_dims:-1]))
    halves = rows * (k // 16)
    if stats is not None and stats["mse"] == 0 and stats["blocks16_verbatim"] == stats["blocks16_total"]:
        return [_lossless_group(g, halves) for g in range(groups)]
    per_group = getattr(stats, "groups", None)
    if per_group is not None and len(per_group) == groups:  # the converter's own figures per group
        return [{"expert": g, "blocks16_total": st.blocks16_total, "blocks16_verbatim": st.blocks16_verbatim,
                 "mse": st.mse, "max_abs_err": st.max_abs_err, "snr_db": st.snr_db,
                 "lossless": st.extra.get("sse", st.mse * halves * 16) == 0.0} for g, st in enumerate(per_group)]
    mx_codes = mx.codes.reshape(groups, rows, -1)
    mx_scales = mx.scales.reshape(groups, rows, -1)
    nv_codes = nv.codes.reshape(groups, rows, -1)
    nv_scales = nv.scales.reshape(groups, rows, -1)
    global_scale = nv.global_scale.reshape(groups).float()
    step = max(1, _CHUNK_ELEMENTS // max(k, 1))
    out = []
    for g in range(groups):
        sse = signal = 0.0
        max_err = 0.0
        verbatim = 0
        for lo in range(0, rows, step):
            hi = min(rows, lo + step)
            x_mx = type(mx)(mx_codes[g, lo:hi], mx_scales[g, lo:hi], mx.block_size).dequantize().double()
            x_nv = type(nv)(nv_codes[g, lo:hi], nv_scales[g, lo:hi], global_scale[g]).dequantize().double()
            err = x_nv - x_mx
            sse += float(err.square().sum())
            signal += float(x_mx.square().sum())
            if err.numel():
                max_err = max(max_err, float(err.abs().max()))
            kept = (nv_codes[g, lo:hi] == mx_codes[g, lo:hi]).reshape(hi - lo, -1, 8).all(-1)
            exact = (err == 0).reshape(hi - lo, -1, 16).all(-1)
            verbatim += int((kept & exact).sum())
        n = rows * k
        out.append({"expert": g, "blocks16_total": halves, "blocks16_verbatim": verbatim,
                    "mse": sse / n if n else 0.0, "max_abs_err": max_err, "snr_db": snr_db(signal, sse),
                    "lossless": sse == 0.0})
    return out


def layout_entry(record) -> dict:
    """The QMoE byte layouts of ``record``: the one read (and how it was recognised) and the one written."""
    if getattr(record, "layout", None) is None:
        return {}
    from fp4pass.onnx.qmoe_layout import LAYOUT_SHAPES, WRITTEN_LAYOUT

    return {"layout_read": record.layout, "layout_read_shape": LAYOUT_SHAPES[record.layout],
            "layout_reason": record.layout_reason, "layout_written": WRITTEN_LAYOUT,
            "layout_written_shape": LAYOUT_SHAPES[WRITTEN_LAYOUT]}


def tensor_entry(record, conv, form: str, note: str | None) -> dict:
    stats = jsonable(conv.stats) if conv.stats is not None else {}
    per_expert = getattr(conv, "per_expert", None)
    if per_expert is not None:
        stats["per_expert"] = jsonable(per_expert)
    return {
        "name": record.name,
        "node": record.node.name,
        "pattern": record.pattern,
        "slot": record.slot,
        "shape": list(record.shape),
        "experts": record.experts,
        "target_form": form,
        "form_note": note,
        **layout_entry(record),
        "seconds": round(conv.seconds, 6),
        **stats,
        **({"per_expert": conv.per_expert} if getattr(conv, "per_expert", None) is not None else {}),
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


def check_threshold(check: dict) -> str:
    """What the check's verdict was held to: the SNR threshold, or that none applied (the W4A4 default)."""
    threshold = check.get("snr_min")
    if threshold is None:
        return " (no SNR threshold applied: --snr-min not given; only NaN/Inf fail)"
    return f" (every output's SNR >= {threshold:g} dB)"


def _num(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_report(report: dict) -> str:
    """The report as readable tables: weights, declined patterns, activations, and the check's outputs."""
    rows: list = [("weight", "pattern", "shape", "form", "verbatim", "mse", "SNR dB", "global_scale")]
    for t in report["tensors"]:
        scales = t.get("global_scale") or []
        shown = ", ".join(f"{g:.4g}" for g in scales[:4]) + (", ..." if len(scales) > 4 else "")
        verbatim = f"{t.get('blocks16_verbatim', 0)}/{t.get('blocks16_total', 0)}"
        snr = "lossless" if _lossless(t) else _num(t.get("snr_db"), ".2f")
        rows.append((t["name"], t["pattern"], "x".join(map(str, t["shape"])), t["target_form"], verbatim,
                     _num(t.get("mse"), ".3g"), snr, f"[{shown}]"))
        if t.get("layout_read"):
            rows.append(f"{'':<4}QMoE layout read {t['layout_read']} {t['layout_read_shape']} ({t['layout_reason']}), "
                        f"written {t['layout_written']} {t['layout_written_shape']}")
        for p in t.get("per_expert") or []:
            if not p["lossless"]:
                rows.append(f"{'':<4}expert {p['expert']}: {p['blocks16_verbatim']}/{p['blocks16_total']} verbatim, "
                            f"mse {p['mse']:.3g}, SNR {_num(p['snr_db'], '.2f')} dB")
    lines = aligned(rows, right={4, 5, 6})
    for d in report.get("declined", []):
        lines.append(declined_line(d))
    listed = report.get("initializer_inputs")
    if listed:
        lines.append(f"initializers also listed as graph inputs, taken as initializers: {', '.join(listed['names'])}")
    activations = report.get("activations")
    if activations:
        rows = [("activation", "g_amax", "input_scale", "form", "consumers")]
        for a in activations:
            form = f"{a.get('target')}/{a.get('scale_form')}" if a.get("inserted") else "skipped"
            rows.append((a["activation"], _num(a.get("g_amax"), ".5g"), _num(a.get("input_scale"), ".4g"), form,
                         ", ".join(a.get("consumers", [])) + (f"  ({a['reason']})" if a.get("reason") else "")))
        lines += ["", *aligned(rows, right={1, 2})]
    check = report.get("check")
    if check:
        lines += ["", f"check on {check['provider']}: {'PASSED' if check['passed'] else 'FAILED'}"
                      f"{check_threshold(check)}"]
        rows = [("output", "shape", "SNR dB", "max_abs_err", "rel_l2", "cosine")]
        for o in check["outputs"]:
            snr = ("identical" if o["snr_db"] is None and o["max_abs_err"] == 0 and not (o.get("nan") or o.get("inf"))
                   else _num(o["snr_db"], ".2f"))
            rows.append((o["name"], "x".join(map(str, o["shape"])), snr, _num(o["max_abs_err"], ".4g"),
                         _num(o["rel_l2"], ".3g"), _num(o["cosine"], ".6f")))
        lines += aligned(rows, right={2, 3, 4, 5})
    return "\n".join(lines)
