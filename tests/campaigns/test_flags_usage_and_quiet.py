"""The user's path through the command line: no flag is silently ignored, usage errors are short, and --quiet
means one thing on every command.

Every command runs in-process through ``fp4pass.cli.main`` on the bundled models."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from cli_helpers import cli, one_line, run_cli

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "models"
MOE, CALIB = MODELS / "moe.onnx", MODELS / "calib.npz"
KIMI = MODELS / "checkpoints" / "deepseek_v3"
TEXT = MODELS / "checkpoints" / "calib_text.jsonl"


@pytest.fixture
def work(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _usage_error(err: str, prog: str) -> str:
    """The two lines of a usage error: one line of usage, then the error; returns the error line."""
    lines = err.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith(f"usage: {prog} ") and "Traceback" not in err, err
    assert lines[1].startswith(f"{prog}: error: "), err
    return lines[1]


# -- usage errors ---------------------------------------------------------------------------------------------


def test_a_usage_error_is_one_line_of_usage_and_the_error(work, capsys):
    code, err = cli(capsys, "convert")
    line = _usage_error(err, "fp4pass convert")
    assert code == 2 and "IN, -o/--output" in line
    assert "usage: fp4pass convert IN -o OUT [options]" in err


def test_a_common_flag_before_the_subcommand_says_where_it_goes(work, capsys):
    for flag in ("--quiet", "--debug", "-v"):
        code, err = cli(capsys, flag, "convert", MOE, "-o", "x.onnx")
        line = _usage_error(err, "fp4pass")
        assert code == 2 and f"{flag} belongs after the subcommand: fp4pass convert {flag}" in line
    assert not (work / "x.onnx").exists()


def test_a_choice_with_underscores_gets_its_hyphenated_name(work, capsys):
    code, err = cli(capsys, "convert", KIMI, "-o", "out", "--format", "compressed_tensors")
    assert code == 2 and "(did you mean compressed-tensors?)" in _usage_error(err, "fp4pass convert")
    code, err = cli(capsys, "convert", MOE, "-o", "x.onnx", "--scale-form", "Alpha")
    assert code == 2 and "(did you mean alpha?)" in _usage_error(err, "fp4pass convert")
    code, err = cli(capsys, "convert", MOE, "-o", "x.onnx", "--scale-form", "zzz")
    assert code == 2 and "did you mean" not in err
    assert not (work / "out").exists() and not (work / "x.onnx").exists()


# -- no flag silently ignored ---------------------------------------------------------------------------------


@pytest.mark.parametrize("model, flags", [
    (MOE, ("--calibrator", "mse")), (MOE, ("--percentile", "99")), (MOE, ("--rho", "2")),
    (MOE, ("--margin", "1.5")), (KIMI, ("--seq-len", "32")), (KIMI, ("--num-samples", "3")),
    (KIMI, ("--calibrator", "headroom")),
])
def test_a_calibrator_flag_without_calib_is_refused(work, capsys, model, flags):
    code, err = cli(capsys, "convert", model, "-o", "out", *flags)
    assert code == 2 and f"{flags[0]} applies to calibration; add --calib DATA" in one_line(err)
    assert not (work / "out").exists()


def test_a_calibrator_flag_with_scales_is_refused_too(work, capsys):
    scales = work / "s.json"
    assert cli(capsys, "calibrate", MOE, "--data", CALIB, "-o", scales, "--quiet")[0] == 0
    code, err = cli(capsys, "convert", MOE, "-o", "x.onnx", "--scales", scales, "--calibrator", "mse")
    assert code == 2 and "--calibrator applies to calibration" in one_line(err)


@pytest.mark.parametrize("command, flags, owner", [
    ("convert", ("--percentile", "99"), "percentile"),  # the default calibrator is max
    ("convert", ("--calibrator", "headroom", "--percentile", "99"), "percentile"),
    ("calibrate", ("--calibrator", "max", "--rho", "3"), "headroom"),
    ("calibrate", ("--calibrator", "percentile", "--margin", "2"), "headroom"),
])
def test_an_option_of_another_calibrator_is_refused(work, capsys, command, flags, owner):
    where = ("-o", "x.onnx", "--calib", CALIB) if command == "convert" else ("--data", CALIB, "-o", "s.json")
    code, err = cli(capsys, command, MOE, *where, *flags)
    line = one_line(err)
    assert code == 2 and f"is an option of the {owner} calibrator" in line and f"--calibrator {owner}" in line
    assert not any(work.iterdir())


def test_the_chosen_calibrators_option_reaches_it(work, capsys):
    """percentile 50 of |x| lies below the max calibrator's amax: the option was read (an independent figure:
    numpy's own max of the calibration data's |x| bounds the first activation)."""
    assert cli(capsys, "calibrate", MOE, "--data", CALIB, "-o", "max.json", "--quiet")[0] == 0
    assert cli(capsys, "calibrate", MOE, "--data", CALIB, "-o", "p50.json", "--calibrator", "percentile",
               "--percentile", "50", "--quiet")[0] == 0
    by_max = json.loads((work / "max.json").read_text())["tensors"]["x_e"]["g_amax"]
    by_p50 = json.loads((work / "p50.json").read_text())["tensors"]["x_e"]["g_amax"]
    assert by_max == pytest.approx(float(np.abs(np.load(CALIB)["x"]).max()), rel=1e-6)
    assert by_p50 < by_max / 2


# -- --quiet: warnings and errors only, on every command -------------------------------------------------------


@pytest.mark.parametrize("argv", [
    ("convert", MOE, "-o", "x.onnx", "--check"),
    ("convert", MOE, "-o", "x.onnx", "--calib", CALIB, "--report", "r.json"),
    ("calibrate", MOE, "--data", CALIB, "-o", "s.json"),
    ("inspect", MOE),
    ("inspect", KIMI),
    ("diff", MOE, MOE),
    ("convert", KIMI, "-o", "out", "--format", "compressed-tensors"),
])
def test_quiet_prints_nothing_on_success(work, capsys, argv):
    code, out, err = run_cli(capsys, *argv)
    assert code == 0 and (out or err), "without --quiet the command says something"
    for made in ("x.onnx", "r.json", "s.json", "out"):
        if (work / made).is_dir():
            import shutil

            shutil.rmtree(work / made)
        elif (work / made).exists():
            (work / made).unlink()
    code, out, err = run_cli(capsys, *argv, "--quiet")
    assert (code, out, err) == (0, "", "")


def test_quiet_keeps_the_failures_and_the_json_asked_for(work, capsys):
    code, out, err = run_cli(capsys, "convert", MOE, "-o", "x.onnx", "--check", "--snr-min", "400", "--quiet")
    assert code == 1 and out == ""
    assert "check FAILED: output 'y' SNR" in err and "< 400 dB" in err
    code, out, err = run_cli(capsys, "inspect", MOE, "--json", "--quiet")
    assert code == 0 and err == "" and json.loads(out)["summary"]["tensors"] == 2
    code, err = cli(capsys, "convert", MOE, "-o", "x.onnx", "--snr-min", "3", "--quiet")
    assert code == 2 and "--snr-min applies to --check" in one_line(err)


@pytest.mark.parametrize("command", ["convert", "inspect", "calibrate", "diff", "study", "bench", "clean"])
def test_quiet_says_what_it_means_in_every_commands_help(capsys, command):
    with pytest.raises(SystemExit):
        from fp4pass.cli import main

        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--quiet warnings and errors only, on every command" in text


def test_quiet_with_debug_keeps_the_whole_traceback(work, capsys):
    code, err = cli(capsys, "convert", MOE, "-o", "x.onnx", "--snr-min", "3", "--quiet", "--debug")
    assert code == 2 and err.startswith("Traceback (most recent call last):")
    assert 'File "' in err and err.strip().splitlines()[-1].endswith("--snr-min applies to --check; add --check")


def test_python_convert_of_an_nvfp4_model_says_it_is_nvfp4_already():
    """fp4pass.onnx.convert on its own output (the dq and alpha forms, weight-only and with activation
    quantizers) names the form, as the command does, instead of "no MXFP4 weights found"."""
    import fp4pass
    from fp4pass.errors import UsageError

    root = Path(__file__).resolve().parents[2] / "models"
    for options, words in (({}, "dq form, W4A16"), ({"scale_form": "alpha"}, "alpha form, W4A16"),
                           ({"calib": str(root / "calib.npz")}, "dq form, W4A4")):
        model, _ = fp4pass.onnx.convert(str(root / "moe.onnx"), **options)
        with pytest.raises(UsageError, match="already NVFP4") as exc:
            fp4pass.onnx.convert(model)
        assert words in str(exc.value) and "fp4pass inspect" in str(exc.value)
