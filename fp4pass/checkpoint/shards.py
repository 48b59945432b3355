"""Writing a planned checkpoint (:mod:`fp4pass.checkpoint.plan`) into its folder: the shards, tensor by tensor, and
the index, configs and other files beside them.

Each shard's header is written first, then each tensor as it is produced: converted units one at a time
(:mod:`fp4pass.checkpoint.engine`), lossless codes and copied tensors straight from the source file. Names,
dtypes and conventions come from the form records (:func:`fp4pass.checkpoint.output_forms.nvfp4_form`,
:data:`fp4pass.checkpoint.forms.MODELOPT_STACK`); compressed-tensors stores the reciprocals of ModelOpt's
multipliers. The report's entry of each unit is built here, where its figures are known.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from fp4pass.checkpoint import engine, output_forms
from fp4pass.checkpoint.byte_transpose import transpose_bytes, transpose_read
from fp4pass.safetensors.catalog import CONFIG_NAME, INDEX_NAME, QUANT_CONFIG_NAME, Catalog
from fp4pass.checkpoint.detect import FusedExperts, Linear
from fp4pass.checkpoint.forms import DIVISOR, MODELOPT_STACK
from fp4pass.checkpoint.input_scales import InputScales
from fp4pass.checkpoint.output_forms import nvfp4_form
from fp4pass.checkpoint.plan import Item, Plan, linears_of
from fp4pass.safetensors.files import DIRECT_ALIGN, CheckpointError, ShardWriter, aligned_view

__all__ = ["UnitFailed", "checked_reciprocal", "write_shards", "write_side_files"]


class UnitFailed(CheckpointError):
    """One unit's conversion failed (its tensors named in the message); ``allow_partial`` declines it."""

    def __init__(self, unit, error: CheckpointError):
        super().__init__(str(error))
        self.unit, self.reason = unit, str(error)



def _f32(value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32)


def checked_reciprocal(value: float, lin: Linear, output: str) -> float:
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
    for i, lin in enumerate(linears_of(item.unit)):
        m = lin.module
        write_codes(form.tensor(m, "codes"), i, lin)
        writer.write(form.tensor(m, "block_scales"), conv.scales[i])
        for role, multiplier in (("global_scale", conv.global_scale),
                                 ("input_scale", scales.values[m] if scales.values else None)):
            if multiplier is None:
                continue
            name = form.tensor(m, role)
            value = _f32(checked_reciprocal(multiplier, lin, name)).reshape(1) if divisor else _f32(multiplier)
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
        codes, block_scales = MODELOPT_STACK.tensor(p, "codes"), MODELOPT_STACK.tensor(p, "block_scales")
        for name, width, stack in ((codes, k // 2, conv.codes), (block_scales, k // 16, conv.scales)):
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


def write_shards(catalog, plan: Plan, tmp: Path, fmt: str, method: str, in_scales: InputScales,
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
    members = linears_of(unit)
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


def write_side_files(catalog: Catalog, tmp: Path, fmt: str, exclude: list[str], with_input: bool,
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
