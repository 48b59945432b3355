"""A test oracle: the per-16-half float encoder that fp4pass's pattern-grouped encoder
(:mod:`fp4pass.convert.patterns`) must match, half by half.

Encoding 16-halves at a given global scale S: the verbatim scale when one exists, else the best E4M3 code.

A 16-half h belongs to an MX block with exponent k and holds the exact values v_i = e2m1(c_i) * 2^k. At an FP32
global scale S (dequant multiplier, ModelOpt convention) an E4M3 block scale s reconstructs

    x_hat_i = e2m1(rne(v_i / fp32(s*S))) * fp32(s*S)

(exactly the float operations of ``NVFP4Tensor.quantize``/``dequantize``). The half is *verbatim* at S when
some E4M3 value s_v has fp32(s_v * S) == 2^k exactly: then x_hat = v, the nibbles are kept, error 0. An
all-zero half is verbatim under any S. Otherwise the half is requantized with one of ``codes`` candidate E4M3
codes around the standard one s0 = e4m3(clamp(amax_h / (6 S), 2^-9, 448)); the candidate of least squared
error (SSE, float64) wins, ties to the earlier candidate (s0 first).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fp4pass.formats import (
    E2M1_MAX,
    E4M3_MAX,
    E4M3_MIN_SUBNORMAL,
    decode_e2m1,
    decode_e4m3,
    encode_e2m1,
    encode_e4m3,
)
from fp4pass.convert.layout import exact_pow2
from fp4pass.formats.constants import E4M3_MAX_CODE

__all__ = ["HalfChoice", "encode_halves", "E4M3_CODE_MAX"]

E4M3_CODE_MAX = E4M3_MAX_CODE
E4M3_CODE_MIN = 0x01  # 2^-9


@dataclass
class HalfChoice:
    """The encoding chosen for n halves: E4M3 codes [n], E2M1 codes [n, 16], SSE [n] float64, verbatim [n]."""

    scale_codes: torch.Tensor
    element_codes: torch.Tensor
    sse: torch.Tensor
    verbatim: torch.Tensor


def _requantize(values: torch.Tensor, scale_codes: torch.Tensor, global_scale: torch.Tensor):
    """(E2M1 codes [n, 16], SSE [n] float64) of ``values`` [n, 16] at block scales ``scale_codes`` [n] and S [n]."""
    full_scale = (decode_e4m3(scale_codes) * global_scale).unsqueeze(-1)
    codes = encode_e2m1(values / full_scale)
    error = values.double() - (decode_e2m1(codes) * full_scale).double()
    return codes, error.square().sum(-1)


def encode_halves(
    values: torch.Tensor,
    exponent: torch.Tensor,
    element_codes: torch.Tensor,
    global_scale: torch.Tensor,
    *,
    allow_verbatim: bool = True,
    neighbours: int = 1,
) -> HalfChoice:
    """Encode halves ``values`` float32 [n, 16] (MX exponent ``exponent`` int32 [n], MX codes [n, 16]) at S [n].

    ``neighbours``: how many E4M3 codes either side of the standard s0 compete (0 = plain requantization).
    ``allow_verbatim`` False gives exactly ModelOpt's NVFP4 quantization (seed Algo 1).
    """
    n = values.shape[0]
    global_scale = global_scale.float()
    amax = values.abs().amax(-1)
    s0 = encode_e4m3((amax / (E2M1_MAX * global_scale)).clamp(E4M3_MIN_SUBNORMAL, E4M3_MAX))
    scale_codes = s0.clone()
    sse = torch.zeros(n, dtype=torch.float64, device=values.device)
    out_codes = element_codes.clone()
    verbatim = torch.zeros(n, dtype=torch.bool, device=values.device)

    if allow_verbatim:
        target = exact_pow2(exponent)  # 2^k
        s_v = encode_e4m3((target / global_scale).clamp(0, E4M3_MAX))
        exact = (decode_e4m3(s_v) * global_scale == target) & (s_v != 0)
        verbatim = exact | (amax == 0)
        scale_codes = torch.where(exact, s_v, scale_codes)

    todo = (~verbatim).nonzero().squeeze(-1)
    if todo.numel():
        v, g, base = values[todo], global_scale[todo], s0[todo].to(torch.int16)
        best_codes, best_sse = _requantize(v, s0[todo], g)
        best_scale = s0[todo]
        for step in [d for i in range(1, neighbours + 1) for d in (-i, i)]:
            cand = (base + step).clamp(E4M3_CODE_MIN, E4M3_CODE_MAX).to(torch.uint8)
            codes, cand_sse = _requantize(v, cand, g)
            better = cand_sse < best_sse
            best_sse = torch.where(better, cand_sse, best_sse)
            best_scale = torch.where(better, cand, best_scale)
            best_codes = torch.where(better.unsqueeze(-1), codes, best_codes)
        scale_codes[todo] = best_scale
        out_codes[todo] = best_codes
        sse[todo] = best_sse
    return HalfChoice(scale_codes, out_codes, sse, verbatim)

