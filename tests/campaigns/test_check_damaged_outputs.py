"""``convert --check`` (fp4pass.checkpoint.check) against outputs damaged after the fact.

Each output is written by the converter, then one defect is planted in it with the safetensors package (a
nibble, a block scale, a global scale); the check is run on the folder as it is. What each defect must do is
computed here with numpy and ml_dtypes (tests/support/checkpoint_oracles.py), never with the check's own decoders:
which experts decode to their source exactly, where the first wrong value is and what it holds, how large the
squared error is next to plain NVFP4 requantization.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from checkpoint_oracles import (
    EXPERTS_PREFIX,
    Folder,
    as_bytes,
    expert_modules,
    moe_checkpoint,
    mx_decode,
    nv_decode,
    requant_sse,
    source_linear,
    write_checkpoint,
)
from safetensors.torch import load_file, save_file

import fp4pass.checkpoint
from fp4pass.safetensors.catalog import Catalog
from fp4pass.checkpoint.detect import detect

pytest.importorskip("compressed_tensors")

CT = "compressed-tensors"
E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6], dtype=np.float64)


def _check(src: Path, out: Path, fmt: str, method: str = "auto") -> dict:
    """The check of ``out`` against ``src``, as ``convert --check`` runs it on its own output."""
    from fp4pass.checkpoint.check import check_checkpoint

    catalog = Catalog.open(src)
    try:
        return check_checkpoint(catalog, detect(catalog.tensors, catalog.config), out, fmt, method)
    finally:
        catalog.close()


def _out_tensors(out: Path, module: str, fmt: str) -> tuple[np.ndarray, np.ndarray, float]:
    """(codes [N, K/2], E4M3 bytes [N, K/16], global multiplier) of one Linear as written."""
    f = Folder(out)
    if fmt == CT:
        return (as_bytes(f.get(f"{module}.weight_packed")), as_bytes(f.get(f"{module}.weight_scale")),
                1.0 / float(f.get(f"{module}.weight_global_scale").double().reshape(())))
    return (as_bytes(f.get(f"{module}.weight")), as_bytes(f.get(f"{module}.weight_scale")),
            float(f.get(f"{module}.weight_scale_2").double()))


def _edit(out: Path, name: str, edit) -> None:
    """Rewrite the shard holding ``name`` with ``edit(tensor) -> tensor`` applied to it."""
    for path in sorted(out.glob("*.safetensors")):
        tensors = load_file(path)
        if name in tensors:
            tensors[name] = edit(tensors[name].clone())
            save_file(tensors, path, metadata={"format": "pt"})
            return
    raise KeyError(name)


def _exact_modules(src: Path, out: Path, modules: list[str], fmt: str) -> list[str]:
    return [m for m in modules if np.array_equal(mx_decode(*source_linear(src, m)), nv_decode(*_out_tensors(out, m, fmt)))]


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """A compressed-tensors MXFP4 MoE (two experts; expert 1's gate lossy) converted to both forms."""
    root = tmp_path_factory.mktemp("check")
    src = moe_checkpoint(root / "src", CT, "w", experts=2, lossy={(1, "gate"): 2}, seed=4)
    outs = {fmt: root / fmt for fmt in (CT, "modelopt")}
    for fmt, out in outs.items():
        fp4pass.checkpoint.convert(src, out, format=fmt)
    modules = [m for e in expert_modules("w", 2) for m in e]
    return src, outs, modules


@pytest.mark.parametrize("fmt", [CT, "modelopt"])
def test_a_good_output_passes_with_every_expert_counted(moe, fmt):
    src, outs, modules = moe
    result = _check(src, outs[fmt], fmt)
    assert result["passed"] and result["failures"] == [] and result["decoded_in_float64"] == []
    assert result["experts_checked"] == len(modules) == 6
    exact = _exact_modules(src, outs[fmt], modules, fmt)
    lossy_gate = expert_modules("w", 2)[1][0]
    assert lossy_gate not in exact and len(exact) == 5  # the oracle's own count, not the converter's
    assert result["experts_identical"] == len(exact)
    assert result["reader"] == "compressed-tensors NVFP4PackedCompressor" + (
        " via ModelOptNvfp4Converter" if fmt == "modelopt" else "")


def _first_nonzero(codes: np.ndarray, row: int) -> int:
    """The first element of ``row`` whose E2M1 magnitude is neither 0 nor 6 (so one step up stays in range)."""
    nibbles = np.stack((codes[row] & 0x0F, codes[row] >> 4), axis=-1).reshape(-1)
    return int(np.flatnonzero(((nibbles & 7) != 0) & ((nibbles & 7) != 7))[0])


def _bump(out: Path, module: str, fmt: str, row: int, col: int) -> None:
    """The element (row, col) of ``module`` one E2M1 magnitude step up (e.g. 1.0 -> 1.5), in place."""
    name = f"{module}.weight_packed" if fmt == CT else f"{module}.weight"

    def edit(t):
        b = t.view(torch.uint8)
        shift = 4 * (col % 2)
        b[row, col // 2] = int(b[row, col // 2]) + (1 << shift)
        return t
    _edit(out, name, edit)


@pytest.mark.parametrize("fmt", [CT, "modelopt"])
def test_one_value_off_in_an_exact_expert_is_named_with_its_place_and_values(moe, tmp_path, fmt):
    """An expert within the lossless spread must decode to its source exactly: one value one step off (an error
    far below plain requantization's) fails it, naming the first wrong element and both values."""
    src, outs, _ = moe
    out = tmp_path / "out"
    shutil.copytree(outs[fmt], out)
    down = expert_modules("w", 2)[0][2]
    codes, _, _ = _out_tensors(out, down, fmt)
    row, col = 3, _first_nonzero(codes, 3)
    _bump(out, down, fmt, row, col)
    x = mx_decode(*source_linear(src, down))
    y = nv_decode(*_out_tensors(out, down, fmt))
    assert list(zip(*np.nonzero(x != y))) == [(row, col)]
    assert ((y - x) ** 2).sum() < requant_sse(x) / 10  # the requantization bound alone would let it pass
    result = _check(src, out, fmt)
    assert not result["passed"]
    assert [f["expert"] for f in result["failures"]] == [down]
    assert result["failures"][0]["reason"] == (f"spread {_spread(src, expert_modules('w', 2)[0][2:])} <= 17 but "
                                               f"value at {[row, col]} is {float(y[row, col])!r}, source "
                                               f"{float(x[row, col])!r}")
    assert result["experts_checked"] == 6 and result["experts_identical"] == 4


def _spread(src: Path, modules) -> int:
    """Exponent spread over the blocks holding a non-zero value, of the modules sharing one global scale."""
    exps = []
    for m in modules:
        codes, e8m0 = source_linear(src, m)
        held = (mx_decode(codes, e8m0).reshape(*e8m0.shape, 32) != 0).any(-1)
        exps.append(e8m0.astype(np.int64)[held])
    e = np.concatenate(exps)
    return int(e.max() - e.min())


def _edge_source(folder: Path, spread: int) -> Path:
    """One expert whose gate/up pair spans exactly ``spread`` octaves: the gate's block (0, 0) at the bottom,
    (0, 1) at the top, every other block of the pair in between."""
    def gate(codes, e8m0):
        e8m0[0, 0], e8m0[0, 1] = 110, 110 + spread
        codes[0, :32] = 0x53  # 1.5 and 3.0: non-zero in both blocks, one step up stays in range

    return _one_expert(folder, spread, lambda rng, shape: (110 + rng.integers(1, spread, shape)).astype(np.uint8),
                       gate)


def _one_expert(folder: Path, seed: int, draw_scales, edit_gate) -> Path:
    """A compressed-tensors checkpoint of one MXFP4 expert (w1, w3 [32, 64], w2 [64, 32]): random codes, E8M0
    scales from ``draw_scales(rng, shape)``, then ``edit_gate(codes, e8m0)`` on w1's arrays."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for proj, rows, k in (("w1", 32, 64), ("w3", 32, 64), ("w2", 64, 32)):
        codes = rng.integers(0, 256, (rows, k // 2), dtype=np.uint8)
        e8m0 = draw_scales(rng, (rows, k // 32))
        if proj == "w1":
            edit_gate(codes, e8m0)
        tensors[f"{EXPERTS_PREFIX}.0.{proj}.weight_packed"] = torch.from_numpy(codes)
        tensors[f"{EXPERTS_PREFIX}.0.{proj}.weight_scale"] = torch.from_numpy(e8m0)
    tensors["model.layers.0.mlp.gate.weight"] = torch.zeros(1, 64, dtype=torch.bfloat16)
    tensors["lm_head.weight"] = torch.ones(8, 64, dtype=torch.bfloat16)
    config = {"hidden_size": 64,
              "quantization_config": {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized"}}
    return write_checkpoint(folder, tensors, config)


def test_at_the_lossless_spread_a_tiny_error_still_fails(tmp_path):
    """Spread 17 (the largest one NVFP4 holds exactly) is held to exactness: a value of the bottom block one step
    off, an error many orders below plain requantization's, fails the check."""
    src = _edge_source(tmp_path / "src", 17)
    gate, up, _ = (f"{EXPERTS_PREFIX}.0.{p}" for p in ("w1", "w3", "w2"))
    assert _spread(src, [gate, up]) == 17
    out = tmp_path / "out"
    fp4pass.checkpoint.convert(src, out, format=CT)
    assert _exact_modules(src, out, [gate, up], CT) == [gate, up]
    good = _check(src, out, CT)
    assert good["passed"] and good["experts_identical"] == 3
    _bump(out, gate, CT, 0, 0)  # 1.5 -> 2.0 at the bottom block
    x, y = mx_decode(*source_linear(src, gate)), nv_decode(*_out_tensors(out, gate, CT))
    assert list(zip(*np.nonzero(x != y))) == [(0, 0)]
    assert 0 < ((y - x) ** 2).sum() < requant_sse(x) * 1e-6
    bad = _check(src, out, CT)
    assert [f["expert"] for f in bad["failures"]] == [gate] and "spread 17 <= 17" in bad["failures"][0]["reason"]


def _requant_sse64(x: np.ndarray) -> float:
    """SSE of plain NVFP4 quantization of ``x`` [N, K] in float64 throughout (ModelOpt's formulas: global scale
    amax / (6 * 448), E4M3 block scales, E2M1 codes; ml_dtypes rounds each), valid over float64's whole range."""
    import ml_dtypes

    amax = float(np.abs(x).max())
    g = amax / 2688.0
    blocks = x.reshape(x.shape[0], -1, 16)
    s = np.clip(np.abs(blocks).max(-1) / (6.0 * g), 2.0**-9, 448.0)
    full = (s.astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * g)[..., None]
    q = np.clip(blocks / full, -6, 6).astype(ml_dtypes.float4_e2m1fn).astype(np.float64)
    return float((((q * full).reshape(x.shape) - x) ** 2).sum())


def _extreme_source(folder: Path, low: int, high: int) -> Path:
    """One expert; its gate/up pair at E8M0 codes ``high - 3 .. high``, the gate's first block of rows 0-3 at
    ``low`` (spread > 17: lossy); its down at ``high - 3 .. high`` too."""
    def gate(_codes, e8m0):
        e8m0[:4, 0] = low

    return _one_expert(folder, low, lambda rng, shape: rng.integers(high - 3, high + 1, shape).astype(np.uint8),
                       gate)


def _scale_global(out: Path, module: str, fmt: str, factor: float) -> None:
    """Every decoded value of ``module`` times ``factor`` (its global multiplier times it; compressed-tensors'
    divisor divided by it)."""
    if fmt == CT:
        _edit(out, f"{module}.weight_global_scale", lambda t: (t.double() / factor).float())
    else:
        _edit(out, f"{module}.weight_scale_2", lambda t: (t.double() * factor).float())


def _pair_sse(src: Path, out: Path, pair, fmt: str, factor: float = 1.0) -> float:
    """Squared error of the pair's decode (its global multiplier times ``factor``) against its source, summed."""
    total = 0.0
    for module in pair:
        codes, e4m3, multiplier = _out_tensors(out, module, fmt)
        y = nv_decode(codes, e4m3, float(np.float32(multiplier * factor)))
        total += float(((y - mx_decode(*source_linear(src, module))) ** 2).sum())
    return total


def _factor_for(src: Path, out: Path, pair, fmt: str, target: float) -> float:
    """A factor on the pair's global multiplier that makes the pair's squared error ``target`` (bisection; the
    error grows with the factor from 1 on, for these weights)."""
    lo, hi = 1.0, 4.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _pair_sse(src, out, pair, fmt, mid) < target else (lo, mid)
    return lo


CASES = {"float32 range": (None, None), "up to 6 * 2^127": (230, 254), "down to 2^-126": (1, 30)}


@pytest.mark.parametrize("fmt", [CT, "modelopt"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_lossy_pair_half_again_worse_than_plain_requantization_fails(moe, tmp_path, fmt, case):
    """A lossy w1/w3 pair is held to plain requantization's squared error under one global scale from the pair's
    joint amax, summed over both (the baseline, measured here in float64 over the whole range): its output as
    written passes; the same with both halves' global scale times one factor, so that the pair's error is 1.5
    times the baseline, fails, naming the pair, where compressed-tensors decodes (float32 range) and where the
    check decodes in float64 itself (values past float32's largest or below its normal range)."""
    low, high = CASES[case]
    if low is None:
        src, outs, _ = moe
        pair = expert_modules("w", 2)[1][:2]
        out = tmp_path / "out"
        shutil.copytree(outs[fmt], out)
    else:
        src = _extreme_source(tmp_path / "src", low, high)
        pair = (f"{EXPERTS_PREFIX}.0.w1", f"{EXPERTS_PREFIX}.0.w3")
        out = tmp_path / "out"
        fp4pass.checkpoint.convert(src, out, format=fmt)
    module = pair[0]
    x = mx_decode(*source_linear(src, module))
    baseline = _requant_sse64(np.concatenate([x, mx_decode(*source_linear(src, pair[1]))]))
    written = _pair_sse(src, out, pair, fmt)
    assert 0 < written <= baseline * 1.01
    good = _check(src, out, fmt)
    assert good["passed"], good["failures"]
    why = {d["expert"]: d["why"] for d in good["decoded_in_float64"]}
    assert (module in why) == (low is not None)
    if high == 254:
        assert why[module] == (f"source values up to {np.abs(x).max():.6g} (E8M0 codes near 254): "
                               "compressed-tensors' float32/bf16 overflows")
    elif low is not None:
        held = np.abs(x)[x != 0]
        assert why[module] == (f"source values down to {held.min():.6g} (E8M0 codes near 0): below float32's normal "
                               "range, where compressed-tensors' float32/bf16 loses them")
    factor = _factor_for(src, out, pair, fmt, 1.5 * baseline)
    for m in pair:
        _scale_global(out, m, fmt, factor)
    assert 1.4 < _pair_sse(src, out, pair, fmt) / baseline < 1.6
    bad = _check(src, out, fmt)
    assert [f["expert"] for f in bad["failures"]] == [f"{EXPERTS_PREFIX}.{1 if low is None else 0}.w1+w3"]
    assert "above plain requantization" in bad["failures"][0]["reason"]


def test_every_expert_of_a_gpt_oss_stack_is_checked_and_a_wrong_one_named(tmp_path):
    """ModelOpt's gpt-oss stacks ([E, K/2, N] codes, [E, K/16, N] block scales, one multiplier): every expert
    of both stacks counted; one value of expert 0 (the first: no expert may be skipped) one step off fails the
    check naming ``stack[0]``, and the same in the last expert names ``stack[E-1]``."""
    src = moe_checkpoint(tmp_path / "src", "gpt-oss", experts=3, seed=7)
    out = tmp_path / "out"
    fp4pass.checkpoint.convert(src, out)
    stack = f"{EXPERTS_PREFIX}.gate_up_proj"
    f = Folder(src)
    blocks = as_bytes(f.get(f"{stack}_blocks"))
    src_codes, src_e8m0 = blocks.reshape(*blocks.shape[:2], -1), as_bytes(f.get(f"{stack}_scales"))
    o = Folder(out)
    codes, e4m3 = as_bytes(o.get(stack)), as_bytes(o.get(f"{stack}_weight_scale"))
    multiplier = float(o.get(f"{stack}_weight_scale_2").double())
    exact = sum(np.array_equal(mx_decode(src_codes[e], src_e8m0[e]), nv_decode(codes[e].T, e4m3[e].T, multiplier))
                for e in range(3))
    assert exact == 3  # and the down stack, by the same oracle:
    down = f"{EXPERTS_PREFIX}.down_proj"
    d_blocks, d_e8m0 = as_bytes(f.get(f"{down}_blocks")), as_bytes(f.get(f"{down}_scales"))
    d_codes, d_e4m3 = as_bytes(o.get(down)), as_bytes(o.get(f"{down}_weight_scale"))
    d_mult = float(o.get(f"{down}_weight_scale_2").double())
    assert all(np.array_equal(mx_decode(d_blocks[e].reshape(d_blocks.shape[1], -1), d_e8m0[e]),
                              nv_decode(d_codes[e].T, d_e4m3[e].T, d_mult)) for e in range(3))
    good = _check(src, out, "modelopt")
    assert good["passed"] and good["experts_checked"] == 6 and good["experts_identical"] == 6
    for e in (0, 2):
        bad_dir = tmp_path / f"bad{e}"
        shutil.copytree(out, bad_dir)
        col = _first_nonzero(codes[e].T.copy(), 1)  # in row 1 of expert e, in [N, K/2] order

        def bump(t, e=e, col=col):
            b = t.view(torch.uint8)  # [E, K/2, N]: element (n=1, k=col) sits at byte [e, col // 2, 1]
            b[e, col // 2, 1] = int(b[e, col // 2, 1]) + (1 << (4 * (col % 2)))
            return t
        _edit(bad_dir, stack, bump)
        bad = _check(src, bad_dir, "modelopt")
        assert [x["expert"] for x in bad["failures"]] == [f"{stack}[{e}]"]
        assert f"value at {[1, col]}" in bad["failures"][0]["reason"]


def _nan_block_scale(out: Path, module: str) -> None:
    """One E4M3 block scale of ``module`` set to 0x7F (NaN)."""
    def edit(t):
        t.view(torch.uint8)[5, 1] = 0x7F
        return t
    _edit(out, f"{module}.weight_scale", edit)


@pytest.mark.parametrize("fmt", [CT, "modelopt"])
def test_a_lossy_expert_decoding_to_nan_fails(moe, tmp_path, fmt):
    """A NaN compares false with every bound: a lossy expert (held to the requantization bound, not exactness)
    whose output holds a NaN block scale must still fail."""
    src, outs, _ = moe
    module = expert_modules("w", 2)[1][0]
    out = tmp_path / "out"
    shutil.copytree(outs[fmt], out)
    _nan_block_scale(out, module)
    assert np.isnan(nv_decode(*_out_tensors(out, module, fmt))).any()
    result = _check(src, out, fmt)
    assert [f["expert"] for f in result["failures"]] == [module] and "not finite" in result["failures"][0]["reason"]
    assert result["decoded_in_float64"] == [{"expert": module, "why": "compressed-tensors' decode is not finite"}]


def _uniform_source(folder: Path, low: int, high: int, zero_down: bool = False) -> Path:
    """One expert, every E8M0 code drawn from ``low .. high``; ``zero_down``: the down projection all zeros."""
    rng = np.random.default_rng(low + high)
    tensors = {}
    for proj, rows, k in (("w1", 32, 64), ("w3", 32, 64), ("w2", 64, 32)):
        codes = rng.integers(0, 256, (rows, k // 2), dtype=np.uint8)
        if zero_down and proj == "w2":
            codes[:] = 0
        tensors[f"{EXPERTS_PREFIX}.0.{proj}.weight_packed"] = torch.from_numpy(codes)
        tensors[f"{EXPERTS_PREFIX}.0.{proj}.weight_scale"] = torch.from_numpy(
            rng.integers(low, high + 1, (rows, k // 32)).astype(np.uint8))
    tensors["lm_head.weight"] = torch.ones(8, 64, dtype=torch.bfloat16)
    config = {"hidden_size": 64,
              "quantization_config": {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized"}}
    return write_checkpoint(folder, tensors, config)


def test_requant_holds_an_all_zero_expert_to_its_bound_and_fails_it_on_nan(tmp_path):
    """``--method requant`` promises no exact expert: every one is compared with plain requantization, an all-zero
    one too (a bound of 0, met by the zeros written); with a NaN block scale planted it fails, as a failure of
    that expert, not an error of the check."""
    src = _uniform_source(tmp_path / "src", 110, 120, zero_down=True)
    down = f"{EXPERTS_PREFIX}.0.w2"
    out = tmp_path / "out"
    fp4pass.checkpoint.convert(src, out, format=CT)
    assert not nv_decode(*_out_tensors(out, down, CT)).any()
    good = _check(src, out, CT, "requant")
    assert good["passed"] and good["experts_identical"] == 3 and good["exact_up_to_spread"] == -1
    _nan_block_scale(out, down)
    bad = _check(src, out, CT, "requant")
    assert [f["expert"] for f in bad["failures"]] == [down] and "not finite" in bad["failures"][0]["reason"]


def test_requant_bound_of_an_expert_below_float32s_normal_range(tmp_path):
    """An expert whose values all lie below 6 * 2^-119 (E8M0 codes 1 to 8): plain requantization's global scale
    (amax / 2688) is below float32's normal range, so the check's baseline is computed on the values scaled up
    by a power of two; the output as written meets it (and decodes exactly, by the oracle)."""
    src = _uniform_source(tmp_path / "src", 1, 8)
    out = tmp_path / "out"
    fp4pass.checkpoint.convert(src, out, format=CT)
    modules = [f"{EXPERTS_PREFIX}.0.{p}" for p in ("w1", "w3", "w2")]
    assert _exact_modules(src, out, modules, CT) == modules
    result = _check(src, out, CT, "requant")
    assert result["passed"] and result["experts_identical"] == 3
    assert [d["expert"] for d in result["decoded_in_float64"]] == modules


def _expert_source(folder: Path, weights: dict) -> Path:
    """One expert from ``weights`` {"w1" | "w3" | "w2": (codes uint8 [N, K/2], E8M0 bytes [N, K/32])}."""
    tensors = {}
    for proj, (codes, e8m0) in weights.items():
        tensors[f"{EXPERTS_PREFIX}.0.{proj}.weight_packed"] = torch.from_numpy(np.ascontiguousarray(codes))
        tensors[f"{EXPERTS_PREFIX}.0.{proj}.weight_scale"] = torch.from_numpy(np.ascontiguousarray(e8m0))
    tensors["lm_head.weight"] = torch.ones(8, 64, dtype=torch.bfloat16)
    config = {"hidden_size": 64,
              "quantization_config": {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized"}}
    return write_checkpoint(folder, tensors, config)


def _draw(rng, rows: int, k: int, low: int, high: int) -> tuple[np.ndarray, np.ndarray]:
    return (rng.integers(0, 256, (rows, k // 2), dtype=np.uint8),
            rng.integers(low, high + 1, (rows, k // 32)).astype(np.uint8))


def test_blocks_holding_only_zeros_do_not_widen_the_spread(tmp_path):
    """The spread is taken over the blocks that hold a non-zero value: a block of +0 and one of -0 (code 8) at
    exponents 40 octaves apart leave the gate exact, so a value one step off still fails it; a block whose only
    non-zero values are even elements (low nibbles) counts, and 30 octaves below the rest makes the gate lossy."""
    rng = np.random.default_rng(11)
    gate, up, down = (_draw(rng, 32, 64, 110, 120), _draw(rng, 32, 64, 110, 120), _draw(rng, 64, 32, 110, 120))
    gate[0][1, :16], gate[1][1, 0] = 0x88, 150  # -0 everywhere, far above
    gate[0][2, :16], gate[1][2, 0] = 0x00, 60  # +0 everywhere, far below
    gate[1][5, 0] = 110  # the bottom: where a value one step off is smallest
    src = _expert_source(tmp_path / "src", {"w1": gate, "w3": up, "w2": down})
    modules = [f"{EXPERTS_PREFIX}.0.{p}" for p in ("w1", "w3", "w2")]
    out = tmp_path / "out"
    fp4pass.checkpoint.convert(src, out, format=CT)
    assert _spread(src, modules[:2]) <= 17 and _exact_modules(src, out, modules, CT) == modules
    assert _check(src, out, CT)["experts_identical"] == 3
    col = _first_nonzero(_out_tensors(out, modules[0], CT)[0], 5)
    assert col < 32
    _bump(out, modules[0], CT, 5, col)
    x, y = mx_decode(*source_linear(src, modules[0])), nv_decode(*_out_tensors(out, modules[0], CT))
    assert ((y - x) ** 2).sum() < requant_sse(x) / 10
    assert [f["expert"] for f in _check(src, out, CT)["failures"]] == [modules[0]]

    gate[0][3, :16], gate[1][3, 0] = 0x01, 80  # 0.5 at every even element, 30 octaves below
    lossy = _expert_source(tmp_path / "lossy", {"w1": gate, "w3": up, "w2": down})
    out = tmp_path / "lossy-out"
    fp4pass.checkpoint.convert(lossy, out, format=CT)
    assert _spread(lossy, modules[:2]) == 40 and modules[0] not in _exact_modules(lossy, out, modules, CT)
    result = _check(lossy, out, CT)
    assert result["passed"], result["failures"]


def test_float64_decoding_starts_at_2_to_127_and_below_2_to_minus_126(tmp_path):
    """Decoded here in float64: an expert whose largest magnitude reaches 2^127 (E8M0 code 254 times 1.0), and
    one holding a magnitude below 2^-126 (code 1 times 0.5); not one whose largest is just below 2^127, nor one
    whose smallest is exactly 2^-126."""
    rng = np.random.default_rng(12)
    gate, up, down = (_draw(rng, 32, 64, 238, 250), _draw(rng, 32, 64, 238, 250), _draw(rng, 64, 32, 238, 250))
    gate[0][0, :16], gate[1][0, 0] = 0x12, 254  # 1.0 and 0.5: the largest is exactly 2^127
    high = _expert_source(tmp_path / "high", {"w1": gate, "w3": up, "w2": down})
    gate, up, down = (_draw(rng, 32, 64, 2, 12), _draw(rng, 32, 64, 2, 12), _draw(rng, 64, 32, 2, 12))
    for codes, e8m0 in (gate, up, down):  # code 2 times 0.5 is 2^-126: every magnitude from there up
        codes[(e8m0 == 2).repeat(16, axis=1) & ((codes & 0x07) == 1)] &= 0xF0
        codes[(e8m0 == 2).repeat(16, axis=1) & ((codes & 0x70) == 0x10)] &= 0x0F
    gate[0][0, :16], gate[1][0, 0] = 0x24, 1  # 2.0 and 1.0 times 2^-126: the smallest exactly 2^-126
    down[0][0, :16], down[1][0, 0] = 0x21, 1  # 0.5 times 2^-126 = 2^-127
    low = _expert_source(tmp_path / "low", {"w1": gate, "w3": up, "w2": down})
    modules = [f"{EXPERTS_PREFIX}.0.{p}" for p in ("w1", "w3", "w2")]
    for src, listed in ((high, modules[:1]), (low, modules[2:])):
        x = {m: np.abs(mx_decode(*source_linear(src, m))) for m in modules}
        assert [m for m in modules if x[m].max() >= 2.0**127 or x[m][x[m] > 0].min() < 2.0**-126] == listed
        out = src.with_name(src.name + "-out")
        fp4pass.checkpoint.convert(src, out, format=CT)
        result = _check(src, out, CT)
        assert result["passed"] and result["experts_identical"] == 3, result
        assert [d["expert"] for d in result["decoded_in_float64"]] == listed


def _reader_decode(packed: torch.Tensor, scale: torch.Tensor, divisor: torch.Tensor) -> np.ndarray:
    """compressed-tensors' own decode (NVFP4PackedCompressor.decompress) of one NVFP4 weight, as float64."""
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import preset_name_to_scheme

    weight = NVFP4PackedCompressor.decompress(
        {"weight_packed": packed, "weight_scale": scale, "weight_global_scale": divisor.reshape(1).float()},
        preset_name_to_scheme("NVFP4A16", ["Linear"]))["weight"]
    return weight.double().numpy()


def test_the_bound_is_plain_requantization_as_the_reader_decodes_it(moe, tmp_path):
    """``--method requant`` writes plain requantization itself: its error, as compressed-tensors decodes it (in
    bf16), summed over the w1/w3 pair that shares its global scale, is the bound, and the output passes; one
    value of w1 one step off, which puts the reader's error of the pair 0.3% to 2% above the bound (past its 0.1%
    slack), fails. (Plain requantization's error computed in float64 is a few percent larger than the reader's on
    these weights: a bound computed that way would let it pass.)"""
    src = moe[0]
    module, up = expert_modules("w", 2)[1][:2]
    out = tmp_path / "out"
    fp4pass.checkpoint.convert(src, out, format=CT, method="requant")
    assert _check(src, out, CT, "requant")["passed"]
    f = Folder(out)

    def written(m: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return f.get(f"{m}.weight_packed"), f.get(f"{m}.weight_scale"), f.get(f"{m}.weight_global_scale")

    x = mx_decode(*source_linear(src, module))
    up_sse = float(((_reader_decode(*written(up)) - mx_decode(*source_linear(src, up))) ** 2).sum())
    packed, scale, divisor = written(module)
    bound = float(((_reader_decode(packed, scale, divisor) - x) ** 2).sum()) + up_sse
    for row, col in ((r, c) for r in range(packed.shape[0]) for c in range(0, 2 * packed.shape[1], 2)):
        if packed[row, col // 2] & 0x07 in (0, 7):
            continue
        bumped = packed.clone()
        bumped[row, col // 2] += 1  # the even element one E2M1 magnitude step up
        ratio = (float(((_reader_decode(bumped, scale, divisor) - x) ** 2).sum()) + up_sse) / bound
        if 1.003 < ratio < 1.02:
            break
    else:
        raise AssertionError("no element whose step lands between the bounds")
    _bump(out, module, CT, row, col)
    result = _check(src, out, CT, "requant")
    assert [f["expert"] for f in result["failures"]] == [f"{EXPERTS_PREFIX}.1.w1+w3"]


def test_check_without_compressed_tensors_is_a_usage_error_naming_the_extra(moe, tmp_path, monkeypatch, capsys):
    """Without compressed-tensors installed, ``convert --check`` stops with exit 2, naming --check and the extra
    that installs it, and writes nothing."""
    from fp4pass.cli import main

    monkeypatch.setitem(sys.modules, "compressed_tensors", None)  # what importing a missing package raises
    out = tmp_path / "out"
    assert main(["convert", str(moe[0]), "-o", str(out), "--check", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "--check needs compressed-tensors, which is not installed: pip install 'fp4pass[checkpoint]'" in err
    assert not out.exists() and not list(tmp_path.iterdir())
