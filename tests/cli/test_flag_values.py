"""The argparse types every command shares: each bound on both sides, each refusal worded for the user."""

from __future__ import annotations

import argparse

import pytest

from fp4pass.commands.safety import PLOT_FORMATS, finite_float, plot_path, positive_int, seed


def _refusal(parse, text: str) -> str:
    with pytest.raises(argparse.ArgumentTypeError) as raised:
        parse(text)
    return str(raised.value)


def test_positive_int_starts_at_one():
    assert positive_int("1") == 1 and positive_int("7") == 7
    assert _refusal(positive_int, "0") == "0 must be at least 1"
    assert _refusal(positive_int, "-3") == "-3 must be at least 1"
    assert _refusal(positive_int, "2.5") == "'2.5' is not an integer"


def test_seed_spans_numpys_range():
    assert seed("0") == 0 and seed(str(2**63 - 1)) == 2**63 - 1 and seed("42") == 42
    assert _refusal(seed, str(2**63)) == f"{2**63} must be in [0, 2^63)"
    assert _refusal(seed, "-1") == "-1 must be in [0, 2^63)"
    assert _refusal(seed, "x1") == "'x1' is not an integer"


def test_finite_float_refuses_nan_and_infinities():
    assert finite_float("-2.5") == -2.5 and finite_float("0") == 0.0
    for text in ("nan", "inf", "-inf"):
        assert _refusal(finite_float, text) == f"{text!r} must be a finite number"
    assert _refusal(finite_float, "1,5") == "'1,5' is not a number"


def test_plot_path_takes_every_format_in_any_case():
    for fmt in PLOT_FORMATS:
        assert plot_path(f"d/p.{fmt}") == f"d/p.{fmt}"
        assert plot_path(f"p.{fmt.upper()}") == f"p.{fmt.upper()}"
    expected = "give a .png file (or .pdf, .svg, .svgz, .eps, ...)"
    assert _refusal(plot_path, "p.txt") == f"'p.txt': {expected}"
    assert _refusal(plot_path, "png") == f"'png': {expected}"  # no suffix: "png" is the name
