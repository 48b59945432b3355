"""FP4 with arbitrary float block scales -> NVFP4 (the lossy path for scales that are not powers of two).

Input: E2M1 codes (packed, low nibble first) [..., K/2] and float32 scales s_b [..., K/B], one per block of
B (32) along the last axis: x[i] = e2m1(code[i]) * s_b. Any finite s_b: negative, zero or not a power of two
(a power-of-two scale is MXFP4 and goes through :func:`fp4pass.convert.mxfp4_to_nvfp4` instead, exactly).

Each group (one FP32 global scale G: per expert for 3-D weights, else per tensor) is encoded per 16-half:

1. ``requant``: G = amax/(6*448) and plain NVFP4 quantization of the decoded x (``NVFP4Tensor.quantize``).
2. ``verbatim``: every code kept (sign flipped where s_b < 0), G = max|s_b|/448 so that the largest block
   scale is E4M3's largest value, and each half's E4M3 scale the least-SSE one of round_e4m3(|s_b|/G) and its
   two neighbouring codes.
3. ``hybrid`` / ``auto`` (the same here: arbitrary scales have no exponent window for hybrid to keep): at each
   candidate G in {requant's G, verbatim's G}, every 16-half takes the least-SSE of its requantized encoding
   and its kept codes under the three E4M3 scales; the G of least total SSE wins. Requant's G and its
   per-half encoding are among the options, so the SSE of auto is never above requant's, per group.

SSE and the statistics are measured against the decoded x, in float64, with the NVFP4 dequantization
e2m1 * (e4m3 * G) formed in float32 as ``NVFP4Tensor.dequantize`` (and ONNX's two DequantizeLinear) does.
"""

from __future__ import annotations

import torch

from fp4pass.convert.stats import ConversionStats
from fp4pass.choices import Method, values
from fp4pass.errors import ShapeError, UsageError
from fp4pass.formats import (
    E4M3_MAX,
    NV_BLOCK_SIZE,
    NVFP4Tensor,
    decode_e2m1,
    decode_e4m3,
    encode_e4m3,
    global_scale_from_amax,
    pack_nibbles,
    unpack_nibbles,
)
from fp4pass.formats.codecs import check_finite
from fp4pass.formats.constants import E4M3_MAX_CODE
from fp4pass.metrics import snr_db

__all__ = ["scaled_fp4_to_nvfp4", "decode_scaled_fp4", "METHODS"]

METHODS = values(Method)


def decode_scaled_fp4(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 [..., K]: e2m1(code) * s_b, one float32 multiply (as DequantizeLinear with float32 scales)."""
    values = decode_e2m1(unpack_nibbles(codes))
    k = values.shape[-1]
    block = k // scales.shape[-1]
    return (values.reshape(*scales.shape, block) * scales.float().unsqueeze(-1)).reshape(*scales.shape[:-1], k)


def _keep_codes(elements: torch.Tensor, scales: torch.Tensor, block: int, g: torch.Tensor, x: torch.Tensor):
    """Kept codes at global scale ``g``: (codes [R, K] one per byte, e4m3 codes [R, H], sse [R, H])."""
    rows, k = elements.shape
    halves = k // NV_BLOCK_SIZE
    per_block = block // NV_BLOCK_SIZE
    negative = (scales < 0).repeat_interleave(block, dim=-1)
    codes = torch.where(negative, elements ^ 0x8, elements)
    values = decode_e2m1(codes).reshape(rows, halves, NV_BLOCK_SIZE)
    target = (scales.abs() / g).repeat_interleave(per_block, dim=-1)  # [R, H]
    nearest = encode_e4m3(target.clamp(max=E4M3_MAX)).to(torch.int32)
    best_sse = best_code = None
    xr = x.reshape(rows, halves, NV_BLOCK_SIZE).double()
    for step in (-1, 0, 1):
        code = (nearest + step).clamp(0, E4M3_MAX_CODE).to(torch.uint8)
        deq = values * (decode_e4m3(code) * g).unsqueeze(-1)
        sse = (deq.double() - xr).square().sum(-1)
        if best_sse is None:
            best_sse, best_code = sse, code
        else:
            better = sse < best_sse
            best_sse, best_code = torch.where(better, sse, best_sse), torch.where(better, code, best_code)
    return codes, best_code, best_sse


def _requant(x: torch.Tensor, g: torch.Tensor):
    """NVFP4 quantization of ``x`` [R, K] at global scale ``g``: (codes [R, K], e4m3 codes [R, H], sse [R, H])."""
    nv = NVFP4Tensor.quantize(x, global_scale=g)
    rows, k = x.shape
    sse = (nv.dequantize().double() - x.double()).reshape(rows, -1, NV_BLOCK_SIZE).square().sum(-1)
    return nv.element_codes(), nv.scales, sse


def _encode_group(elements, scales, block, x, method):
    """One group -> (codes one per byte [R, K], e4m3 codes [R, H], G float32 [], method_used)."""
    amax = x.abs().amax() if x.numel() else torch.zeros(())
    g_requant = global_scale_from_amax(amax)
    s_max = scales.abs().amax() if scales.numel() else torch.zeros(())
    g_keep = global_scale_from_amax(s_max * 6)  # s_max / 448, or 1.0 when every scale is 0
    if method == "requant":
        codes, block_scales, _ = _requant(x, g_requant)
        return codes, block_scales, g_requant, "requant"
    if method == "verbatim":
        codes, block_scales, _ = _keep_codes(elements, scales, block, g_keep, x)
        return codes, block_scales, g_keep, "verbatim"
    best = None
    for g in (g_requant, g_keep):
        r_codes, r_scales, r_sse = _requant(x, g)
        k_codes, k_scales, k_sse = _keep_codes(elements, scales, block, g, x)
        keep = k_sse < r_sse
        half_keep = keep.repeat_interleave(NV_BLOCK_SIZE, dim=-1)
        codes = torch.where(half_keep, k_codes, r_codes)
        block_scales = torch.where(keep, k_scales, r_scales)
        total = float(torch.where(keep, k_sse, r_sse).sum())
        if best is None or total < best[0]:
            best = (total, codes, block_scales, g)
    _, codes, block_scales, g = best
    return codes, block_scales, g, method


def scaled_fp4_to_nvfp4(
    codes: torch.Tensor, scales: torch.Tensor, method: str = "auto", group_dims: int | None = None, *,
    name: str = "fp4",
) -> tuple[NVFP4Tensor, ConversionStats]:
    """Convert FP4 codes uint8 [..., K/2] with float block scales [..., K/B] to NVFP4 (module docstring).

    ``group_dims``: leading dims with their own global scale (None: 1 for 3-D tensors, else 0). Returns the
    NVFP4 tensor and its statistics, measured against the decoded input.
    """
    if method not in METHODS:
        raise UsageError(f"{name}: unknown method {method!r}; choose one of {', '.join(METHODS)}")
    codes, scales = torch.as_tensor(codes), torch.as_tensor(scales).float()
    check_finite(scales, f"{name} scales")
    k = codes.shape[-1] * 2
    if codes.shape[:-1] != scales.shape[:-1] or not scales.shape[-1] or k % scales.shape[-1]:
        raise ShapeError(f"{name}: codes {tuple(codes.shape)} and scales {tuple(scales.shape)} do not match")
    block = k // scales.shape[-1]
    if block % NV_BLOCK_SIZE:
        raise ShapeError(f"{name}: block size {block} is not a multiple of 16")
    if group_dims is None:
        group_dims = 1 if codes.dim() == 3 else 0
    lead = codes.shape[:group_dims]
    groups = 1
    for d in lead:
        groups *= d
    elements = unpack_nibbles(codes).reshape(groups, -1, k)
    flat_scales = scales.reshape(groups, -1, scales.shape[-1])
    x = decode_scaled_fp4(codes, scales).reshape(groups, -1, k)
    out_codes, out_scales, out_g, used = [], [], [], method
    for i in range(groups):
        c, s, g, used = _encode_group(elements[i], flat_scales[i], block, x[i], method)
        out_codes.append(c)
        out_scales.append(s)
        out_g.append(g.reshape(()))
    shape = codes.shape
    nv_codes = pack_nibbles(torch.stack(out_codes).reshape(*shape[:-1], k))
    nv_scales = torch.stack(out_scales).reshape(*shape[:-1], k // NV_BLOCK_SIZE)
    global_scale = torch.stack(out_g).reshape(lead).float()
    nv = NVFP4Tensor.from_codes(nv_codes, nv_scales, global_scale, name=name)
    return nv, _stats(nv, elements.reshape(*shape[:-1], k), x.reshape(*shape[:-1], k), used)


def _stats(nv: NVFP4Tensor, elements: torch.Tensor, x: torch.Tensor, method: str) -> ConversionStats:
    err = nv.dequantize().double() - x.double()
    sse = float(err.square().sum())
    signal = float(x.double().square().sum())
    n = err.numel()
    exact = (err == 0).reshape(*err.shape[:-1], -1, NV_BLOCK_SIZE).all(-1)
    kept = (nv.element_codes() & 0x7 == elements & 0x7).reshape(exact.shape + (NV_BLOCK_SIZE,)).all(-1)
    verbatim = int((exact & kept).sum())
    total = exact.numel()
    return ConversionStats(
        total, verbatim, total - verbatim, nv.global_scale.flatten().tolist(), sse / n if n else 0.0,
        float(err.abs().max()) if n else 0.0, snr_db(signal, sse), method,
    )
