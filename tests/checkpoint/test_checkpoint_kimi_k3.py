"""Kimi-K3 as it ships (models/checkpoints/kimi_k3: nested text_config, latent MoE, vision tower, KDA and MLA
layers, 12 experts a layer): read as MXFP4, converted into both NVFP4 forms, weight-only and W4A4, and checked
with independent decoders (tests/support/checkpoint_oracles.py: numpy + ml_dtypes + the safetensors package).

vLLM's own Kimi-K3 loader on these outputs is in tests/checkpoint/test_checkpoint_engines.py (marker ``engines``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

import fp4pass.checkpoint
from fp4pass.checkpoint import engines
from fp4pass.cli import main
from fp4pass.examples.kimi_k3 import build_kimi_k3

pytest.importorskip("safetensors")
from checkpoint_oracles import Folder, as_bytes, mx_decode, nv_decode  # noqa: E402

KIMI_K3 = Path(__file__).resolve().parents[2] / "models" / "checkpoints" / "kimi_k3"
EXPERT = re.compile(r"^language_model\.model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])$")
LOSSY = ("2", "11", "w1")  # the bundled example's one lossy weight: layer 2, expert 11, its w1
INPUT_SCALE = 0.0123


def _expert_modules(folder: Folder, suffix: str) -> list[str]:
    return sorted(n[: -len(suffix)] for n in folder.keys() if n.endswith(suffix) and EXPERT.match(n[: -len(suffix)]))


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """{(format, w4a4): (folder, report)}; W4A4 from a constant input scale."""
    root = tmp_path_factory.mktemp("kimi_k3")
    out = {}
    for fmt in ("modelopt", "compressed-tensors"):
        for w4a4 in (False, True):
            folder = root / f"{fmt}-{'w4a4' if w4a4 else 'w4a16'}"
            out[(fmt, w4a4)] = folder, fp4pass.checkpoint.convert(KIMI_K3, folder, format=fmt,
                                                                  input_scale=INPUT_SCALE if w4a4 else None)
    return out


def test_inspect_reads_the_release_as_mxfp4_with_a_lossless_forecast(capsys):
    """The MXFP4 description is only inside text_config, and the scales' U8 dtype says E8M0: an MXFP4 source,
    never "an NVFP4 checkpoint of unknown form"."""
    source = json.loads((KIMI_K3 / "config.json").read_text())
    assert "quantization_config" not in source and "quantization_config" in source["text_config"]
    assert main(["inspect", str(KIMI_K3), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["input_forms"] == ["compressed-tensors"]
    assert info["summary"] == {"weights": 108, "experts_total": 108, "experts_lossless_forecast": 107}
    assert not info["declined"]


def test_config_describes_the_nvfp4_result_at_the_top_and_in_text_config(converted):
    source = json.loads((KIMI_K3 / "config.json").read_text())
    for (fmt, w4a4), (folder, _) in converted.items():
        config = json.loads((folder / "config.json").read_text())
        top, nested = config["quantization_config"], config["text_config"]["quantization_config"]
        assert top == nested, fmt
        assert "mxfp4" not in json.dumps(config).lower(), (fmt, w4a4)
        assert top["quant_method"] == ("modelopt" if fmt == "modelopt" else "compressed-tensors")
        assert config["vision_config"] == source["vision_config"]
        assert config["architectures"] == ["KimiK3ForConditionalGeneration"]
        rest = {k: v for k, v in config["text_config"].items() if k != "quantization_config"}
        assert rest == {k: v for k, v in source["text_config"].items() if k != "quantization_config"}


def test_every_tensor_but_the_experts_is_copied_bit_for_bit(converted):
    src = Folder(KIMI_K3)
    kept = [n for n in src.keys() if not EXPERT.match(n.rsplit(".", 1)[0])]
    assert any(n.startswith("vision_tower.") for n in kept) and any("routed_expert_up_proj" in n for n in kept)
    for (fmt, w4a4), (folder, _) in converted.items():
        out = Folder(folder)
        for name in kept:
            assert out.dtype(name) == src.dtype(name) and out.shape(name) == src.shape(name), name
            assert np.array_equal(as_bytes(out.get(name)), as_bytes(src.get(name))), (fmt, name)


def _decoded(out: Folder, module: str, fmt: str) -> tuple[np.ndarray, float, float | None]:
    """(values, global multiplier, input multiplier or None) of one NVFP4 expert projection."""
    if fmt == "modelopt":
        codes, block = as_bytes(out.get(f"{module}.weight")), as_bytes(out.get(f"{module}.weight_scale"))
        g = float(out.get(f"{module}.weight_scale_2"))
        x = float(out.get(f"{module}.input_scale")) if f"{module}.input_scale" in out else None
    else:
        codes, block = as_bytes(out.get(f"{module}.weight_packed")), as_bytes(out.get(f"{module}.weight_scale"))
        g = 1.0 / float(out.get(f"{module}.weight_global_scale").reshape(()))
        x = (1.0 / float(out.get(f"{module}.input_global_scale").reshape(()))
             if f"{module}.input_global_scale" in out else None)
    return nv_decode(codes, block, g), g, x


def test_experts_decode_to_the_source_values_lossless_but_the_one_wide_weight(converted):
    src = Folder(KIMI_K3)
    modules = _expert_modules(src, ".weight_packed")
    assert len(modules) == 3 * 12 * 3
    for (fmt, w4a4), (folder, report) in converted.items():
        out = Folder(folder)
        for module in modules:
            want = mx_decode(as_bytes(src.get(f"{module}.weight_packed")), as_bytes(src.get(f"{module}.weight_scale")))
            got, _, x = _decoded(out, module, fmt)
            assert got.shape == want.shape
            if EXPERT.match(module).groups() == LOSSY:
                assert not np.array_equal(got, want) and np.abs(got - want).max() <= np.abs(want).max() / 8
            else:
                assert np.array_equal(got, want), (fmt, module)
            assert (x == pytest.approx(INPUT_SCALE, rel=1e-6)) if w4a4 else x is None
        assert report["summary"]["experts_lossless"] == 107


def test_w1_and_w3_share_one_global_scale_and_the_experts_each_have_their_own(converted):
    """w1/w3 feed one fused GEMM (vLLM keeps w1's scale with a warning, TensorRT-LLM asserts): equal; expert e's
    exponents sit 2e octaves above expert 0's, so the global scales of one layer's experts differ."""
    for (fmt, _), (folder, _) in converted.items():
        out = Folder(folder)
        scales = {}
        for module in _expert_modules(out, ".weight_scale"):
            scales[module] = _decoded(out, module, fmt)[1]
        pairs = 0
        for module, g in scales.items():
            if module.endswith(".w1"):
                assert scales[module[:-1] + "3"] == g, module
                pairs += 1
        assert pairs == 36
        layer1 = {EXPERT.match(m).group(2): g for m, g in scales.items() if m.endswith(".w2") and ".layers.1." in m}
        assert len(set(layer1.values())) == 6  # 2e mod 12 takes six values over twelve experts


def test_every_bf16_linear_is_excluded_under_vllm_and_sglang_names(converted):
    """The exclusion list as each engine reads it: vLLM sees the checkpoint's names, SGLang its run-time names
    (``model.layers.{L}.mlp...``: the language model built with prefix "" and block_sparse_moe -> mlp)."""
    for (fmt, w4a4), (folder, report) in converted.items():
        config = json.loads((folder / "config.json").read_text())
        qc = config["quantization_config"]
        exclude = qc["exclude_modules"] if fmt == "modelopt" else qc["ignore"]
        assert "model.layers.1.mlp.gate" in exclude or "model.layers.1.mlp.gate*" in exclude, fmt
        assert "lm_head" in exclude and "language_model.lm_head" in exclude
        for engine in ("vllm", "sglang"):
            assert report["engines"][engine]["loads"], (fmt, w4a4, engine, report["engines"][engine])
        assert not report["engines"]["trtllm"]["loads"] and "not claimed" in report["engines"]["trtllm"]["why"]
        assert main(["inspect", str(folder)]) == 0


def test_without_sglangs_names_sglang_would_quantize_the_bf16_linears(converted):
    """The aliases are what SGLang needs: the same list without them leaves SGLang's names unexcluded."""
    folder, _ = converted[("modelopt", False)]
    config = json.loads((folder / "config.json").read_text())
    exclude = config["quantization_config"]["exclude_modules"]
    canonical = [e for e in exclude if e.startswith(("language_model.", "vision_tower", "mm_projector"))]
    arch = config["architectures"][0]
    shared = "language_model.model.layers.1.block_sparse_moe.shared_experts.gate_proj"
    assert engines.is_excluded("sglang", shared, exclude, architecture=arch)
    assert not engines.is_excluded("sglang", shared, canonical, architecture=arch)
    assert engines.is_excluded("vllm", shared, canonical, architecture=arch)  # vLLM reads the checkpoint's names
    experts = "language_model.model.layers.1.block_sparse_moe.experts"
    for engine in ("vllm", "sglang"):
        assert not engines.is_excluded(engine, experts, exclude, architecture=arch)


def test_three_digit_expert_numbers_and_their_two_digit_prefixes_convert_apart(tmp_path):
    """896 experts in the release: expert 100 and expert 10 (a prefix of its name) are two modules."""
    src = build_kimi_k3(tmp_path / "src", layers=2, experts=101, lossy_expert=None, tokenizer=False)
    report = fp4pass.checkpoint.convert(src, tmp_path / "out", format="compressed-tensors", input_scale=INPUT_SCALE)
    out = Folder(tmp_path / "out")
    for e in (10, 100):
        module = f"language_model.model.layers.1.block_sparse_moe.experts.{e}.w2"
        want = mx_decode(as_bytes(Folder(src).get(f"{module}.weight_packed")),
                         as_bytes(Folder(src).get(f"{module}.weight_scale")))
        assert np.array_equal(_decoded(out, module, "compressed-tensors")[0], want)
    assert report["summary"]["experts_total"] == 3 * 101


def test_nvfp4_dtypes_under_mxfp4_names_are_named_as_both(tmp_path, capsys):
    """compressed-tensors writes weight_packed + weight_scale for MXFP4 and NVFP4 alike: a folder whose config
    says MXFP4 but whose block scales are E4M3 is refused with both facts, not converted."""
    nvfp4 = tmp_path / "nvfp4"
    fp4pass.checkpoint.convert(KIMI_K3, nvfp4, format="compressed-tensors")
    config = json.loads((KIMI_K3 / "config.json").read_text())
    (nvfp4 / "config.json").write_text(json.dumps(config))  # the MXFP4 description back, in text_config
    rc = main(["convert", str(nvfp4), "-o", str(tmp_path / "again")])
    err = capsys.readouterr().err
    assert rc == 2 and not (tmp_path / "again").exists()
    assert "compressed-tensors" in err and "F8_E4M3" in err and "NVFP4" in err and "E8M0" in err, err


def test_the_scales_dtype_decides_where_no_config_says(tmp_path, capsys):
    """With no quantization description anywhere, U8 (E8M0) block scales beside weight_packed are MXFP4."""
    import shutil

    folder = tmp_path / "bare"
    shutil.copytree(KIMI_K3, folder)
    config = json.loads((folder / "config.json").read_text())
    del config["text_config"]["quantization_config"]
    (folder / "config.json").write_text(json.dumps(config))
    assert main(["inspect", str(folder), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["input_forms"] == ["compressed-tensors"] and info["summary"]["weights"] == 108


# ---------------------------------------------------------------------------------------------------------
# the published layouts: NVIDIA's (ModelOpt MIXED_PRECISION) and an llm-compressor one (compressed-tensors)

def _aliases(name: str) -> list[str]:
    """Model-Optimizer examples/kimi/kimi_k3/quantize_to_nvfp4.py ``_module_name_aliases``: the checkpoint's
    name, ``block_sparse_moe`` -> ``mlp``, and both without ``language_model.`` / ``language_model.model.``."""
    names = {name} | ({name.replace("block_sparse_moe", "mlp")} if "block_sparse_moe" in name else set())
    for n in list(names):
        if n.startswith("language_model.model."):
            names |= {"model." + n[len("language_model.model."):], n[len("language_model.model."):]}
    return sorted(names)


NVIDIA_EXCLUDE = ["*block_sparse_moe.gate*", "*block_sparse_moe.routed_expert_up_proj*",
                  "*block_sparse_moe.routed_expert_down_proj*", "*block_sparse_moe.routed_expert_norm*",
                  "*block_sparse_moe.shared_experts*", "*self_attn.q_conv1d*", "*self_attn.k_conv1d*",
                  "*self_attn.v_conv1d*", "*self_attn.f_b_proj*", "*self_attn.o_norm*", "*self_attn.q_a_layernorm*",
                  "*self_attn.kv_a_layernorm*", "*_res_proj*", "*_res_norm*", "*layernorm*",
                  "language_model.model.layers.0.mlp.*", "language_model.lm_head", "vision_tower*", "mm_projector*"]


def nvidia_layout(folder: Path) -> Path:
    """A ModelOpt W4A4 output (input_scale 1.0) rewritten as NVIDIA's converter writes its configs: quant_algo
    MIXED_PRECISION with the expert banks in quantized_layers under every alias, its exclusion patterns under
    every alias, ``quant_method: modelopt_mixed``, producer modelopt, and text_config's description dropped
    (``_build_hf_quant_config``, ``_rewrite_config_json``). Attention stays bf16 here (its FP8 recipe aside)."""
    layers = {a: {"quant_algo": "NVFP4", "group_size": 16}
              for bank in sorted({EXPERT.match(m).group(1) for m in _expert_modules(Folder(folder), ".weight_scale")})
              for a in _aliases(f"language_model.model.layers.{bank}.block_sparse_moe.experts")}
    exclude = list(dict.fromkeys(a for pattern in NVIDIA_EXCLUDE for a in _aliases(pattern)))
    producer = {"name": "modelopt", "version": "0.47.0"}
    quant = {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": None, "group_size": 16,
             "quantized_layers": layers, "exclude_modules": exclude}
    (folder / "hf_quant_config.json").write_text(json.dumps({"producer": producer, "quantization": quant}))
    config = json.loads((folder / "config.json").read_text())
    config["text_config"].pop("quantization_config")
    config["quantization_config"] = {"quant_method": "modelopt_mixed", **quant, "ignore": exclude,
                                     "producer": producer}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def llmcompressor_layout(folder: Path, targets=("Linear",)) -> Path:
    """A compressed-tensors W4A4 output with llm-compressor's usual description: ``targets: ["Linear"]`` and an
    ``ignore`` of ``re:`` patterns for everything left in bf16."""
    config = json.loads((folder / "config.json").read_text())
    qc = config["quantization_config"]
    qc["config_groups"]["group_0"]["targets"] = list(targets)
    qc["ignore"] = ["lm_head", "language_model.lm_head", "re:vision_tower.*", "re:mm_projector.*", "re:.*self_attn.*",
                    r"re:.*\.gate$", "re:.*shared_experts.*", r"re:.*routed_expert_(up|down)_proj$",
                    r"re:.*layers\.0\.mlp\..*", r"re:.*_res_proj$"]
    config["text_config"]["quantization_config"] = qc
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """{name: folder}: NVIDIA's layout, the llm-compressor one, and one whose targets miss vLLM's MoE names."""
    root = tmp_path_factory.mktemp("published")
    out = {}
    fp4pass.checkpoint.convert(KIMI_K3, root / "nvidia", format="modelopt", input_scale=1.0)
    out["nvidia"] = nvidia_layout(root / "nvidia")
    for name, targets in (("llmcompressor", ("Linear",)),
                          ("expert-names", (r"re:.*block_sparse_moe\.experts\.\d+\.w[123]$",))):
        fp4pass.checkpoint.convert(KIMI_K3, root / name, format="compressed-tensors", input_scale=INPUT_SCALE)
        out[name] = llmcompressor_layout(root / name, targets)
    return out


def test_inspect_takes_the_published_layouts_with_no_false_alarm(published, capsys):
    for name in ("nvidia", "llmcompressor"):
        assert main(["inspect", str(published[name]), "--json"]) == 0, name
        info = json.loads(capsys.readouterr().out)
        assert [p for p in info["problems"] if p["severity"] == "error"] == [], (name, info["problems"])
        assert info["engines"]["vllm"]["loads"] and info["engines"]["vllm"]["mode"] == "W4A4", name
    nvidia = json.loads((published["nvidia"] / "config.json").read_text())
    assert nvidia["quantization_config"]["quant_algo"] == "MIXED_PRECISION"


def test_targets_that_miss_vllms_moe_names_leave_the_experts_unquantized(published, capsys):
    """vLLM 0.33 matches a routed-experts layer through ``P.experts.routed_experts.0.w1``, which a regex on the
    checkpoint's ``experts.\\d+.w1`` names never matches: the MoE gets no NVFP4 method."""
    main(["inspect", str(published["expert-names"]), "--json"])
    info = json.loads(capsys.readouterr().out)
    assert not info["engines"]["vllm"]["loads"] and "block_sparse_moe.experts" in info["engines"]["vllm"]["why"]


@pytest.mark.engines
def test_vllm_loads_the_published_layouts_and_not_the_one_its_moe_misses(published):
    import os
    import subprocess
    import sys

    from vllm_probe import vllm_path

    if not vllm_path():
        pytest.skip("the unpacked vLLM 0.33.0 wheel is absent (~/.cache/fp4pass-test; bash .ci/install fetches it)")
    proc = subprocess.run([sys.executable, str(Path(__file__).parents[1] / "vllm_probe.py"), "--load",
                           *(str(published[n]) for n in ("nvidia", "llmcompressor", "expert-names"))],
                          capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    nvidia, llmc, missed = (result[str(published[n])] for n in ("nvidia", "llmcompressor", "expert-names"))
    assert nvidia["quantization"] == "modelopt_mixed"
    for loaded in (nvidia, llmc):
        assert loaded["errors"] == [] and loaded["skipped_tensors"] == [] and loaded["unloaded_params"] == []
    assert "build_error" in missed or missed["errors"], missed


def test_an_alias_that_would_cover_a_converted_module_gives_way_to_exact_names():
    """vLLM's ModelOpt rule takes an entry that is a substring of a module's name: SGLang's spelling
    ``model.layers.1*`` of an entry for a kept layer 1 would also cover layer 10's NVFP4 experts."""
    from fp4pass.checkpoint.output_forms import _sglang_aliases

    kept = ["language_model.model.layers.1.self_attn.o_proj", "language_model.model.layers.1.block_sparse_moe.gate"]
    converted = ["language_model.model.layers.10.block_sparse_moe.experts.0.w1"]
    aliases = _sglang_aliases(["language_model.model.layers.1*"], kept, converted, "KimiK3ForConditionalGeneration",
                              "modelopt")
    assert aliases == ["model.layers.1.self_attn.o_proj", "model.layers.1.mlp.gate"]
    arch = "KimiK3ForConditionalGeneration"
    assert not engines.is_excluded("vllm", converted[0].rsplit(".", 2)[0], aliases, architecture=arch)
