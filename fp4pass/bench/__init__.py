"""Benchmarks: every figure is a ratio to a baseline measured in the same process, on the same bytes.

Each module here (one per area: formats, convert, onnx, diff, calib, fx) defines ``BENCHMARKS``, a list of
functions ``bench(device: torch.device, quick: bool) -> list[BenchResult]``. ``fp4pass bench`` runs them all.
A ratio is ``seconds / baseline_seconds``: lower is better, 1.0 means as fast as the baseline.
"""

from __future__ import annotations

import importlib
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:  # torch is imported by the benchmarks that run: `fp4pass bench --help` does not load it
    import torch

__all__ = ["BenchResult", "measure", "run_benchmarks", "format_row", "format_table", "AREAS", "HEADER", "RATIO_NOTE"]

AREAS = ("formats", "convert", "onnx", "diff", "calib", "checkpoint", "fx", "calibrate-checkpoint", "diff-checkpoint",
         "startup")


@dataclass
class BenchResult:
    """One measurement: ``seconds`` for ``name`` against ``baseline_seconds`` for ``baseline``.

    ``unit``: what ``seconds`` and ``baseline_seconds`` hold; "s" (the default) for times, else e.g. "MiB" for a
    memory measurement (both fields then in that unit, the ratio unchanged).
    """

    name: str
    seconds: float
    baseline: str
    baseline_seconds: float
    goal: float | None = None  # the target ratio (<=), if any: docs/results.md states it
    extra: dict = field(default_factory=dict)  # throughput, bytes, peak memory, ...
    unit: str = "s"
    quick: bool = False  # measured at --quick sizes: a goal stated for the full size is not judged

    @property
    def met(self) -> bool | None:
        """Whether the goal is met; None without a goal, or at --quick sizes (goals are for the full sizes)."""
        return None if self.goal is None or self.quick else self.ratio <= self.goal

    @property
    def ratio(self) -> float:
        return self.seconds / self.baseline_seconds if self.baseline_seconds > 0 else float("inf")

    def to_json(self) -> dict:
        return {**asdict(self), "ratio": self.ratio, "met": self.met}


def measure(fn: Callable[[], object], repeat: int = 5, device: torch.device | None = None) -> float:
    """Best wall time of ``repeat`` calls (after one warm-up), synchronizing CUDA around each call."""

    def sync():
        if device is not None and device.type == "cuda":
            import torch

            torch.cuda.synchronize(device)

    fn()
    best = float("inf")
    for _ in range(repeat):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def run_benchmarks(device: torch.device, quick: bool = False, areas=AREAS, log=print) -> list[BenchResult]:
    results: list[BenchResult] = []
    for area in areas:
        module = importlib.import_module(f"fp4pass.bench.{area.replace('-', '_')}")
        for bench in module.BENCHMARKS:
            for result in bench(device, quick):
                result.quick = quick
                log(format_row(result))
                results.append(result)
    return results


def format_row(r: BenchResult) -> str:
    if r.goal is None:
        goal = ""
    elif r.met is None:
        goal = f"  goal <= {r.goal:g}x at full size, not judged at --quick size"
    else:
        goal = f"  goal <= {r.goal:g}x {'met' if r.met else 'MISSED'}"
    extra = "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.extra.items())
    value = f"{r.seconds * 1e3:10.2f} ms " if r.unit == "s" else f"{r.seconds:10.2f} {r.unit:<3}"
    return f"{r.name:<44} {value}  {r.ratio:7.2f}x {r.baseline}{goal}  {extra}"


RATIO_NOTE = ("ratio = measured / baseline, both in the same process: lower is better (1.00x = the baseline's "
              "time, or its memory for MiB rows); a goal is met at or below its ratio")


HEADER = f"{'benchmark':<44} {'time':>13}  {'ratio':>7} baseline"


def format_table(results: list[BenchResult]) -> str:
    return "\n".join([HEADER, *(format_row(r) for r in results), RATIO_NOTE])
