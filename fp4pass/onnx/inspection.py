"""``fp4pass.onnx.inspect``: the FP4 weights of a model, their pattern and shape, and a lossless forecast.

For each MXFP4 weight (and per expert of a 3-D [E, N, K] weight), with k_j = E8M0 code - 127 over the blocks
of 32 that hold a non-zero E2M1 code::

    spread = k_max - k_min
    lossless = spread <= 17

because a global scale S = 2^(k_max - 8) puts every block scale 2^(k_j - m) among E4M3's 18 exact powers of two
2^-9..2^8 exactly when the spread is at most 17 (docs/conversion.md). ``lossless_per_tensor_scale`` is the
same test with one global scale for all experts (ModelOpt's merged cast).

The error forecast: where some expert is not lossless by that test, the tensor is converted with ``auto`` (as
``fp4pass convert`` does by default) and the error measured, tensor-wide (``blocks16_total``,
``blocks16_verbatim``, ``mse``, ``snr_db``) and per expert (the same keys, as in the convert report: see
:func:`fp4pass.onnx.report.group_stats`). Where every expert is lossless nothing is converted: ``mse`` 0,
``snr_db`` null, every 16-half verbatim. Tensors are read one at a time (external data streams), so this runs
on models larger than RAM; ``measure=False`` skips the conversion and gives the spread forecast only.
The forecast is a sufficient condition: ``--method auto`` may still find a lossless non-power-of-two global
scale where it says false. FP4 with arbitrary float scales (the torch exporter's DequantizeLinear where a scale is
not a power of two) has no exponents: it is listed as lossy, with the reason.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from fp4pass.convert.lossless import LOSSLESS_SPREAD, lossless_range
from fp4pass.onnx import loading
from fp4pass.onnx.nvfp4_forms import find_nvfp4, nvfp4_problems, scheme
from fp4pass.onnx.patterns import declined_line, node_label
from fp4pass.onnx.report import group_stats, jsonable, layout_entry
from fp4pass.onnx.initializer_inputs import initializer_inputs, unlist_initializer_inputs
from fp4pass.onnx.sharing import find_weights
from fp4pass.onnx.tables import aligned
from fp4pass.onnx.rewrite_common import WeightConversion
from fp4pass.onnx.rewrite_quark import activation_declines

__all__ = ["inspect", "inspect_nvfp4", "LOSSLESS_SPREAD", "format_inspection"]


def _range(k: np.ndarray, holds: np.ndarray) -> tuple[int | None, int | None]:
    if not holds.any():
        return None, None
    return int(k[holds].min()), int(k[holds].max())


def _spread_entry(k: np.ndarray, holds: np.ndarray) -> dict:
    k_min, k_max = _range(k, holds)
    spread = 0 if k_min is None else k_max - k_min
    return {"k_min": k_min, "k_max": k_max, "spread": spread, "lossless": k_min is None or lossless_range(k_min, k_max)}


_ERROR_KEYS = ("blocks16_total", "blocks16_verbatim", "mse", "max_abs_err", "snr_db")


def _error_forecast(mx, group_dims: int, lossless: bool) -> tuple[dict, list[dict]]:
    """(tensor-wide error keys, per-group error keys) of converting ``mx`` with ``auto`` (module docstring)."""
    halves = mx.shape.numel() // 16
    if lossless:
        tensor = {"blocks16_total": halves, "blocks16_verbatim": halves, "mse": 0.0, "max_abs_err": 0.0,
                  "snr_db": None}
        groups = int(np.prod(mx.shape[:group_dims])) if group_dims else 0
        per_group = [{**tensor, "blocks16_total": halves // groups, "blocks16_verbatim": halves // groups}
                     for _ in range(groups)]
        return tensor, per_group
    from fp4pass.convert import mxfp4_to_nvfp4

    nv, stats = mxfp4_to_nvfp4(mx, method="auto", group_dims=group_dims)
    tensor = {key: jsonable(stats[key]) for key in _ERROR_KEYS}
    per_group = [{key: p[key] for key in _ERROR_KEYS} for p in group_stats(mx, nv, group_dims, stats)]
    return tensor, per_group


def inspect(model_or_path, *, measure: bool = True, base_dir=None) -> dict:
    """``{"model", "tensors": [{"name", "node", "pattern", "slot", "shape", "experts", "k_min", "k_max",
    "spread", "lossless", "lossless_per_tensor_scale", "blocks16_total", "blocks16_verbatim", "mse",
    "max_abs_err", "snr_db", "per_expert": [{"expert", "k_min", "k_max", "spread", "lossless",
    "blocks16_total", "blocks16_verbatim", "mse", "max_abs_err", "snr_db"}]}], "declined": [...],
    "summary": {"tensors", "lossless", "experts_lossless", "experts"}}``.

    ``measure``: forecast the error of lossy tensors by converting them (module docstring); False leaves the
    error keys out. ``base_dir``: where the external data of a model that is not a path lies
    (:func:`fp4pass.onnx.loading.load`)."""
    loaded = loading.load(model_or_path, base_dir)
    if loaded.kind == "ir" and initializer_inputs(loaded.model):
        loaded = loading.Loaded(loaded.model.clone(), loaded.kind, loaded.path)  # the caller's model stays
    unlist_initializer_inputs(loaded.model)  # an initializer also listed as an input converts as one
    records, declined = find_weights(loaded.model, loaded.path.parent if loaded.path is not None else base_dir)
    declined += activation_declines(loaded.model)
    tensors = []
    for record in records:
        conv = WeightConversion(record, "auto")
        if conv.lossy_reason is not None:  # FP4 with arbitrary float scales: no exponents to forecast from
            lossy = {"k_min": None, "k_max": None, "spread": None, "lossless": False}
            experts = [{"expert": e, **lossy} for e in range(record.experts or 0)]
            entry = {"name": record.name, "node": node_label(record.node), "pattern": record.pattern,
                     "slot": record.slot, "shape": list(record.shape), "experts": record.experts, **lossy,
                     "lossless_per_tensor_scale": False, "per_expert": experts, "reason": conv.lossy_reason}
            if measure:  # the lossy path's own figures: exact where every value lands on the NVFP4 grid
                conv.result()
                entry.update({key: jsonable(conv.stats[key]) for key in _ERROR_KEYS})
                entry["lossless"] = conv.stats["max_abs_err"] == 0
            tensors.append(entry)
            continue
        mx = conv.mx()
        k = mx.exponents.numpy().astype(np.int64)
        packed = mx.codes.numpy().reshape(*k.shape, 16)
        holds = ((packed & 0x77) != 0).any(-1)  # a non-zero magnitude in either nibble of any byte of the block
        whole = _spread_entry(k, holds)
        entry = {"name": record.name, "node": node_label(record.node), "pattern": record.pattern, "slot": record.slot,
                 "shape": list(record.shape), "experts": record.experts, **layout_entry(record)}
        if record.experts is None:
            entry.update(whole, lossless_per_tensor_scale=whole["lossless"], per_expert=[])
        else:
            per_expert = [{"expert": e, **_spread_entry(k[e], holds[e])} for e in range(record.experts)]
            entry.update(
                k_min=whole["k_min"], k_max=whole["k_max"], spread=whole["spread"],
                lossless=all(p["lossless"] for p in per_expert),
                lossless_per_tensor_scale=whole["lossless"], per_expert=per_expert,
            )
        if measure:
            group_dims = 1 if record.experts is not None else 0
            tensor_error, group_error = _error_forecast(mx, group_dims, entry["lossless"])
            entry.update(tensor_error)
            for p, error in zip(entry["per_expert"], group_error):
                p.update(error)
        tensors.append(entry)
    experts = [p for t in tensors for p in t["per_expert"]]
    info = {
        "model": str(loaded.path) if loaded.path else f"<{loaded.kind}>",
        "tensors": tensors,
        "declined": [d.to_json() for d in declined],
        "summary": {"tensors": len(tensors), "lossless": sum(t["lossless"] for t in tensors),
                    "experts": len(experts), "experts_lossless": sum(p["lossless"] for p in experts)},
    }
    nvfp4 = inspect_nvfp4(loaded.model)
    if nvfp4["weights"] or nvfp4["activations"]:
        info["nvfp4"] = nvfp4
    return info


def inspect_nvfp4(model: ir.Model) -> dict:
    """The NVFP4 weights and activation quantizers fp4pass wrote into ``model`` and the problems of their scales
    (:mod:`fp4pass.onnx.nvfp4_forms`): ``{"forms", "scheme", "weights": [{"name", "node", "form", "shape",
    "experts", "global_scale", "global_scale_is"}], "activations": [{"activation", "node", "form",
    "input_scale"}], "problems": [{"kind", "tensor", "message"}]}``."""
    weights, quantizers = find_nvfp4(model)
    return {"forms": sorted({w.form for w in weights}), "scheme": scheme(quantizers),
            "weights": [w.to_json() for w in weights], "activations": [q.to_json() for q in quantizers],
            "problems": nvfp4_problems(weights, quantizers)}


def _scales_text(values) -> str:
    if values is None:
        return "-"
    if isinstance(values, float):
        return f"{values:.6g}"
    shown = ", ".join(f"{v:.4g}" for v in values[:4])
    return f"[{shown}{', ...' if len(values) > 4 else ''}]" if len(values) > 1 else f"{values[0]:.6g}"


def format_nvfp4(info: dict) -> list[str]:
    """The lines of the NVFP4 part of :func:`inspect`'s result."""
    nv = info["nvfp4"]
    lines = [f"{info['model']}: NVFP4 ({', '.join(nv['forms']) or 'activations only'}, {nv['scheme']}): "
             f"{len(nv['weights'])} weights, {len(nv['activations'])} activation quantizers"]
    rows: list = [("weight", "form", "shape", "experts", "global scale")]
    for w in nv["weights"]:
        label = "alpha " if w["global_scale_is"] == "alpha" else ""
        rows.append((w["name"], w["form"], str(w["shape"]), w["experts"] or "-",
                     label + _scales_text(w["global_scale"])))
    lines += aligned(rows, right=set())
    if nv["activations"]:
        rows = [("activation", "form", "input_scale")]
        rows += [(q["activation"], q["form"], _scales_text(q["input_scale"])) for q in nv["activations"]]
        lines += aligned(rows, right=set())
    if nv["problems"]:
        lines.append(f"{len(nv['problems'])} problem(s):")
        lines += [f"  {p['kind']}: {p['message']}" for p in nv["problems"]]
    else:
        lines.append("no problem found in the NVFP4 scales")
    return lines


def format_inspection(info: dict) -> str:
    """A human-readable table of :func:`inspect`'s result (the NVFP4 part alone when no MXFP4 tensor is left)."""
    if info.get("nvfp4") and not info["tensors"] and not info["declined"]:
        return "\n".join(format_nvfp4(info))
    lines = _format_mxfp4(info)
    if info.get("nvfp4"):
        lines += format_nvfp4(info)
    return "\n".join(lines)


def _format_mxfp4(info: dict) -> list[str]:
    summary = info["summary"]
    experts = f", {summary['experts_lossless']}/{summary['experts']} experts" if summary["experts"] else ""
    lines = [f"{info['model']}: {summary['tensors']} MXFP4 tensors, {summary['lossless']} forecast lossless"
             f"{experts} (per-expert global scales)"]
    rows: list = [("tensor", "pattern", "shape", "k range", "spread", "lossless")]
    for t in info["tensors"]:
        k_range = "-" if t["k_min"] is None else f"{t['k_min']}..{t['k_max']}"
        if t.get("reason"):
            verdict = "yes, every value exact on the NVFP4 grid" if t["lossless"] else "no"
            rows.append((t["name"], t["pattern"], str(t["shape"]), "-", "-", f"{verdict} ({t['reason']})"))
            if not t["lossless"] and t.get("mse") is not None:
                snr = "-" if t["snr_db"] is None else f"{t['snr_db']:.2f}"
                rows.append(f"{'':<4}auto: {t['blocks16_verbatim']}/{t['blocks16_total']} 16-halves verbatim, "
                            f"mse {t['mse']:.3g}, SNR {snr} dB")
            continue
        lossless = "yes" if t["lossless"] else "no"
        if t["experts"]:
            lossless += f" ({sum(p['lossless'] for p in t['per_expert'])}/{t['experts']} experts;" \
                        f" one scale for all: {'yes' if t['lossless_per_tensor_scale'] else 'no'})"
        rows.append((t["name"], t["pattern"], str(t["shape"]), k_range, t["spread"], lossless))
        if t.get("layout_read"):
            rows.append(f"{'':<4}QMoE weight layout read: {t['layout_read']} {t['layout_read_shape']} "
                        f"({t['layout_reason']}); convert writes {t['layout_written']} {t['layout_written_shape']}")
        if not t["lossless"] and t.get("mse") is not None:
            rows.append(f"{'':<4}auto: {t['blocks16_verbatim']}/{t['blocks16_total']} 16-halves verbatim, "
                        f"mse {t['mse']:.3g}, SNR {t['snr_db']:.2f} dB" if t["snr_db"] is not None else
                        f"{'':<4}auto: lossless")
        for p in t["per_expert"]:
            if not p["lossless"]:
                error = ""
                if p.get("mse") is not None:
                    snr = "lossless" if p["snr_db"] is None else f"SNR {p['snr_db']:.2f} dB"
                    error = (f"; auto: {p['blocks16_verbatim']}/{p['blocks16_total']} verbatim, "
                             f"mse {p['mse']:.3g}, {snr}")
                rows.append(f"{'':<4}expert {p['expert']}: k {p['k_min']}..{p['k_max']}, spread {p['spread']} > 17: "
                            f"lossy{error}")
    lines += aligned(rows, right={4})
    for d in info["declined"]:
        lines.append(declined_line(d))
    return lines
