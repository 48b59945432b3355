"""Checkpoint calibration (``fp4pass.checkpoint.calibrate``): time against a plain transformers forward, and peak
memory against depth.

- (a) gpt-oss-20b layer shapes (hidden 2880, 32 experts of intermediate 2880, top-4, 64 heads of 64), 2 layers,
  16 x 128 tokens in batches of 8 rows (the default): the calibration (reading the shards, dequantizing every
  expert once, running each batch through each layer, the statistics, the scales) against the same model's plain
  forward (``AutoModelForCausalLM`` with every weight resident in bf16, transformers' default experts
  implementation) of the same batches, in the same process (goal <= 1.0x on the CPU); tokens/s; and the ratio to
  a matmul floor measured in the same process: the matmuls of the routed shapes alone ([tokens * 4 / 32, 2880]
  x [2880, 5760] and x [2880, 2880] per expert, per layer), bf16 in the fastest layout, or float32 products
  where the calibration uses them, whichever is faster. On a GPU the floor that binds is the larger of two, both
  measured in the same process (goal <= 1.5x): copying the layers' MXFP4 bytes (``*_blocks`` and ``*_scales``,
  from pinned host memory) host to device, and the routed matmuls in bf16; the ratio to the resident forward is
  kept beside it (that forward has its weights on the device already: no calibration that reads them reaches
  1.0x there). On the CPU the plain forward is timed on the first row (128 tokens, which reach every expert)
  and scaled to all 16 (its time is linear in the tokens; transformers' default bf16
  ``grouped_mm`` runs ~0.3 GFLOP/s on CPUs without bf16 matrix instructions, so all 16 rows would take ~40
  minutes there);
- (b) peak RSS (VmHWM of a child process) of a 16-layer model against a 4-layer model of the same width (hidden
  = intermediate = 1024, 16 experts), each calibrated on the same tokens (goal <= 1.25x); their RSS growth over
  the process's size before calibrating is reported beside it.

The (a) rows carry the calibration's phases (``load_s``: the wait for a layer's weights, the part of their
reading and dequantizing that the background thread did not hide; ``load_background_s``: that thread's own
seconds; ``layers_s``; ``release_s``: freeing each layer; ``scales_s``).

Weights are random MXFP4 codes (:func:`fp4pass.examples.checkpoints.build_checkpoint`, ``runnable=True``), written
to a temporary folder that is removed after. ``quick``: hidden 256, 8 experts, 8 x 32 tokens (no goals).
"""

from __future__ import annotations

import json
import math
import os
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from fp4pass.bench import BenchResult
from fp4pass.examples.checkpoints import build_checkpoint

_CHILD = """
import json, sys, time
import fp4pass.checkpoint

def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])

before = hwm()
start = time.perf_counter()
{call}
print(json.dumps({{"seconds": time.perf_counter() - start, "rss_before_kib": before, "rss_after_kib": hwm()}}))
"""


def sync_device(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA kernels run asynchronously: a timer read before it undercounts)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _plain_model(src: Path, device: torch.device):
    """The checkpoint as a plain transformers model: every weight resident in bf16 (experts dequantized)."""
    from transformers import AutoModelForCausalLM

    from fp4pass.safetensors.catalog import Catalog
    from fp4pass.checkpoint.detect import detect
    from fp4pass.checkpoint.layerwise.model import WeightLoader, WeightSources, resolve_architecture

    with Catalog.open(src) as catalog:
        model_type, cfg = resolve_architecture(catalog.config, src)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        sources = WeightSources.build(catalog, detect(catalog.tensors, catalog.config), model_type)
        loader = WeightLoader(catalog, sources, device)
        base = model.model
        from fp4pass.checkpoint.layerwise.model import materialize

        for name, child in base.named_children():
            if name == "layers":
                for i, layer in enumerate(child):
                    materialize(layer, f"layers.{i}.", loader, cfg, device)
            else:
                materialize(child, f"{name}.", loader, cfg, device)
    return base.eval()


def _matmul_floor(device: torch.device, layers: int, tokens: int, experts: int, top_k: int, hidden: int,
                  inter: int, repeat: int = 2) -> dict[str, float]:
    """Seconds of the routed expert matmuls alone, per expert an even share of the routed tokens, in the
    fastest layout (weights [N, K], read transposed): ``bf16``, and ``float32_products`` (bf16 operands
    multiplied in float32, rounded to bf16, as the calibration does on CPUs without bf16 matrix instructions)
    where that applies."""
    from fp4pass.checkpoint.layerwise.runner import float32_products

    rows = max(1, tokens * top_k // experts)
    x = torch.randn(rows, hidden, dtype=torch.bfloat16, device=device)
    w1 = torch.randn(2 * inter, hidden, dtype=torch.bfloat16, device=device)
    h = torch.randn(rows, inter, dtype=torch.bfloat16, device=device)
    w2 = torch.randn(hidden, inter, dtype=torch.bfloat16, device=device)
    forms = {"bf16": lambda a, w: a @ w.t()}
    if float32_products(device, torch.bfloat16):
        forms["float32_products"] = lambda a, w: (a.float() @ w.float().t()).bfloat16()
    out = {}
    for name, product in forms.items():
        best = float("inf")
        for _ in range(repeat):
            sync_device(device)
            start = time.perf_counter()
            for _ in range(layers * experts):
                product(x, w1)
                product(h, w2)
            sync_device(device)
            best = min(best, time.perf_counter() - start)
        out[name] = best
    return out


def mxfp4_bytes(folder: Path) -> int:
    """Bytes of the MXFP4 expert tensors (names ending ``_blocks`` or ``_scales``) in the checkpoint ``folder``,
    from the safetensors headers (an 8-byte little-endian header length, then JSON with each tensor's
    ``data_offsets``)."""
    total = 0
    for shard in sorted(Path(folder).glob("*.safetensors")):
        with open(shard, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        for name, entry in header.items():
            if name != "__metadata__" and name.endswith(("_blocks", "_scales")):
                start, end = entry["data_offsets"]
                total += end - start
    return total


def _h2d_floor(device: torch.device, nbytes: int, repeat: int = 3) -> float:
    """Seconds to copy ``nbytes`` from pinned host memory to ``device`` (best of ``repeat``), in 256 MiB pieces
    as a layer-by-layer loader would."""
    piece = min(nbytes, 256 << 20)
    host = torch.empty(piece, dtype=torch.uint8).pin_memory()
    target = torch.empty(piece, dtype=torch.uint8, device=device)
    pieces, rest = divmod(nbytes, piece)
    best = math.inf
    for _ in range(repeat):
        sync_device(device)
        start = time.perf_counter()
        for _ in range(pieces):
            target.copy_(host, non_blocking=True)
        if rest:
            target[:rest].copy_(host[:rest], non_blocking=True)
        sync_device(device)
        best = min(best, time.perf_counter() - start)
    return best


def gpu_floor(h2d_s: float, bf16_matmul_s: float) -> tuple[float, str]:
    """The floor that binds on a GPU: the larger of the host-to-device copy and the bf16 routed matmuls."""
    if h2d_s >= bf16_matmul_s:
        return h2d_s, "host-to-device copy of the MXFP4 bytes"
    return bf16_matmul_s, "routed matmuls (bf16)"


def bench_against_forward(device: torch.device, quick: bool) -> list[BenchResult]:
    if quick:
        return against_forward(device, hidden=256, experts=8, rows=8, seq=32, goal=None)
    return against_forward(device, hidden=2880, experts=32, rows=16, seq=128, goal=1.0, forward_rows=1)


def against_forward(device: torch.device, *, hidden: int, experts: int, rows: int, seq: int, goal: float | None,
                    layers: int = 2, batch: int = 8, forward_rows: int | None = None) -> list[BenchResult]:
    """Calibration of a ``layers``-layer gpt-oss-shaped checkpoint on ``rows`` x ``seq`` random tokens against
    its plain forward and the routed matmul floor (module docstring), in batches of ``batch`` rows.
    ``forward_rows``: on the CPU, time the plain forward on that many rows only and scale it to all."""
    import fp4pass.checkpoint

    with tempfile.TemporaryDirectory(prefix="fp4pass-bench-calib-") as tmp:
        src = build_checkpoint(Path(tmp) / "ckpt", "gpt-oss", layers=layers, experts=experts, hidden=hidden,
                               intermediate=hidden, seed=0, expert_step=0, runnable=True, vocab=32)
        ids = np.random.default_rng(0).integers(0, 32, size=(rows, seq))
        np.savez(Path(tmp) / "ids.npz", input_ids=ids)
        fp4pass.checkpoint.calibrate(src, Path(tmp) / "ids.npz", batch_size=batch, device=device.type,
                                     num_samples=batch)  # warm: imports, kernels
        sync_device(device)
        start = time.perf_counter()
        result = fp4pass.checkpoint.calibrate(src, Path(tmp) / "ids.npz", batch_size=batch, device=device.type)
        sync_device(device)
        calib_s = time.perf_counter() - start
        model = _plain_model(src, device)
        batches = [torch.from_numpy(ids[i:i + batch]).to(device) for i in range(0, rows, batch)]
        timed = batches if device.type == "cuda" or forward_rows is None else [batches[0][:forward_rows]]
        with torch.no_grad():
            model(input_ids=batches[0][:, :8], use_cache=False)  # warm, on a few tokens
            sync_device(device)
            start = time.perf_counter()
            for input_ids in timed:
                model(input_ids=input_ids, use_cache=False)
            sync_device(device)
        # the rows have the same length and each reaches every expert: the untimed ones cost what the timed do
        forward_s = (time.perf_counter() - start) * rows / sum(t.shape[0] for t in timed)
        del model
        floors = _matmul_floor(device, layers, rows * seq, experts, 4, hidden, hidden)
        nbytes = mxfp4_bytes(src)
        h2d_s = _h2d_floor(device, nbytes) if device.type == "cuda" else None
    floor_s = min(floors.values())
    tokens = rows * seq
    extra = {"tokens": tokens, "tokens_per_s": tokens / calib_s, "forward_tokens_per_s": tokens / forward_s,
             "forward_rows_timed": f"{sum(t.shape[0] for t in timed)} of {rows}", "batch_rows": batch,
             "layers_x_experts_x_H": f"{layers}x{experts}x{hidden}", "unrouted": len(result.unrouted),
             "device": str(device), **{f"{k}_s": round(v, 3) for k, v in result.timings.items()}}
    rows_out = [BenchResult(f"calibrate-checkpoint {rows}x{seq} tokens, H={hidden}", calib_s,
                            "transformers forward (bf16)", forward_s, None if device.type == "cuda" else goal, extra)]
    if h2d_s is None:
        rows_out.append(BenchResult("calibrate-checkpoint vs matmul floor", calib_s, "routed matmuls (fastest form)",
                                    floor_s, None, {"forward_over_floor": round(forward_s / floor_s, 2),
                                                    **{f"floor_{k}_s": round(v, 3) for k, v in floors.items()}}))
        return rows_out
    binding_s, binding = gpu_floor(h2d_s, floors["bf16"])
    floor_extra = {"h2d_s": round(h2d_s, 4), "mxfp4_bytes": nbytes, "h2d_GBps": round(nbytes / h2d_s / 1e9, 1),
                   "floor_bf16_s": round(floors["bf16"], 4), "ratio_to_resident_forward": round(calib_s / forward_s, 2),
                   "forward_over_floor": round(forward_s / binding_s, 2)}
    rows_out.append(BenchResult("calibrate-checkpoint vs GPU floor", calib_s, f"max(H2D copy, bf16 matmuls): {binding}",
                                binding_s, None if goal is None else GPU_FLOOR_GOAL, floor_extra))
    return rows_out


#: calibration on a GPU against the floor that binds there (module docstring), at gpt-oss-20b shapes
GPU_FLOOR_GOAL = 1.5


def measured_child(area: str, call: str, *argv) -> dict:
    """Run ``call`` (a line of Python reading ``sys.argv[1:]`` = ``argv``) in a child process; its seconds and its
    VmHWM (peak RSS, KiB) before and after: ``{"seconds", "rss_before_kib", "rss_after_kib"}``."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", _CHILD.format(call=call), *map(str, argv)], capture_output=True,
                         text=True, env=env, check=False)
    if out.returncode:
        raise RuntimeError(f"{area} bench: the child exited {out.returncode}: {out.stderr[-500:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _child(src: Path, data: Path, device: torch.device) -> dict:
    return measured_child("calibrate-checkpoint", "fp4pass.checkpoint.calibrate(sys.argv[1], sys.argv[2], "
                          "batch_size=4, device=sys.argv[3])", src, data, device.type)


def bench_depth_memory(device: torch.device, quick: bool) -> list[BenchResult]:
    hidden, experts, (shallow, deep) = (128, 4, (1, 4)) if quick else (1024, 16, (4, 16))
    with tempfile.TemporaryDirectory(prefix="fp4pass-bench-calib-") as tmp:
        np.savez(Path(tmp) / "ids.npz", input_ids=np.random.default_rng(1).integers(0, 32, size=(8, 64)))
        runs = {}
        for layers in (shallow, deep):
            src = build_checkpoint(Path(tmp) / f"ckpt{layers}", "gpt-oss", layers=layers, experts=experts,
                                   hidden=hidden, intermediate=hidden, seed=0, expert_step=0, runnable=True,
                                   vocab=32, shard_bytes=200_000_000)
            runs[layers] = _child(src, Path(tmp) / "ids.npz", device)
    a, b = runs[shallow], runs[deep]
    extra = {f"growth_{shallow}_MiB": (a["rss_after_kib"] - a["rss_before_kib"]) / 1024,
             f"growth_{deep}_MiB": (b["rss_after_kib"] - b["rss_before_kib"]) / 1024,
             f"seconds_{shallow}": a["seconds"], f"seconds_{deep}": b["seconds"], "hidden": hidden, "experts": experts}
    return [BenchResult(f"calibrate-checkpoint peak RSS {deep} vs {shallow} layers", b["rss_after_kib"] / 1024,
                        f"{shallow} layers", a["rss_after_kib"] / 1024, None if quick else 1.25, extra, unit="MiB")]


BENCHMARKS = [bench_against_forward, bench_depth_memory]
