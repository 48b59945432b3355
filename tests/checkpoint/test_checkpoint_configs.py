"""The quantization configs a converted checkpoint carries, read by the engines' own parsers where one exists.

compressed-tensors' ``QuantizationConfig`` (what vLLM and transformers parse ``quantization_config`` with) must
read our compressed-tensors config as its own NVFP4 preset, weights and (with input scales) activations; the
ModelOpt files hold exactly the keys and values vLLM's ``modelopt_fp4`` reads, null ones included.
"""

from __future__ import annotations

import pytest

import fp4pass
from fp4pass.checkpoint import output_forms as forms


@pytest.mark.parametrize("with_input", [False, True])
def test_compressed_tensors_config_is_its_own_nvfp4_preset(with_input):
    ct = pytest.importorskip("compressed_tensors.quantization")
    config = forms.quantization_config(forms.COMPRESSED_TENSORS_FORMAT, ["lm_head", "model.layers.*.mlp.gate"],
                                       with_input)
    # as written (compressed-tensors' parser forgives case; other readers of config.json may not)
    weights = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True,
               "dynamic": False, "scale_dtype": "torch.float8_e4m3fn"}
    assert config["config_groups"]["group_0"]["weights"] == weights
    assert config["config_groups"]["group_0"]["input_activations"] == (
        {**weights, "dynamic": "local"} if with_input else None)
    parsed = ct.QuantizationConfig.model_validate(config)
    preset = ct.preset_name_to_scheme("NVFP4", ["Linear"])
    scheme = parsed.config_groups["group_0"]
    assert scheme.targets == ["Linear"]
    assert scheme.weights.model_dump() == preset.weights.model_dump()
    if with_input:
        mine, theirs = scheme.input_activations.model_dump(), preset.input_activations.model_dump()
        theirs.pop("observer", None), mine.pop("observer", None)  # a calibration-time choice, not a format
        assert mine == theirs
    else:
        assert scheme.input_activations is None
    assert parsed.quant_method == "compressed-tensors" and parsed.format == "nvfp4-pack-quantized"
    assert parsed.quantization_status == "compressed"
    assert parsed.ignore == ["lm_head", r"re:^model\.layers\.\d+\.mlp\.gate$"]


def test_ignore_keeps_exact_names_exact_and_turns_only_patterns_into_regexes():
    assert forms.ct_ignore(["lm_head", "model.embed_tokens", "model.layers.*.mlp.experts.*.gate"]) == \
        ["lm_head", "model.embed_tokens", r"re:^model\.layers\.\d+\.mlp\.experts\.\d+\.gate$"]


@pytest.mark.parametrize("with_input", [False, True])
def test_modelopt_files_hold_every_key_vllm_reads(with_input):
    exclude = ["lm_head", "model.layers.*.mlp.router"]
    producer = {"name": "fp4pass", "version": fp4pass.__version__}
    # quant_method at the top: vLLM recognises hf_quant_config.json alone as ModelOpt's by it (or by a producer
    # named "modelopt"); W4A16_NVFP4 for weight-only: SGLang and TensorRT-LLM run "NVFP4" as W4A4
    algo = "NVFP4" if with_input else "W4A16_NVFP4"
    assert forms.hf_quant_config(exclude, with_input) == {
        "producer": producer, "quant_method": "modelopt",
        "quantization": {"quant_algo": algo, "kv_cache_quant_algo": None, "group_size": 16,
                         "exclude_modules": exclude}}
    fp4 = {"num_bits": 4, "type": "float", "group_size": 16, "dynamic": False}
    assert forms.quantization_config(forms.MODELOPT, exclude, with_input) == {
        "quant_method": "modelopt", "quant_algo": algo, "kv_cache_quant_algo": None, "group_size": 16,
        "exclude_modules": exclude, "ignore": exclude, "producer": producer,
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": fp4,
                                      "input_activations": fp4 if with_input else None}}}
