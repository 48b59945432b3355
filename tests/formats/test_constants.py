"""fp4pass.formats.constants against independent sources (ml_dtypes, float32 arithmetic in numpy), the one
global-scale formula against numpy, and no stray copies of the format numbers in the code."""

import ast
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch

from fp4pass.formats import constants as c
from fp4pass.formats import global_scale_from_amax

ROOT = Path(__file__).resolve().parents[2]


def test_e2m1_grid_and_max():
    values = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    assert [float(v) for v in values] == list(c.E2M1_VALUES)
    assert np.signbit(values[8]) and c.E2M1_MAX == float(ml_dtypes.finfo(ml_dtypes.float4_e2m1fn).max)


def test_e4m3_limits_and_pow2_window():
    info = ml_dtypes.finfo(ml_dtypes.float8_e4m3fn)
    assert c.E4M3_MAX == float(info.max) == 448.0
    assert c.E4M3_MIN_NORMAL == float(info.smallest_normal) == 2.0**c.E4M3_MIN_NORMAL_EXP
    assert c.E4M3_MIN_SUBNORMAL == float(info.smallest_subnormal) == 2.0**c.E4M3_MIN_SUBNORMAL_EXP
    assert np.array(c.E4M3_MAX_CODE, np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32) == 448.0
    exact = [e for e in range(-20, 20)
             if float(np.float32(2.0**e).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)) == 2.0**e]
    assert (exact[0], exact[-1], len(exact)) == (c.E4M3_POW2_MIN_EXP, c.E4M3_POW2_MAX_EXP, 18)
    assert c.LOSSLESS_SPREAD == len(exact) - 1 == 17
    assert c.E4M3_NORMAL_WINDOW == 448.0 / 2.0**-6 == 28672.0


def test_e8m0_bias_and_nan():
    codes = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e8m0fnu).astype(np.float64)
    assert codes[c.E8M0_BIAS] == 1.0 and np.isnan(codes[c.E8M0_NAN]) and not np.isnan(codes[:255]).any()
    assert codes[0] == 2.0**c.E8M0_MIN_EXP and codes[254] == 2.0**c.E8M0_MAX_EXP


def test_global_scale_factor_and_floor():
    assert c.NVFP4_AMAX_PER_GLOBAL_SCALE == 6 * 448 == 2688
    least = np.float32(c.GLOBAL_SCALE_MIN) * np.float32(c.E4M3_MIN_SUBNORMAL)
    below = np.float32(c.GLOBAL_SCALE_MIN / 2) * np.float32(c.E4M3_MIN_SUBNORMAL)
    assert least == np.float32(2.0**-149) and below == 0


@pytest.mark.parametrize("amax", [0.0, 1.0, 2688.0, 3.3, 1e-30, 1e-38, 1e-44, 7e37])
def test_global_scale_from_amax_matches_numpy(amax):
    expected = 1.0 if amax == 0 else max(float(np.float32(np.float32(amax) / np.float32(2688))), 2.0**-140)
    assert global_scale_from_amax(amax) == expected
    assert float(global_scale_from_amax(torch.tensor([amax]))[0]) == expected


NUMBERS = {127: "E8M0_BIAS", 254: "E8M0 max code", 255: "E8M0_NAN", 448: "E4M3_MAX", 448.0: "E4M3_MAX",
           2688: "NVFP4_AMAX_PER_GLOBAL_SCALE", 2688.0: "NVFP4_AMAX_PER_GLOBAL_SCALE", 28672.0: "E4M3_NORMAL_WINDOW"}
STRINGS = {"com.microsoft": "MS_DOMAIN", "com.amd.quark": "QUARK_DOMAIN"}
ALLOWED = {("fp4pass/convert/layout.py", 127),  # FP32_EXP_BIAS: float32's bias, not E8M0's
           ("fp4pass/io/stale.py", 255)}  # NAME_MAX_FALLBACK: the longest file name, not an E8M0 code


def test_no_stray_format_numbers_in_code():
    """Code (docstrings and comments aside) takes these numbers from fp4pass.formats.constants."""
    stray = []
    for path in sorted((ROOT / "fp4pass").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel == "fp4pass/formats/constants.py" or rel.startswith("fp4pass/examples/"):
            continue  # the example builders import nothing of fp4pass: the tests use them as independent oracles
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Constant) or isinstance(node.value, bool):
                continue
            name = NUMBERS.get(node.value) if isinstance(node.value, (int, float)) else STRINGS.get(node.value)
            if name and (rel, node.value) not in ALLOWED:
                stray.append(f"{rel}:{node.lineno}: {node.value!r} (use {name})")
    assert stray == []
