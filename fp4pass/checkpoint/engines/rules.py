"""How each serving engine reads an exclusion list: one rule per engine and form, each restating one engine
function named in its docstring (vLLM 0.33.0 and SGLang 0.5.23 wheels, TensorRT-LLM's ``tensorrt_llm`` sources).

Vocabulary:

- *module*: a checkpoint module name (``model.layers.0.self_attn.q_proj``, DeepSeek-V4 ``layers.0.attn.wq_a``);
- *fused module*: one engine layer built from several checkpoint modules, its *shards*
  (vLLM ``qkv_proj`` <- ``q_proj``, ``k_proj``, ``v_proj``); the engine decides the fused module's precision
  from its own name and its shards' names;
- *exclusion list*: ModelOpt's ``exclude_modules`` / config.json ``ignore`` (globs), or compressed-tensors'
  ``ignore`` (exact names and ``re:`` regexes).

Every rule is built as ``Rule(exclude, where, architecture)`` and called as ``rule(module, shards)``; the engine
records (:mod:`fp4pass.checkpoint.engines.records`) say which rule each engine uses for each form.
"""

from __future__ import annotations

import operator
import re

from fp4pass.checkpoint.families import family_of
from fp4pass.safetensors.patterns import Budget, GlobIndex, RegexList, SubstringIndex, dotted_runs, entries

__all__ = ["MixedShards", "vllm_module_name", "shards_rule", "VllmModelopt", "VllmCompressedTensors",
           "SglangModelopt", "SglangCompressedTensors", "TrtllmGlobs", "SchemeTargets", "QuantizedLayers",
           "NVFP4_ALGOS"]


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


def shards_rule(module: str, shards: list[str] | None, match) -> bool:
    """The fused-module rule shared by vLLM and SGLang ``is_layer_skipped``: the fused name itself (vLLM checks
    it first), else every shard must match, and a mix raises."""
    if not shards:
        return match(module)
    hits = [match(s) for s in shards]
    if any(hits) and not all(hits):
        raise MixedShards(f"{module}: shards {', '.join(s for s, h in zip(shards, hits) if h)} are excluded but "
                          f"{', '.join(s for s, h in zip(shards, hits) if not h)} are not")
    return all(hits)


class VllmModelopt:
    """vLLM 0.33.0 model_executor/layers/quantization/modelopt.py ``ModelOptQuantConfigBase.is_layer_excluded``
    (after ``apply_vllm_mapper`` split the prefix wildcards):

    1. quant_utils.py ``is_layer_skipped`` (exact): the fused name in the list, else every shard's exact name
       in the list (a mix raises);
    2. any entry that is a substring of the (fused) name;
    3. any entry that fnmatches the (fused) name. Globs never see the shard names.
    """

    def __init__(self, exclude: list[str], where: str, architecture: str | None = None):
        patterns = _split_prefix_wildcards(exclude)
        budget = Budget(where)  # one CPU budget for the list's rules (patterns.Budget)
        self.inside = SubstringIndex(patterns, budget)
        self.exact = self.inside.entries
        self.globs = GlobIndex(patterns, exact=False, budget=budget)

    def __call__(self, module: str, shards: list[str] | None) -> bool:
        if module in self.exact:
            return True
        if shards and shards_rule(module, shards, self.exact.__contains__):
            return True
        return self.inside.found_in(module) or self.globs.match(module)


class VllmCompressedTensors:
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
        return bool(shards) and shards_rule(module, shards, self.match)


# SGLang's glob-to-regex translation keeps every regex character but ``.`` and ``*``
_REGEX_SYNTAX = frozenset("\\^$+?{}[]|()")
_REGEX_SYNTAX_RE = re.compile(r"[\\^$+?{}\[\]|()]")
_MLA_TAILS = {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"}


def _sglang_regex(pattern: str) -> str:
    return pattern.replace(".", r"\.").replace("*", ".*")


class SglangModelopt:
    """SGLang 0.5.23 layers/quantization/modelopt_quant.py ``ModelOptQuantConfig._get_quant_method`` for a
    Linear: ``is_layer_skipped`` (utils.py ``_module_path_match``: an entry equal to the name, a dotted
    ancestor of it, or a dotted run of components inside it: ``".E."`` in ``".name."``; for a fused module
    every shard, a mix raises) or ``is_layer_excluded`` (each entry a glob turned regex, ``.`` literal and
    ``*`` -> ``.*``, fullmatched against the whole name or any one component; the fused shard tails
    ``q_a_proj``, ``kv_a_proj_with_mqa``, ... found inside the name's last component).

    An entry without other regex syntax is matched as a ``*``-only glob (:class:`~fp4pass.safetensors.patterns.
    Glob`, no backtracking); the others as SGLang's regex, with a timeout."""

    def __init__(self, exclude: list[str], where: str, architecture: str | None = None):
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
        if shards_rule(module, shards, self.path_match):
            return True
        parts = module.split(".")
        if self.glob_match(module) or any(self.glob_match(part) for part in parts):
            return True
        return any(tail in parts[-1] for tail in self.tails)


class SglangCompressedTensors:
    """SGLang 0.5.23 layers/quantization/compressed_tensors/compressed_tensors.py (adapted from vLLM's
    ``should_ignore_layer``): exact names or ``re:`` regexes (``re.match``), every shard of a fused module."""

    def __init__(self, ignore: list[str], where: str, architecture: str | None = None):
        self.exact = {p for p in ignore if not p.startswith("re:")}
        self.regexes = RegexList([p[3:] for p in ignore if p.startswith("re:")], where,
                                 shown={p[3:]: p for p in ignore if p.startswith("re:")})

    def match(self, name: str) -> bool:
        return name in self.exact or self.regexes.search(name)

    def __call__(self, module: str, shards: list[str] | None) -> bool:
        return self.match(module) or (bool(shards) and shards_rule(module, shards, self.match))


class TrtllmGlobs:
    """TensorRT-LLM tensorrt_llm/models/modeling_utils.py ``QuantConfig.is_module_excluded_from_quantization``:
    ``fnmatchcase`` of the engine's own module name (the fused ``qkv_proj``, never its shards) against each
    entry; ``re:`` entries are not understood (they match nothing)."""

    def __init__(self, exclude: list[str], where: str, architecture: str | None = None):
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
        for a, b in (("language_model.model.", "model.language_model."),
                     ("model.language_model.", "language_model.model.")):
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

