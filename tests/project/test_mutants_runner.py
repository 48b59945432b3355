"""tests/mutants.py's runner: mutants run ``--jobs`` at a time, each reported as ``[n/N]`` when it finishes, and
the outcomes come back in the mutants' own order whatever order they finished in."""

from __future__ import annotations

import threading
import time

import mutants


def test_mutants_run_in_parallel_with_progress(monkeypatch):
    running, peak, lock = [0], [0], threading.Lock()

    def fake_run(m, all_tests, verbose):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.3 if m.name == "slow" else 0.05)
        with lock:
            running[0] -= 1
        return ("SURVIVED" if m.name == "open" else "killed"), f"detail of {m.name}"

    monkeypatch.setattr(mutants, "run_mutant", fake_run)
    chosen = [mutants.Mutant(name, name, []) for name in ("slow", "a", "b")]
    chosen.append(mutants.Mutant("open", "open", [], open_question=True))
    lines = []
    outcomes = mutants.run_all(chosen, False, False, jobs=2, report=lines.append)
    assert list(outcomes) == ["slow", "a", "b", "open"]  # the mutants' order, not the finishing order
    assert outcomes == {"slow": "killed", "a": "killed", "b": "killed", "open": "survived (open)"}
    assert [line.split("]")[0] for line in lines] == ["[1/4", "[2/4", "[3/4", "[4/4"]
    assert lines[-1].split()[2] == "slow"  # it finished last: reported as it finished
    assert peak[0] == 2


def test_one_job_runs_one_at_a_time(monkeypatch):
    running, peak = [0], [0]

    def fake_run(m, all_tests, verbose):
        running[0] += 1
        peak[0] = max(peak[0], running[0])
        time.sleep(0.02)
        running[0] -= 1
        return "killed", ""

    monkeypatch.setattr(mutants, "run_mutant", fake_run)
    mutants.run_all([mutants.Mutant(str(i), "", []) for i in range(3)], False, False, jobs=1, report=lambda _: None)
    assert peak[0] == 1


def test_default_jobs_follow_the_cores_this_process_may_use(monkeypatch):
    monkeypatch.setattr(mutants.os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    assert mutants.default_jobs() == 3


def test_every_mutant_still_applies():
    """Each hand mutant's old texts are still in their files: a mutant whose code was rewritten plants nothing,
    and is reported as "could not apply" only when someone runs it (update its text with the code)."""
    stale, index = [], mutants.definitions(mutants.ROOT)
    for m in mutants.MUTANTS:
        for where, old, _ in m.edits:
            place = mutants.locate(mutants.ROOT, where, index)
            if isinstance(place, str) or old not in place[0].read_text()[place[1]:place[2]]:
                stale.append((m.name, where, old[:60]))
        stale += [(m.name, test, "test file gone") for test in m.tests if not (mutants.ROOT / test).exists()]
    assert stale == []
    assert len({m.name for m in mutants.MUTANTS}) == len(mutants.MUTANTS), "two mutants share a name"


def test_a_def_anchor_finds_its_function_in_any_module_and_edits_only_inside_it(tmp_path):
    pkg = tmp_path / "fp4pass" / "sub"
    pkg.mkdir(parents=True)
    (pkg / "one.py").write_text("X = 1\n\n\ndef first():\n    return 1\n\n\nclass Box:\n    @staticmethod\n"
                                "    def first():\n        return 1\n")
    (tmp_path / "fp4pass" / "two.py").write_text("def second():\n    return 1\n")
    path, start, end = mutants.locate(tmp_path, "def Box.first")
    assert path == pkg / "one.py" and path.read_text()[start:end].startswith("    @staticmethod\n")
    assert path.read_text()[start:end].endswith("        return 1\n")
    assert mutants.locate(tmp_path, "def second")[0] == tmp_path / "fp4pass" / "two.py"
    m = mutants.Mutant("t", "t", [("def first", "return 1", "return 2")], tests=[])
    assert mutants._apply(tmp_path, m) is None
    assert (pkg / "one.py").read_text().count("return 2") == 1  # the method of the same name is untouched
    assert (tmp_path / "fp4pass" / "two.py").read_text() == "def second():\n    return 1\n"
    (tmp_path / "fp4pass" / "three.py").write_text("def second():\n    pass\n")
    assert "2 definitions" in mutants.locate(tmp_path, "def second")
    gone = mutants.Mutant("g", "g", [("def second", "x", "y")], tests=["tests/test_gone.py"])
    assert "2 definitions" in mutants._apply(tmp_path, gone)
    (tmp_path / "fp4pass" / "three.py").unlink()
    gone.edits = [("def second", "return 1", "return 3")]
    assert "tests/test_gone.py is gone" in mutants._apply(tmp_path, gone)
