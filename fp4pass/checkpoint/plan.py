"""Planning a converted checkpoint: every output tensor's name, dtype and shape, in source order, cut into shards.

The plan is made before a byte is written, so that the shard headers can be written first and every tensor
streamed into its place after (:mod:`fp4pass.checkpoint.shards`), and so that the engines' verdicts and the
exclusion list are known from the names alone. A unit (a Linear, a gate/up pair, a gpt-oss stack) is never split
across shards; a tensor the source holds beside the MXFP4 weight it replaces, under an output name, is refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fp4pass.checkpoint import output_forms
from fp4pass.safetensors.catalog import Catalog
from fp4pass.checkpoint.detect import FusedExperts, Linear
from fp4pass.checkpoint.forms import WEIGHT_SUFFIX
from fp4pass.safetensors.files import CheckpointError, OutputSpec

__all__ = ["Item", "Plan", "linears_of", "output_specs", "plan_output", "kept_modules", "converted_modules"]


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


def linears_of(unit) -> list[Linear]:
    """The Linears of a unit: one, or the two of a gate/up pair (which share their global and input scales)."""
    return list(unit) if isinstance(unit, tuple) else [unit]


def output_specs(unit, fmt: str, with_input: bool) -> list[OutputSpec]:
    """The output tensors of one unit in format ``fmt`` (input scales too when ``with_input``)."""
    if isinstance(unit, FusedExperts):
        return output_forms.fused_specs(unit, with_input)
    return [s for lin in linears_of(unit) for s in output_forms.linear_specs(lin, fmt, with_input)]


def plan_output(catalog: Catalog, found, fmt: str, with_input: bool, max_shard_bytes: int) -> Plan:
    """Every unit of ``found`` and every other tensor of ``catalog`` (copied as it is), in the source's order,
    cut into shards of at most ``max_shard_bytes`` (a unit larger than that is a shard of its own)."""
    order = {name: i for i, name in enumerate(catalog.tensors)}
    placed: list[tuple[int, Item]] = []
    for unit in found.units:
        fused = isinstance(unit, FusedExperts)
        names = unit.consumed if fused else [n for lin in linears_of(unit) for n in lin.consumed]
        placed.append((min(order[n] for n in names), Item(unit, output_specs(unit, fmt, with_input))))
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


def kept_modules(catalog: Catalog, found) -> list[str]:
    """The modules whose weight is copied as it is (not MXFP4): what the exclusion list is made of."""
    out = []
    for name in catalog.tensors:
        if name not in found.consumed and name.endswith(WEIGHT_SUFFIX):
            out.append(name[: -len(WEIGHT_SUFFIX)])
    return out


def converted_modules(found) -> list[str]:
    """The modules converted to NVFP4 (a gpt-oss stack by its prefix)."""
    out = []
    for unit in found.units:
        out.extend([unit.prefix] if isinstance(unit, FusedExperts) else [lin.module for lin in linears_of(unit)])
    return out
