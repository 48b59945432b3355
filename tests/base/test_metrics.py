"""fp4pass.metrics against the formulas written out here in float64 numpy."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fp4pass.metrics import JSON_KEYS, compare


def _expected(a, b):
    a64, b64 = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    e = a64 - b64
    return {
        "max_abs_err": np.abs(e).max(),
        "mean_abs_err": np.abs(e).mean(),
        "rel_l2": np.linalg.norm(e) / np.linalg.norm(a64),
        "snr_db": 20 * np.log10(np.linalg.norm(a64) / np.linalg.norm(e)),
        "cosine": a64 @ b64 / (np.linalg.norm(a64) * np.linalg.norm(b64)),
        "p99_abs_err": np.percentile(np.abs(e), 99),
    }


@pytest.mark.parametrize("shape", [(7,), (3, 50), (2, 3, 17)])
def test_lossy_pair_matches_numpy(shape):
    rng = np.random.default_rng(1)
    a = rng.standard_normal(shape).astype(np.float32)
    b = (a + 1e-3 * rng.standard_normal(shape)).astype(np.float32)
    m = compare("t", a, b)
    for key, value in _expected(a, b).items():
        assert getattr(m, key) == pytest.approx(value, rel=1e-6), key
    assert m.shape == shape and m.nan == 0 and m.inf == 0


def test_identical_has_no_snr_and_zero_error():
    a = np.linspace(-3, 3, 64, dtype=np.float32).reshape(4, 16)
    m = compare("t", a, a.copy())
    assert m.snr_db is None and m.max_abs_err == 0 and m.rel_l2 == 0 and m.cosine == pytest.approx(1.0)
    assert m.identical and not m.below(200.0)
    assert set(m.to_json()) == set(JSON_KEYS) and m.to_json()["snr_db"] is None


def test_snr_threshold_and_known_value():
    a = np.ones(100, np.float32)
    b = np.full(100, 1.1, np.float32)  # ||a||/||e|| = 10 -> 20 dB
    m = compare("t", a, b)
    assert m.snr_db == pytest.approx(20.0, abs=1e-5)
    assert m.below(21.0) and not m.below(19.0)


def test_nan_inf_counted_in_b_and_excluded_from_errors():
    a = np.array([1.0, 2.0, np.nan, 4.0], np.float32)
    b = np.array([1.0, np.inf, np.nan, np.nan], np.float32)
    m = compare("t", a, b)
    assert (m.nan, m.inf, m.a_nonfinite) == (2, 1, 1)
    assert m.new_nonfinite and m.below(None)
    assert m.max_abs_err == 0.0  # only position 0 is finite in both


def test_zero_reference_gives_null_json_not_nan():
    m = compare("t", np.zeros(4, np.float32), np.ones(4, np.float32))
    assert m.snr_db == -math.inf and m.rel_l2 == math.inf and m.cosine == 0.0
    js = m.to_json()
    assert js["snr_db"] is None and js["rel_l2"] is None and js["max_abs_err"] == 1.0


def test_shape_mismatch_raises():
    with pytest.raises(ValueError, match="shapes differ"):
        compare("t", np.zeros((2, 3)), np.zeros((3, 2)))


def test_chunked_accumulation_matches_one_shot(monkeypatch):
    import fp4pass.metrics as metrics

    rng = np.random.default_rng(2)
    a = rng.standard_normal(1000).astype(np.float32)
    b = (a * 1.01).astype(np.float32)
    whole = compare("t", a, b)
    monkeypatch.setattr(metrics, "_CHUNK", 64)
    chunked = compare("t", a, b)
    assert chunked.snr_db == pytest.approx(whole.snr_db, rel=1e-12)
    assert chunked.p99_abs_err == whole.p99_abs_err and chunked.max_abs_err == whole.max_abs_err


def test_snr_of_an_infinite_error_is_minus_infinity():
    """A conversion whose error energy overflows float64 (sources near 2^128) reports -inf dB, not a crash."""
    from fp4pass.metrics import snr_db

    assert snr_db(2.4e78, math.inf) == -math.inf and snr_db(math.inf, math.inf) == -math.inf
    assert snr_db(100.0, 1.0) == pytest.approx(20.0)
