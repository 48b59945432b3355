"""The two NVFP4 checkpoint forms written: tensor names, dtypes, shapes, and the quantization configs.

Scale conventions (a *multiplier* is applied on dequantize, a *divisor* divides):

ModelOpt unified HF checkpoint (``--format modelopt``; vLLM ``modelopt_fp4``, TensorRT-LLM), per Linear ``M``::

    M.weight          uint8   [N, K/2]    two E2M1 codes per byte, even element in the low nibble
    M.weight_scale    F8_E4M3 [N, K/16]   block scale, multiplier, plain row-major
    M.weight_scale_2  F32     []          global scale, multiplier: W = e2m1 * weight_scale * weight_scale_2
    M.input_scale     F32     []          activation amax / 2688, multiplier (only when input scales are given)

gpt-oss expert stacks, as ModelOpt's own gpt-oss export writes them (``P`` = ``...mlp.experts``)::

    P.gate_up_proj                 uint8   [E, K/2, N]   the [E, N, K/2] bytes transposed (rows still interleaved)
    P.gate_up_proj_weight_scale    F8_E4M3 [E, K/16, N]
    P.gate_up_proj_weight_scale_2  F32     []            one multiplier for all experts
    P.gate_up_proj_input_scale     F32     []            (when input scales are given)

(``down_proj`` likewise; the biases ``P.*_bias`` are copied as they are.)

compressed-tensors ``nvfp4-pack-quantized`` (``--format compressed-tensors``), per Linear ``M``::

    M.weight_packed       uint8   [N, K/2]   the same bytes
    M.weight_scale        F8_E4M3 [N, K/16]  the same bytes
    M.weight_global_scale F32     [1]        1 / weight_scale_2: a DIVISOR (W = e2m1 * weight_scale / it)
    M.input_global_scale  F32     [1]        1 / input_scale (when input scales are given)
"""

from __future__ import annotations

import re

from importlib import metadata

from fp4pass.checkpoint.configs import quantization_config as source_quantization_config
from fp4pass.checkpoint.configs import with_quantization_config
from fp4pass.checkpoint.detect import FusedExperts, Linear
from fp4pass.checkpoint.engines import ARCH_DEEPSEEK_V4, vllm_module_name
from fp4pass.checkpoint.families import architecture_of, family_of
from fp4pass.checkpoint.forms import CT_NVFP4, FP8_SCALE_SUFFIXES, MODELOPT_LINEAR, MODELOPT_STACK, Form
from fp4pass.safetensors.files import OutputSpec

__all__ = ["MODELOPT", "COMPRESSED_TENSORS_FORMAT", "FORMATS", "linear_specs", "fused_specs", "exclude_list",
           "hf_quant_config", "quantization_config", "side_configs", "output_style", "quant_algo", "PRODUCER",
           "nvfp4_form"]

MODELOPT, COMPRESSED_TENSORS_FORMAT = "modelopt", "compressed-tensors"
FORMATS = (MODELOPT, COMPRESSED_TENSORS_FORMAT)


def _version() -> str:
    try:
        return metadata.version("fp4pass")
    except metadata.PackageNotFoundError:
        return "unknown"


PRODUCER = {"name": "fp4pass", "version": _version()}
GROUP_SIZE = 16


def nvfp4_form(fmt: str) -> Form:
    """The per-Linear NVFP4 form written for ``--format fmt`` (:mod:`fp4pass.checkpoint.forms`)."""
    return MODELOPT_LINEAR if fmt == MODELOPT else CT_NVFP4


def _spec(form: Form, module: str, role: str, shape: tuple) -> OutputSpec:
    r = form.role(role)
    return OutputSpec(r.name(module), r.dtypes[0], shape)


def linear_specs(lin: Linear, fmt: str, with_input: bool) -> list[OutputSpec]:
    """The output tensors of one converted Linear [N, K], in writing order: codes [N, K/2], block scales
    [N, K/16], the global scale ([] for ModelOpt's multiplier, [1] for compressed-tensors' divisor) and, with
    input scales, the activation scale of the same shape."""
    form, m, n, k = nvfp4_form(fmt), lin.module, lin.rows, lin.cols
    scalar = () if fmt == MODELOPT else (1,)
    specs = [_spec(form, m, "codes", (n, k // 2)), _spec(form, m, "block_scales", (n, k // 16)),
             _spec(form, m, "global_scale", scalar)]
    return specs + ([_spec(form, m, "input_scale", scalar)] if with_input else [])


def fused_specs(unit: FusedExperts, with_input: bool) -> list[OutputSpec]:
    """The output tensors of a gpt-oss expert stack (ModelOpt only): [E, K/2, N] codes, [E, K/16, N] block
    scales, one global (and input) multiplier for all experts."""
    form, p, e, n, k = MODELOPT_STACK, unit.name, unit.experts, unit.rows, unit.cols
    specs = [_spec(form, p, "codes", (e, k // 2, n)), _spec(form, p, "block_scales", (e, k // 16, n)),
             _spec(form, p, "global_scale", ())]
    return specs + ([_spec(form, p, "input_scale", ())] if with_input else [])


def _prefix_wildcard(module: str, converted: list[str]) -> str:
    """``module`` itself, or ``A*`` for its shallowest proper ancestor ``A`` under which no converted module's
    name begins (a string prefix: ``model.layers.1*`` would also cover ``model.layers.10``)."""
    parts = module.split(".")
    for depth in range(1, len(parts)):
        ancestor = ".".join(parts[:depth])
        if not any(c.startswith(ancestor) for c in converted):
            return ancestor + "*"
    return module


def output_style(fmt: str, source_config: dict | None) -> str:
    """"modelopt", "compressed-tensors", or "deepseek-v4-fp8": ModelOpt tensors under DeepSeek-V4's own FP8
    config with ``moe_quant_algo`` (what vLLM's DeepSeek-V4 loader reads; models/deepseek_v4/quant_config.py)."""
    config = source_config or {}
    qc = source_quantization_config(config) or {}
    if fmt == MODELOPT and architecture_of(config) == ARCH_DEEPSEEK_V4 \
            and str(qc.get("quant_method", "")).lower() == "fp8":
        return "deepseek-v4-fp8"
    return fmt


def exclude_list(kept_modules: list[str], converted_modules: list[str], fmt: str = MODELOPT,
                 source_config: dict | None = None, tensor_names=None) -> list[str]:
    """Modules left in their own precision (lm_head, embeddings, routers, norms, attention, ...).

    ModelOpt: each module's name, or ``A*`` for its shallowest ancestor ``A`` that holds no converted module
    (``model.layers.0.self_attn*``), as ModelOpt writes them. Never a ``*`` for a layer or expert index: the
    engines try globs against a fused module's own name only (``qkv_proj``, shared-expert ``gate_up_proj``,
    ``fused_wqa_wkv``), so ``model.layers.*.self_attn.q_proj`` leaves ``qkv_proj`` to NVFP4
    (:mod:`fp4pass.checkpoint.engines`).

    compressed-tensors and DeepSeek-V4's FP8 ``ignored_layers``: every module's exact name (vLLM renames exact
    names with the model's hf_to_vllm_mapper but never ``re:`` patterns; its FP8 ``is_layer_skipped`` matches
    exactly). A top-level module that vLLM renames to another top-level name (DeepSeek-V4 ``head`` ->
    ``lm_head``) is written as a ``re:`` matching both. DeepSeek-V4's FP8 form lists only the modules without
    an FP8 ``.scale`` (those stay FP8).
    """
    style = output_style(fmt, source_config)
    architecture = architecture_of(source_config)
    out: dict[str, None] = {}
    for module in kept_modules:
        if style == MODELOPT:
            out.setdefault(_prefix_wildcard(module, converted_modules))
            continue
        if style == "deepseek-v4-fp8" and tensor_names is not None and any(
                module + suffix in tensor_names for suffix in FP8_SCALE_SUFFIXES):
            continue
        renamed = vllm_module_name(architecture, module)
        if style == COMPRESSED_TENSORS_FORMAT and "." not in module and renamed != module and "." not in renamed:
            out.setdefault(f"re:^(?:{re.escape(module)}|{re.escape(renamed)})$")
        else:
            out.setdefault(module)
    return list(out) + _sglang_aliases(list(out), kept_modules, converted_modules, architecture, style)


def _sglang_aliases(listed: list[str], kept: list[str], converted: list[str], architecture: str | None,
                    style: str) -> list[str]:
    """SGLang's run-time spelling of the entries ``listed`` where the family's differs (Kimi-K3's
    ``language_model.model.layers.3.block_sparse_moe.gate`` is ``model.layers.3.mlp.gate`` there), so that
    SGLang's lookups find them too.

    An alias must exclude nothing converted in any engine's reading: vLLM's ModelOpt rule takes an entry that
    is a substring of a module's name, so ``model.layers.1*`` would cover ``...model.layers.10...``. An alias
    that could is replaced by the exact aliases of the kept modules it stood for."""
    family = family_of(architecture)
    if style == "deepseek-v4-fp8" or all(family.sglang_name(m) == m for m in kept):
        return []
    targets = converted + [family.sglang_name(c) for c in converted]
    have = set(listed)
    out: dict[str, None] = {}

    def safe(alias: str) -> bool:
        stem = alias.rstrip("*")
        return alias not in have and not any(stem in t for t in targets)

    for entry in listed:
        alias = family.sglang_name(entry)
        if alias == entry or entry.startswith("re:"):
            continue
        if safe(alias):
            out.setdefault(alias)
            continue
        stem = entry.rstrip("*")
        for module in kept:
            exact = family.sglang_name(module)
            if module.startswith(stem) and exact != module and safe(exact):
                out.setdefault(exact)
    return list(out)


def _regex(pattern: str) -> str:
    return re.escape(pattern).replace(r"\*", r"\d+")


def ct_ignore(patterns: list[str]) -> list[str]:
    """compressed-tensors ``ignore`` from glob patterns: exact names as they are, ``*`` patterns as ``re:``."""
    return [p if p.startswith("re:") or "*" not in p else f"re:^{_regex(p)}$" for p in patterns]


def quant_algo(with_input: bool) -> str:
    """ModelOpt's ``quant_algo``: "NVFP4" (W4A4, input scales stored) or "W4A16_NVFP4" (weight-only), as
    ModelOpt writes them; SGLang and TensorRT-LLM run W4A4 for "NVFP4" whatever the config groups say."""
    return "NVFP4" if with_input else "W4A16_NVFP4"


def hf_quant_config(exclude: list[str], with_input: bool = True) -> dict:
    """``hf_quant_config.json`` (ModelOpt): every key present, null ones too (vLLM refuses a missing key).

    ``quant_method: "modelopt"`` at the top: without it vLLM recognises the file as ModelOpt's only when the
    producer is named "modelopt" (transformers_utils/model_arch_config_convertor.py), and the producer stays
    fp4pass's own.
    """
    return {"producer": dict(PRODUCER), "quant_method": "modelopt",
            "quantization": {"quant_algo": quant_algo(with_input), "kv_cache_quant_algo": None,
                             "group_size": GROUP_SIZE, "exclude_modules": list(exclude)}}


def _fp4_args(dynamic) -> dict:
    return {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": GROUP_SIZE,
            "symmetric": True, "dynamic": dynamic, "scale_dtype": "torch.float8_e4m3fn"}


def quantization_config(fmt: str, exclude: list[str], with_input: bool, source_config: dict | None = None) -> dict:
    """config.json's ``quantization_config`` for ``fmt``; weight-only (no input_activations, ModelOpt
    ``W4A16_NVFP4``) without input scales.

    DeepSeek-V4 with its FP8 config (``output_style`` "deepseek-v4-fp8"): the source's FP8 description kept,
    plus ``"moe_quant_algo": "NVFP4"``, the bf16 Linears in ``ignored_layers`` and ``activation_scheme``
    (``"dynamic"`` unless the source gives one; vLLM's Fp8Config refuses a config without it), as vLLM's
    models/deepseek_v4/quant_config.py ``DeepseekV4FP8Config`` reads them. That path is W4A4 only: the experts
    need input scales.
    """
    if output_style(fmt, source_config) == "deepseek-v4-fp8":
        qc = dict(source_quantization_config(source_config))
        ignored = list(qc.get("ignored_layers") or [])
        qc["ignored_layers"] = ignored + [m for m in exclude if m not in ignored]
        qc["moe_quant_algo"] = "NVFP4"
        # fp8.py Fp8Config.from_config requires the key; DeepSeek's FP8 Linears quantize activations per block
        # at run time ("dynamic", what DeepSeek-V4's own config.json says)
        qc.setdefault("activation_scheme", "dynamic")
        return qc
    if fmt == MODELOPT:
        group = {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "float", "group_size": GROUP_SIZE,
                                                     "dynamic": False},
                 "input_activations": ({"num_bits": 4, "type": "float", "group_size": GROUP_SIZE, "dynamic": False}
                                       if with_input else None)}
        return {"quant_method": "modelopt", "quant_algo": quant_algo(with_input), "kv_cache_quant_algo": None,
                "group_size": GROUP_SIZE, "exclude_modules": list(exclude), "ignore": list(exclude),
                "config_groups": {"group_0": group}, "producer": dict(PRODUCER)}
    group = {"targets": ["Linear"], "weights": _fp4_args(False),
             "input_activations": _fp4_args("local") if with_input else None,
             "format": "nvfp4-pack-quantized"}
    return {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
            "config_groups": {"group_0": group}, "ignore": ct_ignore(exclude),
            "quantization_status": "compressed", "kv_cache_scheme": None}


def side_configs(fmt: str, source_config: dict, exclude: list[str], with_input: bool) -> tuple[dict, dict | None]:
    """(config.json, hf_quant_config.json or None) of the output: the source's config.json with its
    ``quantization_config`` replaced, at the top and in a nested ``text_config`` that had one (Kimi-K3: no config
    of the output describes the MXFP4 source; :mod:`fp4pass.checkpoint.configs`); hf_quant_config.json for the ModelOpt form (TensorRT-LLM reads it first),
    none for DeepSeek-V4's FP8 form (the FP8 Linears there are not NVFP4)."""
    config = with_quantization_config(source_config, quantization_config(fmt, exclude, with_input, source_config))
    if output_style(fmt, source_config) != MODELOPT:
        return config, None
    return config, hf_quant_config(exclude, with_input)
