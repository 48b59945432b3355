"""An engine's reading of a checkpoint's exclusion list, indexed once, and the engine's layers over the
checkpoint's modules (its fused modules).

:class:`Exclusions` builds, for one engine and one list, the rule its record names for the form
(:mod:`fp4pass.checkpoint.engines.rules`), the engine's run-time names of the modules, compressed-tensors'
config group targets and ModelOpt's MIXED_PRECISION layers where the engine reads them.
"""

from __future__ import annotations

from fp4pass.checkpoint.engines.records import engine_record
from fp4pass.checkpoint.engines.rules import NVFP4_ALGOS, QuantizedLayers, SchemeTargets
from fp4pass.checkpoint.families import family_of, fused_shards
from fp4pass.checkpoint.forms import GATE_NAMES
from fp4pass.safetensors.patterns import entries

__all__ = ["Exclusions", "exclusions", "is_excluded", "engine_modules", "FUSED_SHARDS"]

#: architecture -> the engines' fused modules and their shards (vLLM's ``packed_modules_mapping`` of each model
#: class), from the family records (:mod:`fp4pass.checkpoint.families`)
FUSED_SHARDS: dict[str, dict[str, tuple[str, ...]]] = fused_shards()


class Exclusions:
    """How ``engine`` reads the exclusion list ``exclude``, indexed once for many modules.

    ``form``: "modelopt" (``exclude_modules`` / ``ignore`` globs) or "compressed-tensors" (``ignore``: exact
    names and ``re:`` regexes, matched against vLLM's renamed names for ``architecture``). ``where`` names the
    list's config field in messages. Raises :class:`~fp4pass.safetensors.patterns.BadPattern` for an entry the
    engine cannot use (not a string, an invalid regex); :meth:`excluded` raises it for a regex that runs past
    its time (:mod:`fp4pass.safetensors.patterns`).
    """

    def __init__(self, engine: str, exclude, form: str = "modelopt", architecture: str | None = None,
                 where: str = "the exclusion list", quantized_layers: dict | None = None,
                 targets: list[str] | None = None):
        record = engine_record(engine)
        exclude = entries(exclude, where)
        rule = record.exclusion_rule.get(form, record.exclusion_rule["modelopt"])
        self._rule = rule(exclude, where, architecture)
        # SGLang looks modules up by its model's run-time names (Kimi-K3: ``model.layers.3.mlp.gate`` for the
        # checkpoint's ``language_model.model.layers.3.block_sparse_moe.gate``); vLLM's renames are its rule's own
        self._rename = record.module_name(architecture, record.lookup_names) if record.lookup_names else None
        # MIXED_PRECISION (vLLM): a layer not excluded is NVFP4 only where quantized_layers says so
        self._mixed = (QuantizedLayers(quantized_layers, family_of(architecture).vllm_fused)
                       if quantized_layers is not None and record.mixed_precision else None)
        # compressed-tensors: a Linear that no config group targets stays unquantized (vLLM and SGLang)
        self._targets = (SchemeTargets(targets, f"{where} (config_groups targets)")
                         if targets is not None and form == "compressed-tensors" and record.reads_targets else None)
        self._vllm_name = record.module_name(architecture, record.target_names)

    def _targeted(self, module: str, shards: list[str] | None) -> bool:
        """Whether a compressed-tensors config group targets ``module``. A routed-experts layer ``P.experts`` is
        matched through its first expert's gate projection under vLLM's RoutedExperts module
        (compressed_tensors_moe.py ``get_moe_method``: ``{layer}.0.{ckpt_gate_proj_name}``, the layer being
        ``P.experts.routed_experts`` in 0.33), whichever gate name the family's checkpoints use."""
        if module.endswith(".experts"):
            return any(self._targets.matches(self._vllm_name(f"{module}.routed_experts.0.{gate}"))
                       for gate in GATE_NAMES)
        return self._targets.matches(self._vllm_name(module), [self._vllm_name(s) for s in shards] if shards else None)

    def excluded(self, module: str, shards: list[str] | None = None) -> bool:
        """Whether the engine keeps ``module`` out of NVFP4 (see :func:`is_excluded`); under
        MIXED_PRECISION also a layer that ``quantized_layers`` leaves unquantized or gives another algorithm."""
        if self._rename is not None:
            module = self._rename(module)
            shards = [self._rename(s) for s in shards] if shards else shards
        if self._rule(module, shards):
            return True
        if self._targets is not None and not self._targeted(module, shards):
            return True
        return self._mixed is not None and self._mixed.algo(module) not in NVFP4_ALGOS


# the last lists indexed: validate and its verdicts share them
_RECENT: list[tuple[tuple, list, dict | None, Exclusions]] = []
_RECENT_KEPT = 6


def exclusions(engine: str, exclude, form: str = "modelopt", architecture: str | None = None,
               where: str = "the exclusion list", quantized_layers: dict | None = None,
               targets: list[str] | None = None) -> Exclusions:
    """:class:`Exclusions` for the list object ``exclude``, reusing the index built for that very list (the
    same object, unchanged in length) by a recent call: a checkpoint's list is read once and judged twice,
    by the validator's checks and by the engine verdicts, and a 600,000-entry list takes a second to index."""
    key = (engine, form, architecture, where, id(exclude), len(exclude) if isinstance(exclude, list) else -1,
           id(quantized_layers), tuple(targets) if isinstance(targets, list) else None)
    for known, listed, layers, rules in _RECENT:
        if known == key and listed is exclude and layers is quantized_layers:
            return rules
    rules = Exclusions(engine, exclude, form, architecture, where, quantized_layers, targets)
    _RECENT.insert(0, (key, exclude, quantized_layers, rules))
    del _RECENT[_RECENT_KEPT:]
    return rules


def is_excluded(engine: str, module: str, exclude, shards: list[str] | None = None, *,
                form: str = "modelopt", architecture: str | None = None) -> bool:
    """Whether ``engine`` keeps ``module`` unquantized under the exclusion list ``exclude`` (a list, or the
    :class:`Exclusions` built from one: build it once to judge many modules).

    ``module``: the engine's module name in checkpoint naming (a fused module's engine name with the shards'
    parent, ``model.layers.0.self_attn.qkv_proj``); ``shards``: the checkpoint names of its shards, or None.
    ``form``: "modelopt" (``exclude_modules`` / ``ignore`` globs) or "compressed-tensors" (``ignore``: exact
    names and ``re:`` regexes, matched against vLLM's renamed names for ``architecture``). Raises
    :class:`~fp4pass.checkpoint.engines.rules.MixedShards` where the engine raises because only some shards are
    excluded, and
    :class:`~fp4pass.safetensors.patterns.BadPattern` for an entry the engine cannot use.
    """
    rules = exclude if isinstance(exclude, Exclusions) else Exclusions(engine, exclude, form, architecture)
    return rules.excluded(module, shards)


def engine_modules(architecture: str | None, modules: list[str], fused: dict[str, tuple[str, ...]] | None = None
                   ) -> list[tuple[str, list[str] | None]]:
    """The engine's layers over the checkpoint modules ``modules``: (name, shards) per fused module whose
    shards are all present under one parent (shards are taken once, in the mapping's order), (name, None)
    for every other module. Routed experts (``...experts.E.w1``) are left to the caller."""
    fused = FUSED_SHARDS.get(architecture or "", {}) if fused is None else fused
    present = set(modules)
    taken: set[str] = set()
    out: list[tuple[str, list[str] | None]] = []
    parents = sorted({m.rsplit(".", 1)[0] for m in modules if "." in m})
    for parent in parents:
        for fused_name, shard_names in fused.items():
            shards = [f"{parent}.{s}" for s in shard_names]
            if all(s in present and s not in taken for s in shards):
                out.append((f"{parent}.{fused_name}", shards))
                taken.update(shards)
    out += [(m, None) for m in modules if m not in taken]
    return out
