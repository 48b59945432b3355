"""The torch path at real layer sizes: memory of a forward, ``fx.diff`` and ``fx.calibrate`` time, routed experts.

The model: :func:`fp4pass.examples.gpt_oss_tiny.build_sized_gpt_oss` with gpt-oss-20b's layer shapes (hidden
2880, intermediate 2880, 32 experts, top-4, 64 heads) and 2 layers, a vocabulary of 4096 (the embedding and
head are not what is measured), random MXFP4 expert bytes; loaded by :func:`fp4pass.fx.load_gpt_oss`
(float32), exported with dynamic batch and sequence, converted by :func:`fp4pass.fx.convert`. ``quick``: a
small model of the same structure. Input: ``input_ids`` [1, 64]. Each figure is a ratio to a baseline run in
the same process:

- forward peak RSS growth per layer (MiB) of the exported program's forward (dense experts: the forward that
  ``fx.calibrate`` and ``fx.diff`` run) and of the eager routed forward, over the resident model: the peak
  RSS during one forward (``VmHWM`` after resetting it through ``/proc/self/clear_refs``) minus the RSS
  before it, divided by the layers. Baseline: the resident model's RSS. Target: 1536 MiB per layer.
- ``fx.diff`` (defaults) against one plain forward of each program. Goal: <= 3x.
- the routed eager forward against the dense eager forward, on [1, 64] tokens (goal: <= 0.25x, 4x faster) and
  on [1, 4]. Each row says how many distinct experts the tokens picked per layer: 64 tokens x top-4 of 32 pick
  nearly all of them, so both forwards dequantize every expert and routing saves only the matmuls' 8x.
- ``fx.calibrate`` on 4 batches against 4 plain forwards of the program.
"""

from __future__ import annotations

import gc
import os
import tempfile
import time

import torch

from fp4pass.bench import BenchResult
from fp4pass.examples.real_size import reset_peak, status_mib

__all__ = ["BENCHMARKS", "bench_fx", "SIZED", "QUICK", "peak_growth_mib"]

#: the model of the full run: 2 layers of gpt-oss-20b's shapes, vocabulary 4096
SIZED = {"num_hidden_layers": 2, "vocab_size": 4096}
#: the model of ``--quick``: the same structure, small
QUICK = {"num_hidden_layers": 2, "vocab_size": 512, "hidden_size": 256, "intermediate_size": 256,
         "num_local_experts": 8, "num_experts_per_tok": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
TOKENS = 64
#: a short forward (a few decode steps' worth of tokens): the case where top-k routing leaves experts out
DECODE_TOKENS = 4
TARGET_MIB_PER_LAYER = 1536


def peak_growth_mib(fn) -> float | None:
    """MiB the peak RSS rose over the RSS before ``fn()`` (None where /proc gives no peak to reset)."""
    gc.collect()
    if not reset_peak():
        return None
    before = status_mib("VmRSS")
    fn()
    peak = status_mib("VmHWM")
    return None if before is None or peak is None else max(0.0, peak - before)


def _experts_picked(model, ids: torch.Tensor) -> float:
    """Mean number of distinct experts the tokens of ``ids`` pick per layer (what a routed forward dequantizes)."""
    seen = []

    def hook(module, args, kwargs):
        indices = kwargs.get("router_indices", args[1] if len(args) > 1 else None)
        if indices is not None:
            seen.append(int(torch.unique(indices).numel()))

    handles = [layer.mlp.experts.register_forward_pre_hook(hook, with_kwargs=True) for layer in model.model.layers]
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for handle in handles:
            handle.remove()
    return sum(seen) / len(seen) if seen else 0.0


def _seconds(fn, repeat: int = 1) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def bench_fx(device: torch.device, quick: bool) -> list[BenchResult]:
    import fp4pass.fx
    from fp4pass.examples.gpt_oss_tiny import build_sized_gpt_oss
    from fp4pass.fx.gpt_oss import CausalLMLogits

    if device.type != "cpu":
        return []  # the CPU figures are the ones a 2-core machine needs; the same code runs on CUDA
    config = QUICK if quick else SIZED
    layers = config["num_hidden_layers"]
    shape = "quick" if quick else "gpt-oss-20b-shaped"
    with tempfile.TemporaryDirectory(prefix="fp4pass-bench-fx-") as folder:
        start = time.perf_counter()
        build_sized_gpt_oss(folder, config, seed=0)
        gc.collect()
        rss_start = status_mib("VmRSS")
        model = fp4pass.fx.load_gpt_oss(folder)
        load_s = time.perf_counter() - start
    gc.collect()
    resident = status_mib("VmRSS") or 0.0
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, vocab, (1, TOKENS), generator=generator) for _ in range(4)]
    ids = batches[0]
    dims = ({0: torch.export.Dim("batch", max=64), 1: torch.export.Dim("seq", min=2, max=4096)},)
    start = time.perf_counter()
    example = torch.randint(0, vocab, (2, 16), generator=generator)  # a batch of 1 would be specialised
    program = torch.export.export(CausalLMLogits(model), (example,), dynamic_shapes=dims)
    export_s = time.perf_counter() - start
    start = time.perf_counter()
    converted, _ = fp4pass.fx.convert(program)
    convert_s = time.perf_counter() - start
    run_a, run_b = program.module(), converted.module()
    results = []

    def forward(module):
        with torch.no_grad():
            module(ids)

    def eager(routed: bool):
        for layer in model.model.layers:
            layer.mlp.experts.routed = routed
        with torch.no_grad():
            model(ids)

    stages = {"load_s": load_s, "export_s": export_s, "convert_s": convert_s}
    for label, fn in (("exported program (dense experts)", lambda: forward(run_a)),
                      ("eager routed experts", lambda: eager(True))):
        growth = peak_growth_mib(fn)
        if growth is None:
            continue
        results.append(BenchResult(
            f"fx forward peak RSS growth/layer, {label} [{shape}]", growth / layers, "resident model RSS", resident,
            unit="MiB", extra={"layers": layers, "peak_growth_mib": growth, "target_mib_per_layer":
                               TARGET_MIB_PER_LAYER, "within_target": growth / layers <= TARGET_MIB_PER_LAYER,
                               "model_mib": resident - (rss_start or 0.0)}))

    forward(run_a), forward(run_b)  # warm-up
    plain = _seconds(lambda: (forward(run_a), forward(run_b)))
    diff_s = _seconds(lambda: fp4pass.fx.diff(program, converted, (ids,)))
    results.append(BenchResult(f"fx.diff mx vs nv, {layers} layers, [1,{TOKENS}] [{shape}]", diff_s,
                               "one forward of each program", plain, goal=3.0, extra=stages))

    eager(False), eager(True)  # warm-up
    for tokens, goal in ((TOKENS, 0.25), (DECODE_TOKENS, None)):
        ids = batches[0][:, :tokens]
        picked = _experts_picked(model, ids)
        dense_s = _seconds(lambda: eager(False))
        routed_s = _seconds(lambda: eager(True))
        results.append(BenchResult(f"fx routed experts forward [1,{tokens}] [{shape}]", routed_s,
                                   "dense experts forward (eager)", dense_s, goal=goal,
                                   extra={"experts_picked_per_layer": picked,
                                          "experts": model.config.num_local_experts}))
    ids = batches[0]

    plain4 = _seconds(lambda: [forward(run_b) for _ in batches])
    calib_s = _seconds(lambda: fp4pass.fx.calibrate(converted, batches))
    results.append(BenchResult(f"fx.calibrate 4 batches [1,{TOKENS}] [{shape}]", calib_s,
                               "4 forwards of the program", plain4, extra={"threads": torch.get_num_threads(),
                                                                          "cpus": os.cpu_count()}))
    return results


BENCHMARKS = [bench_fx]
