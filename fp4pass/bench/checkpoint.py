"""Checkpoint conversion: time against ``cp -r`` of the same folder, peak memory against the largest tensor, and a
lossy expert against its lossless neighbours.

- per-expert model (DeepSeek-V4 form, gpt-oss-20b's expert shapes H = I = 2880; 4 layers x 32 experts, 1.6 GB):
  ``fp4pass.checkpoint.convert`` against ``cp -r`` of the source folder (goal <= 1.5x; the codes need no
  reordering);
- gpt-oss fused experts (gpt-oss-20b shapes, 4 layers, 1.6 GB) into ModelOpt's transposed layout (goal <= 3x);
- peak RSS growth of the conversion (a child process: its max RSS after the conversion minus before it) over the
  largest tensor's bytes (goal <= 2x);
- one lossy expert in a [32, 5760, 2880] stack through each front door: the checkpoint engine
  (``fp4pass.checkpoint.engine.convert_experts``), ``fp4pass.fx.convert`` (a GraphModule reading the stack through
  ``dequantize_mxfp4``) and ``fp4pass.onnx.convert`` (an in-memory model with DequantizeLinear FP4/E8M0 on it),
  each against the parts through the engine: that expert alone plus the 31 others alone (goal <= 1.2x). The
  parts keep the 31 lossless experts' nibbles as they are (a scale remap); the whole stack also writes a copy of
  every nibble (its output owns its codes) and, for the report's SNR, sums the lossless experts' signal.

Each figure is the pair of median ratio among five back-to-back pairs (three when ``quick``; ``sync`` before
each run); ``ratios`` lists them all, and ``best_ratio`` is the conversion's fastest run over ``cp -r``'s fastest.
The two take turns at going first, and each run starts right after the folder written by the last run of its
kind is removed, so both write into page-cache pages just freed: on a virtual machine whose host takes back the
guest's free memory, a run that writes into memory free for a few seconds finds pages the host must back anew,
and the same ``cp -r`` then takes 2-8x as long (three copies of one folder in a row measured 0.59, 0.67 and
4.51 s, all of it system time). The conversion's process imports fp4pass before that removal, and the time
counted is that of ``fp4pass.checkpoint.convert`` alone. The conversion fsyncs its output and ``cp -r`` does
not, so a second, fair baseline is reported beside the stated one: the same ``cp -r`` plus an fsync of every
file it copied (the time of ``cp -r && sync -f``, without flushing other processes' files). ``quick``: a folder
of a few MB (fixed costs dominate; no goals) and an [8, 576, 2880] stack. The folders live in a temporary
folder that is removed afterwards.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import fp4pass.fx
import fp4pass.onnx
from fp4pass.bench import BenchResult
from fp4pass.checkpoint.engine import convert_experts
from fp4pass.examples.checkpoints import build_checkpoint
from fp4pass.formats import MXFP4Tensor

# VmHWM (this process's peak RSS), not getrusage's ru_maxrss, which Linux carries over from the parent at exec.
# The child imports first and converts when a line arrives on stdin, so that the parent can free the pages of the
# previous run just before (see the module's docstring).
_CHILD = """
import json, sys, time
import fp4pass.checkpoint

def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])

print("ready", flush=True)
sys.stdin.readline()
before = hwm()
start = time.perf_counter()
fp4pass.checkpoint.convert(sys.argv[1], sys.argv[2], format=sys.argv[3])
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "rss_before_kib": before, "rss_after_kib": hwm()}))
"""


def _cp(src: Path, dst: Path) -> float:
    start = time.perf_counter()
    subprocess.run(["cp", "-r", str(src), str(dst)], check=True)
    return time.perf_counter() - start


def _fsync_tree(folder: Path) -> float:
    """Seconds to fsync every file under ``folder`` (what the conversion does to its own output)."""
    start = time.perf_counter()
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    return time.perf_counter() - start


def _convert_child(src: Path, dst: Path, fmt: str, before=lambda: None) -> dict:
    """Convert ``src`` into ``dst`` in a fresh process; ``before()`` runs once the child has imported fp4pass, just
    before it starts (the timed part)."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    with subprocess.Popen([sys.executable, "-c", _CHILD, str(src), str(dst), fmt], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True, env=env) as child:
        ready = child.stdout.readline()
        if ready.strip() != "ready":
            child.kill()
            raise RuntimeError(f"checkpoint bench: the conversion's process did not start ({ready!r})")
        before()
        out, _ = child.communicate("go\n")
    if child.returncode:
        raise RuntimeError(f"checkpoint bench: the conversion's process exited with {child.returncode}")
    return json.loads(out.strip().splitlines()[-1])


def _largest(folder: Path) -> int:
    from fp4pass.safetensors.catalog import Catalog

    with Catalog.open(folder) as catalog:
        return max(e.nbytes for e in catalog.tensors.values())


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


def _against_cp(label: str, form: str, fmt: str, quick: bool, goal: float, work: Path) -> list[BenchResult]:
    if quick:
        kwargs = {"layers": 1, "experts": 4, "hidden": 256, "intermediate": 256}
    else:
        kwargs = {"layers": 4, "experts": 32, "hidden": 2880, "intermediate": 2880}
    src = build_checkpoint(work / f"src-{label}", form, seed=0, shard_bytes=500_000_000, tokenizer=True, **kwargs)
    size = _folder_bytes(src)
    pairs, synced, runs = [], [], []

    last: dict[str, Path] = {}

    def fresh(kind: str, path: Path) -> None:  # free the last run's pages (its output), then sync the disk
        if kind in last:
            shutil.rmtree(last[kind])
        last[kind] = path
        os.sync()

    def timed_cp(i: int) -> tuple[float, float]:
        copy = work / f"cp-{label}-{i}"
        fresh("cp", copy)
        cp_s = _cp(src, copy)
        return cp_s, _fsync_tree(copy)

    def timed_convert(i: int) -> dict:
        out = work / f"out-{label}-{i}"
        return _convert_child(src, out, fmt, before=lambda: fresh("out", out))

    # unmeasured: the first measured runs too find a last run's pages to reuse
    timed_cp(-1)
    timed_convert(-1)
    for i in range(3 if quick else 5):  # cp -r and the conversion back to back, taking turns at going first
        if i % 2:
            run = timed_convert(i)
            cp_s, fsync_s = timed_cp(i)
        else:
            cp_s, fsync_s = timed_cp(i)
            run = timed_convert(i)
        pairs.append((run["seconds"], cp_s))
        synced.append((run["seconds"], cp_s + fsync_s))
        runs.append(run)
    conv_s, cp_s = sorted(pairs, key=lambda p: p[0] / p[1])[len(pairs) // 2]  # the pair of median ratio
    conv_synced_s, cp_synced_s = sorted(synced, key=lambda p: p[0] / p[1])[len(synced) // 2]
    largest = _largest(src)
    growth = max(r["rss_after_kib"] - r["rss_before_kib"] for r in runs) * 1024
    for path in (src, *last.values()):
        shutil.rmtree(path)
    shape = "x".join(map(str, (kwargs["layers"], kwargs["experts"], kwargs["hidden"])))
    extra = {"folder_MB": size / 1e6, "layers_x_experts_x_H": shape, "format": fmt,
             "ratios": " ".join(f"{c / b:.2f}" for c, b in pairs),
             "best_ratio": round(min(c for c, _ in pairs) / min(b for _, b in pairs), 2),
             "convert_s": " ".join(f"{c:.2f}" for c, _ in pairs), "cp_s": " ".join(f"{b:.2f}" for _, b in pairs)}
    return [
        BenchResult(f"checkpoint {label} convert", conv_s, "cp -r", cp_s, None if quick else goal, extra),
        BenchResult(f"checkpoint {label} convert (fsynced baseline)", conv_synced_s, "cp -r + fsync", cp_synced_s,
                    None, {"format": fmt, "ratios": " ".join(f"{c / b:.2f}" for c, b in synced)}),
        BenchResult(f"checkpoint {label} peak RSS growth", growth / 2**20, "largest tensor", largest / 2**20,
                    None if quick else 2.0, {"largest_MB": largest / 1e6}, unit="MiB"),
    ]


def bench_against_cp(device: torch.device, quick: bool) -> list[BenchResult]:
    if device.type != "cpu":
        return []
    with tempfile.TemporaryDirectory(prefix="fp4pass-bench-ckpt-") as tmp:
        work = Path(tmp)
        return (_against_cp("per-expert", "deepseek", "modelopt", quick, 1.5, work)
                + _against_cp("gpt-oss fused", "gpt-oss", "modelopt", quick, 3.0, work))


def _stack(quick: bool, lossy: int) -> MXFP4Tensor:
    e, n, k = (8, 576, 2880) if quick else (32, 5760, 2880)
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, generator=gen)
    scales = (120 + torch.randint(-3, 4, (e, n, k // 32), generator=gen)).to(torch.uint8)
    scales[lossy, 0, 0] = 100  # 20 octaves under the rest: that expert's spread > 17
    codes[lossy, 0, :16] = 0x77
    return MXFP4Tensor(codes, scales, 32, name="stack")


def _fx_door(mx: MXFP4Tensor):
    """A GraphModule reading the stack through ``torch.ops.fp4pass.dequantize_mxfp4`` into a bmm (built untimed)."""
    root = torch.nn.Module()
    root.register_buffer("codes", mx.codes)
    root.register_buffer("scales", mx.scales)
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    w = graph.call_function(torch.ops.fp4pass.dequantize_mxfp4.default, (graph.get_attr("codes"),
                                                                           graph.get_attr("scales")))
    wt = graph.call_function(torch.ops.aten.transpose.int, (w, 1, 2))
    graph.output(graph.call_function(torch.ops.aten.bmm.default, (x, wt)))
    gm = torch.fx.GraphModule(root, graph)
    return lambda: fp4pass.fx.convert(gm)


def _onnx_door(mx: MXFP4Tensor):
    """An onnx_ir model with DequantizeLinear (FP4 codes, E8M0 scales, block 32) on the stack into a MatMul."""
    import numpy as np
    import onnx_ir as ir

    e, n, k = mx.shape
    codes = ir.PackedTensor(mx.codes.numpy(), ir.DataType.FLOAT4E2M1, shape=ir.Shape([e, n, k]), name="W")
    scales = ir.Tensor(mx.scales.numpy().view(np.uint8), dtype=ir.DataType.FLOAT8E8M0, name="W_scale")
    w, s = ir.Value(name="W", const_value=codes), ir.Value(name="W_scale", const_value=scales)
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([e, "t", k]))
    dq = ir.node("DequantizeLinear", [w, s], attributes={"axis": -1, "block_size": 32,
                                                         "output_dtype": ir.DataType.FLOAT}, name="dq")
    t = ir.node("Transpose", dq.outputs, attributes={"perm": [0, 2, 1]}, name="t")
    mm = ir.node("MatMul", [x, t.outputs[0]], name="mm")
    mm.outputs[0].name = "y"
    graph = ir.Graph([x], mm.outputs, nodes=[dq, t, mm], initializers=[w, s], opset_imports={"": 24})
    model = ir.Model(graph, ir_version=12)
    return lambda: fp4pass.onnx.convert(model)


def bench_lossy_expert(device: torch.device, quick: bool) -> list[BenchResult]:
    """One lossy expert in a stack through each front door against the parts through the engine (module docstring)."""
    if device.type != "cpu":
        return []
    lossy = 5
    mx = _stack(quick, lossy)
    e = mx.shape[0]
    alone = MXFP4Tensor(mx.codes[lossy:lossy + 1].clone(), mx.scales[lossy:lossy + 1].clone(), 32)
    keep = [i for i in range(e) if i != lossy]
    rest = MXFP4Tensor(mx.codes[keep].contiguous(), mx.scales[keep].contiguous(), 32)
    doors = {"checkpoint engine": lambda: (lambda: convert_experts(mx)), "fx.convert": lambda: _fx_door(mx),
             "onnx.convert": lambda: _onnx_door(mx)}

    def timed(fn) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    convert_experts(alone)  # warm-up
    wholes: dict[str, list[float]] = {door: [] for door in doors}
    parts_list = []
    for _ in range(3):  # interleaved rounds, medians: other load on the machine hits every side alike
        parts_list.append(timed(lambda: convert_experts(alone)) + timed(lambda: convert_experts(rest)))
        for door, build in doors.items():
            wholes[door].append(timed(build()))  # the model is built untimed, each round afresh
    parts = sorted(parts_list)[1]
    shape = "x".join(map(str, mx.shape))
    return [BenchResult(f"{door} one lossy expert", sorted(runs)[1], "lossy alone + rest alone", parts,
                        None if quick else 1.2, {"shape": shape, "runs_s": " ".join(f"{r:.2f}" for r in runs),
                                                 "parts_s": " ".join(f"{p:.2f}" for p in parts_list)})
            for door, runs in wholes.items()]


BENCHMARKS = [bench_lossy_expert, bench_against_cp]
