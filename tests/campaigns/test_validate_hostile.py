"""``fp4pass inspect NVFP4_DIR`` on hostile folders: what a downloaded checkpoint's configs and names may do.

Each test copies a third-party fixture (tests/fixtures/nvfp4_thirdparty, MAKE.md there), plants one hostile
config or name with plain JSON and the safetensors package, and checks the documented outcome: exit 1 with a
``bad_config_value`` naming the field, or exit 2 with one line naming the file, and never a hang, exit 3, a
read outside the folder, or a bare NaN in the JSON printed.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fp4pass.checkpoint.validate import validate
from fp4pass.io import NON_FINITE_NOTE, json_text, write_json
from cli_helpers import one_line, run_cli

FIXTURES = Path(__file__).parents[1] / "fixtures" / "nvfp4_thirdparty"
MODELOPT_MOE = FIXTURES / "modelopt_qwen3_moe"
LLMC_MOE = FIXTURES / "llmcompressor_qwen3_moe"
E0 = "model.layers.0.mlp.experts.0"


def _copy(src: Path, tmp_path: Path) -> Path:
    out = tmp_path / src.name
    shutil.copytree(src, out)
    return out


def _edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def _add_bf16_linear(folder: Path, module: str) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(path)
    tensors[f"{module}.weight"] = torch.ones(4, 4, dtype=torch.bfloat16)
    save_file(tensors, path, metadata={"format": "pt"})


def _strict(text: str):
    """json.loads that refuses NaN, Infinity and -Infinity, as RFC 8259 readers do."""
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")
    return json.loads(text, parse_constant=refuse)


def _inspect(capsys, folder, *flags):
    code, out, err = run_cli(capsys, "inspect", folder, "--json", *flags)
    return code, (_strict(out) if out.strip() else None), err


def _bad_values(result: dict) -> list[dict]:
    return [p for p in result["problems"] if p["kind"] == "bad_config_value"]


# ------------------------------------------------------------------------------------ patterns and names

def test_a_catastrophic_ignore_regex_is_a_bad_config_value(tmp_path, capsys):
    folder = _copy(LLMC_MOE, tmp_path)
    _add_bf16_linear(folder, "a" * 36 + "!")
    _edit_json(folder / "config.json", lambda d: d["quantization_config"]["ignore"].append("re:(a|aa)+$"))
    start = time.process_time()
    code, result, err = _inspect(capsys, folder)
    assert time.process_time() - start < 20
    assert code == 1 and "Traceback" not in err
    [bad] = _bad_values(result)
    assert "re:(a|aa)+$" in bad["message"] and "ran past" in bad["message"]
    assert set(bad["engines"]) == {"vllm", "sglang"} and bad["tensor"] == "config.json"


def test_the_classic_redos_regex_is_answered(tmp_path, capsys):
    """``re:(a+)+$`` against ``aaa...a!`` (seconds in ``re``): no match (the module stays unexcluded), at once."""
    folder = _copy(LLMC_MOE, tmp_path)
    _add_bf16_linear(folder, "a" * 26 + "!")
    _edit_json(folder / "config.json", lambda d: d["quantization_config"]["ignore"].append("re:(a+)+$"))
    start = time.process_time()
    code, result, _ = _inspect(capsys, folder)
    assert time.process_time() - start < 20 and code == 1
    assert {p["module"] for p in result["problems"] if p["kind"] == "unexcluded_linear"} == {"a" * 26 + "!"}


def test_a_backtracking_glob_is_decided_at_once(tmp_path, capsys):
    folder = _copy(MODELOPT_MOE, tmp_path)
    module = "model.layers.0." + "a" * 32  # SGLang's regex takes seconds on it in re
    _add_bf16_linear(folder, module)
    glob = "*a*a*a*a*a*a*a*a*a*a*ab"
    _edit_json(folder / "hf_quant_config.json", lambda d: d["quantization"]["exclude_modules"].append(glob))
    _edit_json(folder / "config.json", lambda d: d["quantization_config"]["ignore"].append(glob))
    start = time.process_time()
    code, result, _ = _inspect(capsys, folder)
    assert time.process_time() - start < 8 and code == 1
    [miss] = [p for p in result["problems"] if p["kind"] == "unexcluded_linear"]
    assert miss["module"] == module and set(miss["engines"]) == {"vllm", "sglang", "trtllm"}


@pytest.mark.parametrize("entry, said", [("re:(", "not a valid regular expression"),
                                         (7, "quantization_config.ignore[3] is int 7"),
                                         (["lm_head"], "quantization_config.ignore[3] is list")])
def test_an_invalid_or_non_string_ignore_entry_is_a_bad_config_value(tmp_path, capsys, entry, said):
    folder = _copy(LLMC_MOE, tmp_path)
    _edit_json(folder / "config.json", lambda d: d["quantization_config"]["ignore"].append(entry))
    code, result, err = _inspect(capsys, folder)
    assert code == 1 and "Traceback" not in err
    [bad] = _bad_values(result)
    assert said in bad["message"] and set(bad["engines"]) == {"vllm", "sglang"}


def test_an_sglang_glob_that_is_no_regex_concerns_sglang_only(tmp_path, capsys):
    folder = _copy(MODELOPT_MOE, tmp_path)
    for name, key in (("hf_quant_config.json", "quantization"), ("config.json", "quantization_config")):
        field = "exclude_modules" if key == "quantization" else "ignore"
        _edit_json(folder / name, lambda d: d[key][field].append("model.layers.[9"))
    code, result, _ = _inspect(capsys, folder)
    assert code == 1
    [bad] = _bad_values(result)
    assert bad["engines"] == ["sglang"] and "model.layers.[9" in bad["message"]


def test_exclude_modules_not_a_list_is_named_in_the_file_trtllm_reads(tmp_path, capsys):
    folder = _copy(MODELOPT_MOE, tmp_path)
    _edit_json(folder / "hf_quant_config.json", lambda d: d["quantization"].__setitem__("exclude_modules", "lm_head"))
    code, result, _ = _inspect(capsys, folder)
    assert code == 1
    bad = [p for p in _bad_values(result) if "exclude_modules" in p["message"]]
    assert len(bad) == 1 and bad[0]["engines"] == ["trtllm"] and bad[0]["tensor"] == "hf_quant_config.json"
    assert "is str" in bad[0]["message"]


def test_each_engine_is_held_to_the_exclusions_of_the_file_it_reads(tmp_path):
    """vLLM and SGLang read config.json's quantization_config; TensorRT-LLM reads hf_quant_config.json."""
    entry = "model.layers.1.self_attn*"
    for dropped_from, blamed in (("hf_quant_config.json", {"trtllm"}), ("config.json", {"vllm", "sglang"})):
        folder = _copy(MODELOPT_MOE, tmp_path / dropped_from)
        key, field = (("quantization", "exclude_modules") if dropped_from == "hf_quant_config.json"
                      else ("quantization_config", "ignore"))
        _edit_json(folder / dropped_from, lambda d: d[key][field].remove(entry))
        missed = [p for p in validate(folder)["problems"] if p["kind"] == "unexcluded_linear"]
        assert {p["module"] for p in missed} == {f"model.layers.1.self_attn.{p}_proj" for p in "qkvo"}
        assert all(set(p["engines"]) == blamed for p in missed), (dropped_from, missed)


def test_six_hundred_thousand_exclusions_validate_in_seconds(tmp_path):
    """15 MB of exclusions (exact names and prefix wildcards): the lists are indexed, so the time goes with
    the list's length, not with list x modules (the scan took over two minutes). 520,000 entries (600,000 made
    each config 18 MB): both configs stay within the 16 MiB a config may be."""
    folder = _copy(MODELOPT_MOE, tmp_path)
    extra = [f"model.layers.{i // 1000}.blk{i % 1000}.proj*" if i % 3 == 0 else
             f"model.layers.{i // 1000}.blk{i % 1000}.w" for i in range(520_000)]
    _edit_json(folder / "hf_quant_config.json", lambda d: d["quantization"]["exclude_modules"].extend(extra))
    _edit_json(folder / "config.json", lambda d: d["quantization_config"]["ignore"].extend(extra))
    assert (folder / "hf_quant_config.json").stat().st_size > 15_000_000
    start = time.process_time()
    result = validate(folder)
    seconds = time.process_time() - start
    assert not result["problems"] and all(v["loads"] for v in result["engines"].values())
    assert seconds < 10, f"{seconds:.1f} CPU seconds"


# ---------------------------------------------------------------------------------- the files it opens

def test_a_quant_config_linked_out_of_the_folder_is_never_opened(tmp_path, capsys, monkeypatch):
    from fp4pass.safetensors import catalog

    folder = _copy(MODELOPT_MOE, tmp_path)
    outside = tmp_path / "elsewhere" / "hf_quant_config.json"
    outside.parent.mkdir()
    shutil.move(folder / "hf_quant_config.json", outside)
    os.symlink(outside, folder / "hf_quant_config.json")
    opened = []
    real_open = catalog.open_regular
    monkeypatch.setattr(catalog, "open_regular", lambda path, *a, **k: (opened.append(
        os.path.realpath(path)), real_open(path, *a, **k))[1])
    code, out, err = run_cli(capsys, "inspect", folder, "--json")
    assert code == 2 and not out
    assert "hf_quant_config.json" in one_line(err) and "symlink" in err
    assert str(outside.resolve()) not in opened and opened  # config.json was read, the link's target never
    code, out, _ = run_cli(capsys, "inspect", folder, "--json", "--follow-symlinks")
    assert code == 0 and str(outside.resolve()) in opened


def _sparse(path: Path, size: int) -> None:
    with open(path, "wb") as f:
        f.truncate(size)


@pytest.mark.parametrize("name", ["hf_quant_config.json", "config.json"])
@pytest.mark.parametrize("damage", ["100MB", "nested", "bad_json", "nan", "folder"])
def test_an_unreadable_config_of_an_nvfp4_folder_is_exit_2(tmp_path, capsys, name, damage):
    folder = _copy(MODELOPT_MOE, tmp_path)
    if name == "config.json":  # an NVFP4 folder by its hf_quant_config.json alone
        pass
    else:  # an NVFP4 folder by hf_quant_config.json alone: config.json says nothing of quantization
        _edit_json(folder / "config.json", lambda d: d.pop("quantization_config"))
    path = folder / name
    path.unlink()
    if damage == "100MB":
        _sparse(path, 100 * 1024 * 1024)
    elif damage == "nested":
        path.write_text("[" * 200_000 + "]" * 200_000)
    elif damage == "bad_json":
        path.write_text('{"quantization": {"quant_algo": "NVFP4",')
    elif damage == "nan":
        path.write_text('{"quantization": {"quant_algo": "NVFP4", "group_size": NaN}}')
    else:
        path.mkdir()
    code, out, err = run_cli(capsys, "inspect", folder, "--json")
    assert code == 2 and not out.strip()
    assert name in one_line(err)


# -------------------------------------------------------------------------------------- strict JSON

def test_inspect_json_writes_a_nan_scale_as_null_with_a_note(tmp_path, capsys):
    folder = _copy(LLMC_MOE, tmp_path)
    path = folder / "model.safetensors"
    tensors = load_file(path)
    tensors[f"{E0}.down_proj.weight_global_scale"] = torch.tensor([float("nan")])
    tensors[f"{E0}.up_proj.input_global_scale"] = torch.tensor([float("inf")])
    save_file(tensors, path, metadata={"format": "pt"})
    code, result, _ = _inspect(capsys, folder)  # parsed by a strict reader
    assert code == 1
    modules = {m["module"]: (i, m) for i, m in enumerate(result["modules"])}
    i, down = modules[f"{E0}.down_proj"]
    j, up = modules[f"{E0}.up_proj"]
    assert down["global_scale"] is None and up["input_scale"] is None
    assert f"$.modules[{i}].global_scale: nan" in result[NON_FINITE_NOTE]
    assert f"$.modules[{j}].input_scale: inf" in result[NON_FINITE_NOTE]
    assert {p["kind"] for p in result["problems"]} >= {"nonfinite_scale"}


def test_write_json_and_json_text_are_strict(tmp_path):
    data = {"a": [1.5, float("nan"), {"b": float("-inf")}], "c": (float("inf"),), "d": "NaN", "e": 0.0}
    path = tmp_path / "report.json"
    write_json(path, data)
    for text in (path.read_text(), json_text(data)):
        got = _strict(text)
        assert got["a"] == [1.5, None, {"b": None}] and got["c"] == [None] and got["d"] == "NaN" and got["e"] == 0.0
        assert got[NON_FINITE_NOTE] == ["$.a[1]: nan", "$.a[2].b: -inf", "$.c[0]: inf"]
    assert NON_FINITE_NOTE not in _strict(json_text({"x": 1.0}))
    assert _strict(json_text([float("nan")])) == [None]
