"""Streamed statistics: histograms, zero blocks, the bounded block sample and its estimates."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fp4pass.calib.stats import ActivationStats, BlockSample, LogHistogram
from fp4pass.errors import ShapeError


def test_block_histogram_counts_and_zero_blocks():
    x = np.zeros((10, 32), np.float32)
    x[:, 0] = 2.0 ** np.arange(10)  # first block of each row: amax 2^i; second block all zero
    stats = ActivationStats("x")
    stats.update(torch.from_numpy(x))
    counts = stats.block_histogram.counts.numpy()
    expected, _ = np.histogram(np.arange(10.0), bins=512, range=(-40, 40))
    np.testing.assert_array_equal(counts, expected)
    assert int(stats.zero_blocks) == 10 and stats.blocks == 20 and stats.amax_value == 512.0


def test_fraction_below_and_percentile_are_inverse():
    h = LogHistogram()
    values = torch.from_numpy(np.random.default_rng(0).lognormal(0, 2, 100_000).astype(np.float32))
    h.add(values)
    for p in (1, 25, 50, 99):
        assert h.fraction_below(h.percentile(p)) == pytest.approx(p / 100, abs=1e-6)


def test_sample_is_bounded_and_estimates_sums():
    rng = np.random.default_rng(1)
    sample = BlockSample(reservoir=512, top_k=16)
    x = rng.standard_normal((20000, 16)).astype(np.float32)
    x[123] *= 1000  # an outlier block, kept exactly by the top-K
    t = torch.from_numpy(x)
    for part in torch.split(t, 3000):
        sample.update(part, part.abs().amax(1))
    assert sample.blocks.shape == (512, 16) and sample.top_blocks.shape == (16, 16)
    blocks, weights = sample.weighted()
    assert float(weights.sum()) == pytest.approx(20000, rel=0.01)
    estimate = float((weights * blocks.double().square().sum(1)).sum())
    assert estimate == pytest.approx(float((x.astype(np.float64) ** 2).sum()), rel=0.05)
    assert any(torch.equal(b, t[123]) for b in sample.top_blocks)


def test_sample_exact_when_small():
    sample = BlockSample(reservoir=8, top_k=64)
    x = torch.randn(40, 16)
    sample.update(x, x.abs().amax(1))
    blocks, weights = sample.weighted()
    assert blocks.shape[0] == 40 and torch.all(weights == 1)


def test_last_dim_must_be_block_multiple():
    with pytest.raises(ShapeError, match="act"):
        ActivationStats("act").update(torch.ones(4, 24))


@pytest.mark.gpu
def test_cuda_statistics_equal_cpu():
    x = torch.randn(256, 64)
    cpu, gpu = ActivationStats("x"), ActivationStats("x", device="cuda")
    cpu.update(x)
    gpu.update(x)
    assert cpu.amax_value == gpu.amax_value and int(cpu.zero_blocks) == int(gpu.zero_blocks)
    assert torch.equal(cpu.block_histogram.counts, gpu.block_histogram.counts.cpu())
