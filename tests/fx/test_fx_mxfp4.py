"""MXFP4Linear, MXFP4Experts and quantize_linears against numpy oracles and a loop written from the gpt-oss math.

Oracles: tests/support/oracles.py's numpy MXFP4 quantizer (OCP FLOOR rule), tests/support/conversion_oracle.py's decoder, and
the experts' math written out per token and expert (gate/up interleaved, clamped SwiGLU, biases).
"""

import numpy as np
import pytest
import torch

import fp4pass.fx
from conversion_oracle import mx_dequant, unpack
from fp4pass.errors import ShapeError
from fp4pass.fx.mxfp4 import MXFP4Experts, MXFP4Linear
from oracles import mx_quantize_np


def _decoded(blocks: torch.Tensor, scales: torch.Tensor) -> np.ndarray:
    b = blocks.numpy()
    return mx_dequant(unpack(b.reshape(*b.shape[:-2], -1)), scales.numpy()).astype(np.float32)


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(64, 96)
        self.fc2 = torch.nn.Linear(96, 32, bias=False)
        self.head = torch.nn.Linear(32, 10)
        self.odd = torch.nn.Linear(10, 4)  # in_features 10: not a multiple of 32, stays float

    def forward(self, x):
        return self.odd(self.head(torch.relu(self.fc2(torch.relu(self.fc1(x))))))


def test_quantize_linears_swaps_every_linear_it_can():
    torch.manual_seed(0)
    mlp = MLP()
    weights = {name: mlp.get_submodule(name).weight.detach().numpy().copy() for name in ("fc1", "fc2", "head")}
    model = fp4pass.fx.quantize_linears(mlp, scale_rule="floor", exclude=("head",))
    assert isinstance(model.fc1, MXFP4Linear) and isinstance(model.fc2, MXFP4Linear)
    assert type(model.head) is torch.nn.Linear and type(model.odd) is torch.nn.Linear
    for name in ("fc1", "fc2"):
        layer = model.get_submodule(name)
        codes, scales = mx_quantize_np(weights[name], "floor")
        assert np.array_equal(unpack(layer.weight_blocks.numpy().reshape(layer.out_features, -1)), codes)
        assert np.array_equal(layer.weight_scales.numpy(), scales)
    x = torch.randn(4, 64)
    h = torch.relu(x @ torch.from_numpy(_decoded(model.fc1.weight_blocks, model.fc1.weight_scales)).T + model.fc1.bias)
    h = torch.relu(h @ torch.from_numpy(_decoded(model.fc2.weight_blocks, model.fc2.weight_scales)).T)
    expected = model.odd(model.head(h))
    with torch.no_grad():
        torch.testing.assert_close(model(x), expected, rtol=1e-6, atol=1e-6)


def test_quantized_mlp_exports_one_dequant_per_weight_and_converts_losslessly():
    torch.manual_seed(0)
    model = fp4pass.fx.quantize_linears(MLP())
    x = torch.randn(4, 64)
    program = torch.export.export(model, (x,))
    targets = [n.target for n in program.graph.nodes]
    assert targets.count(torch.ops.fp4pass.dequantize_mxfp4.default) == 3
    out, report = fp4pass.fx.convert(program)
    assert report["summary"]["lossless"] == 3 and sorted(t["name"] for t in report["tensors"]) == [
        "fc1.weight", "fc2.weight", "head.weight"]
    with torch.no_grad():
        assert torch.equal(out.module()(x), model(x))


def test_quantize_linears_on_a_bare_linear_and_other_scale_rules():
    lin = torch.nn.Linear(32, 4)
    for rule in ("floor", "ceil", "even", "rceil"):
        q = fp4pass.fx.quantize_linears(lin, scale_rule=rule)
        _, scales = mx_quantize_np(lin.weight.detach().numpy(), rule)
        assert isinstance(q, MXFP4Linear) and np.array_equal(q.weight_scales.numpy(), scales)
    with pytest.raises(ShapeError, match="multiple of the MXFP4 block"):
        MXFP4Linear(48, 4)


def _loop_experts(x, w1, b1, w2, b2, indices, weights, alpha=1.702, limit=7.0):
    """gpt-oss experts per token and chosen expert, in float64 (w1 [E, 2I, H] rows interleave gate/up)."""
    x, w1, b1, w2, b2 = (torch.as_tensor(t, dtype=torch.float64) for t in (x, w1, b1, w2, b2))
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for slot in range(indices.shape[1]):
            e = int(indices[t, slot])
            gate_up = w1[e] @ x[t] + b1[e]
            gate, up = gate_up[0::2].clamp(max=limit), gate_up[1::2].clamp(-limit, limit)
            h = (up + 1) * gate * torch.sigmoid(alpha * gate)
            out[t] += float(weights[t, slot]) * (w2[e] @ h + b2[e])
    return out


def _random_experts(e, h, i, routed, seed=1):
    m = MXFP4Experts(e, h, i, routed=routed)
    for proj, shape in (("gate_up_proj", (e, 2 * i, h)), ("down_proj", (e, h, i))):
        codes, scales = mx_quantize_np(np.random.default_rng(seed).standard_normal(shape) * 0.5)
        packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
        getattr(m, f"{proj}_blocks").copy_(torch.from_numpy(packed.reshape(*shape[:2], -1, 16)))
        getattr(m, f"{proj}_scales").copy_(torch.from_numpy(scales))
    with torch.no_grad():
        m.gate_up_proj_bias.normal_()
        m.down_proj_bias.normal_()
    return m


@pytest.mark.parametrize("routed", [False, True])
def test_experts_match_the_gpt_oss_math_written_per_token(routed):
    torch.manual_seed(0)
    e, h, i, t = 4, 64, 32, 6
    m = MXFP4Experts(e, h, i, routed=routed)
    for proj, shape in (("gate_up_proj", (e, 2 * i, h)), ("down_proj", (e, h, i))):
        codes, scales = mx_quantize_np(np.random.default_rng(1).standard_normal(shape) * 0.5)
        packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
        getattr(m, f"{proj}_blocks").copy_(torch.from_numpy(packed.reshape(*shape[:2], -1, 16)))
        getattr(m, f"{proj}_scales").copy_(torch.from_numpy(scales))
    with torch.no_grad():
        m.gate_up_proj_bias.normal_()
        m.down_proj_bias.normal_()
    x = torch.randn(t, h) * 3  # large enough that the clamps at +-7 bite
    logits = torch.randn(t, e)
    top, indices = torch.topk(logits, 2, dim=-1)
    weights = torch.softmax(top, -1)
    expected = _loop_experts(x, _decoded(m.gate_up_proj_blocks, m.gate_up_proj_scales), m.gate_up_proj_bias.detach(),
                             _decoded(m.down_proj_blocks, m.down_proj_scales), m.down_proj_bias.detach(),
                             indices, weights)
    with torch.no_grad():
        got = m(x, indices, weights)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-4)


def test_experts_from_float_experts_keep_the_checkpoint_orientation():
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    config = transformers.GptOssConfig(num_local_experts=2, hidden_size=64, intermediate_size=32)
    float_experts = GptOssExperts(config)
    with torch.no_grad():
        for p in float_experts.parameters():
            p.normal_()
    m = MXFP4Experts.from_experts(float_experts)
    # transformers multiplies x @ W with W [E, H, 2I]; the MXFP4 weight is [E, 2I, H], rows = outputs
    codes, scales = mx_quantize_np(float_experts.gate_up_proj.detach().transpose(1, 2).numpy())
    assert np.array_equal(unpack(m.gate_up_proj_blocks.numpy().reshape(2, 64, -1)), codes)
    assert np.array_equal(m.gate_up_proj_scales.numpy(), scales)


def test_routed_forward_equals_dense_and_dequantizes_only_the_picked_experts(monkeypatch):
    from fp4pass.fx import dequant

    torch.manual_seed(0)
    e, h, i = 8, 64, 32
    dense = _random_experts(e, h, i, routed=False, seed=3)
    routed = MXFP4Experts(e, h, i, routed=True)
    routed.load_state_dict(dense.state_dict())
    x = torch.randn(2, 3, h) * 2  # [batch, seq, H]: the output keeps the input's shape
    indices = torch.tensor([[5, 0], [2, 5], [0, 3], [6, 2], [3, 0], [5, 6]])  # experts 1, 4, 7 unpicked
    weights = torch.softmax(torch.randn(6, 2), -1)
    calls = []
    real = dequant.dequantize_mxfp4
    monkeypatch.setattr(dequant, "dequantize_mxfp4", lambda c, s, **k: calls.append(tuple(c.shape)) or real(c, s, **k))
    with torch.no_grad():
        got = routed(x, indices, weights)
        assert sorted(calls) == sorted([(2 * i, h // 2), (h, i // 2)] * 5)  # one [N, K/2] weight pair per expert
        want = dense(x, indices, weights)
    assert got.shape == x.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)  # float32 summation order only
    assert not torch.equal(want, dense(x, indices.flip(-1), weights))  # the slots matter: not a vacuous compare


def test_routed_experts_export_the_dense_graph():
    """torch.export traces the dense forward of a routed module: one dequant per weight, same outputs."""
    m = _random_experts(4, 64, 32, routed=True)
    x, indices, weights = torch.randn(5, 64), torch.tensor([[0, 1], [1, 2], [0, 2], [2, 1], [1, 0]]), torch.rand(5, 2)
    program = torch.export.export(m, (x, indices, weights))
    targets = [n.target for n in program.graph.nodes]
    assert targets.count(torch.ops.fp4pass.dequantize_mxfp4.default) == 2
    assert torch.ops.aten.bmm.default in targets and torch.ops.aten.index_put.default not in targets
    with torch.no_grad():
        torch.testing.assert_close(program.module()(x, indices, weights), m(x, indices, weights), rtol=1e-5, atol=1e-4)


def test_conv1d_is_quantized_along_its_input_axis():
    """transformers' Conv1D holds W [in, out] and computes x @ W + b: the MXFP4 weight is W^T [out, in]."""
    pytest.importorskip("transformers")
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    conv = Conv1D(48, 64)  # nf=48 outputs, nx=64 inputs
    with torch.no_grad():
        conv.weight.normal_()
        conv.bias.normal_()
    w = conv.weight.detach().numpy().copy()
    q = fp4pass.fx.quantize_linears(conv)
    assert isinstance(q, MXFP4Linear) and (q.in_features, q.out_features) == (64, 48)
    codes, scales = mx_quantize_np(w.T)  # blocks of 32 along the 64 inputs
    assert np.array_equal(unpack(q.weight_blocks.numpy().reshape(48, -1)), codes)
    assert np.array_equal(q.weight_scales.numpy(), scales)
    x = torch.randn(2, 3, 64)
    want = x.numpy() @ _decoded(q.weight_blocks, q.weight_scales).T + conv.bias.detach().numpy()
    with torch.no_grad():
        np.testing.assert_allclose(q(x).numpy(), want, rtol=1e-5, atol=1e-5)


def test_gpt2_conv1d_layers_are_all_quantized_and_calibrate_finds_them():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=50, n_positions=16, n_embd=64, n_layer=1, n_head=2)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    model, skipped = fp4pass.fx.quantize_linears(model, exclude=("lm_head",), return_skipped=True)
    assert skipped == [("lm_head", "excluded by pattern 'lm_head'")]
    names = sorted(n for n, m in model.named_modules() if isinstance(m, MXFP4Linear))
    assert names == ["transformer.h.0.attn.c_attn", "transformer.h.0.attn.c_proj", "transformer.h.0.mlp.c_fc",
                     "transformer.h.0.mlp.c_proj"]

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, input_ids):
            return self.m(input_ids=input_ids, use_cache=False).logits

    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(0))
    program = torch.export.export(Logits(), (ids,))
    _, scales = fp4pass.fx.calibrate(program, [ids])
    assert len(scales.tensors) == 4  # the input of each quantized layer: ln_1, attention, ln_2, activation


def test_linear_subclasses_are_covered_and_multihead_attention_reads_the_dequantized_weight():
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(64, 4, batch_first=True).eval()
    assert type(mha.out_proj) is not torch.nn.Linear  # NonDynamicallyQuantizableLinear, a subclass
    quantized = fp4pass.fx.quantize_linears(torch.nn.Sequential(mha))
    out_proj = quantized[0].out_proj
    assert isinstance(out_proj, MXFP4Linear)
    reference = torch.nn.MultiheadAttention(64, 4, batch_first=True).eval()
    reference.load_state_dict({k: v for k, v in mha.state_dict().items() if not k.startswith("out_proj.weight_")},
                              strict=False)
    with torch.no_grad():
        reference.out_proj.weight.copy_(torch.from_numpy(_decoded(out_proj.weight_blocks, out_proj.weight_scales)))
        reference.out_proj.bias.copy_(out_proj.bias)
        x = torch.randn(2, 5, 64)
        torch.testing.assert_close(quantized[0](x, x, x)[0], reference(x, x, x)[0], rtol=1e-5, atol=1e-5)


def test_subclasses_with_their_own_forward_are_skipped_with_the_reason(caplog):
    class Scaled(torch.nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    model = torch.nn.Sequential(Scaled(64, 8), torch.nn.Linear(64, 8), torch.nn.Linear(10, 4))
    with caplog.at_level("INFO", logger="fp4pass.fx.mxfp4"):
        model, skipped = fp4pass.fx.quantize_linears(model, return_skipped=True)
    assert type(model[0]) is Scaled and isinstance(model[1], MXFP4Linear) and type(model[2]) is torch.nn.Linear
    assert [name for name, _ in skipped] == ["0", "2"]
    assert "Scaled subclasses nn.Linear with its own forward" in skipped[0][1]
    assert skipped[1][1] == "in_features 10 is not a multiple of 32 (the MXFP4 block)"
    warning = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warning) == 1 and "2 linear layer(s) left in float" in warning[0].getMessage()


def test_routed_forward_in_bfloat16_matches_dense_on_bfloat16_weights():
    """Loaded with ``dtype=torch.bfloat16`` (how a real-size model fits), the routed forward casts each expert's
    weight to the activations' dtype, as the dense one does: both run in bf16 and agree within bf16 rounding,
    and the oracle (float64 over the bf16-rounded MXFP4 weights) is close to both."""
    e, h, i = 4, 64, 32
    dense = _random_experts(e, h, i, routed=False, seed=5).to(torch.bfloat16)
    routed = MXFP4Experts(e, h, i, routed=True, dtype=torch.bfloat16)
    routed.load_state_dict(dense.state_dict())
    x = (torch.randn(6, h, generator=torch.Generator().manual_seed(2)) * 2).to(torch.bfloat16)
    indices = torch.tensor([[0, 3], [1, 0], [3, 2], [2, 1], [0, 1], [3, 0]])
    weights = torch.softmax(torch.randn(6, 2, generator=torch.Generator().manual_seed(3)), -1).to(torch.bfloat16)
    with torch.no_grad():
        got, want = routed(x, indices, weights), dense(x, indices, weights)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=0.05, atol=0.1)
    oracle = _loop_experts(x.float(), _decoded(dense.gate_up_proj_blocks, dense.gate_up_proj_scales),
                           dense.gate_up_proj_bias.detach().float(),
                           _decoded(dense.down_proj_blocks, dense.down_proj_scales),
                           dense.down_proj_bias.detach().float(), indices, weights.float())
    torch.testing.assert_close(got.double(), oracle, rtol=0.05, atol=0.2)
