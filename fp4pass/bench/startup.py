"""Start-up time of the command line: ``fp4pass --version`` and ``fp4pass convert --help``, each in a fresh
interpreter, as a ratio to ``python -c pass`` in a fresh interpreter on the same machine, same moment.

Why: every command once imported torch first (3.7-4.2 s on 2 shared cores before the first line of output);
a command imports what it needs when it runs, so these two answer in about the time of the interpreter itself
plus fp4pass's own argument parser. The best of ``repeat`` runs of each, taking turns, so that a busy moment of
the machine weighs on the three alike. CPU only (a CUDA row would time the same thing again).
"""

from __future__ import annotations

import subprocess
import sys
import time

from fp4pass.bench import BenchResult

#: the commands timed, as given to ``python -m fp4pass``
COMMANDS = (("--version",), ("convert", "--help"))
BASELINE = "python -c pass"


def _seconds(argv: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    return time.perf_counter() - start


def startup_seconds(repeat: int) -> dict[str, float]:
    """The best wall time of ``repeat`` runs of each command and of the baseline, taken in turns."""
    runs = {BASELINE: [sys.executable, "-c", "pass"]}
    runs.update({"fp4pass " + " ".join(c): [sys.executable, "-m", "fp4pass", *c] for c in COMMANDS})
    best = {name: float("inf") for name in runs}
    for _ in range(repeat):
        for name, argv in runs.items():
            best[name] = min(best[name], _seconds(argv))
    return best


def bench_startup(device, quick: bool) -> list[BenchResult]:
    if getattr(device, "type", "cpu") != "cpu":
        return []
    best = startup_seconds(3 if quick else 10)
    base = best.pop(BASELINE)
    return [BenchResult(f"startup {name}", seconds, BASELINE, base) for name, seconds in best.items()]


BENCHMARKS = [bench_startup]
