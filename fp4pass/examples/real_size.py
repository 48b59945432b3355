"""The torch path on a gpt-oss-20b-shaped model, stage by stage: memory and time of each.

    python -m fp4pass.examples.real_size FOLDER [--layers 24] [--batches 4] [--tokens 64] [--json OUT.json]

Builds (once; skipped when FOLDER already holds a checkpoint) a random gpt-oss checkpoint with gpt-oss-20b's
shapes and ``--layers`` layers (:func:`fp4pass.examples.gpt_oss_tiny.build_sized_gpt_oss`: about 13 GB for all
24 layers, written shard by shard), then runs the path a user runs, in one process:

1. ``fp4pass.fx.load_gpt_oss(FOLDER, dtype=torch.bfloat16)``: the float weights stay bf16 as stored, so every
   tensor is mapped from the checkpoint's files (safetensors' memory map) and nothing is copied;
2. ``torch.export`` with dynamic batch and sequence; 3. ``fp4pass.fx.convert``;
4. ``fp4pass.fx.calibrate`` on ``--batches`` batches of [1, ``--tokens``] token ids;
5. ``fp4pass.fx.diff`` of the calibrated program against the exported one, on the first batch.

For each stage: seconds, the process's RSS before and after, and its peak RSS during the stage (``VmHWM``,
reset through ``/proc/self/clear_refs`` before each stage), plus the machine's memory in use (``MemTotal -
MemAvailable``) at its highest, sampled every 0.2 s. RSS counts the checkpoint's mapped pages, which are file
pages the kernel drops and reads again under pressure; "memory in use" counts what it cannot drop. Linux only.
The weights are random: the diff's figures say nothing about accuracy.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import threading
import time
from pathlib import Path

__all__ = ["run_stages", "main", "status_mib", "reset_peak"]


def status_mib(key: str) -> float | None:
    """A ``/proc/self/status`` figure (``VmRSS``, ``VmHWM``: kB) in MiB; None where it cannot be read."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def reset_peak() -> bool:
    """Reset this process's peak RSS (``VmHWM``) to its current RSS; False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _status_gib(key: str) -> float:
    mib = status_mib(key)
    if mib is None:
        raise RuntimeError(f"/proc/self/status has no {key}")
    return mib / 1024


def _in_use_gib() -> float:
    fields = {}
    with open("/proc/meminfo") as f:
        for line in f:
            name, value = line.split(":", 1)
            fields[name] = int(value.split()[0])
    return (fields["MemTotal"] - fields["MemAvailable"]) / 2**20


class _Sampler:
    """The highest value of ``probe`` (GiB; default the machine's memory in use, from /proc/meminfo) while a
    stage runs, sampled every ``period`` seconds by a background thread."""

    def __init__(self, period: float = 0.2, probe=_in_use_gib):
        self.probe = probe
        self.period, self.high, self._stop = period, probe(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self.high = max(self.high, self.probe())

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def _stage(figures: dict, name: str, fn):
    gc.collect()
    if not reset_peak():  # VmHWM back to the current RSS
        raise RuntimeError("/proc/self/clear_refs cannot be written: no peak RSS per stage")
    before = _status_gib("VmRSS")
    start = time.perf_counter()
    with _Sampler() as sampler:
        result = fn()
    seconds = time.perf_counter() - start
    gc.collect()
    figures[name] = {"seconds": round(seconds, 1), "rss_before_gib": round(before, 2),
                     "rss_peak_gib": round(_status_gib("VmHWM"), 2), "rss_after_gib": round(_status_gib("VmRSS"), 2),
                     "machine_in_use_peak_gib": round(sampler.high, 2)}
    print(f"{name}: {json.dumps(figures[name])}", file=sys.stderr, flush=True)
    return result


def run_stages(folder: str | Path, layers: int = 24, batches: int = 4, tokens: int = 64, seed: int = 0,
               config: dict | None = None) -> dict:
    """Build the checkpoint in ``folder`` when it has none, run the five stages; the figures (module docstring).

    ``config``: GptOssConfig fields over gpt-oss-20b's for the build (a smaller model for a quick try).
    """
    import torch

    import fp4pass.fx
    from fp4pass.examples.gpt_oss_tiny import build_sized_gpt_oss
    from fp4pass.fx.gpt_oss import CausalLMLogits

    folder = Path(folder)
    figures: dict = {"layers": layers, "batches": batches, "tokens": tokens, "stages": {}}
    stages = figures["stages"]
    if not (folder / "config.json").exists():
        _stage(stages, "build", lambda: build_sized_gpt_oss(folder, {**(config or {}), "num_hidden_layers": layers},
                                                               seed=seed))
    figures["checkpoint_gib"] = round(sum(p.stat().st_size for p in folder.glob("*.safetensors")) / 2**30, 2)
    model = _stage(stages, "load", lambda: fp4pass.fx.load_gpt_oss(folder, dtype=torch.bfloat16,
                                                                   num_hidden_layers=layers))
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(seed)
    data = [torch.randint(0, vocab, (1, tokens), generator=generator) for _ in range(batches)]
    dims = ({0: torch.export.Dim("batch", max=64), 1: torch.export.Dim("seq", min=2, max=4096)},)
    example = torch.randint(0, vocab, (2, 16), generator=generator)
    program = _stage(stages, "export", lambda: torch.export.export(CausalLMLogits(model), (example,),
                                                                   dynamic_shapes=dims))
    converted, report = _stage(stages, "convert", lambda: fp4pass.fx.convert(program))
    calibrated, _ = _stage(stages, "calibrate", lambda: fp4pass.fx.calibrate(converted, data))
    result = _stage(stages, "diff", lambda: fp4pass.fx.diff(program, calibrated, (data[0],)))
    figures["convert_summary"] = report["summary"]
    figures["diff_output_snr_db"] = [m.snr_db for m in result.outputs]
    figures["diff_intermediates"] = len(result.intermediates)
    return figures


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fp4pass.examples.real_size", description=__doc__.split("\n")[0],
                                epilog="example: python -m fp4pass.examples.real_size /data/gpt-oss-20b-shaped "
                                       "--layers 24 --json stages.json")
    p.add_argument("folder", help="the checkpoint folder (built there when it holds no config.json)")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--batches", type=int, default=4)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="OUT.json", help="also write the figures here")
    args = p.parse_args(argv)
    if min(args.layers, args.batches) < 1 or args.tokens < 2:
        p.error("--layers and --batches must be >= 1, --tokens >= 2")
    from fp4pass.errors import FP4PassError
    from fp4pass.io import output_target, write_json

    try:
        if args.json:
            output_target(args.json, "--json")  # refused now (a device, a FIFO, a symlink out), not after the run
        figures = run_stages(args.folder, args.layers, args.batches, args.tokens, args.seed)
        print(json.dumps(figures, indent=2))
        if args.json:
            write_json(args.json, figures)
    except FP4PassError as exc:  # a folder whose checkpoint does not fit, an output that is not ours: one line
        print(f"python -m fp4pass.examples.real_size: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
