"""Checkpoint calibration against an oracle: forward hooks on a whole transformers model.

The oracle model is loaded by transformers' own ``from_pretrained`` from a bf16 copy of the bundled checkpoint
that this file writes with its own MXFP4 decoder (tests/support/checkpoint_oracles.py: numpy, no fp4pass code) and the
names transformers' loader reads. Its normal full forward runs the same batches; a forward pre-hook on every
experts module records, per expert, the MoE input of the tokens routed to it and the expert's intermediate
activation on them (from the module's own weights and ``_apply_gate``); pre-hooks on the dense MXFP4 Linears
record their inputs. fp4pass's layer-by-layer run must give the same amax, exactly, with the same token counts.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from checkpoint_oracles import Folder, as_bytes, mx_decode, tree_hash
from cli_helpers import cli, one_line

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

ROOT = Path(__file__).resolve().parents[2] / "models" / "checkpoints"
TOKENS = ROOT / "calib_tokens.npz"
BATCH = 4
#: bundled example -> (transformers model type, dense MXFP4 module in transformers' names, in the checkpoint's)
FAMILIES = {"gpt_oss": ("gpt_oss", None, None),
            "deepseek_v3": ("deepseek_v3", "self_attn.o_proj", "model.layers.{}.self_attn.o_proj"),
            "deepseek": ("deepseek_v4", "self_attn.o_b_proj", "layers.{}.attn.wo_b")}
KIMI_PARTS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def _bf16(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(array.astype(np.float32)).to(torch.bfloat16)


def dequantized_copy(src: Path, dst: Path, model_type: str) -> Path:
    """A bf16 checkpoint of ``src`` in the names transformers loads (experts decoded by the test's decoder)."""
    from safetensors.torch import save_file

    folder = Folder(src)
    out: dict[str, torch.Tensor] = {}
    for name in folder.keys():
        t = folder.get(name)
        if name.endswith("_scales") or name.endswith(".weight_scale"):
            continue
        if name.endswith(".scale") and folder.dtype(name) == "F8_E8M0":
            continue
        if name.endswith("_blocks"):  # gpt-oss stack [E, N, K/32, 16] -> transformers' [E, K, N]
            base = name[: -len("_blocks")]
            codes = as_bytes(t).reshape(*t.shape[:-2], -1)
            w = mx_decode(codes, as_bytes(folder.get(base + "_scales")))
            out[base] = _bf16(np.ascontiguousarray(np.swapaxes(w, -1, -2)))
            continue
        if name.endswith(".weight_packed"):
            module = name[: -len(".weight_packed")]
            w = _bf16(mx_decode(as_bytes(t), as_bytes(folder.get(module + ".weight_scale"))))
        elif name.endswith(".weight") and folder.dtype(name) == "I8":
            module = name[: -len(".weight")]
            w = _bf16(mx_decode(as_bytes(t), as_bytes(folder.get(module + ".scale"))))
        else:
            out[name] = t
            continue
        parts = module.rsplit(".", 1)
        if model_type == "deepseek_v3" and ".experts." in module:
            module = f"{parts[0]}.{KIMI_PARTS[parts[1]]}"
        out[module + ".weight"] = w
    dst.mkdir()
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config")
    config.pop("expert_dtype", None)
    config["model_type"] = model_type
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def oracle(ckpt: Path, model_type: str, dense: str | None, tmp: Path, device: str = "cpu") -> dict:
    """{"experts": {(layer, e): (tokens, gate_up amax, down amax)}, "dense": {layer: amax}} by hooks."""
    from transformers import AutoModelForCausalLM

    copy = dequantized_copy(ckpt, tmp / "bf16", model_type)
    model, info = AutoModelForCausalLM.from_pretrained(copy, dtype=torch.bfloat16, attn_implementation="eager",
                                                       experts_implementation="eager", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    model.to(device).eval()
    experts_seen: dict = {}
    dense_seen: dict = {}

    def expert_hook(layer):
        def hook(mod, args, kwargs):
            hidden, index = args[0], args[1]
            for e in range(mod.num_experts):
                rows = hidden[(index == e).any(-1)]
                tokens, gu, dn = experts_seen.get((layer, e), (0, 0.0, 0.0))
                if rows.shape[0]:
                    w = mod.gate_up_proj[e]
                    y = rows @ w if mod.is_transposed else torch.nn.functional.linear(rows, w)
                    if mod.has_bias:
                        y = y + mod.gate_up_proj_bias[e]
                    act = mod._apply_gate(y)
                    gu = max(gu, float(rows.float().abs().max()))
                    dn = max(dn, float(act.float().abs().max()))
                experts_seen[(layer, e)] = (tokens + rows.shape[0], gu, dn)
        return hook

    def dense_hook(layer):
        def hook(mod, args):
            dense_seen[layer] = max(dense_seen.get(layer, 0.0), float(args[0].float().abs().max()))
        return hook

    for i, layer in enumerate(model.model.layers):
        layer.mlp.experts.register_forward_pre_hook(expert_hook(i), with_kwargs=True)
        if dense:
            layer.get_submodule(dense).register_forward_pre_hook(dense_hook(i))
    ids = torch.from_numpy(np.load(TOKENS)["input_ids"]).long()
    with torch.no_grad():
        for start in range(0, ids.shape[0], BATCH):
            model(input_ids=ids[start:start + BATCH].to(device), use_cache=False)
    return {"experts": experts_seen, "dense": dense_seen}


def _ours(scales) -> dict:
    out = {}
    for row in scales.experts:
        layer = int(row["module"].split(".")[1])
        out[(layer, row["expert"])] = (row["tokens"], row.get("gate_up_amax", 0.0), row.get("down_amax", 0.0))
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """fp4pass's calibration and the oracle's, per bundled family (each computed once)."""
    import fp4pass.checkpoint

    cache: dict = {}

    def get(name: str):
        if name not in cache:
            model_type, dense, _ = FAMILIES[name]
            ours = fp4pass.checkpoint.calibrate(ROOT / name, TOKENS, batch_size=BATCH, device="cpu")
            cache[name] = (ours, oracle(ROOT / name, model_type, dense, tmp_path_factory.mktemp(name)))
        return cache[name]
    return get


@pytest.mark.parametrize("name", list(FAMILIES))
def test_per_expert_amax_matches_hooks_on_transformers_forward(results, name):
    ours, expected = results(name)
    assert _ours(ours) == expected["experts"]
    assert any(tokens for tokens, _, _ in expected["experts"].values())
    unrouted = {(int(r["module"].split(".")[1]), r["expert"]) for r in ours.unrouted}
    assert unrouted == {k for k, (tokens, _, _) in expected["experts"].items() if tokens == 0}
    dense_name = FAMILIES[name][2]
    for layer, amax in expected["dense"].items():
        assert ours.tensors[dense_name.format(layer)].amax == amax
    assert ours.tokens == np.load(TOKENS)["input_ids"].size


@pytest.mark.parametrize("name", list(FAMILIES))
def test_scales_keys_are_checkpoint_module_names(results, name):
    ours, expected = results(name)
    layers = {layer for layer, _ in expected["experts"]}
    for layer in layers:
        routed = {e: v for (l, e), v in expected["experts"].items() if l == layer and v[0]}
        if name == "gpt_oss":  # one value per stack: the max over its experts
            stack = f"model.layers.{layer}.mlp.experts"
            assert ours.tensors[f"{stack}.gate_up_proj"].amax == max(v[1] for v in routed.values())
            assert ours.tensors[f"{stack}.down_proj"].amax == max(v[2] for v in routed.values())
            continue
        stack = f"model.layers.{layer}.mlp.experts" if name == "deepseek_v3" else f"layers.{layer}.ffn.experts"
        for e, (_, gate_up, down) in routed.items():
            assert ours.tensors[f"{stack}.{e}.w1"].amax == gate_up == ours.tensors[f"{stack}.{e}.w3"].amax
            assert ours.tensors[f"{stack}.{e}.w2"].amax == down
        for e in {e for (l, e) in expected["experts"] if l == layer} - set(routed):
            assert f"{stack}.{e}.w1" not in ours.tensors


def test_deepseek_hash_layer_leaves_its_last_expert_unrouted(results):
    ours, _ = results("deepseek")
    assert {(r["module"], r["expert"]) for r in ours.unrouted} >= {("layers.0.mlp.experts", 2)}
    row = [r for r in ours.unrouted if r["module"] == "layers.0.mlp.experts"][0]
    assert row["checkpoint_modules"] == ["layers.0.ffn.experts.2.w1", "layers.0.ffn.experts.2.w3",
                                         "layers.0.ffn.experts.2.w2"]


@pytest.mark.parametrize("name,fmt", [("gpt_oss", "modelopt"), ("deepseek_v3", "compressed-tensors"),
                                      ("deepseek", "modelopt")])
def test_convert_writes_amax_over_2688(results, tmp_path, name, fmt):
    """The converted checkpoint's input scales: amax / 2688 per expert (ModelOpt multiplier or compressed-tensors
    divisor), the layer's max for unrouted experts, the max over experts for a gpt-oss stack."""
    import fp4pass.checkpoint

    ours, expected = results(name)
    fp4pass.checkpoint.convert(ROOT / name, tmp_path / "o", format=fmt, scales=ours)
    out = Folder(tmp_path / "o")

    def written(module: str) -> float:
        if fmt == "modelopt":
            key = f"{module}_input_scale" if name == "gpt_oss" else f"{module}.input_scale"
            return float(out.get(key))
        return 1.0 / float(np.float32(out.get(f"{module}.input_global_scale").item()))

    def want(amax: float) -> float:
        return float(np.float32(np.float32(amax) / np.float32(2688)))

    for layer in {layer for layer, _ in expected["experts"]}:
        rows = {e: v for (l, e), v in expected["experts"].items() if l == layer}
        top = (max(v[1] for v in rows.values()), max(v[2] for v in rows.values()))
        if name == "gpt_oss":
            stack = f"model.layers.{layer}.mlp.experts"
            assert written(f"{stack}.gate_up_proj") == want(top[0])
            assert written(f"{stack}.down_proj") == want(top[1])
            continue
        stack = f"model.layers.{layer}.mlp.experts" if name == "deepseek_v3" else f"layers.{layer}.ffn.experts"
        for e, (tokens, gate_up, down) in rows.items():
            for proj, amax in (("w1", gate_up), ("w3", gate_up), ("w2", down)):
                expect = want(amax if tokens else top[0 if proj != "w2" else 1])
                assert written(f"{stack}.{e}.{proj}") == pytest.approx(expect, rel=2e-7), (layer, e, proj)


def test_calibrate_then_convert_scales_equals_convert_calib(tmp_path, capsys):
    src = ROOT / "deepseek_v3"
    code, err = cli(capsys, "calibrate", src, "--data", TOKENS, "-o", tmp_path / "s.json", "--batch-size", 4,
                    "--report", tmp_path / "r.json", "--device", "cpu")
    assert code == 0, err
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["unrouted_experts"] is not None and all("tokens" in r for r in report["experts"])
    code, err = cli(capsys, "convert", src, "-o", tmp_path / "a", "--scales", tmp_path / "s.json",
                    "--format", "compressed-tensors")
    assert code == 0, err
    code, err = cli(capsys, "convert", src, "-o", tmp_path / "b", "--calib", TOKENS, "--calib-batch-size", 4,
                    "--format", "compressed-tensors", "--device", "cpu")
    assert code == 0, err
    a, b = tree_hash(tmp_path / "a"), tree_hash(tmp_path / "b")
    assert {k: v[0] for k, v in a.items()} == {k: v[0] for k, v in b.items()}
    scales = json.loads((tmp_path / "s.json").read_text())["tensors"]
    assert "model.layers.0.mlp.experts.0.w1" in scales and "model.layers.0.self_attn.o_proj" in scales


@pytest.mark.slow
def test_text_data_is_tokenized_with_the_checkpoint_tokenizer(tmp_path):
    """A .jsonl gives the same scales as the .npz of the same tokens, tokenized by the tokenizers package."""
    import fp4pass.checkpoint
    from tokenizers import Tokenizer

    src = ROOT / "gpt_oss"
    lines = [json.loads(line)["text"] for line in (ROOT / "calib_text.jsonl").read_text().splitlines()]
    tokenizer = Tokenizer.from_file(str(src / "tokenizer.json"))
    stream = [i for text in lines for i in tokenizer.encode(text, add_special_tokens=False).ids]
    ids = np.asarray(stream[: 5 * 16]).reshape(5, 16)
    np.savez(tmp_path / "ids.npz", input_ids=ids)
    text = fp4pass.checkpoint.calibrate(src, ROOT / "calib_text.jsonl", seq_len=16, num_samples=5, batch_size=2,
                                        device="cpu")
    tokens = fp4pass.checkpoint.calibrate(src, tmp_path / "ids.npz", batch_size=2, device="cpu")
    assert text.tokens == tokens.tokens == 80
    assert {k: v.amax for k, v in text.tensors.items()} == {k: v.amax for k, v in tokens.tensors.items()}


@pytest.mark.slow
def test_padding_is_not_counted(tmp_path):
    """Rows with attention_mask 0 at the end: the statistics equal those of the unpadded rows alone."""
    import fp4pass.checkpoint

    src = ROOT / "deepseek_v3"
    ids = np.load(TOKENS)["input_ids"][:2, :16].astype(np.int64)
    padded = np.concatenate([ids, np.full((2, 8), 5)], 1)
    mask = np.concatenate([np.ones((2, 16), np.int64), np.zeros((2, 8), np.int64)], 1)
    np.savez(tmp_path / "p.npz", input_ids=padded, attention_mask=mask)
    np.savez(tmp_path / "u.npz", input_ids=ids)
    a = fp4pass.checkpoint.calibrate(src, tmp_path / "p.npz", device="cpu")
    b = fp4pass.checkpoint.calibrate(src, tmp_path / "u.npz", device="cpu")
    assert a.tokens == b.tokens == 32
    assert [r["tokens"] for r in a.experts] == [r["tokens"] for r in b.experts]
    for key, value in b.tensors.items():
        assert a.tensors[key].amax == pytest.approx(value.amax, rel=1e-2), key


@pytest.mark.slow
def test_calibrators_pick_g_amax(tmp_path):
    import fp4pass.checkpoint

    src = ROOT / "deepseek"
    base = fp4pass.checkpoint.calibrate(src, TOKENS, device="cpu")
    low = fp4pass.checkpoint.calibrate(src, TOKENS, device="cpu", calibrator="percentile", percentile=50)
    head = fp4pass.checkpoint.calibrate(src, TOKENS, device="cpu", calibrator="headroom", rho=8192, margin=2)
    for key, scale in base.tensors.items():
        assert scale.g_amax == scale.amax
        assert scale.input_scale == float(np.float32(scale.amax) / np.float32(2688))
        assert low.tensors[key].amax == scale.amax and low.tensors[key].g_amax < scale.amax
        assert head.tensors[key].g_amax >= 2 * scale.b_max * 0.999
        assert head.tensors[key].input_scale == float(np.float32(head.tensors[key].g_amax) / np.float32(2688))


def _bad_npz(path: Path, **arrays) -> Path:
    np.savez(path, **arrays)
    return path


@pytest.mark.parametrize("arrays,expect", [
    ({"input_ids": np.array([[1, 2, 3], [4, 99, 5]])}, ("row 1", "token id 99", "position 1", "[0, 32)")),
    ({"input_ids": np.ones((2, 3), np.float32)}, ("input_ids is float32", "not integer")),
    ({"input_ids": np.zeros((0, 8), np.int64)}, ("input_ids [0, 8] is empty",)),
    ({"tokens": np.ones((2, 3), np.int64)}, ("no array named input_ids",)),
    ({"input_ids": np.ones((2, 3), np.int64), "attention_mask": np.array([[1, 1, 0], [0, 0, 0]])},
     ("row 1", "attention_mask is all 0")),
])
def test_bad_npz_is_exit_2_with_nothing_left(tmp_path, capsys, arrays, expect):
    data = _bad_npz(tmp_path / "bad.npz", **arrays)
    code, err = cli(capsys, "convert", ROOT / "gpt_oss", "-o", tmp_path / "o", "--calib", data)
    assert code == 2, err
    line = one_line(err)
    assert str(data) in line and all(piece in line for piece in expect), line
    assert not (tmp_path / "o").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["bad.npz"]
    code, err = cli(capsys, "calibrate", ROOT / "gpt_oss", "--data", data, "-o", tmp_path / "s.json")
    assert code == 2 and str(data) in one_line(err) and not (tmp_path / "s.json").exists()


def test_text_without_tokenizer_and_bad_jsonl(tmp_path, capsys):
    src = shutil.copytree(ROOT / "gpt_oss", tmp_path / "ckpt")
    (src / "tokenizer.json").unlink()
    code, err = cli(capsys, "convert", src, "-o", tmp_path / "o", "--calib", ROOT / "calib_text.jsonl")
    assert code == 2 and "no tokenizer.json" in one_line(err) and not (tmp_path / "o").exists()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n\n["not", "an", "object"]\n')
    code, err = cli(capsys, "convert", ROOT / "gpt_oss", "-o", tmp_path / "o", "--calib", bad)
    assert code == 2 and "row 3" in one_line(err) and not (tmp_path / "o").exists()


def test_unknown_architecture_is_refused_naming_it(tmp_path, capsys):
    src = shutil.copytree(ROOT / "deepseek_v3", tmp_path / "ckpt")
    config = json.loads((src / "config.json").read_text())
    config["architectures"] = ["KimiK3ForCausalLM"]
    (src / "config.json").write_text(json.dumps(config))
    code, err = cli(capsys, "calibrate", src, "--data", TOKENS, "-o", tmp_path / "s.json")
    assert code == 2 and "model_type 'kimi_k2'" in one_line(err) and not (tmp_path / "s.json").exists()


def test_onnx_only_and_folder_only_flags(tmp_path, capsys):
    code, err = cli(capsys, "calibrate", ROOT / "gpt_oss", "--data", TOKENS, "-o", tmp_path / "s.json",
                    "--activation", "x")
    assert code == 2 and "--activation applies to ONNX" in one_line(err)
    code, err = cli(capsys, "convert", ROOT / "gpt_oss", "-o", tmp_path / "o", "--calib", TOKENS,
                    "--input-scale", "1")
    assert code == 2 and "not two of them" in one_line(err) and not (tmp_path / "o").exists()


@pytest.mark.slow
def test_hidden_states_spill_to_disk_and_give_the_same_scales(tmp_path, monkeypatch):
    import tempfile

    import fp4pass.checkpoint

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    kept = fp4pass.checkpoint.calibrate(ROOT / "gpt_oss", TOKENS, batch_size=4, device="cpu")
    spilled = fp4pass.checkpoint.calibrate(ROOT / "gpt_oss", TOKENS, batch_size=4, device="cpu",
                                           hidden_budget_bytes=1)
    assert kept.spilled_batches == 0 and spilled.spilled_batches == 4
    assert {k: v.amax for k, v in kept.tensors.items()} == {k: v.amax for k, v in spilled.tensors.items()}
    assert not list(tmp_path.iterdir())  # the spill folder is gone


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(FAMILIES))
def test_cuda_run_matches_hooks_on_cuda_forward(tmp_path, name):
    import fp4pass.checkpoint

    model_type, dense, dense_name = FAMILIES[name]
    ours = fp4pass.checkpoint.calibrate(ROOT / name, TOKENS, batch_size=BATCH, device="cuda")
    assert ours.device.startswith("cuda")
    expected = oracle(ROOT / name, model_type, dense, tmp_path, device="cuda")
    assert _ours(ours) == expected["experts"]
    for layer, amax in expected["dense"].items():
        assert ours.tensors[dense_name.format(layer)].amax == amax


def test_bf16_dequantization_matches_an_independent_decode():
    """Every code byte pair under every E8M0 scale (0..254) against the numpy decoder, bit for bit in bf16."""
    from fp4pass.checkpoint.layerwise.decode import mx_dequantize

    rows = 255
    codes = torch.arange(256, dtype=torch.uint8).repeat(rows, 1)  # [255, 256]: K = 512, 16 scales a row
    scales = torch.arange(255, dtype=torch.uint8).reshape(rows, 1).repeat(1, 16)
    scales[:, 1::2] = torch.flip(scales[:, ::2], [0])
    ours = mx_dequantize(codes, scales, torch.bfloat16, "all")
    with np.errstate(over="ignore"):
        expect = torch.from_numpy(mx_decode(codes.numpy(), scales.numpy()).astype(np.float32)).to(torch.bfloat16)
    assert torch.equal(ours.view(torch.int16), expect.view(torch.int16))
    with np.errstate(over="ignore"):
        expect32 = torch.from_numpy(mx_decode(codes.numpy(), scales.numpy()).astype(np.float32))
    assert torch.equal(mx_dequantize(codes, scales, torch.float32, "all"), expect32)
    scales[3, 5] = 255
    with pytest.raises(Exception, match="all scales"):
        mx_dequantize(codes, scales, torch.bfloat16, "all")


@pytest.mark.slow
def test_readme_calibration_commands_run_as_written(tmp_path, capsys, monkeypatch):
    """The README's calibrated-checkpoint commands, run from a scratch folder (the bundled inputs by their path
    in the repository), write what they say."""
    import shlex

    readme = (ROOT.parents[1] / "README.md").read_text()
    block = readme.split("Calibrated input scales (", 1)[1].split("```bash\n", 1)[1]
    lines = block.split("```", 1)[0].strip().splitlines()
    assert len(lines) == 3 and all(line.startswith(".venv/bin/fp4pass ") for line in lines)
    monkeypatch.chdir(tmp_path)
    outputs = []
    for line in lines:
        args = shlex.split(line)[1:]
        argv = [str(ROOT.parents[1] / a) if a.startswith("models/") else a for a in args]
        outputs += [args[i + 1] for i, a in enumerate(args) if a in ("-o", "--output")]
        code, err = cli(capsys, *argv)
        assert code == 0, (line, err)
    scales, gpt_oss_out, kimi_out = outputs
    assert "model.layers.0.mlp.experts.gate_up_proj" in json.loads((tmp_path / scales).read_text())["tensors"]
    for folder in (gpt_oss_out, kimi_out):
        assert (tmp_path / folder / "model.safetensors").is_file()
        assert json.loads((tmp_path / folder / "config.json").read_text())["quantization_config"]


_RANK = """
import json, sys
import torch.distributed as dist
import fp4pass.checkpoint
rank, store, src, data, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2)
scales = fp4pass.checkpoint.calibrate(src, data, batch_size=4, device="cpu")
json.dump({"amax": {k: v.amax for k, v in scales.tensors.items()}, "batches": scales.batches, "all": scales.tokens,
           "tokens": [[r["module"], r["expert"], r["tokens"]] for r in scales.experts]}, open(out, "w"))
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_two_gloo_ranks_split_the_batches_and_reduce_to_one_process(tmp_path):
    """Under torch.distributed each rank runs half the batches; after the all-reduce, both hold exactly the
    single process's amax and token counts, and report the whole data's batches and tokens."""
    import os
    import subprocess
    import sys

    import fp4pass.checkpoint

    src = ROOT / "deepseek_v3"
    env = {**os.environ, "PYTHONPATH": str(ROOT.parents[1])}
    ranks = [subprocess.Popen([sys.executable, "-c", _RANK, str(r), str(tmp_path / "store"), str(src), str(TOKENS),
                               str(tmp_path / f"r{r}.json")], env=env) for r in range(2)]
    assert [p.wait(timeout=600) for p in ranks] == [0, 0]
    single = fp4pass.checkpoint.calibrate(src, TOKENS, batch_size=4, device="cpu")
    want = {"amax": {k: v.amax for k, v in single.tensors.items()},
            "tokens": [[r["module"], r["expert"], r["tokens"]] for r in single.experts]}
    for r in range(2):
        got = json.loads((tmp_path / f"r{r}.json").read_text())
        assert got["batches"] == single.batches == 4 and got["all"] == single.tokens == 16 * 32
        assert got["amax"] == want["amax"] and got["tokens"] == want["tokens"]


def _expert_stack(experts=3, rows=64, cols=96, seed=5):
    rng = np.random.default_rng(seed)
    codes = torch.from_numpy(rng.integers(0, 256, size=(experts, rows, cols // 2), dtype=np.uint8))
    scales = torch.from_numpy(rng.integers(100, 150, size=(experts, rows, cols // 32), dtype=np.uint8))
    return codes, scales


@pytest.mark.parametrize("layout", ["plain", "plain, strided", "transposed", "transposed, checkpoint order"])
def test_expert_stack_decode_matches_an_independent_decode(layout):
    """decode_experts (the per-layer path, here with device=cpu) against the numpy decoder, bit for bit in bf16,
    each expert in its own slot (distinct experts: a swap or a repeated expert fails); a transposed [E, K, N]
    stack both in its own memory order and as a view of [E, N, K] memory (how the layer runner stores it)."""
    from fp4pass.checkpoint.layerwise.decode import decode_experts

    codes, scales = _expert_stack()
    expect = _bf16(mx_decode(codes.numpy(), scales.numpy()))  # [E, N, K]
    out = torch.full(expect.shape, float("nan"), dtype=torch.bfloat16)
    if layout == "plain, strided":  # each expert's rows are strided: a slice of a wider tensor
        e, n, k = expect.shape
        out = torch.full((e, n, k + 32), float("nan"), dtype=torch.bfloat16)[:, :, :k]
    elif layout != "plain":
        expect = expect.transpose(1, 2).contiguous()
        out = out.transpose(1, 2) if layout.endswith("checkpoint order") else out.transpose(1, 2).contiguous()
    decode_experts(codes, scales, out, layout.startswith("transposed"), "stack")
    assert torch.equal(out.contiguous().view(torch.int16), expect.view(torch.int16))


def test_gpt_oss_stacks_are_stored_in_the_checkpoint_order_with_the_model_values(tmp_path):
    """The layer runner's gpt-oss expert stacks: the model's [E, K, N] shapes over [E, N, K] memory (so x @ W
    reads an [N, K] matrix transposed), holding the values of the reference decode transposed."""
    from fp4pass.safetensors.catalog import Catalog
    from fp4pass.checkpoint.detect import detect
    from fp4pass.checkpoint.layerwise.runner import LayerRunner

    src = ROOT / "gpt_oss"
    folder = Folder(src)
    with Catalog.open(src) as catalog:
        runner = LayerRunner(catalog, detect(catalog.tensors, catalog.config), torch.device("cpu"))
        with runner.layer(1) as layer:
            experts = layer.mlp.experts
            for name in ("gate_up_proj", "down_proj"):
                param = getattr(experts, name)
                e, k, n = param.shape
                assert param.stride() == (n * k, 1, k), name
                codes = as_bytes(folder.get(f"model.layers.1.mlp.experts.{name}_blocks"))
                scales = as_bytes(folder.get(f"model.layers.1.mlp.experts.{name}_scales"))
                expect = _bf16(mx_decode(codes.reshape(e, n, -1), scales.reshape(e, n, -1))).transpose(1, 2)
                assert torch.equal(param.detach().contiguous().view(torch.int16),
                                   expect.contiguous().view(torch.int16)), name


@pytest.mark.parametrize("layout", ["plain", "plain, strided", "transposed", "transposed, checkpoint order"])
def test_a_nan_scale_in_a_stack_is_refused_naming_its_expert(layout):
    """E8M0 code 255 (NaN) in expert 2's scales: the error names the stack and that expert, whichever path
    decodes it."""
    from fp4pass.checkpoint.layerwise.decode import decode_experts

    codes, scales = _expert_stack()
    scales[2, 5, 1] = 255
    e, n, k = codes.shape[0], codes.shape[1], codes.shape[2] * 2
    out = torch.empty((e, n, k), dtype=torch.bfloat16)
    if layout == "plain, strided":
        out = torch.empty((e, n, k + 32), dtype=torch.bfloat16)[:, :, :k]
    elif layout != "plain":
        out = out.transpose(1, 2) if layout.endswith("checkpoint order") else out.transpose(1, 2).contiguous()
    with pytest.raises(Exception, match=r"model\.layers\.7\.mlp\.experts\.gate_up_proj\[2\]"):
        decode_experts(codes, scales, out, layout.startswith("transposed"), "model.layers.7.mlp.experts.gate_up_proj")


def test_float32_products_on_a_torch_without_the_cpu_probes(monkeypatch):
    """A torch without ``torch.cpu._is_avx512_bf16_supported`` / ``_is_amx_tile_supported`` counts as a CPU
    without bf16 matrix instructions (float32 products), and one with either probe true as one with them."""
    from fp4pass.checkpoint.layerwise.runner import float32_products

    cpu = torch.device("cpu")
    monkeypatch.delattr(torch.cpu, "_is_avx512_bf16_supported")
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported")
    assert float32_products(cpu, torch.bfloat16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True, raising=False)
    assert not float32_products(cpu, torch.bfloat16)
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True, raising=False)
    assert not float32_products(cpu, torch.bfloat16)


def test_only_transposed_stacks_change_their_memory_order():
    """In a module holding a stack without ``is_transposed`` (used as ``linear(x, W)``) before a transposed one,
    only the transposed one is laid over [E, N, K] memory; shapes stay the model's."""
    from fp4pass.checkpoint.layerwise.model import store_in_checkpoint_order

    def stack(transposed: bool | None) -> torch.nn.Module:
        m = torch.nn.Module()
        m.gate_up_proj = torch.nn.Parameter(torch.empty(4, 6, 10, device="meta"))
        m.down_proj = torch.nn.Parameter(torch.empty(4, 5, 6, device="meta"))
        if transposed is not None:
            m.is_transposed = transposed
        return m

    holder = torch.nn.Module()
    holder.a, holder.b = stack(None), stack(True)
    store_in_checkpoint_order(holder)
    assert holder.a.gate_up_proj.is_contiguous() and holder.a.down_proj.is_contiguous()
    assert holder.b.gate_up_proj.shape == (4, 6, 10) and holder.b.gate_up_proj.stride() == (60, 1, 6)
    assert holder.b.down_proj.shape == (4, 5, 6) and holder.b.down_proj.stride() == (30, 1, 5)
    assert {p.device.type for p in holder.parameters()} == {"meta"}  # no memory until the layer is loaded


def test_no_heap_trim_where_there_is_no_c_library(monkeypatch):
    """Without a C library that has ``malloc_trim`` the trim is skipped (False), every time, with no error."""
    import ctypes

    from fp4pass.checkpoint.layerwise import runner

    def refuse(*_args, **_kwargs):
        raise OSError("no such library")

    monkeypatch.setattr(runner, "_LIBC_TRIM", None)
    monkeypatch.setattr(ctypes, "CDLL", refuse)
    assert runner.return_freed_memory() is False
    assert runner.return_freed_memory() is False


def test_float32_products_only_on_cpus_without_bf16_matrix_instructions(monkeypatch):
    from fp4pass.checkpoint.layerwise.runner import float32_products

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert float32_products(cpu, torch.bfloat16)
    assert not float32_products(cpu, torch.float32) and not float32_products(cuda, torch.bfloat16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert not float32_products(cpu, torch.bfloat16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    assert not float32_products(cpu, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["plain", "transposed", "transposed, checkpoint order"])
def test_expert_stack_decode_on_cuda_equals_the_cpu_decode(layout):
    from fp4pass.checkpoint.layerwise.decode import decode_experts

    codes, scales = _expert_stack(experts=4, rows=256, cols=512)
    transposed = layout != "plain"
    shape = (4, 512, 256) if transposed else (4, 256, 512)
    cpu = torch.empty(shape, dtype=torch.bfloat16)
    gpu = torch.empty((4, 256, 512), dtype=torch.bfloat16, device="cuda").transpose(1, 2) \
        if layout.endswith("checkpoint order") else torch.empty(shape, dtype=torch.bfloat16, device="cuda")
    decode_experts(codes, scales, cpu, transposed, "stack")
    decode_experts(codes, scales, gpu, transposed, "stack")
    assert torch.equal(gpu.cpu().contiguous().view(torch.int16), cpu.view(torch.int16))


def test_each_layer_gives_its_freed_heap_back(monkeypatch):
    """The heap is trimmed after every layer (without it the peak memory crept up with depth: the bench's
    16-layer model peaked 1.24x its 4-layer one), and on this glibc system the trim is glibc's own."""
    import fp4pass.checkpoint
    from fp4pass.checkpoint.layerwise import runner

    import platform

    assert runner.return_freed_memory() is (platform.libc_ver()[0] == "glibc")
    calls = []
    monkeypatch.setattr(runner, "return_freed_memory", lambda: calls.append(1) or True)
    scales = fp4pass.checkpoint.calibrate(ROOT / "gpt_oss", TOKENS, batch_size=BATCH, device="cpu")
    assert len(calls) == scales.layers == 2


def _fp8_blocks(weight: np.ndarray, scales: np.ndarray):
    """E4M3 codes of ``weight`` [R, C] under 128 x 128 block ``scales`` [ceil(R/128), ceil(C/128)] (float32), and
    their float32 dequantization code * scale (ml_dtypes; the block of element (r, c) is (r // 128, c // 128))."""
    import ml_dtypes

    rows, cols = weight.shape
    full = np.repeat(np.repeat(scales, 128, 0)[:rows], 128, 1)[:, :cols]
    codes = (weight / full).astype(ml_dtypes.float8_e4m3fn)
    return codes, codes.astype(np.float32) * full


@pytest.mark.parametrize("scale_form", ["ue8m0 .scale", "float32 .weight_scale_inv"])
def test_fp8_block_weights_decode_per_128x128_block(tmp_path, scale_form):
    """An FP8 E4M3 weight with 128 x 128 block scales (DeepSeek's attention), 200 x 300 so that the blocks are
    2 x 3 with ragged edges and six distinct scales (a block read along the wrong axis, or a scale divided
    instead of multiplied, changes values): the loader's bf16 values equal the ml_dtypes decode."""
    from safetensors.torch import save_file

    from fp4pass.safetensors.catalog import Catalog
    from fp4pass.checkpoint.layerwise.model import Source, WeightLoader, WeightSources

    rng = np.random.default_rng(3)
    weight = rng.normal(0, 1, size=(200, 300)).astype(np.float32)
    if scale_form.startswith("ue8m0"):
        scales, name = np.float32(2.0) ** np.array([[-3, -1, 0], [1, 2, 4]], dtype=np.float32), "w.scale"
        stored = torch.from_numpy(scales).to(torch.float8_e8m0fnu)
    else:
        scales, name = np.array([[0.3, 0.7, 1.1], [1.9, 2.5, 3.3]], dtype=np.float32), "w.weight_scale_inv"
        stored = torch.from_numpy(scales)
    codes, expect = _fp8_blocks(weight, scales)
    (tmp_path / "config.json").write_text("{}")
    save_file({"w.weight": torch.from_numpy(codes.view(np.uint8)).view(torch.float8_e4m3fn), name: stored},
              str(tmp_path / "model.safetensors"))
    with Catalog.open(tmp_path) as catalog:
        loader = WeightLoader(catalog, WeightSources(), torch.device("cpu"))
        got = loader.value(Source("fp8", "w.weight", scale=name))
    assert torch.equal(got.to(torch.bfloat16).view(torch.int16), _bf16(expect).view(torch.int16))


def test_calibrating_fp8_attention_equals_calibrating_its_bf16_decode(tmp_path):
    """The DeepSeek-V4 example with two attention weights stored as FP8 E4M3 + ue8m0 block scales (as DeepSeek-V4
    ships them) calibrates exactly as the same example holding those weights' ml_dtypes decode in bf16."""
    import fp4pass.checkpoint
    from checkpoint_oracles import rewrite_shard

    fp8, plain = tmp_path / "fp8", tmp_path / "plain"
    shutil.copytree(ROOT / "deepseek", fp8)
    shutil.copytree(ROOT / "deepseek", plain)
    index = json.loads((fp8 / "model.safetensors.index.json").read_text())
    targets = {"layers.0.attn.wq_b.weight": [[2.0 ** -6]], "layers.1.attn.wo_a.weight": [[2.0 ** -5]]}
    for name, block_scales in targets.items():
        shard = index["weight_map"][name]
        scales = np.array(block_scales, dtype=np.float32)
        weight = Folder(ROOT / "deepseek").get(name).float().numpy()
        codes, decoded = _fp8_blocks(weight, scales)

        def to_fp8(tensors, name=name, codes=codes, scales=scales):
            tensors[name] = torch.from_numpy(codes.view(np.uint8)).view(torch.float8_e4m3fn)
            tensors[name[: -len(".weight")] + ".scale"] = torch.from_numpy(scales).to(torch.float8_e8m0fnu)

        def to_decoded(tensors, name=name, decoded=decoded):
            tensors[name] = _bf16(decoded)

        rewrite_shard(fp8 / shard, to_fp8)
        rewrite_shard(plain / shard, to_decoded)
        index["weight_map"][name[: -len(".weight")] + ".scale"] = shard
    (fp8 / "model.safetensors.index.json").write_text(json.dumps(index))
    a = fp4pass.checkpoint.calibrate(fp8, TOKENS, batch_size=BATCH, device="cpu")
    b = fp4pass.checkpoint.calibrate(plain, TOKENS, batch_size=BATCH, device="cpu")
    assert {k: v.amax for k, v in a.tensors.items()} == {k: v.amax for k, v in b.tensors.items()}
    assert [r["tokens"] for r in a.experts] == [r["tokens"] for r in b.experts]
    # the FP8 codes are not the bf16 weights: a run that read them as numbers would differ
    assert not torch.equal(Folder(fp8).get("layers.0.attn.wq_b.weight").float(),
                           Folder(plain).get("layers.0.attn.wq_b.weight").float())


def test_hugging_face_expert_names_calibrate_as_the_w1_w2_w3_names(tmp_path):
    """The DeepSeek-V3-architecture example with its experts renamed to Hugging Face's gate_proj / up_proj / down_proj (as
    DeepSeek-V3 checkpoints name them) gives the same statistics, keyed by the new names: gate and up fill the
    halves of each expert's gate_up_proj in that order (swapped halves change every expert's down input and the
    next layer's routing), down its down_proj."""
    import fp4pass.checkpoint
    from checkpoint_oracles import rewrite_shard

    renamed = tmp_path / "kimi_hf"
    shutil.copytree(ROOT / "deepseek_v3", renamed)

    def hf(name: str) -> str:  # a tensor or a module name
        return re.sub(r"\.(w[123])(?=\.|$)", lambda m: "." + KIMI_PARTS[m.group(1)], name)

    for shard in renamed.glob("*.safetensors"):
        rewrite_shard(shard, lambda tensors: tensors.update({hf(k): tensors.pop(k) for k in list(tensors)}))
    index_path = renamed / "model.safetensors.index.json"
    if index_path.exists():
        index = json.loads(index_path.read_text())
        index["weight_map"] = {hf(k): v for k, v in index["weight_map"].items()}
        index_path.write_text(json.dumps(index))
    assert any(".gate_proj." in k for k in Folder(renamed).keys())
    assert not any(".w1." in k for k in Folder(renamed).keys())
    ours = fp4pass.checkpoint.calibrate(renamed, TOKENS, batch_size=BATCH, device="cpu")
    base = fp4pass.checkpoint.calibrate(ROOT / "deepseek_v3", TOKENS, batch_size=BATCH, device="cpu")
    assert {k: v.amax for k, v in ours.tensors.items()} == {hf(k): v.amax for k, v in base.tensors.items()}
    assert [r["tokens"] for r in ours.experts] == [r["tokens"] for r in base.experts]


def test_hash_routing_follows_each_batch_tokens(tmp_path):
    """DeepSeek-V4's hash-routed layer picks experts by token id (``tid2eid[input_ids]``). The bundled example's
    table sends every token to experts {0, 1}; here token t goes to experts t % 3 and (t + 1) % 3, so a layer
    run with another batch's token ids routes differently. Every expert's token count and amax equal hooks on
    transformers' whole-model forward."""
    import fp4pass.checkpoint
    from checkpoint_oracles import rewrite_shard

    src = tmp_path / "deepseek"
    shutil.copytree(ROOT / "deepseek", src)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    name = "layers.0.ffn.gate.tid2eid"
    table = torch.tensor([[t % 3, (t + 1) % 3] for t in range(32)], dtype=torch.int64)
    rewrite_shard(src / index["weight_map"][name], lambda tensors: tensors.update({name: table}))
    ours = fp4pass.checkpoint.calibrate(src, TOKENS, batch_size=BATCH, device="cpu")
    (tmp_path / "oracle").mkdir()
    expected = oracle(src, "deepseek_v4", FAMILIES["deepseek"][1], tmp_path / "oracle")
    assert _ours(ours) == expected["experts"]
    assert all(expected["experts"][(0, e)][0] for e in range(3))  # every expert of layer 0 reached


@pytest.mark.parametrize("name", ["gpt_oss", "deepseek"])
def test_batches_of_two_lengths_calibrate_as_each_length_alone(tmp_path, name):
    """A data folder holding 32-token rows and 16-token rows: each layer's inputs (masks, rotary tables) are
    made for each batch's own shape. The run equals the two runs of each file alone merged as the statistics
    merge (token counts add, amax is the larger), each batch computed with the same shapes either way."""
    import fp4pass.checkpoint

    ids = np.load(TOKENS)["input_ids"]
    data = tmp_path / "data"
    data.mkdir()
    np.savez(data / "a.npz", input_ids=ids[:8])
    np.savez(data / "b.npz", input_ids=ids[8:, 5:21])
    both = fp4pass.checkpoint.calibrate(ROOT / name, data, batch_size=BATCH, device="cpu")
    alone = [fp4pass.checkpoint.calibrate(ROOT / name, data / f, batch_size=BATCH, device="cpu")
             for f in ("a.npz", "b.npz")]
    assert both.tokens == 8 * 32 + 8 * 16
    for key in set(both.tensors) | set(alone[0].tensors) | set(alone[1].tensors):
        assert both.tensors[key].amax == max(a.tensors[key].amax for a in alone if key in a.tensors), key
    assert [r["tokens"] for r in both.experts] == [a["tokens"] + b["tokens"] for a, b in
                                                   zip(alone[0].experts, alone[1].experts)]
    assert alone[0].tensors != alone[1].tensors  # the two files differ where it matters
