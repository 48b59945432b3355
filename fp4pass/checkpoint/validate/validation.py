"""Check any NVFP4 checkpoint folder (fp4pass's, ModelOpt's, llm-compressor's) against what the engines load.

The steps, each in its module: read the folder leniently (:mod:`.reading`), the configs as each engine reads
them (:mod:`.configs`), the quantized modules and their scales (:mod:`.tensors`), their shapes, values and
magnitudes (:mod:`.scales`), the modules that must stay out of NVFP4 (:mod:`.exclusions`), then each engine's
verdict (:mod:`.verdicts`). The result is a :class:`Validation`; :func:`validate` gives its JSON, which
``fp4pass inspect --json`` prints.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from fp4pass.checkpoint import engines as eng
from fp4pass.safetensors.catalog import CONFIG_NAME, QUANT_CONFIG_NAME, read_json_file
from fp4pass.checkpoint.configs import quantization_config
from fp4pass.checkpoint.forms import CT_NVFP4, MODELOPT_LINEAR
from fp4pass.safetensors.files import CheckpointError
from fp4pass.checkpoint.validate.configs import check_configs, config_groups, read_configs
from fp4pass.checkpoint.validate.exclusions import check_exclusions, check_roles
from fp4pass.checkpoint.validate.kinds import FAILS_LOAD, WRITER_BUGS, Problem
from fp4pass.checkpoint.validate.reading import member, read_folder
from fp4pass.checkpoint.validate.scales import (check_pairs, check_presence, check_scalars_only, check_shapes,
                                                check_values)
from fp4pass.checkpoint.validate.tensors import Module, find_modules, partner_name, read_exact_blocks, read_scales
from fp4pass.checkpoint.validate.verdicts import cannot_load_fix, engines_held_to, settle_verdicts, verdicts_for
from fp4pass.safetensors.hub import resolve_checkpoint

__all__ = ["Validation", "validation", "validate", "validate_own_output", "is_nvfp4_folder"]

#: the global scales' names after a module's, as a message names them: "weight_scale_2, weight_global_scale"
_GLOBAL_SCALES = ", ".join(form.role("global_scale").suffix[1:] for form in (MODELOPT_LINEAR, CT_NVFP4))


@dataclass
class Validation:
    """What :func:`validation` found in one folder: its form, modules, problems and each engine's verdict
    (``{"loads", "mode", "why", "problems", "outcome", ...}``, as :func:`fp4pass.checkpoint.engines.engine_verdicts`
    gives it and the problems settle it)."""

    source: str
    form: str
    quant_algo: str | None
    input_scales_needed: bool
    modules: list[Module]
    problems: list[Problem]
    engines: dict[str, dict]
    shards: list[str]
    tensors: int

    @property
    def layouts(self) -> list[str]:
        return sorted({m.layout for m in self.modules})

    def to_json(self) -> dict:
        return {"source": self.source, "form": self.form, "quant_algo": self.quant_algo, "layouts": self.layouts,
                "input_scales": "needed" if self.input_scales_needed else "not needed",
                "modules": [m.to_json() for m in self.modules],
                "problems": [p.to_json() for p in self.problems], "engines": self.engines,
                "shards": self.shards, "tensors": self.tensors}


def validation(folder, engine: str | None = None, follow_symlinks: bool = False) -> Validation:
    """Check the NVFP4 checkpoint folder ``folder`` (or a Hub model ID). ``engine``: one of vllm, sglang, trtllm:
    only its verdict and the problems that concern it. Raises :class:`CheckpointError` when nothing can be read
    (no config.json, no shard, no index)."""
    folder = resolve_checkpoint(folder)  # a folder, or a Hugging Face Hub model ID (org/name[@revision])
    names = list(eng.ENGINES)
    if engine is not None and engine not in names:
        raise CheckpointError(f"unknown engine {engine!r}; choose one of {', '.join(names)}")
    data = read_folder(folder, follow_symlinks)
    try:
        problems = data.problems
        cfg = read_configs(data.config, data.quant_config, problems)
        check_configs(cfg, problems)
        modules = find_modules(data.tensors)
        targets = engines_held_to(cfg, data.config, engine)
        read_scales(data, modules)
        read_exact_blocks(data, modules)
        for mod in modules.values():
            if check_shapes(mod, problems):
                check_values(mod, problems, modules.get(partner_name(mod.name) or ""))
            else:
                check_scalars_only(mod, problems)
        check_presence(modules, cfg, problems)
        check_pairs(modules, problems)
        check_roles(modules, problems)
        if not modules:
            problems.append(Problem("no_quantized_modules", f"{data.path}: no NVFP4 module (no {_GLOBAL_SCALES} "
                                    "or E4M3 block scale beside packed weights); this is not an NVFP4 checkpoint; "
                                    "fix: point at the quantized folder"))
        else:
            check_exclusions(data, modules, cfg, targets, problems)
        verdicts = verdicts_for(data, problems)
        for name, verdict in verdicts.items():
            if name in targets and not verdict.get("loads") and not any(
                    p.kind in FAILS_LOAD and (p.engines is None or name in p.engines) for p in problems):
                problems.append(Problem("engine_cannot_load", f"{name}: "
                                        f"{verdict.get('why') or 'cannot load this form'}; fix: "
                                        f"{cannot_load_fix(name, cfg, data.config, modules)}", engines=[name],
                                        warning=engine is None))
                verdict["problems"] = sorted(set(verdict["problems"]) | {"engine_cannot_load"})
        for p in problems:  # an engine outside the form's targets: its verdict says it, not a problem
            if p.engines is not None:
                p.engines = [e for e in p.engines if e in targets]
        problems = [p for p in problems if p.engines is None or p.engines]
        settle_verdicts(verdicts, problems)
        if engine is not None:  # its problems are the targets' above
            verdicts = {engine: verdicts[engine]} if engine in verdicts else {}
        return Validation(str(data.path), cfg.form, cfg.quant_algo, any(cfg.input_needed.values()),
                          list(modules.values()), problems, verdicts, sorted(data.shards), len(data.tensors))
    finally:
        data.close()


def validate(folder, engine: str | None = None, follow_symlinks: bool = False) -> dict:
    """:func:`validation`'s result as JSON: ``{"source", "form", "quant_algo", "layouts", "input_scales",
    "modules", "problems", "engines", "shards", "tensors"}`` (docs/checkpoint.md)."""
    return validation(folder, engine, follow_symlinks).to_json()


def _config_if_present(folder: Path, name: str, follow_symlinks: bool) -> dict:
    """The JSON object ``folder / name`` under the folder's rule on symlinks, {} when there is no such entry;
    :class:`CheckpointError` (exit 2) when it is there but cannot be read: a link out of the folder, not a
    regular file, too large, not JSON, nested too deep. Never taken for an absent file: a folder whose
    quantization config cannot be read is not judged as an unquantized one."""
    path = member(folder, name, follow_symlinks)
    if not os.path.lexists(path):
        return {}
    return read_json_file(path, name)


def is_nvfp4_folder(folder, follow_symlinks: bool = False) -> bool:
    """Whether ``folder`` holds an NVFP4 checkpoint (a config that says so, or NVFP4 scale tensor names), from
    config.json, hf_quant_config.json and the shards' headers only; False for MXFP4 and unquantized folders.
    Raises :class:`CheckpointError` when config.json or hf_quant_config.json is there but unreadable."""
    folder = Path(folder)
    if not folder.is_dir():
        return False
    config = _config_if_present(folder, CONFIG_NAME, follow_symlinks)
    quant = _config_if_present(folder, QUANT_CONFIG_NAME, follow_symlinks)
    algo = quant.get("quantization", {}).get("quant_algo") if isinstance(quant.get("quantization"), dict) else None
    if "NVFP4" in str(algo or "").upper():  # NVFP4, W4A16_NVFP4, W4A8_NVFP4_FP8
        return True
    qc = quantization_config(config)  # the top level's, else a nested text_config's
    if isinstance(qc, dict):
        method = str(qc.get("quant_method", "")).lower()
        if method.startswith("modelopt") or qc.get("moe_quant_algo"):
            return True
        formats = [qc.get("format")] + [g.get("format") for g in config_groups(qc).values() if isinstance(g, dict)]
        if "nvfp4-pack-quantized" in formats:
            return True
        if method == "compressed-tensors" or qc.get("quant_method"):
            return False
    try:
        data = read_folder(folder, follow_symlinks)
    except CheckpointError:
        return False
    try:
        return bool(find_modules(data.tensors))
    finally:
        data.close()


def validate_own_output(folder) -> dict:
    """:func:`validation` of a folder fp4pass has just written (before it is renamed into place): ``{"problems",
    "engines"}`` for the report; raises :class:`~fp4pass.errors.InvalidOutputError` (exit 3: a bug in fp4pass)
    when a problem of :data:`~fp4pass.checkpoint.validate.kinds.WRITER_BUGS` is found (a per-module missing
    global scale too).

    The weights' magnitude guesses (``guess``) are left out: each global scale fp4pass writes comes from the
    weight's own amax, so a weight amax above 2^10 (E8M0 codes up to 137 reach 6144) is the weight's, not a
    swapped scale. A scale_convention finding outside
    :data:`~fp4pass.checkpoint.validate.scales.OWN_WEIGHT_AMAX_RANGE` is no guess (what a swapped scale gives for
    ordinary weights) and stays a writer bug."""
    from fp4pass.errors import InvalidOutputError

    result = validation(folder)
    problems = [p for p in result.problems if not p.guess]
    bugs = [p for p in problems if p.kind in WRITER_BUGS or (p.kind == "missing_scale" and p.engines is None)]
    if bugs:
        raise InvalidOutputError(f"the NVFP4 checkpoint just written breaks its own form ({bugs[0].kind}: "
                                 f"{bugs[0].message}; {len(bugs)} problem(s)); nothing was written; please report")
    return {"problems": [p.to_json() for p in problems], "engines": result.engines}
