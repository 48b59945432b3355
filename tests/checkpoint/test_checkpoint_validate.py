"""``fp4pass inspect NVFP4_DIR``: fp4pass.checkpoint.validate against NVFP4 checkpoints it did not write.

The fixtures under tests/fixtures/nvfp4_thirdparty/ were written by ModelOpt 0.47 and llm-compressor 0.14 (MAKE.md
there). Each test copies one, plants one defect with the safetensors package and plain JSON (the defect's values
computed here from the file, not by the validator), and asserts the validator names it, with the module or tensor;
the unmodified copy is the baseline that must not show that problem. The good ones (the fixtures as made, and
fp4pass's own outputs of models/checkpoints/*) must give no problem but the engine verdicts' own.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from fp4pass.checkpoint.validate import BLOCK_SAMPLE_BYTES, KINDS, validate
from cli_helpers import cli

FIXTURES = Path(__file__).parents[1] / "fixtures" / "nvfp4_thirdparty"
MODELOPT_MOE = FIXTURES / "modelopt_qwen3_moe"
MODELOPT_GPT_OSS = FIXTURES / "modelopt_gpt_oss"
LLMC_MOE = FIXTURES / "llmcompressor_qwen3_moe"
ALL = (MODELOPT_MOE, MODELOPT_GPT_OSS, LLMC_MOE)
E0 = "model.layers.0.mlp.experts.0"
E1 = "model.layers.0.mlp.experts.1"


def _copy(src: Path, tmp_path: Path) -> Path:
    out = tmp_path / src.name
    shutil.copytree(src, out)
    return out


def _edit_tensors(folder: Path, edit) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def _edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data, indent=2))


def _kinds(result: dict) -> set[str]:
    return {p["kind"] for p in result["problems"]}


def _named(result: dict, kind: str) -> list[dict]:
    return [p for p in result["problems"] if p["kind"] == kind]


def _f32(value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32)


# ------------------------------------------------------------------------------------------ the good ones

def _engine_findings_only(result: dict, folder: Path) -> None:
    """Every problem is an engine's verdict that it cannot load the form; every such verdict of an engine the
    form is written for is a problem (compressed-tensors is not written for TensorRT-LLM; DeepSeek-V4's NVFP4
    path was read in vLLM only)."""
    refused = {name for name, v in result["engines"].items() if not v["loads"]}
    # a problem the verdicts already give as an engine's reason (DeepSeek-V4's moe_quant_algo path is W4A4 only)
    others = [p for p in result["problems"] if p["kind"] != "engine_cannot_load"
              and not (p.get("engines") and set(p["engines"]) <= refused)]
    assert not others, others
    if result["form"] == "compressed-tensors":
        refused.discard("trtllm")
    if json.loads((folder / "config.json").read_text())["architectures"] == ["DeepseekV4ForCausalLM"]:
        refused &= {"vllm"}
    assert refused == {e for p in result["problems"] for e in p["engines"]}


@pytest.mark.parametrize("fixture", ALL, ids=lambda p: p.name)
def test_fixture_as_made_matches_its_committed_output(fixture):
    """The validator's --json output on each fixture is the one committed beside it (MAKE.md's command)."""
    result = validate(fixture)
    committed = json.loads((fixture.parent / f"{fixture.name}.inspect.json").read_text())
    for r in (result, committed):  # the engine rules' wording may be reworded; their verdicts may not change
        r["source"] = None
        for verdict in r["engines"].values():
            verdict.pop("why")
        for p in r["problems"]:
            if p["kind"] == "engine_cannot_load":
                p.pop("message")
    assert result == committed
    _engine_findings_only(result, fixture)


def test_fixtures_forms_and_modules():
    """Forms and module lists read from the files by safetensors, not by the validator."""
    for folder, form, layouts in ((MODELOPT_MOE, "modelopt", ["linear"]),
                                  (MODELOPT_GPT_OSS, "modelopt", ["fused-experts", "linear"]),
                                  (LLMC_MOE, "compressed-tensors", ["linear"])):
        names = load_file(folder / "model.safetensors").keys()
        scale_2 = {n.rpartition(".")[0] for n in names if n.endswith((".weight_scale_2", ".weight_global_scale"))}
        fused = {n[: -len("_weight_scale_2")] for n in names if n.endswith("_weight_scale_2")}
        result = validate(folder)
        assert result["form"] == form and result["layouts"] == layouts
        assert {m["module"] for m in result["modules"]} == scale_2 | fused
        assert scale_2 | fused


def test_modelopt_gpt_oss_export_is_refused_by_vllm_and_sglang():
    """A finding on ModelOpt's own export: its gpt-oss fused scale keys are what vLLM 0.33 and SGLang drop
    (vLLM #46641); TensorRT-LLM's verdict is its own."""
    result = validate(MODELOPT_GPT_OSS)
    assert result["engines"]["vllm"]["loads"] is False and "46641" in result["engines"]["vllm"]["why"]
    assert result["engines"]["sglang"]["loads"] is False
    assert sorted(e for p in _named(result, "engine_cannot_load") for e in p["engines"]) == sorted(
        name for name, v in result["engines"].items() if not v["loads"])


# ------------------------------------------------------------------------------------- planted defects

def test_zero_input_scale_of_one_expert(tmp_path):
    folder = _copy(MODELOPT_MOE, tmp_path)
    assert "zero_scale" not in _kinds(validate(folder))
    _edit_tensors(folder, lambda t: t.__setitem__(f"{E1}.down_proj.input_scale", _f32(0.0)))
    [p] = _named(validate(folder), "zero_scale")
    assert p["tensor"] == f"{E1}.down_proj.input_scale" and p["module"] == f"{E1}.down_proj"
    assert "45212" in p["message"] and "fix:" in p["message"]


@pytest.mark.parametrize("value,kind", [(float("nan"), "nonfinite_scale"), (float("inf"), "nonfinite_scale"),
                                        (-3.0e-5, "negative_scale"), (0.0, "zero_scale")])
def test_bad_weight_global_scale(tmp_path, value, kind):
    folder = _copy(MODELOPT_MOE, tmp_path)
    tensor = f"{E0}.down_proj.weight_scale_2"
    _edit_tensors(folder, lambda t: t.__setitem__(tensor, _f32(value)))
    found = _named(validate(folder), kind)
    assert [p["tensor"] for p in found] == [tensor]


def test_bad_compressed_tensors_divisor(tmp_path):
    folder = _copy(LLMC_MOE, tmp_path)
    tensor = f"{E1}.up_proj.input_global_scale"
    _edit_tensors(folder, lambda t: t.__setitem__(tensor, torch.tensor([float("nan")])))
    assert [p["tensor"] for p in _named(validate(folder), "nonfinite_scale")] == [tensor]


@pytest.mark.parametrize("value,kind", [(float("nan"), "nonfinite_scale"), (-1.0, "negative_scale")])
def test_bad_block_scale(tmp_path, value, kind):
    folder = _copy(MODELOPT_MOE, tmp_path)
    tensor = f"{E0}.gate_proj.weight_scale"

    def edit(t):
        scales = t[tensor].float()
        scales[3, 1] = value  # E4M3FN NaN is 0x7F; -1.0 is 0xB8
        t[tensor] = scales.to(torch.float8_e4m3fn)

    _edit_tensors(folder, edit)
    result = validate(folder)
    assert [p["tensor"] for p in _named(result, kind)] == [tensor]
    assert {"nonfinite_scale", "negative_scale"} - {kind} - _kinds(result)


@pytest.mark.parametrize("tensor, kind", [(f"{E0}.down_proj.weight_global_scale", "missing_scale"),
                                          (f"{E1}.down_proj.weight_packed", "missing_tensor")])
def test_a_dropped_tensor_is_named(tmp_path, tensor, kind):
    folder = _copy(LLMC_MOE, tmp_path)
    _edit_tensors(folder, lambda t: t.pop(tensor))
    assert [p["tensor"] for p in _named(validate(folder), kind)] == [tensor]


def test_input_scale_missing_for_some_experts(tmp_path):
    """Experts calibration never reached: some experts of a layer have no input_scale (vLLM #45212)."""
    folder = _copy(MODELOPT_MOE, tmp_path)
    dropped = [f"model.layers.1.mlp.experts.{e}.down_proj.input_scale" for e in (1, 3)]
    _edit_tensors(folder, lambda t: [t.pop(n) for n in dropped])
    result = validate(folder)
    [p] = _named(result, "scale_missing_some_experts")
    assert p["tensor"] in dropped and "2 of 4" in p["message"] and "model.layers.1.mlp.experts.*.down_proj" in \
        p["message"]
    assert "missing_scale" not in _kinds(result)


def test_no_input_scales_while_config_says_w4a4(tmp_path):
    folder = _copy(MODELOPT_MOE, tmp_path)
    _edit_tensors(folder, lambda t: [t.pop(n) for n in list(t) if n.endswith(".input_scale")])
    [p] = _named(validate(folder), "missing_scale")
    assert set(p["engines"]) >= {"sglang", "trtllm"} and "W4A16_NVFP4" in p["message"]
    # declared weight-only, the same tensors are fine
    for name in ("hf_quant_config.json",):
        _edit_json(folder / name, lambda d: d["quantization"].__setitem__("quant_algo", "W4A16_NVFP4"))
    _edit_json(folder / "config.json", lambda d: d["quantization_config"].__setitem__("quant_algo", "W4A16_NVFP4"))
    assert "missing_scale" not in _kinds(validate(folder))


@pytest.mark.parametrize("which", ["weight_scale_2", "input_scale"])
def test_w1_w3_mismatch(tmp_path, which):
    folder = _copy(MODELOPT_MOE, tmp_path)
    tensor = f"{E1}.up_proj.{which}"
    _edit_tensors(folder, lambda t: t.__setitem__(tensor, t[tensor] * 1.5))
    [p] = _named(validate(folder), "w1_w3_mismatch")
    assert p["module"] == f"{E1}.up_proj" and p["tensor"] == tensor
    assert "w1_w3_mismatch" not in _kinds(validate(MODELOPT_MOE))


def test_w1_w3_mismatch_compressed_tensors(tmp_path):
    folder = _copy(LLMC_MOE, tmp_path)
    tensor = "model.layers.1.mlp.experts.2.up_proj.weight_global_scale"
    _edit_tensors(folder, lambda t: t.__setitem__(tensor, t[tensor] * 0.75))
    assert [p["tensor"] for p in _named(validate(folder), "w1_w3_mismatch")] == [tensor]


@pytest.mark.parametrize("fixture,tensor", [
    (MODELOPT_MOE, f"{E0}.down_proj.weight_scale_2"),  # ModelOpt: a multiplier; the divisor stored
    (LLMC_MOE, f"{E0}.down_proj.weight_global_scale"),  # compressed-tensors: a divisor; the multiplier stored
    (MODELOPT_GPT_OSS, "model.layers.1.mlp.experts.gate_up_proj_weight_scale_2"),
    (MODELOPT_MOE, f"{E1}.gate_proj.input_scale"),
    (LLMC_MOE, "model.layers.0.self_attn.o_proj.input_global_scale"),
])
def test_reciprocal_stored(tmp_path, fixture, tensor):
    folder = _copy(fixture, tmp_path)
    stored = float(load_file(fixture / "model.safetensors")[tensor].reshape(-1)[0])
    _edit_tensors(folder, lambda t: t.__setitem__(tensor, (1.0 / t[tensor].double()).float()))
    found = _named(validate(folder), "scale_convention")
    assert [p["tensor"] for p in found] == [tensor]
    assert f"{stored:.6g}" in found[0]["message"]  # the fix: the reciprocal of what is now stored


def test_global_scale_folded_into_e4m3(tmp_path):
    """weight_scale = e4m3(weight_scale x weight_scale_2), weight_scale_2 = 1 (ml_dtypes does the cast)."""
    folder = _copy(MODELOPT_MOE, tmp_path)
    module = f"{E0}.gate_proj"

    def edit(t):
        block = t[f"{module}.weight_scale"].float().numpy() * float(t[f"{module}.weight_scale_2"])
        folded = block.astype(ml_dtypes.float8_e4m3fn)
        assert (folded.astype(np.float32) < 2.0 ** -6).mean() > 0.5  # most blocks land in the subnormals
        t[f"{module}.weight_scale"] = torch.from_numpy(folded.view(np.uint8)).view(torch.float8_e4m3fn)
        t[f"{module}.weight_scale_2"] = _f32(1.0)

    _edit_tensors(folder, edit)
    result = validate(folder)
    assert [p["module"] for p in _named(result, "folded_global_scale")] == [module]
    assert "scale_convention" not in _kinds(result)


def test_compressed_tensors_global_scale_folded(tmp_path):
    folder = _copy(LLMC_MOE, tmp_path)
    module = "model.layers.1.self_attn.o_proj"

    def edit(t):
        block = t[f"{module}.weight_scale"].float().numpy() / float(t[f"{module}.weight_global_scale"])
        t[f"{module}.weight_scale"] = torch.from_numpy(
            block.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)).view(torch.float8_e4m3fn)
        t[f"{module}.weight_global_scale"] = torch.tensor([1.0])

    _edit_tensors(folder, edit)
    assert [p["module"] for p in _named(validate(folder), "folded_global_scale")] == [module]


def _set_exclusions(folder: Path, replace) -> None:
    quant = "quantization"
    _edit_json(folder / "hf_quant_config.json",
               lambda d: d[quant].__setitem__("exclude_modules", replace(d[quant]["exclude_modules"])))
    _edit_json(folder / "config.json",
               lambda d: d["quantization_config"].__setitem__("ignore", replace(d["quantization_config"]["ignore"])))


def test_bf16_attention_left_out_of_the_exclusions(tmp_path):
    folder = _copy(MODELOPT_MOE, tmp_path)
    _set_exclusions(folder, lambda ex: [e for e in ex if e != "model.layers.1.self_attn*"])
    found = _named(validate(folder), "unexcluded_linear")
    assert {p["module"] for p in found} == {f"model.layers.1.self_attn.{p}_proj" for p in "qkvo"}
    assert all(set(p["engines"]) == {"vllm", "sglang", "trtllm"} for p in found)


def test_fused_qkv_missed_by_index_wildcards(tmp_path):
    """``*`` for the layer index matches q_proj but not the fused qkv_proj vLLM and SGLang build; the exact
    names of every shard (what ModelOpt writes, or a prefix wildcard) exclude it."""
    folder = _copy(MODELOPT_MOE, tmp_path)
    globs = [f"model.layers.*.self_attn.{p}_proj" for p in "qkvo"]
    _set_exclusions(folder, lambda ex: [e for e in ex if "self_attn" not in e] + globs)
    result = validate(folder)
    found = _named(result, "unexcluded_linear")
    assert {p["module"] for p in found} == {f"model.layers.{i}.self_attn.{p}_proj" for i in (0, 1) for p in "qkv"}
    assert all({"vllm", "sglang"} <= set(p["engines"]) for p in found)
    assert result["engines"]["vllm"]["loads"] is False and result["engines"]["sglang"]["loads"] is False
    assert [p["module"] for p in _named(validate(folder, engine="vllm"), "unexcluded_linear")]
    exact = [f"model.layers.{i}.self_attn.{p}_proj" for i in (0, 1) for p in "qkvo"]
    _set_exclusions(folder, lambda ex: [e for e in ex if "self_attn" not in e] + exact)
    assert not _named(validate(folder, engine="vllm"), "unexcluded_linear")
    assert not _named(validate(folder, engine="sglang"), "unexcluded_linear")


def test_compressed_tensors_unignored_lm_head_and_router(tmp_path):
    """lm_head and the router (vLLM's Qwen3-MoE GateLinear takes the quant config) are Linears to exclude."""
    folder = _copy(LLMC_MOE, tmp_path)
    dropped = {"lm_head", "model.layers.0.mlp.gate"}
    _edit_json(folder / "config.json", lambda d: d["quantization_config"].__setitem__(
        "ignore", [e for e in d["quantization_config"]["ignore"] if e not in dropped]))
    assert {p["module"] for p in _named(validate(folder), "unexcluded_linear")} == dropped


@pytest.mark.parametrize("target,kind", [("lm_head", "quantized_lm_head"),
                                         ("model.layers.0.mlp.gate", "quantized_router")])
def test_quantized_lm_head_or_router(tmp_path, target, kind):
    folder = _copy(MODELOPT_MOE, tmp_path)
    source = f"{E0}.down_proj"

    def edit(t):
        t.pop(f"{target}.weight")
        for suffix in ("weight", "weight_scale", "weight_scale_2", "input_scale"):
            t[f"{target}.{suffix}"] = t[f"{source}.{suffix}"].clone()

    _edit_tensors(folder, edit)
    _set_exclusions(folder, lambda ex: [e for e in ex if e != target])
    assert [p["module"] for p in _named(validate(folder), kind)] == [target]


@pytest.mark.parametrize("tensor,change", [
    (f"{E0}.gate_proj.weight_scale", lambda x: x[:, :3].contiguous()),  # [N, K/16 - 1]
    (f"{E0}.gate_proj.weight_scale", lambda x: x.view(torch.uint8)),  # an E8M0-like byte, not E4M3
    (f"{E0}.gate_proj.weight", lambda x: x.view(torch.int8)),
    (f"{E0}.gate_proj.weight_scale_2", lambda x: torch.stack([x, x])),
    ("model.layers.0.mlp.experts.down_proj_weight_scale", lambda x: x[:, :, :32].contiguous()),
])
def test_dtypes_and_shapes_that_do_not_fit(tmp_path, tensor, change):
    fixture = MODELOPT_GPT_OSS if "experts.down_proj" in tensor else MODELOPT_MOE
    folder = _copy(fixture, tmp_path)
    _edit_tensors(folder, lambda t: t.__setitem__(tensor, change(t[tensor])))
    result = validate(folder)
    assert [p["tensor"] for p in _named(result, "dtype_shape")] == [tensor]
    assert "dtype_shape" not in _kinds(validate(fixture))


@pytest.mark.parametrize("key", ["group_size", "kv_cache_quant_algo", "exclude_modules"])
def test_hf_quant_config_field_missing(tmp_path, key):
    folder = _copy(MODELOPT_MOE, tmp_path)
    _edit_json(folder / "hf_quant_config.json", lambda d: d["quantization"].pop(key))
    found = _named(validate(folder), "missing_config_field")
    assert len(found) == 1 and f"quantization.{key}" in found[0]["message"]
    assert "trtllm" in found[0]["engines"]


def test_hf_quant_config_alone_missing_field_concerns_vllm(tmp_path):
    """Without config.json's quantization_config, vLLM reads hf_quant_config.json and refuses a missing field."""
    folder = _copy(MODELOPT_MOE, tmp_path)
    _edit_json(folder / "config.json", lambda d: d.pop("quantization_config"))
    assert not _kinds(validate(folder))
    _edit_json(folder / "hf_quant_config.json", lambda d: d["quantization"].pop("kv_cache_quant_algo"))
    [p] = _named(validate(folder), "missing_config_field")
    assert set(p["engines"]) == {"vllm", "sglang", "trtllm"}


@pytest.mark.parametrize("drop", ["config_groups", "format"])
def test_compressed_tensors_config_field_missing(tmp_path, drop):
    folder = _copy(LLMC_MOE, tmp_path)

    def edit(d):
        qc = d["quantization_config"]
        if drop == "format":
            qc.pop("format")
            for group in qc["config_groups"].values():
                group.pop("format")
        else:
            qc.pop(drop)

    _edit_json(folder / "config.json", edit)
    found = _named(validate(folder), "missing_config_field")
    assert len(found) == 1 and drop in found[0]["message"]


def test_no_quantization_config_at_all(tmp_path):
    folder = _copy(LLMC_MOE, tmp_path)
    _edit_json(folder / "config.json", lambda d: d.pop("quantization_config"))
    result = validate(folder)
    assert result["form"] == "unknown" and [p["tensor"] for p in _named(result, "missing_config_field")] == [
        "config.json"]


@pytest.mark.parametrize("where", ["quant_algo", "exclusions"])
def test_config_json_and_hf_quant_config_disagree(tmp_path, where):
    folder = _copy(MODELOPT_GPT_OSS, tmp_path)
    if where == "quant_algo":
        _edit_json(folder / "hf_quant_config.json", lambda d: d["quantization"].__setitem__("quant_algo", "FP8"))
    else:
        _edit_json(folder / "hf_quant_config.json", lambda d: d["quantization"]["exclude_modules"].remove(
            "model.layers.1.mlp.router"))
    found = _named(validate(folder), "config_disagreement")
    assert len(found) == 1 and found[0]["tensor"] == "hf_quant_config.json"
    assert "config_disagreement" not in _kinds(validate(MODELOPT_GPT_OSS))


def test_index_naming_a_missing_shard(tmp_path, capsys):
    """A shard the index names but the folder lacks is a problem (exit 1), not a crash."""
    folder = _copy(LLMC_MOE, tmp_path)
    tensors = load_file(folder / "model.safetensors")
    second = {n: tensors.pop(n) for n in list(tensors) if n.startswith("model.layers.1.")}
    save_file(tensors, folder / "model-00001-of-00002.safetensors", metadata={"format": "pt"})
    (folder / "model.safetensors").unlink()
    weight_map = {**{n: "model-00001-of-00002.safetensors" for n in tensors},
                  **{n: "model-00002-of-00002.safetensors" for n in second}}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    result = validate(folder)
    [p] = _named(result, "missing_shard")
    assert p["tensor"] == "model-00002-of-00002.safetensors" and f"for {len(second)} tensor(s)" in p["message"]
    assert all(not v["loads"] for v in result["engines"].values())
    code, err = cli(capsys, "inspect", folder, "--json")
    assert code == 1 and "Traceback" not in err
    # the second shard written, the index is whole again
    save_file(second, folder / "model-00002-of-00002.safetensors", metadata={"format": "pt"})
    assert "missing_shard" not in _kinds(validate(folder))


def test_truncated_shard(tmp_path):
    folder = _copy(LLMC_MOE, tmp_path)
    tensors = load_file(folder / "model.safetensors")
    second = {n: tensors.pop(n) for n in list(tensors) if n.startswith("model.layers.1.")}
    save_file(tensors, folder / "model-00001-of-00002.safetensors", metadata={"format": "pt"})
    save_file(second, folder / "model-00002-of-00002.safetensors", metadata={"format": "pt"})
    (folder / "model.safetensors").unlink()
    with open(folder / "model-00002-of-00002.safetensors", "r+b") as f:
        f.truncate(f.seek(0, 2) - 100)
    result = validate(folder)
    assert [p["tensor"] for p in _named(result, "unreadable_shard")] == ["model-00002-of-00002.safetensors"]
    assert {m["module"] for m in result["modules"]} and all(m["module"].startswith("model.layers.0.")
                                                             for m in result["modules"])


def test_group_size_not_16(tmp_path):
    folder = _copy(MODELOPT_MOE, tmp_path)
    _edit_json(folder / "hf_quant_config.json", lambda d: d["quantization"].__setitem__("group_size", 32))
    _edit_json(folder / "config.json", lambda d: d["quantization_config"].__setitem__("group_size", 32))
    assert [p["tensor"] for p in _named(validate(folder), "bad_config_value")] == ["hf_quant_config.json"]


@pytest.mark.parametrize("key,value", [("group_size", 32), ("strategy", "group"), ("num_bits", 8)])
def test_compressed_tensors_weights_not_nvfp4(tmp_path, key, value):
    folder = _copy(LLMC_MOE, tmp_path)
    _edit_json(folder / "config.json",
               lambda d: d["quantization_config"]["config_groups"]["group_0"]["weights"].__setitem__(key, value))
    found = _named(validate(folder), "bad_config_value")
    assert len(found) == 1 and f"weights.{key}" in found[0]["message"]
    assert "bad_config_value" not in _kinds(validate(LLMC_MOE))


def test_folder_without_nvfp4_modules(tmp_path):
    """An unquantized folder beside a ModelOpt config: the validator says there is nothing NVFP4 in it."""
    folder = _copy(MODELOPT_MOE, tmp_path)
    _edit_tensors(folder, lambda t: [t.pop(n) for n in list(t) if ".experts." in n])
    result = validate(folder)
    assert _kinds(result) == {"no_quantized_modules"} and not result["modules"]


# ----------------------------------------------------------------------------------------------- the CLI

def test_cli_json_and_exit_codes(tmp_path, capsys):
    code, _ = cli(capsys, "inspect", LLMC_MOE, "--json")
    assert code == 0
    folder = _copy(LLMC_MOE, tmp_path)
    _edit_tensors(folder, lambda t: t.__setitem__(f"{E0}.down_proj.input_global_scale", torch.tensor([0.0])))
    try:
        from fp4pass.cli import main

        code = main(["inspect", str(folder), "--json"])
    except SystemExit as exc:
        code = exc.code
    out = json.loads(capsys.readouterr().out)
    assert code == 1
    assert set(out) >= {"problems", "engines", "form", "modules"}
    assert set(out["engines"]) == {"vllm", "sglang", "trtllm"}
    assert all(set(v) >= {"loads", "mode", "why"} for v in out["engines"].values())
    [p] = out["problems"]
    assert p["kind"] == "zero_scale" and p["kind"] in KINDS and p["module"] == f"{E0}.down_proj"


def test_cli_engine_narrows(capsys):
    from fp4pass.cli import main

    assert main(["inspect", str(MODELOPT_GPT_OSS), "--json", "--engine", "trtllm"]) == (
        0 if validate(MODELOPT_GPT_OSS)["engines"]["trtllm"]["loads"] else 1)
    out = json.loads(capsys.readouterr().out)
    assert list(out["engines"]) == ["trtllm"]
    assert all(p.get("engines") in (None,) or "trtllm" in p["engines"] for p in out["problems"])
    assert main(["inspect", str(MODELOPT_GPT_OSS), "--engine", "vllm"]) == 1
    text = capsys.readouterr().out
    assert "vllm" in text and "engine_cannot_load" in text and "sglang" not in text.split("problem(s):")[1]


def test_cli_table(capsys):
    from fp4pass.cli import main

    assert main(["inspect", str(MODELOPT_MOE)]) == 0
    text = capsys.readouterr().out
    assert "form modelopt (NVFP4)" in text and "no problem found" in text and f"{E0}.gate_proj" in text


@pytest.mark.parametrize("case", ["no_config", "no_shards", "not_a_folder"])
def test_cli_unreadable_folder_exit_2(tmp_path, capsys, case):
    folder = _copy(LLMC_MOE, tmp_path)
    if case == "no_config":
        (folder / "config.json").unlink()
        with pytest.raises(Exception, match="config.json"):
            validate(folder)
    elif case == "no_shards":
        (folder / "model.safetensors").unlink()
        with pytest.raises(Exception, match="nothing to read"):
            validate(folder)
    else:
        folder = folder / "model.safetensors"
    code, err = cli(capsys, "inspect", folder, "--engine", "vllm")
    assert code == 2 and "Traceback" not in err


def test_mxfp4_folder_keeps_the_mxfp4_inspection(tmp_path, capsys):
    """An MXFP4 folder, even beside a producer's hf_quant_config.json of another algorithm, gets the lossless
    forecast; an NVFP4 folder without any quantization config is found by its scale tensors."""
    from fp4pass.cli import main

    folder = _copy(Path("models/checkpoints/deepseek_v3"), tmp_path)
    (folder / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "FP8"}}))
    for source in ("models/checkpoints/deepseek_v3", folder):
        assert main(["inspect", str(source), "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert "weights" in out and "problems" not in out
    bare = _copy(LLMC_MOE, tmp_path)
    _edit_json(bare / "config.json", lambda d: d.pop("quantization_config"))
    assert main(["inspect", str(bare), "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["form"] == "unknown"
    code, err = cli(capsys, "inspect", "models/checkpoints/deepseek_v3", "--engine", "vllm")
    assert code == 2 and "--engine" in err


def _header_spans(path: Path) -> dict[str, tuple[int, int]]:
    """Tensor name -> absolute [begin, end) file offsets, from the safetensors header read here."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    header.pop("__metadata__", None)
    return {k: (8 + n + v["data_offsets"][0], 8 + n + v["data_offsets"][1]) for k, v in header.items()}


def test_reads_scales_not_codes(tmp_path, monkeypatch):
    """No byte of a packed weight is read, and a block-scale tensor at most BLOCK_SAMPLE_BYTES."""
    import importlib

    from fp4pass.safetensors import files as safetensors_io

    validate_mod = importlib.import_module("fp4pass.checkpoint.validate.tensors")  # where the reads are

    reads: list[tuple[int, int]] = []
    original = validate_mod._pread

    def spy(fd, size, offset, shard):
        reads.append((offset, offset + size))
        return original(fd, size, offset, shard)

    monkeypatch.setattr(validate_mod, "_pread", spy)
    other: list[str] = []
    monkeypatch.setattr(safetensors_io.SafetensorsFile, "read_bytes", lambda self, name, *a: other.append(name))
    folder = _copy(MODELOPT_MOE, tmp_path)
    big = f"{E0}.gate_proj"

    def edit(t):  # one module 4096 x 8192: 16 MiB of codes, 2 MiB of block scales
        t[f"{big}.weight"] = torch.zeros(4096, 4096, dtype=torch.uint8)
        t[f"{big}.weight_scale"] = torch.full((4096, 512), 448.0).to(torch.float8_e4m3fn)

    _edit_tensors(folder, edit)
    validate(folder)
    spans = _header_spans(folder / "model.safetensors")
    codes = [spans[n] for n in spans if n.endswith(".weight") and n[:-7] + ".weight_scale" in spans]
    assert codes and not other
    assert not [r for r in reads for c in codes if r[0] < c[1] and c[0] < r[1]]
    lo, hi = spans[f"{big}.weight_scale"]
    assert 0 < sum(min(e, hi) - max(b, lo) for b, e in reads if b < hi and lo < e) <= BLOCK_SAMPLE_BYTES


# -------------------------------------------------------------------------------- fp4pass's own outputs

OWN = [(model, fmt, scale) for model in ("gpt_oss", "deepseek_v3", "deepseek")
       for fmt in ("modelopt", "compressed-tensors") for scale in (None, 0.5)
       if not (model == "gpt_oss" and fmt == "compressed-tensors")
       and not (model == "deepseek" and fmt == "modelopt" and scale is None)]  # refused: W4A4 only


@pytest.fixture(scope="module")
def own_root(tmp_path_factory):
    return tmp_path_factory.mktemp("own")


@pytest.mark.parametrize("model,fmt,input_scale", OWN,
                         ids=[f"{m}-{f}-{'w4a4' if s else 'w4a16'}" for m, f, s in OWN])
def test_own_outputs_have_no_problem(own_root, model, fmt, input_scale):
    """fp4pass's outputs follow every rule; what remains is an engine's documented refusal of a form."""
    from fp4pass.checkpoint import convert

    out = own_root / f"{model}-{fmt}-{input_scale}"
    convert(f"models/checkpoints/{model}", out, format=fmt, input_scale=input_scale)
    result = validate(out)
    assert result["modules"]
    _engine_findings_only(result, out)


def test_every_kind_is_tested():
    """Each kind the validator can report is planted by a test of this file (or is the engine verdict's own)."""
    text = Path(__file__).read_text()
    untested = [k for k in KINDS if f'"{k}"' not in text.split("def test_every_kind_is_tested")[0]]
    assert not untested, untested


def test_convert_checks_its_own_output(tmp_path, monkeypatch, capsys):
    """convert runs the validator on the folder before its rename: its result is in the report, and a writer that
    stores a multiplier where compressed-tensors keeps a divisor is exit 3, with nothing written."""
    from fp4pass.checkpoint import convert, engine

    report = convert("models/checkpoints/deepseek_v3", tmp_path / "good", format="compressed-tensors", input_scale=0.5)
    assert report["validation"]["problems"] == validate(tmp_path / "good")["problems"]
    assert set(report["validation"]["engines"]) == {"vllm", "sglang", "trtllm"}
    monkeypatch.setattr(engine, "reciprocal", lambda value: value)  # the writer's bug: no 1/x
    code, err = cli(capsys, "convert", "models/checkpoints/deepseek_v3", "-o", tmp_path / "bad", "--format",
                    "compressed-tensors", "--input-scale", "0.5")
    assert code == 3 and "scale_convention" in err and not (tmp_path / "bad").exists()


@pytest.mark.parametrize("fmt", ["compressed-tensors", "modelopt"])
def test_convert_of_large_or_zero_weights_is_not_called_a_writer_bug(tmp_path, capsys, fmt):
    """The validator's magnitude guesses cannot tell a weight amax above 2^10 from a swapped global scale, nor an
    all-zero expert's global scale of 1 from a folded one. In a folder fp4pass wrote the scales are the weights'
    own: a compressed-tensors expert whose E8M0 codes reach 137 (amax 6 x 2^10) and an all-zero expert convert (exit 0,
    also with --method requant), and the same folder through `inspect` still shows the guess, marked as one."""
    import shutil

    from checkpoint_oracles import rewrite_shard

    src = tmp_path / "src"
    shutil.copytree("models/checkpoints/deepseek_v3", src)
    layer = "model.layers.1.mlp.experts"

    def edit(tensors):
        for proj in ("w1", "w2", "w3"):
            scale = tensors[f"{layer}.0.{proj}.weight_scale"]
            tensors[f"{layer}.0.{proj}.weight_scale"] = torch.full_like(scale, 121) + (torch.arange(
                scale.numel(), dtype=torch.uint8).reshape(scale.shape) % 17)
            tensors[f"{layer}.1.{proj}.weight_packed"] = torch.zeros_like(tensors[f"{layer}.1.{proj}.weight_packed"])

    rewrite_shard(src / "model.safetensors", edit)
    for method in ("auto", "requant"):
        out = tmp_path / f"out-{method}"
        code, err = cli(capsys, "convert", src, "-o", out, "--format", fmt, "--method", method, "--input-scale", "0.5")
        assert code == 0, err
        assert out.is_dir()
    seen = validate(tmp_path / "out-auto")["problems"]
    assert all(p.get("guess") for p in seen if p["kind"] in ("scale_convention", "folded_global_scale"))
