"""``convert``: a whole checkpoint folder, tensor by tensor, into a new folder.

Order of work in :func:`convert`:

1. read the folder (:class:`~fp4pass.safetensors.catalog.Catalog`: every shard's header checked first), find
   the MXFP4 weights (:func:`~fp4pass.checkpoint.detect.detect`), resolve the input scales;
2. plan: every output tensor's name, dtype and shape, in source order, cut into shards of at most
   ``max_shard_bytes`` (a unit is never split);
3. write into a temporary folder beside OUT_DIR (:func:`fp4pass.io.atomic_folder`): each shard's header, then
   each tensor as it is produced (converted units one at a time; copied tensors straight from the source
   file), then the index, config.json, hf_quant_config.json and the other files; optionally check it;
4. fsync everything and rename the folder onto OUT_DIR. Any failure leaves no OUT_DIR; the source folder is
   only ever opened for reading.

The steps live beside it: :mod:`~fp4pass.checkpoint.plan` (2), :mod:`~fp4pass.checkpoint.shards` (3);
``inspect`` is :mod:`~fp4pass.checkpoint.inspection`.

Memory: two units at most, the one being converted and the one a writer thread is writing (each: its input
scales, its output scales, and its codes where they were re-encoded; lossless codes are copied file to file),
so the peak stays near two of the largest tensors, whatever the model's size.
"""

from __future__ import annotations

import logging
import math
import os
import time
from pathlib import Path

from fp4pass.checkpoint import output_forms
from fp4pass.safetensors.catalog import Catalog
from fp4pass.checkpoint.detect import FusedExperts, detect
from fp4pass.checkpoint.input_scales import resolve_input_scales
from fp4pass.checkpoint.forms import CT_NVFP4
from fp4pass.checkpoint.output_forms import COMPRESSED_TENSORS_FORMAT, FORMATS, MODELOPT, output_style
# the steps of convert, under the names its flow has always called them by
from fp4pass.checkpoint.plan import Plan
from fp4pass.checkpoint.plan import linears_of as _members
from fp4pass.checkpoint.plan import converted_modules as _converted_modules
from fp4pass.checkpoint.plan import kept_modules as _kept_modules
from fp4pass.checkpoint.plan import plan_output as _plan
from fp4pass.safetensors.files import CheckpointError, SafetensorsFile
from fp4pass.checkpoint.shards import UnitFailed
from fp4pass.checkpoint.shards import checked_reciprocal as _reciprocal
from fp4pass.checkpoint.shards import write_shards as _write_shards
from fp4pass.checkpoint.shards import write_side_files as _write_side_files
from fp4pass.checkpoint.validate import validate_own_output
from fp4pass.choices import Method, values
from fp4pass.convert import DEFAULT_EFFORT, DEFAULT_THREADS, check_threads
from fp4pass.errors import UsageError
from fp4pass.safetensors.hub import resolve_checkpoint
from fp4pass.io import atomic_folder
from fp4pass.progress import byte_progress

__all__ = ["convert", "CheckFailed", "DEFAULT_SHARD_BYTES", "open_checkpoint", "format_report", "summary_line",
           "declined_line"]

log = logging.getLogger(__name__)

DEFAULT_SHARD_BYTES = 5_000_000_000  # as Hugging Face's writer: "5GB"


class CheckFailed(Exception):
    """``check=True`` found an expert that differs from its source beyond the rules; ``report`` says which."""

    def __init__(self, report: dict):
        super().__init__("check failed")
        self.report = report


def _load_scales(scales):
    if scales is None:
        return None, None
    from fp4pass.calib.scales import ActivationScales

    if isinstance(scales, (str, os.PathLike)):
        return ActivationScales.load(scales), str(scales)
    if hasattr(scales, "report_json"):  # a checkpoint calibration of this run (convert --calib), not a file
        return scales, "calibration"
    return scales, "SCALES.json"


def open_checkpoint(src_dir, fmt: str, method: str, follow_symlinks: bool = False):
    if fmt not in FORMATS:
        raise UsageError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if method not in values(Method):
        raise UsageError(f"unknown method {method!r}; choose one of {', '.join(values(Method))}")
    catalog = Catalog.open(src_dir, follow_symlinks=follow_symlinks)
    try:
        found = detect(catalog.tensors, catalog.config)
        _refuse_empty(found)
    except BaseException:
        catalog.close()
        raise
    return catalog, found


def _refuse_empty(found) -> None:
    """CheckpointError naming the first MXFP4 weight with no element (a dimension 0: [0, N, K/32, 16],
    [E, 0, ...], [E, N, 0, 16], a [0, K/2] Linear): it has nothing to convert, and no engine loads an empty
    expert or projection."""
    for unit in found.units:
        for part in ([unit] if isinstance(unit, FusedExperts) else _members(unit)):
            for entry in (part.codes, part.scales):
                if 0 in entry.shape:
                    raise CheckpointError(f"{entry.shard}: tensor {entry.name!r}: shape {list(entry.shape)} holds no "
                                          "element: an empty MXFP4 weight has nothing to convert")


def _refuse_weight_only_fp8_form(src_dir, fmt: str, config: dict | None, with_input: bool) -> None:
    """DeepSeek-V4's own FP8 config with NVFP4 experts (``--format modelopt``) is W4A4 only: vLLM's DeepSeek-V4
    loader builds its NVFP4 experts from ``moe_quant_algo`` with input scales (models/deepseek_v4/
    quant_config.py) and has no weight-only variant, so without input scales that folder is one the validator
    rejects (``missing_scale``). Refused before anything is written, naming the flags that make it valid."""
    if with_input or output_style(fmt, config) != "deepseek-v4-fp8":
        return
    raise CheckpointError(f"{src_dir}: DeepSeek-V4 in its FP8 config form (--format modelopt) needs input scales "
                          "(W4A4: vLLM's DeepSeek-V4 NVFP4 experts have no weight-only form); give --calib DATA, "
                          "--scales SCALES.json or --input-scale X, or write --format compressed-tensors "
                          "(weight-only)")


def convert(source, output, format: str = MODELOPT, input_scale: float | None = None, scales=None,  # noqa: A002
            method: str = "auto", *, max_shard_bytes: int = DEFAULT_SHARD_BYTES, check: bool = False,
            effort: str = DEFAULT_EFFORT, threads: int | None = DEFAULT_THREADS, allow_partial: bool = False,
            follow_symlinks: bool = False, before_rename=None, engine: str | None = None,
            overwrite: bool = False, show_progress: bool | None = None) -> dict:
    """Convert the MXFP4 checkpoint folder ``source`` (``src_dir`` below) into an NVFP4 checkpoint folder
    ``output`` (``out_dir``); the report. ``source, output`` as in ``fp4pass.pipeline.convert`` (the ONNX door).

    ``engine``: "vllm", "sglang" or "trtllm": refuse (before anything is written) an output that engine's
    loader would not load (:func:`fp4pass.checkpoint.engines.engine_verdicts`; the report's ``engines`` holds
    the verdict of every engine either way).

    ``format``: "modelopt" or "compressed-tensors". ``input_scale``: one activation input_scale (a multiplier,
    amax / 2688) for every converted module; ``scales``: a SCALES.json path or an ActivationScales mapped onto
    module names (``fp4pass.checkpoint.input_scales``). Neither: weight-only. ``method``: the conversion
    method of ``fp4pass.convert`` (auto: lossless where the exponent spread allows, else the searched best).
    ``check``: read the result back with compressed-tensors and compare (``fp4pass.checkpoint.check``); a
    failure raises :class:`CheckFailed` and nothing is written. ``effort``, ``threads``: of every unit's
    conversion (:func:`fp4pass.convert.mxfp4_to_nvfp4`).

    Every unit is converted whole or not at all. An MXFP4 weight that cannot be (``detect``'s declines: codes
    without scales, shapes that do not fit; or a unit whose conversion fails) raises CheckpointError naming
    it, unless ``allow_partial``: then it is copied in its MXFP4 source form and named in the report's
    ``declined`` (``{"tensor", "shard", "reason"}``). A last check reads the written headers back: no MXFP4
    codes/scales pair is in the output unless declined.

    ``follow_symlinks``: read symlinks of the folder that lead out of it (refused by default:
    :mod:`fp4pass.safetensors.catalog`). ``before_rename(report)``: called once everything is written (and
    checked), before ``out_dir`` is renamed into place, which is the last step: what it writes (a report
    beside the folder) is in place first, and when it fails no ``out_dir`` appears. ``src_dir`` may be a Hugging
    Face Hub model ID (``org/name[@revision]``, :func:`fp4pass.safetensors.hub.resolve_checkpoint`). ``overwrite``: an
    existing ``out_dir`` that fp4pass wrote (it holds :data:`fp4pass.io.OUTPUT_MARKER`) is replaced by that
    rename, and only then removed; any other non-empty ``out_dir`` is refused. ``show_progress``: bars on
    stderr over the bytes written and the units checked (:mod:`fp4pass.progress`; None: on a terminal).
    """
    src_dir, out_dir = resolve_checkpoint(source), output
    fmt = format
    start = time.perf_counter()
    if max_shard_bytes < 1:
        raise UsageError(f"max_shard_bytes must be >= 1, got {max_shard_bytes}")
    if threads is not None:
        check_threads(threads, "threads")
    scales_obj, scales_path = _load_scales(scales)
    catalog, found = open_checkpoint(src_dir, fmt, method, follow_symlinks)
    with catalog:
        _refuse_declines(found, allow_partial)
        if not found.units:
            raise CheckpointError(f"{src_dir}: no MXFP4 weights found (none of the gpt-oss *_blocks/_scales, "
                                  "compressed-tensors weight_packed/weight_scale or DeepSeek weight/scale forms)")
        fused = [u for u in found.units if isinstance(u, FusedExperts)]
        if fmt == COMPRESSED_TENSORS_FORMAT and fused:
            raise CheckpointError(f"{fused[0].codes.shard}: tensor {fused[0].codes.name!r}: gpt-oss fused expert "
                                  "stacks have no standard compressed-tensors NVFP4 form; use --format modelopt")
        while True:
            in_scales = resolve_input_scales(found.units, input_scale, scales_obj, scales_path or "SCALES.json")
            with_input = bool(in_scales.values)
            _refuse_weight_only_fp8_form(src_dir, fmt, catalog.config, with_input)
            if fmt == COMPRESSED_TENSORS_FORMAT:  # its divisors: refused now rather than half-way through
                for unit in found.units:
                    for lin in ([] if isinstance(unit, FusedExperts) else _members(unit)):
                        if lin.module in in_scales.values:
                            _reciprocal(in_scales.values[lin.module], lin, CT_NVFP4.tensor(lin.module, "input_scale"))
            plan = _plan(catalog, found, fmt, with_input, max_shard_bytes)
            exclude = output_forms.exclude_list(_kept_modules(catalog, found), _converted_modules(found), fmt,
                                                catalog.config, set(catalog.tensors))
            verdicts = _engine_verdicts(catalog, plan, fmt, exclude, with_input, engine)
            entries: list[dict] = []
            try:
                with atomic_folder(out_dir, inputs=(src_dir,), overwrite=overwrite) as tmp:
                    with byte_progress(sum(i.nbytes for i in plan.items), "convert", show_progress) as bar:
                        weight_map = _write_shards(catalog, plan, tmp, fmt, method, in_scales, entries,
                                                   {"effort": effort, "threads": threads}, bar.update)
                    _no_undeclined_mxfp4(tmp, plan, found)
                    _write_side_files(catalog, tmp, fmt, exclude, with_input, weight_map, plan)
                    report = _report(src_dir, out_dir, fmt, method, found, entries, plan, in_scales, exclude,
                                     catalog, start)
                    report["engines"] = verdicts
                    if scales_path == "calibration":  # where the input scales came from, with its figures
                        report["input_scales"]["calibration"] = scales_obj.report_json()
                    # `fp4pass inspect` on the folder before its rename: a broken rule of the form is exit 3
                    report["validation"] = validate_own_output(tmp)
                    if check:
                        from fp4pass.checkpoint.check import check_checkpoint

                        report["check"] = check_checkpoint(catalog, found, tmp, fmt, method, show_progress)
                        _finite_figures(report)
                        if not report["check"]["passed"]:
                            raise CheckFailed(report)
                    report["summary"]["seconds"] = time.perf_counter() - start
                    _finite_figures(report)
                    if before_rename is not None:
                        before_rename(report)  # the rename of out_dir comes after it, as the last step
            except UnitFailed as failed:
                if not allow_partial:
                    raise CheckpointError(f"{failed.reason}; {_PARTIAL_HINT}") from None
                found = _decline_unit(found, failed)  # written again without it, from the start
                if not found.units:
                    raise CheckpointError(f"{src_dir}: every MXFP4 weight was declined; nothing to convert") from None
                continue
            break
    return report


NOT_FINITE_WHY = ("not finite: the source's values reach past float32 (E8M0 codes near 254 scale E2M1 values up "
                  "to 6 * 2^127), where the error arithmetic overflows; the weights were converted, only this "
                  "figure could not be computed")


def _finite_figures(report: dict) -> None:
    """JSON has no NaN or Inf: every figure of ``report`` that is not finite becomes null, and
    ``report["not_finite"]`` lists where (``tensors[3].per_expert[1].snr_db``) and why (:data:`NOT_FINITE_WHY`)."""
    where: list[str] = []

    def walk(node, path: str):
        if isinstance(node, dict):
            for key, value in node.items():
                if isinstance(value, float) and not math.isfinite(value):
                    node[key] = None
                    where.append(f"{path}.{key}" if path else key)
                else:
                    walk(value, f"{path}.{key}" if path else key)
        elif isinstance(node, list):
            for i, value in enumerate(node):
                if isinstance(value, float) and not math.isfinite(value):
                    node[i] = None
                    where.append(f"{path}[{i}]")
                else:
                    walk(value, f"{path}[{i}]")

    walk(report, "")
    if where:
        report.setdefault("not_finite", {"figures": [], "why": NOT_FINITE_WHY})["figures"].extend(where)


_PARTIAL_HINT = "--allow-partial copies such weights in their MXFP4 form and names them"


def _decline_message(d: dict) -> str:
    return f"{d['shard']}: tensor {d['tensor']!r}: {d['reason']}"


def _refuse_declines(found, allow_partial: bool) -> None:
    """CheckpointError naming the first MXFP4 weight ``detect`` declined, unless ``allow_partial``."""
    if found.declined and not allow_partial:
        more = len(found.declined) - 1
        raise CheckpointError(_decline_message(found.declined[0]) + (f" (and {more} more)" if more else "") +
                              f"; {_PARTIAL_HINT}")


def _decline_unit(found, failed: UnitFailed):
    """``found`` without the unit whose conversion failed; its codes tensors declined with the error."""
    unit = failed.unit
    members = [unit] if isinstance(unit, FusedExperts) else _members(unit)
    names = {n for m in members for n in m.consumed}
    declined = found.declined + [{"tensor": m.codes.name, "shard": m.codes.shard, "reason": failed.reason}
                                 for m in members]
    return type(found)([u for u in found.units if u is not unit], found.consumed - names, declined, found.forms)


def _no_undeclined_mxfp4(tmp: Path, plan: Plan, found) -> None:
    """The last guard: read the written shard headers back and find MXFP4 weights as ``detect`` does; any that is
    not a declined one is a bug (an MXFP4 tensor in an NVFP4 checkpoint, in silence)."""
    tensors: dict = {}
    for name in plan.shard_names():
        with SafetensorsFile(tmp / name) as shard:
            tensors.update(shard.entries)
    declined = {d["tensor"] for d in found.declined}
    for unit in detect(tensors, {}).units:
        for member in [unit] if isinstance(unit, FusedExperts) else _members(unit):
            if member.codes.name not in declined:
                raise RuntimeError(f"{member.codes.shard}: tensor {member.codes.name!r} is still an MXFP4 weight in "
                                   "the NVFP4 output, and was not declined")


def _engine_verdicts(catalog: Catalog, plan: Plan, fmt: str, exclude: list[str], with_input: bool,
                     engine: str | None) -> dict:
    """Each engine's verdict on the output about to be written (its configs and tensor names, known from the
    plan); with ``engine``, a CheckpointError when that one would not load it."""
    from fp4pass.checkpoint.engines import ENGINES, engine_verdicts

    if engine is not None and engine not in ENGINES:
        raise UsageError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINES)}")
    config, hf_quant = output_forms.side_configs(fmt, catalog.config, exclude, with_input)
    verdicts = engine_verdicts(config, hf_quant, [s.name for item in plan.items for s in item.specs])
    if engine is not None and not verdicts[engine]["loads"]:
        raise CheckpointError(f"{catalog.folder}: the {fmt} output would not load in {engine}: "
                              f"{verdicts[engine]['why']}")
    return verdicts


def _report(src_dir, out_dir, fmt, method, found, entries, plan, in_scales, exclude, catalog, start) -> dict:
    experts_total = sum(e["experts"] for e in entries)
    experts_lossless = sum(e["experts_lossless"] for e in entries)
    copied = [item.copy for item in plan.items if item.copy is not None]
    return {
        "source": str(src_dir), "output": str(out_dir), "format": fmt, "method": method,
        "input_forms": sorted(found.forms), "tensors": entries, "declined": found.declined,
        "input_scales": in_scales.to_json(), "exclude_modules": exclude,
        "shards": [{"file": name, "tensors": sum(len(i.specs) for i in items),
                    "bytes": sum(i.nbytes for i in items)} for name, items in zip(plan.shard_names(), plan.shards)],
        "files_copied": list(catalog.other_files), "not_copied": list(catalog.skipped),
        "summary": {"tensors_converted": len(entries), "experts_total": experts_total,
                    "experts_lossless": experts_lossless, "tensors_copied": len(copied),
                    "bytes_written": sum(i.nbytes for i in plan.items),
                    "seconds": time.perf_counter() - start},
    }


def matrices_note(matrices: int, weights: int) -> str:
    """How the lossless counts count: one per weight (a Linear, an expert's w1 or a dense o_proj alike), and
    each expert of a stacked weight (gpt-oss's [E, N, K]) apart: said when that makes more than the weights."""
    return "" if matrices == weights else f" ({matrices} matrices: a stacked weight counts each expert)"


def format_report(report: dict) -> str:
    """A header, one line per converted weight and a summary line."""
    lines = [f"{'weight':<60} {'experts':<12}  {'global scale':<12}  SNR vs MXFP4"] if report["tensors"] else []
    for t in report["tensors"]:
        snr = ("lossless" if t["lossless"] else "snr not finite (see the report's not_finite)"
               if t["snr_db"] is None else f"snr {t['snr_db']:.2f} dB")
        lines.append(f"{t['name']:<60} {t['experts_lossless']}/{t['experts']} lossless  S={t['global_scale'][0]:.6g}"
                     f"  {snr}")
    lines.extend(declined_line(d) for d in report.get("declined", []))
    lines.append(summary_line(report))
    return "\n".join(lines)


def declined_line(d: dict) -> str:
    """An ``--allow-partial`` decline: the weight left in MXFP4, its shard and why (a warning in the CLI)."""
    return f"declined, left in its MXFP4 form: {d['tensor']} ({d['shard']}): {d['reason']}"


def summary_line(report: dict) -> str:
    s = report["summary"]
    return (f"{s['tensors_converted']} weights converted{matrices_note(s['experts_total'], s['tensors_converted'])}, "
            f"{s['experts_lossless']}/{s['experts_total']} lossless, {s['tensors_copied']} tensors copied, "
            f"{len(report['shards'])} shard(s), "
            f"{s['bytes_written'] / 1e6:.1f} MB, format {report['format']}" +
            (f"; {len(report['declined'])} MXFP4 weight(s) declined (--allow-partial), left in MXFP4 form"
             if report.get("declined") else ""))
