"""Every file a command writes: never an input, checked before work, nothing left on a non-zero exit, modes."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from fp4pass.cli import main
from fp4pass.io import TMP_PREFIX

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "models"


def cli(capsys, *argv):
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:  # argparse's own usage errors
        code = exc.code
    captured = capsys.readouterr()
    return code, captured.err


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture
def work(tmp_path):
    """m.onnx, b.onnx (its conversion), calib.npz and s.json (a calibration) in a fresh folder."""
    shutil.copy(MODELS / "tiny_mlp.onnx", tmp_path / "m.onnx")
    shutil.copy(MODELS / "calib.npz", tmp_path / "calib.npz")
    assert main(["convert", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "b.onnx"), "--quiet"]) == 0
    assert main(["calibrate", str(tmp_path / "m.onnx"), "--data", str(tmp_path / "calib.npz"),
                 "-o", str(tmp_path / "s.json"), "--quiet"]) == 0
    return tmp_path


OVERWRITES = {
    "convert --report IN": ["convert", "m.onnx", "-o", "o.onnx", "--report", "m.onnx"],
    "convert -o CALIB": ["convert", "m.onnx", "-o", "calib.npz", "--calib", "calib.npz"],
    "convert --report CALIB": ["convert", "m.onnx", "-o", "o.onnx", "--calib", "calib.npz", "--report", "calib.npz"],
    "convert -o SCALES": ["convert", "m.onnx", "-o", "s.json", "--scales", "s.json"],
    "convert --report = -o": ["convert", "m.onnx", "-o", "o.onnx", "--report", "o.onnx"],
    "convert -o IN through ..": ["convert", "m.onnx", "-o", "sub/../m.onnx"],
    "calibrate -o DATA": ["calibrate", "m.onnx", "--data", "calib.npz", "-o", "calib.npz"],
    "calibrate --report IN": ["calibrate", "m.onnx", "--data", "calib.npz", "-o", "x.json", "--report", "m.onnx"],
    "diff --json A": ["diff", "m.onnx", "b.onnx", "--json", "m.onnx"],
    "diff --plot A (symlink)": ["diff", "m.onnx", "b.onnx", "--plot", "a_link.png"],
    "diff --json B (hardlink)": ["diff", "m.onnx", "b.onnx", "--json", "b_hard.json"],
}


@pytest.mark.parametrize("case", OVERWRITES)
def test_no_output_flag_can_name_an_input(work, capsys, monkeypatch, case):
    monkeypatch.chdir(work)
    (work / "sub").mkdir()
    os.symlink(work / "m.onnx", work / "a_link.png")
    os.link(work / "b.onnx", work / "b_hard.json")
    before = {p.name: p.read_bytes() for p in work.iterdir() if p.is_file()}
    code, err = cli(capsys, *OVERWRITES[case])
    line = one_line(err)
    assert code == 2 and ("refusing to write over the input" in line or "the same file as" in line), line
    assert {p.name: p.read_bytes() for p in work.iterdir() if p.is_file()} == before
    assert not (work / "o.onnx").exists() and not (work / "x.json").exists()


def test_plot_must_name_an_image_format(work, capsys):
    code, err = cli(capsys, "diff", work / "m.onnx", work / "b.onnx", "--plot", work / "x.txt")
    assert code == 2 and "give a .png file" in err and not (work / "x.txt").exists()
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib (the 'plot' extra)")
    code, err = cli(capsys, "diff", work / "m.onnx", work / "b.onnx", "--plot", work / "x.svg", "--quiet")
    assert code == 0 and (work / "x.svg").read_text().lstrip().startswith("<?xml")


@pytest.mark.parametrize("case", ["missing_folder", "output_is_dir", "report_missing_folder"])
def test_outputs_refused_before_any_work(work, capsys, monkeypatch, case):
    import fp4pass.pipeline as pipeline

    monkeypatch.setattr(pipeline, "convert", lambda *a, **k: pytest.fail("work started"))
    (work / "outdir").mkdir()
    args = {"missing_folder": ["-o", work / "nope" / "o.onnx"],
            "output_is_dir": ["-o", work / "outdir"],
            "report_missing_folder": ["-o", work / "o.onnx", "--report", work / "nope" / "r.json"]}[case]
    code, err = cli(capsys, "convert", work / "m.onnx", *args)
    line = one_line(err)
    assert code == 2 and ("does not exist" in line or "is a directory" in line)
    assert not (work / "o.onnx").exists() and os.listdir(work / "outdir") == []


def test_check_that_fails_removes_the_model_keeps_the_report(work, capsys):
    out, report = work / "o.onnx", work / "r.json"
    code, err = cli(capsys, "convert", work / "m.onnx", "-o", out, "--report", report, "--method", "requant",
                    "--check", "--snr-min", "60", "--quiet")
    assert code == 1 and not out.exists()
    assert "output 'y' SNR" in err and "< 60 dB" in err and "dB short" in err
    data = json.loads(report.read_text())
    assert data["check"]["passed"] is False and data["check"]["snr_min"] == 60
    code, _ = cli(capsys, "convert", work / "m.onnx", "-o", out, "--method", "requant", "--check", "--snr-min",
                  "60", "--keep-unchecked", "--quiet")
    assert code == 1 and out.exists()
    onnx.checker.check_model(str(out), full_check=True)


def test_default_check_threshold_flags_a_broken_conversion(work, capsys, monkeypatch):
    """Weight-only --check fails by default when the converted weights are wrong (here: scaled by 2)."""
    import fp4pass.pipeline as pipeline

    real = pipeline._check

    def broken_check(original, rewritten, provider, inputs=None, snr_min=None, **options):
        model = onnx.load(rewritten)
        for t in model.graph.initializer:
            if t.name.endswith("_global_scale"):
                arr = onnx.numpy_helper.to_array(t) * 2
                t.CopyFrom(onnx.numpy_helper.from_array(arr.astype(np.float32), t.name))
        broken = Path(rewritten).with_name("broken.onnx")
        onnx.save(model, broken)
        try:
            return real(original, str(broken), provider, inputs, snr_min, **options)
        finally:
            broken.unlink()

    monkeypatch.setattr(pipeline, "_check", broken_check)
    code, err = cli(capsys, "convert", work / "m.onnx", "-o", work / "o.onnx", "--check", "--quiet")
    assert code == 1 and "< 15 dB" in err and not (work / "o.onnx").exists()


def test_check_that_cannot_run_exits_2_and_leaves_no_model(work, capsys, monkeypatch):
    import fp4pass.pipeline as pipeline
    from fp4pass.errors import ModelError

    def failing(*args, **kwargs):
        raise ModelError("onnxruntime could not load the model: no kernel")

    monkeypatch.setattr(pipeline, "diff", failing)
    out = work / "o.onnx"
    code, err = cli(capsys, "convert", work / "m.onnx", "-o", out, "--report", work / "r.json", "--check")
    assert code == 2 and "--check could not run" in one_line(err)
    assert not out.exists() and not (work / "r.json").exists()
    code, err = cli(capsys, "convert", work / "m.onnx", "-o", out, "--check", "--keep-unchecked")
    assert code == 2 and out.exists()


def test_snr_min_needs_a_finite_number(work, capsys):
    for bad in ("nan", "inf", "-inf", "x"):
        code, err = cli(capsys, "diff", work / "m.onnx", work / "b.onnx", "--snr-min", bad)
        assert code == 2 and "--snr-min" in err
        code, err = cli(capsys, "convert", work / "m.onnx", "-o", work / "o.onnx", "--check", "--snr-min", bad)
        assert code == 2 and not (work / "o.onnx").exists()


def test_every_output_gets_the_models_mode(work, capsys):
    try:  # the plot extra; without it, no --plot
        import matplotlib  # noqa: F401

        plot = True
    except ImportError:
        plot = False
    old = os.umask(0o022)
    try:
        outs = [work / "o.onnx", work / "r.json", work / "s2.json", work / "d.json"] + ([work / "p.png"] if plot else [])
        assert main(["convert", str(work / "m.onnx"), "-o", str(outs[0]), "--report", str(outs[1]), "--quiet"]) == 0
        assert main(["calibrate", str(work / "m.onnx"), "--data", str(work / "calib.npz"), "-o", str(outs[2]),
                     "--quiet"]) == 0
        assert main(["diff", str(work / "m.onnx"), str(outs[0]), "--json", str(outs[3]), "--quiet",
                     *(["--plot", str(outs[4])] if plot else [])]) == 0
    finally:
        os.umask(old)
    assert {stat.S_IMODE(p.stat().st_mode) for p in outs} == {0o644}


def test_sigterm_is_handled_like_ctrl_c(work, capsys, monkeypatch):
    import fp4pass.onnx.loading as loading

    def killed(staged, path, allow_invalid):
        assert staged.parent.name.startswith(TMP_PREFIX)
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(loading, "_check_output", killed)
    code, err = cli(capsys, "convert", work / "m.onnx", "-o", work / "o.onnx", "--report", work / "r.json")
    assert code == 143 and "terminated" in err
    assert not [n for n in os.listdir(work) if n.startswith(TMP_PREFIX) or n in ("o.onnx", "r.json")]
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_clean_removes_what_a_killed_run_left(work, capsys):
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(proc.stdout)
    from fp4pass.io import host_token, write_marker

    stale = work / f"{TMP_PREFIX}{dead}-h{host_token()}-0000-o.onnx.d"
    stale.mkdir()
    (stale / "o.onnx.data").write_bytes(bytes(1000))
    write_marker(stale, pid=dead)
    code, err = cli(capsys, "clean", work)
    assert code == 0 and "removed 1 stale" in err and not stale.exists()


class _ClosedPipe:
    """A stdout whose reader has gone: every write raises BrokenPipeError, as a pipe into `head` does."""

    writes = 0

    def write(self, text):
        self.writes += 1
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self):
        raise BrokenPipeError(32, "Broken pipe")


def test_closed_stdout_is_quiet_and_keeps_the_exit_code(monkeypatch, capsys):
    pipe = _ClosedPipe()
    monkeypatch.setattr(sys, "stdout", pipe)
    assert main(["inspect", str(MODELS / "moe.onnx"), "--json"]) == 0
    assert pipe.writes == 1  # the first write failed; the rest were dropped, not retried
    err = capsys.readouterr().err
    assert "Traceback" not in err and "BrokenPipe" not in err


@pytest.mark.slow
def test_inspect_json_into_a_closed_pipe_is_quiet(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "fp4pass", "inspect", str(MODELS / "moe.onnx"), "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    proc.stdout.close()  # the reader is gone before the command prints (as `| head -0` does)
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0
    assert "Traceback" not in err and "BrokenPipe" not in err and "Exception ignored" not in err
