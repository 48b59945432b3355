"""How a tensor is cut for conversion: groups (one global scale each), rows, blocks, exponents.

An MXFP4 tensor [..., K] with ``group_dims = g`` is viewed as a 2-D table of ``G * R`` rows of K values, where
``G = prod(shape[:g])`` groups (experts) each own ``R = prod(shape[g:-1])`` consecutive rows. Row r belongs to
group ``r // R``. Every per-group quantity (k_max, k_min, the global scale) is a tensor of shape [G].

Exponents: an MX block b has scale 2^k_b, k_b = e8m0_b - 127. The block *holds a value* when one of its E2M1
codes is non-zero in magnitude (code & 0x7 != 0); only such blocks constrain the global scale, since an
all-zero block is exact under any scale. ``k_max``/``k_min`` range over those blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fp4pass.errors import ShapeError
from fp4pass.formats import MXFP4Tensor, NV_BLOCK_SIZE
from fp4pass.formats.codecs import check_e8m0
from fp4pass.formats.constants import E4M3_MIN_NORMAL_EXP, E4M3_POW2_MAX_EXP, E8M0_BIAS, E8M0_NAN

__all__ = [
    "GroupLayout",
    "block_holds_value",
    "exponent_range",
    "scale_code_range",
    "exact_pow2",
    "exact_pow2_list",
    "E4M3_POW2_CODES",
    "EMPTY_K",
]

#: k_max/k_min of a group without any non-zero block (a sentinel below every E8M0 exponent).
EMPTY_K = -1000
FP32_EXP_BIAS = 127  # float32's exponent field bias (not E8M0's, though the same number)

# E4M3FN code of 2^e for e = -9..8: subnormals 2^-9, 2^-8, 2^-7 are codes 1, 2, 4 (mantissa k * 2^-9);
# normals 2^e have exponent field e + 7 and a zero mantissa.
E4M3_POW2_CODES = tuple([1, 2, 4] + [(e + 7) << 3 for e in range(E4M3_MIN_NORMAL_EXP, E4M3_POW2_MAX_EXP + 1)])


@dataclass(frozen=True)
class GroupLayout:
    """The 2-D view of an MXFP4 tensor used by every conversion method (module docstring)."""

    shape: torch.Size
    group_dims: int
    groups: int  # G
    rows_per_group: int  # R
    k: int  # elements per row
    mx_block: int  # elements per E8M0 scale (32)
    name: str = "mxfp4"  # the tensor, for error messages

    @classmethod
    def of(cls, mx: MXFP4Tensor, group_dims: int | None) -> "GroupLayout":
        shape = mx.shape
        ndim = len(shape)
        if group_dims is None:
            group_dims = 1 if ndim == 3 else 0
        if not 0 <= group_dims < max(ndim, 1):
            raise ShapeError(f"{mx.name}: group_dims={group_dims} must be in [0, {max(ndim - 1, 0)}] for shape {tuple(shape)}")
        if mx.block_size % NV_BLOCK_SIZE:
            raise ShapeError(f"{mx.name}: MX block size {mx.block_size} is not a multiple of the NVFP4 block 16")
        groups = math.prod(shape[:group_dims])
        rows = math.prod(shape[group_dims:-1])
        return cls(shape, group_dims, groups, rows, shape[-1], mx.block_size, mx.name)

    @property
    def total_rows(self) -> int:
        return self.groups * self.rows_per_group

    @property
    def halves_per_block(self) -> int:
        return self.mx_block // NV_BLOCK_SIZE

    @property
    def group_shape(self) -> torch.Size:
        return torch.Size(self.shape[: self.group_dims])

    def flat(self, mx: MXFP4Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes [G*R, K/2], e8m0 scales [G*R, K/mx_block]) views, contiguous."""
        return (
            mx.codes.reshape(self.total_rows, self.k // 2).contiguous(),
            mx.scales.reshape(self.total_rows, self.k // self.mx_block).contiguous(),
        )

    def row_chunks(self, group_ids, max_elements: int = 1 << 22):
        """Yield (row_start, row_stop) covering the rows of ``group_ids`` (sorted), each at most ~max_elements."""
        step = max(1, max_elements // max(self.k, 1))
        runs: list[list[int]] = []
        for g in group_ids:
            start, stop = g * self.rows_per_group, (g + 1) * self.rows_per_group
            if runs and runs[-1][1] == start:
                runs[-1][1] = stop
            else:
                runs.append([start, stop])
        for start, stop in runs:
            for lo in range(start, stop, step):
                yield lo, min(lo + step, stop)


def block_holds_value(codes: torch.Tensor, mx_block: int) -> torch.Tensor:
    """Packed codes [n, K/2] -> bool [n, K/mx_block]: does the block hold a non-zero E2M1 magnitude?

    Works on the packed bytes: a byte holds a non-zero magnitude iff ``byte & 0x77``; with 16 bytes per
    32-block this is two 64-bit words per block (the sign bits of ±0 are masked away).
    """
    n, nbytes = codes.shape
    per_block = mx_block // 2
    if per_block % 8 == 0 and codes.is_contiguous():
        try:
            words = codes.view(torch.int64)  # 8 bytes per word
            mask = 0x7777777777777777
            return (words & mask).ne(0).reshape(n, -1, per_block // 8).any(-1)
        except RuntimeError:  # an odd storage offset: fall back to bytes
            pass
    return (codes & 0x77).ne(0).reshape(n, -1, per_block).any(-1)


def on_host(tensor: torch.Tensor) -> bool:
    """Whether the memory-bound integer steps run in numpy (CPU tensors) rather than torch ops.

    On CPU torch splits each op over its threads and waits at a barrier after it; on shared cores that wait
    (a scheduler slice, milliseconds) costs more than one thread streaming a few MB. numpy uses one thread.
    """
    return tensor.device.type == "cpu"


def scale_code_range(scales: torch.Tensor, layout: GroupLayout, name: str = "mxfp4") -> tuple[list[int], list[int]]:
    """Per group (min, max) E8M0 code over *all* blocks (two lists of G ints), in one pass over the uint8 scales.

    The same pass checks E8M0 NaN: a group maximum of 255 means some scale is code 255, and only then does
    ``check_e8m0`` run to name its first position. k = code - 127. One host sync (the lists are small).
    """
    if scales.numel() == 0:  # nothing to hold: k = 8, so that m = k - 8 = 0 and the global scale is 1
        return [135] * layout.groups, [135] * layout.groups
    per_group = scales.reshape(layout.groups, -1)
    if on_host(per_group):  # numpy: one thread, no intra-op barrier (see on_host)
        host = per_group.numpy()
        lo, hi = host.min(axis=-1).tolist(), host.max(axis=-1).tolist()
    else:
        lo, hi = torch.stack(per_group.aminmax(dim=-1)).tolist()
    if E8M0_NAN in hi:
        check_e8m0(scales.reshape(*layout.shape[:-1], -1), f"{name} scales")
    return lo, hi


def exponent_range(codes: torch.Tensor, scales: torch.Tensor, layout: GroupLayout,
                   lossless_spread: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per group (k_max, k_min) as int32 [G] over the blocks that hold a value; EMPTY_K for an all-zero group.

    With ``lossless_spread``: when the range over *all* blocks is already within it for every group, that
    range is returned without looking at the codes (it bounds the range over the blocks that hold a value,
    so the verdict "lossless" is the same, and m = k_max - 8 is then lossless too). This skips the one pass
    over the codes on the common path.
    """
    k = scales.to(torch.int32) - E8M0_BIAS
    if lossless_spread is not None:
        k_min_all, k_max_all = k.reshape(layout.groups, -1).aminmax(dim=-1)
        if bool((k_max_all - k_min_all <= lossless_spread).all()):
            return k_max_all, k_min_all
    holds = block_holds_value(codes, layout.mx_block)
    k = k.reshape(layout.groups, -1)
    holds = holds.reshape(layout.groups, -1)
    low = torch.full_like(k, 10_000)
    k_max = torch.where(holds, k, torch.full_like(k, EMPTY_K)).amax(-1)
    k_min = torch.where(holds, k, low).amin(-1)
    k_min = torch.where(k_max == EMPTY_K, torch.full_like(k_min, EMPTY_K), k_min)
    return k_max, k_min


def exact_pow2_list(exponents: list[int], device: torch.device) -> torch.Tensor:
    """Host integer exponents in [-149, 127] -> exact float32 2^e [len] (math.ldexp is exact, and so is the cast)."""
    return torch.tensor([math.ldexp(1.0, e) for e in exponents], dtype=torch.float32, device=device)


def exact_pow2(exponent: torch.Tensor) -> torch.Tensor:
    """Integer exponents in [-149, 127] -> exact float32 2^e, built from the bit pattern (subnormals included)."""
    e = exponent.to(torch.int32)
    normal = ((e + FP32_EXP_BIAS).clamp(min=1) << 23).view(torch.float32)
    subnormal = (torch.ones_like(e) << (e + 149).clamp(0, 22)).view(torch.float32)
    return torch.where(e >= -126, normal, subnormal)
