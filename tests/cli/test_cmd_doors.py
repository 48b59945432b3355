"""The front-door registry of the command line (``fp4pass/commands/doors.py``): each door's flags refused, word
for word, with another door's input; a flag at its default never counted as given; an NVFP4 folder's flags
judged only once the folder is told apart; a Hub ID resolved once per command.

Every refusal happens before any model is read, so each case takes milliseconds (no torch import).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from fp4pass.cli import build_parser
from fp4pass.commands import doors
from cli_helpers import cli, one_line

ROOT = Path(__file__).resolve().parents[2]
ONNX = ROOT / "models" / "moe.onnx"
MXFP4 = ROOT / "models" / "checkpoints" / "gpt_oss"
NVFP4 = ROOT / "tests" / "fixtures" / "nvfp4_thirdparty" / "modelopt_gpt_oss"
TOKENS = ROOT / "models" / "checkpoints" / "calib_tokens.npz"


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices


def test_each_door_flag_is_a_flag_of_its_command_and_of_one_door_only():
    parsers = _subparsers()
    assert set(doors.ENTRANCES) == {"convert", "inspect", "calibrate", "diff"}
    for name, entrance in doors.ENTRANCES.items():
        dests = {a.dest for a in parsers[name]._actions}
        named = [dest for flags in entrance.own.values() for dest in flags]
        assert set(named) <= dests, (name, set(named) - dests)
        assert len(named) == len(set(named)), (name, "a flag in two doors")


def test_a_door_flag_its_command_lacks_fails_when_the_parser_is_built():
    parser = argparse.ArgumentParser()
    parser.add_argument("--format")
    typo = doors.Entrance("convert", {"checkpoint": ("format", "formt"), "onnx": ()})
    with pytest.raises(AssertionError, match="formt"):
        doors.open_doors(parser, typo)


# (argv, the whole error line after "fp4pass COMMAND: error: "), {onnx}/{mxfp4}/{nvfp4} the inputs
REFUSALS = [
    (("convert", "{onnx}", "-o", "o.onnx", "--overwrite"),
     "--overwrite applies to checkpoint folders; {onnx} is not one (an ONNX output file is replaced anyway, never "
     "an input)"),
    (("convert", "{onnx}", "-o", "o.onnx", "--format", "modelopt"),
     "--format applies to checkpoint folders; {onnx} is not one"),
    (("convert", "{onnx}", "-o", "o.onnx", "--calib-batch-size", "2"),
     "--calib-batch-size applies to checkpoint folders; {onnx} is not one"),
    (("convert", "{mxfp4}", "-o", "out", "--inputs", "x.npz"),
     "--inputs applies to ONNX models, not to checkpoint folders (a checkpoint folder's calibration data is "
     "--calib DATA)"),
    (("convert", "{mxfp4}", "-o", "out", "--target", "trt", "--scale-form", "dq", "--past-length", "2"),
     "--past-length applies to ONNX models, not to checkpoint folders"),  # the defaults given are not refused
    (("inspect", "{onnx}", "--follow-symlinks"), "--follow-symlinks applies to checkpoint folders; {onnx} is not one"),
    (("inspect", "{onnx}", "--engine", "vllm"),
     "--engine applies to NVFP4 checkpoint folders; {onnx} is not a folder"),
    (("inspect", "{mxfp4}", "--allow-invalid", "--engine", "vllm"),
     "--allow-invalid applies to ONNX models, not to checkpoint folders ({mxfp4} is one)"),
    (("inspect", "{mxfp4}", "--strict"), "--strict applies to NVFP4 checkpoint folders; {mxfp4} is not one"),
    (("inspect", "{nvfp4}", "--allow-invalid"),
     "--allow-invalid applies to ONNX models, not to checkpoint folders ({nvfp4} is one)"),
    (("calibrate", "{onnx}", "--data", "x.npz", "-o", "s.json", "--trust-remote-code"),
     "--trust-remote-code applies to checkpoint folders; {onnx} is not one"),
    (("calibrate", "{mxfp4}", "--data", "x.npz", "-o", "s.json", "--provider", "auto", "--activation", "a"),
     "--activation applies to ONNX models, not to checkpoint folders"),
    (("diff", "{mxfp4}", "{nvfp4}", "--seed", "0", "--intermediates"),
     "--intermediates applies to ONNX models; {mxfp4} is a checkpoint folder (give --data)"),
    (("diff", "{onnx}", "{onnx}", "--data", "x"),
     "--data applies to checkpoint folders; {onnx} is not one (ONNX models take their inputs as --inputs DATA.npz)"),
    (("diff", "{onnx}", "{onnx}", "--kl-max", "1"), "--kl-max applies to checkpoint folders; {onnx} is not one"),
    # not a refusal: --seed 0 is diff's default, so the folder pair goes on to its next check
    (("diff", "{mxfp4}", "{onnx}", "--seed", "0", "--shape", "x=1"),
     "--shape applies to ONNX models; {mxfp4} is a checkpoint folder (give --data)"),
]


@pytest.mark.parametrize("argv, line", REFUSALS, ids=[" ".join(a[:1] + a[2:]) for a, _ in REFUSALS])
def test_a_flag_of_another_door_is_refused_in_one_line(capsys, tmp_path, monkeypatch, argv, line):
    monkeypatch.chdir(tmp_path)
    paths = {"onnx": str(ONNX), "mxfp4": str(MXFP4), "nvfp4": str(NVFP4)}
    code, err = cli(capsys, *(a.format(**paths) for a in argv))
    assert code == 2 and one_line(err) == f"fp4pass {argv[0]}: error: {line.format(**paths)}"


def test_diff_folders_with_only_defaults_of_onnx_flags_go_on(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, err = cli(capsys, "diff", MXFP4, ONNX, "--seed", "0", "--past-length", "0", "--provider", "auto")
    assert code == 2 and one_line(err).startswith(f"fp4pass diff: error: {ONNX}: not a folder; SRC_DIR {MXFP4}")


def test_an_nvfp4_folder_takes_its_own_and_every_checkpoint_folder_flag(capsys, monkeypatch):
    import importlib

    from fp4pass.errors import UsageError

    validate = importlib.import_module("fp4pass.checkpoint.validate")  # the module; the package's name is a function

    seen = {}

    def spy(folder, engine=None, follow_symlinks=False):  # past every refusal: stop before the work
        seen.update(folder=str(folder), engine=engine, follow=follow_symlinks)
        raise UsageError("reached the validation")

    monkeypatch.setattr(validate, "validate", spy)
    code, err = cli(capsys, "inspect", NVFP4, "--follow-symlinks", "--engine", "vllm", "--strict")
    assert code == 2 and one_line(err) == "fp4pass inspect: error: reached the validation"
    assert seen == {"folder": str(NVFP4), "engine": "vllm", "follow": True}


@pytest.mark.parametrize("argv, resolved", [
    (("convert", "acme/gpt-oss@v1", "-o", "out", "--target", "ort"), 1),
    (("inspect", "acme/gpt-oss@v1", "--allow-invalid"), 1),
    (("calibrate", "acme/gpt-oss@v1", "--data", "x.npz", "-o", "s.json", "--strict"), 1),
    (("diff", "acme/gpt-oss@v1", "acme/nvfp4", "--data", str(TOKENS), "--json", str(TOKENS)), 2),
])
def test_a_hub_id_is_resolved_once_per_command(capsys, tmp_path, monkeypatch, argv, resolved):
    import fp4pass.safetensors.hub as hub

    monkeypatch.chdir(tmp_path)
    calls = []

    def resolve(path, show_progress=None):
        calls.append(path)
        return {"acme/gpt-oss@v1": str(MXFP4), "acme/nvfp4": str(NVFP4)}.get(path, path)

    monkeypatch.setattr(hub, "resolve_checkpoint", resolve)
    monkeypatch.setattr(hub, "uncached_hub_id", lambda path: None)  # as cached: inspect reads the folder
    code, err = cli(capsys, *argv)
    hub_ids = [a for a in argv if a.startswith("acme/")]
    assert code == 2 and calls == hub_ids and len(calls) == resolved, err
    if argv[0] != "diff":  # refused as the checkpoint folder it resolved to (inspect: the folder named)
        assert "not to checkpoint folders" in one_line(err)
