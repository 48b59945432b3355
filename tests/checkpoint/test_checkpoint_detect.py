"""fp4pass.checkpoint.detect on shard headers alone: which tensors are MXFP4 weights in which form, how they pair,
and what is declined (with its exact reason). The headers are written here by hand; nothing is converted."""

from __future__ import annotations

import math

import pytest

from fp4pass.checkpoint.detect import COMPRESSED_TENSORS, DEEPSEEK, GPT_OSS, FusedExperts, Linear, detect
from fp4pass.safetensors.files import DTYPES, TensorEntry

SHARD = "model-00002-of-00003.safetensors"
DS_FP4 = {"expert_dtype": "fp4", "quantization_config": {"quant_method": "fp8"}}


def _header(*specs) -> dict:
    """name -> TensorEntry of (name, dtype, shape) triples, laid end to end in file order."""
    out, at = {}, 100
    for name, dtype, shape in specs:
        n = math.prod(shape) * DTYPES[dtype][1]
        out[name] = TensorEntry(name, dtype, tuple(shape), at, at + n, SHARD)
        at += n
    return out


def _ct(module, n, k, scale_dtype="U8"):
    return [(f"{module}.weight_packed", "U8", (n, k // 2)), (f"{module}.weight_scale", scale_dtype, (n, k // 32))]


def _ds(module, n, k, code_dtype="I8", scale_dtype="F8_E8M0"):
    return [(f"{module}.weight", code_dtype, (n, k // 2)), (f"{module}.scale", scale_dtype, (n, k // 32))]


def _shape(unit):
    return [(m.module, m.form, m.rows, m.cols) for m in (unit if isinstance(unit, tuple) else (unit,))]


def test_the_three_forms_in_file_order():
    tensors = _header(
        ("lm_head.weight", "BF16", (8, 64)),
        ("model.layers.0.mlp.experts.gate_up_proj_blocks", "U8", (4, 96, 2, 16)),
        ("model.layers.0.mlp.experts.gate_up_proj_scales", "U8", (4, 96, 2)),
        ("model.layers.0.self_attn.o_proj.weight_blocks", "U8", (64, 4, 16)),
        ("model.layers.0.self_attn.o_proj.weight_scales", "F8_E8M0", (64, 4)),
        ("model.layers.0.router_blocks", "U8", (8, 2, 16)),
        ("model.layers.0.router_scales", "U8", (8, 2)),
        *_ct("model.layers.1.mlp.experts.0.w2", 64, 96),
        ("model.layers.1.mlp.experts.0.w2.weight_shape", "I64", (2,)),
        *_ds("layers.2.ffn.experts.3.w2", 32, 128, code_dtype="U8", scale_dtype="U8"),
        *_ds("layers.2.attn.wo", 64, 64))
    found = detect(tensors, {})
    stack, o_proj, router, w2, ds_w2, wo = found.units
    assert isinstance(stack, FusedExperts)
    assert (stack.prefix, stack.proj, stack.name, stack.experts, stack.rows, stack.cols, stack.form) == (
        "model.layers.0.mlp.experts", "gate_up_proj", "model.layers.0.mlp.experts.gate_up_proj", 4, 96, 64, GPT_OSS)
    assert stack.consumed == ["model.layers.0.mlp.experts.gate_up_proj_blocks",
                              "model.layers.0.mlp.experts.gate_up_proj_scales"]
    assert _shape(o_proj) == [("model.layers.0.self_attn.o_proj", GPT_OSS, 64, 128)]
    assert (o_proj.codes.name, o_proj.scales.name) == ("model.layers.0.self_attn.o_proj.weight_blocks",
                                                       "model.layers.0.self_attn.o_proj.weight_scales")
    assert (ds_w2.codes.name, ds_w2.scales.name, wo.scales.name) == (
        "layers.2.ffn.experts.3.w2.weight", "layers.2.ffn.experts.3.w2.scale", "layers.2.attn.wo.scale")
    assert _shape(router) == [("model.layers.0.router", GPT_OSS, 8, 64)]
    assert _shape(w2) == [("model.layers.1.mlp.experts.0.w2", COMPRESSED_TENSORS, 64, 96)]
    assert w2.consumed == ["model.layers.1.mlp.experts.0.w2.weight_packed", "model.layers.1.mlp.experts.0.w2.weight_scale",
                           "model.layers.1.mlp.experts.0.w2.weight_shape"]
    assert _shape(ds_w2) == [("layers.2.ffn.experts.3.w2", DEEPSEEK, 32, 128)]
    assert ds_w2.consumed == ["layers.2.ffn.experts.3.w2.weight", "layers.2.ffn.experts.3.w2.scale"]
    assert _shape(wo) == [("layers.2.attn.wo", DEEPSEEK, 64, 64)]
    assert found.forms == {GPT_OSS, COMPRESSED_TENSORS, DEEPSEEK} and found.declined == []
    assert found.consumed == {n for n in tensors if n != "lm_head.weight"}
    assert (w2.codes.name, w2.scales.name) == ("model.layers.1.mlp.experts.0.w2.weight_packed",
                                               "model.layers.1.mlp.experts.0.w2.weight_scale")


def test_not_mxfp4_is_left_alone():
    """Integer weights with float scales, float weights named like DeepSeek's, biases: no unit, no decline; the
    MXFP4 weight after them is found."""
    tensors = _header(("layers.0.attn.wq.weight", "I8", (64, 32)), ("layers.0.attn.wq.scale", "F32", (64, 2)),
                      ("layers.0.attn.wkv.weight", "F8_E4M3", (64, 64)), ("layers.0.attn.wkv.scale", "F8_E8M0", (1, 1)),
                      ("layers.0.norm.weight", "U8", (64,)), ("embed.weight", "BF16", (8, 64)),
                      *_ds("layers.0.attn.wo", 64, 64))
    found = detect(tensors, DS_FP4)
    assert [_shape(u) for u in found.units] == [[("layers.0.attn.wo", DEEPSEEK, 64, 64)]]
    assert found.declined == [] and found.consumed == {"layers.0.attn.wo.weight", "layers.0.attn.wo.scale"}
    assert found.forms == {DEEPSEEK}


@pytest.mark.parametrize("naming", [("w1", "w3", "w2"), ("gate_proj", "up_proj", "down_proj")])
@pytest.mark.parametrize("form", ["ct", "ds"])
@pytest.mark.parametrize("gate_first", [False, True])
def test_gate_and_up_pair_in_both_namings(naming, form, gate_first):
    make = _ct if form == "ct" else _ds
    gate, up, down = (f"model.layers.0.mlp.experts.5.{p}" for p in naming)
    order = (gate, up, down) if gate_first else (up, down, gate)
    found = detect(_header(*(spec for m in order for spec in make(m, 64 if m == down else 32,
                                                                    32 if m == down else 64))), {})
    f = COMPRESSED_TENSORS if form == "ct" else DEEPSEEK
    pair, single = found.units if gate_first else found.units[::-1]  # a pair stands where its gate stands
    assert _shape(pair) == [(gate, f, 32, 64), (up, f, 32, 64)] and _shape(single) == [(down, f, 64, 32)]
    assert [m.role for m in pair] == ["gate", "up"] and single.role == "down"
    assert [m.fill_group for m in pair] == [("model.layers.0.mlp", "gate_up")] * 2
    assert single.fill_group == ("model.layers.0.mlp", naming[2])


def test_what_does_not_pair():
    """A gate pairs with the up of its own naming, parent and shape only; a module outside ``experts`` has no
    fill group; names at the top level pair too."""
    tensors = _header(*_ct("w1", 32, 64), *_ct("w3", 32, 64),  # the top level: a pair, and more after it
                      *_ct("a.w1", 32, 64), *_ct("a.up_proj", 32, 64),  # two namings: no pair
                      *_ct("b.w1", 32, 64), *_ct("b.w3", 64, 64),  # two shapes: no pair
                      *_ct("c.gate_proj", 32, 64), *_ct("d.up_proj", 32, 64))  # two parents: no pair
    units = detect(tensors, {}).units
    assert [[m.module for m in (u if isinstance(u, tuple) else (u,))] for u in units] == [
        ["w1", "w3"], ["a.w1"], ["a.up_proj"], ["b.w1"], ["b.w3"], ["c.gate_proj"], ["d.up_proj"]]
    assert units[1].fill_group is None and units[1].role == "gate" and units[2].role == "up"
    assert Linear("x.experts.0.q", DEEPSEEK, None, None, 1, 32).role is None
    assert Linear("l.experts.7.q", DEEPSEEK, None, None, 1, 32).fill_group == ("l", "q")


BOTH = "(the pair shares one global scale and one input scale: both or neither)"
# (the header, the config, the declines {tensor: reason}, the modules converted)
E = "model.layers.0.mlp.experts"
DECLINES = {
    "gpt-oss scales missing": (
        [(f"{E}.down_proj_blocks", "U8", (2, 64, 2, 16))], {},
        {f"{E}.down_proj_blocks": f"MXFP4 codes without their scales tensor '{E}.down_proj_scales'"}, []),
    "gpt-oss dtypes": (
        [(f"{E}.down_proj_blocks", "I8", (2, 64, 2, 16)), (f"{E}.down_proj_scales", "U8", (2, 64, 2)),
         (f"{E}.up_blocks", "U8", (2, 64, 2, 16)), (f"{E}.up_scales", "F32", (2, 64, 2))], {},
        {f"{E}.down_proj_blocks": "blocks I8 / scales U8: not uint8 E2M1 codes with E8M0 scales",
         f"{E}.up_blocks": "blocks U8 / scales F32: not uint8 E2M1 codes with E8M0 scales"}, []),
    "gpt-oss shapes": (
        [("a_blocks", "U8", (64, 2, 15)), ("a_scales", "U8", (64, 2)),
         ("b_blocks", "U8", (64, 16)), ("b_scales", "U8", (64,)),
         ("c_blocks", "U8", (2, 64, 2, 16)), ("c_scales", "U8", (2, 64, 3)),
         ("d_blocks", "U8", (1, 2, 8, 2, 16)), ("d_scales", "U8", (1, 2, 8, 2))], {},
        {"a_blocks": "gpt-oss blocks [64, 2, 15] do not match scales 'a_scales' [64, 2] (expected [..., N, K/32, 16] "
                     "and [..., N, K/32])",
         "b_blocks": "gpt-oss blocks [64, 16] do not match scales 'b_scales' [64] (expected [..., N, K/32, 16] and "
                     "[..., N, K/32])",
         "c_blocks": "gpt-oss blocks [2, 64, 2, 16] do not match scales 'c_scales' [2, 64, 3] (expected "
                     "[..., N, K/32, 16] and [..., N, K/32])",
         "d_blocks": "gpt-oss blocks of rank 5"}, []),
    "compressed-tensors": (
        [(f"{E}.0.w2.weight_packed", "U8", (64, 16)),
         (f"{E}.1.w2.weight_packed", "I8", (64, 16)), (f"{E}.1.w2.weight_scale", "U8", (64, 1)),
         *_ct(f"{E}.2.w2", 64, 32, scale_dtype="F8_E4M3"),
         (f"{E}.3.w2.weight_packed", "U8", (64, 16)), (f"{E}.3.w2.weight_scale", "U8", (32, 1)),
         (f"{E}.4.w2.weight_packed", "U8", (64, 16)), (f"{E}.4.w2.weight_scale", "U8", (64, 2)),
         (f"{E}.5.w2.weight_packed", "U8", (2, 64, 16)), (f"{E}.5.w2.weight_scale", "U8", (64, 1)),
         (f"{E}.6.w2.weight_packed", "U8", (64, 16)), (f"{E}.6.w2.weight_scale", "U8", (64,)),
         *_ct(f"{E}.7.w2", 64, 32)], {},
        {f"{E}.0.w2.weight_packed": f"MXFP4 codes without their scales tensor '{E}.0.w2.weight_scale'",
         f"{E}.1.w2.weight_packed": "weight_packed I8 with weight_scale U8: the names are compressed-tensors' MXFP4 form, the dtypes are not "
                                               "(expected U8 codes with U8 E8M0 block scales)",
         f"{E}.2.w2.weight_packed": "weight_packed U8 with weight_scale F8_E4M3: the names are compressed-tensors' (MXFP4 or NVFP4), the "
                                               "F8_E4M3 block scale is NVFP4's, not MXFP4's U8 E8M0: this weight is NVFP4 "
                                               "already (check the folder with fp4pass inspect)",
         f"{E}.3.w2.weight_packed": f"packed codes [64, 16] do not match scales '{E}.3.w2.weight_scale' [32, 1] "
                                    "(expected [N, K/2] and [N, K/32])",
         f"{E}.4.w2.weight_packed": f"packed codes [64, 16] do not match scales '{E}.4.w2.weight_scale' [64, 2] "
                                    "(expected [N, K/2] and [N, K/32])",
         f"{E}.5.w2.weight_packed": f"packed codes [2, 64, 16] do not match scales '{E}.5.w2.weight_scale' [64, 1] "
                                    "(expected [N, K/2] and [N, K/32])",
         f"{E}.6.w2.weight_packed": f"packed codes [64, 16] do not match scales '{E}.6.w2.weight_scale' [64] "
                                    "(expected [N, K/2] and [N, K/32])"}, [f"{E}.7.w2"]),
    "deepseek-v4 header and its pair": (
        [(f"{E}.0.w1.weight", "I8", (16, 64)), (f"{E}.0.w1.scale", "F8_E8M0", (32, 2)), *_ds(f"{E}.0.w3", 32, 64),
         *_ds(f"{E}.0.w2", 64, 32)], {},
        {f"{E}.0.w1.weight": f"packed codes [16, 64] do not match scales '{E}.0.w1.scale' [32, 2] (expected "
                             "[N, K/2] and [N, K/32])",
         f"{E}.0.w3.weight": f"the other half of its gate/up pair, {E}.0.w1, is declined (the pair shares one "
                             "global scale and one input scale: both or neither)"}, [f"{E}.0.w2"]),
    "pairs whose gate or up is declined": (
        [(f"{E}.0.w1.weight_packed", "U8", (32, 32)), *_ct(f"{E}.0.w3", 32, 64),
         *_ct("w1", 32, 64), ("w3.weight_packed", "U8", (32, 32)), ("w3.weight_scale", "U8", (32, 1)),
         *_ct("x.w1", 32, 64), *_ct("x.w3", 32, 64),
         ("a.gate_proj.weight_blocks", "U8", (32, 2, 16)), ("a.up_proj.weight_blocks", "U8", (32, 2, 16)),
         ("a.up_proj.weight_scales", "U8", (32, 2)),
         ("b.gate_proj.weight_blocks", "I8", (32, 2, 16)), ("b.gate_proj.weight_scales", "U8", (32, 2)),
         ("b.up_proj.weight_blocks", "U8", (32, 2, 16)), ("b.up_proj.weight_scales", "U8", (32, 2)),
         ("c.w1.weight_blocks", "U8", (32, 2, 15)), ("c.w1.weight_scales", "U8", (32, 2)),
         ("c.w3.weight_blocks", "U8", (32, 2, 16)), ("c.w3.weight_scales", "U8", (32, 2)),
         ("d.w1_blocks", "U8", (1, 1, 32, 2, 16)), ("d.w1_scales", "U8", (1, 1, 32, 2)),
         ("d.w3_blocks", "U8", (32, 2, 16)), ("d.w3_scales", "U8", (32, 2)),
         ("e.w1.weight_packed", "I8", (32, 32)), ("e.w1.weight_scale", "U8", (32, 2)), *_ct("e.w3", 32, 64)], {},
        {f"{E}.0.w1.weight_packed": f"MXFP4 codes without their scales tensor '{E}.0.w1.weight_scale'",
         f"{E}.0.w3.weight_packed": f"the other half of its gate/up pair, {E}.0.w1, is declined (the pair shares one "
                                    "global scale and one input scale: both or neither)",
         "w3.weight_packed": "packed codes [32, 32] do not match scales 'w3.weight_scale' [32, 1] (expected [N, K/2] "
                             "and [N, K/32])",
         "w1.weight_packed": "the other half of its gate/up pair, w3, is declined (the pair shares one global scale "
                             "and one input scale: both or neither)",
         "a.gate_proj.weight_blocks": "MXFP4 codes without their scales tensor 'a.gate_proj.weight_scales'",
         "a.up_proj.weight_blocks": "the other half of its gate/up pair, a.gate_proj, is declined (the pair shares "
                                    "one global scale and one input scale: both or neither)",
         "b.gate_proj.weight_blocks": "blocks I8 / scales U8: not uint8 E2M1 codes with E8M0 scales",
         "b.up_proj.weight_blocks": f"the other half of its gate/up pair, b.gate_proj, is declined {BOTH}",
         "c.w1.weight_blocks": "gpt-oss blocks [32, 2, 15] do not match scales 'c.w1.weight_scales' [32, 2] (expected "
                               "[..., N, K/32, 16] and [..., N, K/32])",
         "c.w3.weight_blocks": f"the other half of its gate/up pair, c.w1, is declined {BOTH}",
         "d.w1_blocks": "gpt-oss blocks of rank 5",
         "d.w3_blocks": f"the other half of its gate/up pair, d.w1, is declined {BOTH}",
         "e.w1.weight_packed": "weight_packed I8 with weight_scale U8: the names are compressed-tensors' MXFP4 form, the dtypes are not "
                                               "(expected U8 codes with U8 E8M0 block scales)",
         "e.w3.weight_packed": f"the other half of its gate/up pair, e.w1, is declined {BOTH}"}, ["x.w1", "x.w3"]),
    "deepseek scale missing, config says fp4": (
        [*_ds(f"{E}.0.gate_proj", 32, 64), (f"{E}.0.up_proj.weight", "I8", (32, 32)), *_ds(f"{E}.0.down_proj", 64, 32),
         ("layers.0.attn.wq.weight", "I8", (64, 32))], DS_FP4,
        {f"{E}.0.up_proj.weight": f"MXFP4 expert weight without its scales tensor '{E}.0.up_proj.scale'",
         f"{E}.0.gate_proj.weight": f"the other half of its gate/up pair, {E}.0.up_proj, is declined (the pair shares "
                                    "one global scale and one input scale: both or neither)"}, [f"{E}.0.down_proj"]),
    "deepseek scale missing, the other experts say fp4": (
        [*_ds(f"{E}.0.w2", 64, 32), (f"{E}.1.w2.weight", "U8", (64, 16)), (f"{E}.1.w9.weight", "U8", (64, 16)),
         ("model.layers.1.mlp.experts.1.w2.weight", "I8", (64, 16))], {},
        {f"{E}.1.w2.weight": f"MXFP4 expert weight without its scales tensor '{E}.1.w2.scale'"}, [f"{E}.0.w2"]),
}


@pytest.mark.parametrize("case", list(DECLINES))
def test_declines_and_their_reasons(case):
    specs, config, declined, converted = DECLINES[case]
    tensors = _header(*specs)
    found = detect(tensors, config)
    assert {d["tensor"]: d["reason"] for d in found.declined} == declined
    assert all(d["shard"] == SHARD for d in found.declined)
    first = [d["tensor"] for d in found.declined]
    primary = [t for t in first if "other half" not in declined[t]]
    assert first[:len(primary)] == sorted(primary, key=list(tensors).index)  # the causes first, in file order
    modules = [m.module for u in found.units for m in (u if isinstance(u, tuple) else (u,)) if hasattr(m, "module")]
    assert modules == converted
    held = {n for m in converted for n in tensors if n.startswith(m + ".")}
    assert found.consumed == held


@pytest.mark.parametrize("config,fp4", [
    ({"expert_dtype": "fp4", "quantization_config": {}}, True),
    ({"expert_dtype": "MXFP4", "quantization_config": {"quant_method": "fp8"}}, True),
    ({"quantization_config": {"expert_dtype": "Fp4"}}, True),
    ({"expert_dtype": "fp8", "quantization_config": {"expert_dtype": "fp4"}}, False),
    ({"expert_dtype": "fp4"}, False), ({"expert_dtype": "fp4", "quantization_config": "fp4"}, False),
    ({"quantization_config": {"quant_method": "fp8"}}, False)])
def test_which_configs_say_the_experts_are_fp4(config, fp4):
    tensors = _header(("layers.0.ffn.experts.0.w2.weight", "I8", (64, 16)))
    declined = detect(tensors, config).declined
    assert [d["tensor"] for d in declined] == (["layers.0.ffn.experts.0.w2.weight"] if fp4 else [])
