"""fp4pass.checkpoint.convert on the example checkpoints of every input form, in both output forms.

Oracles: the safetensors package reads every output; numpy + ml_dtypes decode the MXFP4 source and the NVFP4
output (tests/support/checkpoint_oracles.py); compressed-tensors 0.20 decompresses the NVFP4 weights (directly for its
own form, through its ModelOpt reader for ModelOpt's); the gpt-oss package's reference dequant decodes the
gpt-oss source.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
import torch

from checkpoint_oracles import Folder, as_bytes, mx_decode, nv_decode, require_direct_writes, requant_sse, tree_hash
import fp4pass.checkpoint
from fp4pass.examples.checkpoints import TOKENIZER_FILES, build_checkpoint
from spies import spy_conversion_options  # noqa: E402

pytest.importorskip("safetensors")

#: an input scale for DeepSeek-V4's default output (its FP8 config with NVFP4 experts is W4A4 only)
W4A4_SCALE = 0.0123
COMBOS = [("gpt-oss", "modelopt"), ("compressed-tensors", "modelopt"), ("compressed-tensors", "compressed-tensors"),
          ("deepseek", "modelopt"), ("deepseek", "compressed-tensors")]


def _sources(src: Folder, form: str):
    """{module: (codes [N, K/2] uint8, e8m0 [N, K/32] uint8)} of every MXFP4 Linear of a per-Linear form, and
    {stack: (codes [E, N, K/2], e8m0 [E, N, K/32])} of gpt-oss stacks."""
    linears, stacks = {}, {}
    for name in src.keys():
        if form == "gpt-oss" and name.endswith("_blocks"):
            blocks, scales = as_bytes(src.get(name)), as_bytes(src.get(name[:-7] + "_scales"))
            codes = blocks.reshape(*blocks.shape[:-2], -1)
            if blocks.ndim == 4:
                stacks[name[:-7]] = (codes, scales)
            else:
                linears[name[: -len(".weight_blocks")]] = (codes, scales)
        elif form == "compressed-tensors" and name.endswith(".weight_packed"):
            m = name[: -len(".weight_packed")]
            linears[m] = (as_bytes(src.get(name)), as_bytes(src.get(m + ".weight_scale")))
        elif form == "deepseek" and name.endswith(".scale"):
            m = name[: -len(".scale")]
            linears[m] = (as_bytes(src.get(m + ".weight")), as_bytes(src.get(name)))
    return linears, stacks


def _decoded_linear(out: Folder, module: str, fmt: str) -> tuple[np.ndarray, float]:
    """(float64 weight, global multiplier) of one converted Linear, decoded independently."""
    if fmt == "modelopt":
        assert out.dtype(f"{module}.weight") == "U8" and out.dtype(f"{module}.weight_scale") == "F8_E4M3"
        assert out.shape(f"{module}.weight_scale_2") == [] and out.dtype(f"{module}.weight_scale_2") == "F32"
        s2 = float(out.get(f"{module}.weight_scale_2"))
        return nv_decode(as_bytes(out.get(f"{module}.weight")), as_bytes(out.get(f"{module}.weight_scale")), s2), s2
    assert out.shape(f"{module}.weight_global_scale") == [1]
    divisor = float(out.get(f"{module}.weight_global_scale")[0])
    return nv_decode(as_bytes(out.get(f"{module}.weight_packed")), as_bytes(out.get(f"{module}.weight_scale")),
                     1.0 / divisor), 1.0 / divisor


@pytest.fixture(scope="module")
def examples(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    out = {}
    for form in ("gpt-oss", "compressed-tensors", "deepseek"):
        out[form] = build_checkpoint(root / form, form, layers=2, experts=3, hidden=64, intermediate=96, seed=7,
                                     dense=True, shard_bytes=60_000)
    return out


@pytest.mark.parametrize("form,fmt", COMBOS)
def test_lossless_experts_bit_exact(examples, tmp_path, form, fmt):
    src_dir = examples[form]
    before = tree_hash(src_dir)
    report = fp4pass.checkpoint.convert(src_dir, tmp_path / "out", format=fmt,
                                        input_scale=W4A4_SCALE if (form, fmt) == ("deepseek", "modelopt") else None)
    assert tree_hash(src_dir) == before  # the source folder is never written
    src, out = Folder(src_dir), Folder(tmp_path / "out")
    linears, stacks = _sources(src, form)
    assert linears  # every form has dense or per-expert Linears here
    for module, (codes, e8m0) in linears.items():
        y, _ = _decoded_linear(out, module, fmt)
        np.testing.assert_array_equal(y, mx_decode(codes, e8m0), err_msg=module)
        for suffix in (".weight_blocks", ".weight_scales", ".weight_packed", ".scale"):
            assert f"{module}{suffix}" not in out or suffix == ".weight_packed" and fmt == "compressed-tensors"
    for stack, (codes, e8m0) in stacks.items():
        x = mx_decode(codes, e8m0)
        w = as_bytes(out.get(stack))
        s = as_bytes(out.get(f"{stack}_weight_scale"))
        e, n, k = x.shape
        assert list(w.shape) == [e, k // 2, n] and list(s.shape) == [e, k // 16, n]
        s2 = float(out.get(f"{stack}_weight_scale_2"))
        assert out.shape(f"{stack}_weight_scale_2") == []
        for i in range(e):
            np.testing.assert_array_equal(nv_decode(w[i].T, s[i].T, s2), x[i], err_msg=f"{stack}[{i}]")
        assert f"{stack}_blocks" not in out and f"{stack}_scales" not in out
    s = report["summary"]
    assert s["experts_lossless"] == s["experts_total"] > 0


def test_gpt_oss_source_matches_reference_dequant(examples, tmp_path):
    weights = pytest.importorskip("gpt_oss.torch.weights", reason="gpt-oss package not installed")
    src_dir = examples["gpt-oss"]
    fp4pass.checkpoint.convert(src_dir, tmp_path / "out")
    out = Folder(tmp_path / "out")
    ref = weights.Checkpoint(str(src_dir), torch.device("cpu"))
    stack = "model.layers.1.mlp.experts.gate_up_proj"
    x = ref._get_mxfp4_tensor(f"{stack}_blocks", f"{stack}_scales", dtype=torch.float32).double().numpy()
    w, s = as_bytes(out.get(stack)), as_bytes(out.get(f"{stack}_weight_scale"))
    s2 = float(out.get(f"{stack}_weight_scale_2"))
    for i in range(x.shape[0]):
        np.testing.assert_array_equal(nv_decode(w[i].T, s[i].T, s2), x[i])


@pytest.mark.parametrize("form,fmt", [c for c in COMBOS if c[0] != "gpt-oss"])
def test_compressed_tensors_decompressor_reads_it(examples, tmp_path, form, fmt):
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.entrypoints.convert import ModelOptNvfp4Converter
    from compressed_tensors.quantization import preset_name_to_scheme

    assert ct is not None
    fp4pass.checkpoint.convert(examples[form], tmp_path / "out", format=fmt, input_scale=0.25)
    src, out = Folder(examples[form]), Folder(tmp_path / "out")
    linears, _ = _sources(src, form)
    scheme = preset_name_to_scheme("NVFP4", ["Linear"])
    for module, (codes, e8m0) in linears.items():
        if fmt == "modelopt":
            names = ("weight", "weight_scale", "weight_scale_2", "input_scale")
            t = ModelOptNvfp4Converter(targets=["Linear"]).process({f"{module}.{p}": out.get(f"{module}.{p}")
                                                                      for p in names})
            t = {k.rpartition(".")[2]: v for k, v in t.items()}
        else:
            t = {p: out.get(f"{module}.{p}") for p in ("weight_packed", "weight_scale", "weight_global_scale",
                                                        "input_global_scale")}
        assert float(t["input_global_scale"].reshape(())) == 4.0  # 1 / input_scale, a divisor
        y = NVFP4PackedCompressor.decompress(t, scheme)["weight"].double().numpy()
        np.testing.assert_array_equal(y, mx_decode(codes, e8m0), err_msg=module)


@pytest.mark.parametrize("form,fmt", [("compressed-tensors", "modelopt"), ("deepseek", "compressed-tensors")])
def test_gate_and_up_share_global_and_input_scale(tmp_path, form, fmt):
    # the builder puts w3 one octave above w1: sharing must take k_max over both
    src_dir = build_checkpoint(tmp_path / "src", form, layers=1, experts=2, hidden=64, intermediate=64, seed=3)
    report = fp4pass.checkpoint.convert(src_dir, tmp_path / "out", format=fmt, input_scale=0.5)
    src, out = Folder(src_dir), Folder(tmp_path / "out")
    linears, _ = _sources(src, form)
    pairs = sorted({m.rpartition(".")[0] for m in linears if m.endswith((".w1", ".w3"))})
    assert pairs
    partners = {t["name"]: t.get("shares_scales_with") for t in report["tensors"]}
    for parent in pairs:  # the report says which Linears share their scales, and only those
        assert partners[f"{parent}.w1"] == f"{parent}.w3" and partners[f"{parent}.w3"] == f"{parent}.w1"
        assert partners[f"{parent}.w2"] is None
    for parent in pairs:
        _, s1 = _decoded_linear(out, f"{parent}.w1", fmt)
        _, s3 = _decoded_linear(out, f"{parent}.w3", fmt)
        k_max = max(int(linears[f"{parent}.{p}"][1].max()) for p in ("w1", "w3")) - 127
        own_w1 = int(linears[f"{parent}.w1"][1].max()) - 127
        assert own_w1 < k_max  # the pair's S is not w1's own
        assert s1 == s3 == math.ldexp(1.0, k_max - 8)
        name = "input_scale" if fmt == "modelopt" else "input_global_scale"
        assert float(out.get(f"{parent}.w1.{name}").reshape(())) == float(out.get(f"{parent}.w3.{name}").reshape(()))


def test_per_expert_global_scales_differ(examples, tmp_path):
    fp4pass.checkpoint.convert(examples["deepseek"], tmp_path / "out", input_scale=W4A4_SCALE)
    out = Folder(tmp_path / "out")
    scales = [float(out.get(f"layers.0.ffn.experts.{e}.w2.weight_scale_2")) for e in range(3)]
    assert len(set(scales)) == 3


def test_copied_tensors_and_files_identical(examples, tmp_path):
    src_dir = examples["compressed-tensors"]
    report = fp4pass.checkpoint.convert(src_dir, tmp_path / "out", format="compressed-tensors")
    src, out = Folder(src_dir), Folder(tmp_path / "out")
    converted = {t["name"] for t in report["tensors"]}
    copied = [n for n in src.keys() if n.rpartition(".")[0] not in converted]
    assert len(copied) == report["summary"]["tensors_copied"] > 0
    for name in copied:
        a, b = src.get(name), out.get(name)
        assert a.dtype == b.dtype and a.shape == b.shape
        assert as_bytes(a).tobytes() == as_bytes(b).tobytes(), name
    for name, text in TOKENIZER_FILES.items():
        assert (tmp_path / "out" / name).read_text() == text


def test_shards_and_index(examples, tmp_path):
    report = fp4pass.checkpoint.convert(examples["deepseek"], tmp_path / "out", max_shard_bytes=40_000,
                                        input_scale=W4A4_SCALE)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    out = Folder(tmp_path / "out")
    assert len(out.files) == len(report["shards"]) > 2
    assert index["weight_map"] == out.where
    assert index["metadata"]["total_size"] == sum(s["bytes"] for s in report["shards"])
    one = fp4pass.checkpoint.convert(examples["deepseek"], tmp_path / "one", max_shard_bytes=10**9,
                                     input_scale=W4A4_SCALE)
    assert [s["file"] for s in one["shards"]] == ["model.safetensors"]
    assert not (tmp_path / "one" / "model.safetensors.index.json").exists()


@pytest.mark.parametrize("fmt", ["modelopt", "compressed-tensors"])
def test_configs(examples, tmp_path, fmt):
    fp4pass.checkpoint.convert(examples["compressed-tensors"], tmp_path / "w", format=fmt)
    fp4pass.checkpoint.convert(examples["compressed-tensors"], tmp_path / "a", format=fmt, input_scale=1.0)
    for name, with_input in (("w", False), ("a", True)):
        config = json.loads((tmp_path / name / "config.json").read_text())
        q = config["quantization_config"]
        group = q["config_groups"]["group_0"]
        assert (group["input_activations"] is not None) == with_input
        assert config["hidden_size"] == 64  # the rest of config.json kept
        ignore = q["exclude_modules"] if fmt == "modelopt" else q["ignore"]
        text = " ".join(ignore).replace("\\", "")
        for kept in ("lm_head", "embed_tokens", "mlp.gate", "layernorm", "norm"):
            assert kept in text
        assert not any("experts" in i and "shared" not in i for i in ignore)
        if fmt == "modelopt":
            # weight-only is W4A16_NVFP4 (SGLang and TensorRT-LLM run "NVFP4" as W4A4)
            assert q["quant_method"] == "modelopt" and q["quant_algo"] == ("NVFP4" if with_input else "W4A16_NVFP4")
            hf = json.loads((tmp_path / name / "hf_quant_config.json").read_text())
            assert hf["quantization"]["quant_algo"] == q["quant_algo"] and hf["quant_method"] == "modelopt"
            assert set(hf["quantization"]) == {"quant_algo", "kv_cache_quant_algo", "group_size", "exclude_modules"}
            assert hf["quantization"]["kv_cache_quant_algo"] is None and hf["quantization"]["group_size"] == 16
            assert hf["producer"] == {"name": "fp4pass", "version": fp4pass.__version__}
            assert q["producer"] == hf["producer"]
        else:
            assert q["quant_method"] == "compressed-tensors" and q["format"] == "nvfp4-pack-quantized"
            assert not (tmp_path / name / "hf_quant_config.json").exists()


def test_ct_ignore_matches_with_compressed_tensors(examples, tmp_path):
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.utils.match import match_name

    fp4pass.checkpoint.convert(examples["compressed-tensors"], tmp_path / "o", format="compressed-tensors")
    ignore = json.loads((tmp_path / "o" / "config.json").read_text())["quantization_config"]["ignore"]
    out = Folder(tmp_path / "o")
    converted = {n.rpartition(".")[0] for n in out.keys() if n.endswith(".weight_packed")}
    kept = {n.rpartition(".")[0] for n in out.keys() if n.endswith(".weight")}
    assert converted and kept
    for module in converted:
        assert not any(match_name(module, i) for i in ignore), module
    for module in kept:
        assert any(match_name(module, i) for i in ignore), module


def test_scales_json_fills_missing_experts(examples, tmp_path):
    from fp4pass.calib import ActivationScales
    from fp4pass.calib.scales import ActivationScale

    def entry(scale):
        return ActivationScale(amax=scale * 2688, g_amax=scale * 2688, input_scale=scale, b_min=0.0, b_max=1.0,
                               blocks=1)

    layer = "model.layers.0.mlp.experts"
    tensors = {f"{layer}.0.w1": entry(0.5), f"{layer}.0.w3": entry(0.75), f"{layer}.1.w2": entry(2.0),
               f"{layer}.0.w2": entry(3.0), "model_layers_0_self_attn_o_proj": entry(0.125),
               "model.layers.1.self_attn.o_proj": entry(0.0625), "some.other.activation": entry(9.0)}
    for e in range(3):
        for p in ("w1", "w2"):
            tensors.setdefault(f"model.layers.1.mlp.experts.{e}.{p}", entry(0.01 * (e + 1)))
    path = tmp_path / "scales.json"
    ActivationScales("max", tensors).save(path)
    report = fp4pass.checkpoint.convert(examples["compressed-tensors"], tmp_path / "out", scales=path)
    out = Folder(tmp_path / "out")
    values = {n[: -len(".input_scale")]: float(out.get(n)) for n in out.keys() if n.endswith(".input_scale")}
    assert all(math.isfinite(v) and v > 0 for v in values.values())
    assert len(values) == report["summary"]["tensors_converted"]
    assert values[f"{layer}.0.w1"] == values[f"{layer}.0.w3"] == 0.75  # the pair takes the larger
    assert values[f"{layer}.1.w1"] == values[f"{layer}.2.w3"] == 0.75  # never routed: the layer's max
    assert values[f"{layer}.2.w2"] == 3.0 and values[f"{layer}.1.w2"] == 2.0
    assert values["model.layers.0.self_attn.o_proj"] == 0.125
    filled = {f["module"] for f in report["input_scales"]["filled_from_layer_max"]}
    assert f"{layer}.1.w1" in filled and f"{layer}.2.w2" in filled and f"{layer}.0.w1" not in filled
    assert report["input_scales"]["unmatched_keys"] == ["some.other.activation"]
    assert report["input_scales"]["source"] == str(path)


def _scales_file(path, values: dict[str, float]):
    from fp4pass.calib import ActivationScales
    from fp4pass.calib.scales import ActivationScale

    ActivationScales("max", {k: ActivationScale(amax=v * 2688, g_amax=v * 2688, input_scale=v, b_min=0.0, b_max=1.0,
                                                blocks=1) for k, v in values.items()}).save(path)
    return path


def test_scales_json_keys_of_every_spelling_meet_on_one_module(examples, tmp_path):
    """Dotted names, fx names (``.`` as ``_``), each with ``.input`` / ``_input``; two keys of one module give
    the larger value; a filled expert's report entry names its layer and projection."""
    layer = "model.layers.0.mlp.experts"
    path = _scales_file(tmp_path / "scales.json", {
        f"{layer}.0.w1.input": 0.5, "model_layers_0_mlp_experts_0_w3_input": 0.25,  # one pair: 0.5 both
        "model_layers_0_mlp_experts_1_w2": 0.375, f"{layer}.1.w2": 0.1875,  # one module twice: the larger
        "model.layers.0.self_attn.o_proj_input": 0.125, "model.layers.1.self_attn.o_proj": 0.0625,
        **{f"model.layers.1.mlp.experts.{e}.{p}": 0.01 * (e + 1) for e in range(3) for p in ("w1", "w2")}})
    report = fp4pass.checkpoint.convert(examples["compressed-tensors"], tmp_path / "out", scales=path)
    out = Folder(tmp_path / "out")

    def scale(module):
        return float(out.get(f"{module}.input_scale"))

    assert scale(f"{layer}.0.w1") == scale(f"{layer}.0.w3") == 0.5
    assert scale(f"{layer}.1.w2") == scale(f"{layer}.0.w2") == scale(f"{layer}.2.w2") == 0.375
    assert scale("model.layers.0.self_attn.o_proj") == 0.125 and scale("model.layers.1.self_attn.o_proj") == 0.0625
    assert {"module": f"{layer}.2.w2", "from_layer": "model.layers.0.mlp", "projection": "w2", "input_scale": 0.375} in \
        report["input_scales"]["filled_from_layer_max"]
    assert report["input_scales"]["unmatched_keys"] == []


@pytest.mark.parametrize("case", ["zero", "dense missing", "gpt-oss stack missing"])
def test_scales_json_that_cannot_give_every_module_a_scale_is_one_line(examples, tmp_path, case):
    from fp4pass.safetensors.files import CheckpointError

    form = "gpt-oss" if case == "gpt-oss stack missing" else "compressed-tensors"
    if form == "gpt-oss":
        values = {"model.layers.0.mlp.experts.gate_up_proj": 1.0, "model.layers.0.mlp.experts.down_proj": 1.0,
                  "model.layers.1.mlp.experts.gate_up_proj": 1.0, "model.layers.0.self_attn.o_proj": 1.0,
                  "model.layers.1.self_attn.o_proj": 1.0}
        message = (r"scales.json: no input scale for model.layers.1.mlp.experts.down_proj \(not one expert of many, "
                   r"so there is none to borrow\); calibrate it or give --input-scale$")
    else:
        values = {f"model.layers.{i}.mlp.experts.0.{p}": 1.0 for i in range(2) for p in ("w1", "w2")}
        values["model.layers.1.self_attn.o_proj"] = 1.0
        if case == "zero":  # a value no SCALES.json file can hold (its reader refuses it first)
            from types import SimpleNamespace

            from fp4pass.safetensors.catalog import Catalog
            from fp4pass.checkpoint.detect import detect
            from fp4pass.checkpoint.input_scales import resolve_input_scales

            with Catalog.open(examples[form]) as catalog:
                units = detect(catalog.tensors, catalog.config).units
            zero = SimpleNamespace(tensors={"model.layers.0.self_attn.o_proj": SimpleNamespace(input_scale=0.0)})
            with pytest.raises(CheckpointError, match=r"^s.json: tensor 'model.layers.0.self_attn.o_proj': "
                                                      r"input_scale 0.0 is not a finite positive number$"):
                resolve_input_scales(units, scales=zero, scales_path="s.json")
            return
        else:
            message = (r"scales.json: no input scale for model.layers.0.self_attn.o_proj \(not one expert of many, "
                       r"so there is none to borrow\); calibrate it or give --input-scale$")
    path = _scales_file(tmp_path / "scales.json", values)
    with pytest.raises(CheckpointError, match=message):
        fp4pass.checkpoint.convert(examples[form], tmp_path / "out", scales=path)
    assert not (tmp_path / "out").exists()


def test_a_constant_input_scale_is_everywhere_and_named_in_the_report(examples, tmp_path):
    report = fp4pass.checkpoint.convert(examples["compressed-tensors"], tmp_path / "out", input_scale=0.375)
    out = Folder(tmp_path / "out")
    values = [float(out.get(n)) for n in out.keys() if n.endswith(".input_scale")]
    assert len(values) == report["summary"]["tensors_converted"] and set(values) == {0.375}
    assert report["input_scales"] == {"source": "constant", "filled_from_layer_max": [], "unmatched_keys": []}


@pytest.mark.parametrize("value", [0.0, -1.0, math.inf, -math.inf, math.nan, "1.0"])
def test_an_input_scale_that_is_not_finite_and_positive_is_refused(value):
    from fp4pass.checkpoint.input_scales import resolve_input_scales
    from fp4pass.safetensors.files import CheckpointError

    with pytest.raises(CheckpointError, match=r"^--input-scale: input_scale .* is not a finite positive number$"):
        resolve_input_scales([], constant=value)


def test_a_constant_and_a_scales_file_together_are_refused(tmp_path):
    from fp4pass.calib import ActivationScales
    from fp4pass.checkpoint.input_scales import resolve_input_scales
    from fp4pass.safetensors.files import CheckpointError

    with pytest.raises(CheckpointError, match=r"^give either a constant input scale or a SCALES.json, not both$"):
        resolve_input_scales([], constant=1.0, scales=ActivationScales("max", {}))


def test_lossy_expert_keeps_neighbours_exact_and_beats_requant(tmp_path):
    src_dir = build_checkpoint(tmp_path / "src", "deepseek", layers=1, experts=3, hidden=64, intermediate=64,
                               seed=5, lossy_expert=(0, 1))
    report = fp4pass.checkpoint.convert(src_dir, tmp_path / "out", check=True, input_scale=W4A4_SCALE)
    assert report["check"]["passed"]
    src, out = Folder(src_dir), Folder(tmp_path / "out")
    linears, _ = _sources(src, "deepseek")
    lossy = "layers.0.ffn.experts.1.w1"
    for module, (codes, e8m0) in linears.items():
        x = mx_decode(codes, e8m0)
        y, _ = _decoded_linear(out, module, "modelopt")
        if module == lossy:
            sse = float(((y - x) ** 2).sum())
            assert 0 < sse <= requant_sse(x)
        else:
            np.testing.assert_array_equal(y, x, err_msg=module)
    entry = {t["name"]: t for t in report["tensors"]}
    assert not entry[lossy]["lossless"] and entry[lossy]["snr_db"] > 0
    assert report["summary"]["experts_lossless"] == report["summary"]["experts_total"] - 1


def test_lossy_gpt_oss_stack_figures_per_expert(tmp_path):
    src_dir = build_checkpoint(tmp_path / "src", "gpt-oss", layers=1, experts=3, hidden=64, intermediate=64, seed=5,
                               lossy_expert=(0, 2), expert_step=4)
    report = fp4pass.checkpoint.convert(src_dir, tmp_path / "out", check=True)
    stack = [t for t in report["tensors"] if t["name"].endswith("gate_up_proj")][0]
    assert [p["lossless"] for p in stack["per_expert"]] == [True, True, False]
    assert stack["experts_lossless"] == 2 and report["check"]["passed"]


def test_inspect(examples):
    info = fp4pass.checkpoint.inspect(examples["gpt-oss"])
    assert info["input_forms"] == ["gpt-oss"] and not info["compressed_tensors_possible"]
    names = {w["name"] for w in info["weights"]}
    assert "model.layers.0.mlp.experts.gate_up_proj" in names and "model.layers.0.self_attn.o_proj" in names
    assert "lm_head.weight" in info["copied"]


@pytest.mark.parametrize("method", ["requant", "hybrid"])
def test_other_methods_pass_the_check(tmp_path, method):
    src_dir = build_checkpoint(tmp_path / "src", "compressed-tensors", layers=1, experts=2, hidden=64,
                               intermediate=64, seed=4, lossy_expert=(0, 1))
    report = fp4pass.checkpoint.convert(src_dir, tmp_path / "out", method=method, check=True)
    assert report["check"]["passed"]
    lossless = report["summary"]["experts_lossless"]
    assert lossless == (0 if method == "requant" else report["summary"]["experts_total"] - 1)


def test_exclude_list_never_covers_a_converted_module():
    import fnmatch

    from fp4pass.checkpoint.output_forms import exclude_list

    converted = [f"model.layers.{i}.mlp.experts.{e}.w{p}" for i in range(3) for e in range(4) for p in (1, 2, 3)]
    converted.append("model.layers.0.self_attn.o_proj")  # layer 0's o_proj is MXFP4, layer 1's and 2's are not
    kept = [f"model.layers.{i}.{m}" for i in range(3) for m in ("self_attn.q_proj", "mlp.gate", "input_layernorm")]
    kept += ["model.layers.1.self_attn.o_proj", "model.layers.2.self_attn.o_proj", "lm_head", "model.embed_tokens"]
    patterns = exclude_list(kept, converted)
    # exact names where the parent holds a converted module, a prefix wildcard where it holds none; never an
    # index glob (the engines try globs against a fused module's own name only: qkv_proj would be missed)
    assert "model.layers.0.self_attn.q_proj" in patterns and "model.layers.1.self_attn*" in patterns
    assert not any("*" in p[:-1] for p in patterns)
    for module in kept:
        assert any(fnmatch.fnmatchcase(module, p) for p in patterns), module
    for module in converted:
        assert not any(fnmatch.fnmatchcase(module, p) for p in patterns), module


def test_gpt_oss_stack_taller_than_two_strips(tmp_path):
    """N = 2I = 576 rows: the transposition runs in strips of 256 rows split between two threads, the last strip
    ragged; every expert's bytes are the source's transposed, byte for byte, and its scales decode alike."""
    src_dir = build_checkpoint(tmp_path / "src", "gpt-oss", seed=7, layers=1, experts=3, hidden=64, intermediate=288)
    fp4pass.checkpoint.convert(src_dir, tmp_path / "out", format="modelopt")
    src, out = Folder(src_dir), Folder(tmp_path / "out")
    _, stacks = _sources(src, "gpt-oss")
    stack = "model.layers.0.mlp.experts.gate_up_proj"
    codes, e8m0 = stacks[stack]
    assert codes.shape == (3, 576, 32)
    w, s = as_bytes(out.get(stack)), as_bytes(out.get(f"{stack}_weight_scale"))
    x = mx_decode(codes, e8m0)
    s2 = float(out.get(f"{stack}_weight_scale_2"))
    for i in range(3):
        np.testing.assert_array_equal(w[i], np.ascontiguousarray(codes[i].T), err_msg=f"{stack}[{i}]")
        np.testing.assert_array_equal(nv_decode(w[i].T, s[i].T, s2), x[i], err_msg=f"{stack}[{i}]")


@pytest.mark.parametrize("lossy", [None, (0, 1)], ids=["lossless", "lossy"])
def test_gpt_oss_stacks_written_past_the_page_cache_are_the_same_bytes(tmp_path, monkeypatch, lossy):
    """Experts of 15360 bytes ([160 * 2, 96 / 2], 3 blocks and a part): their whole 4 KiB blocks go to the disk
    directly, at a different phase for each expert. The folder is byte for byte the one written all through
    the page cache, and lossless codes are the source's transposed."""
    from fp4pass.safetensors import files as safetensors_io

    src_dir = build_checkpoint(tmp_path / "src", "gpt-oss", seed=3, layers=1, experts=3, hidden=96,
                               intermediate=160, lossy_expert=lossy)
    require_direct_writes(tmp_path)
    direct = []
    real_pwrite = os.pwrite
    monkeypatch.setattr(os, "pwrite", lambda fd, data, offset: direct.append(len(data)) or real_pwrite(fd, data, offset))
    fp4pass.checkpoint.convert(src_dir, tmp_path / "direct", format="modelopt")
    monkeypatch.setattr(safetensors_io, "_open_direct", lambda path: -1)
    fp4pass.checkpoint.convert(src_dir, tmp_path / "cached", format="modelopt")
    assert sum(direct) >= 3 * 2 * safetensors_io.DIRECT_ALIGN  # at least two blocks of each gate_up expert
    contents = [{name: entry[0] for name, entry in tree_hash(tmp_path / d).items()} for d in ("direct", "cached")]
    assert contents[0] == contents[1] and "model.safetensors" in contents[0]  # sha256 of each file
    if lossy is None:
        src, out = Folder(src_dir), Folder(tmp_path / "direct")
        codes, _ = _sources(src, "gpt-oss")[1]["model.layers.0.mlp.experts.gate_up_proj"]
        w = as_bytes(out.get("model.layers.0.mlp.experts.gate_up_proj"))
        for i in range(3):
            np.testing.assert_array_equal(w[i], np.ascontiguousarray(codes[i].T))


def test_effort_and_threads_reach_every_unit_by_argument(tmp_path, monkeypatch):
    """``fp4pass.checkpoint.convert(effort=, threads=)`` names both to each unit's conversion; a later call
    that names neither gets the defaults (no process-wide setting)."""
    import fp4pass.checkpoint.engine as engine
    from fp4pass.examples.checkpoints import build_checkpoint

    seen = spy_conversion_options(monkeypatch, engine)
    for form in ("deepseek", "gpt-oss"):  # Linears and gpt-oss stacks
        src = build_checkpoint(tmp_path / f"src-{form}", form, layers=1, experts=2, hidden=64, intermediate=32)
        seen.clear()
        fp4pass.checkpoint.convert(src, tmp_path / f"a-{form}", effort="fast", threads=2, input_scale=W4A4_SCALE)
        assert seen and set(seen) == {("fast", 2)}, form
        seen.clear()
        fp4pass.checkpoint.convert(src, tmp_path / f"b-{form}", input_scale=W4A4_SCALE)
        assert seen and set(seen) == {("best", 1)}, form


def test_a_failing_unit_waits_for_the_write_in_flight(tmp_path, monkeypatch):
    """The writer thread writes unit i while unit i + 1 is converted: when that conversion fails, the shard is
    closed only after the write in flight has ended (never under it), the conversion's error is the one raised,
    and no output folder is left."""
    import threading
    import time

    import fp4pass.checkpoint.engine as engine
    from fp4pass.safetensors import files as safetensors_io
    from fp4pass.safetensors.files import CheckpointError

    src = build_checkpoint(tmp_path / "src", "deepseek", layers=1, experts=3, hidden=64, intermediate=32)
    events = []
    real_copy, real_abort, real_convert = (safetensors_io.ShardWriter.copy_from, safetensors_io.ShardWriter.abort,
                                           engine.convert_linears)
    calls = {"n": 0}

    def slow_copy(self, *args, **kwargs):
        events.append(("start", None))
        time.sleep(0.3)
        real_copy(self, *args, **kwargs)
        events.append(("copied", threading.current_thread() is threading.main_thread()))

    def abort(self):
        events.append(("abort", None))
        real_abort(self)

    def convert(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            time.sleep(0.05)  # the first unit's write has started
            raise CheckpointError("planted failure of the second unit")
        return real_convert(*args, **kwargs)

    monkeypatch.setattr(safetensors_io.ShardWriter, "copy_from", slow_copy)
    monkeypatch.setattr(safetensors_io.ShardWriter, "abort", abort)
    monkeypatch.setattr(engine, "convert_linears", convert)
    with pytest.raises(CheckpointError, match="planted failure"):
        fp4pass.checkpoint.convert(src, tmp_path / "out", input_scale=W4A4_SCALE)
    assert not (tmp_path / "out").exists()
    before_close = events[:events.index(("abort", None))]
    started = before_close.count(("start", None))
    assert started >= 2, events  # a copied tensor, then the first unit's codes: its write was in flight
    assert before_close.count(("copied", False)) == started, events  # all ended in the writer thread first


def test_at_most_one_unit_waits_for_the_writer(tmp_path, monkeypatch):
    """Memory holds two units at most: the one being converted and the one being written."""
    import time

    import fp4pass.checkpoint.engine as engine
    import fp4pass.checkpoint.shards as shards

    src = build_checkpoint(tmp_path / "src", "deepseek", layers=1, experts=4, hidden=64, intermediate=32)
    state = {"held": 0, "most": 0}
    real_convert, real_write = engine.convert_linears, shards._write_linears

    def convert(*args, **kwargs):
        out = real_convert(*args, **kwargs)
        state["held"] += 1
        state["most"] = max(state["most"], state["held"])
        return out

    def write(*args, **kwargs):
        time.sleep(0.05)  # a slow disk: the converting thread runs ahead if nothing holds it back
        real_write(*args, **kwargs)
        state["held"] -= 1

    monkeypatch.setattr(engine, "convert_linears", convert)
    monkeypatch.setattr(shards, "_write_linears", write)
    report = fp4pass.checkpoint.convert(src, tmp_path / "out", input_scale=W4A4_SCALE)
    assert report["summary"]["tensors_converted"] >= 8
    assert state["held"] == 0 and state["most"] == 2


def test_units_written_in_plan_order_by_the_writer(tmp_path):
    """With the writer thread, every tensor still lands where the header says (a reader we did not write reads
    each one back equal to what a one-thread copy holds)."""
    from safetensors import safe_open

    src = build_checkpoint(tmp_path / "src", "compressed-tensors", layers=2, experts=3, hidden=64,
                           intermediate=96, seed=3, dense=True, shard_bytes=40_000)
    fp4pass.checkpoint.convert(src, tmp_path / "out", format="compressed-tensors")
    names = {}
    for shard in sorted((tmp_path / "out").glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for key in f.keys():
                names[key] = f.get_tensor(key)
    source = {}
    for shard in sorted(src.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for key in f.keys():
                source[key] = f.get_tensor(key)
    packed = [k for k in source if k.endswith(".weight_packed")]
    assert len(packed) >= 6
    for key in packed:  # lossless units: the codes are the source's bytes, whichever unit they belong to
        assert torch.equal(names[key], source[key]), key
    for key in source:
        if not key.endswith((".weight_packed", ".weight_scale")):
            assert torch.equal(names[key], source[key]), key


@pytest.mark.parametrize("form,fmt", COMBOS)
def test_report_outputs_and_shard_metadata_are_what_the_files_hold(examples, tmp_path, form, fmt):
    """Every output the report names for a converted weight is in the written shards (safetensors' own reader),
    every shard says ``{"format": "pt"}`` (transformers refuses a safetensors file without it), and the
    index maps every tensor to the shard that holds it."""
    from safetensors import safe_open

    report = fp4pass.checkpoint.convert(examples[form], tmp_path / "out", format=fmt, input_scale=0.25,
                                        max_shard_bytes=30_000)
    held = {}
    for shard in sorted((tmp_path / "out").glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}, shard.name
            held.update({key: shard.name for key in f.keys()})
    named = [name for t in report["tensors"] for name in t["outputs"]]
    assert named and set(named) <= set(held)
    suffixes = {name.rpartition(".")[2] for name in named}
    assert ("weight_packed" in suffixes) == (fmt == "compressed-tensors")
    assert len(set(held.values())) > 1
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == held


def test_a_gpt_oss_stack_waits_for_the_write_before_it(tmp_path, monkeypatch):
    """gpt-oss stacks are written by the converting thread itself: it must wait for the writer thread's unit
    in flight first (a slow copy just before the stack), or the two would write the shard at once."""
    import time

    from fp4pass.safetensors import files as safetensors_io

    src_dir = build_checkpoint(tmp_path / "src", "gpt-oss", layers=2, experts=3, hidden=64, intermediate=32, seed=5)
    real_copy = safetensors_io.ShardWriter.copy_from

    def slow_copy(self, *args, **kwargs):
        time.sleep(0.05)
        real_copy(self, *args, **kwargs)

    monkeypatch.setattr(safetensors_io.ShardWriter, "copy_from", slow_copy)
    fp4pass.checkpoint.convert(src_dir, tmp_path / "out")
    src, out = Folder(src_dir), Folder(tmp_path / "out")
    _, stacks = _sources(src, "gpt-oss")
    assert stacks
    for stack, (codes, scales) in stacks.items():
        w = as_bytes(out.get(stack))
        s2 = float(out.get(f"{stack}_weight_scale_2"))
        s = as_bytes(out.get(f"{stack}_weight_scale"))
        x = mx_decode(codes, scales)
        for i in range(codes.shape[0]):
            np.testing.assert_array_equal(nv_decode(w[i].T, s[i].T, s2), x[i], err_msg=f"{stack}[{i}]")
    for name in src.keys():  # the copied tensors around the stacks, byte for byte
        if not name.endswith(("_blocks", "_scales")):
            np.testing.assert_array_equal(as_bytes(out.get(name)), as_bytes(src.get(name)), err_msg=name)


@pytest.mark.parametrize("form,fmt", COMBOS)
def test_report_entries_name_their_source(examples, tmp_path, form, fmt):
    """Each converted weight's report entry names its input form, its source tensors, the shard that holds them
    and their shape, as the source folder has them (read through safetensors and the source's index); with an
    input scale it lists that scale, and its outputs include the input-scale tensor."""
    src = examples[form]
    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    report = fp4pass.checkpoint.convert(src, tmp_path / "out", format=fmt, input_scale=0.25)
    source = Folder(src)
    assert report["tensors"]
    for t in report["tensors"]:
        assert t["form"] == form
        codes, scales = t["source"]
        assert index[codes] == t["shard"] and codes in source.keys() and scales in source.keys()
        shape = source.shape(codes)
        if form == "gpt-oss":
            want = [*shape[:-2], shape[-2] * shape[-1] * 2]  # blocks [.., N, K/32, 16] hold K values per row
        else:
            want = [*shape[:-1], shape[-1] * 2]  # packed [N, K/2]
        assert t["shape"] == want, t["name"]
        assert t["input_scale"] == 0.25
        wanted = {"modelopt": "input_scale", "compressed-tensors": "input_global_scale"}[fmt]
        assert any(o.endswith(wanted) for o in t["outputs"]), t["outputs"]


@pytest.mark.parametrize("fmt", ["modelopt", "compressed-tensors"])
def test_allow_partial_leaves_a_nan_scaled_compressed_tensors_expert_in_mxfp4_and_writes_the_rest(tmp_path, fmt):
    """An E8M0 255 (NaN) in one expert's w1 of a compressed-tensors MXFP4 checkpoint: with allow_partial the
    w1/w3 pair stays as it was (U8 codes, U8 E8M0 scales: MXFP4 by its dtypes, never read as a broken NVFP4
    module of the output), every other weight converts, and the output validates."""
    import shutil

    from checkpoint_oracles import rewrite_shard

    src = tmp_path / "src"
    shutil.copytree(os.path.join(os.path.dirname(os.path.dirname(__file__)), "..", "models", "checkpoints", "deepseek_v3"), src)
    w1 = "model.layers.1.mlp.experts.0.w1"

    def nan_scale(tensors):
        tensors[f"{w1}.weight_scale"] = tensors[f"{w1}.weight_scale"].clone()
        tensors[f"{w1}.weight_scale"][0, 0] = 255

    rewrite_shard(src / "model.safetensors", nan_scale)
    report = fp4pass.checkpoint.convert(src, tmp_path / "out", format=fmt, allow_partial=True)
    declined = sorted(d["tensor"] for d in report["declined"])
    assert declined == [f"{w1}.weight_packed", "model.layers.1.mlp.experts.0.w3.weight_packed"], declined
    out, source = Folder(tmp_path / "out"), Folder(src)
    for name in (f"{w1}.weight_packed", f"{w1}.weight_scale"):
        assert out.dtype(name) == "U8" and np.array_equal(as_bytes(out.get(name)), as_bytes(source.get(name)))
    assert report["summary"]["experts_total"] == 18
    from fp4pass.checkpoint.validate import validate

    assert [p for p in validate(tmp_path / "out")["problems"] if p["severity"] == "error"] == []
