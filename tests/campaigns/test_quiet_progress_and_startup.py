"""The user's path, round 5: ``--quiet`` as a level (every warning and error whole, nothing else), the
calibration-data flags that point at each other, progress on folder work, a command line that answers without
importing torch, and the smaller refusals and messages.

Commands run in-process through ``fp4pass.cli.main`` on the bundled models and the third-party NVFP4 fixtures,
except the start-up checks, which need a fresh interpreter."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from checkpoint_oracles import moe_checkpoint, rewrite_shard
from cli_helpers import cli, one_line, run_cli

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "models"
MOE, CALIB = MODELS / "moe.onnx", MODELS / "calib.npz"
KIMI = MODELS / "checkpoints" / "deepseek_v3"
TOKENS = MODELS / "checkpoints" / "calib_tokens.npz"
THIRD_PARTY = ROOT / "tests" / "fixtures" / "nvfp4_thirdparty"
ENGINES = ("vllm", "sglang", "trtllm")


@pytest.fixture
def work(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


# -- --quiet is a level, decided where a message is made ---------------------------------------------------------


def test_quiet_inspect_of_a_broken_nvfp4_folder_names_its_problem(work, capsys):
    """A zero input_scale planted in one expert: exit 1, and under --quiet the problem line is still printed,
    naming the kind and the tensor that was changed."""
    from safetensors.torch import load_file, save_file

    folder = work / "broken"
    shutil.copytree(THIRD_PARTY / "modelopt_qwen3_moe", folder)
    planted = "model.layers.0.mlp.experts.1.down_proj.input_scale"
    tensors = load_file(folder / "model.safetensors")
    tensors[planted] = torch.zeros((), dtype=torch.float32)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    code, loud, _ = run_cli(capsys, "inspect", folder)
    assert code == 1 and "zero_scale" in loud
    code, out, err = run_cli(capsys, "inspect", folder, "--quiet")
    assert code == 1, err
    shown = [line for line in (out + err).splitlines() if "zero_scale" in line]
    assert len(shown) == 1 and planted in shown[0] and "1 problem(s):" in out
    assert "engine" not in out.split("1 problem(s):")[0], "the engine table is info: hidden"


def test_quiet_inspect_shows_every_warning_it_counts(work, capsys):
    """ModelOpt's gpt-oss export: no engine loads its fused scale keys, three warnings, exit 0; --quiet prints
    the count and each of the three warnings, one per engine, not the count alone."""
    code, out, err = run_cli(capsys, "inspect", THIRD_PARTY / "modelopt_gpt_oss", "--quiet")
    assert code == 0 and err == ""
    lines = out.strip().splitlines()
    assert lines[0] == "3 warning(s) (exit 0 unless --strict):", out
    assert [line.split(":")[0].strip() for line in lines[1:]] == [f"engine_cannot_load [{e}]" for e in ENGINES]


@pytest.fixture
def one_nan_expert(tmp_path):
    """A DeepSeek-form MoE whose expert 1 has an E8M0 255 (NaN) in w2's scales: --allow-partial leaves it MXFP4."""
    src = moe_checkpoint(tmp_path / "src", "deepseek", experts=2)
    name = "model.layers.0.mlp.experts.1.w2.scale"

    def edit(t):
        t[name] = t[name].clone()
        t[name].view(torch.uint8).view(-1)[5] = 255
    rewrite_shard(src / "model.safetensors", edit)
    return src, "model.layers.0.mlp.experts.1.w2.weight"


def test_quiet_keeps_the_weights_allow_partial_left_in_mxfp4(one_nan_expert, work, capsys):
    src, declined = one_nan_expert
    code, out, err = run_cli(capsys, "convert", src, "-o", "out", "--allow-partial", "--quiet")
    assert code == 0, err
    assert out.strip().splitlines() == [line for line in out.strip().splitlines() if line.startswith("declined")]
    assert len(out.strip().splitlines()) == 1 and f"declined, left in its MXFP4 form: {declined} " in out
    assert "weights converted" not in out + err, "the summary is info"


def test_quiet_hides_a_passed_check_and_the_table(work, capsys):
    code, out, err = run_cli(capsys, "convert", KIMI, "-o", "out", "--check", "--quiet")
    assert (code, out, err) == (0, "", "")
    code, out, err = run_cli(capsys, "convert", KIMI, "-o", "out2", "--check")
    assert code == 0 and "check PASSED" in err and "lossless" in out


def test_quiet_keeps_a_failed_diffs_verdict(work, capsys):
    assert cli(capsys, "convert", MOE, "-o", "m.onnx", "--quiet")[0] == 0
    code, out, err = run_cli(capsys, "diff", MOE, "m.onnx", "--snr-min", "400", "--quiet")
    assert code == 1 and out == "" and one_line(err) == "fp4pass diff: FAILED (snr-min 400 dB)"


def test_quiet_goes_by_level_not_by_the_words_of_a_line(capsys):
    """Info that says "error" is hidden; a warning that says neither "error" nor "warning" is shown; a bare print
    (info) is hidden whatever it says; Python's warnings are warnings."""
    import warnings

    from fp4pass import messages

    with messages.shown_from(messages.Level.WARNING):
        messages.info("error: 3 warning(s) FAILED")
        print("warning: a bare print is info")
        print("error: on stderr too", file=sys.stderr)
        messages.warning("left in MXFP4: w2")
        messages.error("nothing converted")
        messages.result('{"problems": []}')
        warnings.warn("a library's own", UserWarning)
    captured = capsys.readouterr()
    assert captured.out == '{"problems": []}\n'
    assert captured.err.splitlines()[:2] == ["left in MXFP4: w2", "nothing converted"]
    assert "UserWarning: a library's own" in captured.err and "bare" not in captured.err + captured.out
    with messages.shown_from(messages.Level.INFO):
        messages.info("error: 3 warning(s) FAILED")
        print("a bare print")
    assert capsys.readouterr().out == "error: 3 warning(s) FAILED\na bare print\n"


def test_quiet_warns_when_no_engine_loads_the_output(work, capsys):
    """gpt-oss's fused experts in NVFP4: no engine's loader reads them yet. The verdict line is a warning there
    (shown under --quiet); with an engine that loads the output (Kimi above) it is info."""
    code, out, err = run_cli(capsys, "convert", MODELS / "checkpoints" / "gpt_oss", "-o", "out", "--quiet")
    assert code == 0 and out == ""
    line = one_line(err)
    assert line.startswith("fp4pass convert: engines: ")
    assert [f"{e} does not load" in line for e in ENGINES] == [True] * 3


# -- a command line that answers at once: nothing heavy imported before a command runs ----------------------------

#: what a command imports when it runs, never before (torch alone took 3-4 s to import on 2 shared cores)
HEAVY = ("torch", "numpy", "onnx", "onnxruntime", "safetensors", "transformers", "tqdm")
STARTUP_PROBE = """
import json, sys
from fp4pass.cli import main
seen = {}
for argv in json.loads(sys.argv[1]):
    try:
        main(argv)
    except SystemExit:
        pass
    seen[" ".join(argv)] = sorted(m for m in HEAVY if m in sys.modules)
sys.__stdout__.write("\\n" + json.dumps(seen))
"""


def test_version_help_and_typos_import_nothing_heavy():
    """``fp4pass --version``, ``--help``, ``convert --help``, every other command's --help, and typos (a command,
    a flag) in a fresh interpreter: ``sys.modules`` holds none of torch, numpy, onnx, ... after any of them."""
    import json

    argvs = [["--version"], ["--help"], ["convert", "--help"], ["convrt", "x"],
             ["convert", "m.onnx", "-o", "x.onnx", "--chek"],
             *([c, "--help"] for c in ("inspect", "calibrate", "diff", "study", "bench", "clean"))]
    probe = f"HEAVY = {HEAVY!r}\n" + STARTUP_PROBE
    done = subprocess.run([sys.executable, "-c", probe, json.dumps(argvs)], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert list(seen) == [" ".join(a) for a in argvs]
    assert seen == {" ".join(a): [] for a in argvs}, seen
    assert "unrecognized arguments: --chek (did you mean --check?)" in done.stderr
    assert "invalid choice: 'convrt'" in done.stderr and "(did you mean convert?)" in done.stderr


# -- calibration data: three names, each command's own, and the wrong one says which is right ---------------------


def _usage_error(err: str, prog: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith(f"usage: {prog} ") and "Traceback" not in err, err
    assert lines[1].startswith(f"{prog}: error: "), err
    return lines[1]


@pytest.mark.parametrize("argv, wrong, right", [
    (("calibrate", MOE, "--data", CALIB, "--calib", CALIB, "-o", "s.json"), "--calib", "--data DATA"),
    (("calibrate", MOE, "--calib", CALIB, "-o", "s.json"), "--calib", "--data DATA"),  # --data missing too
    (("calibrate", MOE, "--inputs", CALIB, "-o", "s.json"), "--inputs", "--data DATA"),
    (("convert", MOE, "-o", "x.onnx", "--data", CALIB), "--data", "--calib DATA"),
    (("convert", KIMI, "-o", "out", "--data=" + str(TOKENS)), "--data", "--calib DATA"),
    (("diff", MOE, MOE, "--calib", CALIB), "--calib", "--inputs DATA.npz"),
    (("diff", KIMI, KIMI, "--calib", TOKENS), "--calib", "--data DATA for checkpoint folders"),
])
def test_another_commands_data_flag_names_this_ones(work, capsys, argv, wrong, right):
    code, err = cli(capsys, *argv)
    line = _usage_error(err, f"fp4pass {argv[0]}")
    assert code == 2 and f"({wrong} is not a flag of this command: {argv[0]} takes " in line and right in line
    assert "invalid choice" not in line and not any((work / made).exists() for made in ("s.json", "x.onnx", "out"))


def test_flags_are_named_whole(work, capsys):
    """No abbreviation: ``--calib`` is never ``--calibrator``, ``--js`` never ``--json``."""
    code, err = cli(capsys, "calibrate", MOE, "--data", CALIB, "-o", "s.json", "--calib", "max")
    assert code == 2 and "unrecognized arguments: --calib max" in _usage_error(err, "fp4pass calibrate")
    code, err = cli(capsys, "inspect", MOE, "--js")
    assert code == 2 and "unrecognized arguments: --js (did you mean --json?)" in _usage_error(err, "fp4pass inspect")


def test_the_data_flag_of_the_other_input_kind_says_which_to_give(work, capsys):
    code, err = cli(capsys, "diff", MOE, MOE, "--data", CALIB)
    assert code == 2 and one_line(err).endswith("is not one (ONNX models take their inputs as --inputs DATA.npz)")
    code, err = cli(capsys, "convert", KIMI, "-o", "out", "--inputs", CALIB, "--check")
    assert code == 2 and one_line(err).endswith("(a checkpoint folder's calibration data is --calib DATA)")
    assert not (work / "out").exists()


# -- progress on folder work: bars on a terminal, a summary line without one ---------------------------------------


def _shard_data_bytes(folder: Path) -> int:
    """The bytes of every tensor in the folder's shards: each file less its 8-byte length and JSON header."""
    import struct

    total = 0
    for shard in folder.glob("*.safetensors"):
        with open(shard, "rb") as f:
            (header,) = struct.unpack("<Q", f.read(8))
        total += shard.stat().st_size - 8 - header
    return total


class _Bars:
    """Stands in for tqdm in fp4pass.progress: records each bar's description, total, updates and items."""

    made: list = []

    def __init__(self, iterable=None, total=None, desc="", disable=False, **kwargs):
        self.iterable, self.total, self.desc, self.disable, self.updates, self.items = (
            iterable, total, desc, disable, [], 0)
        _Bars.made.append(self)

    def __iter__(self):
        for item in self.iterable:
            self.items += 1
            yield item

    def update(self, n):
        self.updates.append(n)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_folder_convert_and_check_count_every_byte_and_unit(work, monkeypatch):
    import fp4pass.checkpoint
    import fp4pass.progress

    monkeypatch.setattr(fp4pass.progress, "tqdm", _Bars)
    monkeypatch.setattr(_Bars, "made", [])
    report = fp4pass.checkpoint.convert(KIMI, work / "out", check=True, show_progress=True)
    bars = {bar.desc: bar for bar in _Bars.made}
    assert sorted(bars) == ["check", "convert"] and not any(bar.disable for bar in bars.values())
    written = _shard_data_bytes(work / "out")
    assert bars["convert"].total == written == sum(bars["convert"].updates)
    assert bars["check"].total == bars["check"].items > 0
    assert report["check"]["experts_checked"] >= bars["check"].items  # a unit holds one expert or more


def test_progress_bars_on_a_terminal_and_a_summary_line_without(work, capsys, monkeypatch):
    code, out, err = run_cli(capsys, "convert", KIMI, "-o", "plain", "--check")
    assert code == 0 and "%|" not in err
    summary = [line for line in err.splitlines() if "weights converted" in line]
    assert len(summary) == 1 and summary[0].rpartition("; ")[2].endswith(" s")
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    code, out, err = run_cli(capsys, "convert", KIMI, "-o", "tty", "--check")
    assert code == 0 and "convert: 100%|" in err and "check: 100%|" in err
    assert err.index("convert: 100%|") < err.index("check:"), "the bytes are written before they are read back"
    code, out, err = run_cli(capsys, "convert", KIMI, "-o", "quiet", "--check", "--quiet")
    assert (code, out, err) == (0, "", "")


# -- the smaller items -----------------------------------------------------------------------------------------------


def _bundled_commands(doc: Path) -> list[list[str]]:
    """The words of each ``fp4pass calibrate|convert models/checkpoints/...`` line of ``doc``, in order."""
    import shlex

    found = []
    for line in doc.read_text().splitlines():
        line = line.strip().removeprefix(".venv/bin/")
        words = shlex.split(line, comments=True) if line.startswith("fp4pass ") else []
        if words[:1] == ["fp4pass"] and len(words) > 2 and words[2].startswith("models/checkpoints/"):
            found.append(words)
    return found


def test_docs_checkpoint_commands_run_after_the_readmes():
    """A reader runs the README's commands, then docs/checkpoint.md's, in one folder: a convert into an OUT_DIR
    that an earlier one wrote needs --overwrite (OUT_DIR must not exist otherwise)."""
    written, refused = set(), []
    commands = _bundled_commands(ROOT / "README.md") + _bundled_commands(ROOT / "docs" / "checkpoint.md")
    for words in commands:
        if words[1] != "convert":
            continue
        out = words[words.index("-o") + 1]
        if out in written and "--overwrite" not in words:
            refused.append(" ".join(words))
        written.add(out)
    assert len(commands) >= 6 and refused == []


@pytest.mark.parametrize("argv, flag", [
    (("calibrate", KIMI, "--data", TOKENS, "-o", "s.json", "--strict"), "--strict"),
    (("inspect", KIMI, "--allow-invalid"), "--allow-invalid"),
    (("inspect", THIRD_PARTY / "modelopt_qwen3_moe", "--allow-invalid"), "--allow-invalid"),
])
def test_onnx_only_flags_are_refused_for_folders(work, capsys, argv, flag):
    code, err = cli(capsys, *argv)
    assert code == 2 and one_line(err).startswith(f"fp4pass {argv[0]}: error: {flag} applies to ONNX models")
    assert not (work / "s.json").exists()


def test_a_calibration_report_given_as_scales_says_what_it_is(work, capsys):
    for model, data, out in ((MOE, CALIB, "x.onnx"), (KIMI, TOKENS, "out")):
        assert cli(capsys, "calibrate", model, "--data", data, "-o", "s.json", "--report", "r.json", "--quiet")[0] == 0
        code, err = cli(capsys, "convert", model, "-o", out, "--scales", "r.json")
        line = one_line(err)
        assert code == 2 and "r.json: a calibration report (what `fp4pass calibrate --report` writes" in line
        assert "pass the SCALES.json that calibrate wrote with -o" in line and not (work / out).exists()
        assert cli(capsys, "convert", model, "-o", out, "--scales", "s.json", "--quiet")[0] == 0  # the right one
        (work / "s.json").unlink()


def test_an_onnx_output_named_as_a_folder_says_to_name_the_file(work, capsys):
    code, err = cli(capsys, "convert", MOE, "-o", "newdir/")
    assert code == 2 and one_line(err) == ("fp4pass convert: error: -o newdir/: names a folder (it ends in /); an "
                                           "ONNX model converts into one file: give its name, e.g. -o "
                                           "newdir/moe.nvfp4.onnx, in a folder that exists")
    assert not (work / "newdir").exists()


@pytest.mark.parametrize("given, fetch", [("acme/absent@v2.1", "hf download acme/absent --revision v2.1 where"),
                                          ("acme/absent", "hf download acme/absent where")])
def test_the_offline_hub_hint_keeps_the_revision(work, capsys, monkeypatch, given, fetch):
    (work / "hub-cache").mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(work / "hub-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, err = cli(capsys, "inspect", given)
    assert code == 2 and fetch in one_line(err)


def provenance(path: Path) -> dict:
    import json
    from importlib.metadata import version

    who = json.loads(Path(path).read_text())["fp4pass"]
    assert who["version"] == version("fp4pass")
    return who


def test_every_json_written_names_fp4pass_the_command_and_the_source(work, capsys, monkeypatch):
    runs = [
        (("convert", MOE, "-o", "x.onnx", "--report", "c.json"), ["c.json"], str(MOE)),
        (("calibrate", MOE, "--data", CALIB, "-o", "s.json", "--report", "cr.json"), ["s.json", "cr.json"], str(MOE)),
        (("convert", KIMI, "-o", "out", "--report", "k.json"), ["k.json"], str(KIMI)),
        (("calibrate", KIMI, "--data", TOKENS, "-o", "ks.json", "--report", "kr.json"), ["ks.json", "kr.json"],
         str(KIMI)),
        (("diff", MOE, "x.onnx", "--json", "d.json"), ["d.json"], None),
    ]
    for argv, files, source in runs:
        assert cli(capsys, *argv, "--quiet")[0] == 0, argv
        for name in files:
            who = provenance(work / name)
            assert who["command"] == "fp4pass " + " ".join(map(str, argv)) + " --quiet"
            assert (who.get("source"), who.get("revision")) == (source, None), name
    from fp4pass.commands import study

    monkeypatch.setattr(study, "run_study", lambda device, show_progress=None: {"device": "cpu", "scenarios": []})
    assert cli(capsys, "study", "--json", "st.json", "--device", "cpu")[0] == 0
    assert provenance(work / "st.json")["command"] == "fp4pass study --json st.json --device cpu"


def test_a_hub_snapshot_is_named_by_its_id_and_commit():
    """The source as given (``org/name@rev``) and the commit of the snapshot folder it resolved to."""
    import argparse

    from fp4pass.commands.provenance import provenance

    args = argparse.Namespace(argv=["inspect", "acme/kimi@v2"], given_model="acme/kimi@v2",
                              model="/cache/models--acme--kimi/snapshots/0123abcd")
    assert provenance(args) == {"version": provenance(args)["version"], "command": "fp4pass inspect acme/kimi@v2",
                                "source": "acme/kimi@v2", "revision": "0123abcd"}
    args.given_model = args.model = "/data/kimi"
    assert provenance(args)["revision"] is None


def test_the_folder_convert_table_has_a_header_over_its_columns(work, capsys):
    code, out, _ = run_cli(capsys, "convert", KIMI, "-o", "out")
    header, first = out.splitlines()[:2]
    assert header.split()[:3] == ["weight", "experts", "global"] and header.endswith("SNR vs MXFP4")
    assert header.index("experts") == first.index("1/1 lossless")
    assert header.index("global scale") == first.index("S=")


def test_sub_folders_left_out_are_named(work, capsys):
    src = work / "deepseek_v3"
    shutil.copytree(KIMI, src)
    (src / "original").mkdir()
    (src / "original" / "consolidated.00.pth").write_bytes(b"x")
    code, out, err = run_cli(capsys, "convert", src, "-o", "out")
    assert code == 0 and "fp4pass convert: left out, not copied (sub-folders and special files): original/" in err
    assert not (work / "out" / "original").exists()


def test_the_documented_exit_status_is_importable_and_is_the_clis(work, capsys):
    """docs/checkpoint.md names ``exit_status``: the import it gives runs, and its value is inspect's exit code."""
    import re

    text = " ".join((ROOT / "docs" / "checkpoint.md").read_text().split())
    (statement,) = re.findall(r"`(from fp4pass\.checkpoint\.validate import exit_status)`", text)
    scope: dict = {}
    exec(statement, scope)  # noqa: S102 - the documentation's own line
    from fp4pass.checkpoint import validate

    for folder in (THIRD_PARTY / "modelopt_qwen3_moe", THIRD_PARTY / "modelopt_gpt_oss"):
        for strict in (False, True):
            code = cli(capsys, "inspect", folder, *(["--strict"] if strict else []))[0]
            assert scope["exit_status"](validate(folder), strict=strict) == code
    assert "fp4pass.checkpoint.validate.exit_status" not in text


def test_the_example_checkpoints_into_an_existing_folder_is_an_fp4pass_error_line(work, capsys):
    from fp4pass.examples.checkpoints import main

    (work / "taken").mkdir()
    (work / "taken" / "x").write_text("mine")
    with pytest.raises(SystemExit) as exited:
        main(["taken"])
    assert exited.value.code == 2
    assert one_line(capsys.readouterr().err) == "fp4pass examples.checkpoints: error: taken exists; give a new folder"
    assert (work / "taken" / "x").read_text() == "mine"


def test_quiet_inspect_of_a_broken_nvfp4_onnx_model_names_its_problem(work, capsys):
    """The ONNX side of the same: one expert's global scale planted at 0 (through onnx alone) in a W4A4 model
    fp4pass wrote; --quiet still prints the problem, and nothing else."""
    import onnx
    from onnx import numpy_helper

    assert cli(capsys, "convert", MOE, "-o", "clean.onnx", "--calib", CALIB, "--quiet")[0] == 0
    model = onnx.load("clean.onnx")
    (scale,) = [t for t in model.graph.initializer if t.name == "experts.w1_global_scale"]
    array = numpy_helper.to_array(scale).copy()
    array.reshape(-1)[2] = 0.0
    scale.CopyFrom(numpy_helper.from_array(array, scale.name))
    onnx.save(model, "planted.onnx")
    code, out, err = run_cli(capsys, "inspect", "planted.onnx", "--quiet")
    assert code == 1 and err == "" and out.startswith("1 problem(s):\n  zero_scale: experts.w1 global scale: 0.0 is 0")
    assert len(out.strip().splitlines()) == 2
