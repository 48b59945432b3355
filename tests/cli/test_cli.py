"""The command's contract: --help with examples, usage errors exit 2 with one line, no traceback."""

import os
import subprocess
import sys

import pytest

from fp4pass.cli import main


def test_help_lists_examples(capsys):
    try:
        main(["--help"])
    except SystemExit as exc:
        assert exc.code == 0
    out = capsys.readouterr().out
    assert "examples:" in out and "fp4pass convert" in out


def test_no_command_prints_help_and_exits_2(capsys):
    assert main([]) == 2


def test_unknown_command_is_a_usage_error():
    proc = subprocess.run([sys.executable, "-m", "fp4pass", "frobnicate"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "invalid choice" in proc.stderr and "Traceback" not in proc.stderr


def test_importing_fp4pass_and_its_cli_loads_nothing_heavy():
    """Ctrl-C in a command's first moments lands before torch/onnx are even imported, where only a handler
    already in place can turn it into exit 130: so the package and the CLI import only the standard library."""
    code = ("import sys, fp4pass, fp4pass.cli; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'onnx', 'onnx_ir', 'numpy', "
            "'onnxruntime', 'ml_dtypes'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    import fp4pass  # the public names still resolve, on first use

    assert fp4pass.MXFP4Tensor.__name__ == "MXFP4Tensor" and callable(fp4pass.mxfp4_to_nvfp4)


@pytest.mark.slow
@pytest.mark.parametrize("delay", [0.3, 0.7, 1.2, 2.0])
def test_ctrl_c_at_any_moment_is_exit_130_in_one_line(tmp_path, delay):
    import signal
    import time

    proc = subprocess.Popen([sys.executable, "-m", "fp4pass", "convert", "models/moe.onnx", "-o",
                             str(tmp_path / "m.onnx"), "--calib", "models/calib.npz", "--check"],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert "Traceback" not in err
    if proc.returncode == 0:  # the run had finished: its outputs are whole, and the late Ctrl-C changes nothing
        assert "check passed" in err and sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]
        return
    assert proc.returncode == 130, err
    assert err.strip().endswith("interrupted") and len(err.strip().splitlines()) <= 2, err
    assert [p for p in tmp_path.iterdir()] == []


def test_ctrl_c_inside_an_import_waits_for_it_and_is_sent_again(monkeypatch):
    """A module cut short half-way stays broken in the process: inside an import the signal is only noted, and
    re-sent a moment later; outside one it is a KeyboardInterrupt at once."""
    import importlib
    import signal

    from fp4pass import cli

    sent = []
    monkeypatch.setattr(cli.os, "kill", lambda pid, sig: sent.append((pid, sig)))
    frames = {}

    class Probe:  # a module body that records its own frame while it is being imported
        @staticmethod
        def find_spec(name, path=None, target=None):
            if name != "fp4pass_probe_module":
                return None
            return importlib.util.spec_from_loader(name, Probe)

        @staticmethod
        def create_module(spec):
            return None

        @staticmethod
        def exec_module(module):
            frames["inside"] = sys._getframe()

    monkeypatch.setattr(sys, "meta_path", [Probe, *sys.meta_path])
    import fp4pass_probe_module  # noqa: F401

    monkeypatch.delitem(sys.modules, "fp4pass_probe_module")
    cli._Interrupts.seen = cli._Interrupts.pending = False
    cli._Interrupts.on_sigint(signal.SIGINT, frames["inside"])
    assert cli._Interrupts.pending and cli._Interrupts.seen
    deadline = __import__("time").monotonic() + 5
    while not sent and __import__("time").monotonic() < deadline:
        __import__("time").sleep(0.01)
    assert sent == [(os.getpid(), signal.SIGINT)]
    with pytest.raises(KeyboardInterrupt):
        cli._Interrupts.on_sigint(signal.SIGINT, sys._getframe())
    assert not cli._Interrupts.pending


def test_an_error_after_ctrl_c_is_the_interruption_not_a_bug(tmp_path, capsys, monkeypatch):
    """A library broken by an import cut short fails later with an unrelated error (torch: RecursionError):
    that is exit 130 "interrupted", not exit 3 "please report"; and a run that ends with a Ctrl-C still
    waiting counts as interrupted, its outputs removed."""
    from fp4pass import cli
    from fp4pass.commands import clean

    def broken(args):
        cli._Interrupts.seen = True
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(clean, "run", broken)
    assert main(["clean", str(tmp_path)]) == 130
    assert capsys.readouterr().err.strip() == "fp4pass clean: interrupted"

    from fp4pass import io as fio

    def finished_with_one_waiting(args):
        fio.write_json(tmp_path / "r.json", {})
        cli._Interrupts.pending = True
        return 0

    monkeypatch.setattr(clean, "run", finished_with_one_waiting)
    assert main(["clean", str(tmp_path)]) == 130
    assert "interrupted" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()


# -- usage errors name their own command and suggest the flag meant -------------------------------------------


@pytest.mark.parametrize("argv, command, typo, meant", [
    (["convert", "models/moe.onnx", "-o", "x.onnx", "--chek"], "convert", "--chek", "--check"),
    (["convert", "models/moe.onnx", "-o", "x.onnx", "--snr-mn=30"], "convert", "--snr-mn=30", "--snr-min"),
    (["diff", "a.onnx", "b.onnx", "--intermediatez"], "diff", "--intermediatez", "--intermediates"),
    (["inspect", "models/moe.onnx", "--jsn"], "inspect", "--jsn", "--json"),
])
def test_a_flag_typo_is_the_subcommands_error_with_the_closest_flag(capsys, argv, command, typo, meant):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: fp4pass {command} "), err  # the subcommand's usage, not the top level's
    assert err.strip().splitlines()[-1] == (f"fp4pass {command}: error: unrecognized arguments: {typo} "
                                            f"(did you mean {meant}?)")


def test_a_bad_choice_is_the_subcommands_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["convert", "models/moe.onnx", "-o", "x.onnx", "--method", "autoo"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("fp4pass convert: error: argument --method")


def test_nothing_close_suggests_nothing(capsys):
    with pytest.raises(SystemExit):
        main(["study", "--zzzzzz"])
    assert capsys.readouterr().err.strip().splitlines()[-1] == "fp4pass study: error: unrecognized arguments: --zzzzzz"


# -- --help: every argument explained, folders named as such ----------------------------------------------------


def _subparsers():
    import argparse

    from fp4pass.cli import build_parser

    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices


def test_every_argument_of_every_command_has_help():
    missing = [f"{name} {a.option_strings or a.dest}" for name, p in _subparsers().items() for a in p._actions
               if not a.help]
    assert missing == []


@pytest.mark.parametrize("command", ["convert", "inspect", "calibrate"])
def test_commands_that_take_folders_do_not_call_their_input_an_onnx_file(command):
    p = _subparsers()[command]
    (model,) = [a for a in p._actions if a.dest == "model"]
    assert model.metavar == "IN" and "folder" in model.help and "ONNX" in model.help
    if command == "convert":
        (out,) = [a for a in p._actions if a.dest == "output"]
        assert out.metavar == "OUT" and "folder" in out.help


# -- running out of threads is the user's limit, not a bug ------------------------------------------------------


@pytest.mark.parametrize("exc", [RuntimeError("can't start new thread"),
                                 RuntimeError("pthread_create failed: Resource temporarily unavailable"),
                                 OSError(11, "Resource temporarily unavailable")])
def test_out_of_threads_is_exit_2_naming_threads(monkeypatch, capsys, exc):
    from fp4pass.commands import convert

    def run(args):
        raise exc

    monkeypatch.setattr(convert, "run", run)
    assert main(["convert", "models/moe.onnx", "-o", "never.onnx", "--threads", "2"]) == 2
    err = capsys.readouterr().err
    assert "--threads 2" in err and "bug" not in err and len(err.strip().splitlines()) == 1


def test_any_other_runtime_error_is_still_a_bug(monkeypatch, capsys):
    from fp4pass.commands import convert

    def run(args):
        raise RuntimeError("index out of range in self")

    monkeypatch.setattr(convert, "run", run)
    assert main(["convert", "models/moe.onnx", "-o", "never.onnx"]) == 3
    assert "a bug in fp4pass" in capsys.readouterr().err
