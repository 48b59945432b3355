"""Each engine's verdict on a folder, agreeing with the problems that concern it.

The engine rules (:func:`fp4pass.checkpoint.engines.engine_verdicts`) say whether an engine's loader takes the
configs and the tensor names; the problems found then decide what it would do (the worst of their outcomes,
:data:`~fp4pass.checkpoint.validate.kinds.OUTCOMES`). A checkpoint is held to the engines its form is written for
among those whose loader for its family was read; the others' verdicts say why not, and are problems only when
asked for.
"""

from __future__ import annotations

from fp4pass.checkpoint import engines as eng
from fp4pass.checkpoint.families import family_of
from fp4pass.checkpoint.validate.configs import Configs
from fp4pass.checkpoint.validate.kinds import FAILS_LOAD, OUTCOMES, Problem
from fp4pass.checkpoint.validate.reading import Folder
from fp4pass.checkpoint.validate.tensors import Module

__all__ = ["engines_held_to", "verdicts_for", "settle_verdicts", "cannot_load_fix"]

def engines_held_to(cfg: Configs, config: dict, engine: str | None) -> list[str]:
    """The engines whose rules the checkpoint is held to: ``engine`` when given, else the form's among those
    whose loader for the family was read (DeepSeek-V4: vLLM only; Kimi-K3: vLLM and SGLang). An engine the form
    is not written for (its record's ``not_held_to``: TensorRT-LLM and compressed-tensors) that cannot load it is
    said in its verdict, and is a problem only when asked for with ``engine``."""
    if engine is not None:
        return [engine]
    claimed = family_of(config).engines  # the engines whose loader for this family was read
    return [e.name for e in eng.ENGINE_RECORDS if cfg.form not in e.not_held_to and e.name in claimed]


def verdicts_for(folder: Folder, problems: list[Problem]) -> dict:
    verdicts = eng.engine_verdicts(folder.config, folder.quant_config, list(folder.tensors))
    out = {}
    for name, verdict in verdicts.items():
        verdict = dict(verdict)
        mine = [p for p in problems if p.engines is None or name in p.engines]
        verdict["problems"] = sorted({p.kind for p in mine})
        failing = sorted({p.kind for p in mine if p.kind in FAILS_LOAD})
        if failing and verdict.get("loads"):
            verdict["loads"] = False
            verdict["why"] = f"problems found: {', '.join(failing)}" + (
                f"; {verdict['why']}" if verdict.get("why") else "")
        out[name] = verdict
    return out


def settle_verdicts(verdicts: dict, problems: list[Problem]) -> None:
    """Each engine's verdict agrees with the problems that concern it: ``outcome`` is the worst of what they make
    the engine do (:data:`OUTCOMES`; "does not load this form" where the engine rules say it cannot), ``loads``
    stays true only when that is "loads" (no error concerns it), and ``warnings`` lists the warnings' kinds."""
    order = list(OUTCOMES)
    for name, verdict in verdicts.items():
        mine = [p for p in problems if p.engines is None or name in p.engines]
        verdict["problems"] = sorted({p.kind for p in mine})
        errors = [p for p in mine if not p.warning and p.kind != "engine_cannot_load"]
        seen = [p.outcome_for(name) for p in errors] + ([] if verdict.get("loads") else ["unsupported"])
        worst = min(seen, key=order.index, default="loads")
        verdict["outcome"] = OUTCOMES[worst]
        if worst in ("refuses", "unsupported"):
            verdict["mode"] = None
        if worst != "loads" and verdict.get("loads"):
            verdict["loads"] = False
            verdict["why"] = f"problems found: {', '.join(sorted({p.kind for p in errors}))}" + (
                f"; {verdict['why']}" if verdict.get("why") else "")
        warnings = sorted({p.kind for p in mine if p.warning})
        if warnings:
            verdict["warnings"] = warnings


def cannot_load_fix(engine: str, cfg: Configs, config: dict, modules: dict[str, Module]) -> str:
    """What makes ``engine`` load a checkpoint whose form its loader does not take."""
    architecture = (config.get("architectures") or [None])[0]
    if architecture == eng.ARCH_DEEPSEEK_V4:
        return ("write DeepSeek-V4 in the compressed-tensors form (fp4pass convert SRC -o OUT --format "
                "compressed-tensors), which vLLM loads; its FP8 form takes NVFP4 routed experts only, W4A4")
    if any(m.layout == "fused-experts" for m in modules.values()):
        return ("none in the checkpoint: the engine's gpt-oss loader has to learn the fused NVFP4 expert scale "
                "keys (for vLLM: PR #46645); until then serve the MXFP4 source")
    fix = eng.engine_record(engine).fixes.get(cfg.form)
    if fix:
        return fix
    return ("write the form this engine loads (fp4pass convert --format modelopt or compressed-tensors), or serve "
            "it with an engine the table says loads it")
