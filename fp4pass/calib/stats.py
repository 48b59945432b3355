"""Streamed statistics of one activation, in bounded memory, reduced in torch (on the GPU when there is one).

Per activation, over every batch seen, cut into 16-blocks along the last axis (the NVFP4 blocks):

1. ``amax``: max |x| (the literal maximum).
2. ``block_histogram``: per-16-block amaxes b > 0 counted in a log2 histogram, 512 bins over
   log2 b in [-40, 40] (bin width 80/512 = 0.156 log2, about 11% in value); values outside are clamped
   into the end bins. ``zero_blocks`` counts the blocks with b = 0 (they are exact at any scale).
3. ``abs_histogram`` (only when a calibrator needs it, e.g. ``percentile``): |x| > 0 in a log2 histogram of
   8192 bins over [-40, 40] (0.7% in value), and ``zero_values``.
4. ``sample`` (:class:`BlockSample`): a uniform reservoir of whole 16-blocks plus the top-K blocks by amax,
   kept exactly. It estimates sums over all blocks (SNR, the ``mse`` sweep) without keeping the activations.

A NaN or Inf in an activation raises :class:`~fp4pass.errors.NonFiniteError` naming the activation.
Memory per activation: 512 + 8192 counters plus (reservoir + top-K) * 16 floats.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from fp4pass.errors import NonFiniteError, ShapeError
from fp4pass.formats import NV_BLOCK_SIZE

__all__ = ["LogHistogram", "BlockSample", "ActivationStats", "LOG2_MIN", "LOG2_MAX", "BLOCK_BINS", "ABS_BINS"]

LOG2_MIN, LOG2_MAX = -40.0, 40.0
BLOCK_BINS = 512
ABS_BINS = 8192
_HYPERGEOMETRIC_LIMIT = 10**9  # numpy's hypergeometric wants good, bad < 1e9
_ABS_BITS = 0x7FFFFFFF  # float32 bits & this = bits of |x|; >= 0x7F800000: Inf or NaN
_INF_BITS = 0x7F800000


class LogHistogram:
    """Counts of positive values by log2(value): ``bins`` equal bins over [lo, hi] (clamped at the ends).

    ``percentile(p)`` finds the bin where the cumulative count reaches p% of the total and interpolates
    linearly in log2 inside it: v = 2^(edge_i + w * (rank - cum_{i-1}) / count_i).
    """

    def __init__(self, bins: int = BLOCK_BINS, lo: float = LOG2_MIN, hi: float = LOG2_MAX, device=None):
        self.bins, self.lo, self.hi = bins, lo, hi
        self.width = (hi - lo) / bins
        self.counts = torch.zeros(bins, dtype=torch.float64, device=device)

    def add(self, values: torch.Tensor, zeros: int | torch.Tensor = 0) -> None:
        """Count ``values`` (> 0, except for ``zeros`` of them that are 0 and are not counted)."""
        if values.numel():
            # zeros give log2 = -inf, clamp into bin 0, and are taken out again: cheaper than masking them
            log2 = torch.log2(values.float()).clamp_(self.lo, self.hi)
            if log2.device.type == "cpu":
                # torch.histc's own CPU arithmetic, bin = int((v - lo) * bins / (hi - lo)) with the top edge in
                # the last bin, counted by bincount: the same counts (test_calib_perf.py), 5x faster on CPU
                index = ((log2 - self.lo) * self.bins / (self.hi - self.lo)).to(torch.int64).clamp_(max=self.bins - 1)
                self.counts += torch.bincount(index, minlength=self.bins).double()
            else:
                self.counts += torch.histc(log2, self.bins, self.lo, self.hi).double()
            self.counts[0] -= zeros

    @property
    def total(self) -> float:
        return float(self.counts.sum())

    def _edges(self, index: int) -> float:
        return self.lo + index * self.width

    def percentile(self, p: float, floor: float | None = None, skip: float = 0.0) -> float | None:
        """The p-th percentile (0..100) of the counted values; None when nothing was counted.

        ``floor``: ignore the bins whose upper edge lies at or below log2(floor).
        ``skip``: that many extra values sit below every bin (zeros); ranks within them return 0.0.
        """
        counts = self.counts.cpu()
        if floor is not None and floor > 0:
            first = max(0, min(self.bins, math.floor((math.log2(floor) - self.lo) / self.width)))
            counts = counts.clone()
            counts[:first] = 0
        total = float(counts.sum()) + skip
        if total <= 0:
            return None
        rank = min(max(p, 0.0), 100.0) / 100.0 * total
        if rank <= skip and skip > 0:
            return 0.0
        rank -= skip
        cum = torch.cumsum(counts, 0)
        index = int(torch.searchsorted(cum, torch.tensor([rank], dtype=torch.float64)).clamp(max=self.bins - 1))
        while counts[index] == 0 and index < self.bins - 1:  # rank 0 lands before the first non-empty bin
            index += 1
        before = float(cum[index - 1]) if index else 0.0
        inside = min(max((rank - before) / float(counts[index]), 0.0), 1.0) if counts[index] else 0.0
        return 2.0 ** (self._edges(index) + inside * self.width)

    def fraction_below(self, value: float) -> float:
        """Fraction of the counted values below ``value`` (linear in log2 inside the bin it falls in)."""
        counts = self.counts.cpu()
        total = float(counts.sum())
        if total == 0 or value <= 0:
            return 0.0
        position = (math.log2(value) - self.lo) / self.width
        if position <= 0:
            return 0.0
        if position >= self.bins:
            return 1.0
        index = int(position)
        below = float(counts[:index].sum()) + float(counts[index]) * (position - index)
        return below / total


class BlockSample:
    """A bounded sample of 16-blocks that estimates sums over every block seen.

    Two parts: the ``top_k`` blocks with the largest amax, kept exactly, and a uniform reservoir of
    ``reservoir`` blocks (a uniform sample without replacement of every block seen). :meth:`weighted` returns
    blocks and weights with ``sum_i w_i f(block_i) ~= sum over all blocks of f``: weight 1 for the top blocks,
    (N - |top|) / |R'| for the reservoir blocks R' below the top's threshold. Exact while N <= top_k.

    The reservoir update costs O(reservoir), not O(batch): with N blocks seen before a batch of n, a uniform
    m-sample of the N + n blocks holds K ~ Hypergeometric(good=n, bad=N, draws=m) new blocks: K blocks drawn
    uniformly from the batch join m - K drawn uniformly from the current reservoir (exact: the batch-wise form
    of reservoir sampling). Past 10^9 blocks (numpy's hypergeometric limit) K ~ Binomial(m, n / (N + n)), its
    limit. The top-K update skips a batch whose max does not beat the smallest amax kept.
    """

    def __init__(self, reservoir: int = 4096, top_k: int = 64, device=None, seed: int = 0):
        self.capacity, self.top_k = reservoir, top_k
        self.device = torch.device(device or "cpu")
        self.rng = np.random.default_rng(seed)
        empty = torch.empty(0, NV_BLOCK_SIZE, device=self.device)
        self.blocks = empty
        self.top_blocks, self.top_amax = empty, torch.empty(0, device=self.device)
        self.seen = 0

    def _new_count(self, n: int) -> int:
        """How many of a batch of ``n`` blocks a uniform ``capacity``-sample of all ``seen + n`` holds."""
        if self.seen + n <= self.capacity:
            return n
        if max(n, self.seen) < _HYPERGEOMETRIC_LIMIT:
            return int(self.rng.hypergeometric(n, self.seen, self.capacity))
        return min(n, max(int(self.rng.binomial(self.capacity, n / (self.seen + n))), self.capacity - self.seen))

    def update(self, blocks: torch.Tensor, block_amax: torch.Tensor, batch_amax: float | None = None) -> None:
        """Add a batch: ``blocks`` [n, 16], ``block_amax`` [n] their max |x|, ``batch_amax`` its max if known."""
        n = blocks.shape[0]
        if n == 0:
            return
        if self.top_k:
            full = self.top_amax.numel() >= self.top_k
            if batch_amax is None and full:
                batch_amax = float(block_amax.max())
            if not full or batch_amax > float(self.top_amax[-1]):  # top_amax is sorted, largest first
                top = torch.topk(block_amax, min(self.top_k, n)).indices  # the batch's own top-K, then merge
                cand_blocks = torch.cat([self.top_blocks, blocks[top]])
                cand_amax = torch.cat([self.top_amax, block_amax[top]])
                best = torch.topk(cand_amax, min(self.top_k, cand_amax.numel())).indices
                self.top_blocks, self.top_amax = cand_blocks[best], cand_amax[best]
        if self.capacity:
            new = self._new_count(n)
            if new:
                old = self.blocks.shape[0]
                keep = min(old, self.capacity - new)
                parts = []
                if keep == old:
                    parts.append(self.blocks)
                elif keep:
                    parts.append(self.blocks[self._choice(old, keep)])
                parts.append(blocks.clone() if new == n else blocks[self._choice(n, new)])
                self.blocks = torch.cat(parts) if len(parts) > 1 else parts[0]
        self.seen += n

    def _choice(self, n: int, k: int) -> torch.Tensor:
        """k distinct indices uniform in [0, n)."""
        return torch.from_numpy(self.rng.choice(n, k, replace=False)).to(self.device)

    def weighted(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(blocks [n, 16], weights [n]) whose weighted sums estimate the sums over all blocks seen."""
        if self.seen <= self.top_k or not self.capacity:
            return self.top_blocks, torch.ones(self.top_blocks.shape[0], device=self.device)
        threshold = self.top_amax.min() if self.top_amax.numel() else torch.tensor(float("inf"), device=self.device)
        rest = self.blocks[self.blocks.abs().amax(1) < threshold]
        n_rest = self.seen - self.top_blocks.shape[0]
        if rest.shape[0] == 0:
            return self.top_blocks, torch.ones(self.top_blocks.shape[0], device=self.device)
        weights = torch.cat([torch.ones(self.top_blocks.shape[0], device=self.device),
                             torch.full((rest.shape[0],), n_rest / rest.shape[0], device=self.device)])
        return torch.cat([self.top_blocks, rest]), weights


class ActivationStats:
    """Running statistics of one activation tensor (module docstring). Feed batches with :meth:`update`."""

    def __init__(self, name: str, *, device=None, abs_histogram: bool = False,
                 reservoir: int = 4096, top_k: int = 64, seed: int = 0):
        self.name = name
        self.device = torch.device(device or "cpu")
        self.amax = torch.zeros((), dtype=torch.float32, device=self.device)
        self.blocks = 0
        self.zero_blocks = torch.zeros((), dtype=torch.int64, device=self.device)
        self.block_histogram = LogHistogram(BLOCK_BINS, device=self.device)
        self.abs_histogram = LogHistogram(ABS_BINS, device=self.device) if abs_histogram else None
        self.zero_values = torch.zeros((), dtype=torch.int64, device=self.device)
        self.sample = BlockSample(reservoir, top_k, self.device, seed)
        self.shape: tuple[int, ...] | None = None

    def update(self, x) -> None:
        """Add one batch of the activation (any shape [..., K], K a multiple of 16; numpy or torch)."""
        x = torch.as_tensor(x).to(self.device, torch.float32)
        self.shape = tuple(x.shape)
        if x.numel() == 0:
            return
        if x.dim() == 0 or x.shape[-1] % NV_BLOCK_SIZE:
            raise ShapeError(f"activation {self.name}: last dim of {tuple(x.shape)} is not a multiple of block 16")
        blocks = x.reshape(-1, NV_BLOCK_SIZE)
        # |x| by clearing the sign bit: exact, and as int32 the order of |x| is the order of the bits, with
        # Inf and NaN above every finite value, so one int max per block gives its amax and flags non-finite
        magnitude_bits = blocks.view(torch.int32) & _ABS_BITS
        block_bits = magnitude_bits.amax(1)
        batch_bits = int(block_bits.max())  # one sync per batch (the NaN check needs it anyway)
        if batch_bits >= _INF_BITS:
            bad = int((~torch.isfinite(blocks)).nonzero()[0, 0]) * NV_BLOCK_SIZE
            raise NonFiniteError(f"activation {self.name}: non-finite value (NaN/Inf) at flat index ~{bad}; "
                                 "calibration needs finite activations")
        block_amax = block_bits.view(torch.float32)
        batch_amax = float(np.array(batch_bits, np.int32).view(np.float32))
        self.amax = torch.maximum(self.amax, block_amax.max())
        self.blocks += blocks.shape[0]
        zero_blocks = (block_bits == 0).sum()
        self.zero_blocks += zero_blocks
        self.block_histogram.add(block_amax, zeros=zero_blocks)
        if self.abs_histogram is not None:
            zero_values = (magnitude_bits == 0).sum()
            self.zero_values += zero_values
            self.abs_histogram.add(magnitude_bits.view(torch.float32).flatten(), zeros=zero_values)
        self.sample.update(blocks, block_amax, batch_amax)

    @property
    def amax_value(self) -> float:
        return float(self.amax)

    def block_percentile(self, p: float, floor: float | None = None) -> float | None:
        """p-th percentile of the non-zero per-block amaxes (p = 100: the literal max)."""
        if p >= 100:
            return self.amax_value if self.block_histogram.total else None
        value = self.block_histogram.percentile(p, floor=floor)
        return None if value is None else min(value, self.amax_value)

    def abs_percentile(self, p: float) -> float | None:
        """p-th percentile of |x| over every element, zeros included (p = 100: the literal max)."""
        if self.abs_histogram is None:
            raise RuntimeError(f"activation {self.name}: |x| histogram not collected (abs_histogram=False)")
        if p >= 100:
            return self.amax_value
        value = self.abs_histogram.percentile(p, skip=float(self.zero_values))
        return None if value is None else min(value, self.amax_value)
