"""The lossless rule of MXFP4 -> NVFP4, stated once.

An MXFP4 block of 32 holds ``e2m1(code) * 2^k`` with k its E8M0 exponent. NVFP4 writes it as two blocks of 16
under an E4M3 block scale and one FP32 global scale 2^m per group. E4M3 holds exactly the 18 powers of two
2^-9..2^8, so with m = k_max - 8 every block keeps its nibbles verbatim and its block scale 2^(k - m) is exact
iff ``k_max - k_min <= 17`` (:data:`~fp4pass.formats.constants.LOSSLESS_SPREAD`) over the blocks of the group.
Whoever decides whether a weight converts without loss (the converter, the ONNX rewrite that keeps the kernel
layout, ``fp4pass inspect``, the checkpoint engine that skips reading the codes) asks :func:`lossless_range`.
"""

from __future__ import annotations

from fp4pass.formats.constants import LOSSLESS_SPREAD

__all__ = ["lossless_range", "LOSSLESS_SPREAD"]


def lossless_range(k_min, k_max):
    """Whether blocks whose E8M0 exponents (or codes: the bias cancels) span ``k_min..k_max`` convert verbatim.

    Element-wise on numpy arrays and torch tensors (a boolean array), a bool on ints. Pass signed integers:
    ``k_max - k_min`` of two uint8 arrays wraps around."""
    return k_max - k_min <= LOSSLESS_SPREAD
