"""``fp4pass.calib.distributed.all_reduce_stats`` over a fake two-rank process group, in the default suite.

The group is in-process: two threads, one per rank, each calling ``all_reduce_stats`` on its own statistics,
and a stand-in for ``torch.distributed`` whose collectives meet at a barrier and apply the real reduction
(``all_reduce`` with the ``ReduceOp`` it is given, ``all_gather_object``). It runs in milliseconds, where two
gloo processes take seconds (that test stays under ``-m slow`` in test_fx_calibrate.py).

The oracle is numpy over all the data (amax = max |x|, block counts) and one process's statistics over every
batch; the ranks are given data such that each reduction could only be confused with another one by failing:
for one activation rank 0 holds the larger |x|, for the other rank 1 does (so SUM, MIN, "rank 0's", "this
rank's" all fail somewhere), and the ranks see different numbers of blocks and of zeros.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
import torch.distributed as real_dist

import fp4pass.calib.distributed as distributed
from fp4pass.calib.stats import ActivationStats


class FakeGroup:
    """Two ranks as two threads: the subset of torch.distributed that all_reduce_stats calls."""

    ReduceOp = real_dist.ReduceOp

    def __init__(self, world: int = 2):
        self.world = world
        self.barrier = threading.Barrier(world, timeout=30)
        self.slots: list = [None] * world
        self.local = threading.local()
        self.ops: list[str] = []

    def rank(self) -> int:
        return self.local.rank

    def get_world_size(self, group=None) -> int:
        return self.world

    def get_backend(self, group=None) -> str:
        return "gloo"

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return True

    def _exchange(self, value):
        self.slots[self.rank()] = value
        self.barrier.wait()
        everything = list(self.slots)
        self.barrier.wait()  # nobody writes the next collective's slot before all have read this one
        return everything

    def all_reduce(self, tensor: torch.Tensor, op=None, group=None) -> None:
        parts = self._exchange(tensor.clone())
        if op == self.ReduceOp.MAX:
            result = torch.stack(parts).amax(0)
        elif op == self.ReduceOp.SUM:
            result = torch.stack(parts).sum(0)
        elif op == self.ReduceOp.MIN:
            result = torch.stack(parts).amin(0)
        else:
            raise AssertionError(f"unexpected reduction {op}")
        if self.rank() == 0:
            self.ops.append(str(op))
        tensor.copy_(result)

    def all_gather_object(self, out: list, obj, group=None) -> None:
        out[:] = self._exchange(obj)


def rank_data(seed: int, rows: int, big: float, zero_rows: int) -> torch.Tensor:
    x = torch.from_numpy(np.random.default_rng(seed).standard_normal((rows, 64)).astype(np.float32))
    x[0, 3] = big
    x[1:1 + zero_rows] = 0.0
    return x


DATA = {  # activation -> (rank 0's batch, rank 1's batch)
    "a": (rank_data(1, 6, 40.0, 1), rank_data(2, 10, -7.5, 3)),
    "b": (rank_data(3, 8, 3.25, 0), rank_data(4, 4, -96.0, 2)),
}


def stats_of(name: str, batches, abs_histogram: bool = True) -> ActivationStats:
    s = ActivationStats(name, abs_histogram=abs_histogram, reservoir=64, top_k=8)
    for batch in batches:
        s.update(batch)
    return s


def run_two_ranks(monkeypatch) -> tuple[list[list[ActivationStats]], FakeGroup]:
    group = FakeGroup()
    monkeypatch.setattr(distributed, "dist", group)
    results: list = [None, None]
    errors: list = []

    def rank_main(rank: int) -> None:
        group.local.rank = rank
        try:
            stats = [stats_of(name, [batches[rank]]) for name, batches in DATA.items()]
            distributed.all_reduce_stats(stats)
            results[rank] = stats
        except BaseException as exc:  # noqa: BLE001 - reported below, on the test's thread
            errors.append(exc)
            group.barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert all(r is not None for r in results)
    return results, group


def test_the_data_tells_the_reductions_apart():
    """Guard on the fixture itself: for 'a' rank 0 holds the max, for 'b' rank 1, and the sums differ."""
    a0, a1 = (float(t.abs().max()) for t in DATA["a"])
    b0, b1 = (float(t.abs().max()) for t in DATA["b"])
    assert a0 > a1 and b1 > b0


def test_every_rank_ends_with_the_statistics_of_all_the_data(monkeypatch):
    results, group = run_two_ranks(monkeypatch)
    for rank_stats in results:
        for s, (name, batches) in zip(rank_stats, DATA.items()):
            everything = torch.cat(batches).numpy()
            assert s.amax_value == pytest.approx(float(np.abs(everything).max()), rel=0, abs=0), name
            blocks = everything.reshape(-1, 16)
            assert s.blocks == blocks.shape[0], name
            assert int(s.zero_blocks) == int((np.abs(blocks).max(1) == 0).sum()), name
            assert int(s.zero_values) == int((everything == 0).sum()), name
            single = stats_of(name, batches)
            assert torch.equal(s.block_histogram.counts, single.block_histogram.counts), name
            assert torch.equal(s.abs_histogram.counts, single.abs_histogram.counts), name
            assert s.sample.seen == single.sample.seen, name
            top = torch.sort(s.sample.top_amax, descending=True).values
            assert torch.equal(top, torch.sort(single.sample.top_amax, descending=True).values), name
    assert "MAX" in group.ops[0]  # the amax went through a MAX reduction


def test_both_ranks_agree_on_the_merged_sample(monkeypatch):
    """The reservoir merge uses a generator seeded alike on every rank: the same blocks on both."""
    results, _ = run_two_ranks(monkeypatch)
    for s0, s1 in zip(*results):
        assert torch.equal(s0.sample.blocks, s1.sample.blocks)
        assert torch.equal(s0.amax, s1.amax)
