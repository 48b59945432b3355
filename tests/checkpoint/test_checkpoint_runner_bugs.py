"""Tests aimed at the bugs nobody planned in checkpoint calibration's layer runner and in --allow-partial.

Each kind of bug is planted as a hand mutant in tests/mutants.py (``ckpt-runner-*``, ``ckpt-partial-*``):

- padded batches (left padding and padding in the middle of a row, two batches of one shape with different
  masks): the statistics equal hooks on transformers' whole-model forward given the same masks, counting the
  unpadded positions only;
- per-expert checkpoints of 11 and 103 experts a layer in Kimi/DeepSeek naming (``experts.<e>.w1|w2|w3``): an
  index read as one digit, or the experts ordered as text (0, 1, 10, 100, 101, 102, 11, 2, ...), gives another
  expert's weights or key;
- gpt-oss's expert biases: added in bf16 after each product is rounded to bf16, as transformers' own
  ``GptOssExperts.forward`` does, compared bit for bit on inputs whose products are exact in float32;
- ``convert --allow-partial``: every decline is kept when units fail one after another.

Oracles: transformers' own modules and forward on a bf16 copy decoded by tests/support/checkpoint_oracles.py (numpy).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from checkpoint_oracles import Folder, as_bytes, moe_checkpoint, rewrite_shard, write_checkpoint

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2] / "models" / "checkpoints"
TOKENS = ROOT / "calib_tokens.npz"
MODEL_TYPES = {"deepseek_v3": "deepseek_v3", "gpt_oss": "gpt_oss"}
DENSE = {"deepseek_v3": ("self_attn.o_proj", "model.layers.{}.self_attn.o_proj"), "gpt_oss": (None, None)}


def masked_oracle(ckpt: Path, model_type: str, dense: str | None, tmp: Path, batches) -> dict:
    """{"experts": {(layer, e): (tokens, gate_up amax, down amax)}, "dense": {layer: amax}} from hooks on
    transformers' whole-model forward of ``batches`` [(input_ids, attention_mask or None)], counting only the
    positions whose mask is 1."""
    from transformers import AutoModelForCausalLM

    from test_checkpoint_calibrate import dequantized_copy

    copy = dequantized_copy(ckpt, tmp / "bf16", model_type)
    model = AutoModelForCausalLM.from_pretrained(copy, dtype=torch.bfloat16, attn_implementation="eager",
                                                 experts_implementation="eager").eval()
    seen: dict = {"experts": {}, "dense": {}}
    state: dict = {}

    def expert_hook(layer):
        def hook(mod, args, kwargs):
            hidden, index = args[0], args[1]
            for e in range(mod.num_experts):
                rows = hidden[(index == e).any(-1) & state["valid"]]
                tokens, gu, dn = seen["experts"].get((layer, e), (0, 0.0, 0.0))
                if rows.shape[0]:
                    w = mod.gate_up_proj[e]
                    y = rows @ w if mod.is_transposed else torch.nn.functional.linear(rows, w)
                    if mod.has_bias:
                        y = y + mod.gate_up_proj_bias[e]
                    gu = max(gu, float(rows.float().abs().max()))
                    dn = max(dn, float(mod._apply_gate(y).float().abs().max()))
                seen["experts"][(layer, e)] = (tokens + rows.shape[0], gu, dn)
        return hook

    def dense_hook(layer):
        def hook(mod, args):
            rows = args[0].reshape(-1, args[0].shape[-1])[state["valid"]]
            seen["dense"][layer] = max(seen["dense"].get(layer, 0.0), float(rows.float().abs().max()))
        return hook

    for i, layer in enumerate(model.model.layers):
        layer.mlp.experts.register_forward_pre_hook(expert_hook(i), with_kwargs=True)
        if dense:
            layer.get_submodule(dense).register_forward_pre_hook(dense_hook(i))
    with torch.no_grad():
        for ids, mask in batches:
            state["valid"] = torch.ones(ids.numel(), dtype=torch.bool) if mask is None else mask.reshape(-1).bool()
            model(input_ids=ids, attention_mask=mask, use_cache=False)
    return seen


def ours(scales) -> dict:
    out = {}
    for row in scales.experts:
        layer = int(row["module"].split(".")[1])
        out[(layer, row["expert"])] = (row["tokens"], row.get("gate_up_amax", 0.0), row.get("down_amax", 0.0))
    return out


def assert_matches(scales, expected: dict, dense_name: str | None) -> None:
    got = ours(scales)
    assert set(got) == set(expected["experts"])
    for key, (tokens, gate_up, down) in expected["experts"].items():
        assert got[key][0] == tokens, key
        assert got[key][1] == pytest.approx(gate_up, rel=1e-2) and got[key][2] == pytest.approx(down, rel=1e-2), key
    for layer, amax in expected["dense"].items():
        assert scales.tensors[dense_name.format(layer)].amax == pytest.approx(amax, rel=1e-2)


# -- padded batches -------------------------------------------------------------------------------------------------


def padded_rows() -> tuple[np.ndarray, np.ndarray]:
    """4 rows of 32 tokens in two batches of 2 (one shape): batch 0 left-padded (8 and 13 pads), batch 1 padded
    in the middle (positions 10-15 and 4-19); pads hold token 0."""
    ids = np.load(TOKENS)["input_ids"][:4, :32].astype(np.int64).copy()
    mask = np.ones_like(ids)
    mask[0, :8] = 0
    mask[1, :13] = 0
    mask[2, 10:16] = 0
    mask[3, 4:20] = 0
    ids[mask == 0] = 0
    return ids, mask


@pytest.mark.parametrize("family,rows", [("deepseek_v3", slice(0, 4)), ("gpt_oss", slice(0, 4)), ("deepseek_v3", slice(0, 2)),
                                         ("deepseek_v3", slice(2, 4))], ids=["deepseek_v3", "gpt_oss", "kimi-left", "kimi-middle"])
def test_left_and_middle_padding_match_the_whole_model_forward_with_the_mask(tmp_path, family, rows):
    """Two batches of the same shape [2, 32] with different masks (left padding, then middle padding), or one
    of them alone: every expert's token count and amax, and the dense MXFP4 input, equal hooks on transformers'
    forward given each batch's own mask; a run that lost a mask, reused the first batch's, or took the mask as
    indices differs."""
    import fp4pass.checkpoint

    ids, mask = (a[rows] for a in padded_rows())
    data = tmp_path / "padded.npz"
    np.savez(data, input_ids=ids, attention_mask=mask)
    scales = fp4pass.checkpoint.calibrate(ROOT / family, data, batch_size=2, device="cpu")
    batches = [(torch.from_numpy(ids[i:i + 2]), torch.from_numpy(mask[i:i + 2])) for i in range(0, len(ids), 2)]
    (tmp_path / "oracle").mkdir()
    dense, dense_name = DENSE[family]
    expected = masked_oracle(ROOT / family, MODEL_TYPES[family], dense, tmp_path / "oracle", batches)
    assert sum(t for (layer, _), (t, _, _) in expected["experts"].items() if layer == 0) == 2 * int(mask.sum())
    assert scales.tokens == int(mask.sum())
    assert_matches(scales, expected, dense_name)


# -- many experts ----------------------------------------------------------------------------------------------------


def many_experts(folder: Path, count: int, seed: int = 7) -> Path:
    """The bundled DeepSeek-V3-architecture example with ``count`` MXFP4 experts a layer (compressed-tensors ``experts.<e>.w1|w3|w2``),
    each expert's codes random and its scales around its own exponent (-7 + e % 6), and a random router."""
    rng = np.random.default_rng(seed)
    src = Folder(ROOT / "deepseek_v3")
    tensors = {n: src.get(n) for n in src.keys() if ".mlp.experts." not in n and ".mlp.gate." not in n}
    for layer in (0, 1):
        mlp = f"model.layers.{layer}.mlp"
        gate = rng.standard_normal((count, 64)).astype(np.float32)
        tensors[f"{mlp}.gate.weight"] = torch.from_numpy(gate).to(torch.bfloat16)
        tensors[f"{mlp}.gate.e_score_correction_bias"] = torch.zeros(count, dtype=torch.float32)
        for e in range(count):
            for proj, rows, k in (("w1", 32, 64), ("w3", 32, 64), ("w2", 64, 32)):
                codes = rng.integers(0, 256, (rows, k // 2), dtype=np.uint8)
                scales = (127 - 7 + e % 6 + rng.integers(-1, 2, (rows, k // 32))).astype(np.uint8)
                tensors[f"{mlp}.experts.{e}.{proj}.weight_packed"] = torch.from_numpy(codes)
                tensors[f"{mlp}.experts.{e}.{proj}.weight_scale"] = torch.from_numpy(scales)
    config = json.loads((ROOT / "deepseek_v3" / "config.json").read_text())
    config["n_routed_experts"] = count
    return write_checkpoint(folder, tensors, config)


@pytest.mark.parametrize("count", [11, 103])
def test_eleven_and_a_hundred_and_three_experts_match_the_whole_model_forward(tmp_path, count):
    """Every expert's token count and amax against hooks on transformers' forward of a decoded copy, and each
    routed expert's scales under its own checkpoint names (experts 1, 10 and 100 are not confused)."""
    import fp4pass.checkpoint

    src = many_experts(tmp_path / "src", count)
    ids = np.load(TOKENS)["input_ids"][:4].astype(np.int64)
    data = tmp_path / "d.npz"
    np.savez(data, input_ids=ids)
    scales = fp4pass.checkpoint.calibrate(src, data, batch_size=2, device="cpu")
    (tmp_path / "oracle").mkdir()
    batches = [(torch.from_numpy(ids[i:i + 2]), None) for i in (0, 2)]
    expected = masked_oracle(src, "deepseek_v3", "self_attn.o_proj", tmp_path / "oracle", batches)
    assert_matches(scales, expected, "model.layers.{}.self_attn.o_proj")
    routed = {k for k, v in expected["experts"].items() if v[0]}
    assert {e for _, e in routed} & {1, 10} == {1, 10} and max(e for _, e in routed) >= 10
    assert [r["expert"] for r in scales.experts] == [e for _ in (0, 1) for e in range(count)]
    for (layer, e), (_, gate_up, down) in expected["experts"].items():
        stack = f"model.layers.{layer}.mlp.experts.{e}"
        if (layer, e) in routed:
            assert scales.tensors[f"{stack}.w1"].amax == pytest.approx(gate_up, rel=1e-2)
            assert scales.tensors[f"{stack}.w3"].amax == scales.tensors[f"{stack}.w1"].amax
            assert scales.tensors[f"{stack}.w2"].amax == pytest.approx(down, rel=1e-2)
        else:
            assert f"{stack}.w1" not in scales.tensors


# -- gpt-oss's expert biases ---------------------------------------------------------------------------------------


def _gpt_oss_experts(experts: int = 12, hidden: int = 64, inter: int = 8, seed: int = 11):
    """transformers' own GptOssExperts (eager) with bf16 weights whose products are exact in float32: gate_up
    integers in [-16, 16] (on inputs that are multiples of 2^-6, the sums are too, of up to 13 bits); down one
    nonzero (1 or 3) per output; biases odd multiples of 2^-6 (gate_up) and 2^-4 (down). Sums of more than 8
    bits are not bf16 numbers, so rounding before or after the bias gives other bits."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    cfg = GptOssConfig(hidden_size=hidden, intermediate_size=inter, num_local_experts=experts,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    cfg._experts_implementation = "eager"
    module = GptOssExperts(cfg)
    g = torch.Generator().manual_seed(seed)
    down = torch.zeros(experts, inter, hidden)
    cols = torch.arange(hidden)
    down[:, cols % inter, cols] = torch.tensor([1.0, 3.0])[torch.randint(0, 2, (experts, hidden), generator=g)]
    values = {"gate_up_proj": torch.randint(-16, 17, (experts, hidden, 2 * inter), generator=g).float(),
              "gate_up_proj_bias": (torch.randint(-4, 4, (experts, 2 * inter), generator=g) * 2 + 1) / 64.0,
              "down_proj": down,
              "down_proj_bias": (torch.randint(-4, 4, (experts, hidden), generator=g) * 2 + 1) / 16.0}
    for name, value in values.items():
        setattr(module, name, torch.nn.Parameter(value.to(torch.bfloat16), requires_grad=False))
    return module


class _Recorded:
    """Stands in for a layer's statistics: keeps every (expert, kind) -> rows handed over."""

    valid = None

    def __init__(self):
        self.rows: dict = {}

    def record(self, rel, expert, kind, rows, token_idx):
        self.rows.setdefault((expert, kind), []).append(rows.clone())


@pytest.mark.parametrize("float32_products", [True, False])
def test_gpt_oss_biases_are_added_after_the_bf16_rounding_bit_for_bit(monkeypatch, float32_products):
    """The routed loop's output and each expert's down input (the gated activation) equal transformers' own
    GptOssExperts.forward bit for bit, with the products computed either as float32 rounded to bf16 (this CPU)
    or in bf16; 12 experts, 40 tokens routed to 3 each."""
    from fp4pass.checkpoint.layerwise import runner

    monkeypatch.setattr(runner, "float32_products", lambda device, dtype: float32_products)
    experts = _gpt_oss_experts()
    g = torch.Generator().manual_seed(3)
    hidden = (torch.randint(-8, 9, (40, 64), generator=g) / 64.0).to(torch.bfloat16)
    top_k = torch.stack([torch.randperm(12, generator=g)[:3] for _ in range(40)])
    weights = torch.rand(40, 3, generator=g).to(torch.bfloat16)
    gated: dict = {}
    real_gate = experts._apply_gate

    def spy(gate_up):
        out = real_gate(gate_up)
        gated.setdefault("rows", []).append(out.clone())
        return out

    experts._apply_gate = spy
    with torch.no_grad():
        expected = experts(hidden, top_k, weights)
    reference = gated.pop("rows")
    recorded = _Recorded()
    with torch.no_grad():
        got = runner.routed_forward(experts, "mlp.experts", recorded)(hidden, top_k, weights)
    assert torch.equal(got.view(torch.int16), expected.view(torch.int16))
    hit = sorted({int(e) for e in top_k.unique()})
    assert len(reference) == len(hit)  # transformers visits the experts hit in ascending order
    for e, rows in zip(hit, reference):
        assert torch.equal(recorded.rows[(e, "down")][0].view(torch.int16), rows.view(torch.int16)), e
    # the bias matters here: the same products with the bias added before the rounding give other bits
    x = hidden[:8].float() @ experts.gate_up_proj[0].float()
    bias = experts.gate_up_proj_bias[0]
    assert not torch.equal((x + bias.float()).to(torch.bfloat16), x.to(torch.bfloat16) + bias)


# -- --allow-partial -------------------------------------------------------------------------------------------------


def _nan_scale(name: str):
    def edit(tensors):
        tensors[name] = tensors[name].clone()
        tensors[name].view(torch.uint8).view(-1)[3] = 255
    return edit


def test_allow_partial_keeps_every_decline_when_units_fail_one_after_another(tmp_path, capsys):
    """A DeepSeek-form layer of 12 experts: expert 3 has no w3 scales (declined when the folder is read), experts 1
    and 10 each have a NaN scale in w2 (each fails while converting, one run after the other). The report and the
    summary name all four declined weights; experts 0, 2, 11 (sharing a prefix with 1) convert."""
    from cli_helpers import run_cli

    src = moe_checkpoint(tmp_path / "src", "deepseek", experts=12)
    prefix = "model.layers.0.mlp.experts"
    rewrite_shard(src / "model.safetensors", lambda t: t.pop(f"{prefix}.3.w3.scale"))
    rewrite_shard(src / "model.safetensors", _nan_scale(f"{prefix}.1.w2.scale"))
    rewrite_shard(src / "model.safetensors", _nan_scale(f"{prefix}.10.w2.scale"))
    report_path = tmp_path / "r.json"
    code, out, err = run_cli(capsys, "convert", src, "-o", tmp_path / "out", "--allow-partial", "--report",
                             report_path)
    assert code == 0, err
    report = json.loads(report_path.read_text())
    declined = [d["tensor"] for d in report["declined"]]
    want = {f"{prefix}.3.w3.weight", f"{prefix}.3.w1.weight", f"{prefix}.1.w2.weight", f"{prefix}.10.w2.weight"}
    assert sorted(declined) == sorted(want)
    assert "4 MXFP4 weight(s) declined" in err
    for name in want:
        assert f"declined, left in its MXFP4 form: {name}" in out
    source, result = Folder(src), Folder(tmp_path / "out")
    for name in want:
        assert as_bytes(result.get(name)).tobytes() == as_bytes(source.get(name)).tobytes(), name
    converted = {t["name"] for t in report["tensors"]}
    for e in (0, 2, 11):
        assert {f"{prefix}.{e}.w1", f"{prefix}.{e}.w2", f"{prefix}.{e}.w3"} <= converted, e
    assert not {f"{prefix}.1.w2", f"{prefix}.10.w2", f"{prefix}.3.w3"} & converted
