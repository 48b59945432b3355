"""Each engine's verdict on an NVFP4 checkpoint from its configs and tensor names: loads or not, W4A4 or W4A16,
and the rule that decided.

:func:`engine_verdicts` gives, per engine (:data:`~fp4pass.checkpoint.engines.records.ENGINE_RECORDS`), whether
a checkpoint folder's configs and tensor names load, in which mode (``W4A4``: activations quantized with the
stored input scales; ``W4A16``: bf16 activations), and why not. Each rule restates one engine function, named
where it is applied (vLLM 0.33.0, SGLang 0.5.23, TensorRT-LLM's sources).
"""

from __future__ import annotations

import re

from fp4pass.safetensors.catalog import QUANT_CONFIG_NAME
from fp4pass.checkpoint.configs import quantization_config
from fp4pass.checkpoint.engines.exclusions import engine_modules, exclusions
from fp4pass.checkpoint.engines.records import ENGINE_RECORDS, ENGINES, engine_record
from fp4pass.checkpoint.engines.rules import NVFP4_ALGOS, MixedShards, shards_rule
from fp4pass.checkpoint.families import deepseek_v4, family_of
from fp4pass.checkpoint.forms import CT_NVFP4, EXPERT, MODELOPT_LINEAR, MODELOPT_STACK, STACK_PROJS
from fp4pass.safetensors.patterns import BadPattern, entries

__all__ = ["engine_verdicts", "verdict_line", "ct_targets", "ARCH_DEEPSEEK_V4"]

ARCH_DEEPSEEK_V4 = deepseek_v4.ARCHITECTURE


def _verdict(loads: bool, mode: str | None, why: str) -> dict:
    return {"loads": loads, "mode": mode if loads else None, "why": why}


#: the block scales of ModelOpt's gpt-oss stacks: ``experts.gate_up_proj_weight_scale``, ``.down_proj_...``
_STACK_BLOCK_SCALES = tuple(f"experts.{MODELOPT_STACK.tensor(p, 'block_scales')}" for p in STACK_PROJS)


def _gpt_oss_fused(tensor_names: list[str]) -> bool:
    return any(n.endswith(_STACK_BLOCK_SCALES) for n in tensor_names)


def _gpt_oss_verdicts() -> dict[str, dict]:
    """gpt-oss expert stacks in ModelOpt's fused layout (``experts.gate_up_proj`` + ``_weight_scale``,
    ``_weight_scale_2``, ``_input_scale``, ``_bias``): no engine loads them today."""
    return {e.name: _verdict(False, None, e.why_gpt_oss_stack) for e in ENGINE_RECORDS}


def _quant_config_for(engine: str, config: dict, hf_quant: dict | None) -> tuple[dict | None, str]:
    """The quantization description ``engine`` reads, and where from.

    vLLM 0.33.0 transformers_utils/config.py: config.json ``quantization_config``, else hf_quant_config.json;
    model_arch_config_convertor.py ``_normalize_quantization_config`` then recognises the latter as ModelOpt
    only by ``producer.name == "modelopt"`` or a top-level ``quant_method``. SGLang 0.5.23
    configs/model_config.py: the same order. TensorRT-LLM _torch/model_config.py: hf_quant_config.json when
    present (authoritative), else config.json's ``quantization_config``.
    """
    qc = quantization_config(config)  # a nested text_config's where the top has none (vLLM's KimiK3Config)
    record = engine_record(engine)
    if record.reads_first == QUANT_CONFIG_NAME and hf_quant is not None:
        return hf_quant, "hf_quant_config.json"
    if qc is not None:
        return qc, "config.json"
    if hf_quant is None:
        return None, "none"
    if record.needs_producer and not ((hf_quant.get("producer") or {}).get("name") == "modelopt"
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
    linear = [m for m, k in kinds.items() if not EXPERT.match(m) and _is_linear(m)]
    record = engine_record(engine)
    fused = record.fused_modules(architecture)
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
        for moe in sorted({EXPERT.match(m)["experts"] for m, k in kinds.items() if EXPERT.match(m) and k == "nvfp4"}):
            if record.moe_layer_exclusion and rules.excluded(moe):
                problems.append(f"{moe}: NVFP4 experts but the MoE layer is excluded")
    return problems


_NORM = re.compile(r"(^|\.)[^.]*norm[^.]*$")


def _is_linear(module: str) -> bool:
    """A module whose ``.weight`` an engine loads into a Linear (or lm_head): not a norm, not an embedding."""
    last = module.rsplit(".", 1)[-1]
    return not _NORM.search(module) and last not in {"embed", "embed_tokens", "wte", "embedding"}


#: a tensor suffix that makes its module NVFP4 (a global scale of either per-Linear form) or FP8
_KIND_SUFFIXES = tuple((form.role("global_scale").suffix, "nvfp4") for form in (MODELOPT_LINEAR, CT_NVFP4)) + (
    (".weight_scale_inv", "fp8"),)


def _classify(tensor_names: list[str]) -> dict[str, str]:
    """module -> "nvfp4" | "fp8" | "plain" from the tensor names alone (NVFP4: a ``weight_scale_2``,
    ``weight_global_scale`` or gpt-oss ``*_weight_scale_2``; FP8: a ``.scale`` or ``.weight_scale_inv``)."""
    names = set(tensor_names)
    kinds: dict[str, str] = {}
    for name in tensor_names:
        for suffix, kind in _KIND_SUFFIXES:
            if name.endswith(suffix):
                kinds[name[: -len(suffix)]] = kind
        if name.endswith(".scale") and name[: -len(".scale")] + ".weight" in names:
            kinds.setdefault(name[: -len(".scale")], "fp8")
    for name in tensor_names:
        if name.endswith(".weight"):
            kinds.setdefault(name[: -len(".weight")], "plain")
    return kinds


def _input_scales(kinds: dict[str, str], names: set[str]) -> tuple[list[str], list[str]]:
    nvfp4 = [m for m, k in kinds.items() if k == "nvfp4"]
    have = [m for m in nvfp4 if any(form.tensor(m, "input_scale") in names for form in (MODELOPT_LINEAR, CT_NVFP4))]
    return nvfp4, have


def _first(problems: list[str]) -> str:
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    return problems[0] + more


def _modelopt_verdict(engine: str, qc: dict, source: str, architecture, kinds, names) -> dict:
    algo, exclude, weight_only_groups, where = _modelopt_fields(qc, source)
    mixed = _quantized_layers(qc) if algo == "MIXED_PRECISION" else None
    if algo == "MIXED_PRECISION":
        if not engine_record(engine).mixed_precision:
            return _verdict(False, None, f"{source}: ModelOpt MIXED_PRECISION; {engine}'s mixed-precision path was "
                                         "not read: not claimed")
        algos = {str(v.get("quant_algo", "")).upper() for v in (mixed or {}).values() if isinstance(v, dict)}
        if not algos & set(NVFP4_ALGOS):  # ModelOptMixedPrecisionConfig._from_config raises on an empty map
            return _verdict(False, None, f"{source}: MIXED_PRECISION whose quantized_layers name no NVFP4 layer")
    elif algo not in NVFP4_ALGOS:
        return _verdict(False, None, f"{source}: quant_algo {algo!r} is not NVFP4 or W4A16_NVFP4")
    if isinstance(qc.get("quantization"), dict):
        missing = [k for k in engine_record(engine).required_fields if k not in qc["quantization"]]
        if missing:  # vLLM modelopt.py ModelOptNvFp4Config._from_config
            return _verdict(False, None, f"{source}: vLLM requires {', '.join(missing)} (ModelOptNvFp4Config)")
    nvfp4, have = _input_scales(kinds, names)
    if mixed is not None:  # each layer's own algorithm: W4A4 where any NVFP4 layer is W4A4
        mode = "W4A4" if "NVFP4" in algos else "W4A16"
    elif engine_record(engine).w4a16_from_groups:
        # vLLM modelopt.py ModelOptNvFp4Config._from_config: NVFP4 with every config group's input_activations
        # null runs as W4A16_NVFP4
        mode = "W4A16" if algo == "W4A16_NVFP4" or weight_only_groups else "W4A4"
    else:
        # SGLang modelopt_quant.py ModelOptFp4Config.from_config: W4A16 only for quant_algo W4A16_NVFP4;
        # TensorRT-LLM QuantAlgo.W4A16_NVFP4 likewise
        mode = "W4A16" if algo == "W4A16_NVFP4" else "W4A4"
    if mode == "W4A4" and len(have) < len(nvfp4):
        lacking = [m for m in nvfp4 if m not in have]
        why = engine_record(engine).why_input_scales
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
    not_claimed = engine_record(engine).not_claimed.get("compressed-tensors")
    if not_claimed:
        return _verdict(False, None, not_claimed)
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
    experts = [m for m, k in kinds.items() if k == "nvfp4" and EXPERT.match(m)]
    dense = [m for m, k in kinds.items() if k == "nvfp4" and not EXPERT.match(m)]
    if dense:
        return _verdict(False, None, f"{dense[0]}: an NVFP4 Linear outside the routed experts; vLLM's DeepSeek-V4 "
                                     "FP8 config gives it an FP8 block layer (deepseek_v4/quant_config.py)")
    lacking = [m for m in experts if MODELOPT_LINEAR.tensor(m, "input_scale") not in names]
    if lacking:
        return _verdict(False, None, f"{lacking[0]}: no input_scale ({len(lacking)} expert module(s)); the "
                                     "moe_quant_algo NVFP4 path is W4A4 only (ModelOptNvFp4FusedMoE with quant_algo "
                                     "NVFP4), so give input scales (--input-scale or --scales)")
    ignored = set(entries(qc.get("ignored_layers"), "config.json quantization_config.ignored_layers"))
    problems = []
    linear = [m for m, k in kinds.items() if k == "plain" and not EXPERT.match(m) and _is_linear(m)]
    for name, shards in engine_modules(architecture, linear):
        try:
            if not shards_rule(name, shards, lambda s: s in ignored):
                problems.append(f"{name}: bf16 weights not in ignored_layers (gets an FP8 layer)")
        except MixedShards as exc:
            problems.append(str(exc))
    if problems:
        return _verdict(False, None, f"config.json ignored_layers: {_first(problems)}")
    return _verdict(True, "W4A4", "DeepSeek-V4 fp8 config with moe_quant_algo NVFP4: routed experts NVFP4 W4A4")


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
    family = family_of(architecture)
    not_claimed = engine_record(engine).not_claimed.get(family.name)
    if not_claimed:  # SGLang's and TensorRT-LLM's DeepSeek-V4 loaders (models/deepseek_v4.py, modeling_deepseekv4.py)
        return _verdict(False, None, not_claimed.format(method=method or "none"))
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
