"""fp4pass.checkpoint.engine: which units skip reading their codes, per-expert conversion of a stack, the E4M3
block scales of a lossless window that reaches E4M3's subnormals (oracle: ml_dtypes), and each unit's figures
per member against independent decoders (tests/support/checkpoint_oracles.py)."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch

from checkpoint_oracles import mx_decode, nv_decode
from fp4pass.checkpoint import engine
from fp4pass.checkpoint.detect import DEEPSEEK, FusedExperts, Linear
from fp4pass.checkpoint.engine import convert_experts, takes_lossless_path
from fp4pass.safetensors.files import CheckpointError, TensorEntry
from fp4pass.convert import mxfp4_to_nvfp4
from fp4pass.formats import MXFP4Tensor


def _mx(e8m0: np.ndarray, seed: int = 0) -> MXFP4Tensor:
    rng = np.random.default_rng(seed)
    rows, blocks = e8m0.shape
    codes = torch.from_numpy(rng.integers(0, 256, (rows, blocks * 16), dtype=np.uint8))
    return MXFP4Tensor(codes, torch.from_numpy(e8m0.astype(np.uint8)), 32)


@pytest.mark.parametrize("low,high", [(110, 126), (100, 117), (100, 118), (2, 12), (30, 40)])
def test_lossless_path_prediction_matches_the_engine(low, high):
    rng = np.random.default_rng(1)
    e8m0 = rng.integers(low, high + 1, (64, 4))
    e8m0[0, 0], e8m0[1, 1] = low, high
    mx = _mx(e8m0)
    nv, stats = mxfp4_to_nvfp4(mx, "auto", group_dims=0)
    shared = nv.codes.data_ptr() == mx.codes.data_ptr()
    predicted = takes_lossless_path(mx.scales, "auto")
    assert predicted == (high - low <= 17 and high - 135 >= -126)
    if predicted:
        assert shared and stats.blocks16_requantized == 0
    assert not takes_lossless_path(mx.scales, "hybrid")


def test_subnormal_window_block_scales_against_ml_dtypes():
    """Spread 17: the lowest blocks take E4M3 subnormal scales 2^-9 .. 2^-7 (the table path of the engine)."""
    rng = np.random.default_rng(2)
    e8m0 = rng.integers(103, 121, (96, 6))
    e8m0[0, 0], e8m0[0, 1] = 103, 120
    mx = _mx(e8m0)
    nv, stats = mxfp4_to_nvfp4(mx, "auto", group_dims=0)
    m = 120 - 127 - 8
    assert float(nv.global_scale) == 2.0**m and stats.blocks16_requantized == 0
    expected = np.exp2(e8m0 - 127 - m).astype(ml_dtypes.float8_e4m3fn).view(np.uint8).repeat(2, axis=-1)
    np.testing.assert_array_equal(nv.scales.numpy(), expected)
    assert (expected < 8).any()  # some block scales are subnormal


@pytest.mark.parametrize("method", ["auto", "verbatim", "hybrid", "requant"])
def test_convert_experts_equals_one_call_with_per_expert_groups(method):
    rng = np.random.default_rng(3)
    e, n, k = 4, 32, 128
    e8m0 = rng.integers(115, 125, (e, n, k // 32)) + np.arange(e)[:, None, None] * 3
    e8m0[2, 0, 0] = 90  # expert 2 spreads over 17 octaves: lossy
    codes = torch.from_numpy(rng.integers(0, 256, (e, n, k // 2), dtype=np.uint8))
    codes[2, 0, :16] = 0x77
    mx = MXFP4Tensor(codes, torch.from_numpy(e8m0.astype(np.uint8)), 32, name="stack")
    nv, parts = convert_experts(mx, method, effort="best", threads=1)
    ref, stats = mxfp4_to_nvfp4(mx, method)  # per-expert groups of a 3-D tensor
    assert nv.name == "stack" and nv.codes.shape == ref.codes.shape and nv.scales.dtype == torch.uint8
    assert torch.equal(nv.codes, ref.codes) and torch.equal(nv.scales, ref.scales)
    assert nv.global_scale.dtype == torch.float32 and torch.equal(nv.global_scale, ref.global_scale)
    assert len(parts) == e and [p["lossless"] for p in parts] == (
        [False] * 4 if method == "requant" else [True, True, False, True])
    assert sum(p["blocks16_requantized"] for p in parts) == stats.blocks16_requantized
    assert [p["global_scale"] for p in parts] == [[g] for g in ref.global_scale.tolist()]
    assert all(p["method_used"] == stats.method_used and p["blocks16_total"] == n * k // 16 for p in parts)


# -- the engine's pieces against independent decoders (numpy + ml_dtypes) ------------------------------------


@pytest.mark.parametrize("low,high,lossless", [(0, 8, False), (0, 9, True), (1, 9, True), (237, 254, True),
                                               (236, 254, False), (240, 255, False), (126, 126, True)])
def test_lossless_path_at_its_edges(low, high, lossless):
    """Spread 17 and 18; the lowest top exponent whose 2^(k_max - 8) is a normal float32 (code 9: 2^-126);
    the NaN code 255 never takes the path; the engine agrees wherever it converts."""
    e8m0 = np.full((8, 2), low)
    e8m0[-1, -1] = high
    mx = _mx(e8m0)
    assert takes_lossless_path(mx.scales, "auto") is lossless
    assert not takes_lossless_path(mx.scales, "requant")
    if high != 255:
        nv, stats = mxfp4_to_nvfp4(mx, "auto", group_dims=0)
        if lossless:
            assert nv.codes.data_ptr() == mx.codes.data_ptr() and stats.blocks16_requantized == 0


def test_no_blocks_is_not_the_lossless_path():
    assert not takes_lossless_path(torch.empty((0, 2), dtype=torch.uint8), "auto")


class _Catalog:
    """``read(name, out)`` from a dict of tensors, as Catalog.read does from the shards."""

    def __init__(self, tensors):
        self.tensors = tensors

    def read(self, name, out=None):
        t = self.tensors[name]
        if out is None:
            return t.clone()
        out.view(torch.uint8).copy_(t.view(torch.uint8).reshape(out.shape))
        return out


def _entry(name, t, shard="shard-7.safetensors"):
    return TensorEntry(name, "U8", tuple(t.shape), 0, t.numel(), shard)


def _linears(e8m0s, seed=0):
    rng = np.random.default_rng(seed)
    tensors, linears = {}, []
    for i, e8m0 in enumerate(e8m0s):
        rows, blocks = e8m0.shape
        codes = torch.from_numpy(rng.integers(0, 256, (rows, blocks * 16), dtype=np.uint8))
        scales = torch.from_numpy(e8m0.astype(np.uint8))
        tensors[f"m{i}.weight"], tensors[f"m{i}.scale"] = codes, scales
        shard = f"shard-{7 + i}.safetensors"
        linears.append(Linear(f"m{i}", DEEPSEEK, _entry(f"m{i}.weight", codes, shard),
                              _entry(f"m{i}.scale", scales, shard), rows, blocks * 32, [f"m{i}.weight", f"m{i}.scale"]))
    return _Catalog(tensors), linears


def _oracle_part(codes, e8m0, out_codes, out_scales, s):
    x = mx_decode(codes, e8m0)
    y = nv_decode(out_codes, out_scales, s)
    err = y - x
    same = (out_codes == codes).reshape(codes.shape[0], -1, 8).all(-1) & (err == 0).reshape(codes.shape[0], -1,
                                                                                             16).all(-1)
    return {"blocks16_total": same.size, "blocks16_verbatim": int(same.sum()),
            "mse": float((err ** 2).mean()), "max_abs_err": float(np.abs(err).max()),
            "snr_db": float(10 * np.log10((x ** 2).sum() / (err ** 2).sum())) if (err != 0).any() else None}


@pytest.mark.parametrize("chunk", [1 << 21, 64])
def test_a_lossy_pair_measured_per_member(monkeypatch, chunk):
    """w1 lossy (a block 22 octaves down, holding values), w3 not: one global scale for both; each member's
    figures are those of its own decoded values (measured in row chunks of any size)."""
    monkeypatch.setattr(engine, "MEASURE_ROWS_ELEMENTS", chunk)
    rng = np.random.default_rng(4)
    w1, w3 = rng.integers(118, 124, (24, 4)), rng.integers(119, 126, (24, 4))
    w1[3, 1] = 100
    catalog, linears = _linears([w1, w3])
    catalog.tensors["m0.weight"][3, 16:32] = 0  # the low block holds 4.0s in its first 16-half only
    catalog.tensors["m0.weight"][3, 16:24] = 0x66
    conv = engine.convert_linears(catalog, linears, "auto")
    assert conv.codes is not None and len(conv.parts) == 2
    assert [p["blocks16_requantized"] for p in conv.parts] == [1, 0]
    for i, part in enumerate(conv.parts):
        codes = catalog.tensors[f"m{i}.weight"].numpy()
        want = _oracle_part(codes, catalog.tensors[f"m{i}.scale"].numpy(), conv.codes[i].numpy(),
                            conv.scales[i].numpy(), conv.global_scale)
        assert part["global_scale"] == [conv.global_scale] and part["method_used"] == "auto"
        for key in ("blocks16_total", "blocks16_verbatim"):
            assert part[key] == want[key], (i, key)
        assert part["blocks16_requantized"] == want["blocks16_total"] - want["blocks16_verbatim"]
        assert part["mse"] == pytest.approx(want["mse"], rel=1e-12, abs=0)
        assert part["max_abs_err"] == want["max_abs_err"]
        assert part["lossless"] == (want["blocks16_verbatim"] == want["blocks16_total"])
        if want["snr_db"] is None:
            assert part["snr_db"] is None
        else:
            assert part["snr_db"] == pytest.approx(want["snr_db"], rel=1e-12)
    assert not conv.parts[0]["lossless"] and conv.parts[0]["blocks16_verbatim"] > 0


def test_a_lossless_pair_copies_codes_and_shares_the_top_scale():
    rng = np.random.default_rng(5)
    w1, w3 = rng.integers(110, 120, (16, 2)), rng.integers(112, 124, (16, 2))
    w3[0, 0] = 124
    catalog, linears = _linears([w1, w3])
    conv = engine.convert_linears(catalog, linears, "auto")
    assert conv.codes is None and conv.global_scale == math.ldexp(1.0, 124 - 127 - 8)
    assert all(type(p["blocks16_total"]) is int for p in conv.parts)
    for i, part in enumerate(conv.parts):
        assert part == {"blocks16_total": 64, "blocks16_verbatim": 64, "blocks16_requantized": 0,
                        "global_scale": [conv.global_scale], "mse": 0.0, "max_abs_err": 0.0, "snr_db": None,
                        "method_used": "auto", "lossless": True}
        y = nv_decode(catalog.tensors[f"m{i}.weight"].numpy(), conv.scales[i].numpy(), conv.global_scale)
        np.testing.assert_array_equal(y, mx_decode(catalog.tensors[f"m{i}.weight"].numpy(), [w1, w3][i]))


def test_one_linear_takes_the_engines_own_figures():
    rng = np.random.default_rng(6)
    e8m0 = rng.integers(118, 124, (16, 2))
    e8m0[0, 0] = 90
    catalog, linears = _linears([e8m0])
    catalog.tensors["m0.weight"][0, :16] = 0x77
    conv = engine.convert_linears(catalog, linears, "auto")
    ref, stats = mxfp4_to_nvfp4(MXFP4Tensor(catalog.tensors["m0.weight"], catalog.tensors["m0.scale"], 32), "auto",
                                group_dims=0)
    assert conv.parts == [{**stats.to_json(), "lossless": False}]
    assert torch.equal(conv.codes[0], ref.codes) and torch.equal(conv.scales[0], ref.scales)


@pytest.mark.parametrize("which", [0, 1])
def test_an_e8m0_nan_names_its_tensor_and_index(which):
    catalog, linears = _linears([np.full((4, 2), 120), np.full((4, 2), 121)])
    catalog.tensors[f"m{which}.scale"][2, 1] = 255
    with pytest.raises(CheckpointError, match=rf"^shard-{7 + which}.safetensors: tensor 'm{which}.scale': E8M0 "
                                              r"code 255 \(NaN\) at index \(2, 1\)$"):
        engine.convert_linears(catalog, linears, "auto")


def test_a_stack_with_one_global_scale_measured_per_expert():
    rng = np.random.default_rng(7)
    e8m0 = rng.integers(118, 124, (3, 8, 2))
    e8m0[1, 0, 0] = 96
    codes = torch.from_numpy(rng.integers(0, 256, (3, 8, 32), dtype=np.uint8))
    codes[1, 0, :16] = 0x77
    blocks = codes.reshape(3, 8, 2, 16)
    scales = torch.from_numpy(e8m0.astype(np.uint8))
    catalog = _Catalog({"s_blocks": blocks, "s_scales": scales})
    unit = FusedExperts("p", "s", _entry("s_blocks", blocks), _entry("s_scales", scales), 3, 8, 64)
    conv = engine.convert_fused(catalog, unit, "auto")
    assert conv.codes is not None and [p["lossless"] for p in conv.parts] == [True, False, True]
    assert all(p["method_used"] == "auto" and type(p["blocks16_total"]) is int for p in conv.parts)
    for e, part in enumerate(conv.parts):
        want = _oracle_part(codes[e].numpy(), e8m0[e], conv.codes[e].numpy(), conv.scales[e].numpy(),
                            conv.global_scale)
        assert (part["blocks16_verbatim"], part["max_abs_err"]) == (want["blocks16_verbatim"], want["max_abs_err"])


@pytest.mark.parametrize("value,expected", [(2.0, 0.5), (0.25, 4.0), (3.0, float(np.float32(1) / np.float32(3)))])
def test_reciprocal_is_float32(value, expected):
    assert engine.reciprocal(value) == expected


@pytest.mark.parametrize("value", [0.0, -2.0, 1e-45, math.inf, 1e39])
def test_reciprocal_refuses_what_has_none(value):
    with pytest.raises(CheckpointError, match="is not a finite positive float32"):
        engine.reciprocal(value)


def test_the_lossless_path_hands_the_engine_uint8_codes_it_never_reads(monkeypatch):
    """The codes the engine gets on the lossless path are an unread uint8 buffer of the unit's shape (the
    MXFP4Tensor contract); the output codes are then copied from the source file, so none are returned."""
    seen = []
    real = engine.mxfp4_to_nvfp4

    def spy(mx, *args, **kwargs):
        seen.append((mx.codes.dtype, tuple(mx.codes.shape), mx.codes.is_contiguous()))
        return real(mx, *args, **kwargs)

    monkeypatch.setattr(engine, "mxfp4_to_nvfp4", spy)
    catalog, linears = _linears([np.full((8, 3), 120), np.full((8, 3), 122)])
    for _ in range(2):  # a second unit reuses the placeholder
        conv = engine.convert_linears(catalog, linears, "auto")
        assert conv.codes is None
    assert seen == [(torch.uint8, (16, 48), True)] * 2


def _stack(e8m0, seed=8):
    rng = np.random.default_rng(seed)
    e, rows, blocks = e8m0.shape
    codes = torch.from_numpy(rng.integers(0, 256, (e, rows, blocks * 16), dtype=np.uint8))
    blocks_t, scales = codes.reshape(e, rows, blocks, 16), torch.from_numpy(e8m0.astype(np.uint8))
    catalog = _Catalog({"p.s_blocks": blocks_t, "p.s_scales": scales})
    return catalog, FusedExperts("p", "s", _entry("p.s_blocks", blocks_t), _entry("p.s_scales", scales), e, rows,
                                 blocks * 32), codes


def test_a_lossless_stack_reads_no_codes_and_shares_the_top_scale(monkeypatch):
    rng = np.random.default_rng(9)
    e8m0 = rng.integers(110, 125, (3, 8, 2))
    e8m0[2, 7, 1] = 126
    catalog, unit, codes = _stack(e8m0)
    seen = []
    real = engine.mxfp4_to_nvfp4
    monkeypatch.setattr(engine, "mxfp4_to_nvfp4", lambda mx, *a, **k: seen.append(
        (mx.codes.dtype, tuple(mx.codes.shape), mx.name)) or real(mx, *a, **k))
    conv = engine.convert_fused(catalog, unit, "auto")
    assert seen == [(torch.uint8, (3, 8, 32), "p.s_blocks")]
    assert conv.codes is None and conv.global_scale == math.ldexp(1.0, 126 - 127 - 8)
    assert all(type(p["blocks16_total"]) is int for p in conv.parts)
    assert conv.parts == [{"blocks16_total": 32, "blocks16_verbatim": 32, "blocks16_requantized": 0,
                           "global_scale": [conv.global_scale], "mse": 0.0, "max_abs_err": 0.0, "snr_db": None,
                           "method_used": "auto", "lossless": True}] * 3
    for i in range(3):
        np.testing.assert_array_equal(nv_decode(codes[i].numpy(), conv.scales[i].numpy(), conv.global_scale),
                                      mx_decode(codes[i].numpy(), e8m0[i]))


@pytest.mark.parametrize("kind", ["linears", "stack"])
def test_an_engine_that_copies_codes_on_the_lossless_path_is_a_bug(monkeypatch, kind):
    """The lossless path promises the source's bytes (the writer copies them from the file): an engine that
    returns other codes there is stopped, not written."""
    from fp4pass.formats import NVFP4Tensor

    real = engine.mxfp4_to_nvfp4

    def copying(mx, *args, **kwargs):
        nv, stats = real(mx, *args, **kwargs)
        return NVFP4Tensor(nv.codes.clone(), nv.scales, nv.global_scale), stats

    monkeypatch.setattr(engine, "mxfp4_to_nvfp4", copying)
    with pytest.raises(RuntimeError, match="did not keep the codes on its lossless path"):
        if kind == "linears":
            catalog, linears = _linears([np.full((8, 2), 120)])
            engine.convert_linears(catalog, linears, "auto")
        else:
            catalog, unit, _ = _stack(np.full((2, 8, 2), 120))
            engine.convert_fused(catalog, unit, "auto")


@pytest.mark.parametrize("method", ["auto", "verbatim"])
def test_convert_experts_passes_effort_and_threads_to_every_call(monkeypatch, method):
    seen = []
    real = engine.mxfp4_to_nvfp4

    def spy(mx, *args, **kwargs):
        seen.append((kwargs.get("effort"), kwargs.get("threads")))
        return real(mx, *args, **kwargs)

    monkeypatch.setattr(engine, "mxfp4_to_nvfp4", spy)
    mx = _mx(np.full((8, 2), 120))
    stack = MXFP4Tensor(torch.stack([mx.codes] * 3), torch.stack([mx.scales] * 3), 32)
    convert_experts(stack, method, effort="fast", threads=2)
    assert seen and set(seen) == {("fast", 2)}


def test_measure_takes_one_global_scale():
    from fp4pass.formats import NVFP4Tensor

    mx = _mx(np.full((4, 2), 120))
    nv = NVFP4Tensor(mx.codes, torch.zeros((4, 4), dtype=torch.uint8), torch.ones(2))
    with pytest.raises(ValueError, match="^measure: one global scale expected$"):
        engine.measure(mx, nv, "auto")


def test_another_engine_error_names_the_first_tensor_of_the_unit():
    catalog, linears = _linears([np.full((4, 2), 120), np.full((4, 2), 121)])
    with pytest.raises(CheckpointError, match=r"^shard-7.safetensors: tensor 'm0.scale': m0.weight: unknown effort 'none'"):
        engine.convert_linears(catalog, linears, "auto", effort="none")
