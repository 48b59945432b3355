"""The calibration run: feeds from .npz / folders / dicts, targets, statistics vs numpy, bad data."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

from calib_builders import float_mlp, nvfp4_linear
from fp4pass.calib import ActivationScales, CalibrationDataError
from fp4pass.onnx.calibrate import calibrate_model, calibration_targets
from fp4pass.errors import ModelError, NonFiniteError


def mlp_and_data(batches=3, rows=8, seed=1):
    model = ir.serde.deserialize_model(float_mlp())
    rng = np.random.default_rng(seed)
    feeds = [{"x": (rng.standard_normal((rows, 64)) * (i + 1)).astype(np.float32)} for i in range(batches)]
    return model, feeds


def hidden_np(model: ir.Model, x: np.ndarray) -> np.ndarray:
    w1 = model.graph.initializers["w1"].const_value.numpy()
    return np.maximum(x @ w1, 0)


def test_max_over_feeds_matches_numpy():
    model, feeds = mlp_and_data()
    scales = calibrate_model(model, feeds, activations=["x", "h"], provider="cpu")
    x_all = np.concatenate([f["x"] for f in feeds])
    assert scales.tensors["x"].amax == float(np.abs(x_all).max())
    assert scales.tensors["h"].amax == pytest.approx(float(hidden_np(model, x_all).max()), rel=1e-5)
    assert scales.tensors["x"].blocks == x_all.size // 16
    s = scales.tensors["x"]
    assert s.input_scale == np.float32(np.float32(s.g_amax) / np.float32(2688))
    assert s.saturated_fraction == 0.0 and s.snr_db is not None and 15 < s.snr_db < 30
    assert scales.provider == "cpu" and scales.batches == 3


def test_npz_file_folder_and_batching_agree(tmp_path):
    model, feeds = mlp_and_data()
    folder = tmp_path / "calib"
    folder.mkdir()
    for i, feed in enumerate(feeds):
        np.savez(folder / f"part{i}.npz", **feed)
    np.savez(tmp_path / "all.npz", x=np.concatenate([f["x"] for f in feeds]))
    from_dir = calibrate_model(model, folder, activations=["h"], provider="cpu")
    whole = calibrate_model(model, tmp_path / "all.npz", activations=["h"], provider="cpu")
    batched = calibrate_model(model, str(tmp_path / "all.npz"), activations=["h"], provider="cpu", batch_size=5)
    assert from_dir.batches == 3 and whole.batches == 1 and batched.batches == 5
    amaxes = {r.tensors["h"].amax for r in (from_dir, whole, batched)}
    assert len(amaxes) == 1


def test_bad_data_is_named(tmp_path):
    model, feeds = mlp_and_data()
    np.savez(tmp_path / "wrong.npz", y=feeds[0]["x"])
    with pytest.raises(CalibrationDataError, match="wrong.npz.*'x'"):
        calibrate_model(model, tmp_path / "wrong.npz", activations=["h"], provider="cpu")
    bad = feeds[0]["x"].copy()
    bad[1, 2] = np.nan
    np.savez(tmp_path / "nan.npz", x=bad)
    with pytest.raises(NonFiniteError, match=r"nan.npz.*'x'.*\(1, 2\)"):
        calibrate_model(model, tmp_path / "nan.npz", activations=["h"], provider="cpu")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CalibrationDataError, match="no .npz"):
        calibrate_model(model, tmp_path / "empty", activations=["h"], provider="cpu")
    with pytest.raises(CalibrationDataError, match="int"):
        calibrate_model(model, [{"x": np.ones((2, 64), np.int64)}], activations=["h"], provider="cpu")
    with pytest.raises(ModelError, match="nope"):
        calibrate_model(model, feeds, activations=["nope"], provider="cpu")
    with pytest.raises(ModelError, match="no activation"):
        calibrate_model(model, feeds, provider="cpu")  # a float model has no FP4 consumer


def test_fp4_targets_once_per_activation():
    model = ir.serde.deserialize_model(nvfp4_linear()[0])
    targets, declined = calibration_targets(model)
    assert [(t.name, sorted(t.consumers)) for t in targets] == [("a", ["mm1", "mm2"])]
    assert declined == []


def test_fp4_model_calibrates_through_lowering(tmp_path):
    proto, _ = nvfp4_linear()
    rng = np.random.default_rng(0)
    feeds = [{"x": rng.standard_normal((4, 64)).astype(np.float32)} for _ in range(2)]
    scales = calibrate_model(ir.serde.deserialize_model(proto), feeds, calibrator="headroom", provider="cpu")
    relu = np.maximum(np.concatenate([f["x"] for f in feeds]), 0)
    assert list(scales.tensors) == ["a"]
    assert scales.tensors["a"].amax == float(relu.max())
    assert scales.calibrator == "headroom"
    scales.save(tmp_path / "s.json")
    assert ActivationScales.load(tmp_path / "s.json").tensors["a"].g_amax == scales.tensors["a"].g_amax
