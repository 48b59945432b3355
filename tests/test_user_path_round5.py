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

from tests.checkpoint_oracles import moe_checkpoint, rewrite_shard
from tests.cli_helpers import cli, one_line, run_cli

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "models"
MOE, CALIB = MODELS / "moe.onnx", MODELS / "calib.npz"
KIMI = MODELS / "checkpoints" / "kimi"
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
             ["convert", "m.onnx", "-o", "x.onnx", "--chek"], *([c, "--help"] for c in ("inspect", "calibrate", "diff", "study", "bench", "clean"))]
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
