"""Checkpoint outputs against the serving engines' loaders.

Two kinds of oracle:

- vLLM 0.33.0's own code, run on CPU from the unpacked wheel in a separate process (tests/vllm_probe.py: its
  config parsing and quant-method resolution, ModelOpt / compressed-tensors / FP8 exclusion code, each model's
  hf_to_vllm_mapper and packed_modules_mapping, ModelOptNvFp4FusedMoE.create_weights). Marked ``engines``;
  skipped when the unpacked wheel is absent (``bash .ci/install`` fetches it; docs/checkpoint.md says how).
- SGLang 0.5.23's and TensorRT-LLM's rules, which cannot be imported here, as encoded in
  :mod:`fp4pass.checkpoint.engines`: each rule is tested on cases chosen so that breaking the rule flips the
  answer.

Every family x form x (W4A4 | W4A16) the converter writes is converted from the bundled tiny checkpoints
(models/checkpoints/*, plus a DeepSeek-V4 variant whose only MXFP4 weights are its routed experts) and judged.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import fp4pass.checkpoint
from fp4pass.checkpoint import engines
from fp4pass.checkpoint.engines import MixedShards, engine_verdicts, is_excluded
from fp4pass.examples.checkpoints import build_checkpoint

ROOT = Path(__file__).resolve().parents[2]
BUNDLED = ROOT / "models" / "checkpoints"
sys.path.insert(0, str(Path(__file__).parents[1]))
from vllm_probe import vllm_path  # noqa: E402

INPUT_SCALE = 0.0123  # a multiplier (amax / 2688), distinct from every weight scale of the examples
DEEPSEEK_V4 = ("deepseek", "deepseek_experts")  # the DeepSeek-V4 families (deepseek_v3 is another architecture)

# family -> (source folder or builder, formats the converter writes for it)
FAMILIES = {"gpt_oss": ("modelopt",), "deepseek_v3": ("modelopt", "compressed-tensors"),
            "kimi_k3": ("modelopt", "compressed-tensors"),
            "deepseek": ("modelopt", "compressed-tensors"), "deepseek_experts": ("modelopt", "compressed-tensors")}

# what each output loads as: (family, format, W4A4?) -> {engine: mode or None}; the engine matrix of
# docs/checkpoint.md, cell by cell
EXPECTED = {
    ("gpt_oss", "modelopt", False): {"vllm": None, "sglang": None, "trtllm": None},
    ("gpt_oss", "modelopt", True): {"vllm": None, "sglang": None, "trtllm": None},
    ("deepseek_v3", "modelopt", False): {"vllm": "W4A16", "sglang": "W4A16", "trtllm": "W4A16"},
    ("deepseek_v3", "modelopt", True): {"vllm": "W4A4", "sglang": "W4A4", "trtllm": "W4A4"},
    ("deepseek_v3", "compressed-tensors", False): {"vllm": "W4A16", "sglang": "W4A16", "trtllm": None},
    ("deepseek_v3", "compressed-tensors", True): {"vllm": "W4A4", "sglang": "W4A4", "trtllm": None},
    # Kimi-K3 as released (nested text_config, latent MoE, vision tower): TensorRT-LLM's loader was not read
    ("kimi_k3", "modelopt", False): {"vllm": "W4A16", "sglang": "W4A16", "trtllm": None},
    ("kimi_k3", "modelopt", True): {"vllm": "W4A4", "sglang": "W4A4", "trtllm": None},
    ("kimi_k3", "compressed-tensors", False): {"vllm": "W4A16", "sglang": "W4A16", "trtllm": None},
    ("kimi_k3", "compressed-tensors", True): {"vllm": "W4A4", "sglang": "W4A4", "trtllm": None},
    ("deepseek", "modelopt", True): {"vllm": None, "sglang": None, "trtllm": None},
    ("deepseek", "compressed-tensors", False): {"vllm": "W4A16", "sglang": None, "trtllm": None},
    ("deepseek", "compressed-tensors", True): {"vllm": "W4A4", "sglang": None, "trtllm": None},
    ("deepseek_experts", "modelopt", True): {"vllm": "W4A4", "sglang": None, "trtllm": None},
    ("deepseek_experts", "compressed-tensors", False): {"vllm": "W4A16", "sglang": None, "trtllm": None},
    ("deepseek_experts", "compressed-tensors", True): {"vllm": "W4A4", "sglang": None, "trtllm": None},
}

#: outputs convert refuses to write: DeepSeek-V4's FP8 config form is W4A4 only (vLLM has no weight-only variant)
REFUSED = {(family, "modelopt", False) for family in DEEPSEEK_V4}


def _source(family: str, root: Path) -> Path:
    if family == "deepseek_experts":  # DeepSeek-V4 as released: only the routed experts are MXFP4
        folder = root / "src-deepseek-experts"
        if not folder.exists():
            build_checkpoint(folder, "deepseek", layers=2, experts=3, hidden=64, intermediate=32, seed=3,
                             dense=False, runnable=True)
        return folder
    return BUNDLED / family


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    """{(family, format, w4a4): (folder, report)} for every output the converter writes."""
    root = tmp_path_factory.mktemp("engines")
    out = {}
    for family, formats in FAMILIES.items():
        for fmt in formats:
            for w4a4 in (False, True):
                if (family, fmt, w4a4) in REFUSED:
                    continue
                folder = root / f"{family}-{fmt}-{'w4a4' if w4a4 else 'w4a16'}"
                report = fp4pass.checkpoint.convert(_source(family, root), folder, format=fmt,
                                                    input_scale=INPUT_SCALE if w4a4 else None)
                out[(family, fmt, w4a4)] = (folder, report)
    return out


def _read(folder: Path):
    config = json.loads((folder / "config.json").read_text())
    hf = folder / "hf_quant_config.json"
    hf_quant = json.loads(hf.read_text()) if hf.exists() else None
    from checkpoint_oracles import Folder

    return config, hf_quant, list(Folder(folder).keys())


# ------------------------------------------------------------------------------------------------------------
# the outputs: configs, and every engine's verdict (the engine matrix)

def test_every_output_has_one_verdict_per_engine_as_the_matrix_says(outputs):
    assert set(outputs) == set(EXPECTED)
    for key, (folder, report) in outputs.items():
        assert set(report["engines"]) == set(engines.ENGINES), key
        got = {e: (v["mode"] if v["loads"] else None) for e, v in report["engines"].items()}
        assert got == EXPECTED[key], (key, report["engines"])
        for v in report["engines"].values():
            assert v["why"] and (v["mode"] in ("W4A4", "W4A16")) == v["loads"]
        # the report's verdicts are those of the written folder, read back
        config, hf_quant, names = _read(folder)
        assert engine_verdicts(config, hf_quant, names) == report["engines"], key


def test_gpt_oss_verdicts_name_the_engine_gap(outputs):
    for w4a4 in (False, True):
        verdicts = outputs[("gpt_oss", "modelopt", w4a4)][1]["engines"]
        assert "#46641" in verdicts["vllm"]["why"] and "#46641" in verdicts["sglang"]["why"]
        assert "modeling_gpt_oss.py" in verdicts["trtllm"]["why"]


def test_weight_only_modelopt_says_w4a16_nvfp4_in_both_files_and_names_modelopt(outputs):
    for (family, fmt, w4a4), (folder, _) in outputs.items():
        config, hf_quant, _ = _read(folder)
        qc = config["quantization_config"]
        if fmt != "modelopt" or family in DEEPSEEK_V4:
            continue
        algo = "NVFP4" if w4a4 else "W4A16_NVFP4"
        assert qc["quant_algo"] == algo and hf_quant["quantization"]["quant_algo"] == algo
        assert hf_quant["quant_method"] == "modelopt" and qc["quant_method"] == "modelopt"
        assert hf_quant["producer"]["name"] == "fp4pass" == qc["producer"]["name"]  # no other tool claimed


def test_exclusions_never_glob_an_index(outputs):
    """Layer and expert indices are never ``*``: exact names or prefix wildcards ``A*`` only."""
    for key, (folder, report) in outputs.items():
        config, hf_quant, _ = _read(folder)
        qc = config["quantization_config"]
        lists = [qc.get("ignore", []), qc.get("exclude_modules", []), qc.get("ignored_layers", []),
                 (hf_quant or {}).get("quantization", {}).get("exclude_modules", [])]
        for entry in (e for lst in lists for e in lst):
            if entry.startswith("re:"):
                assert r"\d" not in entry, (key, entry)
            else:
                assert "*" not in entry[:-1], (key, entry)
        if key[1] == "compressed-tensors" or key[0] in DEEPSEEK_V4:
            assert not any(e.endswith("*") for lst in lists for e in lst), key


def test_deepseek_v4_keeps_its_fp8_config_and_adds_moe_quant_algo(outputs):
    for family in ("deepseek", "deepseek_experts"):
        source = json.loads((_source(family, outputs[(family, "modelopt", True)][0].parent) / "config.json")
                            .read_text())["quantization_config"]
        for w4a4 in (True,):
            folder = outputs[(family, "modelopt", w4a4)][0]
            config, hf_quant, names = _read(folder)
            qc = config["quantization_config"]
            assert hf_quant is None
            assert {k: qc[k] for k in source} == source
            assert qc["moe_quant_algo"] == "NVFP4" and qc["activation_scheme"] == "dynamic"
            assert "layers.0.attn.wq_a" in qc["ignored_layers"] and "head" in qc["ignored_layers"]
            assert not any(n.startswith("layers.0.ffn.experts.") for n in qc["ignored_layers"])
    # the same folder without its input scales (another writer's): vLLM's DeepSeek-V4 FP8 form cannot load it
    config, hf_quant, names = _read(outputs[("deepseek_experts", "modelopt", True)][0])
    weight_only = engine_verdicts(config, hf_quant, [n for n in names if not n.endswith(".input_scale")])["vllm"]
    assert not weight_only["loads"] and "input_scale" in weight_only["why"]
    dense = outputs[("deepseek", "modelopt", True)][1]["engines"]["vllm"]
    assert not dense["loads"] and "wo_b" in dense["why"]


@pytest.mark.parametrize("family", DEEPSEEK_V4)
def test_deepseek_v4_fp8_form_without_input_scales_is_refused_naming_the_flags(family, tmp_path, capsys):
    """What vLLM's DeepSeek-V4 FP8 config cannot load (NVFP4 experts with no input scale) is never written:
    exit 2 before anything is written, naming the flags that make it valid; the compressed-tensors form and
    --input-scale both convert."""
    from fp4pass.cli import main

    src, out = _source(family, tmp_path), tmp_path / "o"
    rc = main(["convert", str(src), "-o", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and not out.exists() and len(err) == 1, err
    for flag in ("--input-scale", "--scales", "--calib", "--format compressed-tensors"):
        assert flag in err[0], err
    assert main(["convert", str(src), "-o", str(tmp_path / "ct"), "--format", "compressed-tensors", "--quiet"]) == 0
    assert main(["convert", str(src), "-o", str(tmp_path / "a4"), "--input-scale", "0.5", "--quiet"]) == 0
    assert main(["inspect", str(tmp_path / "a4"), "--quiet"]) == 0


def test_convert_engine_flag_refuses_what_that_engine_does_not_load(tmp_path, capsys):
    from fp4pass.cli import main

    out = tmp_path / "o"
    rc = main(["convert", str(BUNDLED / "deepseek_v3"), "-o", str(out), "--format", "compressed-tensors", "--engine",
               "trtllm", "--quiet"])
    assert rc == 2 and not out.exists()
    assert "would not load in trtllm" in capsys.readouterr().err
    rc = main(["convert", str(BUNDLED / "deepseek_v3"), "-o", str(out), "--engine", "sglang"])
    err = capsys.readouterr().err
    assert rc == 0 and out.exists()
    assert "engines: vllm loads W4A16; sglang loads W4A16; trtllm loads W4A16" in err


# ------------------------------------------------------------------------------------------------------------
# the encoded rules, one case per rule, each chosen so that breaking the rule flips it

QKV = ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj"]
FUSED = "model.layers.0.self_attn.qkv_proj"


@pytest.mark.parametrize("engine", engines.ENGINES)
def test_index_globs_of_shards_never_exclude_a_fused_module(engine):
    globs = ["model.layers.*.self_attn.q_proj", "model.layers.*.self_attn.k_proj", "model.layers.*.self_attn.v_proj"]
    assert not is_excluded(engine, FUSED, globs, QKV)
    # while each shard alone is matched by its glob in every engine that globs
    assert all(is_excluded(engine, s, globs) for s in QKV)


@pytest.mark.parametrize("engine", engines.ENGINES)
def test_prefix_wildcards_exclude_fused_modules(engine):
    assert is_excluded(engine, FUSED, ["model.layers.0.self_attn*"], QKV)
    assert not is_excluded(engine, "model.layers.1.self_attn.qkv_proj", ["model.layers.0.self_attn*"],
                           [s.replace(".0.", ".1.") for s in QKV])


def test_exact_shard_names_exclude_fused_modules_in_vllm_and_sglang_not_trtllm():
    assert is_excluded("vllm", FUSED, QKV, QKV)
    assert is_excluded("sglang", FUSED, QKV, QKV)
    assert not is_excluded("trtllm", FUSED, QKV, QKV)  # fnmatch of the fused name only


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_some_shards_excluded_raises(engine):
    with pytest.raises(MixedShards, match="k_proj"):
        is_excluded(engine, FUSED, QKV[:1] + QKV[2:], QKV)


def test_vllm_substring_rule_and_sglang_component_rule():
    # vLLM modelopt.py is_layer_excluded: an entry inside the name excludes it (a router named mlp.gate
    # therefore also excludes a dense mlp.gate_up_proj of the same layer)
    assert is_excluded("vllm", "model.layers.0.mlp.gate_up_proj", ["model.layers.0.mlp.gate"])
    assert not is_excluded("trtllm", "model.layers.0.mlp.gate_up_proj", ["model.layers.0.mlp.gate"])
    # SGLang: an entry matching one component; and the MLA fused tails
    assert is_excluded("sglang", "model.layers.3.lm_head", ["lm_head"])
    assert not is_excluded("trtllm", "model.layers.3.lm_head", ["lm_head"])
    # (the tail must be a substring of the fused name's last component: kv_a_proj_with_mqa is, q_a_proj is not)
    fused_mla = "model.layers.0.self_attn.fused_qkv_a_proj_with_mqa"
    assert is_excluded("sglang", fused_mla, ["model.layers.0.self_attn.kv_a_proj_with_mqa"])
    assert not is_excluded("sglang", fused_mla, ["model.layers.0.self_attn.q_a_proj"])
    assert not is_excluded("vllm", fused_mla, ["model.layers.0.self_attn.kv_a_proj_with_mqa"])


def test_vllm_splits_prefix_wildcards_but_fnmatch_crosses_dots():
    assert is_excluded("vllm", "model.layers.0.self_attn", ["model.layers.0.self_attn*"])
    assert is_excluded("vllm", "model.layers.10.mlp.gate", ["model.layers.1*"])  # a string prefix, as fnmatch
    assert not is_excluded("vllm", "model.layers.10.mlp.gate", ["model.layers.1.*"])


def test_trtllm_ignores_regex_entries():
    assert not is_excluded("trtllm", "lm_head", ["re:^lm_head$"])
    assert is_excluded("vllm", "lm_head", ["re:^lm_head$"], form="compressed-tensors")
    assert is_excluded("sglang", "lm_head", ["re:^lm_head$"], form="compressed-tensors")


def test_compressed_tensors_regexes_see_vllm_names_plain_names_are_renamed():
    arch = engines.ARCH_DEEPSEEK_V4
    # vLLM renames DeepSeek-V4's layers.* to model.layers.*; a regex in checkpoint naming then matches nothing
    assert not is_excluded("vllm", "layers.0.attn.wq_a", [r"re:^layers\.0\.attn\.wq_a$"],
                           form="compressed-tensors", architecture=arch)
    assert is_excluded("vllm", "layers.0.attn.wq_a", ["layers.0.attn.wq_a"], form="compressed-tensors",
                       architecture=arch)
    assert is_excluded("vllm", "layers.0.attn.wq_a", [r"re:^model\.layers\.0\.attn\.wq_a$"],
                       form="compressed-tensors", architecture=arch)
    # a plain entry without a dot is not renamed: DeepSeek-V4's head (vLLM's lm_head)
    assert not is_excluded("vllm", "head", ["head"], form="compressed-tensors", architecture=arch)
    assert is_excluded("vllm", "head", ["re:^(?:head|lm_head)$"], form="compressed-tensors", architecture=arch)


def test_engine_modules_groups_present_shards_once():
    arch = engines.ARCH_DEEPSEEK_V4
    mods = ["layers.1.attn.wq_a", "layers.1.attn.wkv", "layers.1.attn.compressor.wkv",
            "layers.1.attn.compressor.wgate", "layers.1.attn.wo_a"]
    got = dict(engines.engine_modules(arch, mods))
    assert got == {"layers.1.attn.fused_wqa_wkv": ["layers.1.attn.wq_a", "layers.1.attn.wkv"],
                   "layers.1.attn.compressor.fused_wkv_wgate": ["layers.1.attn.compressor.wkv",
                                                                "layers.1.attn.compressor.wgate"],
                   "layers.1.attn.wo_a": None}


def _names(modules_nvfp4, modules_bf16, input_scale=False):
    out = []
    for m in modules_nvfp4:
        out += [f"{m}.weight", f"{m}.weight_scale", f"{m}.weight_scale_2"] + ([f"{m}.input_scale"] if input_scale
                                                                            else [])
    return out + [f"{m}.weight" for m in modules_bf16]


def _modelopt(algo, exclude, *, groups_weight_only=None, flat=True):
    if not flat:
        return {}, {"producer": {"name": "x"}, "quant_method": "modelopt",
                    "quantization": {"quant_algo": algo, "kv_cache_quant_algo": None, "group_size": 16,
                                     "exclude_modules": exclude}}
    qc = {"quant_method": "modelopt", "quant_algo": algo, "group_size": 16, "ignore": exclude,
          "kv_cache_quant_algo": None}
    if groups_weight_only is not None:
        qc["config_groups"] = {"g": {"input_activations": None if groups_weight_only else {"num_bits": 4}}}
    return {"architectures": ["Qwen3MoeForCausalLM"], "quantization_config": qc}, None


EXPERTS = [f"model.layers.0.mlp.experts.{e}.{p}" for e in range(2) for p in ("gate_proj", "up_proj", "down_proj")]
BF16 = QKV + ["model.layers.0.self_attn.o_proj", "lm_head", "model.layers.0.mlp.gate"]


def test_weight_only_nvfp4_algo_is_w4a16_in_vllm_only():
    config, hf = _modelopt("NVFP4", ["model.layers.0.self_attn*", "lm_head", "model.layers.0.mlp.gate"],
                           groups_weight_only=True)
    v = engine_verdicts(config, hf, _names(EXPERTS, BF16))
    assert v["vllm"] == {"loads": True, "mode": "W4A16", "why": v["vllm"]["why"]}
    assert not v["sglang"]["loads"] and "1.0" in v["sglang"]["why"]
    assert not v["trtllm"]["loads"]
    config["quantization_config"]["quant_algo"] = "W4A16_NVFP4"
    v = engine_verdicts(config, hf, _names(EXPERTS, BF16))
    assert all(v[e]["loads"] and v[e]["mode"] == "W4A16" for e in engines.ENGINES)
    # W4A4 with every input_scale
    config["quantization_config"]["quant_algo"] = "NVFP4"
    config["quantization_config"]["config_groups"]["g"]["input_activations"] = {"num_bits": 4}
    v = engine_verdicts(config, hf, _names(EXPERTS, BF16, input_scale=True))
    assert all(v[e]["loads"] and v[e]["mode"] == "W4A4" for e in engines.ENGINES)


def test_sglang_fuses_its_fallback_pairs_whatever_the_architecture():
    """SGLang 0.5.23 layers/quantization/utils.py ``_FALLBACK_FUSED_SHARDS``: where the quantization config has no
    ``packed_modules_mapping``, SGLang builds ``qkv_proj`` from q/k/v (and ``gate_up_proj`` from gate/up) for any
    model and judges the fused layer (``is_layer_skipped``): its own name in the list covers the three shards, and
    two shards of three listed is a refusal. The architecture here has no family record, so no fused module of
    its own."""
    arch = "LlamaForCausalLM"
    assert arch not in engines.FUSED_SHARDS
    nvfp4 = [f"model.layers.0.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
    bf16 = QKV + ["model.layers.0.self_attn.o_proj", "lm_head"]
    qc = {"quant_method": "modelopt", "quant_algo": "W4A16_NVFP4", "group_size": 16, "kv_cache_quant_algo": None,
          "ignore": [FUSED, "model.layers.0.self_attn.o_proj", "lm_head"]}
    v = engine_verdicts({"architectures": [arch], "quantization_config": qc}, None, _names(nvfp4, bf16))
    assert v["sglang"]["loads"] and v["sglang"]["mode"] == "W4A16", v["sglang"]
    qc["ignore"] = QKV[:2] + ["model.layers.0.self_attn.o_proj", "lm_head"]
    v = engine_verdicts({"architectures": [arch], "quantization_config": qc}, None, _names(nvfp4, bf16))
    assert not v["sglang"]["loads"] and f"{FUSED}: shards" in v["sglang"]["why"], v["sglang"]
    assert "are excluded but model.layers.0.self_attn.v_proj are not" in v["sglang"]["why"]


def test_index_glob_exclusions_fail_every_engine():
    exclude = ["model.layers.*.self_attn.q_proj", "model.layers.*.self_attn.k_proj", "model.layers.*.self_attn.v_proj",
               "model.layers.*.self_attn.o_proj", "lm_head", "model.layers.*.mlp.gate"]
    config, hf = _modelopt("W4A16_NVFP4", exclude)
    v = engine_verdicts(config, hf, _names(EXPERTS, BF16))
    for e in engines.ENGINES:
        assert not v[e]["loads"] and "qkv_proj" in v[e]["why"], (e, v[e])


def test_hf_quant_config_alone_needs_modelopt_producer_or_quant_method_in_vllm():
    exclude = ["model.layers.0.self_attn*", "lm_head", "model.layers.0.mlp.gate"]
    _, hf = _modelopt("W4A16_NVFP4", exclude, flat=False)
    config = {"architectures": ["Qwen3MoeForCausalLM"]}
    names = _names(EXPERTS, BF16)
    assert engine_verdicts(config, hf, names)["vllm"]["loads"]
    del hf["quant_method"]
    v = engine_verdicts(config, hf, names)
    assert not v["vllm"]["loads"] and v["trtllm"]["loads"]
    hf["producer"]["name"] = "modelopt"
    assert engine_verdicts(config, hf, names)["vllm"]["loads"]


def test_missing_input_scale_for_one_module_fails_w4a4():
    config, hf = _modelopt("NVFP4", ["model.layers.0.self_attn*", "lm_head", "model.layers.0.mlp.gate"])
    names = _names(EXPERTS, BF16, input_scale=True)
    names.remove("model.layers.0.mlp.experts.1.down_proj.input_scale")
    for e in engines.ENGINES:
        v = engine_verdicts(config, hf, names)[e]
        assert not v["loads"] and "experts.1.down_proj" in v["why"]


# ------------------------------------------------------------------------------------------------------------
# vLLM 0.33.0's own code

@pytest.fixture(scope="module")
def vllm_results(outputs, tmp_path_factory):
    if not vllm_path():
        pytest.skip("the unpacked vLLM 0.33.0 wheel is absent (~/.cache/fp4pass-test; bash .ci/install fetches it)")
    folders = [str(folder) for folder, _ in outputs.values()]
    cases = tmp_path_factory.mktemp("rules") / "cases.json"
    cases.write_text(json.dumps([{"form": f, "module": m, "exclude": e, "packed": p} for f, m, e, p in RULE_CASES]))
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, str(Path(__file__).parents[1] / "vllm_probe.py"), "--rules", str(cases),
                           *folders], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _vllm_loads(result: dict, names: set[str]) -> tuple[bool, str | None]:
    """What vLLM's code decided, read as load / not load, and its mode."""
    if "error" in result:
        return False, None
    if result["architecture"] == "GptOssForCausalLM":
        return not result["unmapped"], None
    for row in result["modules"]:
        if "error" in row or len(row["kinds"]) != 1:
            return False, None
        if row["excluded"] != (row["kinds"] == ["plain"]):
            return False, None
    if any(m["excluded"] is not False for m in result["moe"]):
        return False, None
    if result["quant_method"] == "deepseek_v4_fp8":
        if result.get("moe_quant_algo") != "NVFP4" or any(r["kinds"] == ["nvfp4"] for r in result["modules"]):
            return False, None
        return (True, "W4A4") if any(n.endswith(".input_scale") for n in names) else (False, None)
    if result["quant_method"] == "modelopt_fp4":
        return True, "W4A16" if result["algo"] == "W4A16_NVFP4" else "W4A4"
    if result["quant_method"] == "compressed-tensors":
        return True, "W4A4" if any(result["input_activations"]) else "W4A16"
    return False, None


@pytest.mark.engines
def test_vllm_code_agrees_with_every_vllm_verdict(outputs, vllm_results):
    for key, (folder, report) in outputs.items():
        result = vllm_results[str(folder)]
        _, _, names = _read(folder)
        loads, mode = _vllm_loads(result, set(names))
        verdict = report["engines"]["vllm"]
        assert loads == verdict["loads"], (key, result.get("error"), verdict)
        if loads:
            assert mode == verdict["mode"], (key, result)


@pytest.mark.engines
def test_vllm_resolves_our_configs_to_the_intended_method(outputs, vllm_results):
    for (family, fmt, w4a4), (folder, _) in outputs.items():
        result = vllm_results[str(folder)]
        if family in DEEPSEEK_V4 and fmt == "modelopt":
            assert result["quant_method"] == "deepseek_v4_fp8" and "error" not in result, result
            assert result["moe_quant_algo"] == "NVFP4"
        elif fmt == "modelopt":
            assert result["quant_method"] == "modelopt_fp4" and "error" not in result, result
            assert result["algo"] == ("NVFP4" if w4a4 else "W4A16_NVFP4")
        else:
            assert result["quant_method"] == "compressed-tensors" and "error" not in result, result
            assert any(result["input_activations"]) == w4a4


@pytest.mark.engines
def test_vllm_exclusion_code_keeps_every_bf16_linear_and_quantizes_every_nvfp4_one(outputs, vllm_results):
    for key, (folder, _) in outputs.items():
        result = vllm_results[str(folder)]
        if result["architecture"] == "GptOssForCausalLM" or "error" in result:
            continue
        fused = [r for r in result["modules"] if r["name"].rsplit(".", 1)[-1] in
                 {"qkv_proj", "gate_up_proj", "fused_wqa_wkv", "fused_wkv_wgate", "fused_qkv_a_proj",
                  "in_proj_qkvgfab", "fused_qkv_a_g_proj"}]
        assert fused, key  # every family here has a bf16 fused module: shared-expert gate_up_proj, fused_wqa_wkv
        for row in result["modules"]:
            assert row.get("excluded") is (row["kinds"] == ["plain"]), (key, row)
        assert all(m["excluded"] is False for m in result["moe"]), key


@pytest.mark.engines
def test_vllm_gpt_oss_mapper_leaves_the_nvfp4_scales_unmapped(outputs, vllm_results):
    """vLLM #46641: gpt_oss.py's hf_to_vllm_mapper has no entry for the underscore scale keys."""
    for w4a4 in (False, True):
        result = vllm_results[str(outputs[("gpt_oss", "modelopt", w4a4)][0])]
        unmapped = set(result["unmapped"])
        assert "model.layers.0.mlp.experts.gate_up_proj_weight_scale_2" in unmapped
        assert "model.layers.0.mlp.experts.down_proj_weight_scale" in unmapped
        assert ("model.layers.0.mlp.experts.gate_up_proj_input_scale" in unmapped) == w4a4
        assert result["mapped"]["model.layers.0.mlp.experts.gate_up_proj"].endswith(".w13_weight")


@pytest.mark.engines
def test_vllm_moe_create_weights_takes_our_expert_tensors(outputs, vllm_results):
    """ModelOptNvFp4FusedMoE.create_weights: w13 = [w1; w3] per expert, our per-expert shapes fit its slices."""
    from checkpoint_oracles import Folder

    folder = outputs[("deepseek_v3", "modelopt", True)][0]
    params = {n: (d, s) for n, d, s in vllm_results[str(folder)]["moe_params"]}
    out = Folder(folder)
    w1 = "model.layers.0.mlp.experts.0.w1"
    n, k2 = out.shape(f"{w1}.weight")
    assert params["w13_weight"] == ("uint8", [3, 2 * n, k2]) and out.dtype(f"{w1}.weight") == "U8"
    assert params["w13_weight_scale"] == ("float8_e4m3fn", [3, 2 * n, k2 * 2 // 16])
    assert out.dtype(f"{w1}.weight_scale") == "F8_E4M3" and out.shape(f"{w1}.weight_scale") == [n, k2 * 2 // 16]
    assert params["w13_weight_scale_2"] == ("float32", [3, 2]) and out.shape(f"{w1}.weight_scale_2") == []
    assert params["w13_input_scale"] == ("float32", [3, 2]) and out.shape(f"{w1}.input_scale") == []
    w2 = "model.layers.0.mlp.experts.0.w2"
    assert params["w2_weight"] == ("uint8", [3, *out.shape(f"{w2}.weight")])


@pytest.mark.engines
def test_encoded_vllm_rule_matches_vllm_code_on_every_module(outputs, vllm_results):
    """engines.is_excluded("vllm", ...) against vLLM's own exclusion code, module by module, in vLLM's naming
    on both sides (the list as vLLM holds it after the model's apply_vllm_mapper)."""
    compared = 0
    for (family, fmt, _), (folder, _) in outputs.items():
        result = vllm_results[str(folder)]
        if "modules" not in result or (family in DEEPSEEK_V4 and fmt == "modelopt"):
            continue
        config, _, _ = _read(folder)
        arch = config["architectures"][0]
        exclude = result["exclude_after_mapper"]
        assert exclude, (family, fmt)
        packed = engines.FUSED_SHARDS[arch]
        for row in result["modules"]:
            if "error" in row:
                continue
            parent, last = row["name"].rsplit(".", 1) if "." in row["name"] else ("", row["name"])
            shards = [f"{parent}.{s}" for s in packed[last]] if last in packed else None
            mine = is_excluded("vllm", row["name"], exclude, shards, form=fmt)
            assert mine == row["excluded"], (family, fmt, row)
            compared += 1
    assert compared > 20


# hand-made cases for vLLM's exclusion code: (form, module, exclude, packed); each rule of engines/rules.py's vLLM
# encoding has a case that flips when the rule is broken
QKV_PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
RULE_CASES = [
    ("modelopt", FUSED, ["model.layers.*.self_attn.q_proj", "model.layers.*.self_attn.k_proj",
                         "model.layers.*.self_attn.v_proj"], QKV_PACKED),           # globs never see shards
    ("modelopt", FUSED, ["model.layers.0.self_attn*"], QKV_PACKED),                  # prefix wildcard
    ("modelopt", "model.layers.0.self_attn", ["model.layers.0.self_attn*"], {}),     # X* split into X, X.*
    ("modelopt", FUSED, QKV, QKV_PACKED),                                            # every shard exact
    ("modelopt", FUSED, QKV[:2], QKV_PACKED),                                        # some shards: raises
    ("modelopt", FUSED, [FUSED], QKV_PACKED),                                        # the fused name itself
    ("modelopt", "model.layers.0.mlp.gate_up_proj", ["model.layers.0.mlp.gate"], {}),  # substring rule
    ("modelopt", "model.layers.10.mlp.gate", ["model.layers.1*"], {}),               # fnmatch crosses dots
    ("modelopt", "model.layers.10.mlp.gate", ["model.layers.1.*"], {}),
    ("modelopt", "lm_head", ["re:^lm_head$"], {}),                                   # no regex in ModelOpt
    ("compressed-tensors", "lm_head", ["re:^lm_head$"], {}),
    ("compressed-tensors", "model.layers.0.mlp.gate", ["re:gate"], {}),              # re.match, anchored at 0
    ("compressed-tensors", "model.layers.0.mlp.gate", ["model.layers.0.mlp.*"], {}),  # no glob in CT
    ("compressed-tensors", FUSED, QKV, QKV_PACKED),
    ("compressed-tensors", FUSED, QKV[1:], QKV_PACKED),
    ("compressed-tensors", FUSED, [r"re:.*\.self_attn\.(q|k|v)_proj$"], QKV_PACKED),
]


@pytest.mark.engines
def test_encoded_vllm_rules_match_vllm_code_case_by_case(vllm_results):
    theirs = vllm_results["--rules"]
    assert len(theirs) == len(RULE_CASES)
    assert {True, False} <= set(t for t in theirs if isinstance(t, bool))
    assert any(isinstance(t, str) for t in theirs)  # an error among the answers
    for (form, module, exclude, packed), answer in zip(RULE_CASES, theirs):
        last = module.rsplit(".", 1)[-1]
        shards = [f"{module.rsplit('.', 1)[0]}.{s}" for s in packed[last]] if last in packed else None
        try:
            mine = is_excluded("vllm", module, exclude, shards, form=form)
        except MixedShards:
            mine = "raises"
        expected = "raises" if isinstance(answer, str) else answer
        assert mine == expected, (form, module, exclude, answer)


@pytest.fixture(scope="module")
def vllm_loads(outputs):
    """vLLM 0.33.0 builds each Kimi-K3 output's model on CPU and loads its tensors (vllm_probe.py --load)."""
    if not vllm_path():
        pytest.skip("the unpacked vLLM 0.33.0 wheel is absent (~/.cache/fp4pass-test; bash .ci/install fetches it)")
    folders = {key: folder for key, (folder, _) in outputs.items() if key[0] == "kimi_k3"}
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, str(Path(__file__).parents[1] / "vllm_probe.py"), "--load",
                           *map(str, folders.values())], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return {key: result[str(folder)] for key, folder in folders.items()}


@pytest.mark.engines
def test_vllm_kimi_k3_model_builds_and_load_weights_takes_every_tensor(outputs, vllm_loads):
    """KimiK3ForConditionalGeneration (models/kimi_k3/nvidia/model.py) built from each output's config.json, and
    its load_weights given every tensor: none raises, none is skipped in silence, and every parameter is
    loaded; weight-only outputs leave exactly the experts' activation-scale parameters, which W4A16 never
    reads."""
    assert len(vllm_loads) == 4
    for (family, fmt, w4a4), result in vllm_loads.items():
        assert result["model"] == "KimiK3ForConditionalGeneration", result
        assert result["quantization"] == ("modelopt_fp4" if fmt == "modelopt" else "compressed-tensors")
        assert result["errors"] == [] and result["skipped_tensors"] == [], (fmt, w4a4, result)
        assert result["params"] > 100
        unloaded = result["unloaded_params"]
        if w4a4:
            assert unloaded == [], (fmt, unloaded)
        else:
            suffix = "_input_scale" if fmt == "modelopt" else "_input_global_scale"
            assert unloaded and all(n.endswith(suffix) and ".experts." in n for n in unloaded), unloaded
