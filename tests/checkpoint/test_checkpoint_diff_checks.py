"""``fp4pass diff SRC_DIR NVFP4_DIR`` for scripts and against strangers' folders: every expert and layer named by
its checkpoint module, the limit that failed and where, ``--seq-len 1``; NaN/Inf in a scale, an output or the KL
failing (exit 1) at the first layer and module where they appear; shard headers that do not fit the model refused
(exit 2) before any tensor is read. The correct outputs and their diffs are tests/checkpoint/test_checkpoint_diff.py's,
made once a session.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from cli_helpers import cli, one_line, run_cli
from diff_oracle import ROOT
from test_checkpoint_diff import BATCH, TOKENS, _copy, _edit, clean  # noqa: F401 - clean is a fixture

pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

# -- what a script reads: every expert by its checkpoint module, the limit that failed, --seq-len 1 -------------

@pytest.mark.parametrize("name,fmt,layer_prefix,expert_module", [
    ("deepseek_v3", "compressed-tensors", "model.layers.{l}", "model.layers.{l}.mlp.experts.{e}"),
    ("gpt_oss", "modelopt", "model.layers.{l}", "model.layers.{l}.mlp.experts"),  # one stack holds every expert
    ("deepseek", "compressed-tensors", "layers.{l}", "layers.{l}.ffn.experts.{e}"),  # the model says mlp
])
def test_json_names_every_expert_and_layer_by_its_checkpoint_module(clean, name, fmt, layer_prefix, expert_module):
    from safetensors import safe_open

    folder, result = clean(name, fmt)
    data = json.loads(json.dumps(result.to_json(), allow_nan=False))
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        stored = list(f.keys())
    config = json.loads((folder / "config.json").read_text())
    experts = config.get("num_local_experts") or config.get("n_routed_experts")
    routed = {(r["layer"], r["expert"]) for r in data["experts"]}
    idle = {(r["layer"], r["expert"]) for r in data["unrouted_experts"]}
    assert routed | idle == {(l, e) for l in range(2) for e in range(experts)} and not routed & idle
    for r in data["experts"]:
        assert r["checkpoint_module"] == expert_module.format(l=r["layer"], e=r["expert"]), r
        assert any(t.startswith(r["checkpoint_module"] + ".") for t in stored), r
    assert [r["checkpoint_module"] for r in data["layers"]] == [layer_prefix.format(l=i) for i in range(2)]
    assert (data["run"]["model"], data["run"]["config_model_type"]) == (name, config["model_type"])


def test_cli_json_says_which_limit_failed(clean, tmp_path, capsys):
    folder, before = clean("deepseek_v3", "compressed-tensors")
    worst = min(range(2), key=lambda i: before.layers[i]["snr_db_local"])
    snr = before.layers[worst]["snr_db_local"]
    kl = before.logits["kl_mean"]
    report = tmp_path / "f.json"
    code, out, _ = run_cli(capsys, "diff", ROOT / "deepseek_v3", folder, "--data", TOKENS, "--json", report,
                           "--snr-min", snr + 0.25, "--kl-max", kl * 2)  # the SNR fails, the KL does not
    assert code == 1
    data = json.loads(report.read_text())
    assert data["passed"] is False
    assert data["failed"] == [{"limit": "snr_min", "value": round(snr, 4), "threshold": snr + 0.25, "layer": worst,
                               "where": f"model.layers.{worst}", "found": data["failed"][0]["found"]}]
    assert f"FAILED --snr-min {snr + 0.25}: layer {worst} (model.layers.{worst}): local SNR" in out
    code, out, _ = run_cli(capsys, "diff", ROOT / "deepseek_v3", folder, "--data", TOKENS, "--json", report,
                           "--snr-min", snr - 0.25, "--kl-max", kl / 2)  # now the KL alone
    assert code == 1
    assert [(f["limit"], f["threshold"], f["where"]) for f in json.loads(report.read_text())["failed"]] == \
        [("kl_max", kl / 2, "logits")]


def test_cli_seq_len_1_prints_its_table_and_writes_its_json(clean, tmp_path, capsys):
    """Rows of one token have no next token to score: no perplexity (null), and the rest of the figures."""
    folder, _ = clean("deepseek_v3", "compressed-tensors")
    report = tmp_path / "one.json"
    code, out, err = run_cli(capsys, "diff", ROOT / "deepseek_v3", folder, "--data", TOKENS, "--seq-len", 1,
                             "--json", report)
    assert code == 0, err
    data = json.loads(report.read_text(), parse_constant=lambda c: pytest.fail(f"non-strict JSON: {c}"))
    rows = np.load(TOKENS)["input_ids"].shape[0]
    assert data["logits"]["tokens"] == rows and data["logits"]["scored_next_tokens"] == 0
    assert data["logits"]["ppl_source"] is None and data["logits"]["ppl_nvfp4"] is None
    assert "perplexity source n/a, nvfp4 n/a" in out


# -- NaN/Inf: exit 1, named at the first layer and module where they appear ----------------------------------------

def _cli_failed(capsys, name, folder, tmp_path):
    report = tmp_path / "nan.json"
    code, out, err = run_cli(capsys, "diff", ROOT / name, folder, "--data", TOKENS, "--batch-size", BATCH,
                             "--json", report)
    assert code == 1, (out, err)
    data = json.loads(report.read_text(), parse_constant=lambda c: pytest.fail(f"non-strict JSON: {c}"))
    assert data["passed"] is False
    return data, out


def test_nan_global_scale_of_one_expert_fails_at_its_layer_and_expert(clean, tmp_path, capsys):
    folder, before = clean("deepseek_v3", "compressed-tensors")
    bad = _copy(folder, tmp_path / "nan")
    tensor = "model.layers.1.mlp.experts.2.w2.weight_global_scale"
    _edit(bad, lambda t: t.__setitem__(tensor, torch.tensor([float("nan")])))
    data, out = _cli_failed(capsys, "deepseek_v3", bad, tmp_path)
    assert [(f["limit"], f["layer"], f["where"]) for f in data["failed"]] == [
        ("finite", 1, tensor), ("finite", 1, "model.layers.1.mlp.experts.2"), ("finite", None, "logits")]
    assert data["failed"][0]["found"] == "global scale NaN"
    assert data["layers"][0]["snr_db_local"] == round(before.layers[0]["snr_db_local"], 4)  # upstream untouched
    assert "nonfinite_local" not in data["layers"][0] and data["layers"][1]["nonfinite_local"] > 0
    assert f"FAILED NaN/Inf: layer 1 ({tensor}): global scale NaN" in out


def test_zero_divisor_global_scale_of_an_attention_output_is_named_at_that_module(clean, tmp_path, capsys):
    """A zero compressed-tensors global scale (a divisor) is finite, but decodes to Inf weights: the first module
    whose output holds NaN/Inf is named, in the first layer where they appear."""
    folder, _ = clean("deepseek_v3", "compressed-tensors")
    bad = _copy(folder, tmp_path / "zero")
    _edit(bad, lambda t: t.__setitem__("model.layers.1.self_attn.o_proj.weight_global_scale", torch.tensor([0.0])))
    data, _ = _cli_failed(capsys, "deepseek_v3", bad, tmp_path)
    assert data["nonfinite_scales"] == []
    assert [(f["limit"], f["layer"], f["where"]) for f in data["failed"]][0] == \
        ("finite", 1, "model.layers.1.self_attn.o_proj")


def test_nan_input_scale_of_a_gpt_oss_stack_is_named(clean, tmp_path, capsys):
    folder, _ = clean("gpt_oss", "modelopt")
    bad = _copy(folder, tmp_path / "stack")
    tensor = "model.layers.0.mlp.experts.down_proj_input_scale"
    _edit(bad, lambda t: t.__setitem__(tensor, torch.tensor(float("nan"))))
    data, _ = _cli_failed(capsys, "gpt_oss", bad, tmp_path)
    assert [(f["limit"], f["layer"], f["where"]) for f in data["failed"]][:2] == [
        ("finite", 0, tensor), ("finite", 0, "model.layers.0.mlp.experts")]
    assert data["layers"][0]["nonfinite_expert"] in range(3)


def test_an_infinite_input_scale_fails_even_where_the_outputs_stay_finite(clean, tmp_path, capsys):
    """An infinite activation global scale zeroes that input (every block's step s / g is 0): nothing in the
    outputs is NaN, yet the checkpoint is broken."""
    folder, _ = clean("deepseek_v3", "compressed-tensors")
    bad = _copy(folder, tmp_path / "inf")
    tensor = "model.layers.1.mlp.experts.0.w1.input_global_scale"
    _edit(bad, lambda t: t.__setitem__(tensor, torch.tensor([float("inf")])))
    data, _ = _cli_failed(capsys, "deepseek_v3", bad, tmp_path)
    assert data["failed"] == [{"limit": "finite", "value": None, "threshold": None, "layer": 1, "where": tensor,
                               "found": "input scale inf"}]


# -- headers against the model, before anything is read ----------------------------------------------------------

def _declare(folder: Path, shapes: dict) -> None:
    """Rewrite ``folder``'s shard so that each tensor of ``shapes`` declares that shape (its dtype kept), its bytes
    a hole: a sparse file as long as the header says, so no disk and no memory holds them."""
    import struct

    path = folder / "model.safetensors"
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    header.pop("__metadata__", None)
    width = {"U8": 1, "F8_E4M3": 1, "BF16": 2, "F32": 4}
    out, pieces, offset = {}, [], 0
    for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        begin, end = info["data_offsets"]
        shape = shapes.get(name, info["shape"])
        size = math.prod(shape) * width[info["dtype"]] if name in shapes else end - begin
        out[name] = {"dtype": info["dtype"], "shape": shape, "data_offsets": [offset, offset + size]}
        pieces.append(size if name in shapes else raw[8 + n + begin: 8 + n + end])
        offset += size
    text = json.dumps(out).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for piece in pieces:
            if isinstance(piece, int):
                f.seek(piece, 1)
            else:
                f.write(piece)
        f.truncate(8 + len(text) + offset)


def _doubled(name: str, dim: int):
    def edit(t):
        t[name] = torch.cat([t[name], t[name]], dim)
    return edit


@pytest.mark.parametrize("name,fmt,edit,declared,words", [
    # 8 GiB of codes (and the block scales that go with them) where expert 2's w1 needs 1 KiB
    ("deepseek_v3", "compressed-tensors", {"model.layers.1.mlp.experts.2.w1.weight_packed": [1 << 20, 1 << 13],
                                    "model.layers.1.mlp.experts.2.w1.weight_scale": [1 << 20, 1 << 10]},
     "model.layers.1.mlp.experts.2.w1.weight_packed", ["[1048576, 8192]", "needs [32, 32]"]),
    # the same for a whole gpt-oss stack: [E, K/2, N] declared 16 GiB
    ("gpt_oss", "modelopt", {"model.layers.1.mlp.experts.down_proj": [3, 1 << 13, 1 << 18],
                             "model.layers.1.mlp.experts.down_proj_weight_scale": [3, 1 << 10, 1 << 18]},
     "model.layers.1.mlp.experts.down_proj", ["[3, 8192, 262144]", "needs [3, 16, 64]"]),
    # a gpt-oss stack's block scales twice as many along K/16 as its codes need
    ("gpt_oss", "modelopt", _doubled("model.layers.1.mlp.experts.gate_up_proj_weight_scale", 1),
     "model.layers.1.mlp.experts.gate_up_proj_weight_scale", ["[3, 8, 64]", "needs [3, 4, 64]"]),
    # a stack's global scale neither one value nor one per expert
    ("gpt_oss", "modelopt", lambda t: t.__setitem__("model.layers.0.mlp.experts.down_proj_weight_scale_2",
                                                    torch.ones(4)),
     "model.layers.0.mlp.experts.down_proj_weight_scale_2", ["holds 4 values", "needs 1 or 3"]),
    # an NVFP4 Linear whose codes and block scales agree with each other, not with the model: half its rows
    ("deepseek_v3", "compressed-tensors", lambda t: [t.__setitem__(k, t[k][:32]) for k in
                                               ("model.layers.0.self_attn.o_proj.weight_packed",
                                                "model.layers.0.self_attn.o_proj.weight_scale")],
     "model.layers.0.self_attn.o_proj.weight_packed", ["[32, 32]", "needs [64, 32]"]),
    # a bf16 tensor the NVFP4 side keeps as it is, twice the model's rows
    ("deepseek_v3", "compressed-tensors", _doubled("model.layers.1.mlp.shared_experts.gate_proj.weight", 0),
     "model.layers.1.mlp.shared_experts.gate_proj.weight", ["[64, 64]", "needs [32, 64]"]),
])
def test_headers_that_do_not_fit_the_model_are_refused_before_any_read(clean, tmp_path, capsys, monkeypatch, name,
                                                                        fmt, edit, declared, words):
    from fp4pass.safetensors.catalog import Catalog

    folder, _ = clean(name, fmt)
    bad = _copy(folder, tmp_path / "bad")
    _declare(bad, edit) if isinstance(edit, dict) else _edit(bad, edit)
    reads = []

    def no_read(self, tensor, out=None):  # nothing may be read, and a lying header must never be allocated
        reads.append(tensor)
        raise AssertionError(f"{tensor} read before the headers were checked")
    monkeypatch.setattr(Catalog, "read", no_read)
    report = tmp_path / "r.json"
    code, err = cli(capsys, "diff", ROOT / name, bad, "--data", TOKENS, "--json", report)
    assert reads == [] and code == 2, err
    line = one_line(err)
    assert line.startswith(f"fp4pass diff: error: {declared}: ") and all(w in line for w in words), line
    assert not report.exists()
