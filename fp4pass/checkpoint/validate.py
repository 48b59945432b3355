"""Check any NVFP4 checkpoint folder (fp4pass's, ModelOpt's, llm-compressor's) against what the engines load.

Only the headers and the scales are read, never the weights' codes: the scalar global and input scales in full,
and at most :data:`BLOCK_SAMPLE_BYTES` of each block-scale tensor (evenly spread, from its first byte to its last),
so a 120B checkpoint is checked in seconds. A module whose sample would make a magnitude finding has its whole
block-scale tensor read (and its w1/w3 partner's), so that finding rests on every block scale.

Forms recognised (from the configs and the tensor names):

- ModelOpt unified HF: ``hf_quant_config.json`` and/or config.json ``quantization_config`` with
  ``quant_method: modelopt``; per Linear ``M``: ``M.weight`` U8 [N, K/2], ``M.weight_scale`` F8_E4M3
  [N, K/16], ``M.weight_scale_2`` F32 scalar and ``M.input_scale`` F32 scalar, both MULTIPLIERS
  (W = e2m1 x weight_scale x weight_scale_2; an activation is quantized with 1/input_scale);
- ModelOpt's gpt-oss fused expert stacks (``P`` = ``...mlp.experts.gate_up_proj`` or ``.down_proj``):
  ``P`` U8 [E, K/2, N], ``P_weight_scale`` F8_E4M3 [E, K/16, N], ``P_weight_scale_2``, ``P_input_scale``;
- compressed-tensors ``nvfp4-pack-quantized``: ``M.weight_packed`` U8 [N, K/2], ``M.weight_scale`` F8_E4M3
  [N, K/16], ``M.weight_global_scale`` and ``M.input_global_scale`` F32 [1], both DIVISORS
  (W = e2m1 x weight_scale / weight_global_scale);
- DeepSeek-V4's ``quant_method: fp8`` with ``moe_quant_algo: NVFP4`` (ModelOpt tensor names, W4A4).

Magnitudes. With ``s_max`` the largest block scale and ``g`` the global scale read as a multiplier, the largest
weight the checkpoint decodes to is ``6 x s_max x g``. A real weight's amax lies in [2^-14, 2^10]; a global
scale stored in the other convention gives ``6 x s_max / g`` instead, which for ModelOpt's ``g = amax / 2688``
is ~7e6 / amax (out of that range by orders of magnitude). So a scale whose stored reading is implausible while
its reciprocal reading is plausible is a divisor stored as a multiplier (or the reverse): an error when the
stored reading is outside even [2^-24, 2^20], else a guess. ``s_max`` is the largest over w1 and w3 of a pair
that shares ``g`` (the scale was made from the pair's amax), per expert where each has its own ``g``.
Activations: the amax ``2688 x input_scale`` must lie in [2^-12, 2^16] under the same test. A global scale of
exactly 1 over block scales at most 16 (448 is E4M3's top) some of which sit on E4M3's lossy subnormals (3, 5, 6
or 7 x 2^-9) means the global scale was folded into the E4M3 block scales: those blocks lost up to a quarter of
their value (power-of-two subnormals, which a lossless conversion writes, are exact and legal).

Every problem names the module or tensor, the consequence and the fix; ``engines`` lists the engines it
affects (all when absent); ``severity`` is "error", or "warning" for a guess and for an engine that does not
load a correct form (unless that engine was asked for). Each engine's verdict says what it would do
(:data:`OUTCOMES`). Exit codes of ``fp4pass inspect`` (:func:`exit_status`): 0 no error, 1 errors (with
``--strict``, warnings too), 2 unreadable folder.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from fp4pass.checkpoint.configs import quantization_config
from fp4pass.checkpoint.families import family_of
from fp4pass.checkpoint.forms import block_precision
from fp4pass.safetensors.catalog import (CONFIG_NAME, INDEX_LIMIT, INDEX_NAME, QUANT_CONFIG_NAME, member_path,
                                        read_json_file)
from fp4pass.safetensors.files import CheckpointError, SafetensorsFile, TensorEntry
from fp4pass.safetensors.hub import resolve_checkpoint
from fp4pass.formats.constants import E2M1_MAX, E4M3_MAX_CODE, NVFP4_AMAX_PER_GLOBAL_SCALE

__all__ = ["validate", "format_validation", "exit_status", "is_nvfp4_folder", "Problem", "KINDS", "OUTCOMES",
           "BLOCK_SAMPLE_BYTES"]

#: problem kinds, each with what it does to a deployment
KINDS = {
    "missing_shard": "a shard the index names is not in the folder",
    "unreadable_shard": "a shard's header cannot be read",
    "missing_tensor": "a quantized module lacks its packed weight",
    "missing_scale": "a quantized module lacks a scale the engine loads",
    "scale_missing_some_experts": "some experts of a layer have an input scale, others none",
    "zero_scale": "a scale is zero",
    "negative_scale": "a scale is negative",
    "nonfinite_scale": "a scale is NaN or infinite",
    "w1_w3_mismatch": "gate (w1) and up (w3) of one expert have different scales",
    "scale_convention": "a divisor stored as a multiplier, or the reverse",
    "folded_global_scale": "the global scale folded into the E4M3 block scales",
    "unexcluded_linear": "a bf16/f16/f32 Linear the engine would quantize (not in the exclusions)",
    "quantized_lm_head": "lm_head is quantized",
    "quantized_router": "a MoE router (gate) is quantized",
    "dtype_shape": "dtypes or shapes that do not fit the form",
    "missing_config_field": "a config field the engine needs is missing",
    "bad_config_value": "a config value the engines do not accept",
    "config_disagreement": "config.json and hf_quant_config.json disagree",
    "engine_cannot_load": "the engine's loader cannot load this form",
    "no_quantized_modules": "no NVFP4 module found",
}

#: what an engine does with the checkpoint, worst first: the engine table's words for a problem's outcome
OUTCOMES = {"refuses": "refuses at load", "unsupported": "does not load this form", "nan": "loads, computes NaN",
            "garbage": "loads, computes garbage", "wrong_w3": "loads, w3 dequantized with w1's scale",
            "inconsistent": "loads, not what the others serve", "accuracy": "loads, loses accuracy", "loads": "loads"}
#: the outcome of each kind that does not stop the load (the others: "refuses")
_KIND_OUTCOMES = {"zero_scale": "garbage", "negative_scale": "garbage", "nonfinite_scale": "nan",
                  "scale_convention": "garbage", "missing_scale": "garbage", "scale_missing_some_experts": "nan",
                  "w1_w3_mismatch": {"vllm": "wrong_w3", "sglang": "wrong_w3", "trtllm": "refuses"},
                  "folded_global_scale": "accuracy", "config_disagreement": "inconsistent"}

BLOCK_SAMPLE_BYTES = 16384  # per block-scale tensor: 4 evenly spread pieces of 4 KiB (all of a smaller one)
_PIECES = 4
WEIGHT_AMAX_RANGE = (2.0 ** -14, 2.0 ** 10)
#: the weight amaxes no weight fp4pass converts can have (its own output's scale_convention guess is a writer bug
#: only outside these: a swapped global scale gives 2688^2 / amax, past 2^20 for every amax below 6.9)
OWN_WEIGHT_AMAX_RANGE = (2.0 ** -24, 2.0 ** 20)
ACT_AMAX_RANGE = (2.0 ** -12, 2.0 ** 16)
_E4M3_NAN = E4M3_MAX_CODE + 1  # 0x7F: the magnitude bits of E4M3FN's NaN, and their mask
_E4M3_SIGN = 0x80
FOLDED_BLOCK_MAX = 16.0
ENGINE_NAMES = ("vllm", "sglang", "trtllm")

_FLOAT_WEIGHTS = ("BF16", "F16", "F32")
_EMBEDDING_LEAVES = {"embed_tokens", "embed", "embeddings", "word_embeddings", "wte", "wpe", "tok_embeddings",
                     "embed_positions"}
_ROUTER_LEAVES = {"gate", "router", "shared_expert_gate"}
_MOE_PARENTS = {"mlp", "ffn", "block_sparse_moe", "moe", "feed_forward"}
_GATE, _UP = ("w1", "gate_proj"), ("w3", "up_proj")
_EXPERT = re.compile(r"^(?P<layer>.+\.experts)\.(?P<e>\d+)\.(?P<proj>[^.]+)$")
_FUSED = re.compile(r"^(?P<p>.+\.experts\.(?:gate_up_proj|down_proj))_(?P<what>weight_scale_2|weight_scale|"
                    r"input_scale)$")
# per-module tensor suffix -> (role, convention)
_SUFFIXES = {"weight_scale_2": ("global", "multiplier"), "input_scale": ("input", "multiplier"),
             "weight_global_scale": ("global", "divisor"), "input_global_scale": ("input", "divisor"),
             "weight_scale": ("block", None), "weight_packed": ("codes", "divisor"), "weight": ("codes", None)}


def _engines():
    from fp4pass.checkpoint import engines

    return engines


@dataclass
class Problem:
    """One finding: ``kind`` (a key of :data:`KINDS`), a message with the consequence and the fix."""

    kind: str
    message: str
    module: str | None = None
    tensor: str | None = None
    engines: list[str] | None = None  # None: every engine
    #: a judgement from magnitudes alone (a weight amax outside 2^-14..2^10 but inside 2^-24..2^20), which a
    #: legitimately large or small weight can also give: always a warning
    guess: bool = False
    #: for a weight's scale_convention finding: the weight amax its global scale gives as stored
    amax_as_stored: float | None = None
    #: a finding that does not fail ``inspect`` unless ``--strict``: a guess, or an engine that does not load a
    #: form that is correct (its loader's gap, not the checkpoint's defect)
    warning: bool = False
    #: what an engine does because of it (an :data:`OUTCOMES` key), one for every engine or per engine; by
    #: default its kind's (:data:`_KIND_OUTCOMES`)
    outcome: str | dict[str, str] | None = None

    def __post_init__(self) -> None:
        self.warning = self.warning or self.guess
        if self.outcome is None:
            self.outcome = _KIND_OUTCOMES.get(self.kind, "refuses")

    def outcome_for(self, engine: str) -> str:
        return self.outcome.get(engine, "refuses") if isinstance(self.outcome, dict) else self.outcome

    def to_json(self) -> dict:
        out = {"kind": self.kind, "severity": "warning" if self.warning else "error", "message": self.message}
        for key in ("module", "tensor", "engines", "amax_as_stored"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.guess:
            out["guess"] = True
        return out


@dataclass
class Module:
    """A quantized module: a Linear (per expert or dense) or a gpt-oss fused expert stack."""

    name: str
    layout: str  # "linear" | "fused-experts"
    codes: TensorEntry | None = None
    block: TensorEntry | None = None
    global_: TensorEntry | None = None
    input: TensorEntry | None = None
    convention: str | None = None  # "multiplier" (ModelOpt) | "divisor" (compressed-tensors)
    global_value: np.ndarray | None = None  # as stored
    input_value: np.ndarray | None = None
    block_max: float | None = None  # the sample's largest finite block scale
    extra: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        out = {"module": self.name, "layout": self.layout}
        if self.codes is not None:
            out["weight"] = self.codes.name
            out["weight_shape"] = list(self.codes.shape)
        if self.convention:
            out["convention"] = self.convention
        for key, value in (("global_scale", self.global_value), ("input_scale", self.input_value)):
            if value is not None and value.size:
                out[key] = float(value.reshape(-1)[0]) if value.size == 1 else [float(v) for v in value.reshape(-1)]
        if self.block_max is not None:
            out["block_scale_max"] = self.block_max
        return out


@dataclass
class _Folder:
    """A checkpoint folder read leniently: the shards that could be opened, the problems of the others."""

    path: Path
    config: dict
    quant_config: dict | None  # hf_quant_config.json
    shards: dict[str, SafetensorsFile]
    tensors: dict[str, TensorEntry]
    problems: list[Problem]

    def close(self) -> None:
        for shard in self.shards.values():
            shard.close()


def _member(folder: Path, name: str, follow_symlinks: bool) -> Path:
    """``folder / name`` under the catalog's rule on symlinks (a link out of the folder is refused)."""
    return member_path(folder, name, follow_symlinks)


def _read_folder(folder, follow_symlinks: bool = False) -> _Folder:
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: not a folder")
    config_path = _member(folder, CONFIG_NAME, follow_symlinks)
    if not config_path.exists():
        raise CheckpointError(f"{folder}: no {CONFIG_NAME}: not a Hugging Face checkpoint folder")
    config = read_json_file(config_path, CONFIG_NAME)
    quant_path = _member(folder, QUANT_CONFIG_NAME, follow_symlinks)
    quant_config = read_json_file(quant_path, QUANT_CONFIG_NAME) if quant_path.exists() else None
    problems: list[Problem] = []
    index_path = _member(folder, INDEX_NAME, follow_symlinks)
    weight_map = None
    if index_path.exists():
        index = read_json_file(index_path, "the index", INDEX_LIMIT)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index_path}: weight_map is not an object of tensor name -> shard file")
        names = sorted(set(weight_map.values()))
    else:
        names = sorted(p.name for p in folder.iterdir() if p.name.endswith(".safetensors"))
    if not names:
        raise CheckpointError(f"{folder}: no *.safetensors shards and no index: nothing to read")
    shards: dict[str, SafetensorsFile] = {}
    try:
        for name in names:
            if name in ("", ".", "..") or "/" in name or "\\" in name or "\x00" in name:
                raise CheckpointError(f"{index_path}: shard {name!r} is not a file name in the folder")
            path = _member(folder, name, follow_symlinks)
            if not path.exists():
                count = sum(1 for v in weight_map.values() if v == name) if weight_map else 0
                problems.append(Problem(
                    "missing_shard", f"{name}: named by {INDEX_NAME} for {count} tensor(s) but not in the folder; "
                    "every engine stops loading at it; fix: copy the shard in (an interrupted download?) or "
                    "rewrite the index", tensor=name))
                continue
            try:
                shards[name] = SafetensorsFile(path)
            except CheckpointError as exc:
                problems.append(Problem("unreadable_shard", f"{exc}; every engine fails to load it; fix: "
                                        "download or write the shard again", tensor=name))
    except BaseException:
        for shard in shards.values():
            shard.close()
        raise
    tensors: dict[str, TensorEntry] = {}
    for name, shard in shards.items():
        for entry in shard.entries.values():
            if weight_map is not None and weight_map.get(entry.name) != name:
                continue  # a tensor the index does not place here: engines do not read it from this shard
            tensors.setdefault(entry.name, entry)
    if weight_map is not None:
        for tensor, shard_name in weight_map.items():
            if shard_name in shards and tensor not in tensors:
                problems.append(Problem("missing_tensor", f"{tensor}: {INDEX_NAME} places it in {shard_name}, "
                                        "which does not hold it; engines fail to load; fix: rewrite the index",
                                        tensor=tensor))
    return _Folder(folder, config, quant_config, shards, tensors, problems)


# ----------------------------------------------------------------------------------------------- the configs

@dataclass
class _Configs:
    form: str
    quant_algo: str | None
    qc: dict | None  # config.json quantization_config
    hq: dict | None  # hf_quant_config.json "quantization"
    input_needed: dict[str, bool]  # per engine: W4A4 (input scales loaded) or W4A16
    exclude: dict[str, list[str] | None]  # per engine: the exclusion list it reads (None: not a list of strings)
    exclude_field: dict[str, str] = field(default_factory=dict)  # per engine: that list's file and field
    quantized_layers: dict | None = None  # ModelOpt MIXED_PRECISION: layer -> {"quant_algo", ...}


def _groups(qc: dict | None) -> dict:
    groups = (qc or {}).get("config_groups")
    return groups if isinstance(groups, dict) else {}


def _read_configs(config: dict, quant_file: dict | None, problems: list[Problem]) -> _Configs:
    qc = quantization_config(config)  # the top level's, else a nested text_config's (a multimodal wrapper)
    hq = None
    if quant_file is not None:
        hq = quant_file.get("quantization")
        if not isinstance(hq, dict):
            problems.append(Problem("missing_config_field", f"{QUANT_CONFIG_NAME}: no \"quantization\" object; "
                                    "TensorRT-LLM and vLLM cannot read it; fix: write {\"quantization\": "
                                    "{\"quant_algo\": ..., \"kv_cache_quant_algo\": ..., \"group_size\": 16, "
                                    "\"exclude_modules\": [...]}}", tensor=QUANT_CONFIG_NAME))
            hq = {}
    method = str((qc or {}).get("quant_method", "")).lower()
    if method.startswith("modelopt") or (qc is None and hq is not None):
        form = "modelopt"
        algo = (qc or {}).get("quant_algo") or (hq or {}).get("quant_algo")
    elif method == "compressed-tensors":
        form = "compressed-tensors"
        algo = None
    elif method == "fp8" and (qc or {}).get("moe_quant_algo"):
        form = "deepseek-fp8-moe-nvfp4"
        algo = str(qc["moe_quant_algo"])
    else:
        form = "unknown"
        algo = None
    algo = str(algo).upper() if algo else None
    input_needed = {name: False for name in ENGINE_NAMES}
    mixed = None
    if form == "modelopt" and algo == "MIXED_PRECISION":  # each layer's algorithm in quantized_layers (vLLM)
        source = qc if isinstance((qc or {}).get("quantized_layers"), dict) else (hq or {})
        mixed = source.get("quantized_layers") if isinstance(source.get("quantized_layers"), dict) else {}
        input_needed["vllm"] = any(isinstance(v, dict) and str(v.get("quant_algo", "")).upper() == "NVFP4"
                                   for v in mixed.values())
    elif form == "modelopt":
        w4a4 = algo == "NVFP4"
        groups = _groups(qc)
        vllm_w4a16 = bool(groups) and all(isinstance(g, dict) and g.get("input_activations") is None
                                          for g in groups.values())
        input_needed = {"vllm": w4a4 and not vllm_w4a16, "sglang": w4a4, "trtllm": w4a4}
    elif form == "compressed-tensors":
        w4a4 = any(isinstance(g, dict) and isinstance(g.get("input_activations"), dict)
                   and g["input_activations"].get("dynamic") is not True for g in _groups(qc).values())
        input_needed = {name: w4a4 for name in ENGINE_NAMES}
    elif form == "deepseek-fp8-moe-nvfp4":
        input_needed = {name: algo == "NVFP4" for name in ENGINE_NAMES}
    exclude, where = _exclusion_lists(qc, hq, problems)
    return _Configs(form, algo, qc, hq, input_needed, exclude, where, mixed)


def _exclusion_lists(qc: dict | None, hq: dict | None, problems: list[Problem]
                     ) -> tuple[dict[str, list[str] | None], dict[str, str]]:
    """Per engine, the exclusion list it reads and that list's field, from the file the engine reads
    (:func:`fp4pass.checkpoint.engines._quant_config_for`): vLLM and SGLang config.json's quantization_config
    (``ignore``, else ``exclude_modules``) when there is one, else hf_quant_config.json's
    ``quantization.exclude_modules``; TensorRT-LLM hf_quant_config.json when there is one, else config.json.
    A list that is not a list of strings is a ``bad_config_value`` (the engine raises on it) and None."""
    from fp4pass.safetensors.patterns import BadPattern, entries

    from_qc = from_hq = None
    if qc is not None:
        key = "ignore" if "ignore" in qc else "exclude_modules"
        from_qc = (qc.get(key), f"{CONFIG_NAME} quantization_config.{key}")
    if hq is not None:
        from_hq = (hq.get("exclude_modules"), f"{QUANT_CONFIG_NAME} quantization.exclude_modules")
    chosen = {"vllm": from_qc or from_hq, "sglang": from_qc or from_hq, "trtllm": from_hq or from_qc}
    lists: dict[str, list[str] | None] = {}
    where: dict[str, str] = {}
    bad: dict[str, Problem] = {}
    for engine, (value, name) in ((e, c or (None, "no exclusion list")) for e, c in chosen.items()):
        where[engine] = name
        try:
            lists[engine] = entries(value, name)
        except BadPattern as exc:
            lists[engine] = None
            if name not in bad:
                bad[name] = Problem("bad_config_value", f"{exc}; the engine raises on it when it builds the "
                                    "model; fix: a list of module names (strings)",
                                    tensor=name.split(" ")[0], engines=[])
                problems.append(bad[name])
            bad[name].engines.append(engine)
    return lists, where


def _check_configs(cfg: _Configs, problems: list[Problem]) -> None:
    """Required fields, accepted values, and config.json against hf_quant_config.json."""
    hq, qc = cfg.hq, cfg.qc
    if hq is not None and hq != {}:
        missing = [k for k in ("quant_algo", "kv_cache_quant_algo", "group_size", "exclude_modules") if k not in hq]
        readers = ["trtllm"] if qc is not None else list(ENGINE_NAMES)
        for key in missing:
            problems.append(Problem(
                "missing_config_field", f"{QUANT_CONFIG_NAME}: quantization.{key} is missing; vLLM refuses the "
                f"file (\"NVFP4 quantization requires the following fields\") and TensorRT-LLM cannot read it; "
                f"fix: add \"{key}\" (null where it does not apply)", tensor=QUANT_CONFIG_NAME, engines=readers))
        if "group_size" in hq and hq["group_size"] != 16:
            problems.append(Problem("bad_config_value", f"{QUANT_CONFIG_NAME}: group_size {hq['group_size']!r}; "
                                    "NVFP4 blocks are 16 elements; fix: \"group_size\": 16",
                                    tensor=QUANT_CONFIG_NAME, engines=readers))
    if cfg.form == "modelopt" and qc is not None and not qc.get("quant_algo"):
        problems.append(Problem("missing_config_field", f"{CONFIG_NAME}: quantization_config.quant_algo is "
                                "missing; vLLM raises \"Missing 'quant_algo' in quantization config\"; fix: "
                                "\"quant_algo\": \"NVFP4\" (or \"W4A16_NVFP4\" without input scales)",
                                tensor=CONFIG_NAME, engines=["vllm", "sglang"]))
    if cfg.form == "compressed-tensors":
        groups = _groups(qc)
        if not groups:
            problems.append(Problem("missing_config_field", f"{CONFIG_NAME}: quantization_config.config_groups is "
                                    "missing or empty; compressed-tensors and vLLM quantize nothing or refuse; "
                                    "fix: one group with targets [\"Linear\"] and the NVFP4 weights arguments",
                                    tensor=CONFIG_NAME))
        top = qc.get("format")
        for gname, group in groups.items():
            group = group if isinstance(group, dict) else {}
            fmt = group.get("format", top)
            if fmt is None:
                problems.append(Problem("missing_config_field", f"{CONFIG_NAME}: quantization_config has no "
                                        f"\"format\" (top level or in {gname}); vLLM cannot tell the packed NVFP4 "
                                        "form; fix: \"format\": \"nvfp4-pack-quantized\"", tensor=CONFIG_NAME))
            elif fmt != "nvfp4-pack-quantized":
                problems.append(Problem("bad_config_value", f"{CONFIG_NAME}: {gname} format {fmt!r} with NVFP4 "
                                        "tensors; engines read the tensors in another layout; fix: "
                                        "\"nvfp4-pack-quantized\"", tensor=CONFIG_NAME))
            weights = group.get("weights")
            if not isinstance(weights, dict):
                problems.append(Problem("missing_config_field", f"{CONFIG_NAME}: {gname} has no \"weights\"; "
                                        "nothing is quantized; fix: the NVFP4 weights arguments",
                                        tensor=CONFIG_NAME))
                continue
            want = {"num_bits": 4, "type": "float", "group_size": 16, "strategy": "tensor_group"}
            for key, value in want.items():
                if weights.get(key) != value:
                    problems.append(Problem("bad_config_value", f"{CONFIG_NAME}: {gname}.weights.{key} is "
                                            f"{weights.get(key)!r}, NVFP4 needs {value!r}; vLLM picks another "
                                            f"scheme or refuses; fix: \"{key}\": {value!r}", tensor=CONFIG_NAME))
    if cfg.form == "unknown":
        problems.append(Problem("missing_config_field", f"{CONFIG_NAME}: no quantization_config that names NVFP4 "
                                f"(quant_method modelopt or compressed-tensors) and no {QUANT_CONFIG_NAME}; "
                                "engines load the NVFP4 tensors as plain weights and fail; fix: write the "
                                "quantization config of the form the tensors are in", tensor=CONFIG_NAME))
    if qc is not None and hq:
        _compare(cfg, qc, hq, problems)


def _compare(cfg: _Configs, qc: dict, hq: dict, problems: list[Problem]) -> None:
    def disagree(what: str, a, b) -> None:
        problems.append(Problem("config_disagreement", f"{what}: {CONFIG_NAME} says {a!r}, {QUANT_CONFIG_NAME} "
                                f"says {b!r}; vLLM and SGLang read {CONFIG_NAME}, TensorRT-LLM reads "
                                f"{QUANT_CONFIG_NAME}, so they serve different models; fix: write the same in "
                                "both", tensor=QUANT_CONFIG_NAME))

    if cfg.form != "modelopt":
        disagree("quant_method", qc.get("quant_method"), "modelopt")
        return
    a, b = qc.get("quant_algo"), hq.get("quant_algo")
    if a and b and str(a).upper() != str(b).upper():
        disagree("quant_algo", a, b)
    if "group_size" in qc and "group_size" in hq and qc["group_size"] != hq["group_size"]:
        disagree("group_size", qc["group_size"], hq["group_size"])
    if "kv_cache_quant_algo" in qc and "kv_cache_quant_algo" in hq and qc["kv_cache_quant_algo"] != hq[
            "kv_cache_quant_algo"]:
        disagree("kv_cache_quant_algo", qc["kv_cache_quant_algo"], hq["kv_cache_quant_algo"])
    lists = {key: qc[key] for key in ("ignore", "exclude_modules") if isinstance(qc.get(key), list)}
    hq_list = hq.get("exclude_modules")
    if isinstance(hq_list, list):
        for key, value in lists.items():
            if sorted(map(str, value)) != sorted(map(str, hq_list)):
                only_a = sorted(set(map(str, value)) - set(map(str, hq_list)))
                only_b = sorted(set(map(str, hq_list)) - set(map(str, value)))
                disagree(f"exclusions ({key} vs exclude_modules)", f"{len(value)} entries, {only_a[:3]} not in "
                         f"the other", f"{len(hq_list)} entries, {only_b[:3]} not in the other")
                break


# --------------------------------------------------------------------------------------------- the tensors

def _find_modules(tensors: dict[str, TensorEntry]) -> dict[str, Module]:
    """Every quantized module, from its scale tensors (a module with no scale tensor is not NVFP4)."""
    modules: dict[str, Module] = {}
    for name, entry in tensors.items():
        fused = _FUSED.match(name)
        if fused:
            mod = modules.setdefault(fused["p"], Module(fused["p"], "fused-experts", convention="multiplier"))
            role = {"weight_scale": "block", "weight_scale_2": "global", "input_scale": "input"}[fused["what"]]
            setattr(mod, {"block": "block", "global": "global_", "input": "input"}[role], entry)
            continue
        prefix, _, suffix = name.rpartition(".")
        if suffix not in _SUFFIXES or suffix in ("weight", "weight_packed") or not prefix:
            continue
        role, convention = _SUFFIXES[suffix]
        mod = modules.setdefault(prefix, Module(prefix, "linear"))
        setattr(mod, {"block": "block", "global": "global_", "input": "input"}[role], entry)
        if convention:
            if mod.convention and mod.convention != convention:
                mod.extra["mixed"] = True
            mod.convention = mod.convention or convention
    for mod in modules.values():
        if mod.layout == "fused-experts":
            mod.codes = tensors.get(mod.name)
        else:
            mod.codes = tensors.get(f"{mod.name}.weight_packed") or tensors.get(f"{mod.name}.weight")
            if mod.convention is None:
                mod.convention = "divisor" if f"{mod.name}.weight_packed" in tensors else "multiplier"
    # a block scale alone is not NVFP4 (FP8 block-quantized weights carry a weight_scale too, and
    # compressed-tensors' MXFP4 has the same weight_packed + weight_scale names): keep a module when its block
    # scale is E4M3 beside packed U8 codes, or it has an NVFP4 global scale. An E8M0 (U8) block scale without a
    # global scale is an MXFP4 weight, decided by its dtype, not its names.
    out = {}
    for name, mod in modules.items():
        nvfp4_codes = mod.codes is not None and mod.codes.dtype == "U8"
        fp8_weight = mod.codes is not None and mod.codes.dtype.startswith("F8")
        mxfp4_block = mod.block is not None and block_precision(mod.block.dtype) == "mxfp4"
        if (fp8_weight or mxfp4_block) and mod.global_ is None:
            continue
        if mod.global_ is not None or (nvfp4_codes and mod.block is not None) or mod.layout == "fused-experts":
            out[name] = mod
    return out


_E4M3_TABLE = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float64).numpy()
_SCALAR_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "BF16": None}
_SCALAR_LIMIT = 1 << 20  # a "scalar" scale of more bytes is a shape problem, not read
_RUN_GAP = 1 << 16  # scalars this close in a shard are read with one pread


def _pread(fd: int, size: int, offset: int, shard: str) -> bytes:
    parts, done = [], 0
    while done < size:
        got = os.pread(fd, size - done, offset + done)
        if not got:
            raise CheckpointError(f"{shard}: truncated while reading its scales (the file shrank)")
        parts.append(got)
        done += len(got)
    return b"".join(parts)


def _decode_scalar(raw: bytes, dtype: str) -> np.ndarray:
    if dtype == "BF16":
        return (np.frombuffer(raw, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return np.frombuffer(raw, dtype=_SCALAR_DTYPES[dtype]).astype(np.float64)


def _sample_pieces(nbytes: int) -> list[tuple[int, int]]:
    """(offset, size) of the block-scale bytes sampled from a tensor of ``nbytes``: all of it up to
    :data:`BLOCK_SAMPLE_BYTES`, else :data:`_PIECES` pieces evenly spread from its first byte to its last (the
    last piece ends at the tensor's end: its last rows are always read)."""
    if nbytes <= BLOCK_SAMPLE_BYTES:
        return [(0, nbytes)]
    piece = BLOCK_SAMPLE_BYTES // _PIECES
    last = nbytes - piece
    return [(k * last // (_PIECES - 1), piece) for k in range(_PIECES)]


def _read_scales(folder: _Folder, modules: dict[str, Module]) -> None:
    """Every module's global and input scales (decoded to float64) and a sample of its E4M3 block scales (at most
    :data:`BLOCK_SAMPLE_BYTES`, in evenly spread pieces), shard by shard with one descriptor each and scalars that
    lie together in one read: a per-expert 120B checkpoint has ~28,000 scalars."""
    wanted: dict[str, tuple[list, list]] = {}
    for mod in modules.values():
        for entry, attr in ((mod.global_, "global_value"), (mod.input, "input_value")):
            if entry is not None and entry.dtype in _SCALAR_DTYPES and entry.nbytes <= _SCALAR_LIMIT:
                wanted.setdefault(entry.shard, ([], []))[0].append((entry, mod, attr))
        if mod.block is not None and mod.block.dtype == "F8_E4M3" and mod.block.nbytes:
            wanted.setdefault(mod.block.shard, ([], []))[1].append(mod)
    for shard_name, (scalars, blocks) in wanted.items():
        shard = folder.shards[shard_name]
        with shard.opened() as fd:
            scalars.sort(key=lambda item: item[0].begin)
            i = 0
            while i < len(scalars):
                j, start, end = i + 1, scalars[i][0].begin, scalars[i][0].end
                while j < len(scalars) and scalars[j][0].begin - end <= _RUN_GAP and scalars[j][0].end - start <= \
                        _SCALAR_LIMIT:
                    end = max(end, scalars[j][0].end)
                    j += 1
                raw = _pread(fd, end - start, start, shard_name)
                for entry, mod, attr in scalars[i:j]:
                    setattr(mod, attr, _decode_scalar(raw[entry.begin - start:entry.end - start], entry.dtype))
                i = j
            for mod in blocks:
                entry = mod.block
                raw = b"".join(_pread(fd, size, entry.begin + offset, shard_name)
                               for offset, size in _sample_pieces(entry.nbytes))
                # on the bytes: E4M3FN 0x7F/0xFF are NaN, bit 7 the sign, and positive codes 0x00..0x7E are
                # ordered as their values, so the largest such code is the largest block scale
                codes = np.frombuffer(raw, dtype=np.uint8)
                magnitude = codes & _E4M3_NAN
                nan = int(np.count_nonzero(magnitude == _E4M3_NAN))
                negative = int(np.count_nonzero((codes >= _E4M3_SIGN) & (magnitude != 0) & (magnitude != _E4M3_NAN)))
                positive = codes[codes < _E4M3_NAN]
                mod.extra["block_sample"] = (codes.size, nan, negative,
                                             float(_E4M3_TABLE[positive.max()]) if positive.size else None)
                mod.block_max = mod.extra["block_sample"][3]


_EXACT_CHUNK = 1 << 24  # bytes of block scales read at a time where a whole tensor is read
#: E4M3 subnormal codes that are not powers of two (3, 5, 6, 7 x 2^-9): a block scale rounded onto them is up to
#: 25% off, where 2^-9, 2^-8 and 2^-7 (codes 1, 2, 4, which a lossless conversion writes) are exact
_LOSSY_SUBNORMALS = np.array([3, 5, 6, 7], dtype=np.uint8)


def _read_exact_blocks(folder: _Folder, modules: dict[str, Module]) -> None:
    """Every block scale of each module whose magnitudes its sample would call wrong (and of its w1/w3 partner,
    which shares its global scale): the largest block scale per expert and the lossy subnormals per expert, so
    that a magnitude finding rests on the whole tensor, never on a sample. Other modules keep their sample."""
    suspects = {name for name, mod in modules.items() if _magnitude_suspect(mod)}
    suspects |= {partner for name in suspects if (partner := _partner_name(name)) in modules}
    by_shard: dict[str, list[Module]] = {}
    for name in sorted(suspects):
        mod = modules[name]
        if mod.block is not None and mod.block.dtype == "F8_E4M3" and mod.block.nbytes and "block_sample" in mod.extra:
            by_shard.setdefault(mod.block.shard, []).append(mod)
    for shard_name, mods in by_shard.items():
        with folder.shards[shard_name].opened() as fd:
            for mod in mods:
                _read_block_census(fd, mod, shard_name)


def _usable_multipliers(mod: Module) -> np.ndarray | None:
    """The module's global scale(s) read as multipliers, or None when one is not a finite positive number."""
    values = mod.global_value
    if values is None or not values.size or not (np.isfinite(values).all() and (values > 0).all()):
        return None
    values = values.reshape(-1)
    return values if mod.convention == "multiplier" else 1.0 / values


def _magnitude_suspect(mod: Module) -> bool:
    """Whether the sample's largest block scale, under any of the module's global scales, gives a folded scale
    (a multiplier of 1 over block scales at most :data:`FOLDED_BLOCK_MAX`) or a weight amax outside
    :data:`WEIGHT_AMAX_RANGE`."""
    multipliers = _usable_multipliers(mod)
    sample = mod.extra.get("block_sample")
    if multipliers is None or sample is None or not sample[3]:
        return False
    amax = E2M1_MAX * sample[3] * multipliers
    folded = (multipliers == 1.0) & (sample[3] <= FOLDED_BLOCK_MAX)
    return bool(folded.any() or ((amax < WEIGHT_AMAX_RANGE[0]) | (amax > WEIGHT_AMAX_RANGE[1])).any())


def _partner_name(name: str) -> str | None:
    """w3's name for w1's (gate_proj's for up_proj's, and the reverse), None for a module of no pair."""
    match = _EXPERT.match(name)
    if not match or match["proj"] not in _GATE + _UP:
        return None
    i = (_GATE + _UP).index(match["proj"])
    other = (_UP + _GATE)[i]
    return f"{match['layer']}.{match['e']}.{other}"


def _read_block_census(fd: int, mod: Module, shard: str) -> None:
    """Read all of ``mod``'s E4M3 block scales, expert by expert where each expert has its own global scale (a
    stack [E, K/16, N] holds expert e's in its e-th contiguous slice): ``extra["expert_max"]`` the largest
    positive block scale of each (0 where none), ``extra["lossy_subnormals"]`` how many are lossy subnormals."""
    entry = mod.block
    experts = mod.global_value.size if mod.layout == "fused-experts" and mod.global_value is not None else 1
    experts = experts if experts > 1 and entry.nbytes % experts == 0 else 1
    size = entry.nbytes // experts
    maxima, lossy = np.zeros(experts), np.zeros(experts, dtype=np.int64)
    for e in range(experts):
        top = 0
        for start in range(0, size, _EXACT_CHUNK):
            codes = np.frombuffer(_pread(fd, min(_EXACT_CHUNK, size - start), entry.begin + e * size + start, shard),
                                  dtype=np.uint8)
            positive = codes[codes < _E4M3_NAN]
            top = max(top, int(positive.max()) if positive.size else 0)
            lossy[e] += int(np.isin(positive, _LOSSY_SUBNORMALS).sum())
        maxima[e] = _E4M3_TABLE[top]
    mod.extra["expert_max"], mod.extra["lossy_subnormals"] = maxima, lossy
    size_read, nan, negative, _ = mod.extra["block_sample"]
    mod.extra["block_sample"] = (size_read, nan, negative, float(maxima.max()))
    mod.block_max = float(maxima.max())


def _check_shapes(mod: Module, problems: list[Problem]) -> bool:
    """dtype and shape rules of the module's form; False when the scales cannot be read as NVFP4."""
    ok = True

    def bad(tensor: str, what: str, fix: str) -> None:
        nonlocal ok
        ok = False
        problems.append(Problem("dtype_shape", f"{tensor}: {what}; the engine's loader refuses it (shape or dtype "
                                f"mismatch in weight_loader); fix: {fix}", module=mod.name, tensor=tensor))

    codes, block = mod.codes, mod.block
    codes_leaf = "weight_packed" if mod.convention == "divisor" else "weight"
    codes_name = mod.name if mod.layout == "fused-experts" else f"{mod.name}.{codes_leaf}"
    if codes is None:
        problems.append(Problem("missing_tensor", f"{codes_name}: missing, but the module has NVFP4 scales; the "
                                "engine builds an NVFP4 layer and finds no weight (\"was never loaded\", or "
                                "garbage); fix: write the packed E2M1 weight", module=mod.name, tensor=codes_name))
        ok = False
    if block is None:
        tensor = f"{mod.name}_weight_scale" if mod.layout == "fused-experts" else f"{mod.name}.weight_scale"
        problems.append(Problem("missing_scale", f"{tensor}: missing; the engine's block scales stay uninitialised "
                                "(garbage output) or the load fails; fix: write the E4M3 block scales [N, K/16]",
                                module=mod.name, tensor=tensor))
        ok = False
    rank = 3 if mod.layout == "fused-experts" else 2
    if codes is not None and (codes.dtype != "U8" or len(codes.shape) != rank):
        bad(codes.name, f"{codes.dtype} {list(codes.shape)}, packed E2M1 needs U8 of rank {rank}",
            "two E2M1 codes per byte, uint8")
        codes = None
    if block is not None and (block.dtype != "F8_E4M3" or len(block.shape) != rank):
        bad(block.name, f"{block.dtype} {list(block.shape)}, NVFP4 block scales are F8_E4M3 of rank {rank}",
            "float8_e4m3fn block scales (an E8M0/U8 scale is MXFP4, not NVFP4)")
        block = None
    if codes is not None and block is not None:
        if rank == 2:
            n, half = codes.shape
            want = [n, -(-2 * half // 16)]
            got = list(block.shape)
            layout = "[N, K/16] beside the weight's [N, K/2]"
        else:
            e, half, n = codes.shape
            want = [e, -(-2 * half // 16), n]
            got = list(block.shape)
            layout = "[E, K/16, N] beside the weight's [E, K/2, N]"
        if got != want:
            bad(block.name, f"shape {got}, expected {want} ({layout} {list(codes.shape)})",
                "block scales of one E4M3 per 16 weights along the input dimension")
    for entry, role in ((mod.global_, "global"), (mod.input, "input")):
        if entry is None:
            continue
        per_expert = mod.layout == "fused-experts" and codes is not None and math.prod(entry.shape) == codes.shape[0]
        if entry.dtype != "F32" or (math.prod(entry.shape) != 1 and not per_expert):
            bad(entry.name, f"{entry.dtype} {list(entry.shape)}, a {role} scale is one F32 ([] or [1])",
                "one float32 number")
    return ok


def _value_problems(mod: Module, entry: TensorEntry, values: np.ndarray, role: str, problems: list[Problem]) -> bool:
    """Zero, negative or non-finite scalar scales; True when every value is a usable positive number."""
    conv = "multiplier" if mod.convention == "multiplier" else "divisor"
    what = "input scale" if role == "input" else "weight global scale"
    if role == "input":
        effect = ("the engine quantizes activations with 1/input_scale = inf: NaN output on the prompts that reach "
                  "this module (vLLM #45212)" if conv == "multiplier" else
                  "activations quantized with a zero or broken divisor: NaN or zero output")
        fix = ("a finite positive amax/2688 from calibration, or the largest over the layer's experts "
               "(what ModelOpt writes for experts calibration never reached)")
    else:
        effect = "every weight of the module dequantizes to 0, NaN or the wrong sign: the model's output is garbage"
        fix = "the finite positive global scale the block scales were made with"
    if conv == "divisor":
        fix = "the reciprocal of " + fix
    good = True
    # a zero the engine inverts (an input multiplier, any divisor) is inf, and inf x 0 is NaN
    zero_outcome = "nan" if role == "input" or conv == "divisor" else "garbage"
    for kind, mask, adjective, outcome in (
            ("nonfinite_scale", ~np.isfinite(values), "NaN or infinite", "nan"),
            ("zero_scale", values == 0, "zero", zero_outcome),
            ("negative_scale", np.isfinite(values) & (values < 0), "negative", "garbage")):
        if mask.any():
            good = False
            problems.append(Problem(kind, f"{entry.name}: {what} ({conv}) is {adjective} "
                                    f"({_number(values[mask][0])}); {effect}; fix: {fix}", module=mod.name,
                                    tensor=entry.name, outcome=outcome))
    return good


def _number(value) -> str:
    """A number as a message shows it: ``0``, ``-0.5``, ``nan``, ``inf`` (never a numpy repr)."""
    return f"{float(value):.6g}"


def _check_values(mod: Module, problems: list[Problem], partner: Module | None = None) -> None:
    """The scales :func:`_read_scales` read: their values, then the magnitudes they decode to (with the w1/w3
    ``partner`` that shares the global scale)."""
    sample = mod.extra.pop("block_sample", None)
    if sample is not None:
        size, nan, neg, mod.block_max = sample
        if nan:
            problems.append(Problem("nonfinite_scale", f"{mod.block.name}: {nan} of {size} block scales read are "
                                    "NaN (E4M3 0x7F/0xFF); those blocks dequantize to NaN; fix: finite block scales "
                                    "(at most 448)", module=mod.name, tensor=mod.block.name))
        if neg:
            problems.append(Problem("negative_scale", f"{mod.block.name}: {neg} of {size} block scales read are "
                                    "negative; those blocks dequantize with the wrong sign; fix: non-negative block "
                                    "scales", module=mod.name, tensor=mod.block.name))
    global_ok = False
    if mod.global_value is not None and mod.global_value.size:
        global_ok = _value_problems(mod, mod.global_, mod.global_value, "global", problems)
    input_ok = False
    if mod.input_value is not None and mod.input_value.size:
        input_ok = _value_problems(mod, mod.input, mod.input_value, "input", problems)
    if global_ok and mod.block_max:
        _check_weight_magnitude(mod, problems, partner)
    if input_ok:
        _check_input_magnitude(mod, problems)


def _inside(value: float, bounds: tuple[float, float]) -> bool:
    return bounds[0] <= value <= bounds[1]


def _check_weight_magnitude(mod: Module, problems: list[Problem], partner: Module | None = None) -> None:
    """The weight amax ``6 x s_max x g`` each global scale decodes to (per expert where each has its own), from
    every block scale where :func:`_read_exact_blocks` read them all. A w1/w3 ``partner`` that shares the global
    scale is judged with it: the scale was made from the pair's amax, and w3 alone may sit far below w1.

    - folded_global_scale (exact): a multiplier of 1, block scales at most :data:`FOLDED_BLOCK_MAX`, and block
      scales on E4M3's lossy subnormals (3, 5, 6, 7 x 2^-9) that a global scale would have kept normal;
    - scale_convention: the amax as stored is outside :data:`WEIGHT_AMAX_RANGE` while the reciprocal reading is
      inside it; outside :data:`OWN_WEIGHT_AMAX_RANGE` too (no trained weight has such an amax) it is an error,
      else a guess (a warning: a weight with amax above 2^10 exists)."""
    multipliers = _usable_multipliers(mod)
    maxima = mod.extra.get("expert_max")
    if maxima is None or maxima.size != multipliers.size:
        maxima = np.full(multipliers.size, mod.block_max)
    lossy = mod.extra.get("lossy_subnormals", np.zeros(maxima.size, dtype=np.int64))
    if partner is not None and "expert_max" in partner.extra and partner.global_value is not None and \
            np.array_equal(partner.global_value, mod.global_value):
        maxima = np.maximum(maxima, partner.extra["expert_max"].max())
    folded = (multipliers == 1.0) & (maxima > 0) & (maxima <= FOLDED_BLOCK_MAX) & (lossy > 0)
    if folded.any():
        e = int(np.argmax(folded))
        problems.append(Problem(
            "folded_global_scale", f"{mod.global_.name}: global scale 1 and the block scales at most "
            f"{maxima[e]:g} (E4M3 reaches 448), {int(lossy[e])} of them on E4M3's subnormals (steps of 2^-9): "
            "the per-tensor scale was folded into the E4M3 block scales, and those blocks lose up to 25% of their "
            "value; fix: requantize with a float32 global scale = amax/2688 and block scales up to 448",
            module=mod.name, tensor=mod.global_.name))
        return
    live = maxima > 0
    as_stored = E2M1_MAX * maxima * multipliers
    other = E2M1_MAX * maxima / multipliers
    swapped = live & ~_within(as_stored, WEIGHT_AMAX_RANGE) & _within(other, WEIGHT_AMAX_RANGE)
    if not swapped.any():
        return
    certain = swapped & ~_within(as_stored, OWN_WEIGHT_AMAX_RANGE)
    e = int(np.argmax(certain)) if certain.any() else int(np.argmax(swapped))
    stored = float(mod.global_value.reshape(-1)[e])
    expected, wrote = (("a multiplier (weight_scale_2)", "a divisor") if mod.convention == "multiplier" else
                       ("a divisor (weight_global_scale)", "a multiplier"))
    which = f" (expert {e} of {multipliers.size})" if multipliers.size > 1 else ""
    problems.append(Problem(
        "scale_convention", f"{mod.global_.name}{which}: {stored:.6g} decodes the weights to an amax of "
        f"{as_stored[e]:.3g} (6 x block max {maxima[e]:g} x scale), but to {other[e]:.3g} read the other way: "
        f"{wrote} was stored where the form keeps {expected}; the engine scales the weights by "
        f"{as_stored[e] / other[e]:.3g}x; fix: store its reciprocal {1.0 / stored:.6g}"
        + ("" if certain.any() else " (a guess: a weight of that amax is possible; then nothing is wrong)"),
        module=mod.name, tensor=mod.global_.name, guess=not certain.any(), amax_as_stored=float(as_stored[e])))


def _within(values: np.ndarray, bounds: tuple[float, float]) -> np.ndarray:
    return (values >= bounds[0]) & (values <= bounds[1])


def _check_input_magnitude(mod: Module, problems: list[Problem]) -> None:
    """The activation amax ``2688 x input_scale`` (multiplier) outside :data:`ACT_AMAX_RANGE` while the other
    reading is inside: an error above 2^20 (what a swapped scale gives for an amax below 6.9), else a guess (a
    model's outlier activations can pass 2^16)."""
    stored = float(mod.input_value.max())
    per = NVFP4_AMAX_PER_GLOBAL_SCALE
    as_stored = per * stored if mod.convention == "multiplier" else per / stored
    other = per / stored if mod.convention == "multiplier" else per * stored
    if not _inside(as_stored, ACT_AMAX_RANGE) and _inside(other, ACT_AMAX_RANGE):
        wrote = "a divisor" if mod.convention == "multiplier" else "a multiplier"
        certain = as_stored > OWN_WEIGHT_AMAX_RANGE[1]
        problems.append(Problem(
            "scale_convention", f"{mod.input.name}: {stored:.6g} means an activation amax of {as_stored:.3g}, "
            f"{other:.3g} read the other way: {wrote} was stored; activations are quantized {as_stored / other:.3g}x "
            f"off (all zeros or all clipped); fix: store its reciprocal {1.0 / stored:.6g}"
            + ("" if certain else " (a guess: an activation of that amax is possible; then nothing is wrong)"),
            module=mod.name, tensor=mod.input.name, guess=not certain, amax_as_stored=as_stored))


def _input_name(mod: Module) -> str:
    if mod.layout == "fused-experts":
        return f"{mod.name}_input_scale"
    return f"{mod.name}.{'input_global_scale' if mod.convention == 'divisor' else 'input_scale'}"


def _global_name(mod: Module) -> str:
    if mod.layout == "fused-experts":
        return f"{mod.name}_weight_scale_2"
    return f"{mod.name}.{'weight_global_scale' if mod.convention == 'divisor' else 'weight_scale_2'}"


def _check_presence(modules: dict[str, Module], cfg: _Configs, problems: list[Problem]) -> None:
    """Global scales everywhere; input scales where an engine loads them, for all experts of a layer or none."""
    for mod in modules.values():
        if mod.global_ is None:
            tensor = _global_name(mod)
            problems.append(Problem("missing_scale", f"{tensor}: missing; the engine's global scale stays "
                                    "uninitialised (garbage or NaN output; vLLM does not check for missing weights "
                                    "of a quantized model); fix: write the float32 global scale", module=mod.name,
                                    tensor=tensor))
    needing = [e for e, need in cfg.input_needed.items() if need]
    if not needing:
        return
    with_input = [m for m in modules.values() if m.input is not None]
    without = [m for m in modules.values() if m.input is None]
    if not without:
        return
    if not with_input:
        algo = cfg.quant_algo or "input activations quantized"
        problems.append(Problem(
            "missing_scale", f"no module has an input scale, but the config says W4A4 ({algo}); "
            f"{', '.join(needing)} quantize activations with an input scale that was never loaded (garbage, or "
            "1.0 in SGLang); fix: write input scales, or declare weight-only (quant_algo W4A16_NVFP4, "
            "input_activations null)", engines=needing))
        return
    layers: dict[str, list[Module]] = {}
    for mod in modules.values():
        match = _EXPERT.match(mod.name)
        if match:
            layers.setdefault(f"{match['layer']}.*.{match['proj']}", []).append(mod)
    reported = set()
    for pattern, mods in layers.items():
        missing = [m for m in mods if m.input is None]
        if missing and len(missing) < len(mods):
            reported.update(m.name for m in missing)
            problems.append(Problem(
                "scale_missing_some_experts", f"{_input_name(missing[0])}: {len(missing)} of {len(mods)} experts "
                f"of {pattern} have no input scale (experts calibration never reached?); the engine reads 0 or "
                "garbage for them: NaN output on the prompts routed there (vLLM #45212); fix: give those experts "
                "the largest input scale of the layer, as ModelOpt does", module=missing[0].name,
                tensor=_input_name(missing[0]), engines=needing))
    for mod in without:
        if mod.name not in reported:
            tensor = _input_name(mod)
            problems.append(Problem("missing_scale", f"{tensor}: missing while the other modules have one (W4A4); "
                                    "the engine's input scale stays uninitialised: NaN or garbage; fix: write its "
                                    "calibrated input scale", module=mod.name, tensor=tensor, engines=needing))


def _check_pairs(modules: dict[str, Module], problems: list[Problem]) -> None:
    """w1/w3 (gate/up) of one expert share one weight global scale and one input scale in every engine."""
    pairs: dict[str, dict[str, Module]] = {}
    for mod in modules.values():
        match = _EXPERT.match(mod.name)
        if match and match["proj"] in _GATE + _UP:
            pairs.setdefault(f"{match['layer']}.{match['e']}", {})["gate" if match["proj"] in _GATE else "up"] = mod
    for expert, pair in pairs.items():
        if len(pair) != 2:
            continue
        gate, up = pair["gate"], pair["up"]
        for attr, what in (("global_value", "weight global scale"), ("input_value", "input scale")):
            a, b = getattr(gate, attr), getattr(up, attr)
            if a is None or b is None or a.size != 1 or b.size != 1 or np.array_equal(a, b):
                continue  # a scale that is not one number is a dtype_shape problem, named by its shape
            problems.append(Problem(
                "w1_w3_mismatch", f"{expert}: {gate.name.rpartition('.')[2]} and {up.name.rpartition('.')[2]} have "
                f"different {what}s ({float(a[0]):.6g} vs {float(b[0]):.6g}); the engines fuse them into one w13 "
                "with one scale: vLLM keeps w1's with a warning (w3 dequantized wrong), TensorRT-LLM asserts; fix: "
                "requantize both with one shared scale (the larger amax)", module=up.name,
                tensor=_global_name(up) if attr == "global_value" else _input_name(up)))


def _leaf(name: str) -> str:
    return name.rpartition(".")[2]


def _parent_leaf(name: str) -> str:
    return _leaf(name.rpartition(".")[0])


def _is_router(name: str) -> bool:
    return _leaf(name) in _ROUTER_LEAVES and (_parent_leaf(name) in _MOE_PARENTS or _leaf(name) != "gate")


def _is_lm_head(name: str) -> bool:
    return _leaf(name) == "lm_head" or name in ("head", "output")


def _check_roles(modules: dict[str, Module], problems: list[Problem]) -> None:
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


def _fused_map(eng, engine: str, architecture: str | None) -> dict:
    """The fused modules ``engine`` builds for ``architecture`` (SGLang splits its fallback pair whatever the
    model: its quantization/utils.py ``_FALLBACK_FUSED_SHARDS``)."""
    if engine == "sglang":
        return getattr(eng, "_SGLANG_FALLBACK_FUSED", {})
    return eng.FUSED_SHARDS.get(architecture or "", {})


def _judged_layers(eng, engine: str, architecture, kept: list[str], cfg: _Configs, why: dict[str, str]
                   ) -> list[tuple[str, list[str] | None, bool]]:
    """(engine layer, its shards or None, excluded) for the Linears ``kept``, under the exclusion list
    ``engine`` reads, indexed once (:class:`fp4pass.checkpoint.engines.Exclusions`); a fused module whose
    shards disagree is not excluded, and ``why`` says so. Raises the engines' ``BadPattern``."""
    rules = eng.exclusions(engine, cfg.exclude[engine], cfg.form, architecture, cfg.exclude_field[engine],
                           cfg.quantized_layers, eng.ct_targets(cfg.qc) if cfg.form == "compressed-tensors" else None)
    out = []
    for layer, shards in eng.engine_modules(architecture, kept, _fused_map(eng, engine, architecture)):
        try:
            excluded = rules.excluded(layer, shards)
        except eng.MixedShards as exc:
            excluded, why[layer] = False, f"{exc}: the engine refuses the model"
        out.append((layer, shards, excluded))
    return out


def _check_exclusions(folder: _Folder, modules: dict[str, Module], cfg: _Configs, engines: list[str],
                      problems: list[Problem]) -> None:
    """bf16/f16/f32 Linears (2-D ``.weight``) that an engine would quantize because its exclusions miss them,
    the engine's fused modules (``qkv_proj`` over ``q_proj``, ``k_proj``, ``v_proj``) judged as it judges them:
    :func:`fp4pass.checkpoint.engines.is_excluded`."""
    if cfg.form not in ("modelopt", "compressed-tensors"):
        return  # DeepSeek-V4's fp8 config: its ignored_layers are judged by the engine verdicts
    eng = _engines()
    architecture = (folder.config.get("architectures") or [None])[0]
    kept = []
    for name, entry in folder.tensors.items():
        if not name.endswith(".weight") or entry.dtype not in _FLOAT_WEIGHTS or len(entry.shape) != 2:
            continue
        module = name[: -len(".weight")]
        if module in modules or _leaf(module) in _EMBEDDING_LEAVES or "norm" in _leaf(module) or _EXPERT.match(module):
            continue
        kept.append(module)
    misses: dict[str, list[str]] = {}
    why: dict[str, str] = {}
    unusable: dict[str, Problem] = {}
    for engine in engines:
        if cfg.exclude.get(engine) is None:
            continue  # not a list of strings: a bad_config_value already
        if cfg.quantized_layers is not None and engine != "vllm":
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


# ------------------------------------------------------------------------------------------------- verdicts

# the engines each form is written for: an engine outside them that cannot load the form (TensorRT-LLM and
# compressed-tensors) is said in its verdict, and is a problem only when asked for with ``engine``
_FORM_TARGETS = {"compressed-tensors": ("vllm", "sglang"), "deepseek-fp8-moe-nvfp4": ("vllm",)}


def _targets(cfg: _Configs, config: dict, engine: str | None) -> list[str]:
    """The engines whose rules the checkpoint is held to: ``engine`` when given, else the form's among those
    whose loader for the family was read (DeepSeek-V4: vLLM only; Kimi-K3: vLLM and SGLang)."""
    if engine is not None:
        return [engine]
    eng = _engines()
    claimed = family_of(config).engines  # the engines whose loader for this family was read
    return [n for n in eng.ENGINES if n in _FORM_TARGETS.get(cfg.form, eng.ENGINES) and n in claimed]

_FAILS_LOAD = {"missing_shard", "unreadable_shard", "missing_tensor", "dtype_shape", "unexcluded_linear",
               "missing_config_field", "quantized_lm_head", "quantized_router", "bad_config_value"}


def _verdicts(folder: _Folder, problems: list[Problem]) -> dict:
    eng = _engines()
    verdicts = eng.engine_verdicts(folder.config, folder.quant_config, list(folder.tensors))
    out = {}
    for name, verdict in verdicts.items():
        verdict = dict(verdict)
        mine = [p for p in problems if p.engines is None or name in p.engines]
        verdict["problems"] = sorted({p.kind for p in mine})
        failing = sorted({p.kind for p in mine if p.kind in _FAILS_LOAD})
        if failing and verdict.get("loads"):
            verdict["loads"] = False
            verdict["why"] = f"problems found: {', '.join(failing)}" + (
                f"; {verdict['why']}" if verdict.get("why") else "")
        out[name] = verdict
    return out


def _settle_verdicts(verdicts: dict, problems: list[Problem]) -> None:
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


def _cannot_load_fix(engine: str, cfg: _Configs, config: dict, modules: dict[str, Module]) -> str:
    """What makes ``engine`` load a checkpoint whose form its loader does not take."""
    architecture = (config.get("architectures") or [None])[0]
    if architecture == getattr(_engines(), "ARCH_DEEPSEEK_V4", None):
        return ("write DeepSeek-V4 in the compressed-tensors form (fp4pass convert SRC -o OUT --format "
                "compressed-tensors), which vLLM loads; its FP8 form takes NVFP4 routed experts only, W4A4")
    if any(m.layout == "fused-experts" for m in modules.values()):
        return ("none in the checkpoint: the engine's gpt-oss loader has to learn the fused NVFP4 expert scale "
                "keys (for vLLM: PR #46645); until then serve the MXFP4 source")
    if cfg.form == "compressed-tensors" and engine == "trtllm":
        return "for TensorRT-LLM write the modelopt form (fp4pass convert SRC -o OUT --format modelopt)"
    return ("write the form this engine loads (fp4pass convert --format modelopt or compressed-tensors), or serve "
            "it with an engine the table says loads it")


def validate(folder, engine: str | None = None, follow_symlinks: bool = False) -> dict:
    """Check the NVFP4 checkpoint folder ``folder``; ``{"form", "quant_algo", "modules", "problems", "engines",
    ...}`` (module docstring). ``engine``: one of vllm, sglang, trtllm: only its verdict and the problems that
    concern it. Raises :class:`CheckpointError` when nothing can be read (no config.json, no shard, no index)."""
    folder = resolve_checkpoint(folder)  # a folder, or a Hugging Face Hub model ID (org/name[@revision])
    names = list(_engines().ENGINES)
    if engine is not None and engine not in names:
        raise CheckpointError(f"unknown engine {engine!r}; choose one of {', '.join(names)}")
    data = _read_folder(folder, follow_symlinks)
    try:
        problems = data.problems
        cfg = _read_configs(data.config, data.quant_config, problems)
        _check_configs(cfg, problems)
        modules = _find_modules(data.tensors)
        targets = _targets(cfg, data.config, engine)
        _read_scales(data, modules)
        _read_exact_blocks(data, modules)
        for mod in modules.values():
            if _check_shapes(mod, problems):
                _check_values(mod, problems, modules.get(_partner_name(mod.name) or ""))
            else:
                _check_values_scalars_only(mod, problems)
        _check_presence(modules, cfg, problems)
        _check_pairs(modules, problems)
        _check_roles(modules, problems)
        if not modules:
            problems.append(Problem("no_quantized_modules", f"{data.path}: no NVFP4 module (no weight_scale_2, "
                                    "weight_global_scale or E4M3 block scale beside packed weights); this is not "
                                    "an NVFP4 checkpoint; fix: point at the quantized folder"))
        else:
            _check_exclusions(data, modules, cfg, targets, problems)
        verdicts = _verdicts(data, problems)
        for name, verdict in verdicts.items():
            if name in targets and not verdict.get("loads") and not any(
                    p.kind in _FAILS_LOAD and (p.engines is None or name in p.engines) for p in problems):
                problems.append(Problem("engine_cannot_load", f"{name}: "
                                        f"{verdict.get('why') or 'cannot load this form'}; fix: "
                                        f"{_cannot_load_fix(name, cfg, data.config, modules)}", engines=[name],
                                        warning=engine is None))
                verdict["problems"] = sorted(set(verdict["problems"]) | {"engine_cannot_load"})
        for p in problems:  # an engine outside the form's targets: its verdict says it, not a problem
            if p.engines is not None:
                p.engines = [e for e in p.engines if e in targets]
        problems = [p for p in problems if p.engines is None or p.engines]
        _settle_verdicts(verdicts, problems)
        if engine is not None:  # its problems are the targets' above
            verdicts = {engine: verdicts[engine]} if engine in verdicts else {}
        layouts = sorted({m.layout for m in modules.values()})
        return {"source": str(data.path), "form": cfg.form, "quant_algo": cfg.quant_algo, "layouts": layouts,
                "input_scales": "needed" if any(cfg.input_needed.values()) else "not needed",
                "modules": [m.to_json() for m in modules.values()],
                "problems": [p.to_json() for p in problems], "engines": verdicts,
                "shards": sorted(data.shards), "tensors": len(data.tensors)}
    finally:
        data.close()


def _check_values_scalars_only(mod: Module, problems: list[Problem]) -> None:
    """A module whose codes or block scales do not fit: its scalar scales are still checked for their values."""
    for entry, role, values in ((mod.global_, "global", mod.global_value), (mod.input, "input", mod.input_value)):
        if entry is not None and values is not None and values.size:
            _value_problems(mod, entry, values, role, problems)


def _config_if_present(folder: Path, name: str, follow_symlinks: bool) -> dict:
    """The JSON object ``folder / name`` under the folder's rule on symlinks, {} when there is no such entry;
    :class:`CheckpointError` (exit 2) when it is there but cannot be read: a link out of the folder, not a
    regular file, too large, not JSON, nested too deep. Never taken for an absent file: a folder whose
    quantization config cannot be read is not judged as an unquantized one."""
    path = _member(folder, name, follow_symlinks)
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
        formats = [qc.get("format")] + [g.get("format") for g in _groups(qc).values() if isinstance(g, dict)]
        if "nvfp4-pack-quantized" in formats:
            return True
        if method == "compressed-tensors" or qc.get("quant_method"):
            return False
    try:
        data = _read_folder(folder, follow_symlinks)
    except CheckpointError:
        return False
    try:
        return bool(_find_modules(data.tensors))
    finally:
        data.close()


def format_validation(info: dict) -> str:
    """A readable report of :func:`validate`'s result: the engine table (what each engine would do), the modules
    with their global and input scales and the convention they are stored in (a multiplier: W = e2m1 x
    block x g; a divisor: W = e2m1 x block / g), then the problems (errors) and the warnings."""
    lines = [f"{info['source']}: form {info['form']}" + (f" ({info['quant_algo']})" if info.get("quant_algo") else "")
             + f", {len(info['modules'])} quantized module(s) in {len(info['shards'])} shard(s), "
             f"layouts {', '.join(info['layouts']) or 'none'}, input scales {info['input_scales']}", ""]
    lines.append(f"{'engine':<8} {'outcome':<38} {'mode':<6} why")
    for name, v in info["engines"].items():
        outcome = v.get("outcome") or ("loads" if v.get("loads") else "does not load")
        lines.append(f"{name:<8} {outcome:<38} {str(v.get('mode') or '-'):<6} {v.get('why') or ''}")
    lines.append("")
    lines.extend(_module_lines(info["modules"]))
    errors = [p for p in info["problems"] if p.get("severity") != "warning"]
    warnings = [p for p in info["problems"] if p.get("severity") == "warning"]
    if not errors:
        lines.append("no problem found")
    else:
        lines.append(f"{len(errors)} problem(s):")
        lines.extend(_problem_line(p) for p in errors)
    if warnings:
        lines.append(f"{len(warnings)} warning(s) (exit 0 unless --strict):")
        lines.extend(_problem_line(p) for p in warnings)
    return "\n".join(lines)


def _module_lines(modules: list[dict], shown: int = 20) -> list[str]:
    """The first ``shown`` modules: layout, and global and input scales as stored, with their convention."""
    if not modules:
        return []

    def scale(m: dict, key: str) -> str:
        value = m.get(key)
        if value is None:
            return "-"
        number = f"{value:.6g}" if isinstance(value, float) else f"[{len(value)}]"
        return f"{number} {m.get('convention', '')}".rstrip()

    lines = [f"{'module':<60} {'layout':<14} {'global scale':>24} {'input scale':>24}"]
    for m in modules[:shown]:
        lines.append(f"{m['module']:<60} {m['layout']:<14} {scale(m, 'global_scale'):>24} "
                     f"{scale(m, 'input_scale'):>24}")
    if len(modules) > shown:
        lines.append(f"... {len(modules) - shown} more (--json lists all)")
    lines.append("")
    return lines


def _problem_line(p: dict) -> str:
    who = f" [{', '.join(p['engines'])}]" if p.get("engines") else ""
    return f"  {p['kind']}{' (guess)' if p.get('guess') else ''}{who}: {p['message']}"


def exit_status(info: dict, strict: bool = False) -> int:
    """``fp4pass inspect``'s exit status for :func:`validate`'s result: 1 when a problem is an error (with
    ``strict``, a warning too), else 0."""
    return 1 if any(strict or p.get("severity") != "warning" for p in info["problems"]) else 0


#: kinds that, in a folder fp4pass itself wrote, can only come from a broken writer (exit 3); the others
#: (an engine that cannot load the form yet, exclusions an engine reads differently, a source's quantized lm_head)
#: are reported in convert's output and report
WRITER_BUGS = {"missing_shard", "unreadable_shard", "missing_tensor", "zero_scale", "negative_scale",
               "nonfinite_scale", "w1_w3_mismatch", "scale_convention", "folded_global_scale", "dtype_shape",
               "missing_config_field", "bad_config_value", "config_disagreement", "scale_missing_some_experts",
               "no_quantized_modules"}


def validate_own_output(folder) -> dict:
    """:func:`validate` on a folder fp4pass has just written (before it is renamed into place): ``{"problems",
    "engines"}`` for the report; raises :class:`~fp4pass.errors.InvalidOutputError` (exit 3: a bug in fp4pass)
    when a problem of :data:`WRITER_BUGS` is found (a per-module missing global scale too).

    The weights' magnitude guesses (``guess``) are left out: each global scale fp4pass writes comes from the
    weight's own amax, so a weight amax above 2^10 (E8M0 codes up to 137 reach 6144) is the weight's, not a
    swapped scale. A scale_convention finding outside :data:`OWN_WEIGHT_AMAX_RANGE` is no guess (what a swapped
    scale gives for ordinary weights) and stays a writer bug."""
    from fp4pass.errors import InvalidOutputError

    result = validate(folder)
    result["problems"] = [p for p in result["problems"] if not p.get("guess")]
    bugs = [p for p in result["problems"] if p["kind"] in WRITER_BUGS
            or (p["kind"] == "missing_scale" and p.get("engines") is None)]
    if bugs:
        raise InvalidOutputError(f"the NVFP4 checkpoint just written breaks its own form ({bugs[0]['kind']}: "
                                 f"{bugs[0]['message']}; {len(bugs)} problem(s)); nothing was written; please report")
    return {"problems": result["problems"], "engines": result["engines"]}
