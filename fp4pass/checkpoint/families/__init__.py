"""Model families as records: what fp4pass knows of one architecture, each fact beside the code it restates.

A family says where its text model's config lives (``text_config`` for a multimodal wrapper), how the serving
engines fuse its Linears and rename its modules, and which Linears stay in their own precision because an
engine builds them without a quantization method. Adding an architecture is adding a file here (one
:class:`Family`) and its tests; the readers, the writer and the engine rules find it through :func:`family_of`.
An architecture without a record gets :data:`GENERIC` (no fused modules, no renames).
"""

from __future__ import annotations

import importlib
import pkgutil

from fp4pass.checkpoint.families.record import Family

__all__ = ["Family", "FAMILIES", "GENERIC", "family_of", "architecture_of", "fused_shards"]


def _families() -> tuple[Family, ...]:
    """Every record of this package: each module but :mod:`.record` names its ``FAMILY`` (or ``FAMILIES``),
    taken in module-name order, so a new family is a new file."""
    found: list[Family] = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if info.name == "record":
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        found += list(getattr(module, "FAMILIES", None) or [module.FAMILY])
    return tuple(found)


FAMILIES: tuple[Family, ...] = _families()
GENERIC = Family("generic", ())
_BY_ARCHITECTURE = {arch: fam for fam in FAMILIES for arch in fam.architectures}


def architecture_of(config: dict | None) -> str | None:
    """config.json's ``architectures[0]``, or None."""
    archs = (config or {}).get("architectures")
    return archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None


def family_of(config_or_architecture) -> Family:
    """The record of a config.json (or of an architecture name); :data:`GENERIC` when there is none."""
    arch = config_or_architecture if isinstance(config_or_architecture, str) or config_or_architecture is None \
        else architecture_of(config_or_architecture)
    return _BY_ARCHITECTURE.get(arch or "", GENERIC)


def fused_shards() -> dict[str, dict[str, tuple[str, ...]]]:
    """architecture -> vLLM's fused modules and their shards, for every family that fuses any."""
    return {arch: dict(fam.vllm_fused) for fam in FAMILIES for arch in fam.architectures if fam.vllm_fused}
