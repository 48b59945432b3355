"""The calibrator flags shared by ``fp4pass calibrate`` and ``fp4pass convert --calib``."""

from __future__ import annotations

from fp4pass.choices import Calibrator, values

CALIBRATORS = values(Calibrator)


def add_calibrator_arguments(p) -> None:
    p.add_argument("--calibrator", choices=CALIBRATORS, default=Calibrator.MAX.value,
                   help="max: g_amax = amax (default); headroom: max(rho*B_min, margin*B_max); "
                        "percentile: pXX of |x|; mse: the MSE-optimal g_amax on the calibration data")
    p.add_argument("--percentile", type=float, help="percentile calibrator: pXX of |x| (default 99.999)")
    p.add_argument("--rho", type=float, help="headroom: g_amax >= rho * B_min, rho in (0, 28672) (default 16384)")
    p.add_argument("--margin", type=float, help="headroom: g_amax >= margin * B_max (default 1)")


def calibrator_options(args) -> dict:
    """The options of the chosen calibrator that were given on the command line."""
    wanted = {"percentile": ("percentile",), "headroom": ("rho", "margin")}.get(args.calibrator, ())
    return {name: getattr(args, name) for name in wanted if getattr(args, name) is not None}
