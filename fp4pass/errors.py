"""The errors fp4pass raises for input a user can fix.

Every user-facing failure is an :class:`FP4PassError`. It is raised where the fact is known, with a message
that names the file, tensor or node and the reason, and it is caught once, in the CLI, which prints that one
line and exits with its ``exit_code``: 2 for input a user can fix, 3 for :class:`InvalidOutputError` (a bug
in fp4pass). Any other exception is a bug too: exit 3, "please report" (``--debug`` shows the traceback).
"""

from __future__ import annotations

__all__ = [
    "FP4PassError",
    "FormatError",
    "NonFiniteError",
    "ShapeError",
    "ModelError",
    "UnsafeExternalDataError",
    "UsageError",
    "CheckError",
    "InvalidOutputError",
]


class FP4PassError(Exception):
    """Base of every error caused by input a user can fix (exit code 2 in the CLI)."""

    exit_code = 2


class FormatError(FP4PassError):
    """A value cannot be represented in, or read from, an FP4/FP8 format (e.g. E8M0 code 255 = NaN)."""


class NonFiniteError(FormatError):
    """NaN or Inf where a finite number is required."""


class ShapeError(FP4PassError):
    """Shapes that do not fit together: K not a multiple of the block, scales not matching codes."""


class ModelError(FP4PassError):
    """An ONNX model that cannot be read or is not what the command needs."""


class UnsafeExternalDataError(ModelError):
    """External data that points outside the model's folder, or is truncated."""


class UsageError(FP4PassError):
    """Flags or arguments that do not make sense together."""


class CheckError(FP4PassError):
    """``convert --check`` could not run (the converted model is kept only with ``--keep-unchecked``)."""


class InvalidOutputError(FP4PassError):
    """fp4pass produced a model the ONNX checker refuses: a bug, nothing is written (exit code 3)."""

    exit_code = 3
