"""Checkpoint conversion on the kinds of input real models have: Hugging Face expert naming, a lossy gate/up pair,
two lossy experts of one stack, broken units, files beside the shards, sizes and folders at their limits.

Oracles: the safetensors package reads every output; numpy + ml_dtypes decode the MXFP4 source and the NVFP4
output (tests/support/checkpoint_oracles.py); plain NVFP4 requantization in numpy is the bound for lossy experts. The
inputs are built with numpy and the safetensors package (``moe_checkpoint``), never with fp4pass.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import struct
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import fp4pass.checkpoint
from checkpoint_oracles import (EXPERTS_PREFIX, Folder, as_bytes, expert_modules, moe_checkpoint, mx_decode,
                                nv_decode, requant_sse, rewrite_shard, snr_db, source_linear, tree_hash)
from cli_helpers import nothing_left, run_cli
from fp4pass.checkpoint import CheckFailed
from fp4pass.io import TMP_PREFIX, host_token

pytest.importorskip("safetensors")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))




def _scales(modules: list[tuple[str, str, str]]):
    """Activation scales: every gate, up and down of its own value (up above its gate)."""
    from fp4pass.calib import ActivationScales
    from fp4pass.calib.scales import ActivationScale

    values = {}
    for e, (gate, up, down) in enumerate(modules):
        values.update({gate: 0.25 * (e + 1), up: 0.25 * (e + 1) + 0.125, down: 2.0 + e})
    return ActivationScales("max", {k: ActivationScale(amax=v * 2688, g_amax=v * 2688, input_scale=v, b_min=0.0,
                                                       b_max=1.0, blocks=1) for k, v in values.items()}), values


# -- gate/up pairs, in both namings, lossless and lossy --------------------------------------------------------

PAIR_INPUTS = [("compressed-tensors", "w", None), ("compressed-tensors", "hf", None), ("deepseek", "hf", None),
               ("compressed-tensors", "hf", {(1, "gate"): 1}), ("deepseek", "w", {(0, "gate"): 2})]


@pytest.mark.parametrize("form,naming,lossy", PAIR_INPUTS,
                         ids=[f"{f}-{n}-{'lossy' if lo else 'lossless'}" for f, n, lo in PAIR_INPUTS])
def test_gate_and_up_share_their_scales(tmp_path, form, naming, lossy):
    """w1/w3 and gate_proj/up_proj of one expert pair: one weight_scale_2 (the pair's k_max - 8 where the pair is
    lossless; one searched value where it is not) and one input_scale (the larger of the two); each member is
    the source exactly where the pair's blocks fit E4M3's window, else no worse than plain requantization."""
    experts = 2
    src = moe_checkpoint(tmp_path / "src", form, naming, experts=experts, lossy=lossy)
    modules = expert_modules(naming, experts)
    scales, values = _scales(modules)
    report = fp4pass.checkpoint.convert(src, tmp_path / "out", scales=scales)
    out = Folder(tmp_path / "out")
    entries = {t["name"]: t for t in report["tensors"]}
    for gate, up, down in modules:
        assert entries[gate].get("shares_scales_with") == up and entries[up].get("shares_scales_with") == gate
        assert "shares_scales_with" not in entries[down]
        s_gate, s_up = (float(out.get(f"{m}.weight_scale_2")) for m in (gate, up))
        assert s_gate == s_up
        assert float(out.get(f"{gate}.input_scale")) == float(out.get(f"{up}.input_scale")) == values[up]
        assert float(out.get(f"{down}.input_scale")) == values[down]
        (cg, eg), (cu, eu) = source_linear(src, gate), source_linear(src, up)
        both = np.concatenate([eg, eu]).astype(int)
        assert int(eg.max()) < int(eu.max())  # the pair's scale is not the gate's own
        pair_lossless = both.max() - both.min() <= 17
        if pair_lossless:
            assert s_gate == math.ldexp(1.0, int(both.max()) - 127 - 8)
        for module, codes, e8m0 in ((gate, cg, eg), (up, cu, eu)):
            x = mx_decode(codes, e8m0)
            y = nv_decode(as_bytes(out.get(f"{module}.weight")), as_bytes(out.get(f"{module}.weight_scale")), s_gate)
            if pair_lossless:
                np.testing.assert_array_equal(y, x, err_msg=module)
            else:
                assert float(((y - x) ** 2).sum()) <= requant_sse(x), module
    assert (report["summary"]["experts_lossless"] < report["summary"]["experts_total"]) == bool(lossy)


# -- inspect's forecast is what convert achieves --------------------------------------------------------------

FORECAST_INPUTS = [("compressed-tensors", "w", None), ("compressed-tensors", "hf", {(1, "gate"): 1}),
                   ("deepseek", "hf", {(0, "down"): 1, (1, "up"): 3}),
                   ("gpt-oss", "w", {(0, "gate"): 1, (2, "up"): 4}), ("gpt-oss", "w", {(3, "down"): 2})]


def _forecast_cases():
    cases = [pytest.param(("built", *c), id=f"{c[0]}-{c[1]}-{len(c[2] or {})}lossy") for c in FORECAST_INPUTS]
    for folder in ("models/tiny_gpt_oss", "models/checkpoints/deepseek_v3", "models/checkpoints/deepseek"):
        cases.append(pytest.param(("bundled", folder), id=folder.rpartition("/")[2]))
    return cases


def _source_scales(src, info_weight: dict) -> np.ndarray:
    f = Folder(src)
    name = info_weight["name"]
    if info_weight["form"] == "gpt-oss":
        return as_bytes(f.get(f"{name}_scales" if len(info_weight["shape"]) == 3 else f"{name}.weight_scales"))
    return source_linear(src, name)[1]


@pytest.mark.parametrize("case", _forecast_cases())
def test_inspect_forecasts_what_convert_achieves(tmp_path, case):
    """Per weight (per expert of a stack), inspect's lossless forecast equals what convert reports; it comes from
    the scales exactly where every block of the unit is within 17 octaves, else from the codes. Each Linear
    shows its own spread, and a gate/up pair's members show the spread they share, in the JSON and the table."""
    if case[0] == "built":
        _, form, naming, lossy = case
        src = moe_checkpoint(tmp_path / "src", form, naming, experts=4, lossy=lossy)
    else:
        src = os.path.join(ROOT, case[1])
    info = fp4pass.checkpoint.inspect(src)
    report = fp4pass.checkpoint.convert(src, tmp_path / "out", input_scale=0.0123)  # DeepSeek-V4's form is W4A4
    achieved = {t["name"]: t for t in report["tensors"]}
    weights = {w["name"]: w for w in info["weights"]}
    assert set(weights) == set(achieved)
    table = fp4pass.checkpoint.format_inspection(info).splitlines()
    for name, w in weights.items():
        t = achieved[name]
        assert w["experts_lossless_forecast"] == t["experts_lossless"], name
        if "per_expert" in t:
            assert w["per_expert_lossless_forecast"] == [p["lossless"] for p in t["per_expert"]], name
        e8m0 = _source_scales(src, w).astype(int)
        assert w["spread"] == e8m0.max() - e8m0.min(), name
        row = next(line.split() for line in table if line.split()[0] == name)
        assert row[3] == str(w["spread"]), row
        if "shares_scales_with" in t:
            other = _source_scales(src, weights[t["shares_scales_with"]]).astype(int)
            shared = max(e8m0.max(), other.max()) - min(e8m0.min(), other.min())
            assert w["shared_spread"] == shared and row[4] == str(shared), row
        else:
            shared = w["spread"]
            assert "shared_spread" not in w and row[4] == "-", row
        assert w["forecast_from"] == ("scales" if shared <= 17 else "codes"), name
        assert row[6] == w["forecast_from"]
    assert info["summary"]["experts_lossless_forecast"] == report["summary"]["experts_lossless"]
    assert info["summary"]["experts_total"] == report["summary"]["experts_total"]


# -- a stack's figures are its worst expert's -----------------------------------------------------------------


def test_a_stack_reports_its_worst_expert(tmp_path):
    """Two lossy experts of one gpt-oss stack, one low block against four: their SNRs differ, each expert's
    figure is the one measured on the written bytes, and the stack's SNR is the worse one."""
    src = moe_checkpoint(tmp_path / "src", "gpt-oss", experts=4, lossy={(0, "gate"): 1, (2, "up"): 4})
    report = fp4pass.checkpoint.convert(src, tmp_path / "out")
    stack = f"{EXPERTS_PREFIX}.gate_up_proj"
    entry = next(t for t in report["tensors"] if t["name"] == stack)
    source, out = Folder(src), Folder(tmp_path / "out")
    blocks, e8m0 = as_bytes(source.get(f"{stack}_blocks")), as_bytes(source.get(f"{stack}_scales"))
    codes = blocks.reshape(*blocks.shape[:2], -1)
    w, s = as_bytes(out.get(stack)), as_bytes(out.get(f"{stack}_weight_scale"))
    s2 = float(out.get(f"{stack}_weight_scale_2"))
    measured = {}
    for e in range(4):
        x, y = mx_decode(codes[e], e8m0[e]), nv_decode(w[e].T, s[e].T, s2)
        part = entry["per_expert"][e]
        if np.array_equal(x, y):
            assert part["lossless"] and part["snr_db"] is None, e
        else:
            measured[e] = snr_db(x, y)
            assert part["snr_db"] == pytest.approx(measured[e], rel=1e-9), e
    assert sorted(measured) == [0, 2] and abs(measured[0] - measured[2]) > 1
    assert entry["snr_db"] == pytest.approx(min(measured.values()), rel=1e-9)
    assert entry["experts_lossless"] == 2 and not entry["lossless"]


# -- --check against plain requantization ---------------------------------------------------------------------


def test_check_fails_a_lossy_expert_worse_than_requantization(tmp_path, monkeypatch):
    """A lossy gate whose written codes lose its first 8 rows (more error than plain requantization of the gate/up
    pair under the one global scale they share, which the test measures with its own oracle) fails --check,
    naming that pair and nothing else; the same input converted as fp4pass converts it passes."""
    pytest.importorskip("compressed_tensors")
    from fp4pass.checkpoint import engine

    src = moe_checkpoint(tmp_path / "src", "deepseek", "hf", experts=2, lossy={(1, "gate"): 1})
    gate, up, _ = expert_modules("hf", 2)[1]
    assert fp4pass.checkpoint.convert(src, tmp_path / "good", check=True)["check"]["passed"]
    real = engine.convert_linears
    seen = {}

    def damaged(catalog, linears, method, **options):
        conv = real(catalog, linears, method, **options)
        if linears[0].module == gate:
            conv.codes[0, :8] = 0  # the gate's rows 0-7: every element 0
            xs = [mx_decode(*source_linear(src, m)) for m in (gate, up)]
            ys = [nv_decode(conv.codes[i].numpy(), as_bytes(conv.scales[i]), conv.global_scale) for i in (0, 1)]
            seen["sse"] = sum(float(((y - x) ** 2).sum()) for x, y in zip(xs, ys))
            seen["requant"] = requant_sse(np.concatenate(xs))  # the pair's, under one scale from its joint amax
        return conv

    monkeypatch.setattr(engine, "convert_linears", damaged)
    with pytest.raises(CheckFailed) as failed:
        fp4pass.checkpoint.convert(src, tmp_path / "out", check=True)
    assert seen["sse"] > 2 * seen["requant"] > 0  # truly worse than requantization
    failures = failed.value.report["check"]["failures"]
    assert [f["expert"] for f in failures] == [f"{gate}+up_proj"]
    assert "above plain requantization" in failures[0]["reason"]
    nothing_left(tmp_path / "out")


# -- every unit all or nothing --------------------------------------------------------------------------------

E1 = f"{EXPERTS_PREFIX}.1"


def _v4_header(t):  # w1 [I, H/2] written as [I/2, H]: the same bytes, shapes that do not fit its scales
    t[f"{E1}.w1.weight"] = t[f"{E1}.w1.weight"].reshape(-1, t[f"{E1}.w1.weight"].shape[1] * 2)


def _nan(name):
    def edit(t):
        t[name] = t[name].clone()
        t[name].view(torch.uint8).view(-1)[5] = 255
    return edit


def _drop(name):
    return lambda t: t.pop(name)


# (id, form, fp4 config, edit, the tensor the error names, the codes tensors declined: those that cannot
# convert, then the other halves of their gate/up pairs)
BROKEN = [
    ("deepseek-v4-header", "deepseek", True, _v4_header, f"{E1}.w1.weight", [f"{E1}.w1.weight", f"{E1}.w3.weight"]),
    ("deepseek-scale-missing", "deepseek", True, _drop(f"{E1}.w3.scale"), f"{E1}.w3.weight",
     [f"{E1}.w3.weight", f"{E1}.w1.weight"]),
    ("deepseek-scale-missing-config-silent", "deepseek", False, _drop(f"{E1}.w2.scale"), f"{E1}.w2.scale",
     [f"{E1}.w2.weight"]),
    ("compressed-tensors-scale-missing", "compressed-tensors", True, _drop(f"{E1}.w2.weight_scale"),
     f"{E1}.w2.weight_scale", [f"{E1}.w2.weight_packed"]),
    ("gpt-oss-scales-missing", "gpt-oss", True, _drop(f"{EXPERTS_PREFIX}.down_proj_scales"),
     f"{EXPERTS_PREFIX}.down_proj_scales", [f"{EXPERTS_PREFIX}.down_proj_blocks"]),
    ("deepseek-expert-cannot-convert", "deepseek", True, _nan(f"{E1}.w2.scale"), f"{E1}.w2.scale",
     [f"{E1}.w2.weight"]),
    ("gpt-oss-stack-cannot-convert", "gpt-oss", True, _nan(f"{EXPERTS_PREFIX}.gate_up_proj_scales"),
     f"{EXPERTS_PREFIX}.gate_up_proj_scales", [f"{EXPERTS_PREFIX}.gate_up_proj_blocks"]),
]


@pytest.fixture(params=BROKEN, ids=[b[0] for b in BROKEN])
def broken(request, tmp_path):
    _, form, fp4_config, edit, named, declined = request.param
    src = moe_checkpoint(tmp_path / "src", form, experts=2, fp4_config=fp4_config)
    rewrite_shard(src / "model.safetensors", edit)
    return src, named, declined


def test_a_unit_that_cannot_convert_is_exit_2_naming_it(broken, tmp_path, capsys):
    src, named, _ = broken
    before = tree_hash(src)
    code, _, err = run_cli(capsys, "convert", src, "-o", tmp_path / "out")
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert named in lines[0] and "model.safetensors" in lines[0] and "--allow-partial" in lines[0], lines[0]
    nothing_left(tmp_path / "out")
    assert tree_hash(src) == before


def test_allow_partial_copies_the_unit_and_names_it(broken, tmp_path, capsys):
    """--allow-partial: the declined codes (and their scales, where there are) are the source's bytes in the
    output, named in the printed summary and in the report with their shard and reason; everything else is
    converted."""
    src, named, declined = broken
    report_path = tmp_path / "r.json"
    code, out, err = run_cli(capsys, "convert", src, "-o", tmp_path / "out", "--allow-partial", "--report", report_path)
    assert code == 0, err
    report = json.loads(report_path.read_text())
    assert [d["tensor"] for d in report["declined"]] == declined
    assert all(d["shard"] == "model.safetensors" and d["reason"] for d in report["declined"])
    assert any(named in d["reason"] or named == d["tensor"] for d in report["declined"])
    for name in declined:
        assert f"declined, left in its MXFP4 form: {name}" in out
    assert f"{len(declined)} MXFP4 weight(s) declined" in err
    source, result = Folder(src), Folder(tmp_path / "out")
    for name in source.keys():
        module = name.rpartition(".")[0] if "_proj_" not in name else name.rpartition("_")[0]
        if any(d.startswith(module) for d in declined):  # the declined units' tensors, as they were
            assert as_bytes(result.get(name)).tobytes() == as_bytes(source.get(name)).tobytes(), name
    converted = {t["name"] for t in report["tensors"]}
    assert converted and not any(d.startswith(c + ".") or d.startswith(c + "_") for c in converted
                                 for d in declined)
    assert report["summary"]["experts_lossless"] == report["summary"]["experts_total"]


def test_no_mxfp4_weight_is_left_in_the_output_in_silence(tmp_path, monkeypatch):
    """The last guard: a unit dropped from the conversion without a decline (an fp4pass bug) is found in the
    written shards and stops the run (not bad input: RuntimeError, exit 3), leaving nothing."""
    import fp4pass.checkpoint.run as run

    src = moe_checkpoint(tmp_path / "src", "deepseek", experts=2)
    real, calls = run.detect, {"n": 0}

    def forgets_a_unit(tensors, config):
        found = real(tensors, config)
        calls["n"] += 1
        if calls["n"] == 1:  # the source: w2 of expert 1 neither converted nor declined
            unit = next(u for u in found.units if getattr(u, "module", "") == f"{E1}.w2")
            found.units.remove(unit)
            found.consumed.difference_update(unit.consumed)
        return found

    monkeypatch.setattr(run, "detect", forgets_a_unit)
    with pytest.raises(RuntimeError, match=rf"tensor '{E1}.w2.weight' is still an MXFP4 weight"):
        fp4pass.checkpoint.convert(src, tmp_path / "out")
    nothing_left(tmp_path / "out")


# -- the folder: index, JSON, files beside the shards ---------------------------------------------------------


def _sharded(tmp_path, **kwargs):
    return moe_checkpoint(tmp_path / "src", "compressed-tensors", experts=2, shards=2, **kwargs)


def _dup_config(src):
    text = (src / "config.json").read_text()
    (src / "config.json").write_text(text[:-1] + ', "hidden_size": 32}')
    return "config.json", "'hidden_size'"


def _dup_index(src):
    path = src / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    first = next(iter(index["weight_map"]))
    text = json.dumps(index)
    path.write_text(text.replace('"weight_map": {', f'"weight_map": {{"{first}": "model-00002-of-00002.safetensors", '))
    return "model.safetensors.index.json", repr(first)


def _dup_header(src):
    shard = src / "model-00001-of-00002.safetensors"
    data = shard.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    name = next(k for k in header if k != "__metadata__")
    entry = json.dumps({name: header[name]})[1:-1]
    text = ("{" + entry + "," + json.dumps(header)[1:]).encode()
    shard.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + n:])
    return shard.name, repr(name)


def _index_names_nothing(src):
    path = src / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    ghost = f"{EXPERTS_PREFIX}.7.w1.weight_packed"
    index["weight_map"][ghost] = "model-00001-of-00002.safetensors"
    path.write_text(json.dumps(index))
    return "model.safetensors.index.json", repr(ghost)


def _index_names_a_missing_shard(src):
    path = src / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    index["weight_map"][f"{EXPERTS_PREFIX}.7.w1.weight_packed"] = "model-00003-of-00002.safetensors"
    path.write_text(json.dumps(index))
    return "model-00003-of-00002.safetensors", "cannot be read"


@pytest.mark.parametrize("damage", [_dup_config, _dup_index, _dup_header, _index_names_nothing,
                                    _index_names_a_missing_shard],
                         ids=["duplicate-key-config", "duplicate-key-index", "duplicate-key-shard-header",
                              "index-tensor-in-no-shard", "index-shard-missing"])
def test_a_folder_that_lies_is_refused(tmp_path, capsys, damage):
    src = _sharded(tmp_path)
    where, what = damage(src)
    for command in (("convert", src, "-o", tmp_path / "out"), ("inspect", src)):
        code, _, err = run_cli(capsys, *command)
        assert code == 2, err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and where in lines[0] and what in lines[0], lines
    nothing_left(tmp_path / "out")


@pytest.mark.parametrize("fmt", ["modelopt", "compressed-tensors"])
def test_files_beside_the_shards(tmp_path, fmt):
    """A stray shard the index does not name is neither read nor copied, and is reported; the source's own
    hf_quant_config.json (a producer's, here claiming FP8) never replaces ours, nor appears in a
    compressed-tensors output; other files are copied as they are."""
    theirs = json.dumps({"producer": {"name": "someone"}, "quantization": {"quant_algo": "FP8"}})
    src = _sharded(tmp_path, files={"hf_quant_config.json": theirs, "notes.txt": "kept as it is"})
    stray = src / "model-old.safetensors"
    shutil.copy(src / "model-00001-of-00002.safetensors", stray)
    report = fp4pass.checkpoint.convert(src, tmp_path / "out", format=fmt)
    out = tmp_path / "out"
    assert not (out / stray.name).exists() and report["not_copied"] == [stray.name]
    assert fp4pass.checkpoint.inspect(src)["not_copied"] == [stray.name]
    assert (out / "notes.txt").read_text() == "kept as it is"
    assert stray.name not in report["files_copied"] and "hf_quant_config.json" not in report["files_copied"]
    if fmt == "modelopt":
        ours = json.loads((out / "hf_quant_config.json").read_text())
        assert ours["quantization"]["quant_algo"].endswith("NVFP4") and ours["producer"]["name"] == "fp4pass"
    else:
        assert not (out / "hf_quant_config.json").exists()


@pytest.mark.parametrize("limit", [1, 3000])
def test_shards_are_numbered_from_one_and_never_empty(tmp_path, limit):
    """A --max-shard-size below the first unit: that unit gets a shard of its own (no empty shard before it);
    every shard holds whole units; names count from model-00001-of-N."""
    src = moe_checkpoint(tmp_path / "src", "deepseek", experts=2)
    report = fp4pass.checkpoint.convert(src, tmp_path / "out", max_shard_bytes=limit)
    out = Folder(tmp_path / "out")
    n = len(out.files)
    assert n > 2 and sorted(out.files) == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert [s["file"] for s in report["shards"]] == sorted(out.files)
    counts = {f: sum(1 for w in out.where.values() if w == f) for f in out.files}
    assert min(counts.values()) >= 1, counts
    for gate, up, down in expert_modules("w", 2):  # a unit is never split; w1 and w3 are one unit
        assert len({out.where[f"{m}.{p}"] for m in (gate, up) for p in ("weight", "weight_scale",
                                                                         "weight_scale_2")}) == 1
    if limit == 1:  # every unit and copied tensor alone: 2 pairs (6 tensors), 2 downs (3), 3 copies (1)
        assert sorted(counts.values()) == [1, 1, 1, 3, 3, 6, 6]
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == out.where


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_out_dir_mode_follows_the_umask(tmp_path, umask):
    """OUT_DIR and its files get the mode any program's mkdir and open give them (not the private 0700 the
    folder has while it is written)."""
    src = moe_checkpoint(tmp_path / "src", "deepseek", experts=1)
    old = os.umask(umask)
    try:
        fp4pass.checkpoint.convert(src, tmp_path / "out")
    finally:
        os.umask(old)
    assert os.stat(tmp_path / "out").st_mode & 0o777 == 0o777 & ~umask
    for path in (tmp_path / "out").iterdir():
        assert os.stat(path).st_mode & 0o777 == 0o666 & ~umask, path.name


_SLOW_CHILD = """
import pathlib, sys, time
import fp4pass.checkpoint.engine as engine
real = engine.convert_linears
def slow(*args, **kwargs):
    out = real(*args, **kwargs)
    pathlib.Path(sys.argv[3]).touch()
    time.sleep(600)
    return out
engine.convert_linears = slow
from fp4pass.cli import main
sys.exit(main(["convert", sys.argv[1], "-o", sys.argv[2]]))
"""


def test_a_dead_runs_temporary_folder_is_removed(tmp_path):
    """A run killed (SIGKILL) while it writes leaves its temporary folder beside OUT_DIR. A run started while it
    still lived leaves it alone; the next run after its death removes it. A folder of the user's named like a
    temporary (no fp4pass marker inside) is never removed."""
    src = moe_checkpoint(tmp_path / "src", "deepseek", experts=2)
    parent = tmp_path / "outs"
    parent.mkdir()
    ready = tmp_path / "ready"
    child = subprocess.Popen([sys.executable, "-c", _SLOW_CHILD, str(src), str(parent / "a"), str(ready)], cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert child.poll() is None, child.stderr.read().decode()
            assert time.monotonic() < deadline
            time.sleep(0.1)
        live = [p for p in parent.iterdir() if p.name.startswith(TMP_PREFIX)]
        assert len(live) == 1 and live[0].is_dir()
        fp4pass.checkpoint.convert(src, parent / "b")  # while the first run lives
        assert live[0].exists()
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    # named as the dead run's temporaries are (its pid, this host), but not made by fp4pass
    mine = parent / f"{TMP_PREFIX}{child.pid}-h{host_token()}-0000-mine"
    mine.mkdir()
    (mine / "data.txt").write_text("the user's")
    assert live[0].exists() and not (parent / "a").exists()  # a dead run cannot clean up
    fp4pass.checkpoint.convert(src, parent / "c")
    assert not live[0].exists()
    assert (mine / "data.txt").read_text() == "the user's"
    assert sorted(p.name for p in parent.iterdir()) == sorted([mine.name, "b", "c"])
