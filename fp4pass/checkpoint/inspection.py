"""``inspect`` of a checkpoint folder: what an MXFP4 folder holds and which experts ``convert`` keeps lossless (an
NVFP4 folder: its validation, :func:`fp4pass.checkpoint.validate.validate`), and its table for the terminal."""

from __future__ import annotations

import torch

from fp4pass.checkpoint import engine
from fp4pass.safetensors.catalog import Catalog
from fp4pass.checkpoint.detect import FusedExperts
from fp4pass.checkpoint.output_forms import MODELOPT
from fp4pass.checkpoint.plan import linears_of
from fp4pass.checkpoint.run import matrices_note, open_checkpoint
from fp4pass.safetensors.files import CheckpointError
from fp4pass.formats.constants import E8M0_BIAS
from fp4pass.safetensors.hub import resolve_checkpoint

__all__ = ["inspect", "format_inspection"]


def inspect(source, follow_symlinks: bool = False) -> dict:
    """An NVFP4 checkpoint folder (ModelOpt's, compressed-tensors', fp4pass's): its validation, as ``fp4pass
    inspect`` prints it (:func:`fp4pass.checkpoint.validate.validate`: problems and engine verdicts).

    An MXFP4 folder: what ``source`` holds: input forms, every MXFP4 weight with its shape and exponent spread,
    the tensors that would be copied, the files around them, and per expert whether ``convert`` (method
    ``auto``, its default effort) keeps it lossless.

    The forecast is the rule of :func:`fp4pass.convert.mxfp4_to_nvfp4` itself, so it agrees with what convert
    achieves. Where the scales decide it (every block of the unit, w1 and w3 of a pair together, within 17
    octaves and a normal float32 global scale: auto's lossless path, which never reads the codes) it comes
    from the scales alone (``forecast_from`` "scales"). Elsewhere auto may still keep experts lossless: blocks
    that hold no value do not count, and its search may pick a global scale 2^m/c (c an E4M3 mantissa) that
    keeps some experts exact; then the unit is converted here, in memory, by the engine convert uses, and the
    forecast is its verdict per expert (``forecast_from`` "codes"). ``source``: a folder or a Hub model ID.
    """
    src_dir = resolve_checkpoint(source)
    from fp4pass.checkpoint.validate import is_nvfp4_folder, validate

    if is_nvfp4_folder(src_dir, follow_symlinks=follow_symlinks):
        return validate(src_dir, follow_symlinks=follow_symlinks)
    catalog, found = open_checkpoint(src_dir, MODELOPT, "auto", follow_symlinks)
    with catalog:
        weights = []
        for unit in found.units:
            weights.extend(_inspect_group(catalog, unit))
        lossless = sum(w["experts_lossless_forecast"] for w in weights)
        total = sum(w["experts"] for w in weights)
        return {"source": str(src_dir), "input_forms": sorted(found.forms), "weights": weights,
                "declined": found.declined,
                "copied": [n for n in catalog.tensors if n not in found.consumed],
                "shards": sorted(catalog.shards), "files": catalog.other_files, "not_copied": catalog.skipped,
                "compressed_tensors_possible": not any(isinstance(u, FusedExperts) for u in found.units),
                "summary": {"weights": len(weights), "experts_total": total, "experts_lossless_forecast": lossless}}


def _spread(scales: torch.Tensor) -> tuple[int, int]:
    """(k_min, k_max) of E8M0 codes over every block (those that hold no value too)."""
    arr = scales.numpy()
    return int(arr.min()) - E8M0_BIAS, int(arr.max()) - E8M0_BIAS


def _forecast(catalog: Catalog, unit, scales: torch.Tensor) -> tuple[list[bool], str, str | None]:
    """(lossless per expert under ``convert``'s auto, "scales" or "codes", the error that stops a conversion)."""
    experts = unit.experts if isinstance(unit, FusedExperts) else len(linears_of(unit))
    if engine.takes_lossless_path(scales, "auto"):
        return [True] * experts, "scales", None
    try:
        if isinstance(unit, FusedExperts):
            conv = engine.convert_fused(catalog, unit, "auto")
        else:
            conv = engine.convert_linears(catalog, linears_of(unit), "auto")
    except CheckpointError as exc:
        return [False] * experts, "codes", str(exc)
    return [bool(p["lossless"]) for p in conv.parts], "codes", None


def _inspect_group(catalog: Catalog, unit) -> list[dict]:
    """The inspection entries of one unit: a gpt-oss stack, a Linear, or w1 and w3 of a pair (each with its own
    spread and the pair's shared one, which decides their common global scale)."""
    if isinstance(unit, FusedExperts):
        scales = catalog.read(unit.scales.name).view(torch.uint8)
        lo, hi = _spread(scales)
        flags, source, problem = _forecast(catalog, unit, scales)
        entry = {"name": unit.name, "form": unit.form, "shape": [unit.experts, unit.rows, unit.cols],
                 "experts": unit.experts, "k_min": lo, "k_max": hi, "spread": hi - lo,
                 "global_scale": "one for all experts", "experts_lossless_forecast": sum(flags),
                 "per_expert_lossless_forecast": flags, "forecast_from": source,
                 "per_expert_spread": [h - l for l, h in (_spread(scales[e]) for e in range(unit.experts))]}
        return [entry | ({"problem": problem} if problem else {})]
    members = linears_of(unit)
    own = [catalog.read(lin.scales.name).view(torch.uint8) for lin in members]
    ranges = [_spread(s) for s in own]
    flags, source, problem = _forecast(catalog, unit, torch.stack(own) if len(own) > 1 else own[0])
    lo, hi = min(r[0] for r in ranges), max(r[1] for r in ranges)
    out = []
    for i, (lin, (l, h)) in enumerate(zip(members, ranges)):
        entry = {"name": lin.module, "form": lin.form, "shape": [lin.rows, lin.cols], "experts": 1, "k_min": l,
                 "k_max": h, "spread": h - l, "experts_lossless_forecast": int(flags[i]), "forecast_from": source}
        if len(members) == 2:
            entry["shared_spread"] = hi - lo
            entry["shares_scales_with"] = members[1 - i].module
        if problem:
            entry["problem"] = problem
        out.append(entry)
    return out


def format_inspection(info: dict) -> str:
    """A table of ``inspect``'s result for the terminal: each weight's own exponent spread, the spread its gate/up
    pair shares (which sets their one global scale), the lossless forecast and where it comes from; an NVFP4
    folder's validation as :func:`fp4pass.checkpoint.validate.format_validation` prints it."""
    if "engines" in info:
        from fp4pass.checkpoint.validate import format_validation

        return format_validation(info)
    lines = [f"{info['source']}: input forms {', '.join(info['input_forms']) or 'none'}; "
             f"{len(info['shards'])} shard(s); {len(info['copied'])} tensors copied as they are"]
    lines.append(f"{'weight':<60} {'form':<18} {'shape':<20} {'spread':>6} {'pair':>4}  lossless  forecast from")
    for w in info["weights"]:
        shape = "x".join(map(str, w["shape"]))
        pair = str(w["shared_spread"]) if "shared_spread" in w else "-"
        lossless = f"{w['experts_lossless_forecast']}/{w['experts']}"
        lines.append(f"{w['name']:<60} {w['form']:<18} {shape:<20} {w['spread']:>6} {pair:>4}  {lossless:<8}  "
                     f"{w['forecast_from']}" + (f" ({w['problem']})" if w.get("problem") else ""))
    for d in info["declined"]:
        lines.append(f"declined {d['tensor']}: {d['reason']}")
    if info["not_copied"]:
        lines.append(f"not copied: {', '.join(info['not_copied'])}")
    s = info["summary"]
    lines.append(f"{s['weights']} MXFP4 weights{matrices_note(s['experts_total'], s['weights'])}, "
                 f"{s['experts_lossless_forecast']}/{s['experts_total']} forecast lossless"
                 + ("" if info["compressed_tensors_possible"] else "; gpt-oss fused experts: --format modelopt only"))
    return "\n".join(lines)
