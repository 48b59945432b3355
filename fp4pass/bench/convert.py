"""MXFP4 -> NVFP4 conversion throughput, as ratios to a clone of the same bytes (codes + scales).

- lossless path (every expert's spread <= 17, the usual case): goal within 2x of the memcpy on the full-size
  tensor [8, 2880, 2880]. With ``quick`` ([2, 256, 2880], a 30 us clone) the ratio measures the fixed cost of
  a call (about 0.1 ms of Python and op dispatch) rather than throughput, so no goal is attached there.
- lossy path (an outlier per expert pushes the spread to ~20): ``auto`` (effort best, and fast) and ``hybrid``
  against the same memcpy and against plain requantization (``requant``) of the same tensor.
  ``fp4pass bench --peers`` sets the lossy path against ModelOpt's casts (``fp4pass.bench.peers``).
"""

from __future__ import annotations

import torch

from fp4pass.bench import BenchResult, measure
from fp4pass.convert import DEFAULT_EFFORT, mxfp4_to_nvfp4
from fp4pass.formats import MXFP4Tensor


def _expert_weight(device: torch.device, quick: bool, outlier: bool) -> MXFP4Tensor:
    shape = (2, 256, 2880) if quick else (8, 2880, 2880)  # gpt-oss expert shape, H = I = 2880
    torch.manual_seed(0)
    x = torch.randn(shape, device=device) * 0.02
    if outlier:
        x[:, 0, 0] = 1e4
    return MXFP4Tensor.quantize(x)


def bench_convert(device: torch.device, quick: bool) -> list[BenchResult]:
    results = []
    lossless = _expert_weight(device, quick, outlier=False)
    lossy = _expert_weight(device, quick, outlier=True)
    for label, mx in (("lossless", lossless), ("lossy", lossy)):
        nbytes = mx.codes.numel() + mx.scales.numel()
        memcpy = measure(lambda: (mx.codes.clone(), mx.scales.clone()), repeat=20, device=device)
        shape = "x".join(map(str, mx.shape))
        methods = ("auto",) if label == "lossless" else ("auto", "auto-fast", "hybrid")
        requant = None
        if label == "lossy":
            requant = measure(lambda: mxfp4_to_nvfp4(mx, "requant"), repeat=2, device=device)
        for method in methods:
            name, effort = ("auto", "fast") if method == "auto-fast" else (method, DEFAULT_EFFORT)
            seconds = measure(lambda: mxfp4_to_nvfp4(mx, name, effort=effort), repeat=20 if label == "lossless" else 2,
                              device=device)
            extra = {"bytes_per_s": nbytes / seconds, "shape": shape}
            if requant is not None:
                extra["vs_requant"] = seconds / requant
            goal = 2.0 if label == "lossless" and not quick else None
            if label == "lossless" and quick:
                extra["goal"] = "<= 2x on 8x2880x2880 (not --quick)"
            results.append(BenchResult(f"convert {method} {label} [{device.type}]", seconds,
                                       "clone codes+scales", memcpy, goal, extra))
        if requant is not None:
            results.append(BenchResult(f"convert requant {label} [{device.type}]", requant, "clone codes+scales",
                                       memcpy, None, {"bytes_per_s": nbytes / requant, "shape": shape}))
    return results


BENCHMARKS = [bench_convert]
