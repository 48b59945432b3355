"""fp4pass.checkpoint.engine's per-member figures where a wrong bound or a wrong count would still pass the other
tests: a member measured in row chunks with more rows than bytes per row, 16-halves whose codes stay while
their scale changes (and the reverse: other codes, the same values), and a stack with exactly one requantized
16-half. The oracle is numpy + ml_dtypes (tests/support/checkpoint_oracles.py), never the engine."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch

from checkpoint_oracles import mx_decode, nv_decode
from fp4pass.checkpoint import engine
from fp4pass.checkpoint.detect import FusedExperts
from fp4pass.safetensors.files import CheckpointError, TensorEntry
from fp4pass.errors import FP4PassError
from fp4pass.formats import MXFP4Tensor, NVFP4Tensor


def _figures(codes, e8m0, out_codes, out_scales, s):
    """The figures of one member from its decoded values: a 16-half is verbatim when its 8 code bytes are the
    source's and its 16 values equal the source's."""
    x, y = mx_decode(codes, e8m0), nv_decode(out_codes, out_scales, s)
    err = y - x
    rows = codes.shape[0]
    kept = (out_codes == codes).reshape(rows, -1, 8).all(-1)
    exact = (err == 0).reshape(rows, -1, 16).all(-1)
    verbatim = int((kept & exact).sum())
    return {"blocks16_total": kept.size, "blocks16_verbatim": verbatim, "blocks16_requantized": kept.size - verbatim,
            "mse": float((err ** 2).mean()), "max_abs_err": float(np.abs(err).max()),
            "snr_db": float(10 * np.log10((x ** 2).sum() / (err ** 2).sum())) if verbatim < kept.size else None}


def _check(part, want, s):
    for key in ("blocks16_total", "blocks16_verbatim", "blocks16_requantized", "max_abs_err"):
        assert part[key] == want[key], key
    assert part["mse"] == pytest.approx(want["mse"], rel=1e-12, abs=0)
    if want["snr_db"] is None:
        assert part["snr_db"] is None
    else:
        assert part["snr_db"] == pytest.approx(want["snr_db"], rel=1e-12)
    assert part["lossless"] == (want["blocks16_requantized"] == 0) and part["global_scale"] == [s]


@pytest.mark.parametrize("chunk", [64 * 8, 64 * 5, 1 << 21])
def test_measure_counts_every_row_and_only_halves_both_kept_and_exact(monkeypatch, chunk):
    """48 rows of K = 64 (32 bytes a row, fewer than the rows), measured 8 or 5 rows at a time or at once. The
    NVFP4 side is written by hand from the E8M0 exponents (2^(k - 127 - m) as E4M3, S = 2^m), then broken:
    row 40's first 16-half keeps its codes under a doubled scale (kept, not exact), row 1's second 16-half
    halves its codes under a doubled scale (exact, not kept), row 45's last 16-half gets other codes."""
    monkeypatch.setattr(engine, "MEASURE_ROWS_ELEMENTS", chunk)
    rng = np.random.default_rng(11)
    rows, k = 48, 64
    e8m0 = rng.integers(118, 126, (rows, k // 32))
    codes = rng.integers(0, 256, (rows, k // 2), dtype=np.uint8)
    codes[1, 8:16] = 0x44  # 2.0s: as 1.0s (0x22) under twice the scale, the same values
    m = int(e8m0.max()) - 127 - 8
    s = math.ldexp(1.0, m)
    out_scales = np.exp2(e8m0 - 127 - m).astype(ml_dtypes.float8_e4m3fn).view(np.uint8).repeat(2, axis=-1)
    out_codes = codes.copy()
    two = np.array(2.0, dtype=ml_dtypes.float8_e4m3fn)
    for r, half in ((40, 0), (1, 1)):
        out_scales[r, half] = (out_scales[r, half:half + 1].view(ml_dtypes.float8_e4m3fn) * two).view(np.uint8)[0]
    out_codes[1, 8:16] = 0x22
    out_codes[45, 24:32] ^= 0x11
    mx = MXFP4Tensor(torch.from_numpy(codes), torch.from_numpy(e8m0.astype(np.uint8)), 32)
    nv = NVFP4Tensor(torch.from_numpy(out_codes), torch.from_numpy(out_scales), torch.tensor(s, dtype=torch.float32))
    part = engine.measure(mx, nv, "hybrid")
    want = _figures(codes, e8m0, out_codes, out_scales, s)
    # the oracle itself: 192 halves; row 40's and row 45's are lossy, row 1's second is exact with other codes
    assert (want["blocks16_total"], want["blocks16_verbatim"]) == (rows * k // 16, rows * k // 16 - 3)
    assert np.array_equal(nv_decode(out_codes[1], out_scales[1], s), mx_decode(codes[1], e8m0[1]))
    _check(part, want, s)
    assert part["method_used"] == "hybrid" and type(part["blocks16_total"]) is int


def test_a_stack_with_exactly_one_requantized_half_is_measured_per_expert():
    """Three experts under one S; expert 1 holds one block 26 octaves below the top whose first 16-half holds
    4.0s and whose second holds zeros: that one 16-half is requantized, every other one stays verbatim."""
    rng = np.random.default_rng(12)
    e, rows, k = 3, 24, 128
    e8m0 = rng.integers(118, 126, (e, rows, k // 32))
    e8m0[2, 0, 0] = 126
    e8m0[1, 3, 1] = 100
    codes = rng.integers(0, 256, (e, rows, k // 2), dtype=np.uint8)
    codes[1, 3, 16:32] = 0
    codes[1, 3, 16:24] = 0x66
    blocks = torch.from_numpy(codes).reshape(e, rows, k // 32, 16)
    scales = torch.from_numpy(e8m0.astype(np.uint8))
    tensors = {"p.s_blocks": blocks, "p.s_scales": scales}

    class Catalog:
        def read(self, name, out):
            return out.copy_(tensors[name].reshape(out.shape))

    unit = FusedExperts("p", "s", TensorEntry("p.s_blocks", "U8", tuple(blocks.shape), 0, blocks.numel(), "a"),
                        TensorEntry("p.s_scales", "U8", tuple(scales.shape), 0, scales.numel(), "a"), e, rows, k)
    conv = engine.convert_fused(Catalog(), unit, "auto")
    assert conv.codes is not None and conv.global_scale == math.ldexp(1.0, 126 - 127 - 8)
    assert [p["blocks16_requantized"] for p in conv.parts] == [0, 1, 0]
    for i, part in enumerate(conv.parts):
        want = _figures(codes[i], e8m0[i], conv.codes[i].numpy(), conv.scales[i].numpy(), conv.global_scale)
        _check(part, want, conv.global_scale)
        assert part["method_used"] == "auto"


def _stack_catalog(e8m0, codes):
    e, rows, blocks = e8m0.shape
    tensors = {"p.s_blocks": torch.from_numpy(codes).reshape(e, rows, blocks, 16),
               "p.s_scales": torch.from_numpy(e8m0.astype(np.uint8))}

    class Catalog:
        def read(self, name, out):
            return out.copy_(tensors[name].reshape(out.shape))

    entries = [TensorEntry(n, "U8", tuple(t.shape), 0, t.numel(), "model-00002-of-00003.safetensors")
               for n, t in tensors.items()]
    return Catalog(), FusedExperts("p", "s", *entries, e, rows, blocks * 32)


def test_a_stacks_e8m0_nan_names_its_scales_tensor_shard_and_index():
    e8m0 = np.full((2, 4, 2), 120)
    e8m0[1, 3, 0] = 255
    catalog, unit = _stack_catalog(e8m0, np.zeros((2, 4, 32), dtype=np.uint8))
    with pytest.raises(CheckpointError, match=r"^model-00002-of-00003.safetensors: tensor 'p.s_scales': E8M0 code 255 "
                                        r"\(NaN\) at index \(1, 3, 0\)$"):
        engine.convert_fused(catalog, unit, "auto")


def test_convert_experts_defaults_to_auto_and_names_the_expert_of_an_error():
    rng = np.random.default_rng(13)
    e8m0 = rng.integers(118, 124, (3, 4, 2)).astype(np.uint8)
    codes = torch.from_numpy(rng.integers(0, 256, (3, 4, 32), dtype=np.uint8))
    mx = MXFP4Tensor(codes, torch.from_numpy(e8m0), 32, name="stack")
    nv, parts = engine.convert_experts(mx)
    assert [p["method_used"] for p in parts] == ["auto"] * 3 and all(p["lossless"] for p in parts)
    for i in range(3):  # per expert S = 2^(k_max - 135), the codes kept
        s = math.ldexp(1.0, int(e8m0[i].max()) - 135)
        assert float(nv.global_scale[i]) == s
        np.testing.assert_array_equal(nv_decode(nv.codes[i].numpy(), nv.scales[i].numpy(), s),
                                      mx_decode(codes[i].numpy(), e8m0[i]))
    bad = e8m0.copy()
    bad[2, 1, 0] = 255  # expert by expert (verbatim): the message names the expert
    with pytest.raises(FP4PassError, match=r"^stack\[2\] scales: E8M0 code 255 \(NaN\) at index \(1, 0\)$"):
        engine.convert_experts(MXFP4Tensor(codes, torch.from_numpy(bad), 32, name="stack"), "verbatim")
