"""load_gpt_oss on the tiny MXFP4 gpt-oss: bytes, logits against transformers, both namings, and fx.convert.

Oracles: the gpt-oss package's reference dequant (gpt_oss.torch.weights), transformers' own
GptOssForCausalLM on those dequantized weights, OpenAI's reference model (gpt_oss.torch.model) for the OpenAI
naming, and numpy decoders (tests/support/conversion_oracle.py) for the NVFP4 result.
"""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import fp4pass.fx  # noqa: E402
from conversion_oracle import mx_dequant, nv_dequant, spread, unpack  # noqa: E402
from fp4pass.errors import ModelError  # noqa: E402
from fp4pass.examples.gpt_oss_tiny import LOSSY, build_tiny_gpt_oss  # noqa: E402
from fp4pass.fx.gpt_oss import CausalLMLogits, read_config  # noqa: E402
from fp4pass.fx.mxfp4 import MXFP4Experts  # noqa: E402

CKPT = Path(__file__).resolve().parents[2] / "models" / "tiny_gpt_oss"
PROJS = ("gate_up_proj", "down_proj")


@pytest.fixture(scope="module")
def model():
    return fp4pass.fx.load_gpt_oss(CKPT)


@pytest.fixture(scope="module")
def input_ids():
    # longer than the sliding window (8), so both attention kinds matter
    return torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def checkpoint():
    from safetensors.torch import load_file

    return load_file(str(CKPT / "model.safetensors"))


def _reference_dequant(ckpt_dir: Path, blocks_name: str) -> torch.Tensor:
    weights = pytest.importorskip("gpt_oss.torch.weights")
    ck = weights.Checkpoint(str(ckpt_dir), torch.device("cpu"))
    return ck._get_mxfp4_tensor(blocks_name, blocks_name.replace("blocks", "scales"), dtype=torch.float32)


def test_experts_hold_the_checkpoint_bytes_and_dequantize_like_gpt_oss(model, checkpoint):
    layers = model.model.layers
    assert all(isinstance(layer.mlp.experts, MXFP4Experts) for layer in layers)
    for i, layer in enumerate(layers):
        experts = layer.mlp.experts
        for proj in PROJS:
            name = f"model.layers.{i}.mlp.experts.{proj}_blocks"
            assert torch.equal(getattr(experts, f"{proj}_blocks"), checkpoint[name])
            assert getattr(experts, f"{proj}_blocks").dtype == torch.uint8
            assert torch.equal(experts.dequantized(proj), _reference_dequant(CKPT, name))
        # packed only: no float copy of an expert weight anywhere in the module
        floats = [t for t in experts.state_dict().values() if t.is_floating_point()]
        assert all(t.dim() <= 2 for t in floats)


def _stock_model_on_reference_weights(ckpt_dir: Path, checkpoint):
    from transformers import GptOssForCausalLM

    config = read_config(ckpt_dir)
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    stock = GptOssForCausalLM(config).eval()
    state = {}
    for name, tensor in checkpoint.items():
        if name.endswith("_scales"):
            continue
        if name.endswith("_blocks"):
            # the checkpoint's [E, N, K]; transformers' float experts multiply x @ W with W [E, K, N]
            state[name[: -len("_blocks")]] = _reference_dequant(ckpt_dir, name).transpose(1, 2).contiguous()
        else:
            state[name] = tensor.float()
    stock.load_state_dict(state, strict=True)
    return stock


def test_logits_equal_transformers_forward_on_reference_dequantized_weights(model, input_ids, checkpoint):
    stock = _stock_model_on_reference_weights(CKPT, checkpoint)
    with torch.no_grad():
        ours = model(input_ids).logits
        theirs = stock(input_ids).logits
    assert ours.abs().max() > 1.0  # a model that does something
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_openai_naming_loads_the_same_model(tmp_path, model, input_ids):
    build_tiny_gpt_oss(tmp_path / "original", naming="openai")
    other = fp4pass.fx.load_gpt_oss(tmp_path / "original")
    ours = model.state_dict()
    theirs = other.state_dict()
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
    with torch.no_grad():
        assert torch.equal(other(input_ids).logits, model(input_ids).logits)


def test_openai_naming_agrees_with_openai_reference_model(tmp_path, model, input_ids):
    reference = pytest.importorskip("gpt_oss.torch.model")
    path = build_tiny_gpt_oss(tmp_path / "original", naming="openai")
    transformer = reference.Transformer.from_checkpoint(str(path), device="cpu")
    tokens = input_ids[0]
    with torch.no_grad():
        theirs = transformer(tokens).float()  # bf16 weights and activations
        ours = model(tokens[None]).logits[0]
    cosine = torch.nn.functional.cosine_similarity(ours.flatten(), theirs.flatten(), dim=0)
    assert cosine > 0.999, float(cosine)
    assert (ours - theirs).abs().max() < 0.05 * ours.abs().max()


def test_config_overrides_keep_the_first_layers(input_ids):
    small = fp4pass.fx.load_gpt_oss(CKPT, num_hidden_layers=1)
    assert len(small.model.layers) == 1 and small.config.layer_types == ["sliding_attention"]
    with torch.no_grad():
        assert small(input_ids).logits.shape == (2, 20, 256)


def test_bad_checkpoints_name_the_problem(tmp_path):
    with pytest.raises(ModelError, match="no config.json"):
        fp4pass.fx.load_gpt_oss(tmp_path)
    from safetensors.torch import load_file, save_file

    bad = build_tiny_gpt_oss(tmp_path / "bad")
    tensors = load_file(str(bad / "model.safetensors"))
    del tensors["model.layers.2.mlp.experts.down_proj_scales"]
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(ModelError, match="missing model.layers.2.mlp.experts.down_proj_scales"):
        fp4pass.fx.load_gpt_oss(bad)


@pytest.fixture(scope="module")
def exported(model, input_ids):
    return torch.export.export(CausalLMLogits(model), (input_ids,))


@pytest.fixture(scope="module")
def converted(exported):
    return fp4pass.fx.convert(exported, method="auto")


def test_convert_is_lossless_per_expert_where_the_exponent_spread_forecasts_it(converted, checkpoint):
    program, report = converted
    state = program.state_dict
    lossy = []
    for i in range(3):
        for proj in PROJS:
            base = f"model.layers.{i}.mlp.experts.{proj}"
            blocks, scales = checkpoint[f"{base}_blocks"].numpy(), checkpoint[f"{base}_scales"].numpy()
            codes = unpack(blocks.reshape(*blocks.shape[:-2], -1))
            mx = mx_dequant(codes, scales).astype(np.float32)
            nv_codes = unpack(state[f"m.{base}_nvfp4_codes"].numpy())
            nv = nv_dequant(nv_codes, state[f"m.{base}_nvfp4_scales"].numpy(),
                            state[f"m.{base}_nvfp4_global_scale"].numpy())
            for e in range(codes.shape[0]):
                if spread(codes[e], scales[e]) <= 17:
                    np.testing.assert_array_equal(nv[e], mx[e], err_msg=f"{base} expert {e}")
                else:
                    lossy.append((i, proj, e))
                    assert not np.array_equal(nv[e], mx[e])
            assert f"m.{base}_blocks" not in state and f"m.{base}_scales" not in state
    assert lossy == [(LOSSY["layer"], "gate_up_proj", LOSSY["expert"])]
    s = report["summary"]
    assert (s["tensors_converted"], s["lossless"], s["declined"]) == (6, 5, 0)
    entry = next(t for t in report["tensors"] if t["name"] == "m.model.layers.1.mlp.experts.gate_up_proj")
    assert entry["experts"] == 4 and len(entry["global_scale"]) == 4 and entry["mse"] > 0


def test_exported_program_in_out_saved_loaded_and_run(tmp_path, exported, converted, input_ids):
    program, _ = converted
    assert isinstance(program, torch.export.ExportedProgram)
    assert any(n.target == torch.ops.fp4pass.dequantize_mxfp4.default for n in exported.graph.nodes)  # input kept
    with torch.no_grad():
        before = exported.module()(input_ids)
        after = program.module()(input_ids)
    err = (after - before).norm() / before.norm()
    assert 0 < err < 1e-5  # only the lossy expert's 2^-20 rows moved
    path = tmp_path / "tiny_nvfp4.pt2"
    torch.export.save(program, path)
    loaded = torch.export.load(path)
    with torch.no_grad():
        assert torch.equal(loaded.module()(input_ids), after)
    again = torch.export.export(loaded.module(), (input_ids,))
    targets = [n.target for n in again.graph.nodes]
    assert targets.count(torch.ops.fp4pass.dequantize_nvfp4.default) == 6
    with torch.no_grad():
        assert torch.equal(again.module()(input_ids), after)


def test_alpha_form_scales_the_expert_matmuls(exported, converted, input_ids):
    program, report = fp4pass.fx.convert(exported, scale_form="alpha")
    assert {t["target_form"] for t in report["tensors"]} == {"alpha"}
    alphas = [k for k in program.state_dict if k.endswith("_nvfp4_alpha")]
    assert len(alphas) == 6 and all(program.state_dict[k].shape == (4, 1, 1) for k in alphas)
    assert not any(k.endswith("_nvfp4_global_scale") for k in program.state_dict)
    with torch.no_grad():
        dq = converted[0].module()(input_ids)
        alpha = program.module()(input_ids)
    torch.testing.assert_close(alpha, dq, rtol=1e-5, atol=1e-5)


def test_exported_experts_dequantize_once_per_weight(exported):
    nodes = [n for n in exported.graph.nodes if n.target == torch.ops.fp4pass.dequantize_mxfp4.default]
    assert len(nodes) == 6


def test_routed_and_dense_models_give_the_same_logits(model, input_ids):
    """load_gpt_oss's default eager forward is routed; the dense one (and the exported graph) agree with it."""
    dense = fp4pass.fx.load_gpt_oss(CKPT, experts="dense")
    assert all(layer.mlp.experts.routed for layer in model.model.layers)
    assert not any(layer.mlp.experts.routed for layer in dense.model.layers)
    with torch.no_grad():
        routed_logits, dense_logits = model(input_ids).logits, dense(input_ids).logits
    torch.testing.assert_close(routed_logits, dense_logits, rtol=1e-5, atol=1e-5)
    with pytest.raises(fp4pass.errors.UsageError, match="experts must be one of routed, dense"):
        fp4pass.fx.load_gpt_oss(CKPT, experts="sparse")


def test_sized_builder_writes_shards_and_an_index_that_load_alike(tmp_path):
    """``build_sized_gpt_oss`` streams shard by shard: cut small, it writes several shards (never over the size
    unless one tensor is larger), an index naming every tensor's shard and their total size (read back by
    safetensors), no leftover part files, and the same model as one shard; cut just under the total, exactly
    two shards."""
    from safetensors import safe_open

    from fp4pass.examples.gpt_oss_tiny import build_sized_gpt_oss

    config = {"num_hidden_layers": 2, "vocab_size": 128, "hidden_size": 64, "intermediate_size": 64,
              "num_local_experts": 4, "num_attention_heads": 4, "num_key_value_heads": 2}
    one = build_sized_gpt_oss(tmp_path / "one", config, seed=3)
    assert [p.name for p in one.glob("*.safetensors")] == ["model.safetensors"]
    assert not (one / "model.safetensors.index.json").exists()
    with safe_open(str(one / "model.safetensors"), framework="pt") as f:
        total = sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys())
    reference = fp4pass.fx.load_gpt_oss(one).state_dict()
    for cut, count in ((20_000, None), (total - 1, 2)):
        folder = build_sized_gpt_oss(tmp_path / f"cut-{cut}", config, seed=3, shard_bytes=cut)
        shards = sorted(p.name for p in folder.glob("*.safetensors"))
        n = len(shards)
        assert n == count if count else n > 2
        assert shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
        assert sorted(p.name for p in folder.iterdir()) == sorted([*shards, "config.json",
                                                                    "model.safetensors.index.json"])
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        held = {}
        for shard in shards:
            with safe_open(str(folder / shard), framework="pt") as f:
                sizes = [f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys()]
                held.update({key: shard for key in f.keys()})
            assert sum(sizes) <= cut or len(sizes) == 1, shard
        assert index["weight_map"] == held and index["metadata"]["total_size"] == total
        loaded = fp4pass.fx.load_gpt_oss(folder).state_dict()
        assert loaded.keys() == reference.keys() and all(torch.equal(loaded[k], reference[k]) for k in loaded)
    with pytest.raises(ValueError, match="shard_bytes"):
        build_sized_gpt_oss(tmp_path / "zero", config, shard_bytes=0)


def test_real_size_stages_run_and_report_each_stage(tmp_path):
    """``python -m fp4pass.examples.real_size``'s stages on a small model: every stage reported with its
    figures, the experts converted losslessly (the builder's scales span 3 octaves), the diff over the
    intermediates, and a second call reuses the checkpoint instead of building it again."""
    from fp4pass.examples.real_size import run_stages

    import resource
    import time

    small = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 64, "num_local_experts": 4,
             "num_attention_heads": 4, "num_key_value_heads": 2}
    start = time.perf_counter()
    figures = run_stages(tmp_path / "m", layers=2, batches=3, tokens=8, config=small, seed=1)
    wall = time.perf_counter() - start
    from safetensors.torch import load_file

    from fp4pass.examples.gpt_oss_tiny import build_sized_gpt_oss
    from fp4pass.fx.gpt_oss import checkpoint_layers

    # the checkpoint built is the one asked for: the small shapes, 2 layers, seed 1
    direct = build_sized_gpt_oss(tmp_path / "direct", {**small, "num_hidden_layers": 2}, seed=1)
    built, want = load_file(tmp_path / "m" / "model.safetensors"), load_file(direct / "model.safetensors")
    assert built.keys() == want.keys() and all(torch.equal(built[k], want[k]) for k in built)
    assert checkpoint_layers(tmp_path / "m") == 2
    size = (tmp_path / "m" / "model.safetensors").stat().st_size
    assert figures["checkpoint_gib"] == round(size / 2**30, 2) and size < 2**30 / 100
    lifetime_peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    assert (figures["layers"], figures["batches"], figures["tokens"]) == (2, 3, 8)
    assert list(figures["stages"]) == ["build", "load", "export", "convert", "calibrate", "diff"]
    keys = {"seconds", "rss_before_gib", "rss_peak_gib", "rss_after_gib", "machine_in_use_peak_gib"}
    for stage in figures["stages"].values():
        assert set(stage) == keys
        assert 0 < stage["rss_before_gib"] <= stage["rss_peak_gib"] <= lifetime_peak_gib + 0.01
        assert stage["rss_after_gib"] <= stage["rss_peak_gib"] + 0.01
        assert 0 < stage["machine_in_use_peak_gib"]
    assert 0 <= sum(stage["seconds"] for stage in figures["stages"].values()) <= wall + 0.5
    assert figures["convert_summary"]["tensors_converted"] == 4
    assert figures["convert_summary"]["lossless"] == 4
    assert figures["diff_intermediates"] > 10 and len(figures["diff_output_snr_db"]) == 1
    again = run_stages(tmp_path / "m", layers=2, batches=1, tokens=8, config=small)
    assert "build" not in again["stages"]


def test_real_size_prints_each_stage_as_it_ends(tmp_path, capsys, monkeypatch):
    """One stderr line per stage, ``name: {json}``, as it ends (a long run shows its progress); a stage made
    1.6 s slower shows it in its seconds."""
    import time

    from fp4pass.examples.real_size import run_stages

    real_convert = fp4pass.fx.convert

    def slow_convert(*args, **kwargs):
        time.sleep(1.6)
        return real_convert(*args, **kwargs)

    monkeypatch.setattr(fp4pass.fx, "convert", slow_convert)
    small = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 64, "num_local_experts": 4,
             "num_attention_heads": 4, "num_key_value_heads": 2}
    figures = run_stages(tmp_path / "m", layers=1, batches=1, tokens=4, config=small)
    assert figures["stages"]["convert"]["seconds"] >= 1.6
    lines = [line for line in capsys.readouterr().err.splitlines() if line.split(":")[0] in figures["stages"]]
    assert [line.split(":")[0] for line in lines] == list(figures["stages"])
    for line in lines:
        name, _, text = line.partition(": ")
        assert json.loads(text) == figures["stages"][name]
