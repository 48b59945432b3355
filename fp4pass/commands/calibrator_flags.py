"""The calibrator flags shared by ``fp4pass calibrate`` and ``fp4pass convert --calib``.

No flag is silently ignored: a calibrator flag without the calibration data it acts on, or an option of
another calibrator than the chosen one, is a usage error (:func:`check_calibrator_flags`).
"""

from __future__ import annotations

import argparse

from fp4pass.choices import Calibrator, values
from fp4pass.errors import UsageError

CALIBRATORS = values(Calibrator)
#: each calibrator's own options (the flags' dest names); max and mse take none
OPTIONS = {Calibrator.PERCENTILE.value: ("percentile",), Calibrator.HEADROOM.value: ("rho", "margin")}
#: checkpoint-folder calibration flags of ``convert`` that only ``--calib`` reads
CALIB_ONLY = ("seq_len", "num_samples", "device", "calib_batch_size")


class _Chosen(argparse.Action):
    """Store the calibrator and note that it was given (its default, max, is not)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        namespace.calibrator_given = True


def add_calibrator_arguments(p) -> None:
    p.add_argument("--calibrator", choices=CALIBRATORS, default=Calibrator.MAX.value, action=_Chosen,
                   help="max: g_amax = amax (default); headroom: max(rho*B_min, margin*B_max); "
                        "percentile: pXX of |x|; mse: the MSE-optimal g_amax on the calibration data")
    p.add_argument("--percentile", type=float, help="percentile calibrator: pXX of |x| (default 99.999)")
    p.add_argument("--rho", type=float, help="headroom: g_amax >= rho * B_min, rho in (0, 28672) (default 16384)")
    p.add_argument("--margin", type=float, help="headroom: g_amax >= margin * B_max (default 1)")


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def check_calibrator_flags(args, data_flag: str, data_given: bool) -> None:
    """Refuse calibrator flags that nothing would read.

    ``data_flag``: the flag that gives calibration data (``--calib``, ``--data``); ``data_given``: whether it
    was given. Without it, ``--calibrator``, its options and the checkpoint calibration flags are refused; with
    it, an option of another calibrator than the chosen one (``--percentile`` with ``max``) is.
    """
    given = [dest for dest in ("percentile", "rho", "margin", *CALIB_ONLY) if getattr(args, dest, None) is not None]
    if getattr(args, "calibrator_given", False):
        given.insert(0, "calibrator")
    if given and not data_given:
        raise UsageError(f"{_flag(given[0])} applies to calibration; add {data_flag} DATA (or leave "
                         f"{_flag(given[0])} out)")
    chosen = args.calibrator
    for owner, options in OPTIONS.items():
        for dest in options:
            if owner != chosen and getattr(args, dest, None) is not None:
                raise UsageError(f"{_flag(dest)} is an option of the {owner} calibrator, not of {chosen}; "
                                 f"add --calibrator {owner} or leave {_flag(dest)} out")


def calibrator_options(args) -> dict:
    """The options of the chosen calibrator that were given on the command line."""
    wanted = OPTIONS.get(args.calibrator, ())
    return {name: getattr(args, name) for name in wanted if getattr(args, name) is not None}
