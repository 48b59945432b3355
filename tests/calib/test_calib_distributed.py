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

    def __init__(self, world: int = 2, group=None, backend: str = "gloo", collective_device: str | None = None):
        self.world = world
        self.collective_device = collective_device  # where every reduced tensor must be (cpu for gloo)
        self.group = group  # the group object every collective must be given
        self.backend = backend
        self.barrier = threading.Barrier(world, timeout=30)
        self.slots: list = [None] * world
        self.local = threading.local()
        self.ops: list[str] = []

    def rank(self) -> int:
        return self.local.rank

    def _same_group(self, group) -> None:
        assert group is self.group, f"a collective ran on group {group!r}, not the caller's {self.group!r}"

    def get_world_size(self, group=None) -> int:
        self._same_group(group)
        return self.world

    def get_backend(self, group=None) -> str:
        self._same_group(group)
        return self.backend

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
        self._same_group(group)
        if self.collective_device is not None:
            assert tensor.device.type == self.collective_device, f"reduced on {tensor.device}"
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
        self._same_group(group)
        out[:] = self._exchange(obj)


def rank_data(seed: int, rows: int, big: float, zero_rows: int) -> torch.Tensor:
    x = torch.from_numpy(np.random.default_rng(seed).standard_normal((rows, 64)).astype(np.float32))
    x[0, 3] = big
    x[1:1 + zero_rows] = 0.0
    return x


DATA = {  # activation -> (rank 0's batch, rank 1's batch)
    "a": (rank_data(1, 6, 40.0, 1), rank_data(2, 10, -7.5, 3)),
    "b": (rank_data(3, 8, 3.25, 0), rank_data(4, 4, -96.0, 2)),
    "c": (rank_data(5, 3, 0.5, 0), rank_data(6, 5, 11.0, 1)),
    "d": (rank_data(7, 7, -2.0, 2), rank_data(8, 2, 1.5, 0)),
}
NO_ABS_HISTOGRAM = {"b"}  # a statistic without the |x| histogram between others: the histograms' order holds
GROUP = object()  # a group of the caller's own: every collective must run on it


def stats_of(name: str, batches, abs_histogram: bool | None = None, device: str = "cpu") -> ActivationStats:
    abs_histogram = name not in NO_ABS_HISTOGRAM if abs_histogram is None else abs_histogram
    s = ActivationStats(name, abs_histogram=abs_histogram, reservoir=64, top_k=8, device=device)
    for batch in batches:
        s.update(batch)
    return s


def run_two_ranks(monkeypatch, device: str = "cpu", backend: str = "gloo",
                  collective_device: str | None = None) -> tuple[list[list[ActivationStats]], FakeGroup]:
    group = FakeGroup(group=GROUP, backend=backend, collective_device=collective_device)
    monkeypatch.setattr(distributed, "dist", group)
    results: list = [None, None]
    errors: list = []

    def rank_main(rank: int) -> None:
        group.local.rank = rank
        try:
            stats = [stats_of(name, [batches[rank].to(device)], device=device) for name, batches in DATA.items()]
            distributed.all_reduce_stats(stats, group=GROUP)
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
    """Guard on the fixture itself: for 'a' rank 0 holds the max, for 'b' rank 1."""
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
            single = stats_of(name, batches)
            assert int(s.zero_values) == int(single.zero_values), name
            if name not in NO_ABS_HISTOGRAM:  # zero values are counted with the |x| histogram
                assert int(s.zero_values) == int((everything == 0).sum()), name
            assert torch.equal(s.block_histogram.counts, single.block_histogram.counts), name
            if name in NO_ABS_HISTOGRAM:
                assert s.abs_histogram is None
            else:
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


def test_nccl_collectives_run_on_this_ranks_cuda_device(monkeypatch):
    """With NCCL the tensors go to the current CUDA device (gloo: CPU); told without a GPU."""
    monkeypatch.setattr(distributed, "dist", FakeGroup(group=GROUP, backend="nccl"))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert distributed._collective_device(GROUP) == torch.device("cuda", 3)
    monkeypatch.setattr(distributed, "dist", FakeGroup(group=GROUP, backend="gloo"))
    assert distributed._collective_device(GROUP) == torch.device("cpu")


# -- the reservoir merge, on samples whose blocks carry their own identity ----------------------------------


def part(rank: int, stored: int, seen: int) -> dict:
    """A rank's sample: ``stored`` blocks (row i of rank r holds r * 1000 + i everywhere), ``seen`` counted."""
    ids = torch.arange(stored, dtype=torch.float32) + 1000 * rank
    return {"top_blocks": torch.empty(0, 16), "top_amax": torch.empty(0), "blocks": ids[:, None].repeat(1, 16),
            "seen": seen}


def merged(parts: list[dict], capacity: int, seed: int = 0) -> tuple[list[int], int]:
    from fp4pass.calib.stats import BlockSample

    sample = BlockSample(reservoir=capacity, top_k=0)
    distributed.merge_samples(sample, parts, np.random.default_rng(seed))
    ids = sample.blocks[:, 0].to(torch.int64).tolist()
    assert torch.equal(sample.blocks, sample.blocks[:, :1].repeat(1, 16))  # whole blocks, never mixed
    return ids, sample.seen


@pytest.mark.parametrize("stored_a, seen_a, stored_b, seen_b, capacity", [
    (40, 40, 60, 60, 64), (64, 500, 64, 100, 64), (1, 1, 10, 10, 64), (10, 10, 1, 1, 64), (0, 0, 30, 30, 16),
    (30, 30, 0, 0, 16), (0, 0, 0, 0, 16), (64, 10**9, 64, 5, 64), (64, 5, 64, 10**9, 64),
    (64, 2 * 10**9, 64, 10**9 - 1, 64)])
def test_the_merged_reservoir_is_a_sample_of_both_ranks_blocks(stored_a, seen_a, stored_b, seen_b, capacity):
    """min(capacity, seen_a + seen_b) distinct blocks, each one a rank held; every block is kept when all fit;
    a rank that saw nothing gives nothing. Seen counts at and above numpy's hypergeometric limit (1e9) go
    through the binomial draw."""
    ids, seen = merged([part(0, stored_a, seen_a), part(1, stored_b, seen_b)], capacity)
    assert seen == seen_a + seen_b
    assert len(ids) == min(capacity, seen_a + seen_b, stored_a + stored_b) and len(set(ids)) == len(ids)
    held = {i for i in range(stored_a)} | {1000 + i for i in range(stored_b)}
    assert set(ids) <= held
    if stored_a + stored_b <= capacity:
        assert set(ids) == held


@pytest.mark.parametrize("seen_a, seen_b", [(3000, 1000), (3 * 10**9, 10**9)])
def test_each_rank_contributes_in_proportion_to_what_it_saw(seen_a, seen_b):
    """Rank a saw 3x the blocks of rank b: over 20 seeds about 3/4 of a 400-block merge comes from a (the
    expectation 300, 20 seeds x 400 draws: within 5% of it), for the hypergeometric and the binomial draw."""
    from_a = 0
    for seed in range(20):
        ids, _ = merged([part(0, 400, seen_a), part(1, 400, seen_b)], 400, seed)
        assert len(ids) == 400 and len(set(ids)) == 400
        from_a += sum(1 for i in ids if i < 1000)
    assert abs(from_a / (20 * 400) - 0.75) < 0.05


@pytest.mark.gpu
@pytest.mark.parametrize("backend, collective", [("gloo", "cpu"), ("nccl", "cuda")])
def test_statistics_on_cuda_reduce_on_the_backends_device_and_come_back(monkeypatch, backend, collective):
    """Statistics kept on CUDA: gloo reduces CPU tensors, NCCL CUDA ones; every reduced statistic is back on
    the statistics' device afterwards, with the values of all the data."""
    results, _ = run_two_ranks(monkeypatch, device="cuda", backend=backend, collective_device=collective)
    for rank_stats in results:
        for s, (name, batches) in zip(rank_stats, DATA.items()):
            for tensor in (s.amax, s.zero_blocks, s.zero_values, s.block_histogram.counts, s.sample.blocks):
                assert tensor.device.type == "cuda", name
            if s.abs_histogram is not None:
                assert s.abs_histogram.counts.device.type == "cuda", name
            assert s.amax_value == float(torch.cat(batches).abs().max()), name


def test_distributed_ready_needs_an_initialised_group(monkeypatch):
    """torch.distributed is available here but no process group is set up: not ready (the calibration then
    reduces nothing); with a group it is."""
    assert real_dist.is_available() and not real_dist.is_initialized()
    assert distributed.distributed_ready() is False
    monkeypatch.setattr(distributed, "dist", FakeGroup(group=GROUP))
    assert distributed.distributed_ready() is True
