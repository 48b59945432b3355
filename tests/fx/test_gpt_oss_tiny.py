"""The tiny gpt-oss example: reproducible from its seed, laid out like a released MXFP4 checkpoint."""

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

import torch  # noqa: E402
from conversion_oracle import spread, unpack  # noqa: E402
from fp4pass.examples.gpt_oss_tiny import LOSSY, TINY_CONFIG, build_tiny_gpt_oss  # noqa: E402

COMMITTED = Path(__file__).resolve().parents[2] / "models" / "tiny_gpt_oss"


def test_committed_checkpoint_is_what_the_builder_writes(tmp_path):
    built = build_tiny_gpt_oss(tmp_path / "tiny", seed=0)
    assert (built / "model.safetensors").read_bytes() == (COMMITTED / "model.safetensors").read_bytes()
    ours, committed = (json.loads((d / "config.json").read_text()) for d in (built, COMMITTED))
    for key in (*TINY_CONFIG, "quantization_config", "model_type"):  # other fields follow transformers' version
        assert ours[key] == committed[key], key
    other = build_tiny_gpt_oss(tmp_path / "seed1", seed=1)
    assert (other / "model.safetensors").read_bytes() != (built / "model.safetensors").read_bytes()


def test_layout_and_config_are_those_of_an_mxfp4_gpt_oss_checkpoint():
    config = json.loads((COMMITTED / "config.json").read_text())
    assert config["model_type"] == "gpt_oss" and config["quantization_config"]["quant_method"] == "mxfp4"
    assert config["architectures"] == ["GptOssForCausalLM"]
    tensors = safetensors_torch.load_file(str(COMMITTED / "model.safetensors"))
    e, h, i = TINY_CONFIG["num_local_experts"], TINY_CONFIG["hidden_size"], TINY_CONFIG["intermediate_size"]
    for n in range(TINY_CONFIG["num_hidden_layers"]):
        p = f"model.layers.{n}.mlp.experts."
        assert tensors[p + "gate_up_proj_blocks"].shape == (e, 2 * i, h // 32, 16)
        assert tensors[p + "gate_up_proj_scales"].shape == (e, 2 * i, h // 32)
        assert tensors[p + "down_proj_blocks"].shape == (e, h, i // 32, 16)
        assert tensors[p + "gate_up_proj_bias"].shape == (e, 2 * i)
        assert tensors[p + "gate_up_proj_blocks"].dtype == torch.uint8
        assert f"model.layers.{n}.self_attn.sinks" in tensors
    assert tensors["model.embed_tokens.weight"].dtype == torch.bfloat16


def test_exactly_one_expert_has_an_exponent_spread_past_17():
    tensors = safetensors_torch.load_file(str(COMMITTED / "model.safetensors"))
    wide = []
    for name, blocks in tensors.items():
        if not name.endswith("_blocks"):
            continue
        b = blocks.numpy()
        codes, scales = unpack(b.reshape(*b.shape[:-2], -1)), tensors[name.replace("_blocks", "_scales")].numpy()
        wide += [(name, e) for e in range(codes.shape[0]) if spread(codes[e], scales[e]) > 17]
    assert wide == [(f"model.layers.{LOSSY['layer']}.mlp.experts.gate_up_proj_blocks", LOSSY["expert"])]
