"""Exclusion lists a stranger wrote: every matcher stops within its budget naming the entry, never hangs; the
indexes agree with plain fnmatch / ``in`` loops at a name's very end; configs over 16 MiB are refused.

Oracles: :func:`fnmatch.fnmatchcase` and Python's ``in`` on small inputs; wall time and tracemalloc on the
hostile ones (each case here would run for hours, or take gigabytes, without its bound)."""

from __future__ import annotations

import fnmatch
import json
import signal
import tracemalloc

import pytest

from fp4pass.safetensors import patterns
from fp4pass.safetensors.patterns import BadPattern, Budget, GlobIndex, RegexList, SubstringIndex, dotted_runs


class TookTooLong(Exception):
    pass


def _quick(fn, seconds: float = 2.0):
    """``fn()``, failed (TookTooLong) once it runs past ``seconds`` of wall time: a bound that is gone makes
    the test fail, not hang (SIGALRM interrupts Python's loops)."""

    def alarm(signum, frame):
        raise TookTooLong(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return fn()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_globs_without_a_fixed_head_or_tail_stop_at_the_budget_naming_the_entry():
    globs = [f"*{'?' * (1 + i % 7)}x*{i}*" for i in range(3000)]  # no literal head, no literal tail
    index = GlobIndex(globs, budget=Budget("quantization_config.ignore", seconds=0.05))
    name = "m" * 20_000
    with pytest.raises(BadPattern, match=r"quantization_config\.ignore: matching took more than [\d.]+ s .*at the "
                                         r"entry '\*"):
        _quick(lambda: [index.match(name + str(i)) for i in range(1000)])


def test_one_glob_on_a_long_name_stops_inside_its_own_scan():
    index = GlobIndex(["*" + "[ab]" * 2000 + "*c"], budget=Budget("exclude_modules", seconds=0.05))
    with pytest.raises(BadPattern, match="exclude_modules: matching took more than"):
        _quick(lambda: index.match(("a" * 1999 + "x") * 200 + "c"))  # each place fails at its last token


def test_a_glob_over_the_size_cap_is_refused_before_it_takes_memory():
    tracemalloc.start()
    try:
        with pytest.raises(BadPattern, match=f"is {1 << 20} characters long; at most {patterns.MAX_GLOB_CHARS}"):
            GlobIndex(["*" + "?" * ((1 << 20) - 1)])  # its tokens would take ~180 MB (a 15 MB one, 2.7 GB)
        assert tracemalloc.get_traced_memory()[1] < 20 << 20
    finally:
        tracemalloc.stop()
    GlobIndex(["*" + "?" * (patterns.MAX_GLOB_CHARS - 1)])  # at the cap: taken


def test_the_substring_rule_on_a_very_long_name_stops_at_the_budget():
    entries = [f"e{i:06d}" * (1 + i % 50) for i in range(2000)]  # many entries of many lengths
    index = SubstringIndex(entries, Budget("ignore", seconds=0.05))
    with pytest.raises(BadPattern, match=r"ignore: matching took more than [\d.]+ s"):
        _quick(lambda: index.found_in("q" * 2_000_000))


def test_the_ancestor_rule_on_a_name_of_very_many_components_stops_at_the_budget():
    budget = Budget("exclude_modules", seconds=0.05)
    name = ".".join(["c"] * 300_000)
    with pytest.raises(BadPattern, match=r"exclude_modules: matching took more than [\d.]+ s"):
        with budget:
            _quick(lambda: any(run == "x" for run in dotted_runs(name, {1, 1000, 50_000}, budget)))


def test_a_regex_that_expands_while_it_compiles_is_refused_at_once():
    assert patterns.regex_nodes("x{4294967294}") > patterns.MAX_REGEX_NODES  # regex.compile: minutes
    for hostile in ("(?:x{1000}){1000}", "(?:a{400}){300}b"):  # 1 s and 0.1 s to compile without the cap
        with pytest.raises(BadPattern, match="expands to more than"):
            _quick(lambda: RegexList([hostile], "ignore"), seconds=0.05)
    assert RegexList(["(?:x{100}){100}"], "ignore").search("x" * 10_000)  # at 10,000 nodes: compiled


def test_compiling_a_list_stops_at_the_budget_naming_the_entry(monkeypatch):
    monkeypatch.setattr(patterns, "REGEX_BUDGET_SECONDS", 0.02)
    heavy = [f"(?:x{{99}}y{i}){{99}}" for i in range(400)]
    with pytest.raises(BadPattern, match=r"compiling its regular expressions took more than 0.02 s, at '\(\?:x"):
        _quick(lambda: RegexList(heavy, "ignore"))


@pytest.mark.parametrize("name", ["abc", "xabc", "abcx", "ab", "zzabc", "abczz", "a.b.abc"])
def test_indexes_at_a_names_end_agree_with_plain_loops(name):
    """Prefix, head, tail and substring look-ups whose entry ends exactly at the name's end (or is all of it),
    with enough entries of one length that the substring rule takes its indexed branch."""
    globs = ["abc*", "*abc", "a?c*", "*b?", "x*c", "ab", "zz*c", "*.abc", "q*"]
    index = GlobIndex(globs)
    assert index.match(name) == any(fnmatch.fnmatchcase(name, g) for g in globs)
    for glob in globs:  # each alone: no other glob can hide a look-up that missed
        assert GlobIndex([glob]).match(name) == fnmatch.fnmatchcase(name, glob), glob
    entries = ["abc"] + [f"{c}{c}{c}" for c in "defghijklmnopqrst"]  # 18 entries of length 3: the set path
    assert len(entries) > 10
    sub = SubstringIndex(entries)
    assert sub.found_in(name) == any(e in name for e in entries)


def test_a_config_over_16_mib_is_refused_by_the_validator(tmp_path):
    from fp4pass.safetensors.files import CheckpointError
    from fp4pass.checkpoint.validate import validate

    folder = tmp_path / "ck"
    folder.mkdir()
    pad = " " * ((16 << 20) - 20)
    (folder / "config.json").write_text('{"a": 1}' + pad + "   " * 10)
    assert (folder / "config.json").stat().st_size > 16 << 20
    with pytest.raises(CheckpointError, match=f"at most {16 << 20} are read"):
        validate(folder)
    (folder / "config.json").write_text(json.dumps({"architectures": ["X"]}))
    with pytest.raises(CheckpointError) as caught:
        validate(folder)
    assert "at most" not in str(caught.value)


def test_the_budget_grows_with_the_names_so_a_big_models_real_list_passes():
    """A real list costs microseconds a name; with a fixed budget a 70,000-module model's names alone would pass
    it. 6,000 names against 8 everyday globs, under a base budget of 1 ms: the per-name allowance carries it."""
    globs = ["*lm_head*", "*.mlp.gate", "*.self_attn.*", "*norm*", "*embed*", "model.layers.0.*", "*shared*", "re*"]
    index = GlobIndex(globs, budget=Budget("exclude_modules", seconds=0.001))
    names = [f"model.layers.{i % 61}.mlp.experts.{i}.w{1 + i % 3}" for i in range(6000)]
    hits = _quick(lambda: [index.match(n) for n in names])
    assert hits == [any(fnmatch.fnmatchcase(n, g) for g in globs) for n in names]
