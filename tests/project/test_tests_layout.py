"""The tests are laid out like the package (tests/README.md): each test file in the folder of the unit it covers,
named for the module or the property it tests, and listed in tests/README.md with what it checks."""

from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
UNITS = {"formats", "convert", "calib", "onnx", "fx", "checkpoint", "cli", "base", "campaigns", "project"}
#: scripts that stay at the top of tests/: run by path (gpu_check.sh, docs) or by pytest itself
TOP = {"conftest.py", "mutants.py", "vllm_probe.py", "qmoe_cuda_check.py", "gpu_check_summary.py",
       "calibrate_120b_check.py", "search_headroom.py"}


def test_every_test_file_is_in_its_units_folder():
    assert sorted(p.name for p in TESTS.glob("*.py") if p.name not in TOP) == []
    misplaced = [str(p.relative_to(TESTS)) for p in TESTS.rglob("test_*.py")
                 if p.parent.name not in UNITS and "fixtures" not in p.parts]
    assert misplaced == []
    names = [p.name for p in TESTS.rglob("test_*.py")]
    assert len(names) == len(set(names)), "two test files share a name (pytest imports them by name)"
    assert [p.name for p in (TESTS / "support").glob("test_*.py")] == []


def test_the_readme_lists_every_test_file_and_nothing_else():
    listed = set(re.findall(r"^- `(test_\w+\.py)`", (TESTS / "README.md").read_text(), re.M))
    present = {p.name for folder in UNITS for p in (TESTS / folder).glob("test_*.py")}
    assert listed == present, (sorted(present - listed), sorted(listed - present))
