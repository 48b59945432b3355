"""The named choices: strings still work, the CLI offers exactly the enum values, the library accepts both."""

import json

import pytest
import torch

from fp4pass import MXFP4Tensor
from fp4pass.calib import CALIBRATORS
from fp4pass.choices import (ActivationTarget, Calibrator, CheckProvider, Device, Effort, ExternalData, Method,
                             Provider, ScaleForm, Target, values)
from fp4pass.cli import build_parser
from fp4pass.convert import mxfp4_to_nvfp4


def _subparser(name):
    parser = build_parser()
    action = next(a for a in parser._actions if a.dest == "command")
    return action.choices[name]


def _choices(parser, flag):
    action = next(a for a in parser._actions if flag in a.option_strings)
    return tuple(action.choices), action.default


@pytest.mark.parametrize("command, flag, enum, default", [
    ("convert", "--method", Method, "auto"), ("convert", "--scale-form", ScaleForm, "dq"),
    ("convert", "--target", Target, "trt"), ("convert", "--external-data", ExternalData, "auto"),
    ("convert", "--effort", Effort, "best"), ("convert", "--provider", CheckProvider, "auto"),
    ("convert", "--calibrator", Calibrator, "max"), ("calibrate", "--calibrator", Calibrator, "max"),
    ("diff", "--provider", CheckProvider, "auto"), ("bench", "--device", Device, "auto"),
    ("study", "--device", Device, "auto"),
])
def test_cli_choices_come_from_the_enums(command, flag, enum, default):
    choices, got_default = _choices(_subparser(command), flag)
    assert choices == values(enum) and got_default == default and type(got_default) is str


def test_members_are_their_strings():
    assert Method.AUTO == "auto" and f"{Target.ORT}" == "ort" and str(ScaleForm.ALPHA) == "alpha"
    assert json.dumps({"m": Method.REQUANT}) == '{"m": "requant"}'
    assert Method("hybrid") is Method.HYBRID and "verbatim" in values(Method)
    assert set(values(ActivationTarget)) < set(values(Target))


def test_calibrator_enum_names_every_calibrator():
    assert set(values(Calibrator)) == set(CALIBRATORS)


def test_library_takes_a_member_or_its_string():
    x = torch.randn(4, 64) * torch.logspace(-3, 3, 64)
    mx = MXFP4Tensor.quantize(x)
    by_member, _ = mxfp4_to_nvfp4(mx, method=Method.REQUANT)
    by_string, _ = mxfp4_to_nvfp4(mx, method="requant")
    assert torch.equal(by_member.codes, by_string.codes) and torch.equal(by_member.scales, by_string.scales)
