"""``fp4pass inspect NVFP4_DIR`` raises no false alarm, and still fails on real defects.

Correct checkpoints (fp4pass's own outputs of models/checkpoints/*, the third-party fixtures, and valid extremes:
a w1/w3 pair whose w3 sits 8 binades below a w1 spanning 27, a global scale of exactly 1 over power-of-two block
scales, a block-scale tensor whose largest scale lies outside the sample) exit 0. A magnitude guess and an engine
that does not load a correct form are warnings (exit 0, 1 with --strict). Planted defects exit 1, and the engine
table then says what each engine would do. Values are planted with the safetensors package and ml_dtypes, never
computed by the validator.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from fp4pass.checkpoint.validate import BLOCK_SAMPLE_BYTES, validate
from cli_helpers import cli, run_cli

FIXTURES = Path(__file__).parents[1] / "fixtures" / "nvfp4_thirdparty"
MODELOPT_MOE = FIXTURES / "modelopt_qwen3_moe"
MODELOPT_GPT_OSS = FIXTURES / "modelopt_gpt_oss"
LLMC_MOE = FIXTURES / "llmcompressor_qwen3_moe"
E = "model.layers.0.mlp.experts"
AMAX_PER_SCALE = 6.0 * 448.0  # ModelOpt: weight_scale_2 = amax / (6 x 448)


def _copy(src: Path, tmp_path: Path, name: str | None = None) -> Path:
    out = tmp_path / (name or src.name)
    shutil.copytree(src, out)
    return out


def _edit(folder: Path, edit) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def _e4m3(values: np.ndarray) -> torch.Tensor:
    """float values -> a float8_e4m3fn tensor, cast by ml_dtypes (round to nearest even)."""
    codes = np.asarray(values, dtype=np.float32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    return torch.from_numpy(codes.copy()).view(torch.float8_e4m3fn)


def _inspect(capsys, folder: Path, *flags: str) -> tuple[int, dict]:
    """``fp4pass inspect FOLDER --json FLAGS``: (exit code, the JSON it printed)."""
    code, out, _ = run_cli(capsys, "inspect", folder, "--json", *flags)
    return code, json.loads(out)


# --------------------------------------------------------------------------------- correct checkpoints

OWN = [("gpt_oss", "modelopt", ["--input-scale", "0.5"]), ("deepseek_v3", "compressed-tensors", []),
       ("deepseek_v3", "modelopt", ["--input-scale", "0.5"]), ("deepseek", "compressed-tensors", ["--input-scale", "0.5"]),
       ("deepseek", "modelopt", ["--input-scale", "0.5"]),
       ("deepseek_v3", "compressed-tensors", ["--calib", "models/checkpoints/calib_tokens.npz"])]


@pytest.fixture(scope="module")
def own_root(tmp_path_factory):
    return tmp_path_factory.mktemp("own")


@pytest.mark.parametrize("model,fmt,flags", OWN, ids=[f"{m}-{f}-{'-'.join(x)[:12]}" for m, f, x in OWN])
def test_own_outputs_exit_0(own_root, capsys, model, fmt, flags):
    """fp4pass's own outputs: exit 0; what remains is engines that do not load a form (warnings, fix named)."""
    out = own_root / f"{model}-{fmt}-{len(flags)}-{flags[0][2:] if flags else ''}"
    code, err = cli(capsys, "convert", f"models/checkpoints/{model}", "-o", out, "--format", fmt, *flags, "--quiet")
    assert code == 0, err
    code, result = _inspect(capsys, out)
    assert code == 0
    assert all(p["kind"] == "engine_cannot_load" and p["severity"] == "warning" for p in result["problems"])
    assert all("fix: " in p["message"] for p in result["problems"])


@pytest.mark.parametrize("fixture", [MODELOPT_MOE, MODELOPT_GPT_OSS, LLMC_MOE], ids=lambda p: p.name)
def test_thirdparty_fixtures_exit_0(capsys, fixture):
    code, result = _inspect(capsys, fixture)
    assert code == 0
    assert {p["kind"] for p in result["problems"]} <= {"engine_cannot_load"}
    assert cli(capsys, "inspect", fixture, "--strict")[0] == (1 if result["problems"] else 0)


def test_gpt_oss_engines_gap_is_an_error_when_that_engine_is_asked(capsys):
    """Without --engine the gpt-oss fused form's loader gap is a warning; asked for vLLM, it is exit 1."""
    assert cli(capsys, "inspect", MODELOPT_GPT_OSS)[0] == 0
    code, result = _inspect(capsys, MODELOPT_GPT_OSS, "--engine", "vllm")
    assert code == 1
    [p] = result["problems"]
    assert p["kind"] == "engine_cannot_load" and p["severity"] == "error" and "fix: " in p["message"]


def _kimi_pair_source(tmp_path: Path) -> Path:
    """The bundled Kimi checkpoint with layer 1 expert 0's w1 E8M0 codes over 100..127 (27 binades) and w3's over
    100..108 (8 binades, the bottom of w1's): the pair's one global scale comes from w1's amax."""
    from checkpoint_oracles import rewrite_shard

    src = tmp_path / "src"
    shutil.copytree("models/checkpoints/deepseek_v3", src)
    layer = "model.layers.1.mlp.experts.0"

    def spread(shape, lo: int, hi: int) -> torch.Tensor:
        return (lo + torch.arange(int(np.prod(shape))) % (hi - lo + 1)).to(torch.uint8).reshape(shape)

    def edit(tensors):
        shape = tensors[f"{layer}.w1.weight_scale"].shape
        tensors[f"{layer}.w1.weight_scale"] = spread(shape, 100, 127)
        tensors[f"{layer}.w3.weight_scale"] = spread(shape, 100, 108)

    rewrite_shard(src / "model.safetensors", edit)
    return src


@pytest.mark.parametrize("fmt", ["modelopt", "compressed-tensors"])
def test_w3_far_below_w1_under_one_shared_scale(tmp_path, capsys, fmt):
    """w3 alone decodes to an amax of ~3e-5 (below 2^-14) under the pair's scale; read as a pair it is w1's."""
    out = tmp_path / "out"
    code, err = cli(capsys, "convert", _kimi_pair_source(tmp_path), "-o", out, "--format", fmt, "--input-scale", "0.5")
    assert code == 0, err
    tensors = load_file(out / "model.safetensors")
    w1, w3 = (tensors[f"model.layers.1.mlp.experts.0.{p}.weight_scale"].float() for p in ("w1", "w3"))
    assert float(w3.max()) * 2 ** 8 <= float(w1.max())  # the planted gap survived the conversion
    code, result = _inspect(capsys, out)
    assert code == 0 and result["problems"] == []


def test_global_scale_of_one_over_power_of_two_block_scales(tmp_path, capsys):
    """weight_scale_2 = 1 with block scales 2^-9..2^4 (E4M3 subnormals 2^-9, 2^-8, 2^-7 included: exact): a
    lossless encoding of weights with amax 96, not a folded scale."""
    folder = _copy(MODELOPT_MOE, tmp_path)

    def edit(t):
        for module in (f"{E}.3.gate_proj", f"{E}.3.up_proj"):  # w1 and w3 share the global scale
            shape = t[f"{module}.weight_scale"].shape
            powers = 2.0 ** (-9 + np.arange(int(np.prod(shape))) % 14)
            t[f"{module}.weight_scale"] = _e4m3(powers.reshape(shape))
            assert float(t[f"{module}.weight_scale"].float().max()) == 16.0
            t[f"{module}.weight_scale_2"] = torch.tensor(1.0)

    _edit(folder, edit)
    code, result = _inspect(capsys, folder)
    assert code == 0 and result["problems"] == []


def _big_down_proj(folder: Path, block: np.ndarray, amax: float) -> None:
    """Replace expert 0's down_proj by one of 64 x 8192 (block scales [64, 512]: 32 KiB, sampled) with the
    block scales ``block`` and weight_scale_2 = amax / 2688."""
    module = f"{E}.0.down_proj"

    def edit(t):
        t[f"{module}.weight"] = torch.full((64, 4096), 0x77, dtype=torch.uint8)  # every code 6 x sign +
        t[f"{module}.weight_scale"] = _e4m3(block)
        t[f"{module}.weight_scale_2"] = torch.tensor(amax / AMAX_PER_SCALE, dtype=torch.float32)

    _edit(folder, edit)


def test_largest_block_scale_outside_the_sample(tmp_path, capsys):
    """Every block scale 2^-9 but row 9's, 448: the sample (4 pieces of 4 KiB of 32 KiB) misses row 9, where
    the amax 0.5 lives; judged on the sample alone the weights would decode to 2e-6."""
    block = np.full((64, 512), 2.0 ** -9)
    block[9] = 448.0
    assert 64 * 512 > BLOCK_SAMPLE_BYTES
    folder = _copy(MODELOPT_MOE, tmp_path)
    _big_down_proj(folder, block, amax=0.5)
    code, result = _inspect(capsys, folder)
    assert code == 0 and result["problems"] == []


def test_sample_reaches_the_last_row(tmp_path):
    """A NaN block scale in the last byte of a sampled tensor (its last row) is found."""
    block = np.full((64, 512), 448.0)
    block[-1, -1] = np.nan
    folder = _copy(MODELOPT_MOE, tmp_path)
    _big_down_proj(folder, block, amax=0.5)
    found = [p for p in validate(folder)["problems"] if p["kind"] == "nonfinite_scale"]
    assert [p["tensor"] for p in found] == [f"{E}.0.down_proj.weight_scale"]


# ------------------------------------------------------------------------------------------------ guesses

def test_a_magnitude_guess_is_a_warning(tmp_path, capsys):
    """weight_scale_2 giving an amax of 20000 (possible for a weight; 361 read as a divisor): a guess, exit 0
    with the warning printed, exit 1 with --strict."""
    folder = _copy(MODELOPT_MOE, tmp_path)
    tensor = f"{E}.3.down_proj.weight_scale_2"
    top = float(load_file(MODELOPT_MOE / "model.safetensors")[f"{E}.3.down_proj.weight_scale"].float().max())
    _edit(folder, lambda t: t.__setitem__(tensor, torch.tensor(20000.0 / (6 * top), dtype=torch.float32)))
    code, result = _inspect(capsys, folder)
    [p] = result["problems"]
    assert code == 0 and p["kind"] == "scale_convention" and p["guess"] and p["severity"] == "warning"
    assert cli(capsys, "inspect", folder, "--strict")[0] == 1
    assert all(v["loads"] and v["warnings"] == ["scale_convention"] for v in result["engines"].values()
               if v["mode"])


def test_table_prints_warnings_apart(tmp_path, capsys):
    from fp4pass.checkpoint.validate import format_validation

    folder = _copy(MODELOPT_MOE, tmp_path)
    tensor = f"{E}.3.down_proj.weight_scale_2"
    _edit(folder, lambda t: t.__setitem__(tensor, torch.tensor(20000.0 / 2688, dtype=torch.float32)))
    text = format_validation(validate(folder))
    assert "no problem found" in text and "1 warning(s)" in text and "scale_convention (guess)" in text


# --------------------------------------------------------------------------------------- planted defects

def _planted(tmp_path: Path) -> Path:
    """A zero weight_scale_2 (expert 0), the divisor stored as multiplier (expert 1), w3's scale x 1.5 (2)."""
    folder = _copy(MODELOPT_MOE, tmp_path, "planted")

    def edit(t):
        t[f"{E}.0.down_proj.weight_scale_2"] = torch.tensor(0.0)
        t[f"{E}.1.down_proj.weight_scale_2"] = (1.0 / t[f"{E}.1.down_proj.weight_scale_2"].double()).float()
        t[f"{E}.2.up_proj.weight_scale_2"] = t[f"{E}.2.up_proj.weight_scale_2"] * 1.5

    _edit(folder, edit)
    return folder


def test_planted_defects_exit_1_and_the_table_agrees(tmp_path, capsys):
    folder = _planted(tmp_path)
    code, result = _inspect(capsys, folder)
    assert code == 1
    kinds = {p["kind"]: p for p in result["problems"]}
    assert set(kinds) == {"zero_scale", "scale_convention", "w1_w3_mismatch"}
    assert all(p["severity"] == "error" and not p.get("guess") for p in kinds.values())
    engines = result["engines"]
    assert not any(v["loads"] for v in engines.values())
    assert engines["vllm"]["outcome"] == engines["sglang"]["outcome"] == "loads, computes garbage"
    assert engines["trtllm"]["outcome"] == "refuses at load" and engines["trtllm"]["mode"] is None
    assert engines["vllm"]["mode"] == "W4A4"
    assert cli(capsys, "inspect", MODELOPT_MOE)[0] == 0  # the unplanted fixture: the baseline


def test_zero_input_scale_computes_nan(tmp_path, capsys):
    folder = _copy(MODELOPT_MOE, tmp_path)
    _edit(folder, lambda t: t.__setitem__(f"{E}.2.down_proj.input_scale", torch.tensor(0.0)))
    code, result = _inspect(capsys, folder)
    assert code == 1
    assert {v["outcome"] for v in result["engines"].values()} == {"loads, computes NaN"}


@pytest.mark.parametrize("value", [0.0, float("nan"), -2.0])
def test_messages_show_plain_numbers(tmp_path, value):
    folder = _copy(LLMC_MOE, tmp_path)
    tensor = f"{E}.0.down_proj.weight_global_scale"
    _edit(folder, lambda t: t.__setitem__(tensor, torch.tensor([value])))
    result = validate(folder)
    [p] = [p for p in result["problems"] if p.get("tensor") == tensor]
    assert f"({value:.6g})" in p["message"] and "np." not in json.dumps(result)


def test_folded_scale_exits_1(tmp_path, capsys):
    """weight_scale = e4m3(weight_scale x weight_scale_2) and weight_scale_2 = 1 (ml_dtypes does the cast)."""
    folder = _copy(MODELOPT_MOE, tmp_path)
    module = f"{E}.0.gate_proj"

    def edit(t):
        block = t[f"{module}.weight_scale"].float().numpy() * float(t[f"{module}.weight_scale_2"])
        t[f"{module}.weight_scale"] = _e4m3(block)
        t[f"{module}.weight_scale_2"] = torch.tensor(1.0)

    _edit(folder, edit)
    code, result = _inspect(capsys, folder)
    assert code == 1
    [p] = [p for p in result["problems"] if p["kind"] == "folded_global_scale"]
    assert p["severity"] == "error" and p["module"] == module


def test_every_problem_names_its_fix(tmp_path, capsys):
    folders = [_planted(tmp_path), MODELOPT_GPT_OSS]
    out = tmp_path / "ds"
    assert cli(capsys, "convert", "models/checkpoints/deepseek", "-o", out, "--format", "modelopt",
               "--input-scale", "0.5")[0] == 0
    folders.append(out)
    seen = [p for f in folders for p in validate(f)["problems"]]
    assert {"engine_cannot_load", "zero_scale", "scale_convention", "w1_w3_mismatch"} <= {p["kind"] for p in seen}
    assert all("; fix: " in p["message"] for p in seen), [p for p in seen if "fix: " not in p["message"]]
    [deepseek] = [p for p in validate(out)["problems"] if p["kind"] == "engine_cannot_load"]
    assert "--format compressed-tensors" in deepseek["message"]


def test_table_says_multiplier_or_divisor(capsys):
    for fixture, word in ((MODELOPT_MOE, "multiplier"), (LLMC_MOE, "divisor")):
        code, out, _ = run_cli(capsys, "inspect", fixture)
        assert code == 0
        lines = out.splitlines()
        header = next(i for i, line in enumerate(lines) if line.startswith("module"))
        assert "global scale" in lines[header] and lines[header + 1].split()[-3] == word


# ----------------------------------------------------------------------------------------- Python entry

def test_checkpoint_inspect_validates_an_nvfp4_folder():
    import fp4pass.checkpoint

    result = fp4pass.checkpoint.inspect(LLMC_MOE)
    assert result["form"] == "compressed-tensors" and result["modules"] and "engines" in result
    assert result["problems"] == validate(LLMC_MOE)["problems"] == []
    assert "engine" in fp4pass.checkpoint.format_inspection(result)


def test_strict_is_refused_for_an_mxfp4_folder(capsys):
    code, err = cli(capsys, "inspect", "models/checkpoints/deepseek_v3", "--strict")
    assert code == 2 and "--strict" in err


# ---------------------------------------------------------------------------- per-expert global scales

STACK = "model.layers.1.mlp.experts.down_proj"


def _twelve_expert_stack(folder: Path, swapped: int | None = None) -> list[float]:
    """Layer 1's down_proj stack widened to 12 experts (the fixture's 4, tiled) with one global scale per expert:
    expert e's is the fixture's x (1 + e/10); expert 5's block scales are the fixture's x 2^-11 (largest <= 0.25)
    under a global scale of 4 (amax <= 6); expert 1's block scales are all 0 under a global scale of 1. With
    ``swapped``, that expert's global scale is stored as its reciprocal. Returns the scales as written."""
    def edit(t):
        codes, block = t[STACK], t[f"{STACK}_weight_scale"].float()
        t[STACK] = codes.repeat(3, 1, 1)
        block = block.repeat(3, 1, 1)
        block[5] = block[5] * 2.0 ** -11
        block[1] = 0.0
        t[f"{STACK}_weight_scale"] = _e4m3(block.numpy())
        g = float(t[f"{STACK}_weight_scale_2"])
        scales = torch.tensor([g * (1 + e / 10) for e in range(12)], dtype=torch.float32)
        scales[5], scales[1] = 4.0, 1.0
        if swapped is not None:
            scales[swapped] = 1.0 / scales[swapped]
        t[f"{STACK}_weight_scale_2"] = scales
        t[f"{STACK}_bias"] = t[f"{STACK}_bias"].repeat(3, 1)

    _edit(folder, edit)
    return [float(v) for v in load_file(folder / "model.safetensors")[f"{STACK}_weight_scale_2"]]


def test_per_expert_global_scales_judged_per_expert(tmp_path):
    """Each expert of a stack under its own global scale: expert 5 (small block scales, scale 4) and expert 1
    (all-zero blocks, scale 1) are legal; the stack's largest block scale under expert 5's scale would not be."""
    folder = _copy(MODELOPT_GPT_OSS, tmp_path)
    _twelve_expert_stack(folder)
    assert [p for p in validate(folder)["problems"] if p["kind"] != "engine_cannot_load"] == []


def test_one_swapped_expert_scale_in_a_stack_is_named(tmp_path):
    folder = _copy(MODELOPT_GPT_OSS, tmp_path)
    scales = _twelve_expert_stack(folder, swapped=10)
    [p] = [p for p in validate(folder)["problems"] if p["kind"] == "scale_convention"]
    assert p["tensor"] == f"{STACK}_weight_scale_2" and "(expert 10 of 12)" in p["message"]
    assert p["severity"] == "error" and f"{1.0 / scales[10]:.6g}" in p["message"]


@pytest.mark.parametrize("amax,severity", [(1.0e5, "warning"), (2.0, "error")])
def test_input_scale_magnitudes(tmp_path, amax, severity):
    """An input scale of amax/2688 with amax 1e5 (an outlier activation; 72 read as a divisor) is a guess; the
    reciprocal of amax 2's scale (7.2e6/2 = 3.6e6 read as stored) is an error."""
    folder = _copy(MODELOPT_MOE, tmp_path)
    tensor = f"{E}.2.down_proj.input_scale"
    value = amax / AMAX_PER_SCALE if severity == "warning" else AMAX_PER_SCALE / amax
    _edit(folder, lambda t: t.__setitem__(tensor, torch.tensor(value, dtype=torch.float32)))
    [p] = validate(folder)["problems"]
    assert p["kind"] == "scale_convention" and p["tensor"] == tensor and p["severity"] == severity
