"""The calibrate-checkpoint bench's GPU floors: the MXFP4 bytes a calibration must copy to the device (counted
from the checkpoint, checked against safetensors' own reader and the format's sizes), the floor that binds (the
larger of the copy and the bf16 matmuls), and the rows on each device (quick sizes)."""

from __future__ import annotations

import math

import pytest
import torch

from fp4pass.bench import calibrate_checkpoint as B
from fp4pass.examples.checkpoints import build_checkpoint


def test_mxfp4_bytes_are_the_blocks_and_scales_of_every_layer(tmp_path):
    from safetensors import safe_open

    layers, experts, hidden, inter = 2, 12, 64, 96
    src = build_checkpoint(tmp_path / "ckpt", "gpt-oss", layers=layers, experts=experts, hidden=hidden,
                           intermediate=inter, runnable=True, shard_bytes=60_000)
    assert len(list(src.glob("*.safetensors"))) > 1  # the count crosses shards
    # E2M1: half a byte per weight; E8M0: one byte per 32 weights; gate_up [2I, H] and down [H, I] per expert
    per_layer = experts * (2 * inter * hidden + hidden * inter) * (1 / 2 + 1 / 32)
    assert B.mxfp4_bytes(src) == layers * per_layer
    read = 0
    for shard in src.glob("*.safetensors"):
        with safe_open(str(shard), "pt") as f:
            read += sum(math.prod(f.get_slice(n).get_shape()) for n in f.keys() if n.endswith(("_blocks", "_scales")))
    assert B.mxfp4_bytes(src) == read  # uint8 tensors: one byte per element


def test_the_binding_gpu_floor_is_the_larger_one():
    assert B.gpu_floor(0.5, 0.2) == (0.5, "host-to-device copy of the MXFP4 bytes")
    assert B.gpu_floor(0.1, 0.3) == (0.3, "routed matmuls (bf16)")


def test_on_the_cpu_the_second_row_is_the_matmul_floor():
    rows = B.against_forward(torch.device("cpu"), hidden=64, experts=12, rows=2, seq=16, goal=None, batch=2)
    assert [r.name for r in rows] == ["calibrate-checkpoint 2x16 tokens, H=64", "calibrate-checkpoint vs matmul floor"]
    assert rows[1].baseline == "routed matmuls (fastest form)" and "h2d_s" not in rows[1].extra


@pytest.mark.gpu
def test_on_cuda_the_second_row_is_the_larger_of_copy_and_bf16_matmuls():
    rows = B.against_forward(torch.device("cuda"), hidden=256, experts=12, rows=4, seq=32, goal=1.0, batch=4)
    floor = rows[1]
    assert floor.name == "calibrate-checkpoint vs GPU floor" and floor.goal == B.GPU_FLOOR_GOAL
    assert floor.baseline_seconds == pytest.approx(max(floor.extra["h2d_s"], floor.extra["floor_bf16_s"]), abs=1e-4)
    assert floor.extra["mxfp4_bytes"] > 0 and floor.extra["h2d_GBps"] > 0
    assert rows[0].goal is None and floor.extra["ratio_to_resident_forward"] == pytest.approx(rows[0].ratio, rel=0.01)
