"""Quantize/dequantize throughput of the format codecs, against ``torch.Tensor.clone`` of the same bytes."""

from __future__ import annotations

import torch

from fp4pass.bench import BenchResult, measure
from fp4pass.formats import MXFP4Tensor, NVFP4Tensor


def bench_codecs(device: torch.device, quick: bool) -> list[BenchResult]:
    n, k = (256, 4096) if quick else (2048, 4096)
    x = torch.randn(n, k, device=device)
    elements = x.numel()
    clone_f32 = measure(lambda: x.clone(), device=device)
    mx = MXFP4Tensor.quantize(x)
    nv = NVFP4Tensor.quantize(x)
    fp4_bytes = torch.cat([mx.codes.flatten(), mx.scales.flatten()])
    clone_fp4 = measure(lambda: fp4_bytes.clone(), device=device)
    rows = [
        ("mxfp4.quantize", lambda: MXFP4Tensor.quantize(x), "clone fp32 input", clone_f32),
        ("nvfp4.quantize", lambda: NVFP4Tensor.quantize(x), "clone fp32 input", clone_f32),
        ("mxfp4.dequantize", mx.dequantize, "clone fp32 output", clone_f32),
        ("nvfp4.dequantize", nv.dequantize, "clone fp32 output", clone_f32),
        ("mxfp4.dequantize (vs packed bytes)", mx.dequantize, "clone packed fp4 bytes", clone_fp4),
    ]
    results = []
    for name, fn, baseline, base_s in rows:
        seconds = measure(fn, device=device)
        results.append(
            BenchResult(f"{name} [{device.type}]", seconds, baseline, base_s,
                        extra={"elements_per_s": elements / seconds, "elements": elements})
        )
    return results


BENCHMARKS = [bench_codecs]
