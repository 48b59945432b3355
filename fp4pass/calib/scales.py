"""Calibrated NVFP4 activation scales and their file, SCALES.json (``fp4pass calibrate -o``).

One :class:`ActivationScale` per activation tensor (the graph tensor fed to a quantized consumer)::

    input_scale = g_amax / (6 * 448)        FP32; ModelOpt's / TensorRT's activation ``input_scale``,
                                            a multiplier applied on dequantize (1.0 when g_amax is 0)

``g_amax`` is what the calibrator chose, ``amax`` the literal max |x| seen, ``b_min`` / ``b_max`` the robust
low / high percentiles of the per-16-block amaxes (p1 over blocks within 1e6 of B_max, and p99.99), ``blocks``
the number of 16-blocks seen. The file::

    {"calibrator": "max", "tensors": {NAME: {"amax", "g_amax", "input_scale", "b_min", "b_max", "blocks"}}}

The report fields (zero / subnormal / saturated block fractions, SNR of the quantized activation on the
calibration sample) travel in :meth:`ActivationScales.report`, not in SCALES.json.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from fp4pass.errors import FP4PassError
from fp4pass.formats import global_scale_from_amax
from fp4pass.formats.constants import E4M3_MAX, FP32_MAX, GLOBAL_SCALE_MIN
from fp4pass.io import read_regular_file, strict_json, write_json

__all__ = ["ActivationScale", "ActivationScales", "ScalesFileError", "input_scale_from_g_amax"]

_FILE_KEYS = ("amax", "g_amax", "input_scale", "b_min", "b_max", "blocks")


class ScalesFileError(FP4PassError):
    """A SCALES.json that cannot be read or does not hold the keys described below."""


# input_scale s multiplies E4M3 block scales b in [2^-9, 448]: b*s must stay a non-zero FP32 (>= 2^-149,
# so s >= 2^-140, the floor NVFP4Tensor's global scale uses) and finite (s <= FP32 max / 448).
INPUT_SCALE_MIN = GLOBAL_SCALE_MIN
INPUT_SCALE_MAX = FP32_MAX / E4M3_MAX


#: the largest SCALES.json read (a calibration of ~100k activations at ~200 bytes each is 20 MB)
SCALES_MAX_BYTES = 256 << 20


def input_scale_from_g_amax(g_amax: float) -> float:
    """g_amax / (6*448) rounded to FP32, floored at 2^-140; 1.0 for g_amax = 0: the NVFP4 global scale of
    :func:`fp4pass.formats.global_scale_from_amax`, as a Python float."""
    return global_scale_from_amax(float(g_amax))


@dataclass
class ActivationScale:
    """The calibrated global scale of one activation, with the numbers behind it.

    Units: every field is in the activation's own units (absolute values), except ``blocks`` (a count),
    the ``*_fraction`` fields (of the non-zero 16-blocks) and ``snr_db`` (dB, 10*log10(sum x^2 / sum err^2)).
    """

    amax: float
    g_amax: float
    input_scale: float
    b_min: float
    b_max: float
    blocks: int
    zero_blocks: int = 0
    subnormal_fraction: float | None = None  # blocks whose E4M3 scale b*448/g_amax falls below 2^-6
    saturated_fraction: float | None = None  # blocks with amax above g_amax (clipped)
    snr_db: float | None = None  # quantized vs float, on the calibration sample; None when exact
    note: str = ""

    def to_json(self) -> dict:
        return {key: getattr(self, key) for key in _FILE_KEYS}

    def report(self, name: str) -> dict:
        return {"name": name, **self.to_json(), "zero_blocks": self.zero_blocks,
                "subnormal_fraction": self.subnormal_fraction, "saturated_fraction": self.saturated_fraction,
                "snr_db": self.snr_db, "note": self.note}

    @classmethod
    def from_json(cls, entry: dict, name: str = "?", where: str = "SCALES.json") -> "ActivationScale":
        if not isinstance(entry, dict):
            raise ScalesFileError(f"{where}: tensor {name!r}: expected an object, got {type(entry).__name__}")
        missing = [key for key in _FILE_KEYS if key not in entry]
        if missing:
            raise ScalesFileError(f"{where}: tensor {name!r}: missing {', '.join(missing)}")
        values = {}
        for key in _FILE_KEYS:
            value = entry[key]
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise ScalesFileError(f"{where}: tensor {name!r}: {key} must be a finite number, got {value!r}")
            values[key] = int(value) if key == "blocks" else float(value)
        if values["input_scale"] <= 0 or values["g_amax"] < 0:
            raise ScalesFileError(f"{where}: tensor {name!r}: input_scale must be > 0 and g_amax >= 0")
        scale = values["input_scale"]
        if not INPUT_SCALE_MIN <= scale <= INPUT_SCALE_MAX:
            raise ScalesFileError(
                f"{where}: tensor {name!r}: input_scale {scale!r} is outside [2^-140, FP32 max / 448] = "
                f"[{INPUT_SCALE_MIN:.4g}, {INPUT_SCALE_MAX:.4g}]: the block scales times it would not be "
                "FP32 numbers")
        for key in ("amax", "g_amax", "b_min", "b_max"):
            if values[key] < 0 or values[key] > FP32_MAX:
                raise ScalesFileError(f"{where}: tensor {name!r}: {key} {values[key]!r} is not in [0, FP32 max]")
        if values["blocks"] < 0:
            raise ScalesFileError(f"{where}: tensor {name!r}: blocks {values['blocks']} is negative")
        return cls(**values)


@dataclass
class ActivationScales:
    """The calibration of a model: ``tensors`` maps each activation name to its :class:`ActivationScale`."""

    calibrator: str
    tensors: dict[str, ActivationScale] = field(default_factory=dict)
    provider: str | None = None  # the onnxruntime provider that ran the calibration (not saved)
    batches: int = 0  # feeds run (not saved)

    def to_json(self) -> dict:
        return {"calibrator": self.calibrator, "tensors": {n: s.to_json() for n, s in self.tensors.items()}}

    @classmethod
    def from_json(cls, data: dict, where: str = "SCALES.json") -> "ActivationScales":
        if isinstance(data, dict) and isinstance(data.get("tensors"), list):  # its rows: what --report writes
            raise ScalesFileError(f"{where}: a calibration report (what `fp4pass calibrate --report` writes: one row "
                                  "per tensor, for reading), not the scales; pass the SCALES.json that calibrate "
                                  "wrote with -o")
        if not isinstance(data, dict) or "tensors" not in data or not isinstance(data["tensors"], dict):
            raise ScalesFileError(f"{where}: expected {{\"calibrator\": ..., \"tensors\": {{...}}}}")
        tensors = {name: ActivationScale.from_json(entry, name, where) for name, entry in data["tensors"].items()}
        return cls(str(data.get("calibrator", "unknown")), tensors)

    def save(self, path: str | os.PathLike) -> None:
        """Write SCALES.json atomically (fp4pass.io)."""
        write_json(path, self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike) -> "ActivationScales":
        """Read SCALES.json: a regular file of at most :data:`SCALES_MAX_BYTES`, strict JSON
        (:func:`fp4pass.io.strict_json`, the reader of every file handed in: no key twice, no NaN, no integer
        longer than any FP32 number needs, bounded depth)."""
        raw = read_regular_file(path, SCALES_MAX_BYTES, ScalesFileError)
        try:
            data = strict_json(raw)
        except UnicodeDecodeError as exc:
            raise ScalesFileError(f"{path}: not a SCALES.json (not UTF-8 text at byte {exc.start})") from None
        except (ValueError, RecursionError) as exc:
            raise ScalesFileError(f"{path}: not valid JSON ({exc})") from None
        return cls.from_json(data, where=str(path))

    def report(self) -> list[dict]:
        """Per activation: g_amax, B_min/B_max, block fractions, SNR (the calibration report)."""
        return [scale.report(name) for name, scale in self.tensors.items()]
