"""``fp4pass diff SRC_DIR NVFP4_DIR``: every figure against an independent whole-model forward (tests/support/diff_oracle.py),
for the three bundled families in both of fp4pass's forms (W4A4, and W4A16 both lossless and lossy) and for the
committed third-party NVFP4 checkpoints (ModelOpt 0.47, llm-compressor 0.14): local SNR within 0.5 dB, end to
end within 1 dB, each expert within 0.5 dB with the same token counts, KL mean within 10%.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from diff_oracle import ROOT, THIRD_PARTY, bf16_source, figures, third_party_source
from test_checkpoint_diff import BATCH, TOKENS, _convert

pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

#: bundled family -> (transformers model type, {checkpoint dense module: model module} where they differ)
FAMILIES = {"gpt_oss": ("gpt_oss", {}), "deepseek_v3": ("deepseek_v3", {}),
            "deepseek": ("deepseek_v4", {f"layers.{i}.attn.wo_b": f"model.layers.{i}.self_attn.o_b_proj"
                                         for i in range(2)})}
#: (family, --format, calibrated input scales: W4A4)
CASES = [("gpt_oss", "modelopt", True), ("gpt_oss", "modelopt", False), ("deepseek_v3", "compressed-tensors", True),
         ("deepseek_v3", "modelopt", False),
         ("deepseek", "compressed-tensors", True), ("deepseek", "modelopt", True)]



def _ids() -> torch.Tensor:
    return torch.from_numpy(np.load(TOKENS)["input_ids"]).long()


def _close(ours: float | None, oracle: float | None, tolerance: float) -> None:
    """Both None (identical outputs), or both numbers within ``tolerance`` dB."""
    assert (ours is None) == (oracle is None), (ours, oracle)
    assert ours is None or abs(ours - oracle) < tolerance, (ours, oracle)


def _agree(ours, oracle: dict) -> None:
    """The figures within 0.5 dB (local, experts), 1 dB (end to end), 10% (KL mean); the same experts routed."""
    assert len(ours.layers) == len(oracle["layers"])
    for row, (local, e2e) in zip(ours.layers, oracle["layers"]):
        _close(row["snr_db_local"], local, 0.5)
        _close(row["snr_db_end_to_end"], e2e, 1.0)
    got = {(r["layer"], r["expert"]): (r["snr_db"], r["tokens"]) for r in ours.experts}
    assert set(got) == set(oracle["experts"])
    for key, (db, tokens) in oracle["experts"].items():
        assert got[key][1] == tokens, key
        _close(got[key][0], db, 0.5)
    lg, want = ours.logits, oracle["logits"]
    assert abs(lg["kl_mean"] - want["kl_mean"]) <= 0.1 * want["kl_mean"], (lg, want)
    assert abs(lg["top1_agreement"] - want["top1_agreement"]) <= 0.03, (lg, want)
    for key in ("ppl_source", "ppl_nvfp4"):  # None: no next token to score (rows of one token)
        assert lg[key] is None if want[key] is None else lg[key] == pytest.approx(want[key], rel=0.01), key


@pytest.mark.parametrize("name,fmt,calibrated", CASES)
def test_figures_match_an_independent_forward(tmp_path, name, fmt, calibrated):
    import fp4pass.checkpoint

    # weight-only: the lossless conversion of Kimi, plain requantization (lossy) of gpt-oss
    nvfp4 = _convert(tmp_path, name, fmt, calibrated, "requant" if (name, calibrated) == ("gpt_oss", False)
                     else "auto")
    ours = fp4pass.checkpoint.diff(ROOT / name, nvfp4, TOKENS, batch_size=BATCH, device="cpu")
    assert ours.run["activations"] == ("W4A4" if calibrated else "W4A16")
    assert ours.run["nvfp4_form"] == fmt
    model_type, dense = FAMILIES[name]
    oracle = figures(bf16_source(name, tmp_path), nvfp4, model_type, _ids(), BATCH, tmp_path, dense)
    _agree(ours, oracle)
    if (name, calibrated) == ("deepseek_v3", False):  # every Kimi expert converts losslessly: W4A16 changes nothing
        assert all(r["snr_db_local"] is None for r in ours.layers) and ours.logits["kl_mean"] == 0.0
    else:
        assert all(r["snr_db_local"] is not None for r in ours.layers)


@pytest.mark.parametrize("fixture,which,form", [("modelopt_gpt_oss", "gpt_oss", "modelopt"),
                                                ("modelopt_qwen3_moe", "qwen3_moe", "modelopt"),
                                                ("llmcompressor_qwen3_moe", "qwen3_moe", "compressed-tensors")])
def test_third_party_checkpoints_match_an_independent_forward(tmp_path, fixture, which, form):
    import fp4pass.checkpoint

    source = third_party_source(which, tmp_path)
    ids = torch.from_numpy(np.random.default_rng(3).integers(0, 128, (8, 24))).long()
    data = tmp_path / "ids.npz"
    np.savez(data, input_ids=ids.numpy())
    ours = fp4pass.checkpoint.diff(source, THIRD_PARTY / fixture, data, batch_size=BATCH, device="cpu")
    assert (ours.run["nvfp4_form"], ours.run["activations"]) == (form, "W4A4")
    oracle = figures(source, THIRD_PARTY / fixture, which, ids, BATCH, tmp_path)
    _agree(ours, oracle)
    # the bf16 source really is the model these were quantized from: every layer within NVFP4's reach
    assert all(r["snr_db_local"] > 10 for r in ours.layers)


def test_per_expert_scales_of_a_gpt_oss_stack_match_an_independent_forward(tmp_path):
    """ModelOpt's gpt-oss stacks may carry one global and one input scale per expert ([E]): each expert decodes
    and quantizes its inputs with its own."""
    import shutil

    from safetensors.torch import load_file, save_file

    import fp4pass.checkpoint

    clean = _convert(tmp_path, "gpt_oss", "modelopt", True)
    folder = shutil.copytree(clean, tmp_path / "per-expert")
    tensors = load_file(folder / "model.safetensors")
    # distinct per expert; the input scales far apart (x1000 saturates every block at 448, /40 sends small
    # blocks under E4M3's range): within its range an input scale's error hides in the rounding noise
    factors = {"_weight_scale_2": [1.0, 0.37, 3.1, 0.77], "_input_scale": [1.0, 40.0, 0.001, 0.77]}
    for key in [k for k in tensors if k.endswith(tuple(factors))]:
        suffix = next(f for f in factors if key.endswith(f))
        experts = tensors[key[: -len(suffix)]].shape[0]
        tensors[key] = tensors[key] * torch.tensor(factors[suffix][:experts])
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    ours = fp4pass.checkpoint.diff(ROOT / "gpt_oss", folder, TOKENS, batch_size=BATCH, device="cpu")
    oracle = figures(bf16_source("gpt_oss", tmp_path), folder, "gpt_oss", _ids(), BATCH, tmp_path)
    _agree(ours, oracle)


def test_a_hundred_and_three_experts_match_an_independent_forward(tmp_path):
    """103 experts a layer, each at its own exponent with its own calibrated input scale: experts 1, 10, 100 and
    101 read as their own (an index read as one digit or sorted as text would pair one's weights or scales with
    another's), every expert's figure and token count against the oracle."""
    import fp4pass.checkpoint
    from test_checkpoint_calibrate import dequantized_copy
    from test_checkpoint_runner_bugs import many_experts

    src = many_experts(tmp_path / "src", 103)
    data = tmp_path / "d.npz"
    np.savez(data, input_ids=np.load(TOKENS)["input_ids"][:8].astype(np.int64))
    scales = fp4pass.checkpoint.calibrate(src, data, batch_size=BATCH, device="cpu")
    nvfp4 = tmp_path / "nvfp4"
    fp4pass.checkpoint.convert(src, nvfp4, format="compressed-tensors", scales=scales)
    ours = fp4pass.checkpoint.diff(src, nvfp4, data, batch_size=BATCH, device="cpu")
    ids = torch.from_numpy(np.load(data)["input_ids"])
    oracle = figures(dequantized_copy(src, tmp_path / "bf16", "deepseek_v3"), nvfp4, "deepseek_v3", ids, BATCH,
                     tmp_path)
    _agree(ours, oracle)
    routed = {e for layer, e in oracle["experts"]}
    assert {1, 10} <= routed and max(routed) >= 100, sorted(routed)


def test_rows_of_one_token_match_an_independent_forward(tmp_path):
    """``--seq-len 1``: every figure but the perplexities (no row has a next token: both None), as the oracle's."""
    import fp4pass.checkpoint

    nvfp4 = _convert(tmp_path, "deepseek_v3", "compressed-tensors", True)
    ids = _ids()[:, :1]
    data = tmp_path / "one.npz"
    np.savez(data, input_ids=ids.numpy())
    ours = fp4pass.checkpoint.diff(ROOT / "deepseek_v3", nvfp4, data, batch_size=BATCH, device="cpu")
    oracle = figures(bf16_source("deepseek_v3", tmp_path), nvfp4, "deepseek_v3", ids, BATCH, tmp_path)
    assert ours.logits["ppl_source"] is None and ours.logits["ppl_nvfp4"] is None and ours.logits["tokens"] == 16
    assert oracle["logits"]["ppl_source"] is None
    _agree(ours, oracle)
