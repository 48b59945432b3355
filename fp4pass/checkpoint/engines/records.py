"""The serving engines, one record each: what fp4pass knows of how its loader reads an NVFP4 checkpoint.

Per-engine data, not algorithms (ModelOpt's ``ModelSpec`` style): which config file the engine reads first, the
rule it reads each form's exclusion list by (:mod:`fp4pass.checkpoint.engines.rules`), when it runs W4A16
rather than W4A4, which fused modules it builds, what a problem kind makes it do where that differs from the
kind's own outcome (:mod:`fp4pass.checkpoint.validate.kinds`), the forms and families whose loader was not
read, and the fix each verdict names. The engine rules and the validator iterate over :data:`ENGINE_RECORDS`;
adding an engine is adding a record here (and its rules) plus its tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fp4pass.safetensors.catalog import CONFIG_NAME, QUANT_CONFIG_NAME
from fp4pass.checkpoint.engines.rules import (SglangCompressedTensors, SglangModelopt, TrtllmGlobs,
                                              VllmCompressedTensors, VllmModelopt)
from fp4pass.checkpoint.families import family_of

__all__ = ["Engine", "VLLM", "SGLANG", "TRTLLM", "ENGINE_RECORDS", "ENGINES", "engine_record", "MODELOPT_FIELDS"]

#: hf_quant_config.json ``quantization`` fields vLLM's ModelOptNvFp4Config._from_config requires
MODELOPT_FIELDS = ("group_size", "kv_cache_quant_algo", "exclude_modules")


@dataclass(frozen=True)
class Engine:
    """One serving engine.

    - ``reads_first``: the config file whose quantization description it reads when both are there;
      ``needs_producer``: it takes hf_quant_config.json alone only with ``producer.name: modelopt`` or a
      top-level ``quant_method``;
    - ``exclusion_rule``: per form ("modelopt", "compressed-tensors"), the rule class it reads the list by;
    - ``lookup_names``: the :class:`~fp4pass.checkpoint.families.Family` attribute that gives the engine's
      run-time name of a checkpoint module, which its exclusion lookups use (None: the checkpoint's names);
      ``target_names``: the one that gives the names compressed-tensors' config group targets are matched under;
    - ``fused``: the fused modules it builds whatever the architecture (None: the family's, ``vllm_fused``);
    - ``reads_targets``: a compressed-tensors Linear that no config group targets stays unquantized;
    - ``mixed_precision``: its reading of ModelOpt's ``MIXED_PRECISION`` (``quantized_layers``) was read;
    - ``required_fields``: hf_quant_config.json ``quantization`` fields it refuses the file without;
    - ``w4a16_from_groups``: ModelOpt NVFP4 whose every config group has ``input_activations: null`` runs W4A16
      (else only ``quant_algo: W4A16_NVFP4`` does); compressed-tensors is W4A16 without input activations in
      every engine;
    - ``moe_layer_exclusion``: an exclusion entry that matches a MoE layer keeps its experts out of NVFP4;
    - ``not_held_to``: the output forms fp4pass does not write for it (its verdict says why; a problem only when
      it is asked for);
    - ``outcomes``: problem kind -> outcome where it differs from the kind's own;
    - ``why_input_scales``: why W4A4 with some input scales missing fails in it;
    - ``why_gpt_oss_stack``: why it does not load ModelOpt's gpt-oss NVFP4 expert stacks;
    - ``not_claimed``: a form or a family name whose loader in this engine was not read -> its verdict's why
      (``{method}``: the config's quant_method);
    - ``fixes``: a form -> the fix for a checkpoint of that form it does not load.
    """

    name: str
    label: str
    reads_first: str
    exclusion_rule: dict[str, type]
    why_input_scales: str
    why_gpt_oss_stack: str
    needs_producer: bool = False
    lookup_names: str | None = None
    target_names: str | None = None
    fused: dict[str, tuple[str, ...]] | None = None
    reads_targets: bool = True
    mixed_precision: bool = False
    required_fields: tuple[str, ...] = ()
    w4a16_from_groups: bool = False
    moe_layer_exclusion: bool = True
    not_held_to: tuple[str, ...] = ()
    outcomes: dict[str, str] = field(default_factory=dict)
    not_claimed: dict[str, str] = field(default_factory=dict)
    fixes: dict[str, str] = field(default_factory=dict)

    def fused_modules(self, architecture: str | None) -> dict[str, tuple[str, ...]]:
        """The fused modules it builds for ``architecture`` and their checkpoint shards."""
        return dict(family_of(architecture).vllm_fused) if self.fused is None else dict(self.fused)

    def module_name(self, architecture: str | None, attribute: str | None):
        """The renaming of checkpoint module names the family's ``attribute`` gives (identity for None)."""
        return getattr(family_of(architecture), attribute) if attribute else (lambda module: module)


VLLM = Engine(
    name="vllm", label="vLLM", reads_first=CONFIG_NAME, needs_producer=True,
    # modelopt.py ModelOptQuantConfigBase.is_layer_excluded; compressed_tensors/utils.py should_ignore_layer
    exclusion_rule={"modelopt": VllmModelopt, "compressed-tensors": VllmCompressedTensors},
    target_names="vllm_name", mixed_precision=True, required_fields=MODELOPT_FIELDS, w4a16_from_groups=True,
    why_input_scales="W4A4 needs an input_scale per NVFP4 module; the uninitialised ones give NaN (vLLM #45212)",
    why_gpt_oss_stack=(
        "vLLM 0.33 gpt_oss.py hf_to_vllm_mapper has no entry for the *_weight_scale, *_weight_scale_2 and "
        "*_input_scale keys, so _load_weights_other skips them and the scales stay uninitialised, and the "
        "NVFP4 MoE method registers no w13_bias (KeyError on the biases): vLLM #46641, fix PR #46645 open"),
)

SGLANG = Engine(
    name="sglang", label="SGLang", reads_first=CONFIG_NAME,
    # modelopt_quant.py ModelOptQuantConfig._get_quant_method; compressed_tensors.py (vLLM's should_ignore_layer)
    exclusion_rule={"modelopt": SglangModelopt, "compressed-tensors": SglangCompressedTensors},
    lookup_names="sglang_name",
    # SGLang 0.5.23 layers/quantization/utils.py ``_FALLBACK_FUSED_SHARDS``: the fused modules SGLang splits when
    # the quantization config carries no ``packed_modules_mapping`` (ours never does)
    fused={"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")},
    not_held_to=("deepseek-fp8-moe-nvfp4",),
    why_input_scales="SGLang runs W4A4 and defaults a missing input_scale to 1.0, which silently clips "
                     "activations; write quant_algo W4A16_NVFP4 for weight-only",
    why_gpt_oss_stack=(
        "SGLang 0.5.23 models/gpt_oss.py drops the same *_weight_scale_2 / *_input_scale keys and has no "
        "NVFP4 fused-expert mapping (the vLLM #46641 gap)"),
    # SGLang 0.5.23 models/deepseek_v4.py reads no ``moe_quant_algo`` (with ``quant_method: fp8`` its
    # ModelOptFp4Config.from_config builds the online FP8 -> NVFP4 config of nvfp4_online.py, which quantizes at
    # load rather than reading NVFP4 tensors)
    not_claimed={"deepseek-v4": "SGLang 0.5.23 models/deepseek_v4.py has no NVFP4 expert path (no "
                                "moe_quant_algo; quant_method {method} not checked there): not claimed"},
)

TRTLLM = Engine(
    name="trtllm", label="TensorRT-LLM", reads_first=QUANT_CONFIG_NAME,
    # modeling_utils.py QuantConfig.is_module_excluded_from_quantization, whatever the form
    exclusion_rule={"modelopt": TrtllmGlobs, "compressed-tensors": TrtllmGlobs},
    reads_targets=False, moe_layer_exclusion=False,
    not_held_to=("compressed-tensors", "deepseek-fp8-moe-nvfp4"),
    outcomes={"w1_w3_mismatch": "refuses"},  # its fused w13 asserts one scale
    why_input_scales="TensorRT-LLM's NVFP4 linear and MoE load an input_scale per module",
    why_gpt_oss_stack=(
        "TensorRT-LLM _torch/models/modeling_gpt_oss.py load_hf_weights reads a uint8 experts.gate_up_proj "
        "as bf16 weights and passes no *_weight_scale / *_weight_scale_2 / *_input_scale to the MoE"),
    not_claimed={
        "compressed-tensors": "TensorRT-LLM: its compressed-tensors reader (_torch/models/checkpoints/hf/"
                              "compressed_tensors.py) was not checked for NVFP4, and its exclusions match "
                              "with fnmatch only, never re: (modeling_utils.py QuantConfig."
                              "is_module_excluded_from_quantization): not claimed; write --format modelopt",
        "deepseek-v4": "TensorRT-LLM's DeepSeek-V4 loader (_torch/models/modeling_deepseekv4.py) was not "
                       "checked for NVFP4 experts: not claimed"},
    fixes={"compressed-tensors": "for TensorRT-LLM write the modelopt form (fp4pass convert SRC -o OUT --format "
                                 "modelopt)"},
)

ENGINE_RECORDS: tuple[Engine, ...] = (VLLM, SGLANG, TRTLLM)
ENGINES = tuple(e.name for e in ENGINE_RECORDS)
_BY_NAME = {e.name: e for e in ENGINE_RECORDS}


def engine_record(name: str) -> Engine:
    """The record of the engine ``name``; ValueError naming the choices for another."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown engine {name!r}; choose one of {', '.join(ENGINES)}") from None
