"""``fp4pass convert`` on a generated MXFP4 model with external data (about 1 GB; 64 MB with ``quick``).

Built by the benchmark in a temporary folder: ``layers`` DequantizeLinear-24 nodes, each an expert weight
[E, N, K] FLOAT4E2M1 (random nibbles) with E8M0 scales in a narrow exponent range (lossless, as real gpt-oss
layers are), all data in one external file.

- time: ``fp4pass.onnx.convert(path, output=...)`` in a fresh subprocess (imports excluded), as a ratio to
  copying the same input bytes (``shutil.copyfile`` of the model and its data). Goal <= 1.5x. Both start
  after ``os.sync()``, so that neither waits on writing back the dirty pages of what was written before it.
- memory: the subprocess's peak RSS during ``convert`` over its RSS just before it (Linux: VmHWM reset through
  /proc/self/clear_refs after the imports; elsewhere ``ru_maxrss``), minus the same for a tiny model, in MiB
  (``unit="MiB"``), as a ratio to the largest tensor's MiB. Goal <= 2x.
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

import numpy as np
import onnx
from onnx import TensorProto, helper

from fp4pass.bench import BenchResult

__all__ = ["build_large_model", "bench_convert_large", "BENCHMARKS"]

_CHILD = r"""
import json, resource, sys, time
from fp4pass.onnx import convert


def status_kb(key):
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))
    except (OSError, StopIteration):
        return None


try:  # Linux: reset the peak (VmHWM) to the current RSS, so that import-time peaks do not hide the convert's
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before_kb = status_kb("VmRSS")
except OSError:
    before_kb = None
start = time.perf_counter()
convert(sys.argv[1], output=sys.argv[2])
seconds = time.perf_counter() - start
peak_kb = status_kb("VmHWM") if before_kb is not None else None
print(json.dumps({"seconds": seconds, "max_rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                  "convert_peak_growth_kb": None if peak_kb is None else peak_kb - before_kb}))
"""


def build_large_model(folder: Path, layers: int, experts: int, n: int, k: int, seed: int = 0) -> tuple[Path, int]:
    """Write ``model.onnx`` + ``model.onnx.data``; returns (path, bytes of the largest tensor)."""
    rng = np.random.default_rng(seed)
    data_path = folder / "model.onnx.data"
    inits, nodes, outputs = [], [], []
    offset = 0
    codes_bytes = experts * n * k // 2
    with open(data_path, "wb") as f:
        for i in range(layers):
            name = f"layer{i}.experts.w"
            for tensor_name, dtype, dims, nbytes, make in (
                (name, TensorProto.FLOAT4E2M1, [experts, n, k], codes_bytes,
                 lambda size: rng.integers(0, 256, size, dtype=np.uint8)),
                (f"{name}_scale", TensorProto.FLOAT8E8M0, [experts, n, k // 32], experts * n * k // 32,
                 lambda size: rng.integers(118, 128, size, dtype=np.uint8)),
            ):
                f.write(make(nbytes).tobytes())
                t = TensorProto(name=tensor_name, data_type=dtype, dims=dims, data_location=TensorProto.EXTERNAL)
                for key, value in (("location", data_path.name), ("offset", str(offset)), ("length", str(nbytes))):
                    t.external_data.add(key=key, value=value)
                inits.append(t)
                offset += nbytes
            nodes.append(helper.make_node("DequantizeLinear", [name, f"{name}_scale"], [f"{name}_dq"],
                                          axis=-1, block_size=32, output_dtype=TensorProto.FLOAT))
            outputs.append(helper.make_tensor_value_info(f"{name}_dq", TensorProto.FLOAT, [experts, n, k]))
    graph = helper.make_graph(nodes, "large", [], outputs, initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24)], ir_version=12)
    path = folder / "model.onnx"
    onnx.save(model, path)
    return path, codes_bytes


def _child(model: Path, out: Path) -> dict:
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(model), str(out)], capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"convert subprocess failed: {proc.stderr.strip()[-500:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def bench_convert_large(device, quick: bool) -> list[BenchResult]:
    if device.type != "cpu":
        return []  # the ONNX pass runs on the host
    layers, experts, n, k = (4, 4, 1024, 2048) if quick else (32, 8, 2048, 4096)
    with tempfile.TemporaryDirectory(prefix="fp4pass-bench-") as tmp:
        tmp = Path(tmp)
        (tmp / "big").mkdir()
        (tmp / "tiny").mkdir()
        model, largest = build_large_model(tmp / "big", layers, experts, n, k)
        tiny, _ = build_large_model(tmp / "tiny", 1, 1, 32, 64)
        input_bytes = model.stat().st_size + (tmp / "big" / "model.onnx.data").stat().st_size
        os.sync()  # neither side pays for writing back the other's (or the builder's) dirty pages
        start = time.perf_counter()
        shutil.copyfile(model, tmp / "copy.onnx")
        shutil.copyfile(tmp / "big" / "model.onnx.data", tmp / "copy.onnx.data")
        copy_seconds = time.perf_counter() - start
        (tmp / "copy.onnx.data").unlink()
        tiny_run = _child(tiny, tmp / "tiny" / "out.onnx")
        os.sync()
        big_run = _child(model, tmp / "big" / "out.onnx")
    if big_run["convert_peak_growth_kb"] is not None and tiny_run["convert_peak_growth_kb"] is not None:
        # peak RSS over the RSS just before convert() (imports done), less the same for the tiny model
        rss_growth_mib = (big_run["convert_peak_growth_kb"] - tiny_run["convert_peak_growth_kb"]) / 1024
        how = "VmHWM-VmRSS"
    else:  # no /proc: whole-process peaks (import-time peaks can hide a small working set)
        rss_growth_mib = (big_run["max_rss_kb"] - tiny_run["max_rss_kb"]) / 1024
        how = "ru_maxrss"
    largest_mib = largest / 2**20
    size = f"{input_bytes / 2**30:.2f} GiB"
    return [
        BenchResult(f"onnx.convert {size} external data", big_run["seconds"], "copy the same bytes", copy_seconds,
                    goal=1.5, extra={"input_bytes": input_bytes, "GB_per_s": input_bytes / big_run["seconds"] / 1e9}),
        BenchResult(f"onnx.convert {size} peak RSS growth", rss_growth_mib, f"largest tensor ({largest_mib:g} MiB)",
                    largest_mib, goal=2.0, unit="MiB",
                    extra={"rss_growth_over_largest_tensor": rss_growth_mib / largest_mib, "measured_as": how,
                           "tiny_rss_MiB": tiny_run["max_rss_kb"] / 1024}),
    ]


BENCHMARKS = [bench_convert_large]
