"""Which modules must stay out of NVFP4, and whether each engine's exclusion list keeps them out.

lm_head and a MoE router that are NVFP4 break every engine (they are built unquantized). A bf16/f16/f32 Linear
that an engine's exclusion list misses gets an NVFP4 layer and fails to load; the list is judged as the engine
reads it, over the engine's fused modules (:mod:`fp4pass.checkpoint.engines`).
"""

from __future__ import annotations

from fp4pass.checkpoint import engines as eng
from fp4pass.checkpoint.forms import EXPERT
from fp4pass.checkpoint.validate.configs import Configs
from fp4pass.checkpoint.validate.kinds import Problem
from fp4pass.checkpoint.validate.reading import Folder
from fp4pass.checkpoint.validate.tensors import Module

__all__ = ["check_roles", "check_exclusions"]

_FLOAT_WEIGHTS = ("BF16", "F16", "F32")
_EMBEDDING_LEAVES = {"embed_tokens", "embed", "embeddings", "word_embeddings", "wte", "wpe", "tok_embeddings",
                     "embed_positions"}
_ROUTER_LEAVES = {"gate", "router", "shared_expert_gate"}
_MOE_PARENTS = {"mlp", "ffn", "block_sparse_moe", "moe", "feed_forward"}


def _leaf(name: str) -> str:
    return name.rpartition(".")[2]


def _parent_leaf(name: str) -> str:
    return _leaf(name.rpartition(".")[0])


def _is_router(name: str) -> bool:
    return _leaf(name) in _ROUTER_LEAVES and (_parent_leaf(name) in _MOE_PARENTS or _leaf(name) != "gate")


def _is_lm_head(name: str) -> bool:
    return _leaf(name) == "lm_head" or name in ("head", "output")


def check_roles(modules: dict[str, Module], problems: list[Problem]) -> None:
    for mod in modules.values():
        if _is_lm_head(mod.name):
            problems.append(Problem("quantized_lm_head", f"{mod.name}: lm_head is NVFP4; vLLM's ParallelLMHead "
                                    "fails or gives garbage with NVFP4 weights (vLLM #44081), and logits lose "
                                    "accuracy everywhere; fix: keep lm_head in bf16 and list it in the exclusions",
                                    module=mod.name))
        elif _is_router(mod.name):
            problems.append(Problem("quantized_router", f"{mod.name}: the MoE router is NVFP4; engines build the "
                                    "router unquantized (GateLinear / ReplicatedLinear without a quant config) and "
                                    "fail on its packed weight, and routing is too sensitive for 4 bits; fix: keep "
                                    "the router in bf16 and list it in the exclusions", module=mod.name))


def _judged_layers(eng, engine: str, architecture, kept: list[str], cfg: Configs, why: dict[str, str]
                   ) -> list[tuple[str, list[str] | None, bool]]:
    """(engine layer, its shards or None, excluded) for the Linears ``kept``, under the exclusion list
    ``engine`` reads, indexed once (:class:`fp4pass.checkpoint.engines.Exclusions`); a fused module whose
    shards disagree is not excluded, and ``why`` says so. Raises the engines' ``BadPattern``."""
    rules = eng.exclusions(engine, cfg.exclude[engine], cfg.form, architecture, cfg.exclude_field[engine],
                           cfg.quantized_layers, eng.ct_targets(cfg.qc) if cfg.form == "compressed-tensors" else None)
    out = []
    for layer, shards in eng.engine_modules(architecture, kept, eng.engine_record(engine).fused_modules(architecture)):
        try:
            excluded = rules.excluded(layer, shards)
        except eng.MixedShards as exc:
            excluded, why[layer] = False, f"{exc}: the engine refuses the model"
        out.append((layer, shards, excluded))
    return out


def check_exclusions(folder: Folder, modules: dict[str, Module], cfg: Configs, engines: list[str],
                      problems: list[Problem]) -> None:
    """bf16/f16/f32 Linears (2-D ``.weight``) that an engine would quantize because its exclusions miss them,
    the engine's fused modules (``qkv_proj`` over ``q_proj``, ``k_proj``, ``v_proj``) judged as it judges them:
    :func:`fp4pass.checkpoint.engines.is_excluded`."""
    if cfg.form not in ("modelopt", "compressed-tensors"):
        return  # DeepSeek-V4's fp8 config: its ignored_layers are judged by the engine verdicts
    architecture = (folder.config.get("architectures") or [None])[0]
    kept = []
    for name, entry in folder.tensors.items():
        if not name.endswith(".weight") or entry.dtype not in _FLOAT_WEIGHTS or len(entry.shape) != 2:
            continue
        module = name[: -len(".weight")]
        if module in modules or _leaf(module) in _EMBEDDING_LEAVES or "norm" in _leaf(module) or EXPERT.match(module):
            continue
        kept.append(module)
    misses: dict[str, list[str]] = {}
    why: dict[str, str] = {}
    unusable: dict[str, Problem] = {}
    for engine in engines:
        if cfg.exclude.get(engine) is None:
            continue  # not a list of strings: a bad_config_value already
        if cfg.quantized_layers is not None and not eng.engine_record(engine).mixed_precision:
            continue  # MIXED_PRECISION: only vLLM's reading was read; the others' verdicts say "not claimed"
        try:
            layers = _judged_layers(eng, engine, architecture, kept, cfg, why)
        except eng.BadPattern as exc:  # an invalid regex or glob, or one that runs too long: the engine fails
            message = (f"{exc}; the engine fails on it when it builds the model (or hangs matching it); fix: "
                       "exact module names, or simple prefix wildcards")
            if message not in unusable:
                unusable[message] = Problem("bad_config_value", message, tensor=cfg.exclude_field[engine].split()[0],
                                            engines=[])
                problems.append(unusable[message])
            unusable[message].engines.append(engine)
            continue
        for layer, shards, excluded in layers:
            if not excluded:
                for module in shards or [layer]:
                    misses.setdefault(module, []).append(engine)
                    if shards:
                        why.setdefault(module, f"{engine} fuses it into {layer}, which it excludes only when the "
                                               "fused name or every shard's name matches exactly")
    for module, who in misses.items():
        problems.append(Problem(
            "unexcluded_linear", f"{module}.weight: {folder.tensors[module + '.weight'].dtype} Linear not in the "
            f"exclusions ({why.get(module, 'no exclusion entry matches it')}); {', '.join(who)} build an NVFP4 "
            "layer for it and fail (shape mismatch, or \"weight_scale was never loaded\"); fix: add "
            f"\"{module}\" to the exclusions (exact names, or a prefix wildcard such as "
            f"\"{module.rpartition('.')[0] or module}*\")", module=module, tensor=f"{module}.weight", engines=who))
