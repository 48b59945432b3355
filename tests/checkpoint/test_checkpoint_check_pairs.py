"""``convert --check`` on w1/w3 pairs that share one global scale: the bound is the pair's, not each tensor's.

Engines load w1 and w3 of an expert as one fused weight with one global scale (w1's), so the converter gives the
pair one scale, taken over both. A w3 whose range is small beside its w1 cannot meet its own plain
requantization's error under that scale, so the check holds the pair to plain requantization under one scale
from the pair's joint amax, summed over both halves.

The sources here are per-expert MXFP4 checkpoints of two families (DeepSeek-V4's native ``layers.L.ffn.experts.E
.wN.weight`` / ``.scale``, Kimi's compressed-tensors ``model.layers.L.mlp.experts.E.wN.weight_packed`` /
``.weight_scale``), 12 experts each, every w1 spanning 27 octaves and every w3 8:

- even experts: w3 sits low inside w1's range (the pair's amax is w1's; w3 is far below it);
- odd experts: w3 holds the pair's amax (w1 tops out 3 octaves below it).

The bound is computed here by compressed-tensors' own NVFP4 quantization (``generate_gparam`` for the global
scale from the pair's amax, ``calculate_qparams`` for the E4M3 block scales, ``fake_quantize``), the output's
error by numpy + ml_dtypes (tests/support/checkpoint_oracles.py); never by fp4pass's code.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from checkpoint_oracles import Folder, as_bytes, mx_decode, nv_decode, source_linear, write_checkpoint
from cli_helpers import nothing_left, run_cli

import fp4pass.checkpoint
from fp4pass.checkpoint import engine
from fp4pass.safetensors.catalog import Catalog
from fp4pass.checkpoint.detect import detect
from fp4pass.examples.checkpoints import build_checkpoint

pytest.importorskip("compressed_tensors")

CT = "compressed-tensors"
INPUT_SCALE = 0.0123  # an activation input_scale (amax / 2688), distinct from every weight scale here
EXPERTS = 12
#: family -> (module of expert e's projection p, the MXFP4 tensors' suffixes and dtypes, config.json)
FAMILIES = {
    "deepseek-v4": ("layers.0.ffn.experts.{e}.{p}", {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "n_routed_experts": EXPERTS,
        "expert_dtype": "fp4", "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                                       "weight_block_size": [128, 128]}}),
    "deepseek_v3": ("model.layers.0.mlp.experts.{e}.{p}", {
        "architectures": ["KimiK3ForCausalLM"], "model_type": "kimi_k3", "n_routed_experts": EXPERTS,
        "quantization_config": {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized"}}),
}
#: E8M0 code ranges (inclusive) of each projection relative to the expert's top code T: (low, high)
LAYOUTS = {"w3 low": {"w1": (-27, 0), "w3": (-24, -16), "w2": (-5, 0)},
           "w3 holds the amax": {"w1": (-30, -3), "w3": (-8, 0), "w2": (-5, 0)}}


def _layout(e: int) -> dict:
    return LAYOUTS["w3 low" if e % 2 == 0 else "w3 holds the amax"]


def _module(family: str, e: int, proj: str) -> str:
    return FAMILIES[family][0].format(e=e, p=proj)


def _pair(family: str, e: int) -> tuple[str, str]:
    return _module(family, e, "w1"), _module(family, e, "w3")


def build_pairs(folder: Path, family: str, seed: int = 0) -> Path:
    """The family's checkpoint: expert e's top code T = 125 - e % 4; each projection's E8M0 codes drawn from its
    layout's range, with the range's two ends both present in blocks that hold values 4 or 6 (so the spread
    over held blocks is the range's: 27 for w1, 8 for w3)."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for e in range(EXPERTS):
        top = 125 - e % 4
        for proj, rows, k in (("w1", 32, 64), ("w2", 64, 32), ("w3", 32, 64)):
            low, high = (top + d for d in _layout(e)[proj])
            codes = rng.integers(0, 256, (rows, k // 2), dtype=np.uint8)
            e8m0 = rng.integers(low, high + 1, (rows, k // 32)).astype(np.uint8)
            e8m0[0, 0], e8m0[1, 0] = low, high
            codes[:2, :16] |= 0x66  # every element of those two blocks 4 or 6 in magnitude
            module = _module(family, e, proj)
            if family == "deepseek_v3":
                tensors[f"{module}.weight_packed"] = torch.from_numpy(codes)
                tensors[f"{module}.weight_scale"] = torch.from_numpy(e8m0)
            else:
                tensors[f"{module}.weight"] = torch.from_numpy(codes).view(torch.int8)
                tensors[f"{module}.scale"] = torch.from_numpy(e8m0).view(torch.float8_e8m0fnu)
    tensors["lm_head.weight"] = torch.ones(8, 64, dtype=torch.bfloat16)
    return write_checkpoint(folder, tensors, {"hidden_size": 64, **FAMILIES[family][1]})


def ct_requant_sse(xs: list[np.ndarray], amax: float | None = None) -> list[float]:
    """Squared error of each of ``xs`` under compressed-tensors' own NVFP4 quantization of them all with ONE global
    scale from their joint amax, or from ``amax`` (``generate_gparam``: 448 * 6 / amax, a divisor), E4M3 block
    scales of 16 (``calculate_qparams``) and E2M1 values (``fake_quantize``), in float64 against the exact source
    values."""
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    args = preset_name_to_scheme("NVFP4A16", ["Linear"]).weights
    x = torch.from_numpy(np.concatenate(xs)).float()  # MXFP4 values: exact in float32
    divisor = generate_gparam(x.min(), x.max()) if amax is None else generate_gparam(torch.tensor(-amax),
                                                                                     torch.tensor(amax))
    blocks = x.reshape(x.shape[0], -1, 16)
    scale, zero = calculate_qparams(blocks.amin(-1), blocks.amax(-1), args, global_scale=divisor)
    y = fake_quantize(x, scale, zero, args, global_scale=divisor).double().numpy()
    ends = np.cumsum([len(m) for m in xs])
    return [float(((part - m) ** 2).sum()) for part, m in zip(np.split(y, ends[:-1]), xs)]


def _written(out: Path, module: str, fmt: str) -> np.ndarray:
    """float64 decode of one Linear of the output (codes, E4M3 block scales, the global scale as written)."""
    f = Folder(out)
    if fmt == CT:
        multiplier = 1.0 / float(f.get(f"{module}.weight_global_scale").double().reshape(()))
        return nv_decode(as_bytes(f.get(f"{module}.weight_packed")), as_bytes(f.get(f"{module}.weight_scale")),
                         multiplier)
    return nv_decode(as_bytes(f.get(f"{module}.weight")), as_bytes(f.get(f"{module}.weight_scale")),
                     float(f.get(f"{module}.weight_scale_2").double()))


def _errors(src: Path, out: Path, pair, fmt: str) -> list[float]:
    return [float(((_written(out, m, fmt) - mx_decode(*source_linear(src, m))) ** 2).sum()) for m in pair]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("pairs")
    return {family: build_pairs(root / family, family, seed=i) for i, family in enumerate(FAMILIES)}


@pytest.fixture(scope="module")
def converted(sources, tmp_path_factory):
    """(family, method, format) -> (output folder, report) of ``convert(..., check=True)`` (``convert --check``);
    a failed check raises CheckFailed here. W4A4 (DeepSeek-V4's FP8 config form has no weight-only variant)."""
    root = tmp_path_factory.mktemp("converted")
    outs = {}
    for family, src in sources.items():
        for method in ("auto", "requant"):
            for fmt in (CT, "modelopt"):
                out = root / f"{family}-{method}-{fmt}"
                outs[family, method, fmt] = out, fp4pass.checkpoint.convert(src, out, format=fmt, method=method,
                                                                            check=True, input_scale=INPUT_SCALE)
    return outs


def test_the_sources_have_the_spreads_and_the_amax_where_the_layouts_say(sources):
    for family, src in sources.items():
        for e in range(EXPERTS):
            spreads = []
            for module in _pair(family, e):
                codes, e8m0 = source_linear(src, module)
                held = (mx_decode(codes, e8m0).reshape(*e8m0.shape, 32) != 0).any(-1)
                spreads.append(int(np.ptp(e8m0[held].astype(int))))
            assert spreads == [27, 8]
            w1, w3 = (np.abs(mx_decode(*source_linear(src, m))).max() for m in _pair(family, e))
            assert (w3 > w1) == (e % 2 == 1)


@pytest.mark.parametrize("fmt", [CT, "modelopt"])
@pytest.mark.parametrize("method", ["auto", "requant"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_correct_conversion_of_pairs_sharing_a_scale_passes_the_check(sources, converted, family, method, fmt):
    """``convert --check`` passes, where each tensor's own bound would refuse it: by the
    oracle, every pair's error is within compressed-tensors' requantization under the pair's scale, while the w3
    of each "w3 low" expert is more than 10% above its own requantization's (1.2 to 490 times)."""
    src = sources[family]
    out, report = converted[family, method, fmt]
    assert report["check"]["passed"] and report["check"]["experts_checked"] == 3 * EXPERTS
    above_own = 0
    for e in range(EXPERTS):
        pair = _pair(family, e)
        xs = [mx_decode(*source_linear(src, m)) for m in pair]
        errors = _errors(src, out, pair, fmt)
        assert sum(errors) <= sum(ct_requant_sse(xs)) * 1.01, (pair, errors)
        above_own += errors[1] > 1.1 * ct_requant_sse(xs[1:])[0]
    assert above_own >= EXPERTS // 2  # every "w3 low" expert at least


def test_the_command_passes_requant_of_a_deepseek_v4_pair_far_below_its_w1(sources, tmp_path, capsys):
    """What was refused (exit 1, nothing written) when each tensor had its own bound: ``fp4pass convert
    DeepSeek-V4 --method requant --check`` exits 0, writes OUT_DIR and says the check passed."""
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "convert", sources["deepseek-v4"], "-o", out, "--format", CT, "--method",
                           "requant", "--check")  # a passed check is info: under --quiet it is not printed
    assert code == 0, err
    assert (f"check PASSED: {3 * EXPERTS} experts compared with their MXFP4 source, 0 identical, the rest within "
            "plain requantization's error") in err
    assert (out / "config.json").is_file()


def _check(src: Path, out: Path, fmt: str, method: str = "auto") -> dict:
    from fp4pass.checkpoint.check import check_checkpoint

    catalog = Catalog.open(src)
    try:
        return check_checkpoint(catalog, detect(catalog.tensors, catalog.config), out, fmt, method)
    finally:
        catalog.close()


def _halve_largest(e4m3: torch.Tensor) -> None:
    """The largest E4M3 block scale (bytes, in place) one binade down: its code minus 8, exactly half its value
    (every normal E4M3 code from 0x10 up)."""
    raw = e4m3.view(torch.uint8)
    row, block = np.unravel_index(int(raw.numpy().argmax()), tuple(raw.shape))
    assert 0x10 <= int(raw[row, block]) <= 0x7E
    raw[row, block] -= 8


def _halve_block_scale(out: Path, module: str) -> None:
    """The largest block scale of ``module`` in the output halved (:func:`_halve_largest`), in place."""
    from safetensors.torch import load_file, save_file

    name = f"{module}.weight_scale"
    for path in sorted(out.glob("*.safetensors")):
        tensors = load_file(path)
        if name in tensors:
            _halve_largest(tensors[name])
            save_file(tensors, path, metadata={"format": "pt"})
            return
    raise KeyError(name)


@pytest.mark.parametrize("fmt", [CT, "modelopt"])
@pytest.mark.parametrize("family,expert", [("deepseek-v4", 11), ("deepseek_v3", 1)])
def test_a_pair_worse_than_requantization_under_its_scale_fails_naming_expert_and_pair(sources, converted, tmp_path,
                                                                                       family, expert, fmt):
    """The largest block scale of w3 halved (one E4M3 binade down) in a correct output: by the oracle the pair's
    error is then above compressed-tensors' requantization under the pair's scale, while w1's alone is untouched;
    the check fails that pair alone, named with its expert (``experts.1`` is not ``experts.10`` or ``.11``), with
    both halves' errors and the bound, each within 5% of the oracle's (the check decodes through the reader)."""
    src = sources[family]
    out = shutil.copytree(converted[family, "auto", fmt][0], tmp_path / "out")
    pair = _pair(family, expert)
    before = _errors(src, out, pair, fmt)
    _halve_block_scale(out, pair[1])
    after = _errors(src, out, pair, fmt)
    bound = sum(ct_requant_sse([mx_decode(*source_linear(src, m)) for m in pair]))
    assert after[0] == before[0] and sum(after) > 1.5 * bound
    result = _check(src, out, fmt)
    parent = pair[0].rpartition(".")[0]
    assert [f["expert"] for f in result["failures"]] == [f"{parent}.w1+w3"]
    reason = result["failures"][0]["reason"]
    figures = re.fullmatch(r"SSE (\S+) \(w1 (\S+), w3 (\S+)\) above plain requantization's (\S+) under the "
                           r"global scale the pair shares", reason)
    assert figures, reason
    total, w1, w3, said_bound = (float(v) for v in figures.groups())
    np.testing.assert_allclose([total, w1, w3, said_bound], [sum(after), *after, bound], rtol=0.05)
    assert result["experts_checked"] == 3 * EXPERTS


def test_convert_check_refuses_a_conversion_worse_than_requantization_and_writes_nothing(sources, tmp_path, capsys,
                                                                                        monkeypatch):
    """A converter that writes the largest block scale of expert 11's w3 halved (a conversion worse than plain
    requantization under the pair's scale): ``convert --check`` exits 1 naming the expert and the pair, and
    OUT_DIR is not written."""
    convert_linears = engine.convert_linears

    def worse(catalog, linears, method, **options):
        conv = convert_linears(catalog, linears, method, **options)
        if linears[-1].module == _module("deepseek_v3", 11, "w3"):
            _halve_largest(conv.scales[1])
        return conv

    monkeypatch.setattr(engine, "convert_linears", worse)
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "convert", sources["deepseek_v3"], "-o", out, "--format", CT, "--check", "--quiet")
    assert code == 1
    assert (f"check FAILED: 1 expert(s), first model.layers.0.mlp.experts.11.w1+w3: SSE " in err
            and f"; {out} not written" in err), err
    nothing_left(out)


@pytest.mark.parametrize("fmt", [CT, "modelopt"])
def test_a_pair_written_with_two_global_scales_fails(sources, converted, tmp_path, fmt):
    """Engines keep w1's global scale for the fused pair: a w3 written with another one (here doubled: every
    value of w3 as written is then read at twice or half its size) fails the pair, naming both scales."""
    src = sources["deepseek-v4"]
    out = shutil.copytree(converted["deepseek-v4", "auto", fmt][0], tmp_path / "out")
    pair = _pair("deepseek-v4", 10)
    field = "weight_global_scale" if fmt == CT else "weight_scale_2"
    name = f"{pair[1]}.{field}"
    from safetensors.torch import load_file, save_file

    path = next(p for p in out.glob("*.safetensors") if name in load_file(p))
    tensors = load_file(path)
    written = float(tensors[name].reshape(()))
    tensors[name] = tensors[name] * 2
    save_file(tensors, path, metadata={"format": "pt"})
    result = _check(src, out, fmt)
    assert result["failures"] == [{"expert": f"{pair[0].rpartition('.')[0]}.w1+w3", "reason": (
        f"the pair is written with different {field}s (w1 {written!r}, w3 {2 * written!r}): engines keep w1's "
        "for both")}]


# -- gpt-oss stacks: ModelOpt's layout has one global scale for every expert of a stack ---------------------------

STACK = "model.layers.0.mlp.experts.gate_up_proj"


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """A gpt-oss layer of 12 experts 5 octaves apart in turn (bases -8 + 5e mod 12), expert 1 lossy: the stack
    spans more than 17 octaves, so its one global scale leaves the low experts far below it; converted with
    ``--check`` by ``auto`` and by ``requant``."""
    root = tmp_path_factory.mktemp("gpt-oss")
    src = build_checkpoint(root / "src", "gpt-oss", layers=1, experts=EXPERTS, hidden=64, intermediate=64, seed=1,
                           lossy_expert=(0, 1), expert_step=5)
    outs = {m: root / m for m in ("auto", "requant")}
    for method, out in outs.items():
        assert fp4pass.checkpoint.convert(src, out, method=method, check=True)["check"]["passed"]
    return src, outs


def _stack_source(src: Path) -> list[np.ndarray]:
    f = Folder(src)
    blocks, e8m0 = as_bytes(f.get(f"{STACK}_blocks")), as_bytes(f.get(f"{STACK}_scales"))
    return [mx_decode(blocks[e].reshape(blocks.shape[1], -1), e8m0[e]) for e in range(EXPERTS)]


def _stack_written(out: Path) -> list[np.ndarray]:
    """Each expert of the stack as written ([K/2, N] codes and [K/16, N] scales per expert, one multiplier)."""
    f = Folder(out)
    codes, e4m3 = as_bytes(f.get(STACK)), as_bytes(f.get(f"{STACK}_weight_scale"))
    multiplier = float(f.get(f"{STACK}_weight_scale_2").double())
    return [nv_decode(codes[e].T.copy(), e4m3[e].T.copy(), multiplier) for e in range(EXPERTS)]


@pytest.mark.parametrize("method", ["auto", "requant"])
def test_each_expert_of_a_stack_is_held_to_requantization_under_the_stacks_scale(gpt_oss, method):
    """Both conversions pass ``--check`` (the fixture): by the oracle each expert's error is within
    compressed-tensors' requantization of that expert under the stack's one scale (from the whole stack's amax),
    and under ``requant`` a low expert is more than 2% above its own requantization (its own amax), the bound
    the check once held it to."""
    src, outs = gpt_oss
    xs = _stack_source(src)
    tops = [np.log2(np.abs(x).max()) for x in xs]
    assert max(tops) - min(tops) >= 10  # the experts' ranges 10 octaves and more apart
    amax = max(float(np.abs(x).max()) for x in xs)
    above_own = 0
    for x, y in zip(xs, _stack_written(outs[method])):
        error = float(((y - x) ** 2).sum())
        assert error <= ct_requant_sse([x], amax)[0] * 1.01
        above_own += error > 1.02 * ct_requant_sse([x])[0]
    assert above_own >= (method == "requant")  # expert 0, 11 octaves below the top: 4.7% above


def test_a_stack_expert_worse_than_requantization_under_the_stacks_scale_fails_alone(gpt_oss, tmp_path):
    """Expert 10's largest block scale halved in the ``requant`` output: by the oracle its error is then above
    requantization under the stack's scale; the check fails it alone, as ``gate_up_proj[10]``."""
    src, outs = gpt_oss
    out = shutil.copytree(outs["requant"], tmp_path / "out")
    from safetensors.torch import load_file, save_file

    path = next(p for p in out.glob("*.safetensors") if f"{STACK}_weight_scale" in load_file(p))
    tensors = load_file(path)
    _halve_largest(tensors[f"{STACK}_weight_scale"][10].t())  # [K/16, N] as [N, K/16]: a view of the same bytes
    save_file(tensors, path, metadata={"format": "pt"})
    xs = _stack_source(src)
    amax = max(float(np.abs(x).max()) for x in xs)
    assert float(((_stack_written(out)[10] - xs[10]) ** 2).sum()) > 1.5 * ct_requant_sse([xs[10]], amax)[0]
    result = _check(src, out, "modelopt", "requant")
    assert [f["expert"] for f in result["failures"]] == [f"{STACK}[10]"]
    assert result["failures"][0]["reason"].endswith("under the stack's global scale")


def test_the_stack_amax_is_read_from_both_nibbles_of_every_byte():
    """The stack's amax, which sets the bound's global scale, is read from the packed bytes without decoding them
    all: equal to the oracle's max |x| where the largest magnitude sits in a high nibble (an odd element), in a
    low one, and where the block of the largest scale holds only small values."""
    from fp4pass.checkpoint.check import _mxfp4_amax

    rng = np.random.default_rng(3)
    for byte, top_scale in ((0xF0, 130), (0x0F, 130), (0x97, 127)):  # -6 high, -6 low, 6 low beside -0.5
        codes = (rng.integers(0, 5, (4, 8, 16)) | (rng.integers(0, 5, (4, 8, 16)) << 4)).astype(np.uint8)
        e8m0 = rng.integers(120, 124, (4, 8, 1)).astype(np.uint8)
        codes[2, 5, 7], e8m0[2, 5, 0] = byte, top_scale
        codes[1, 1, :], e8m0[1, 1, 0] = 0x11, 128  # 0.5 everywhere under the largest scale but one
        expected = np.abs(mx_decode(codes, e8m0)).max()
        assert _mxfp4_amax(codes, e8m0) == expected == 6.0 * 2.0 ** (top_scale - 127)
