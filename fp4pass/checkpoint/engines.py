"""What the serving engines' loaders do with an NVFP4 checkpoint: exclusion rules, fused modules, verdicts.

Each rule below restates one engine function, named in its docstring (vLLM 0.33.0 and SGLang 0.5.23 wheels,
TensorRT-LLM's ``tensorrt_llm`` sources), so that a checkpoint can be judged without the engine installed.
The vLLM rules are also checked against vLLM's own code in the test suite.

Vocabulary:

- *module*: a checkpoint module name (``model.layers.0.self_attn.q_proj``, DeepSeek-V4 ``layers.0.attn.wq_a``);
- *fused module*: one engine layer built from several checkpoint modules, its *shards*
  (vLLM ``qkv_proj`` <- ``q_proj``, ``k_proj``, ``v_proj``); the engine decides the fused module's precision
  from its own name and its shards' names;
- *exclusion list*: ModelOpt's ``exclude_modules`` / config.json ``ignore`` (globs), or compressed-tensors'
  ``ignore`` (exact names and ``re:`` regexes).

:func:`engine_verdicts` gives, per engine, whether a checkpoint folder's configs and tensor names load, in
which mode (``W4A4``: activations quantized with the stored input scales; ``W4A16``: bf16 activations), and
why not.
"""

from __future__ import annotations

import operator
import re

from fp4pass.checkpoint.configs import quantization_config
from fp4pass.checkpoint.families import deepseek_v4, family_of, fused_shards, gpt_oss
from fp4pass.checkpoint.forms import GATE_NAMES
from fp4pass.safetensors.patterns import BadPattern, Budget, GlobIndex, RegexList, SubstringIndex, dotted_runs, entries

__all__ = ["ENGINES", "FUSED_SHARDS", "MixedShards", "BadPattern", "Exclusions", "exclusions", "is_excluded",
           "engine_modules", "vllm_module_name", "engine_verdicts", "verdict_line", "ARCH_GPT_OSS", "ARCH_DEEPSEEK_V4"]

ENGINES = ("vllm", "sglang", "trtllm")

ARCH_GPT_OSS = gpt_oss.FAMILY.architectures[0]
ARCH_DEEPSEEK_V4 = deepseek_v4.ARCHITECTURE

#: architecture -> the engines' fused modules and their shards (vLLM's ``packed_modules_mapping`` of each model
#: class), from the family records (:mod:`fp4pass.checkpoint.families`)
FUSED_SHARDS: dict[str, dict[str, tuple[str, ...]]] = fused_shards()

# SGLang 0.5.23 layers/quantization/utils.py ``_FALLBACK_FUSED_SHARDS``: the fused modules SGLang splits when
# the quantization config carries no ``packed_modules_mapping`` (ours never does).
_SGLANG_FALLBACK_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


class MixedShards(ValueError):
    """Some shards of a fused module are excluded and others not: vLLM and SGLang raise at model build."""


def vllm_module_name(architecture: str | None, module: str) -> str:
    """The name vLLM gives the module ``module`` of a checkpoint of ``architecture`` (its hf_to_vllm_mapper, as
    the family record restates it: DeepSeek-V4's ``layers.`` -> ``model.layers.``, ``head`` -> ``lm_head``;
    Kimi-K3's ``mm_projector.proj.0`` -> ``mm_projector.linear_1``). gpt-oss's ``.self_attn.`` -> ``.attn.`` is
    applied to patterns and names alike, so it never changes a match and is not recorded.
    """
    return family_of(architecture).vllm_name(module)


def _split_prefix_wildcards(patterns: list[str]) -> list[str]:
    """vLLM modelopt.py ModelOptQuantConfigBase.apply_vllm_mapper: ``X*`` (not ``X.*``) becomes ``X``, ``X.*``."""
    out = []
    for p in patterns:
        if len(p) >= 2 and p[-1] == "*" and p[-2] != ".":
            out += [p[:-1], p[:-1] + ".*"]
        else:
            out.append(p)
    return out


def _shards_rule(module: str, shards: list[str] | None, match) -> bool:
    """The fused-module rule shared by vLLM and SGLang ``is_layer_skipped``: the fused name itself (vLLM checks
    it first), else every shard must match, and a mix raises."""
    if not shards:
        return match(module)
    hits = [match(s) for s in shards]
    if any(hits) and not all(hits):
        raise MixedShards(f"{module}: shards {', '.join(s for s, h in zip(shards, hits) if h)} are excluded but "
                          f"{', '.join(s for s, h in zip(shards, hits) if not h)} are not")
    return all(hits)


class _VllmModelopt:
    """vLLM 0.33.0 model_executor/layers/quantization/modelopt.py ``ModelOptQuantConfigBase.is_layer_excluded``
    (after ``apply_vllm_mapper`` split the prefix wildcards):

    1. quant_utils.py ``is_layer_skipped`` (exact): the fused name in the list, else every shard's exact name
       in the list (a mix raises);
    2. any entry that is a substring of the (fused) name;
    3. any entry that fnmatches the (fused) name. Globs never see the shard names.
    """

    def __init__(self, exclude: list[str], where: str):
        patterns = _split_prefix_wildcards(exclude)
        budget = Budget(where)  # one CPU budget for the list's rules (patterns.Budget)
        self.inside = SubstringIndex(patterns, budget)
        self.exact = self.inside.entries
        self.globs = GlobIndex(patterns, exact=False, budget=budget)

    def __call__(self, module: str, shards: list[str] | None) -> bool:
        if module in self.exact:
            return True
        if shards and _shards_rule(module, shards, self.exact.__contains__):
            return True
        return self.inside.found_in(module) or self.globs.match(module)


class _VllmCompressedTensors:
    """vLLM 0.33.0 compressed_tensors/compressed_tensors.py ``CompressedTensorsConfig.get_quant_method`` ->
    compressed_tensors/utils.py ``should_ignore_layer`` -> utils/config_utils.py ``find_matching_patterns`` /
    ``is_equal_or_regex_match``: an entry equal to the vLLM name, or a ``re:`` entry whose regex ``re.match``es
    it; for a fused module, the fused name first, else every shard (a mix raises).

    Names are vLLM's (after the model's hf_to_vllm_mapper); ``apply_vllm_mapper`` renames plain entries that
    contain a ``.`` but leaves ``re:`` entries as written.
    """

    def __init__(self, ignore: list[str], where: str, architecture):
        self.architecture = architecture
        self.plain = {vllm_module_name(architecture, p) for p in ignore if not p.startswith("re:") and "." in p}
        self.plain |= {p for p in ignore if not p.startswith("re:") and "." not in p}
        self.regexes = RegexList([p[3:] for p in ignore if p.startswith("re:")], where,
                                 shown={p[3:]: p for p in ignore if p.startswith("re:")})

    def match(self, name: str) -> bool:
        name = vllm_module_name(self.architecture, name)
        return name in self.plain or self.regexes.search(name)

    def __call__(self, module: str, shards: list[str] | None) -> bool:
        if self.match(module):
            return True
        return bool(shards) and _shards_rule(module, shards, self.match)


# SGLang's glob-to-regex translation keeps every regex character but ``.`` and ``*``
_REGEX_SYNTAX = frozenset("\\^$+?{}[]|()")
_REGEX_SYNTAX_RE = re.compile(r"[\\^$+?{}\[\]|()]")
_MLA_TAILS = {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"}


def _sglang_regex(pattern: str) -> str:
    return pattern.replace(".", r"\.").replace("*", ".*")


class _SglangModelopt:
    """SGLang 0.5.23 layers/quantization/modelopt_quant.py ``ModelOptQuantConfig._get_quant_method`` for a
    Linear: ``is_layer_skipped`` (utils.py ``_module_path_match``: an entry equal to the name, a dotted
    ancestor of it, or a dotted run of components inside it: ``".E."`` in ``".name."``; for a fused module
    every shard, a mix raises) or ``is_layer_excluded`` (each entry a glob turned regex, ``.`` literal and
    ``*`` -> ``.*``, fullmatched against the whole name or any one component; the fused shard tails
    ``q_a_proj``, ``kv_a_proj_with_mqa``, ... found inside the name's last component).

    An entry without other regex syntax is matched as a ``*``-only glob (:class:`~fp4pass.safetensors.patterns.
    Glob`, no backtracking); the others as SGLang's regex, with a timeout."""

    def __init__(self, exclude: list[str], where: str):
        self.paths = set(map(operator.methodcaller("rstrip", "."), exclude))
        self.path_dots = set(map(operator.methodcaller("count", "."), self.paths))
        if _REGEX_SYNTAX_RE.search("\n".join(exclude)):
            self.simple = [p for p in exclude if _REGEX_SYNTAX.isdisjoint(p)]
        else:
            self.simple = exclude
        self.budget = Budget(where)
        self.globs = GlobIndex(self.simple, classes=False, budget=self.budget)
        translated = {_sglang_regex(p): p for p in exclude if not _REGEX_SYNTAX.isdisjoint(p)} if len(
            self.simple) < len(exclude) else {}
        self.regexes = RegexList(translated, f"{where} (as SGLang's regexes)", fullmatch=True, shown=translated)
        self.multiline = None  # the simple globs as regexes, for names with a newline (``.*`` stops there)
        self.where = where
        self.tails = {p.rsplit(".", 1)[-1] for p in exclude} & _MLA_TAILS

    def path_match(self, name: str) -> bool:
        with self.budget:
            return any(run in self.paths for run in dotted_runs(name.rstrip("."), self.path_dots, self.budget))

    def glob_match(self, name: str) -> bool:
        if "\n" in name and any("*" in p for p in self.simple):
            if self.multiline is None:
                self.multiline = RegexList([_sglang_regex(p) for p in self.simple], self.where, fullmatch=True)
            return self.multiline.search(name) or (bool(self.regexes) and self.regexes.search(name))
        return self.globs.match(name) or (bool(self.regexes) and self.regexes.search(name))

    def __call__(self, module: str, shards: list[str] | None) -> bool:
        if _shards_rule(module, shards, self.path_match):
            return True
        parts = module.split(".")
        if self.glob_match(module) or any(self.glob_match(part) for part in parts):
            return True
        return any(tail in parts[-1] for tail in self.tails)


class _SglangCompressedTensors:
    """SGLang 0.5.23 layers/quantization/compressed_tensors/compressed_tensors.py (adapted from vLLM's
    ``should_ignore_layer``): exact names or ``re:`` regexes (``re.match``), every shard of a fused module."""

    def __init__(self, ignore: list[str], where: str):
        self.exact = {p for p in ignore if not p.startswith("re:")}
        self.regexes = RegexList([p[3:] for p in ignore if p.startswith("re:")], where,
                                 shown={p[3:]: p for p in ignore if p.startswith("re:")})

    def match(self, name: str) -> bool:
        return name in self.exact or self.regexes.search(name)

    def __call__(self, module: str, shards: list[str] | None) -> bool:
        return self.match(module) or (bool(shards) and _shards_rule(module, shards, self.match))


class _Trtllm:
    """TensorRT-LLM tensorrt_llm/models/modeling_utils.py ``QuantConfig.is_module_excluded_from_quantization``:
    ``fnmatchcase`` of the engine's own module name (the fused ``qkv_proj``, never its shards) against each
    entry; ``re:`` entries are not understood (they match nothing)."""

    def __init__(self, exclude: list[str], where: str):
        self.globs = GlobIndex((p for p in exclude if not p.startswith("re:")), budget=Budget(where))

    def __call__(self, module: str, shards: list[str] | None) -> bool:
        return self.globs.match(module)


class SchemeTargets:
    """compressed-tensors ``config_groups[*].targets``, as vLLM 0.33.0 reads them (compressed_tensors/utils.py
    ``find_matched_target``; SGLang's copy of it likewise): a Linear that no target matches gets no scheme and
    stays unquantized (``CompressedTensorsConfig.get_scheme`` returns None). A target matches a layer's name
    exactly, or as a ``re:`` regex (``re.match``), or for a fused layer every shard's name, or the layer's class
    name by containment, so ``Linear`` matches every Linear class (``QKVParallelLinear``, ``ReplicatedLinear``)."""

    def __init__(self, targets: list[str], where: str):
        targets = entries(targets, where)
        self.every = any(not t.startswith("re:") and "." not in t and t.endswith("Linear") for t in targets)
        self.names = {t for t in targets if not t.startswith("re:")}
        self.regexes = RegexList([t[3:] for t in targets if t.startswith("re:")], where,
                                 shown={t[3:]: t for t in targets if t.startswith("re:")})

    def _one(self, name: str) -> bool:
        return name in self.names or self.regexes.search(name)

    def matches(self, name: str, shards: list[str] | None = None) -> bool:
        return self.every or self._one(name) or (bool(shards) and all(self._one(s) for s in shards))


NVFP4_ALGOS = ("NVFP4", "W4A16_NVFP4")


class QuantizedLayers:
    """vLLM 0.33.0 modelopt.py ``ModelOptMixedPrecisionConfig`` (``quant_algo: MIXED_PRECISION``): a layer that
    the exclusion list does not exclude takes the algorithm ``_resolve_quant_algo`` finds for it in
    ``quantized_layers``, and stays unquantized where it finds none (``get_quant_method``):

    1. the layer's name itself (or its candidates: ``lm_head`` for ``*.lm_head``, ``language_model.model.X`` <->
       ``model.language_model.X``);
    2. a fused layer: its shards' entries (all one algorithm);
    3. an entry below the layer (``key`` starting with ``name + "."``): the first such entry's algorithm;
    4. a routed-experts layer ``P.experts``: the first entry below ``P``.

    Indexed once: every dotted ancestor of every key maps to the first key's algorithm under it."""

    def __init__(self, layers: dict, packed: dict[str, tuple[str, ...]]):
        self.algos = {str(k): str(v.get("quant_algo", "")).upper() for k, v in layers.items() if isinstance(v, dict)}
        self.packed = packed
        self.below: dict[str, str] = {}
        for key, algo in self.algos.items():
            parts = key.split(".")
            for depth in range(1, len(parts)):
                self.below.setdefault(".".join(parts[:depth]), algo)

    @staticmethod
    def _candidates(name: str) -> list[str]:
        out = [name]
        if name.endswith(".lm_head"):
            out.append("lm_head")
        for a, b in (("language_model.model.", "model.language_model."), ("model.language_model.", "language_model.model.")):
            if name.startswith(a):
                out.append(b + name[len(a):])
                break
        return out

    def algo(self, name: str) -> str | None:
        """The algorithm vLLM gives the layer ``name`` (upper case), None when it stays unquantized."""
        for c in self._candidates(name):
            if c in self.algos:
                return self.algos[c]
        base, _, last = name.rpartition(".")
        if last in self.packed:
            found = {self.algos[f"{b}.{s}"] for b in self._candidates(base) for s in self.packed[last]
                     if f"{b}.{s}" in self.algos}
            if len(found) > 1:
                raise MixedShards(f"{name}: its shards take {', '.join(sorted(found))} in quantized_layers "
                                  "(vLLM: mixed quant_algo within a fused layer)")
            if found:
                return found.pop()
        for c in self._candidates(name):
            if c in self.below:
                return self.below[c]
        if name.endswith(".experts"):
            return self.below.get(name.rsplit(".experts", 1)[0])
        return None


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
        if engine not in ENGINES:
            raise ValueError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINES)}")
        exclude = entries(exclude, where)
        if engine == "trtllm":
            self._rule = _Trtllm(exclude, where)
        elif form == "compressed-tensors":
            self._rule = (_VllmCompressedTensors(exclude, where, architecture) if engine == "vllm" else
                          _SglangCompressedTensors(exclude, where))
        else:
            self._rule = _VllmModelopt(exclude, where) if engine == "vllm" else _SglangModelopt(exclude, where)
        # SGLang looks modules up by its model's run-time names (Kimi-K3: ``model.layers.3.mlp.gate`` for the
        # checkpoint's ``language_model.model.layers.3.block_sparse_moe.gate``); vLLM's renames are its rule's own
        self._rename = family_of(architecture).sglang_name if engine == "sglang" else None
        # MIXED_PRECISION (vLLM): a layer not excluded is NVFP4 only where quantized_layers says so
        self._mixed = (QuantizedLayers(quantized_layers, family_of(architecture).vllm_fused)
                       if quantized_layers is not None and engine == "vllm" else None)
        # compressed-tensors: a Linear that no config group targets stays unquantized (vLLM and SGLang)
        self._targets = (SchemeTargets(targets, f"{where} (config_groups targets)")
                         if targets is not None and form == "compressed-tensors" and engine != "trtllm" else None)
        self._vllm_name = (lambda n: vllm_module_name(architecture, n)) if engine == "vllm" else (lambda n: n)

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


_RECENT: list[tuple[tuple, list, dict | None, Exclusions]] = []  # the last lists indexed: validate and its verdicts share them
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
    :class:`MixedShards` where the engine raises because only some shards are excluded, and
    :class:`~fp4pass.safetensors.patterns.BadPattern` for an entry the engine cannot use.
    """
    rules = exclude if isinstance(exclude, Exclusions) else Exclusions(engine, exclude, form, architecture)
    return rules.excluded(module, shards)


# ---------------------------------------------------------------------------------------------------------
# the checkpoint's modules, as each engine groups them

_NORM = re.compile(r"(^|\.)[^.]*norm[^.]*$")
_EXPERT = re.compile(r"^(?P<moe>.*\.experts)\.\d+\.[^.]+$")


def _is_linear(module: str) -> bool:
    """A module whose ``.weight`` an engine loads into a Linear (or lm_head): not a norm, not an embedding."""
    last = module.rsplit(".", 1)[-1]
    return not _NORM.search(module) and last not in {"embed", "embed_tokens", "wte", "embedding"}


def _classify(tensor_names: list[str]) -> dict[str, str]:
    """module -> "nvfp4" | "fp8" | "plain" from the tensor names alone (NVFP4: a ``weight_scale_2``,
    ``weight_global_scale`` or gpt-oss ``*_weight_scale_2``; FP8: a ``.scale`` or ``.weight_scale_inv``)."""
    names = set(tensor_names)
    kinds: dict[str, str] = {}
    for name in tensor_names:
        for suffix, kind in ((".weight_scale_2", "nvfp4"), (".weight_global_scale", "nvfp4"),
                             (".weight_scale_inv", "fp8")):
            if name.endswith(suffix):
                kinds[name[: -len(suffix)]] = kind
        if name.endswith(".scale") and name[: -len(".scale")] + ".weight" in names:
            kinds.setdefault(name[: -len(".scale")], "fp8")
    for name in tensor_names:
        if name.endswith(".weight"):
            kinds.setdefault(name[: -len(".weight")], "plain")
    return kinds


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


# ---------------------------------------------------------------------------------------------------------
# verdicts

def _verdict(loads: bool, mode: str | None, why: str) -> dict:
    return {"loads": loads, "mode": mode if loads else None, "why": why}


def _gpt_oss_fused(tensor_names: list[str]) -> bool:
    return any(n.endswith(("experts.gate_up_proj_weight_scale", "experts.down_proj_weight_scale"))
               for n in tensor_names)


def _gpt_oss_verdicts() -> dict[str, dict]:
    """gpt-oss expert stacks in ModelOpt's fused layout (``experts.gate_up_proj`` + ``_weight_scale``,
    ``_weight_scale_2``, ``_input_scale``, ``_bias``): no engine loads them today."""
    return {
        "vllm": _verdict(False, None, (
            "vLLM 0.33 gpt_oss.py hf_to_vllm_mapper has no entry for the *_weight_scale, *_weight_scale_2 and "
            "*_input_scale keys, so _load_weights_other skips them and the scales stay uninitialised, and the "
            "NVFP4 MoE method registers no w13_bias (KeyError on the biases): vLLM #46641, fix PR #46645 open")),
        "sglang": _verdict(False, None, (
            "SGLang 0.5.23 models/gpt_oss.py drops the same *_weight_scale_2 / *_input_scale keys and has no "
            "NVFP4 fused-expert mapping (the vLLM #46641 gap)")),
        "trtllm": _verdict(False, None, (
            "TensorRT-LLM _torch/models/modeling_gpt_oss.py load_hf_weights reads a uint8 experts.gate_up_proj "
            "as bf16 weights and passes no *_weight_scale / *_weight_scale_2 / *_input_scale to the MoE")),
    }


def _quant_config_for(engine: str, config: dict, hf_quant: dict | None) -> tuple[dict | None, str]:
    """The quantization description ``engine`` reads, and where from.

    vLLM 0.33.0 transformers_utils/config.py: config.json ``quantization_config``, else hf_quant_config.json;
    model_arch_config_convertor.py ``_normalize_quantization_config`` then recognises the latter as ModelOpt
    only by ``producer.name == "modelopt"`` or a top-level ``quant_method``. SGLang 0.5.23
    configs/model_config.py: the same order. TensorRT-LLM _torch/model_config.py: hf_quant_config.json when
    present (authoritative), else config.json's ``quantization_config``.
    """
    qc = quantization_config(config)  # a nested text_config's where the top has none (vLLM's KimiK3Config)
    if engine == "trtllm" and hf_quant is not None:
        return hf_quant, "hf_quant_config.json"
    if qc is not None:
        return qc, "config.json"
    if hf_quant is None:
        return None, "none"
    if engine == "vllm" and not ((hf_quant.get("producer") or {}).get("name") == "modelopt"
                                 or hf_quant.get("quant_method")):
        return None, "hf_quant_config.json (not recognised)"
    return hf_quant, "hf_quant_config.json"


def _modelopt_fields(qc: dict, source: str) -> tuple[str, list[str], bool, str]:
    """(quant_algo, exclusion list, all config_groups' input_activations null, the list's field) of a ModelOpt
    description in either layout (nested ``quantization`` of hf_quant_config.json, or flat config.json).
    :class:`BadPattern` when the list is not a list of strings."""
    if isinstance(qc.get("quantization"), dict):
        q = qc["quantization"]
        where = f"{source} quantization.exclude_modules"
        return str(q.get("quant_algo", "")).upper(), entries(q.get("exclude_modules"), where), False, where
    groups = qc.get("config_groups")
    weight_only = (isinstance(groups, dict) and bool(groups)
                   and all(isinstance(g, dict) and g.get("input_activations") is None for g in groups.values()))
    key = "ignore" if "ignore" in qc else "exclude_modules"
    where = f"{source} quantization_config.{key}"
    return str(qc.get("quant_algo", "")).upper(), entries(qc.get(key), where), weight_only, where


def _quantized_layers(qc: dict) -> dict | None:
    """A ModelOpt MIXED_PRECISION description's ``quantized_layers`` (either layout), None when absent."""
    q = qc["quantization"] if isinstance(qc.get("quantization"), dict) else qc
    layers = q.get("quantized_layers")
    return layers if isinstance(layers, dict) else None


def _exclusion_problems(engine: str, architecture, kinds: dict[str, str], exclude: list[str], form: str,
                        expert_quantized: bool = True, where: str = "the exclusion list",
                        quantized_layers: dict | None = None, targets: list[str] | None = None) -> list[str]:
    """Modules the exclusion list gets wrong for ``engine``: an NVFP4 module it excludes, a bf16 Linear it
    leaves to NVFP4, a fused module whose shards disagree."""
    rules = exclusions(engine, exclude, form, architecture, where, quantized_layers, targets)
    linear = [m for m, k in kinds.items() if not _EXPERT.match(m) and _is_linear(m)]
    if engine == "sglang":
        fused = _SGLANG_FALLBACK_FUSED
    elif engine == "trtllm":
        fused = FUSED_SHARDS.get(architecture or "", {})
    else:
        fused = None
    problems = []
    for name, shards in engine_modules(architecture, linear, fused):
        members = shards or [name]
        member_kinds = {kinds[m] for m in members}
        try:
            excluded = rules.excluded(name, shards)
        except MixedShards as exc:
            problems.append(f"{exc} (the engine refuses the model)")
            continue
        if len(member_kinds) > 1:
            problems.append(f"{name}: its shards mix {', '.join(sorted(member_kinds))} weights")
        elif member_kinds == {"nvfp4"} and excluded:
            problems.append(f"{name}: NVFP4 weights but excluded (loaded as bf16: shape mismatch)")
        elif member_kinds == {"plain"} and not excluded:
            problems.append(f"{name}: bf16 weights but not excluded (gets an NVFP4 layer: weight_scale never "
                            "loaded)")
    if expert_quantized:
        for moe in sorted({_EXPERT.match(m)["moe"] for m, k in kinds.items() if _EXPERT.match(m) and k == "nvfp4"}):
            if engine != "trtllm" and rules.excluded(moe):
                problems.append(f"{moe}: NVFP4 experts but the MoE layer is excluded")
    return problems


def _input_scales(kinds: dict[str, str], names: set[str]) -> tuple[list[str], list[str]]:
    nvfp4 = [m for m, k in kinds.items() if k == "nvfp4"]
    have = [m for m in nvfp4 if f"{m}.input_scale" in names or f"{m}.input_global_scale" in names]
    return nvfp4, have


def _first(problems: list[str]) -> str:
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    return problems[0] + more


def _modelopt_verdict(engine: str, qc: dict, source: str, architecture, kinds, names) -> dict:
    algo, exclude, weight_only_groups, where = _modelopt_fields(qc, source)
    mixed = _quantized_layers(qc) if algo == "MIXED_PRECISION" else None
    if algo == "MIXED_PRECISION":
        if engine != "vllm":
            return _verdict(False, None, f"{source}: ModelOpt MIXED_PRECISION; {engine}'s mixed-precision path was "
                                         "not read: not claimed")
        algos = {str(v.get("quant_algo", "")).upper() for v in (mixed or {}).values() if isinstance(v, dict)}
        if not algos & set(NVFP4_ALGOS):  # ModelOptMixedPrecisionConfig._from_config raises on an empty map
            return _verdict(False, None, f"{source}: MIXED_PRECISION whose quantized_layers name no NVFP4 layer")
    elif algo not in NVFP4_ALGOS:
        return _verdict(False, None, f"{source}: quant_algo {algo!r} is not NVFP4 or W4A16_NVFP4")
    if isinstance(qc.get("quantization"), dict):
        missing = [k for k in ("group_size", "kv_cache_quant_algo", "exclude_modules") if k not in qc["quantization"]]
        if engine == "vllm" and missing:  # modelopt.py ModelOptNvFp4Config._from_config
            return _verdict(False, None, f"{source}: vLLM requires {', '.join(missing)} (ModelOptNvFp4Config)")
    nvfp4, have = _input_scales(kinds, names)
    if mixed is not None:  # each layer's own algorithm: W4A4 where any NVFP4 layer is W4A4
        mode = "W4A4" if "NVFP4" in algos else "W4A16"
    elif engine == "vllm":
        # modelopt.py ModelOptNvFp4Config._from_config: NVFP4 with every config group's input_activations null
        # runs as W4A16_NVFP4
        mode = "W4A16" if algo == "W4A16_NVFP4" or weight_only_groups else "W4A4"
    else:
        # SGLang modelopt_quant.py ModelOptFp4Config.from_config: W4A16 only for quant_algo W4A16_NVFP4;
        # TensorRT-LLM QuantAlgo.W4A16_NVFP4 likewise
        mode = "W4A16" if algo == "W4A16_NVFP4" else "W4A4"
    if mode == "W4A4" and len(have) < len(nvfp4):
        lacking = [m for m in nvfp4 if m not in have]
        why = {"vllm": "W4A4 needs an input_scale per NVFP4 module; the uninitialised ones give NaN (vLLM #45212)",
               "sglang": "SGLang runs W4A4 and defaults a missing input_scale to 1.0, which silently clips "
                         "activations; write quant_algo W4A16_NVFP4 for weight-only",
               "trtllm": "TensorRT-LLM's NVFP4 linear and MoE load an input_scale per module"}[engine]
        return _verdict(False, None, f"{lacking[0]}: no input_scale ({len(lacking)} module(s)): {why}")
    problems = _exclusion_problems(engine, architecture, kinds, exclude, "modelopt", where=where,
                                   quantized_layers=mixed)
    if problems:
        return _verdict(False, None, f"{source} exclusions: {_first(problems)}")
    covered = "quantized_layers and exclusions leave" if mixed is not None else "exclusions cover"
    return _verdict(True, mode, f"{source}: ModelOpt {algo}, {covered} every bf16 Linear")


def ct_targets(qc: dict | None) -> list[str] | None:
    """Every compressed-tensors config group's ``targets`` (one list), None when a group has none to read."""
    groups = (qc or {}).get("config_groups")
    if not isinstance(groups, dict) or not groups:
        return None
    out: list[str] = []
    for group in groups.values():
        targets = group.get("targets") if isinstance(group, dict) else None
        if not isinstance(targets, list):
            return None
        out += [t for t in targets if isinstance(t, str)]
    return out


def _ct_verdict(engine: str, qc: dict, architecture, kinds, names) -> dict:
    if engine == "trtllm":
        return _verdict(False, None, "TensorRT-LLM: its compressed-tensors reader (_torch/models/checkpoints/hf/"
                                     "compressed_tensors.py) was not checked for NVFP4, and its exclusions match "
                                     "with fnmatch only, never re: (modeling_utils.py QuantConfig."
                                     "is_module_excluded_from_quantization): not claimed; write --format modelopt")
    groups = qc.get("config_groups") or {}
    if qc.get("format") != "nvfp4-pack-quantized" and not any(
            isinstance(g, dict) and g.get("format") == "nvfp4-pack-quantized" for g in groups.values()):
        return _verdict(False, None, "config.json: compressed-tensors format is not nvfp4-pack-quantized")
    acts = [g.get("input_activations") for g in groups.values() if isinstance(g, dict)]
    mode = "W4A16" if all(a is None for a in acts) else "W4A4"
    nvfp4, have = _input_scales(kinds, names)
    if mode == "W4A4" and len(have) < len(nvfp4):
        lacking = [m for m in nvfp4 if m not in have]
        return _verdict(False, None, f"{lacking[0]}: no input_global_scale ({len(lacking)} module(s)) while "
                                     "input_activations is set: W4A4 divides by an uninitialised scale")
    where = "config.json quantization_config.ignore"
    problems = _exclusion_problems(engine, architecture, kinds, entries(qc.get("ignore"), where),
                                   "compressed-tensors", where=where, targets=ct_targets(qc))
    if problems:
        return _verdict(False, None, f"config.json ignore: {_first(problems)}")
    return _verdict(True, mode, "compressed-tensors nvfp4-pack-quantized, ignore covers every bf16 Linear")


def _deepseek_v4_fp8_verdict(engine: str, qc: dict, architecture, kinds, names) -> dict:
    """DeepSeek-V4 with config.json ``quant_method: fp8``, in vLLM.

    vLLM 0.33.0 models/deepseek_v4/quant_config.py ``DeepseekV4FP8Config.get_quant_method``: routed experts get
    ``ModelOptNvFp4FusedMoE`` (W4A4: ``_get_nvfp4_config`` is quant_algo NVFP4, so every expert needs its
    input_scale) when config.json ``quantization_config.moe_quant_algo`` is "NVFP4", else the MXFP4 method;
    every other Linear gets Fp8Config's method (FP8 block weights, or unquantized when in ``ignored_layers``,
    exact names per quant_utils.py ``is_layer_skipped``).
    """
    if "activation_scheme" not in qc:  # fp8.py Fp8Config.from_config: get_from_keys raises
        return _verdict(False, None, "config.json quant_method fp8 without activation_scheme: vLLM's "
                                     "Fp8Config.from_config raises")
    if str(qc.get("moe_quant_algo") or "").upper() != "NVFP4":
        return _verdict(False, None, "config.json quant_method fp8 without moe_quant_algo NVFP4: vLLM builds the "
                                     "MXFP4 expert method (deepseek_v4/quant_config.py)")
    experts = [m for m, k in kinds.items() if k == "nvfp4" and _EXPERT.match(m)]
    dense = [m for m, k in kinds.items() if k == "nvfp4" and not _EXPERT.match(m)]
    if dense:
        return _verdict(False, None, f"{dense[0]}: an NVFP4 Linear outside the routed experts; vLLM's DeepSeek-V4 "
                                     "FP8 config gives it an FP8 block layer (deepseek_v4/quant_config.py)")
    lacking = [m for m in experts if f"{m}.input_scale" not in names]
    if lacking:
        return _verdict(False, None, f"{lacking[0]}: no input_scale ({len(lacking)} expert module(s)); the "
                                     "moe_quant_algo NVFP4 path is W4A4 only (ModelOptNvFp4FusedMoE with quant_algo "
                                     "NVFP4), so give input scales (--input-scale or --scales)")
    ignored = set(entries(qc.get("ignored_layers"), "config.json quantization_config.ignored_layers"))
    problems = []
    linear = [m for m, k in kinds.items() if k == "plain" and not _EXPERT.match(m) and _is_linear(m)]
    for name, shards in engine_modules(architecture, linear):
        try:
            if not _shards_rule(name, shards, lambda s: s in ignored):
                problems.append(f"{name}: bf16 weights not in ignored_layers (gets an FP8 layer)")
        except MixedShards as exc:
            problems.append(str(exc))
    if problems:
        return _verdict(False, None, f"config.json ignored_layers: {_first(problems)}")
    return _verdict(True, "W4A4", "DeepSeek-V4 fp8 config with moe_quant_algo NVFP4: routed experts NVFP4 W4A4")


def _deepseek_v4_other(engine: str, method: str) -> dict:
    """DeepSeek-V4 NVFP4 outside vLLM: SGLang 0.5.23 models/deepseek_v4.py reads no ``moe_quant_algo`` (with
    ``quant_method: fp8`` its ModelOptFp4Config.from_config builds the online FP8 -> NVFP4 config of
    nvfp4_online.py, which quantizes at load rather than reading NVFP4 tensors), and no NVFP4 DeepSeek-V4 path
    of SGLang or TensorRT-LLM was checked for the ModelOpt or compressed-tensors forms: not claimed."""
    if engine == "sglang":
        return _verdict(False, None, "SGLang 0.5.23 models/deepseek_v4.py has no NVFP4 expert path (no "
                                     f"moe_quant_algo; quant_method {method or 'none'} not checked there): not "
                                     "claimed")
    return _verdict(False, None, "TensorRT-LLM's DeepSeek-V4 loader (_torch/models/modeling_deepseekv4.py) was not "
                                 "checked for NVFP4 experts: not claimed")


def engine_verdicts(config: dict, hf_quant_config: dict | None, tensor_names: list[str]) -> dict[str, dict]:
    """``{"vllm": {"loads", "mode", "why"}, "sglang": ..., "trtllm": ...}`` for a checkpoint folder.

    ``config``: config.json; ``hf_quant_config``: hf_quant_config.json or None; ``tensor_names``: every tensor
    of every shard. ``mode`` is "W4A4" or "W4A16" where it loads, else None; ``why`` says which rule decided.
    """
    architecture = (config.get("architectures") or [None])[0]
    names = set(tensor_names)
    if _gpt_oss_fused(tensor_names):
        return _gpt_oss_verdicts()
    kinds = _classify(tensor_names)
    out = {}
    for engine in ENGINES:
        qc, source = _quant_config_for(engine, config, hf_quant_config)
        if qc is None:
            out[engine] = _verdict(False, None, f"no quantization config the engine reads ({source})")
            continue
        try:
            out[engine] = _engine_verdict(engine, qc, source, architecture, kinds, names)
        except BadPattern as exc:  # the engine raises on the entry, or hangs on the regex
            out[engine] = _verdict(False, None, f"bad_config_value: {exc}")
    return out


def _engine_verdict(engine: str, qc: dict, source: str, architecture, kinds, names) -> dict:
    """One engine's verdict on the quantization description ``qc`` it reads from ``source``."""
    method = str(qc.get("quant_method", "")).lower()
    if architecture == ARCH_DEEPSEEK_V4 and engine != "vllm":
        return _deepseek_v4_other(engine, method)
    family = family_of(architecture)
    if engine not in family.engines:
        return _verdict(False, None, f"{engine}: its loader for {architecture} ({family.name}) was not read; "
                        "not claimed")
    if architecture == ARCH_DEEPSEEK_V4 and method == "fp8":
        return _deepseek_v4_fp8_verdict(engine, qc, architecture, kinds, names)
    if method.startswith("modelopt") or isinstance(qc.get("quantization"), dict):
        return _modelopt_verdict(engine, qc, source, architecture, kinds, names)
    if method in {"compressed-tensors", "compressed_tensors"}:
        return _ct_verdict(engine, qc, architecture, kinds, names)
    return _verdict(False, None, f"{source}: quant_method {method!r} is not an NVFP4 description")


def verdict_line(verdicts: dict[str, dict]) -> str:
    """One line: ``vllm loads W4A16; sglang loads W4A16; trtllm does not load (why)``."""
    parts = []
    for engine in ENGINES:
        v = verdicts[engine]
        parts.append(f"{engine} loads {v['mode']}" if v["loads"] else f"{engine} does not load ({v['why']})")
    return "; ".join(parts)
