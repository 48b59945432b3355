"""fp4pass.fx.calibrate: activation statistics of FP4 matmuls, shared calibrators, fake-quant insertion, ranks."""

from __future__ import annotations

import gc
import json
import os
import weakref

import numpy as np
import pytest
import torch

import fp4pass.fx
from fp4pass.calib import ActivationScales
from fp4pass.calib.errors import CalibrationDataError
from fp4pass.errors import ModelError, NonFiniteError
from fp4pass.fx.calibration import calibration_targets
from calib_builders import nv_fake_quant_np
from fx_builders import MXFP4MLP, mxfp4_weight

FAKE_QUANT = torch.ops.fp4pass.fake_quantize_nvfp4.default


def _batches(count: int = 4, rows: int = 8, seed: int = 1, scale: float = 1.0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, 64, generator=generator) * scale for _ in range(count)]


def _oracle_activations(model: MXFP4MLP, x: torch.Tensor) -> list[np.ndarray]:
    """The inputs of the three FP4 matmuls, in numpy float32 from the weights' bytes."""
    weights = [mxfp4_weight(getattr(model, f"codes{i}"), getattr(model, f"scales{i}")) for i in range(3)]
    acts = [x.numpy()]
    for w in weights[:2]:
        acts.append(np.maximum(acts[-1] @ w.T, 0).astype(np.float32))
    return acts


@pytest.fixture(scope="module")
def program():
    model = MXFP4MLP()
    return model, torch.export.export(model, (torch.randn(8, 64),))


def test_targets_are_the_inputs_of_the_fp4_matmuls(program):
    _, ep = program
    targets, declined = calibration_targets(ep)
    assert [t.name for t in targets] == ["x", "relu", "relu_1"]
    assert [t.consumers for t in targets] == [["matmul"], ["matmul_1"], ["linear"]]
    assert declined == []


def test_max_scales_match_numpy_statistics(program):
    model, ep = program
    batches = _batches()
    prog, scales = fp4pass.fx.calibrate(ep, batches, calibrator="max")
    assert isinstance(scales, ActivationScales) and scales.calibrator == "max" and scales.batches == 4
    per_batch = [_oracle_activations(model, x) for x in batches]
    for i, name in enumerate(["x", "relu", "relu_1"]):
        values = np.concatenate([acts[i] for acts in per_batch])
        entry = scales.tensors[name]
        np.testing.assert_allclose(entry.amax, np.abs(values).max(), rtol=1e-6)
        assert entry.g_amax == entry.amax
        assert entry.input_scale == float(np.float32(np.float32(entry.g_amax) / np.float32(6 * 448)))
        assert entry.blocks == values.size // 16
    assert set(json.loads(json.dumps(scales.to_json()))["tensors"]["x"]) == {
        "amax", "g_amax", "input_scale", "b_min", "b_max", "blocks"}


def test_inserted_fake_quant_is_bit_exact_with_numpy_nvfp4(program):
    model, ep = program
    prog, scales = fp4pass.fx.calibrate(ep, _batches())
    quantizers = [n for n in prog.graph.nodes if n.target == FAKE_QUANT]
    assert [n.args[0].name for n in quantizers] == ["x", "relu", "relu_1"]
    assert [n.name for n in quantizers] == ["x_fake_quantize_nvfp4", "relu_fake_quantize_nvfp4",
                                            "relu_1_fake_quantize_nvfp4"]
    for node in quantizers:
        assert [u.name for u in node.users] == calibration_targets(ep)[0][quantizers.index(node)].consumers
        assert node.args[1] == scales.tensors[node.args[0].name].input_scale
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(11)) * 3
    values = {}

    class Keep(torch.fx.Interpreter):
        def run_node(self, node):
            values[node.name] = out = super().run_node(node)
            return out

    Keep(prog.module()).run((x,), {})
    weights = [mxfp4_weight(getattr(model, f"codes{i}"), getattr(model, f"scales{i}")) for i in range(3)]
    for name, matmul, w in zip(("x", "relu", "relu_1"), ("matmul", "matmul_1", "linear"), weights):
        quantized = values[f"{name}_fake_quantize_nvfp4"].numpy()
        g = scales.tensors[name].input_scale
        assert g == float(np.float32(np.float32(scales.tensors[name].g_amax) / np.float32(2688)))
        np.testing.assert_array_equal(quantized, nv_fake_quant_np(values[name].numpy(), g))
        # float32 matmul: within 1e-5 of the sum of |terms| (accumulation order differs from numpy's)
        bound = 1e-5 * (np.abs(quantized) @ np.abs(w.T))
        assert (np.abs(values[matmul].numpy() - quantized @ w.T) <= bound).all()
    # the op alone, bit for bit, on values that hit every E2M1 binade and saturate at 448 block scale
    a = torch.randn(4, 96) * torch.logspace(-3, 3, 96)
    for scale in (1e-4, 0.37, 2.0):
        np.testing.assert_array_equal(FAKE_QUANT(a, scale).numpy(), nv_fake_quant_np(a.numpy(), scale))


def test_input_is_not_changed_and_kinds_are_kept(program):
    model, ep = program
    before = str(ep.graph)
    prog, _ = fp4pass.fx.calibrate(ep, _batches(1))
    assert isinstance(prog, torch.export.ExportedProgram) and str(ep.graph) == before
    assert prog.state_dict["codes0"] is ep.state_dict["codes0"]  # weights shared, not copied
    gm = ep.module()
    gm_before = gm.code
    gm_out, scales = fp4pass.fx.calibrate(gm, _batches(1))
    assert isinstance(gm_out, torch.fx.GraphModule) and gm.code == gm_before
    assert sum(n.target == FAKE_QUANT for n in gm_out.graph.nodes) == 3
    assert gm_out.codes0 is gm.codes0
    exported, _ = fp4pass.fx.calibrate(model, [(b,) for b in _batches(2)])
    assert isinstance(exported, torch.export.ExportedProgram)


def test_calibrated_program_saves_loads_and_runs(program, tmp_path):
    _, ep = program
    prog, _ = fp4pass.fx.calibrate(ep, _batches(2))
    x = torch.randn(8, 64)
    torch.export.save(prog, tmp_path / "calibrated.pt2")
    loaded = torch.export.load(tmp_path / "calibrated.pt2")
    assert torch.equal(loaded.module()(x), prog.module()(x))


def test_batches_are_streamed_one_at_a_time(program):
    _, ep = program
    alive = []

    def stream():
        for i in range(4):
            gc.collect()
            assert all(ref() is None for ref in alive), "an earlier batch is still held"
            batch = torch.randn(8, 64)
            alive.append(weakref.ref(batch))
            yield batch
            del batch

    _, scales = fp4pass.fx.calibrate(ep, stream())
    assert scales.batches == 4


def test_non_finite_batch_names_batch_and_activation(program):
    _, ep = program
    batches = _batches(3)
    batches[2][1, 5] = float("nan")
    with pytest.raises(NonFiniteError, match=r"batch #2: activation x"):
        fp4pass.fx.calibrate(ep, batches)
    with pytest.raises(CalibrationDataError):
        fp4pass.fx.calibrate(ep, [])


def test_calibrators_share_the_onnx_side_options(program):
    _, ep = program
    batches = _batches()
    _, by_max = fp4pass.fx.calibrate(ep, batches, calibrator="max")
    _, by_headroom = fp4pass.fx.calibrate(ep, batches, calibrator="headroom", rho=64.0)
    for name, entry in by_headroom.tensors.items():
        assert entry.g_amax == max(64.0 * entry.b_min, entry.b_max)
        assert entry.b_max == by_max.tensors[name].b_max
    _, by_percentile = fp4pass.fx.calibrate(ep, batches, calibrator="percentile", percentile=50.0)
    assert by_percentile.tensors["x"].g_amax < by_max.tensors["x"].g_amax / 2


class _WeightFirst(torch.nn.Module):
    """An FP4 weight as the first operand of mm (the activation is contracted along its first axis)."""

    def __init__(self):
        super().__init__()
        self.inner = MXFP4MLP(shapes=((64, 64),))

    def forward(self, x):
        return torch.mm(self.inner.weight(0), x)


def test_declines_an_activation_not_contracted_along_its_last_axis():
    ep = torch.export.export(_WeightFirst(), (torch.randn(64, 16),))
    targets, declined = calibration_targets(ep)
    assert targets == []
    assert declined[0]["activation"] == "x" and "second operand" in declined[0]["reason"]
    with pytest.raises(ModelError, match="no activation to calibrate"):
        fp4pass.fx.calibrate(ep, [torch.randn(64, 16)])


def test_a_symbolic_trace_that_folded_the_dequant_is_told_the_fix():
    gm = torch.fx.symbolic_trace(MXFP4MLP())  # buffers are constants to symbolic_trace: the dequant is folded
    with pytest.raises(ModelError, match="torch.export.export"):
        fp4pass.fx.calibrate(gm, [torch.randn(8, 64)])


def test_same_scales_as_onnx_calibrate_on_the_export(program, tmp_path):
    """fx.calibrate and fp4pass calibrate on fx.export's ONNX agree on every SCALES.json field."""
    from fp4pass.onnx.calibrate import calibrate_model

    _, ep = program
    batches = _batches(3)
    _, fx_scales = fp4pass.fx.calibrate(ep, batches, calibrator="headroom")
    onnx_model = fp4pass.fx.export(ep, (batches[0],), tmp_path / "mlp.onnx")
    onnx_scales = calibrate_model(onnx_model, [{"x": b.numpy()} for b in batches], calibrator="headroom",
                                  provider="cpu")
    assert list(onnx_scales.tensors) == list(fx_scales.tensors)
    assert onnx_scales.tensors["x"].to_json() == fx_scales.tensors["x"].to_json()  # the graph input: exact
    for name, fx_entry in fx_scales.tensors.items():
        onnx_entry = onnx_scales.tensors[name].to_json()
        for key, value in fx_entry.to_json().items():
            assert value == pytest.approx(onnx_entry[key], rel=1e-5), (name, key)


@pytest.mark.gpu
def test_calibrates_on_cuda_where_the_model_is():
    model = MXFP4MLP()
    ep = torch.export.export(model, (torch.randn(8, 64),))
    batches = _batches()
    _, cpu_scales = fp4pass.fx.calibrate(ep, batches)
    gpu_program = torch.export.export(model.to("cuda"), (torch.randn(8, 64, device="cuda"),))
    prog, gpu_scales = fp4pass.fx.calibrate(gpu_program, batches)
    assert gpu_scales.provider == "torch:cuda"
    for name, entry in cpu_scales.tensors.items():
        assert gpu_scales.tensors[name].amax == pytest.approx(entry.amax, rel=1e-5)
    assert prog.module()(batches[0].cuda()).is_cuda


# -- torch.distributed: 2 gloo ranks on CPU ------------------------------------------------------------------


def _rank_main(rank: int, world: int, rendezvous: str, out_dir: str, calibrator: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        ep = torch.export.export(MXFP4MLP(), (torch.randn(8, 64),))
        mine = _distributed_batches()[rank::world]
        prog, scales = fp4pass.fx.calibrate(ep, mine, calibrator=calibrator)
        inserted = {n.args[0].name: n.args[1] for n in prog.graph.nodes if n.target == FAKE_QUANT}
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"scales": scales.to_json(), "inserted": inserted}, f)
    finally:
        dist.destroy_process_group()


def _distributed_batches() -> list[torch.Tensor]:
    # the ranks see different ranges (rank 1's batches are 40x larger): MAX and SUM give different amaxes
    generator = torch.Generator().manual_seed(7)
    return [torch.randn(8, 64, generator=generator) * (40.0 if i % 2 else 1.0) for i in range(6)]


@pytest.mark.slow
@pytest.mark.parametrize("calibrator", ["percentile"])
def test_two_gloo_ranks_reduce_to_the_single_process_scales(tmp_path, calibrator):
    import torch.multiprocessing as mp

    world = 2
    mp.spawn(_rank_main, args=(world, str(tmp_path / "rendezvous"), str(tmp_path), calibrator), nprocs=world,
             join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    ep = torch.export.export(MXFP4MLP(), (torch.randn(8, 64),))
    prog, single = fp4pass.fx.calibrate(ep, _distributed_batches(), calibrator=calibrator)
    for result in ranks:
        assert result["scales"] == single.to_json()
        assert result["inserted"] == {n.args[0].name: n.args[1] for n in prog.graph.nodes if n.target == FAKE_QUANT}
