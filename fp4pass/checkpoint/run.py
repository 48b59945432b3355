"""``convert``: a whole checkpoint folder, tensor by tensor, into a new folder; ``inspect``: what it holds.

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

Memory: two units at most, the one being converted and the one a writer thread is writing (each: its input
scales, its output scales, and its codes where they were re-encoded; lossless codes are copied file to file),
so the peak stays near two of the largest tensors, whatever the model's size.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from fp4pass.checkpoint import engine, output_forms
from fp4pass.checkpoint.byte_transpose import transpose_bytes, transpose_read
from fp4pass.safetensors.catalog import CONFIG_NAME, INDEX_NAME, QUANT_CONFIG_NAME, Catalog
from fp4pass.checkpoint.detect import FusedExperts, Linear, detect
from fp4pass.checkpoint.input_scales import InputScales, resolve_input_scales
from fp4pass.checkpoint.forms import CT_NVFP4, DIVISOR, MODELOPT_STACK
from fp4pass.checkpoint.output_forms import COMPRESSED_TENSORS_FORMAT, FORMATS, MODELOPT, nvfp4_form
from fp4pass.safetensors.files import (DIRECT_ALIGN, CheckpointError, OutputSpec, SafetensorsFile, ShardWriter,
                                               aligned_view)
from fp4pass.checkpoint.validate import validate_own_output
from fp4pass.choices import Method, values
from fp4pass.convert import DEFAULT_EFFORT, DEFAULT_THREADS, check_threads
from fp4pass.errors import UsageError
from fp4pass.formats.constants import E8M0_BIAS
from fp4pass.safetensors.hub import resolve_checkpoint
from fp4pass.io import atomic_folder
from fp4pass.progress import byte_progress

__all__ = ["convert", "inspect", "CheckFailed", "DEFAULT_SHARD_BYTES"]

log = logging.getLogger(__name__)

DEFAULT_SHARD_BYTES = 5_000_000_000  # as Hugging Face's writer: "5GB"


class UnitFailed(CheckpointError):
    """One unit's conversion failed (its tensors named in the message); ``allow_partial`` declines it."""

    def __init__(self, unit, error: CheckpointError):
        super().__init__(str(error))
        self.unit, self.reason = unit, str(error)


class CheckFailed(Exception):
    """``check=True`` found an expert that differs from its source beyond the rules; ``report`` says which."""

    def __init__(self, report: dict):
        super().__init__("check failed")
        self.report = report


@dataclass
class Item:
    """One step of the plan: a converted unit or a copied tensor, with the output tensors it writes."""

    unit: object  # Linear | (Linear, Linear) | FusedExperts | None (a copy)
    specs: list[OutputSpec]
    copy: str | None = None  # the source tensor copied as it is

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.specs)


@dataclass
class Plan:
    items: list[Item]
    shards: list[list[Item]] = field(default_factory=list)

    def shard_names(self) -> list[str]:
        n = len(self.shards)
        if n == 1:
            return ["model.safetensors"]
        return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def _members(unit) -> list[Linear]:
    return list(unit) if isinstance(unit, tuple) else [unit]


def _specs(unit, fmt: str, with_input: bool) -> list[OutputSpec]:
    if isinstance(unit, FusedExperts):
        return output_forms.fused_specs(unit, with_input)
    return [s for lin in _members(unit) for s in output_forms.linear_specs(lin, fmt, with_input)]


def _plan(catalog: Catalog, found, fmt: str, with_input: bool, max_shard_bytes: int) -> Plan:
    order = {name: i for i, name in enumerate(catalog.tensors)}
    placed: list[tuple[int, Item]] = []
    for unit in found.units:
        names = unit.consumed if isinstance(unit, FusedExperts) else [n for lin in _members(unit) for n in lin.consumed]
        placed.append((min(order[n] for n in names), Item(unit, _specs(unit, fmt, with_input))))
    for name, entry in catalog.tensors.items():
        if name not in found.consumed:
            placed.append((order[name], Item(None, [OutputSpec(name, entry.dtype, entry.shape)], copy=name)))
    placed.sort(key=lambda p: p[0])
    plan = Plan([item for _, item in placed])
    seen: set[str] = set()
    for item in plan.items:
        for spec in item.specs:
            if spec.name in seen:
                raise CheckpointError(f"{spec.name}: the converted checkpoint would hold this name twice (the source "
                                      "has a tensor of that name beside the MXFP4 weight it replaces)")
            seen.add(spec.name)
    current: list[Item] = []
    size = 0
    for item in plan.items:
        if current and size + item.nbytes > max_shard_bytes:
            plan.shards.append(current)
            current, size = [], 0
        current.append(item)
        size += item.nbytes
    if current:
        plan.shards.append(current)
    return plan


def _f32(value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32)


def _reciprocal(value: float, lin: Linear, output: str) -> float:
    """:func:`engine.reciprocal`, its error naming the source tensor and the output tensor it was for."""
    try:
        return engine.reciprocal(value)
    except CheckpointError as exc:
        raise CheckpointError(f"{lin.codes.shard}: tensor {lin.codes.name!r}: {output}: {exc}") from None


def _write_linears(catalog: Catalog, writer: ShardWriter, item: Item, conv: engine.Converted, fmt: str,
                   scales: InputScales) -> None:
    def write_codes(name: str, i: int, lin: Linear) -> None:
        if conv.codes is not None:
            writer.write(name, conv.codes[i])
        else:  # lossless: the source's bytes, copied file to file
            with catalog.shards[lin.codes.shard].opened() as fd:
                writer.copy_from(name, fd, lin.codes.begin, lin.codes.nbytes, lin.codes.shard)

    form = nvfp4_form(fmt)
    divisor = form.convention == DIVISOR  # compressed-tensors stores the reciprocals of the multipliers
    for i, lin in enumerate(_members(item.unit)):
        m = lin.module
        write_codes(form.tensor(m, "codes"), i, lin)
        writer.write(form.tensor(m, "block_scales"), conv.scales[i])
        for role, multiplier in (("global_scale", conv.global_scale),
                                 ("input_scale", scales.values[m] if scales.values else None)):
            if multiplier is None:
                continue
            name = form.tensor(m, role)
            value = _f32(_reciprocal(multiplier, lin, name)).reshape(1) if divisor else _f32(multiplier)
            writer.write(name, value)


def _write_fused(catalog: Catalog, writer: ShardWriter, unit: FusedExperts, conv: engine.Converted,
                 scales: InputScales) -> None:
    """ModelOpt's gpt-oss layout: [E, N, K/2] -> [E, K/2, N] and [E, N, K/16] -> [E, K/16, N], expert by expert.

    Each expert is transposed (cache-blocked; in two halves on two threads where the machine has two cores) into
    one of two reused buffers while the other is being written (numpy's copy and the write both release the
    GIL), so memory stays at a few experts and no page is faulted twice. Each buffer is placed in memory as its
    bytes will lie in the file (:func:`aligned_view`), so that their whole 4 KiB blocks go to the disk directly.
    Codes kept as they are (``conv.codes`` None) are read from the source a strip of rows at a time and
    transposed while in the cache (:func:`transpose_read`); converted ones and the scales from memory
    (:func:`transpose_bytes`).
    """
    p, e, n, k = unit.name, unit.experts, unit.rows, unit.cols
    source = catalog.shards[unit.codes.shard]
    row_bytes = k // 2

    def reader(expert: int):
        def read(begin: int, stop: int, rows: np.ndarray) -> None:
            source.read_bytes(unit.codes.name, (expert * n + begin) * row_bytes, rows)
        return read

    with ThreadPoolExecutor(1) as pool, ThreadPoolExecutor(1) as helper:
        halves = helper if (os.cpu_count() or 1) > 1 else None
        pending = None
        for name, width, stack in ((p, k // 2, conv.codes), (f"{p}_weight_scale", k // 16, conv.scales)):
            part, start = width * n, writer.file_offset(name)
            backings = [np.empty(part + DIRECT_ALIGN, dtype=np.uint8) for _ in range(2)]
            for i in range(e):
                # the write of expert i - 2, which used this backing, has finished; the view's address matches
                # its offset in the file, so the writer can send its whole blocks to the disk directly
                out = aligned_view(backings[i % 2], part, (start + i * part) % DIRECT_ALIGN).reshape(width, n)
                if stack is None:
                    transpose_read(reader(i), out, pool=halves)
                else:
                    transpose_bytes(stack[i].numpy(), out, pool=halves)
                if pending is not None:
                    pending.result()
                pending = pool.submit(writer.write_part, name, out)
            pending.result()
            pending = None
    writer.write(MODELOPT_STACK.tensor(p, "global_scale"), _f32(conv.global_scale))
    if scales.values:
        writer.write(MODELOPT_STACK.tensor(p, "input_scale"), _f32(scales.values[p]))


def _fused_entry(unit: FusedExperts, conv: engine.Converted, scales: InputScales) -> dict:
    """The report's entry of a gpt-oss stack: totals over its experts, and each expert's figures."""
    parts = conv.parts
    entry = {"name": unit.name, "form": unit.form, "source": [unit.codes.name, unit.scales.name],
             "shard": unit.codes.shard, "shape": [unit.experts, unit.rows, unit.cols], "experts": unit.experts,
             **_totals(parts), "global_scale": [conv.global_scale],
             "experts_lossless": sum(p["lossless"] for p in parts), "per_expert": parts,
             "outputs": [s.name for s in output_forms.fused_specs(unit, bool(scales.values))]}
    if scales.values:
        entry["input_scale"] = scales.values[unit.name]
    return entry


def _linear_entry(lin: Linear, part: dict, fmt: str, scales: InputScales, partner: str | None) -> dict:
    """The report's entry of one Linear; ``partner``: the other half of its gate/up pair (shared scales)."""
    entry = {"name": lin.module, "form": lin.form, "source": [lin.codes.name, lin.scales.name],
             "shard": lin.codes.shard, "shape": [lin.rows, lin.cols], "experts": 1, **part,
             "experts_lossless": int(part["lossless"]),
             "outputs": [s.name for s in output_forms.linear_specs(lin, fmt, bool(scales.values))]}
    if partner:
        entry["shares_scales_with"] = partner
    if scales.values:
        entry["input_scale"] = scales.values[lin.module]
    return entry


def _totals(parts: list[dict]) -> dict:
    total = sum(p["blocks16_total"] for p in parts)
    verbatim = sum(p["blocks16_verbatim"] for p in parts)
    mse = sum(p["mse"] * p["blocks16_total"] for p in parts) / total if total else 0.0
    snrs = [p["snr_db"] for p in parts if p["snr_db"] is not None]
    return {"blocks16_total": total, "blocks16_verbatim": verbatim, "blocks16_requantized": total - verbatim,
            "mse": mse, "max_abs_err": max((p["max_abs_err"] for p in parts), default=0.0),
            "snr_db": min(snrs) if snrs else None, "method_used": parts[0]["method_used"] if parts else None,
            "lossless": total == verbatim}


def _kept_modules(catalog: Catalog, found) -> list[str]:
    out = []
    for name in catalog.tensors:
        if name not in found.consumed and name.endswith(".weight"):
            out.append(name[: -len(".weight")])
    return out


def _converted_modules(found) -> list[str]:
    out = []
    for unit in found.units:
        out.extend([unit.prefix] if isinstance(unit, FusedExperts) else [lin.module for lin in _members(unit)])
    return out


def _load_scales(scales):
    if scales is None:
        return None, None
    from fp4pass.calib.scales import ActivationScales

    if isinstance(scales, (str, os.PathLike)):
        return ActivationScales.load(scales), str(scales)
    if hasattr(scales, "report_json"):  # a checkpoint calibration of this run (convert --calib), not a file
        return scales, "calibration"
    return scales, "SCALES.json"


def _open(src_dir, fmt: str, method: str, follow_symlinks: bool = False):
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


def convert(src_dir, out_dir, format: str = MODELOPT, input_scale: float | None = None, scales=None,  # noqa: A002
            method: str = "auto", *, max_shard_bytes: int = DEFAULT_SHARD_BYTES, check: bool = False,
            effort: str = DEFAULT_EFFORT, threads: int | None = DEFAULT_THREADS, allow_partial: bool = False,
            follow_symlinks: bool = False, before_rename=None, engine: str | None = None,
            overwrite: bool = False, show_progress: bool | None = None) -> dict:
    """Convert the MXFP4 checkpoint folder ``src_dir`` into an NVFP4 checkpoint folder ``out_dir``; the report.

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
    src_dir = resolve_checkpoint(src_dir)
    fmt = format
    start = time.perf_counter()
    if max_shard_bytes < 1:
        raise UsageError(f"max_shard_bytes must be >= 1, got {max_shard_bytes}")
    if threads is not None:
        check_threads(threads, "threads")
    scales_obj, scales_path = _load_scales(scales)
    catalog, found = _open(src_dir, fmt, method, follow_symlinks)
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


def _write_shards(catalog, plan: Plan, tmp: Path, fmt: str, method: str, in_scales: InputScales,
                  entries: list[dict], options: dict, advance=lambda nbytes: None) -> dict[str, str]:
    """Write every shard of the plan; the weight map (output tensor -> shard file).

    Two stages overlap: this thread reads and converts unit i + 1 while one writer thread writes unit i (its
    scales, and its codes copied file to file inside the kernel); both release the GIL in their long calls
    (numpy, ``preadv``, ``copy_file_range``, ``write``). At most one unit waits to be written, so memory
    holds two units at most. gpt-oss stacks are written by this thread (``_write_fused`` runs its own
    pipeline). A failure in either stage waits for the other before the shard is closed.
    """
    weight_map: dict[str, str] = {}
    with ThreadPoolExecutor(1, thread_name_prefix="fp4pass-writer") as pool:
        for shard_name, items in zip(plan.shard_names(), plan.shards):
            writer = ShardWriter(tmp / shard_name, [s for item in items for s in item.specs],
                                 metadata={"format": "pt"})
            pending = None
            try:
                for item in items:
                    for spec in item.specs:
                        weight_map[spec.name] = shard_name
                    job = _unit_job(catalog, writer, item, fmt, method, in_scales, entries, options,
                                    wait=lambda: pending.result() if pending is not None else None)
                    if pending is not None:
                        pending.result()  # the writer is free: at most one unit in flight
                    pending = pool.submit(job) if job is not None else None
                    advance(item.nbytes)
                if pending is not None:
                    pending.result()
                pending = None
                writer.close()
            finally:
                if pending is not None:  # a failure here: let the write in flight end before the file closes
                    pending.exception()
                writer.abort()
    return weight_map


def _unit_job(catalog, writer: ShardWriter, item: Item, fmt: str, method: str, in_scales: InputScales,
              entries: list[dict], options: dict, wait):
    """Convert one item of the plan here; the write that is left for the writer thread (or None when it was
    written here). ``wait()`` waits for the write in flight (called before this thread writes itself)."""
    if item.copy is not None:
        entry = catalog.tensors[item.copy]
        shard = catalog.shards[entry.shard]

        def copy() -> None:
            with shard.opened() as fd:
                writer.copy_from(item.copy, fd, entry.begin, entry.nbytes, entry.shard)
        return copy
    unit = item.unit
    if isinstance(unit, FusedExperts):
        try:
            conv = engine.convert_fused(catalog, unit, method, **options)
        except CheckpointError as exc:
            raise UnitFailed(unit, exc) from None
        wait()
        _write_fused(catalog, writer, unit, conv, in_scales)
        entries.append(_fused_entry(unit, conv, in_scales))
        return None
    members = _members(unit)
    try:
        conv = engine.convert_linears(catalog, members, method, **options)
    except CheckpointError as exc:
        raise UnitFailed(unit, exc) from None
    for i, lin in enumerate(members):
        partner = members[1 - i].module if len(members) == 2 else None
        entries.append(_linear_entry(lin, conv.parts[i], fmt, in_scales, partner))
    return lambda: _write_linears(catalog, writer, item, conv, fmt, in_scales)


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, allow_nan=False) + "\n")


def _write_side_files(catalog: Catalog, tmp: Path, fmt: str, exclude: list[str], with_input: bool,
                      weight_map: dict[str, str], plan: Plan) -> None:
    if len(plan.shards) > 1:
        total = sum(s.nbytes for item in plan.items for s in item.specs)
        _write_json(tmp / INDEX_NAME, {"metadata": {"total_size": total}, "weight_map": weight_map})
    config, hf_quant = output_forms.side_configs(fmt, catalog.config, exclude, with_input)
    _write_json(tmp / CONFIG_NAME, config)
    if hf_quant is not None:
        _write_json(tmp / QUANT_CONFIG_NAME, hf_quant)
    for name in catalog.other_files:
        try:
            catalog.copy_file(name, tmp / name)
        except OSError as exc:
            raise CheckpointError(f"{catalog.folder / name}: cannot be copied ({exc.strerror})") from None


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


def inspect(src_dir, follow_symlinks: bool = False) -> dict:
    """An NVFP4 checkpoint folder (ModelOpt's, compressed-tensors', fp4pass's): its validation, as ``fp4pass
    inspect`` prints it (:func:`fp4pass.checkpoint.validate.validate`: problems and engine verdicts).

    An MXFP4 folder: what ``src_dir`` holds: input forms, every MXFP4 weight with its shape and exponent spread, the tensors
    that would be copied, the files around them, and per expert whether ``convert`` (method ``auto``, its
    default effort) keeps it lossless.

    The forecast is the rule of :func:`fp4pass.convert.mxfp4_to_nvfp4` itself, so it agrees with what convert
    achieves. Where the scales decide it (every block of the unit, w1 and w3 of a pair together, within 17
    octaves and a normal float32 global scale: auto's lossless path, which never reads the codes) it comes
    from the scales alone (``forecast_from`` "scales"). Elsewhere auto may still keep experts lossless: blocks
    that hold no value do not count, and its search may pick a global scale 2^m/c (c an E4M3 mantissa) that
    keeps some experts exact; then the unit is converted here, in memory, by the engine convert uses, and the
    forecast is its verdict per expert (``forecast_from`` "codes"). ``src_dir``: a folder or a Hub model ID.
    """
    src_dir = resolve_checkpoint(src_dir)
    from fp4pass.checkpoint.validate import is_nvfp4_folder, validate

    if is_nvfp4_folder(src_dir, follow_symlinks=follow_symlinks):
        return validate(src_dir, follow_symlinks=follow_symlinks)
    catalog, found = _open(src_dir, MODELOPT, "auto", follow_symlinks)
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
    experts = unit.experts if isinstance(unit, FusedExperts) else len(_members(unit))
    if engine.takes_lossless_path(scales, "auto"):
        return [True] * experts, "scales", None
    try:
        if isinstance(unit, FusedExperts):
            conv = engine.convert_fused(catalog, unit, "auto")
        else:
            conv = engine.convert_linears(catalog, _members(unit), "auto")
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
    members = _members(unit)
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
    lines.append(f"{s['weights']} MXFP4 weights{_matrices(s['experts_total'], s['weights'])}, "
                 f"{s['experts_lossless_forecast']}/{s['experts_total']} forecast lossless"
                 + ("" if info["compressed_tensors_possible"] else "; gpt-oss fused experts: --format modelopt only"))
    return "\n".join(lines)


def _matrices(matrices: int, weights: int) -> str:
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
    return (f"{s['tensors_converted']} weights converted{_matrices(s['experts_total'], s['tensors_converted'])}, "
            f"{s['experts_lossless']}/{s['experts_total']} lossless, {s['tensors_copied']} tensors copied, "
            f"{len(report['shards'])} shard(s), "
            f"{s['bytes_written'] / 1e6:.1f} MB, format {report['format']}" +
            (f"; {len(report['declined'])} MXFP4 weight(s) declined (--allow-partial), left in MXFP4 form"
             if report.get("declined") else ""))
