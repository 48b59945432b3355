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
    stale = [(m.name, path, old[:60]) for m in mutants.MUTANTS for path, old, _ in m.edits
             if old not in (mutants.ROOT / path).read_text()]
    assert stale == []
    assert len({m.name for m in mutants.MUTANTS}) == len(mutants.MUTANTS), "two mutants share a name"
