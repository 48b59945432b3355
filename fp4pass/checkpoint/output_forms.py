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

from fp4pass.checkpoint.detect import FusedExperts, Linear
from fp4pass.checkpoint.safetensors_io import OutputSpec

__all__ = ["MODELOPT", "COMPRESSED_TENSORS_FORMAT", "FORMATS", "linear_specs", "fused_specs", "exclude_list",
           "hf_quant_config", "quantization_config", "PRODUCER"]

MODELOPT, COMPRESSED_TENSORS_FORMAT = "modelopt", "compressed-tensors"
FORMATS = (MODELOPT, COMPRESSED_TENSORS_FORMAT)


def _version() -> str:
    try:
        return metadata.version("fp4pass")
    except metadata.PackageNotFoundError:
        return "unknown"


PRODUCER = {"name": "fp4pass", "version": _version()}
GROUP_SIZE = 16


def linear_specs(lin: Linear, fmt: str, with_input: bool) -> list[OutputSpec]:
    """The output tensors of one converted Linear, in writing order."""
    m, n, k = lin.module, lin.rows, lin.cols
    if fmt == MODELOPT:
        specs = [OutputSpec(f"{m}.weight", "U8", (n, k // 2)), OutputSpec(f"{m}.weight_scale", "F8_E4M3", (n, k // 16)),
                 OutputSpec(f"{m}.weight_scale_2", "F32", ())]
        return specs + ([OutputSpec(f"{m}.input_scale", "F32", ())] if with_input else [])
    specs = [OutputSpec(f"{m}.weight_packed", "U8", (n, k // 2)),
             OutputSpec(f"{m}.weight_scale", "F8_E4M3", (n, k // 16)),
             OutputSpec(f"{m}.weight_global_scale", "F32", (1,))]
    return specs + ([OutputSpec(f"{m}.input_global_scale", "F32", (1,))] if with_input else [])


def fused_specs(unit: FusedExperts, with_input: bool) -> list[OutputSpec]:
    """The output tensors of a gpt-oss expert stack (ModelOpt only)."""
    p, e, n, k = unit.name, unit.experts, unit.rows, unit.cols
    specs = [OutputSpec(p, "U8", (e, k // 2, n)), OutputSpec(f"{p}_weight_scale", "F8_E4M3", (e, k // 16, n)),
             OutputSpec(f"{p}_weight_scale_2", "F32", ())]
    return specs + ([OutputSpec(f"{p}_input_scale", "F32", ())] if with_input else [])


def _glob(name: str) -> str:
    return re.sub(r"(?<=\.)\d+(?=\.|$)", "*", name)


def exclude_list(kept_modules: list[str], converted_modules: list[str]) -> list[str]:
    """Modules left in their own precision (lm_head, embeddings, routers, norms, attention, ...), compacted.

    Layer and expert indices become ``*`` where the pattern then covers no converted module; else the name is
    listed as it is. Glob patterns, as ModelOpt writes them; compressed-tensors takes the ``re:`` form.
    """
    # a pattern (indices as *) matches a module exactly when the module's own pattern is that pattern, so one
    # set of the converted modules' patterns decides: linear in the number of modules
    converted_globs = {_glob(m) for m in converted_modules}
    out: dict[str, None] = {}
    for module in kept_modules:
        pattern = _glob(module)
        out.setdefault(pattern if pattern != module and pattern not in converted_globs else module)
    return list(out)


def _regex(pattern: str) -> str:
    return re.escape(pattern).replace(r"\*", r"\d+")


def ct_ignore(patterns: list[str]) -> list[str]:
    """compressed-tensors ``ignore``: exact names as they are, ``*`` patterns as ``re:`` regexes."""
    return [f"re:^{_regex(p)}$" if "*" in p else p for p in patterns]


def hf_quant_config(exclude: list[str]) -> dict:
    """``hf_quant_config.json`` (ModelOpt): every key present, null ones too (vLLM refuses a missing key)."""
    return {"producer": dict(PRODUCER),
            "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": GROUP_SIZE,
                             "exclude_modules": list(exclude)}}


def _fp4_args(dynamic) -> dict:
    return {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": GROUP_SIZE,
            "symmetric": True, "dynamic": dynamic, "scale_dtype": "torch.float8_e4m3fn"}


def quantization_config(fmt: str, exclude: list[str], with_input: bool) -> dict:
    """config.json's ``quantization_config`` for ``fmt``; weight-only (no input_activations) without input scales."""
    if fmt == MODELOPT:
        group = {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "float", "group_size": GROUP_SIZE,
                                                     "dynamic": False},
                 "input_activations": ({"num_bits": 4, "type": "float", "group_size": GROUP_SIZE, "dynamic": False}
                                       if with_input else None)}
        return {"quant_method": "modelopt", "quant_algo": "NVFP4", "kv_cache_quant_algo": None,
                "group_size": GROUP_SIZE, "exclude_modules": list(exclude), "ignore": list(exclude),
                "config_groups": {"group_0": group}, "producer": dict(PRODUCER)}
    group = {"targets": ["Linear"], "weights": _fp4_args(False),
             "input_activations": _fp4_args("local") if with_input else None,
             "format": "nvfp4-pack-quantized"}
    return {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
            "config_groups": {"group_0": group}, "ignore": ct_ignore(exclude),
            "quantization_status": "compressed", "kv_cache_scheme": None}
