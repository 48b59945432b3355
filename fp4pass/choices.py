"""The named choices of fp4pass's options, in one place; the CLI's ``choices=`` are built from them.

Each is a ``str``-valued enum: a member equals its string (``Method.AUTO == "auto"``), formats as it
(``f"{Method.AUTO}"`` is ``auto``) and serializes to JSON as it, so plain strings keep working wherever a
choice is taken. ``values(E)`` is the tuple of strings, in the order shown to users.
"""

from __future__ import annotations

import enum

__all__ = ["Choice", "Method", "ScaleForm", "Target", "ActivationTarget", "Provider", "CheckProvider",
           "Calibrator",
           "ExternalData", "Effort", "MRule", "Device", "values"]


class Choice(str, enum.Enum):
    """A str-valued option (module docstring)."""

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__  # f"{x}" is the value on every Python version


class Method(Choice):
    """MXFP4 -> NVFP4 conversion method (docs/conversion.md)."""

    AUTO = "auto"
    HYBRID = "hybrid"
    REQUANT = "requant"
    VERBATIM = "verbatim"


class ScaleForm(Choice):
    """Where the NVFP4 global scale goes: a second DequantizeLinear, or the consumer's alpha."""

    DQ = "dq"
    ALPHA = "alpha"


class Target(Choice):
    """The runtime an ONNX conversion is written for."""

    TRT = "trt"
    ORT = "ort"
    REFERENCE = "reference"


class ActivationTarget(Choice):
    """The form of inserted activation quantizers: TensorRT's dynamic quantize, or standard-op emulation."""

    TRT = "trt"
    REFERENCE = "reference"


class Provider(Choice):
    """onnxruntime execution provider (auto: CUDA when present)."""

    AUTO = "auto"
    CUDA = "cuda"
    CPU = "cpu"


class CheckProvider(Choice):
    """What runs the two models of ``diff`` and ``convert --check``: an onnxruntime provider as
    :class:`Provider`, or ``reference``, onnx.reference (numpy; slow; runs what onnxruntime CPU cannot)."""

    AUTO = "auto"
    CUDA = "cuda"
    CPU = "cpu"
    REFERENCE = "reference"


class Calibrator(Choice):
    """Activation calibrator (docs/fx-calibrate-diff-export.md, fp4pass.calib.calibrators)."""

    MAX = "max"
    HEADROOM = "headroom"
    PERCENTILE = "percentile"
    MSE = "mse"


class ExternalData(Choice):
    """Whether a written model keeps its tensors in an external data file."""

    AUTO = "auto"
    ALWAYS = "always"
    NEVER = "never"


class Effort(Choice):
    """How hard the ``auto`` conversion searches (docs/conversion-search.md)."""

    BEST = "best"
    FAST = "fast"


class MRule(Choice):
    """How a lossless group's exponent offset m is chosen."""

    MIDPOINT = "midpoint"
    SEARCH = "search"


class Device(Choice):
    """torch device of a benchmark or study."""

    AUTO = "auto"
    CPU = "cpu"
    CUDA = "cuda"


def values(choice: type[Choice]) -> tuple[str, ...]:
    """The choice's strings, in declaration order."""
    return tuple(member.value for member in choice)
