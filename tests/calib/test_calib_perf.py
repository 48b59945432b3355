"""The fast paths of the calibration statistics give the same numbers as independent numpy computations."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
import torch

from calib_builders import float_mlp
from fp4pass.onnx.calibrate import calibrate_model
from fp4pass.calib import stats as stats_module
from fp4pass.calib.stats import ActivationStats, BlockSample, LogHistogram


@pytest.mark.parametrize("bins", [512, 8192])
def test_log_histogram_matches_numpy_histogram(bins):
    rng = np.random.default_rng(5)
    values = np.exp2(rng.uniform(-45, 45, 200_000)).astype(np.float32)  # some beyond [-40, 40]: end bins
    h = LogHistogram(bins)
    h.add(torch.from_numpy(values))
    log2 = np.clip(np.log2(values), np.float32(-40), np.float32(40))  # float32, as the histogram takes it
    expected, _ = np.histogram(log2, bins=bins, range=(-40, 40))
    got = h.counts.numpy()
    assert got.sum() == values.size
    # float32 vs float64 edge arithmetic moves values within an ulp of an edge (~3e-4 at 8192 bins); a bin
    # off by one everywhere would differ by 2 * size
    assert np.abs(got - expected).sum() <= 5e-4 * values.size
    # and exactly what torch.histc counts (the slower path this replaced on CPU)
    reference = torch.histc(torch.log2(torch.from_numpy(values)).clamp(-40, 40), bins, -40, 40).double()
    assert torch.equal(h.counts, reference)
    assert got[0] == expected[0] and got[-1] == expected[-1]


def test_block_amax_zero_blocks_and_sign_handling():
    x = np.zeros((3, 48), np.float32)
    x[0, :16] = -np.arange(16)  # block amax 15 from a negative value
    x[1, 16:32] = -0.0  # a block of negative zeros is a zero block
    x[2, 40] = 7.5
    stats = ActivationStats("x")
    stats.update(torch.from_numpy(x))
    b = np.abs(x.reshape(-1, 16)).max(1)
    assert stats.amax_value == 15.0 and int(stats.zero_blocks) == int((b == 0).sum()) == 7
    assert torch.equal(stats.sample.top_blocks[0], torch.from_numpy(x[0, :16]))


def reservoir_frequencies(batches, capacity, trials=2000):
    n = sum(batches)
    hits = np.zeros(n)
    for seed in range(trials):
        sample = BlockSample(reservoir=capacity, top_k=0, seed=seed)
        start = 0
        for size in batches:
            ids = torch.arange(start, start + size, dtype=torch.float32)
            block = ids[:, None].repeat(1, 16)
            sample.update(block, ids)
            start += size
        kept = sample.blocks[:, 0].numpy().astype(int)
        assert len(kept) == min(capacity, n) and len(set(kept)) == len(kept)
        assert bool(torch.all(sample.blocks == sample.blocks[:, :1]))  # whole blocks, not mixed rows
        hits[kept] += 1
    return hits / trials


@pytest.mark.parametrize("limit", [None, 1])
def test_reservoir_is_uniform(monkeypatch, limit):
    """Every block ends in the reservoir with probability capacity / N (binomial oracle, 6 sd)."""
    if limit is not None:  # the Binomial path used past numpy's hypergeometric limit
        monkeypatch.setattr(stats_module, "_HYPERGEOMETRIC_LIMIT", limit)
    batches, capacity, trials = [5, 7, 20, 3], 8, 2000
    freq = reservoir_frequencies(batches, capacity, trials)
    p = capacity / sum(batches)
    assert np.all(np.abs(freq - p) < 6 * np.sqrt(p * (1 - p) / trials))
    # by batch, too: a biased count of new blocks would show here
    edges = np.cumsum([0] + batches)
    for lo, hi in zip(edges[:-1], edges[1:]):
        assert freq[lo:hi].mean() == pytest.approx(p, abs=0.02)


def test_top_blocks_are_the_largest_over_batches():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3000, 16)).astype(np.float32)
    sample = BlockSample(reservoir=64, top_k=10)
    for part in np.array_split(x, [1000, 1100, 2900]):  # a small batch after a big one: mostly skipped
        t = torch.from_numpy(part)
        sample.update(t, t.abs().amax(1))
    b = np.abs(x).max(1)
    expected = np.sort(b)[::-1][:10]
    np.testing.assert_array_equal(np.sort(sample.top_amax.numpy())[::-1], expected)
    assert sample.seen == 3000


def test_runner_reused_buffers_with_changing_shapes():
    """Feeds of changing row counts (bound outputs, then plain runs) still give numpy's exact statistics."""
    model = ir.serde.deserialize_model(float_mlp())
    w1 = model.graph.initializers["w1"].const_value.numpy()
    rng = np.random.default_rng(4)
    feeds = [{"x": (rng.standard_normal((rows, 64)) * (i + 1)).astype(np.float32)}
             for i, rows in enumerate([8, 8, 3, 8, 8, 8])]
    threads = torch.get_num_threads()
    scales = calibrate_model(model, feeds, activations=["h"], provider="cpu")
    assert torch.get_num_threads() == threads
    h = np.maximum(np.concatenate([f["x"] for f in feeds]) @ w1, 0)
    s = scales.tensors["h"]
    assert s.amax == pytest.approx(float(h.max()), rel=1e-6)
    assert s.blocks == h.size // 16
    assert s.zero_blocks == int((np.abs(h.reshape(-1, 16)).max(1) == 0).sum())
    # the last batch's activation, not the first's: the statistics saw each batch's own numbers
    last = calibrate_model(model, feeds[-1:], activations=["h"], provider="cpu").tensors["h"].amax
    assert last == pytest.approx(float(h[-8:].max()), rel=1e-6)
