"""fp4pass.checkpoint.output_forms' exclude list and compressed-tensors ``ignore`` on names the bundled examples
lack: a kept module under a top-level module that holds nothing converted, and a ``re:`` pattern that holds a
``*``. Expected values are written out by hand from the rules of docs/checkpoint.md."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import fp4pass.checkpoint
from fp4pass.checkpoint import output_forms as forms

sys.path.insert(0, str(Path(__file__).parents[1]))
from checkpoint_oracles import Folder, as_bytes
from vllm_probe import vllm_path


def test_a_kept_module_is_excluded_under_its_shallowest_ancestor_without_converted_modules():
    kept = ["vision_tower.blocks.0.attn", "model.layers.0.self_attn.q_proj", "lm_head"]
    converted = ["model.layers.0.mlp.experts.0.w1"]
    assert forms.exclude_list(kept, converted) == ["vision_tower*", "model.layers.0.self_attn*", "lm_head"]


def test_ct_ignore_leaves_a_regex_holding_a_star_as_it_is():
    pattern = r"re:^model\.layers\..*\.gate$"
    out = forms.ct_ignore([pattern, "model.layers.*.mlp.gate"])
    assert out[0] == pattern
    assert re.fullmatch(out[1][3:], "model.layers.12.mlp.gate") and not re.fullmatch(out[1][3:], "model.layers.x.mlp.gate")


# -- DeepSeek-V4's FP8 form: the Linears holding their own FP8 scale stay FP8 -----------------------------------

DSV4_FP8 = {"architectures": ["DeepseekV4ForCausalLM"],
            "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                    "weight_block_size": [128, 128]}}
# an FP8 Linear with DeepSeek-V4's ``.scale`` first (a skip must not end the list), one with DeepSeek-V3's
# ``.weight_scale_inv``, then bf16 modules (no scale of their own) and the top-level ones vLLM renames
FP8_KEPT = ["layers.0.attn.wq_a", "embed", "layers.0.attn.wkv", "layers.0.ffn.shared_experts.w1", "head"]
FP8_NAMES = {"layers.0.attn.wq_a.weight", "layers.0.attn.wq_a.scale", "embed.weight", "layers.0.attn.wkv.weight",
             "layers.0.attn.wkv.weight_scale_inv", "layers.0.ffn.shared_experts.w1.weight", "head.weight"}
CONVERTED = ["layers.0.ffn.experts.0.w1"]


def test_deepseek_v4_fp8_form_lists_only_the_modules_without_their_own_fp8_scale():
    """vLLM's Fp8Config makes a module in ``ignored_layers`` an unquantized Linear (exact names,
    quant_utils.py ``is_layer_skipped``): an FP8 module listed there could not take its FP8 weight and scale."""
    got = forms.exclude_list(FP8_KEPT, CONVERTED, forms.MODELOPT, DSV4_FP8, FP8_NAMES)
    assert got == ["embed", "layers.0.ffn.shared_experts.w1", "head"]
    # one scale of either name is enough
    only_one = FP8_NAMES - {"layers.0.attn.wkv.weight_scale_inv"} | {"layers.0.attn.wkv.scale"}
    assert forms.exclude_list(FP8_KEPT, CONVERTED, forms.MODELOPT, DSV4_FP8, only_one) == got
    # without the tensor names nothing tells an FP8 module from a bf16 one: every kept module is listed
    assert forms.exclude_list(FP8_KEPT, CONVERTED, forms.MODELOPT, DSV4_FP8) == FP8_KEPT


def test_only_the_deepseek_v4_fp8_form_skips_modules_with_a_scale():
    """compressed-tensors' ``ignore`` of the same source lists every kept module (the whole config is NVFP4
    there); ``head`` as a ``re:`` matching vLLM's ``lm_head`` too; ModelOpt's own form, prefix wildcards."""
    ct = forms.exclude_list(FP8_KEPT, CONVERTED, forms.COMPRESSED_TENSORS_FORMAT, DSV4_FP8, FP8_NAMES)
    assert ct == ["layers.0.attn.wq_a", "embed", "layers.0.attn.wkv", "layers.0.ffn.shared_experts.w1",
                  "re:^(?:head|lm_head)$"]
    bf16_source = {**DSV4_FP8, "quantization_config": {"quant_method": "compressed-tensors"}}
    assert forms.output_style(forms.MODELOPT, bf16_source) == forms.MODELOPT
    assert forms.exclude_list(FP8_KEPT, CONVERTED, forms.MODELOPT, bf16_source, FP8_NAMES) == [
        "layers.0.attn*", "embed", "layers.0.ffn.shared_experts*", "head"]


def _deepseek_v4_with_fp8_linears(folder: Path) -> dict:
    """A DeepSeek-V4 checkpoint as released: MXFP4 routed experts, FP8 attention Linears holding their own
    scale (``wq``: E8M0 ``.scale`` per 128x128 block; ``wkv``: a float32 ``.weight_scale_inv``, DeepSeek-V3's
    name), bf16 elsewhere. Returns the FP8 tensors as written."""
    import torch
    from safetensors.torch import load_file, save_file

    from fp4pass.examples.checkpoints import build_checkpoint

    build_checkpoint(folder, "deepseek", layers=1, experts=2, hidden=64, intermediate=32, seed=5, tokenizer=False)
    tensors = load_file(folder / "model.safetensors")
    g = torch.Generator().manual_seed(1)
    fp8 = {"layers.0.attn.wq.weight": torch.randn(64, 64, generator=g).to(torch.float8_e4m3fn),
           "layers.0.attn.wq.scale": torch.full((1, 1), 2.0**-3).to(torch.float8_e8m0fnu),
           "layers.0.attn.wkv.weight": torch.randn(64, 64, generator=g).to(torch.float8_e4m3fn),
           "layers.0.attn.wkv.weight_scale_inv": torch.full((1, 1), 0.75)}
    tensors.update(fp8)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return fp8


def test_a_converted_deepseek_v4_keeps_its_fp8_linears_fp8(tmp_path):
    """config.json (read as JSON) lists the bf16 modules in ``ignored_layers`` and not the FP8 ones, whose
    tensors are copied byte for byte (read back with the safetensors package)."""
    fp8 = _deepseek_v4_with_fp8_linears(tmp_path / "src")
    fp4pass.checkpoint.convert(tmp_path / "src", tmp_path / "out", input_scale=0.0123)
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert not (tmp_path / "out" / "hf_quant_config.json").exists()
    assert qc["moe_quant_algo"] == "NVFP4" and qc["quant_method"] == "fp8"
    ignored = qc["ignored_layers"]
    assert "layers.0.attn.wq" not in ignored and "layers.0.attn.wkv" not in ignored
    assert {"head", "embed", "layers.0.attn.wo", "layers.0.ffn.gate", "layers.0.ffn.shared_experts.w1",
            "layers.0.ffn.shared_experts.w2", "layers.0.ffn.shared_experts.w3"} <= set(ignored)
    assert not any(".experts." in m and ".shared_experts." not in m for m in ignored)
    out = Folder(tmp_path / "out")
    for name, tensor in fp8.items():
        assert (as_bytes(out.get(name)) == as_bytes(tensor)).all() and out.get(name).dtype == tensor.dtype, name


@pytest.mark.engines
@pytest.mark.slow
def test_vllm_keeps_the_fp8_linears_fp8_and_the_bf16_ones_unquantized(tmp_path):
    """vLLM 0.33.0's own DeepseekV4FP8Config and ``is_layer_skipped`` (tests/vllm_probe.py) on the folder."""
    if not vllm_path():
        pytest.skip("the unpacked vLLM 0.33.0 wheel is absent (~/.cache/fp4pass-test; bash .ci/install fetches it)")
    _deepseek_v4_with_fp8_linears(tmp_path / "src")
    fp4pass.checkpoint.convert(tmp_path / "src", tmp_path / "out", input_scale=0.0123)
    proc = subprocess.run([sys.executable, str(Path(__file__).parents[1] / "vllm_probe.py"), str(tmp_path / "out")],
                          check=False, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])[str(tmp_path / "out")]
    assert result["quant_method"] == "deepseek_v4_fp8" and result["moe_quant_algo"] == "NVFP4", result
    excluded = {row["name"]: row["excluded"] for row in result["modules"]}
    assert excluded["model.layers.0.attn.wq"] is False and excluded["model.layers.0.attn.wkv"] is False
    assert all(excluded[m] is True for m in ("lm_head", "model.layers.0.attn.wo", "model.layers.0.ffn.gate",
                                             "model.layers.0.ffn.shared_experts.gate_up_proj",
                                             "model.layers.0.ffn.shared_experts.down_proj")), excluded
    assert [m["excluded"] for m in result["moe"]] == [False]
