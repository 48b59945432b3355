"""fp4pass.fx.diff: per-node metrics through torch.fx.Interpreter, the ONNX diff's result type, first_divergent."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

import fp4pass.fx
from fp4pass.fx.numerics import DiffResult, plot_diff
from fp4pass.metrics import JSON_KEYS
from fx_builders import MXFP4MLP, buffer_node


def _snr_np(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return 20 * math.log10(np.linalg.norm(a) / np.linalg.norm(a - b))


@pytest.fixture(scope="module")
def pair():
    """The MLP, and a copy whose second weight has one 32-block's scale raised 2^3 (an injected error)."""
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(3))
    a, b = MXFP4MLP(), MXFP4MLP()
    b.scales1[5, 0] += 3
    return a, b, x, torch.export.export(a, (x,)), torch.export.export(b, (x,))


def test_first_divergent_names_the_node_of_the_injected_error(pair):
    a, b, x, ep_a, ep_b = pair
    result = fp4pass.fx.diff(ep_a, ep_b, (x,), snr_min=60.0, weights=True)
    assert isinstance(result, DiffResult)
    injected = buffer_node(ep_a.graph, "codes1").name  # the dequant node that reads the changed scales
    assert result.first_divergent["node"] == injected
    assert result.first_divergent["op_type"] == "fp4pass.dequantize_mxfp4.default"
    by_name = {m.name: m for m in result.intermediates}
    upstream = buffer_node(ep_a.graph, "codes0").name
    assert by_name[upstream].snr_db is None and by_name[upstream].max_abs_err == 0  # before the error: identical
    (output,) = result.outputs
    assert output.name == "linear"
    assert output.snr_db == pytest.approx(_snr_np(a(x).numpy(), b(x).numpy()), rel=1e-9)
    assert output.snr_db < 60 and not result.passed


def test_identical_programs_have_no_divergence(pair):
    _, _, x, ep_a, _ = pair
    result = fp4pass.fx.diff(ep_a, ep_a, (x,), snr_min=200.0, weights=True)
    assert result.passed and result.first_divergent is None
    assert all(m.snr_db is None and m.max_abs_err == 0 for m in [*result.outputs, *result.intermediates])
    # every computing node of the graph is compared, the output apart
    computing = [n.name for n in ep_a.graph.nodes if n.op == "call_function" and n.name != "linear"]
    assert sorted(m.name for m in result.intermediates) == sorted(computing)


def test_weight_copies_are_compared_only_on_request(pair):
    """By default the activations only: the dequantized weights and their transposes are skipped, and the
    notes say so; the first divergent node is then the first matmul that reads the changed weight."""
    _, _, x, ep_a, ep_b = pair
    result = fp4pass.fx.diff(ep_a, ep_b, (x,), snr_min=60.0)
    names = {m.name for m in result.intermediates}
    # nodes that read the input x, directly or not, are activations; the others are weight copies
    activations = {"matmul", "relu", "matmul_1", "relu_1"}
    assert names == activations
    assert result.first_divergent["node"] == "matmul_1"
    assert any("compared 4 intermediate activations and 1 outputs; 5 weight copies not compared" in n
               for n in result.notes), result.notes


def test_json_table_and_plot_match_the_onnx_diff(pair, tmp_path):
    _, _, x, ep_a, ep_b = pair
    result = fp4pass.fx.diff(ep_a, ep_b, (x,), snr_min=60.0)
    data = json.loads(json.dumps(result.to_json(), allow_nan=False))
    assert set(data) == {"provider", "outputs", "intermediates", "first_divergent", "passed", "notes", "provider_options",
                         "placement"}
    assert data["provider"] == "torch:cpu"
    assert all(tuple(entry) == JSON_KEYS for entry in data["outputs"] + data["intermediates"])
    table = result.format_table()
    assert "first divergent: node 'matmul_1'" in table and table.endswith("FAILED (snr-min 60 dB)")
    pytest.importorskip("matplotlib")
    plot_diff(result, tmp_path / "diff.png")
    assert (tmp_path / "diff.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_graph_modules_modules_and_a_tiny_budget(pair):
    a, b, x, ep_a, ep_b = pair
    whole = fp4pass.fx.diff(ep_a, ep_b, (x,), snr_min=60.0)
    small = fp4pass.fx.diff(ep_a.module(), b, x, snr_min=60.0, intermediate_budget_bytes=1)
    assert small.to_json() == whole.to_json()  # same-order graphs hold one pair at a time
    only_outputs = fp4pass.fx.diff(ep_a, ep_b, (x,), intermediates=False, snr_min=60.0)
    assert only_outputs.intermediates == [] and only_outputs.first_divergent["node"] == "linear"


def test_calibrated_program_diverges_first_at_its_first_quantized_matmul(pair):
    _, _, x, ep_a, _ = pair
    calibrated, _ = fp4pass.fx.calibrate(ep_a, [x])
    result = fp4pass.fx.diff(ep_a, calibrated, (x,), snr_min=100.0)
    # the fake-quant nodes exist only in b; the first node of a they change is the first FP4 matmul
    assert result.first_divergent["node"] == "matmul"
    assert "x_fake_quantize_nvfp4" not in {m.name for m in result.intermediates}


def test_new_nan_is_divergent_without_a_threshold(pair):
    _, _, x, ep_a, _ = pair
    bad = MXFP4MLP()
    bad.codes2.zero_()

    class NaNTail(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = bad

        def forward(self, x):
            y = self.inner(x)
            return y / y  # 0/0

    result = fp4pass.fx.diff(ep_a, torch.export.export(NaNTail(), (x,)), (x,))
    # no snr_min: the zeroed weight upstream is not flagged, the output's new NaNs are (matched by position)
    assert result.first_divergent["node"] == "linear" and result.first_divergent["snr_db"] is None
    (output,) = result.outputs
    assert output.nan == output.shape[0] * output.shape[1] and not result.passed


class _Deep(torch.nn.Module):
    """``layers`` x (MXFP4 matmul + tanh), the depth a diff must stay linear in."""

    def __init__(self, layers: int):
        super().__init__()
        self.inner = MXFP4MLP(shapes=((64, 64),) * layers)

    def forward(self, x):
        return self.inner(x).tanh()


@pytest.mark.parametrize("layers", [2, 6])
def test_each_model_runs_once_whatever_the_depth(layers, monkeypatch):
    """Every dequant and every matmul of each model runs exactly once per diff, with the default budget and
    with one of a few bytes: the cost is one forward of each model, not one per chunk."""
    from fp4pass.fx import numerics

    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    model = _Deep(layers)
    ep_a = torch.export.export(model, (x,))
    ep_b, _ = fp4pass.fx.convert(ep_a)
    runs = []
    real = numerics._Stepper.run_node

    def counting(self, node):
        if node.op == "call_function":
            runs.append((id(self.module), node.name))
        return real(self, node)

    monkeypatch.setattr(numerics._Stepper, "run_node", counting)
    for budget in (1 << 30, 16):
        runs.clear()
        result = fp4pass.fx.diff(ep_a, ep_b, (x,), intermediate_budget_bytes=budget)
        assert len(runs) == len(set(runs))  # no node of either model ran twice
        assert len(result.intermediates) == 2 * layers - 1  # matmuls and relus, the output apart


def test_graphs_in_different_orders_still_pair_their_nodes():
    """b computes the same nodes in another order: the pairs still meet (b's early values are held)."""
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    gm_a = torch.fx.symbolic_trace(_TwoBranches())
    gm_b = torch.fx.symbolic_trace(_TwoBranches())
    nodes = {n.name: n for n in gm_b.graph.nodes}
    nodes["cos"].prepend(nodes["sin"])  # b computes sin before cos
    gm_b.recompile()
    result = fp4pass.fx.diff(gm_a, gm_b, (x,))
    assert {m.name for m in result.intermediates} == {"sin", "cos"}
    assert all(m.max_abs_err == 0 for m in result.intermediates)


class _TwoBranches(torch.nn.Module):
    def forward(self, x):
        return torch.cos(x) + torch.sin(x)
