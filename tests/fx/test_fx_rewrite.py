"""The fx pass on what torch users hold: ExportedProgram and GraphModule, in and out, on small MXFP4 modules.

Oracles: numpy decoders of the stored bytes (tests/support/conversion_oracle.py), the module's own eager output
before conversion, and torch.export's save/load/re-export.
"""

import numpy as np
import pytest
import torch

import fp4pass.fx
from conversion_oracle import mx_dequant, nv_dequant, unpack
from fp4pass import MXFP4Tensor
from fp4pass.errors import UsageError
from fp4pass.fx.mxfp4 import MXFP4Experts, MXFP4Linear
from spies import spy_conversion_options  # noqa: E402

MXFP4 = torch.ops.fp4pass.dequantize_mxfp4.default
NVFP4 = torch.ops.fp4pass.dequantize_nvfp4.default


def _linear(seed=0, n=16, k=64, bias=True, spread_rows=0):
    g = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g))
        lin.weight[:spread_rows] *= 2.0 ** -24
        if bias:
            lin.bias.copy_(torch.randn(n, generator=g))
    return MXFP4Linear.from_linear(lin)


def _experts(seed=0, e=3, h=64, i=32):
    g = torch.Generator().manual_seed(seed)
    m = MXFP4Experts(e, h, i)
    factors = torch.tensor([1.0, 2.0 ** -10, 2.0 ** 10]).view(e, 1, 1)
    for proj, (rows, cols) in (("gate_up_proj", (2 * i, h)), ("down_proj", (h, i))):
        mx = MXFP4Tensor.quantize(torch.randn(e, rows, cols, generator=g) * factors)
        getattr(m, f"{proj}_blocks").copy_(mx.codes.reshape(e, rows, -1, 16))
        getattr(m, f"{proj}_scales").copy_(mx.scales)
    with torch.no_grad():
        m.gate_up_proj_bias.copy_(torch.randn(e, 2 * i, generator=g) * 0.1)
        m.down_proj_bias.copy_(torch.randn(e, h, generator=g) * 0.1)
    return m


class Block(torch.nn.Module):
    """A linear, then MoE experts routed top-2 by a float router."""

    def __init__(self):
        super().__init__()
        self.proj = _linear()
        self.router = torch.nn.Linear(16, 3)
        self.up = torch.nn.Linear(16, 64)
        self.experts = _experts()

    def forward(self, x):
        h = self.proj(x)
        weights, indices = torch.topk(self.router(h), 2, dim=-1)
        return self.experts(self.up(h), indices, torch.softmax(weights, -1))


@pytest.fixture
def block_and_input():
    torch.manual_seed(0)
    return Block().eval(), torch.randn(5, 64)


def _state(program):
    return program.state_dict if isinstance(program, torch.export.ExportedProgram) else dict(program.named_buffers())


def test_exported_program_in_exported_program_out(block_and_input, tmp_path):
    block, x = block_and_input
    program = torch.export.export(block, (x,))
    with torch.no_grad():
        before = block(x)
    out, report = fp4pass.fx.convert(program)
    assert isinstance(out, torch.export.ExportedProgram)
    targets = [n.target for n in out.graph.nodes]
    assert targets.count(NVFP4) == 3 and MXFP4 not in targets
    state = out.state_dict
    assert {"proj.weight_nvfp4_codes", "proj.weight_nvfp4_scales", "proj.weight_nvfp4_global_scale",
            "experts.gate_up_proj_nvfp4_codes", "experts.down_proj_nvfp4_global_scale"} <= set(state)
    assert not [k for k in state if k.endswith(("_blocks", "_scales")) and "nvfp4" not in k]
    assert state["experts.gate_up_proj_nvfp4_global_scale"].shape == (3,)  # one per expert
    assert state["proj.weight_nvfp4_global_scale"].shape == ()
    assert report["summary"]["lossless"] == 3
    # the input program is left as it was
    assert sum(n.target == MXFP4 for n in program.graph.nodes) == 3 and "proj.weight_blocks" in program.state_dict
    with torch.no_grad():
        assert torch.equal(out.module()(x), before)
    path = tmp_path / "block.pt2"
    torch.export.save(out, path)
    loaded = torch.export.load(path)
    with torch.no_grad():
        assert torch.equal(loaded.module()(x), before)
    again = torch.export.export(loaded.module(), (x,))
    with torch.no_grad():
        assert torch.equal(again.module()(x), before)


def test_nvfp4_buffers_decode_to_the_mxfp4_weight(block_and_input):
    block, x = block_and_input
    out, _ = fp4pass.fx.convert(torch.export.export(block, (x,)))
    state = out.state_dict
    for weight, module_blocks in (("proj.weight", block.proj.weight_blocks),
                                  ("experts.gate_up_proj", block.experts.gate_up_proj_blocks)):
        scales = getattr(block.get_submodule(weight.rsplit(".", 1)[0]), weight.rsplit(".", 1)[1] + "_scales")
        blocks = module_blocks.numpy()
        mx = mx_dequant(unpack(blocks.reshape(*blocks.shape[:-2], -1)), scales.numpy()).astype(np.float32)
        nv = nv_dequant(unpack(state[f"{weight}_nvfp4_codes"].numpy()), state[f"{weight}_nvfp4_scales"].numpy(),
                        state[f"{weight}_nvfp4_global_scale"].numpy())
        np.testing.assert_array_equal(nv, mx)


def test_graph_module_from_export_is_rewritten_in_place(block_and_input):
    block, x = block_and_input
    gm = torch.export.export(block, (x,)).module()
    with torch.no_grad():
        before = gm(x)
    out, report = fp4pass.fx.convert(gm)
    assert out is gm and report["summary"]["tensors_converted"] == 3
    buffers = dict(gm.named_buffers())
    assert "experts.down_proj_nvfp4_scales" in buffers and "experts.down_proj_blocks" not in buffers
    with torch.no_grad():
        assert torch.equal(gm(x), before)


def test_alpha_form_moves_the_global_scale_after_the_matmuls(block_and_input):
    block, x = block_and_input
    program = torch.export.export(block, (x,))
    dq, _ = fp4pass.fx.convert(program)
    alpha, report = fp4pass.fx.convert(program, scale_form="alpha")
    forms = {t["name"]: t["target_form"] for t in report["tensors"]}
    assert forms == {"proj.weight": "alpha", "experts.gate_up_proj": "alpha", "experts.down_proj": "alpha"}
    state = alpha.state_dict
    assert state["experts.gate_up_proj_nvfp4_alpha"].shape == (3, 1, 1)
    assert float(state["proj.weight_nvfp4_scale_one"]) == 1.0
    # linear with a bias: linear(x, W) * G + b
    linear = next(n for n in alpha.graph.nodes if n.target == torch.ops.aten.linear.default
                  and n.args[1].target == NVFP4)
    (mul,) = linear.users
    assert mul.target == torch.ops.aten.mul.Tensor and next(iter(mul.users)).target == torch.ops.aten.add.Tensor
    with torch.no_grad():
        torch.testing.assert_close(alpha.module()(x), dq.module()(x), rtol=1e-5, atol=1e-6)


def test_alpha_form_falls_back_to_dq_with_the_reason():
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = _linear(bias=False)

        def forward(self, x):
            w = self.lin.dequantized_weight()
            return x @ (w * 2).t()

    x = torch.randn(2, 64)
    program, report = fp4pass.fx.convert(torch.export.export(Scaled(), (x,)), scale_form="alpha")
    (entry,) = report["tensors"]
    assert entry["target_form"] == "dq" and "alpha form not possible" in entry["form_note"]
    assert "lin.weight_nvfp4_global_scale" in program.state_dict


def test_a_weight_read_twice_is_converted_once():
    class Twice(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = _linear()

        def forward(self, x):
            return self.lin(x) + self.lin(x * 2)

    x = torch.randn(3, 64)
    module = Twice()
    with torch.no_grad():
        before = module(x)
    program, report = fp4pass.fx.convert(torch.export.export(module, (x,)))
    assert report["summary"]["tensors_converted"] == 1
    assert [n.target for n in program.graph.nodes].count(NVFP4) == 2
    assert len([k for k in program.state_dict if k.endswith("_nvfp4_codes")]) == 1
    with torch.no_grad():
        assert torch.equal(program.module()(x), before)


def test_lossy_weight_is_reported_not_hidden():
    module = _linear(spread_rows=4)  # rows 2^-24 apart: exponent spread > 17
    x = torch.randn(2, 64)
    program, report = fp4pass.fx.convert(torch.export.export(module, (x,)))
    (entry,) = report["tensors"]
    assert entry["mse"] > 0 and entry["snr_db"] is not None and report["summary"]["lossless"] == 0
    assert set(entry) >= {"name", "node", "pattern", "slot", "shape", "experts", "target_form", "form_note",
                          "seconds", "blocks16_total", "blocks16_verbatim", "blocks16_requantized",
                          "global_scale", "mse", "max_abs_err", "snr_db", "method_used"}
    assert set(report) >= {"input", "output", "method", "scale_form", "target", "external_data", "model",
                           "tensors", "declined", "summary"}


def test_codes_that_are_user_inputs_are_declined():
    class FromInputs(torch.nn.Module):
        def forward(self, codes, scales, x):
            return x @ torch.ops.fp4pass.dequantize_mxfp4(codes, scales).t()

    mx = MXFP4Tensor.quantize(torch.randn(8, 64))
    program = torch.export.export(FromInputs(), (mx.codes, mx.scales, torch.randn(2, 64)))
    out, report = fp4pass.fx.convert(program)
    assert report["tensors"] == [] and report["summary"]["declined"] == 1
    assert "codes is not a stored tensor: user input 'codes'" in report["declined"][0]["reason"]
    assert MXFP4 in [n.target for n in out.graph.nodes]


def test_symbolic_trace_that_folded_the_dequant_gets_a_warning_naming_the_fix():
    gm = torch.fx.symbolic_trace(_linear())
    with pytest.warns(UserWarning, match=r"torch\.export\.export"):
        _, report = fp4pass.fx.convert(gm)
    assert report["tensors"] == []
    (declined,) = report["declined"]
    assert "symbolic_trace" in declined["reason"] and declined["tensor"].startswith("_tensor_constant")


def test_plain_float_graph_converts_nothing_and_warns_nothing():
    gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(64, 8)))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, report = fp4pass.fx.convert(gm)
    assert report["tensors"] == [] and report["declined"] == []


def test_a_module_that_was_not_traced_is_a_usage_error():
    with pytest.raises(UsageError, match="torch.export.export"):
        fp4pass.fx.convert(_linear())


def test_effort_and_threads_are_explicit_and_no_process_default_reaches_them(monkeypatch):
    """fx.convert passes its own effort/threads to every weight's conversion, by name."""
    import fp4pass.convert as convert_mod

    seen = spy_conversion_options(monkeypatch, convert_mod)
    lin = _linear(spread_rows=4)
    x = torch.randn(3, 64)
    program = torch.export.export(lin, (x,))
    _, report = fp4pass.fx.convert(program)
    assert seen == [("best", 1)] and (report["effort"], report["threads"]) == ("best", 1)
    seen.clear()
    _, report = fp4pass.fx.convert(program, effort="fast", threads=None)
    assert seen == [("fast", None)] and report["effort"] == "fast"
    with pytest.raises(UsageError, match="effort must be one of best, fast"):
        fp4pass.fx.convert(program, effort="max")
    with pytest.raises(UsageError, match="threads must be a positive integer"):
        fp4pass.fx.convert(program, threads=0)
