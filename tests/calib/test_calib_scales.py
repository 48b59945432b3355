"""SCALES.json: its keys, round trip, and clear errors on bad files."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fp4pass.calib import ActivationScale, ActivationScales, ScalesFileError, input_scale_from_g_amax


def sample() -> ActivationScales:
    g = 123.456
    return ActivationScales("headroom", {"a/b:0": ActivationScale(130.0, g, input_scale_from_g_amax(g), 0.01, 99.0,
                                                                  4096, zero_blocks=3, snr_db=20.5)})


def test_round_trip_and_spec_keys(tmp_path):
    scales = sample()
    path = tmp_path / "SCALES.json"
    scales.save(path)
    data = json.loads(path.read_text())
    assert set(data) == {"calibrator", "tensors"} and data["calibrator"] == "headroom"
    assert set(data["tensors"]["a/b:0"]) == {"amax", "g_amax", "input_scale", "b_min", "b_max", "blocks"}
    assert data["tensors"]["a/b:0"]["input_scale"] == float(np.float32(123.456) / np.float32(2688))
    back = ActivationScales.load(path)
    assert back.to_json() == scales.to_json()
    assert not list(tmp_path.glob(".*tmp"))


def test_input_scale_convention():
    assert input_scale_from_g_amax(2688.0) == 1.0
    assert input_scale_from_g_amax(0.0) == 1.0


@pytest.mark.parametrize("text, match", [
    ("not json", "not valid JSON"),
    ('{"calibrator": "max"}', "tensors"),
    ('{"tensors": {"x": {"amax": 1}}}', "missing g_amax"),
    ('{"tensors": {"x": {"amax": 1, "g_amax": 1, "input_scale": 0, "b_min": 0, "b_max": 1, "blocks": 1}}}', "input_scale"),
    ('{"tensors": {"x": {"amax": 1, "g_amax": "1", "input_scale": 1, "b_min": 0, "b_max": 1, "blocks": 1}}}', "finite number"),
])
def test_bad_files(tmp_path, text, match):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ScalesFileError, match=match):
        ActivationScales.load(path)
