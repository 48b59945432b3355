"""Reduce activation statistics over the ranks of a ``torch.distributed`` process group.

When each rank calibrates on its own share of the data, every rank ends, after :func:`all_reduce_stats`,
with the statistics of all the data, as if one process had seen every batch. Each statistic of
:class:`~fp4pass.calib.stats.ActivationStats` takes the reduction that makes that true:

==========================  ==========  ==========================================================
statistic                   reduction   why
==========================  ==========  ==========================================================
``amax``                    MAX         max |x| over all data = max over ranks of each rank's max
``blocks``, ``zero_blocks``  SUM         counts add up
``zero_values``             SUM         counts add up
``block_histogram``         SUM         a histogram of all data is the sum of the ranks' histograms
``abs_histogram``           SUM         (float64 counts: exact integers up to 2^53)
``sample`` top-K blocks     gather      the top K of all blocks is among the union of each rank's top K
``sample`` reservoir        gather      merged as the batch-wise reservoir merge (below)
==========================  ==========  ==========================================================

So the amax, the histograms and everything computed from them (``max``, ``percentile`` and ``headroom``
calibrators, B_min / B_max, the block fractions) equal a single-process run over the same data exactly.
The reservoir merge draws, for rank sample sizes ``N_a`` and ``N_b`` blocks seen, ``K ~ Hypergeometric(N_a,
N_b, m)`` of the merged ``m``-sample from rank a's reservoir and ``m - K`` from b's: a uniform sample of all
the blocks again, but not the same draw a single process makes, so the ``mse`` calibrator and the SNR report
(which read the sample) agree with one process in distribution, not bit for bit. The merge uses a generator
seeded identically on every rank, so all ranks compute the same scales.

Collectives run on CUDA tensors for the NCCL backend, on CPU tensors otherwise (gloo). Every rank must call
this with the same activations in the same order (the same model).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from fp4pass.calib.stats import BlockSample, ActivationStats

__all__ = ["all_reduce_stats", "distributed_ready", "merge_samples"]

_HYPERGEOMETRIC_LIMIT = 10**9  # numpy's hypergeometric wants good, bad < 1e9


def distributed_ready() -> bool:
    """True when ``torch.distributed`` is available and a process group is initialised."""
    return dist.is_available() and dist.is_initialized()


def _collective_device(group) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_reduce(tensor: torch.Tensor, op, device: torch.device, group) -> torch.Tensor:
    moved = tensor.to(device)
    dist.all_reduce(moved, op=op, group=group)
    return moved


def all_reduce_stats(stats: list[ActivationStats], group=None, seed: int = 0) -> None:
    """Reduce ``stats`` (in place, in this order on every rank) over ``group`` (module docstring)."""
    if not stats:
        return
    device = _collective_device(group)
    home = stats[0].device
    amax = _all_reduce(torch.stack([s.amax.float() for s in stats]), dist.ReduceOp.MAX, device, group)
    counts = torch.tensor([[s.blocks, int(s.zero_blocks), int(s.zero_values)] for s in stats], dtype=torch.int64)
    counts = _all_reduce(counts, dist.ReduceOp.SUM, device, group).cpu()
    block_hist = _all_reduce(torch.stack([s.block_histogram.counts for s in stats]), dist.ReduceOp.SUM, device, group)
    with_abs = [s for s in stats if s.abs_histogram is not None]
    if with_abs:
        abs_hist = _all_reduce(torch.stack([s.abs_histogram.counts for s in with_abs]), dist.ReduceOp.SUM, device,
                               group)
    samples = [_sample_parts(s.sample) for s in stats]
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, samples, group=group)
    abs_index = 0
    for i, s in enumerate(stats):
        s.amax = amax[i].to(home)
        s.blocks = int(counts[i, 0])
        s.zero_blocks = counts[i, 1].to(home)
        s.zero_values = counts[i, 2].to(home)
        s.block_histogram.counts = block_hist[i].to(home)
        if s.abs_histogram is not None:
            s.abs_histogram.counts = abs_hist[abs_index].to(home)
            abs_index += 1
        merge_samples(s.sample, [rank_parts[i] for rank_parts in gathered], np.random.default_rng(seed + i))


def _sample_parts(sample: BlockSample) -> dict:
    return {"top_blocks": sample.top_blocks.cpu(), "top_amax": sample.top_amax.cpu(), "blocks": sample.blocks.cpu(),
            "seen": sample.seen}


def merge_samples(sample: BlockSample, parts: list[dict], rng: np.random.Generator) -> None:
    """Set ``sample`` to the merge of the rank ``parts`` (``top_blocks``, ``top_amax``, ``blocks``, ``seen``).

    Top-K: the K largest block amaxes of the union. Reservoir: folded pairwise, each step a uniform
    ``min(capacity, N_a + N_b)``-sample of the two ranks' blocks (module docstring).
    """
    device = sample.device
    top_blocks = torch.cat([p["top_blocks"] for p in parts]).to(device)
    top_amax = torch.cat([p["top_amax"] for p in parts]).to(device)
    if sample.top_k and top_amax.numel():
        best = torch.topk(top_amax, min(sample.top_k, top_amax.numel())).indices
        sample.top_blocks, sample.top_amax = top_blocks[best], top_amax[best]
    blocks, seen = parts[0]["blocks"], parts[0]["seen"]
    for part in parts[1:]:
        blocks = _merge_reservoirs(blocks, seen, part["blocks"], part["seen"], sample.capacity, rng)
        seen += part["seen"]
    sample.blocks = blocks.to(device)
    sample.seen = seen


def _merge_reservoirs(a: torch.Tensor, seen_a: int, b: torch.Tensor, seen_b: int, capacity: int,
                      rng: np.random.Generator) -> torch.Tensor:
    """A uniform ``min(capacity, seen_a + seen_b)``-sample of both streams, from their uniform samples a and b."""
    total = min(capacity, seen_a + seen_b)
    if not total:
        return a[:0]
    if seen_a == 0 or seen_b == 0:
        return (a if seen_b == 0 else b)[:total]
    if seen_a < _HYPERGEOMETRIC_LIMIT and seen_b < _HYPERGEOMETRIC_LIMIT:
        from_a = int(rng.hypergeometric(seen_a, seen_b, total))
    else:
        from_a = int(rng.binomial(total, seen_a / (seen_a + seen_b)))
    from_a = min(from_a, a.shape[0])
    take_a = torch.from_numpy(rng.choice(a.shape[0], from_a, replace=False))
    take_b = torch.from_numpy(rng.choice(b.shape[0], total - from_a, replace=False))
    return torch.cat([a[take_a], b[take_b]])
