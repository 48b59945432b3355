"""``fp4pass diff SRC_DIR NVFP4_DIR``: the activation fake-quant against compressed-tensors' own, planted defects
named at their layer and expert, padding, the command line's exit codes and files. The figures themselves
against an independent forward: tests/checkpoint/test_checkpoint_diff_oracle.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from cli_helpers import cli, one_line
from diff_oracle import ROOT, ct_fake_quant

pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

TOKENS = ROOT / "calib_tokens.npz"
BATCH = 4
def _convert(tmp: Path, name: str, fmt: str, calibrated: bool, method: str = "auto") -> Path:
    import fp4pass.checkpoint

    out = tmp / f"{name}-{fmt}-{'w4a4' if calibrated else 'w4a16'}-{method}"
    scales = fp4pass.checkpoint.calibrate(ROOT / name, TOKENS, batch_size=BATCH, device="cpu") if calibrated else None
    fp4pass.checkpoint.convert(ROOT / name, out, format=fmt, scales=scales, method=method)
    return out


# -- the activation fake-quant against compressed-tensors' own -----------------------------------------------------

def _activations(seed: int, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(48, 64, generator=g) * torch.exp(torch.randn(48, 1, generator=g) * 3)
    x[0, :16] = 0.0  # an all-zero block
    x[1, :16] *= 1e-7  # a block whose scale rounds to 0 in E4M3
    x[2, 16:32] *= 1e4  # blocks that saturate at 448
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(6))
def test_activation_fake_quant_equals_compressed_tensors(seed, dtype):
    from fp4pass.checkpoint.nvfp4_weights import fake_quantize_activation

    x = _activations(seed, dtype)
    amax = float(x.float().abs().max())
    for g in (2688.0 / amax, 2688.0 / amax * 3.7, 2688.0 / amax / 1000.0):
        ours = fake_quantize_activation(x, g)
        assert ours.dtype == dtype
        assert torch.equal(ours, ct_fake_quant(x, g)), g  # compressed-tensors on the float32 input


def test_activation_global_scale_is_used_in_float32_whatever_its_type():
    """A float64 or numpy global scale is rounded to float32 first, as the stored F32 scale and the engines have it."""
    from fp4pass.checkpoint.nvfp4_weights import fake_quantize_activation

    x = _activations(7, torch.float32)
    g = 2688.0 / float(x.abs().max()) * 3.7  # not a float32 number
    want = ct_fake_quant(x, g)
    for given in (g, torch.tensor(g, dtype=torch.float64), np.float64(g), torch.tensor(g, dtype=torch.float32)):
        assert torch.equal(fake_quantize_activation(x, given), want), type(given)


def test_a_stack_or_linear_without_input_scales_has_no_activation_scale():
    from fp4pass.checkpoint.nvfp4_weights import NVExpertStack, NVLinear
    from fp4pass.safetensors.files import TensorEntry

    entry = TensorEntry.__new__(TensorEntry)  # never read: no input scale means nothing to read
    assert NVExpertStack("p", "gate_up_proj", entry, entry, entry, None).activation_scale(None) is None
    assert NVLinear("m", entry, entry, entry, "multiplier").activation_scale(None) is None


def test_decode_fills_the_work_buffer_it_is_given_with_the_same_values():
    """The reused buffer (one per stack, so no fresh pages per expert) is really used, also when it is exactly the
    size needed, and gives what a decode without it gives."""
    from fp4pass.checkpoint.nvfp4_weights import MULTIPLIER, decode_nvfp4

    g = torch.Generator().manual_seed(11)
    codes = torch.randint(0, 256, (24, 32), dtype=torch.uint8, generator=g)
    block = torch.randint(0, 0x7E, (24, 4), dtype=torch.uint8, generator=g)
    scale = torch.tensor(0.37)
    alone = decode_nvfp4(codes, block, scale, MULTIPLIER)
    work = torch.full((24 * 64,), float("nan"))
    out = torch.empty(24, 64, dtype=torch.bfloat16)
    decode_nvfp4(codes, block, scale, MULTIPLIER, out=out, work=work)
    assert torch.isfinite(work).all() and torch.equal(work.view(24, 64), alone)
    assert torch.equal(out, alone.to(torch.bfloat16))


def test_decode_on_a_big_endian_machine_gives_the_same_values(monkeypatch):
    """Where two bytes cannot be read as one little-endian word, each byte's two nibbles are decoded instead:
    the same values (against an independent numpy + ml_dtypes decode)."""
    import sys

    from checkpoint_oracles import nv_decode
    from fp4pass.checkpoint.nvfp4_weights import DIVISOR, decode_nvfp4

    g = torch.Generator().manual_seed(12)
    codes = torch.randint(0, 256, (8, 16), dtype=torch.uint8, generator=g)
    block = torch.randint(0, 0x7E, (8, 2), dtype=torch.uint8, generator=g)
    little = decode_nvfp4(codes, block, torch.tensor(4.0), DIVISOR)
    monkeypatch.setattr(sys, "byteorder", "big")
    big = decode_nvfp4(codes, block, torch.tensor(4.0), DIVISOR)
    want = nv_decode(codes.numpy(), block.numpy(), 0.25)  # a divisor of 4 is a multiplier of 1/4, exactly
    assert torch.equal(big, little) and np.array_equal(big.numpy(), want.astype(np.float32))


def test_e2m1_rounding_equals_ml_dtypes_on_every_tie_and_between():
    import ml_dtypes

    from fp4pass.checkpoint.nvfp4_weights import rne_e2m1_values

    grid = np.array([0, .5, 1, 1.5, 2, 3, 4, 6], dtype=np.float32)
    ties = (grid[1:] + grid[:-1]) / 2
    near = np.concatenate([np.nextafter(ties, np.float32(0)), np.nextafter(ties, np.float32(7))])
    v = np.concatenate([grid, ties, near, np.linspace(0, 6, 100_001, dtype=np.float32)])
    v = np.concatenate([v, -v]).astype(np.float32)
    want = v.astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
    got = rne_e2m1_values(torch.from_numpy(v)).numpy()
    assert np.array_equal(got, want)
    assert np.array_equal(np.signbit(got), np.signbit(want))


def test_activation_fake_quant_nan_and_zero_blocks():
    from fp4pass.checkpoint.nvfp4_weights import fake_quantize_activation

    x = torch.ones(2, 32)
    x[0, 3] = float("nan")
    x[1, 16:] = 0.0
    y = fake_quantize_activation(x, 6.0)  # block scale e4m3(6 * 1/6) = 1: ones stay ones
    assert torch.isnan(y[0, :16]).all() and torch.equal(y[0, 16:], torch.ones(16))  # NaN's block only
    assert torch.equal(y[1, 16:], torch.zeros(16)) and torch.equal(y[1, :16], torch.ones(16))
    z = fake_quantize_activation(x[1:], 100.0)  # e4m3(100/6) = 16: a step of 0.16, so 1 saturates at 6 steps
    assert torch.equal(z[0, :16], torch.full((16,), 0.96))


def test_logit_figures_of_known_distributions():
    """KL(source || nvfp4) in nats, not the reverse; top-1 agreement; perplexity of the scored next tokens."""
    from fp4pass.checkpoint.diff_figures import LogitStats

    src = torch.log(torch.tensor([[0.5, 0.5], [0.8, 0.2]]))
    nv = torch.log(torch.tensor([[0.9, 0.1], [0.3, 0.7]]))
    stats = LogitStats()
    stats.add(src, nv, torch.tensor([1, -1]))
    got = stats.to_json()
    kl = [0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1),  # 0.511; KL(nvfp4 || source) would be 0.368
          0.8 * math.log(0.8 / 0.3) + 0.2 * math.log(0.2 / 0.7)]  # 0.534; the reverse 0.583
    assert got["kl_mean"] == pytest.approx(sum(kl) / 2, rel=1e-5) and got["kl_max"] == pytest.approx(kl[1], rel=1e-5)
    assert got["top1_agreement"] == 0.5  # both pick token 0 in row 1 (the tie goes to the first); not in row 2
    assert got["ppl_source"] == pytest.approx(2.0) and got["ppl_nvfp4"] == pytest.approx(10.0)
    assert got["scored_next_tokens"] == 1


# -- planted defects, each named at its layer and expert -----------------------------------------------------------

def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def _edit(folder: Path, edit) -> None:
    """Rewrite ``folder``'s single shard with ``edit(tensors)`` applied (the safetensors package)."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


#: (name, --format) -> (folder, CheckpointDiff), for the whole session: tests/checkpoint/test_checkpoint_diff_checks.py shares it
_CLEAN: dict = {}


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """Correct outputs and their diffs, each made once a session: {name: (folder, CheckpointDiff)} (the folders
    under the session's base temporary folder, which lasts as long)."""
    import fp4pass.checkpoint

    def get(name: str, fmt: str):
        if (name, fmt) not in _CLEAN:
            folder = _convert(tmp_path_factory.mktemp("clean"), name, fmt, True)
            _CLEAN[(name, fmt)] = folder, fp4pass.checkpoint.diff(ROOT / name, folder, TOKENS, batch_size=BATCH,
                                                                   device="cpu")
        return _CLEAN[(name, fmt)]
    return get


def _planted(clean, tmp_path, name, fmt, edit):
    import fp4pass.checkpoint

    folder, before = clean(name, fmt)
    tmp_path.mkdir(parents=True, exist_ok=True)
    bad = _copy(folder, tmp_path / "planted")
    _edit(bad, edit)
    return before, fp4pass.checkpoint.diff(ROOT / name, bad, TOKENS, batch_size=BATCH, device="cpu")


def _named(before, after, layer: int, expert: int, drop: float = 3.0) -> None:
    """The defect is found at ``layer`` and ``expert``: the layers upstream are unchanged to the bit, ``layer``'s
    local SNR is lower than before, and ``expert`` is now the worst of all, ``drop`` dB or more under every expert
    of the correct checkpoint."""
    for b, a in zip(before.layers[:layer], after.layers[:layer]):
        assert a == b
    assert after.layers[layer]["snr_db_local"] < before.layers[layer]["snr_db_local"]
    worst = after.experts[0]
    assert (worst["layer"], worst["expert"]) == (layer, expert), after.experts[:3]
    assert worst["snr_db"] < before.experts[0]["snr_db"] - drop, (worst, before.experts[0])


@pytest.mark.parametrize("layer,expert,factor", [(1, 2, 4.0), (0, 1, 0.125), (1, 0, 16.0)])
def test_one_expert_global_scale_off(clean, tmp_path, layer, expert, factor):
    prefix = f"model.layers.{layer}.mlp.experts.{expert}"

    def edit(t):
        for proj in ("w1", "w2", "w3"):
            t[f"{prefix}.{proj}.weight_global_scale"] = t[f"{prefix}.{proj}.weight_global_scale"] * factor
    before, after = _planted(clean, tmp_path, "deepseek_v3", "compressed-tensors", edit)
    _named(before, after, layer, expert)


@pytest.mark.parametrize("layer,expert", [(1, 2), (0, 0)])
def test_gate_up_halves_of_one_gpt_oss_expert_swapped(clean, tmp_path, layer, expert):
    name = f"model.layers.{layer}.mlp.experts.gate_up_proj"

    def edit(t):
        for key in (name, name + "_weight_scale"):  # [E, ., 2I], gate/up interleaved along the last axis
            w = t[key].clone()
            w[expert, :, 0::2], w[expert, :, 1::2] = t[key][expert, :, 1::2], t[key][expert, :, 0::2]
            t[key] = w
    before, after = _planted(clean, tmp_path, "gpt_oss", "modelopt", edit)
    _named(before, after, layer, expert)


@pytest.mark.parametrize("layer,expert", [(1, 1), (0, 2)])
def test_one_expert_block_scales_one_e4m3_step_up(clean, tmp_path, layer, expert):
    prefix = f"model.layers.{layer}.mlp.experts.{expert}.w2"

    def edit(t):
        codes = t[f"{prefix}.weight_scale"].view(torch.uint8)
        t[f"{prefix}.weight_scale"] = torch.where(codes == 0, codes, codes + 1).view(torch.float8_e4m3fn)
    before, after = _planted(clean, tmp_path, "deepseek_v3", "compressed-tensors", edit)
    _named(before, after, layer, expert, drop=1.0)


def test_global_scales_stored_as_reciprocals_fail_at_the_first_layer(clean, tmp_path):
    def edit(t):
        for key in [k for k in t if k.endswith(".weight_global_scale")]:
            t[key] = 1.0 / t[key]
    before, after = _planted(clean, tmp_path, "deepseek_v3", "compressed-tensors", edit)
    after.snr_min = 0.0
    assert after.first_below == 0
    assert not after.passed


@pytest.mark.parametrize("fmt,key,factor,visible", [
    # compressed-tensors stores the activation global scale g: x1000 saturates every block at 448 (E4M3's top)
    ("compressed-tensors", "input_global_scale", 1000.0, True),
    # x2 on g: the largest blocks (calibrated to land at 448) now saturate
    ("compressed-tensors", "input_global_scale", 2.0, True),
    # ModelOpt stores input_scale = 1/g: x2 halves g, so every block scale halves exactly (a power of two in
    # E4M3's range) and x / (s / g) is unchanged: invisible while no block falls below E4M3's normals
    ("modelopt", "input_scale", 2.0, False),
    ("modelopt", "input_scale", 1e-3, True),
])
def test_an_input_scale_far_off_in_each_convention(clean, tmp_path, fmt, key, factor, visible):
    layer, expert = 1, 0
    prefix = f"model.layers.{layer}.mlp.experts.{expert}"

    def edit(t):
        for proj in ("w1", "w3"):
            t[f"{prefix}.{proj}.{key}"] = t[f"{prefix}.{proj}.{key}"] * factor
    before, after = _planted(clean, tmp_path, "deepseek_v3", fmt, edit)
    if visible:
        _named(before, after, layer, expert, drop=1.0)
    else:
        assert after.layers == before.layers and after.experts == before.experts


def test_w1_and_w3_input_scales_differ_and_w1s_quantizes_the_fused_input(clean, tmp_path):
    """vLLM keeps w1's input scale for the fused gate/up input: a w3 scale far off changes nothing (but a note
    says the two differ), a w1 scale far off is found at its expert."""
    prefix = "model.layers.1.mlp.experts.0"

    def scale(proj):
        def edit(t):
            t[f"{prefix}.{proj}.input_global_scale"] = t[f"{prefix}.{proj}.input_global_scale"] * 1000.0
        return edit
    before, up = _planted(clean, tmp_path / "up", "deepseek_v3", "compressed-tensors", scale("w3"))
    assert up.layers == before.layers and up.experts == before.experts
    assert any("w1's" in note and f"{prefix[len('model.'):]}" in note for note in up.notes), up.notes
    assert not before.notes
    _, gate = _planted(clean, tmp_path / "gate", "deepseek_v3", "compressed-tensors", scale("w1"))
    _named(before, gate, 1, 0, drop=1.0)


# -- the command line ----------------------------------------------------------------------------------------------

def test_cli_writes_strict_json_and_a_plot_and_exits_1_under_the_limits(clean, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    folder, before = clean("deepseek_v3", "compressed-tensors")
    report, plot = tmp_path / "d.json", tmp_path / "d.png"
    code, err = cli(capsys, "diff", ROOT / "deepseek_v3", folder, "--data", TOKENS, "--batch-size", BATCH,
                    "--json", report, "--plot", plot, "--quiet")
    assert code == 0, err
    data = json.loads(report.read_text(), parse_constant=lambda c: pytest.fail(f"non-strict JSON: {c}"))
    assert [r["index"] for r in data["layers"]] == [0, 1]
    assert data["layers"][0]["snr_db_local"] == round(before.layers[0]["snr_db_local"], 4)
    assert {"kl_mean", "kl_max", "top1_agreement", "ppl_source", "ppl_nvfp4"} <= set(data["logits"])
    assert data["first_below"] is None and data["passed"] is True
    assert plot.stat().st_size > 1000
    worst = min(r["snr_db_local"] for r in before.layers)
    code, _ = cli(capsys, "diff", ROOT / "deepseek_v3", folder, "--data", TOKENS, "--snr-min", worst + 0.5)
    assert code == 1
    code, _ = cli(capsys, "diff", ROOT / "deepseek_v3", folder, "--data", TOKENS, "--kl-max", before.logits["kl_mean"] / 2)
    assert code == 1
    code, _ = cli(capsys, "diff", ROOT / "deepseek_v3", folder, "--data", TOKENS, "--kl-max", before.logits["kl_mean"] * 2,
                  "--snr-min", worst - 0.5)
    assert code == 0


def test_cli_refuses_unrelated_models_bad_data_and_wrong_flags(clean, tmp_path, capsys):
    folder, _ = clean("deepseek_v3", "compressed-tensors")
    gpt, _ = clean("gpt_oss", "modelopt")
    report = tmp_path / "r.json"
    fewer = _copy(folder, tmp_path / "fewer")
    config = json.loads((fewer / "config.json").read_text())
    config["num_hidden_layers"] = 1
    (fewer / "config.json").write_text(json.dumps(config))
    big = tmp_path / "big.npz"
    np.savez(big, input_ids=np.full((2, 8), 32, dtype=np.int64))  # the vocabulary is [0, 32)
    lying, lying_src = _copy(folder, tmp_path / "lying"), _copy(ROOT / "deepseek_v3", tmp_path / "lying-src")
    for lie in (lying, lying_src):  # the two agree, but not with their shards (which hold 32)
        config = json.loads((lie / "config.json").read_text())
        config["moe_intermediate_size"] = 4096
        (lie / "config.json").write_text(json.dumps(config))
    long_rows = tmp_path / "long.npz"
    np.savez(long_rows, input_ids=np.zeros((2, 400_000), dtype=np.int64))
    cases = [((ROOT / "deepseek_v3", gpt, "--data", TOKENS), "not the same architecture"),
             ((ROOT / "deepseek_v3", lying, "--data", TOKENS), "moe_intermediate_size"),
             ((lying_src, lying, "--data", TOKENS), "config.json does not describe these shards"),
             ((ROOT / "deepseek_v3", folder, "--data", long_rows, "--seq-len", 400_000), "--seq-len"),
             ((ROOT / "deepseek_v3", fewer, "--data", TOKENS), "layer counts"),
             ((ROOT / "deepseek_v3", folder, "--data", big), "outside the vocabulary"),
             ((ROOT / "deepseek_v3", tmp_path / "missing", "--data", TOKENS), "missing"),
             ((ROOT / "deepseek_v3", folder), "--data"),
             ((folder, ROOT / "deepseek_v3", "--data", TOKENS), "give the MXFP4 (or bf16) source first"),
             ((ROOT / "deepseek_v3", folder, "--data", TOKENS, "--intermediates"), "--intermediates applies to ONNX"),
             ((ROOT.parent / "moe.onnx", ROOT.parent / "moe.onnx", "--data", TOKENS), "--data applies to checkpoint")]
    for argv, words in cases:
        code, err = cli(capsys, "diff", *argv, "--json", report)
        assert code == 2, (argv, err)
        assert words in one_line(err), (argv, err)
        assert not report.exists()


def test_right_padding_is_not_compared(clean, tmp_path):
    """Rows padded at the right, two batches of one shape with different masks, give the figures of the same
    rows run alone at their own lengths (causal attention: padding after a token never reaches it)."""
    import fp4pass.checkpoint

    folder, _ = clean("deepseek_v3", "compressed-tensors")
    ids = np.load(TOKENS)["input_ids"][:4].astype(np.int64)  # [4, 32]
    lengths = [32, 20, 27, 12]
    mask = (np.arange(32)[None, :] < np.array(lengths)[:, None]).astype(np.int64)
    junk = np.where(mask == 1, ids, (ids * 7 + 3) % 32)  # padding holds other tokens than the real ones
    np.savez(tmp_path / "padded.npz", input_ids=junk, attention_mask=mask)
    alone = tmp_path / "alone"
    alone.mkdir()
    for i, n in enumerate(lengths):
        np.savez(alone / f"row{i}.npz", input_ids=ids[i:i + 1, :n])
    padded = fp4pass.checkpoint.diff(ROOT / "deepseek_v3", folder, tmp_path / "padded.npz", batch_size=2, device="cpu")
    single = fp4pass.checkpoint.diff(ROOT / "deepseek_v3", folder, alone, batch_size=1, device="cpu")
    assert padded.run["tokens"] == single.run["tokens"] == sum(lengths)
    for a, b in zip(padded.layers, single.layers):
        assert a["snr_db_local"] == pytest.approx(b["snr_db_local"], abs=0.02)
        assert a["snr_db_end_to_end"] == pytest.approx(b["snr_db_end_to_end"], abs=0.02)
    tokens = {(r["layer"], r["expert"]): r["tokens"] for r in padded.experts}
    assert tokens == {(r["layer"], r["expert"]): r["tokens"] for r in single.experts}
    assert sum(tokens.values()) == 2 * 2 * sum(lengths)  # 2 layers, top-2 routing of the real tokens
    assert padded.logits["kl_mean"] == pytest.approx(single.logits["kl_mean"], rel=1e-3)
    assert padded.logits["scored_next_tokens"] == single.logits["scored_next_tokens"] == sum(lengths) - 4


def test_hub_model_ids_diff_offline_from_the_cache(clean, tmp_path, capsys, monkeypatch):
    """Both folders given as Hub model IDs, resolved from a Hub-layout cache with the network off: the figures of
    the folders themselves."""
    from test_hub import COMMIT_A, COMMIT_B, add_snapshot

    folder, before = clean("deepseek_v3", "compressed-tensors")
    cache = tmp_path / "hub-cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    add_snapshot(cache, "acme/kimi-tiny", ROOT / "deepseek_v3", COMMIT_A)
    add_snapshot(cache, "acme/kimi-tiny-nvfp4", folder, COMMIT_B)
    report = tmp_path / "hub.json"
    code, err = cli(capsys, "diff", "acme/kimi-tiny", "acme/kimi-tiny-nvfp4", "--data", TOKENS, "--batch-size", BATCH,
                    "--json", report)
    assert code == 0, err
    data = json.loads(report.read_text())
    layers = data["layers"]
    assert [r["snr_db_local"] for r in layers] == [round(r["snr_db_local"], 4) for r in before.layers]
    assert data["run"]["model"] == "acme/kimi-tiny"  # as the user named it, not the snapshot's commit folder
    code, err = cli(capsys, "diff", "acme/kimi-tiny", "acme/not-cached", "--data", TOKENS)
    assert code == 2 and "acme/not-cached" in one_line(err)


_RANK = """
import json, sys
import torch.distributed as dist
import fp4pass.checkpoint
rank, store, src, nvfp4, data, out = int(sys.argv[1]), *sys.argv[2:7]
dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2)
result = fp4pass.checkpoint.diff(src, nvfp4, data, batch_size=4, device="cpu")
json.dump(result.to_json(), open(out, "w"))
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_two_gloo_ranks_split_the_batches_and_reduce_to_one_process(clean, tmp_path):
    """Under torch.distributed each rank runs half the batches; after the all-reduce both report the single
    process's figures (sums of the same energies in another order) and every expert's token count."""
    import os
    import subprocess
    import sys

    folder, single = clean("deepseek_v3", "compressed-tensors")
    env = {**os.environ, "PYTHONPATH": str(ROOT.parents[1])}
    ranks = [subprocess.Popen([sys.executable, "-c", _RANK, str(r), str(tmp_path / "store"), str(ROOT / "deepseek_v3"),
                               str(folder), str(TOKENS), str(tmp_path / f"r{r}.json")], env=env) for r in range(2)]
    assert [p.wait(timeout=600) for p in ranks] == [0, 0]
    want = single.to_json()
    for r in range(2):
        got = json.loads((tmp_path / f"r{r}.json").read_text())
        assert got["run"]["batches"] == 4 and got["run"]["tokens"] == 16 * 32
        for a, b in zip(got["layers"], want["layers"]):
            assert a["snr_db_local"] == pytest.approx(b["snr_db_local"], abs=1e-3)
            assert a["snr_db_end_to_end"] == pytest.approx(b["snr_db_end_to_end"], abs=1e-3)
        assert [(e["layer"], e["expert"], e["tokens"]) for e in got["experts"]] == \
            [(e["layer"], e["expert"], e["tokens"]) for e in want["experts"]]
        assert got["logits"]["kl_mean"] == pytest.approx(want["logits"]["kl_mean"], rel=1e-6)
        assert got["logits"]["kl_max"] == want["logits"]["kl_max"]


@pytest.mark.gpu
@pytest.mark.parametrize("name,fmt", [("gpt_oss", "modelopt"), ("deepseek_v3", "compressed-tensors"),
                                      ("deepseek", "compressed-tensors")])
def test_cuda_run_gives_the_cpu_figures(clean, name, fmt):
    """On CUDA (bf16 products there, float32 products on this CPU) every figure within 0.5 dB of the CPU's."""
    import fp4pass.checkpoint

    if not torch.cuda.is_available():
        pytest.skip("needs torch with a CUDA device; none here")
    folder, cpu = clean(name, fmt)
    gpu = fp4pass.checkpoint.diff(ROOT / name, folder, TOKENS, batch_size=BATCH, device="cuda")
    assert gpu.run["device"].startswith("cuda")
    for a, b in zip(gpu.layers, cpu.layers):
        assert abs(a["snr_db_local"] - b["snr_db_local"]) < 0.5
        assert abs(a["snr_db_end_to_end"] - b["snr_db_end_to_end"]) < 1
    assert {(r["layer"], r["expert"]): r["tokens"] for r in gpu.experts} == \
        {(r["layer"], r["expert"]): r["tokens"] for r in cpu.experts}
    assert gpu.logits["kl_mean"] == pytest.approx(cpu.logits["kl_mean"], rel=0.1)

