"""Checkpoint diff (``fp4pass.checkpoint.diff``): time against one calibration of the same data and model, and
peak memory against depth.

- (a) gpt-oss-20b layer shapes (hidden 2880, 32 experts of intermediate 2880, top-4, 64 heads of 64), 2 layers,
  16 x 128 tokens in batches of 8: the diff of the MXFP4 source against its W4A4 NVFP4 conversion (ModelOpt
  form, input scales from that calibration) against ``fp4pass.checkpoint.calibrate`` of the same source on the
  same tokens, timed in the same process (goal <= 2.5x). The diff runs every layer three times where calibration
  runs it once (the source; the NVFP4 layer on the source's input; the NVFP4 layer on its own input), plus each
  routed expert again on the source's rows and the logits of both models; the extra columns carry its phases.
- (b) peak RSS (VmHWM of a child process) of the diff of a 16-layer model against a 4-layer model of the same
  width (hidden = intermediate = 1024, 16 experts) on the same tokens (goal <= 1.25x).

Weights are random MXFP4 codes (:func:`fp4pass.examples.checkpoints.build_checkpoint`, ``runnable=True``) in a
temporary folder removed after. ``quick``: hidden 256, 8 experts, 8 x 32 tokens; 1 and 4 layers (no goals).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from fp4pass.bench import BenchResult
from fp4pass.bench.calibrate_checkpoint import measured_child, sync_device
from fp4pass.examples.checkpoints import build_checkpoint

#: the diff's time over one calibration of the same model and data
TIME_GOAL = 2.5
#: peak RSS of the diff of 16 layers over that of 4
DEPTH_GOAL = 1.25



def _pair(tmp: Path, name: str, device: torch.device, *, layers: int, experts: int, hidden: int, data: Path,
          batch: int, shard_bytes: int | None = None):
    """An MXFP4 gpt-oss-shaped source, its W4A4 ModelOpt conversion, and the calibration's seconds."""
    import fp4pass.checkpoint

    src = build_checkpoint(tmp / f"{name}-mxfp4", "gpt-oss", layers=layers, experts=experts, hidden=hidden,
                           intermediate=hidden, seed=0, expert_step=0, runnable=True, vocab=32,
                           shard_bytes=shard_bytes)
    sync_device(device)
    start = time.perf_counter()
    scales = fp4pass.checkpoint.calibrate(src, data, batch_size=batch, device=device.type)
    sync_device(device)
    calib_s = time.perf_counter() - start
    out = tmp / f"{name}-nvfp4"
    fp4pass.checkpoint.convert(src, out, format="modelopt", scales=scales)
    return src, out, calib_s


def bench_against_calibrate(device: torch.device, quick: bool) -> list[BenchResult]:
    import fp4pass.checkpoint

    hidden, experts, rows, seq, goal = (256, 8, 8, 32, None) if quick else (2880, 32, 16, 128, TIME_GOAL)
    batch = 8
    with tempfile.TemporaryDirectory(prefix="fp4pass-bench-diff-") as tmp:
        tmp = Path(tmp)
        np.savez(tmp / "ids.npz", input_ids=np.random.default_rng(0).integers(0, 32, size=(rows, seq)))
        warm_src, warm_out, _ = _pair(tmp, "warm", device, layers=1, experts=4, hidden=64, data=tmp / "ids.npz",
                                      batch=batch)  # imports and kernels, before anything is timed
        fp4pass.checkpoint.diff(warm_src, warm_out, tmp / "ids.npz", batch_size=batch, device=device.type,
                                num_samples=batch)
        src, nvfp4, calib_s = _pair(tmp, "bench", device, layers=2, experts=experts, hidden=hidden,
                                    data=tmp / "ids.npz", batch=batch)
        sync_device(device)
        start = time.perf_counter()
        result = fp4pass.checkpoint.diff(src, nvfp4, tmp / "ids.npz", batch_size=batch, device=device.type)
        sync_device(device)
        diff_s = time.perf_counter() - start
    extra = {"tokens": rows * seq, "tokens_per_s": rows * seq / diff_s, "layers_x_experts_x_H": f"2x{experts}x{hidden}",
             "device": str(device), "activations": result.run["activations"],
             **{f"{k}_s": round(v, 3) for k, v in result.run["timings_s"].items()}}
    return [BenchResult(f"diff-checkpoint {rows}x{seq} tokens, H={hidden}", diff_s, "calibrate (same model, tokens)",
                        calib_s, goal, extra)]


def _child(src: Path, nvfp4: Path, data: Path, device: torch.device) -> dict:
    return measured_child("diff-checkpoint", "fp4pass.checkpoint.diff(sys.argv[1], sys.argv[2], sys.argv[3], "
                          "batch_size=4, device=sys.argv[4])", src, nvfp4, data, device.type)


def bench_depth_memory(device: torch.device, quick: bool) -> list[BenchResult]:
    hidden, experts, (shallow, deep) = (128, 4, (1, 4)) if quick else (1024, 16, (4, 16))
    with tempfile.TemporaryDirectory(prefix="fp4pass-bench-diff-") as tmp:
        tmp = Path(tmp)
        data = tmp / "ids.npz"
        np.savez(data, input_ids=np.random.default_rng(1).integers(0, 32, size=(8, 64)))
        runs = {}
        for layers in (shallow, deep):
            src, nvfp4, _ = _pair(tmp, f"d{layers}", device, layers=layers, experts=experts, hidden=hidden, data=data,
                                  batch=4, shard_bytes=200_000_000)
            runs[layers] = _child(src, nvfp4, data, device)
    a, b = runs[shallow], runs[deep]
    extra = {f"growth_{shallow}_MiB": (a["rss_after_kib"] - a["rss_before_kib"]) / 1024,
             f"growth_{deep}_MiB": (b["rss_after_kib"] - b["rss_before_kib"]) / 1024,
             f"seconds_{shallow}": a["seconds"], f"seconds_{deep}": b["seconds"], "hidden": hidden, "experts": experts}
    return [BenchResult(f"diff-checkpoint peak RSS {deep} vs {shallow} layers", b["rss_after_kib"] / 1024,
                        f"{shallow} layers", a["rss_after_kib"] / 1024, None if quick else DEPTH_GOAL, extra,
                        unit="MiB")]


BENCHMARKS = [bench_against_calibrate, bench_depth_memory]
