"""The checkpoint writer's and reader's modules spell no tensor suffix and no expert pattern: they read them from
the form records (``fp4pass.checkpoint.forms``), so a form changes in one place.

The check reads each module's string constants (docstrings and error prose aside: a constant counts when it is a
suffix, starts with one, or holds a regex of the expert names). The suffixes are listed here by hand as well as
taken from the records, so that a suffix missing from the records is still caught.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from fp4pass.checkpoint import forms

ROOT = Path(__file__).resolve().parents[2]
CHECKED = ["run.py", "plan.py", "shards.py", "inspection.py", "output_forms.py", "detect.py", "input_scales.py"]
#: every suffix of FACTS.md's checkpoint forms, written out (MXFP4 inputs, NVFP4 outputs, the tensors beside them)
BY_HAND = ("_blocks", "_scales", ".weight_packed", ".weight_scale", ".scale", ".weight", "_weight_scale",
           "_weight_scale_2", "_input_scale", ".weight_scale_2", ".input_scale", ".weight_global_scale",
           ".input_global_scale", ".weight_shape", ".weight_scale_inv")
SUFFIXES = set(BY_HAND) | {r.suffix for f in forms.MXFP4_FORMS + forms.NVFP4_FORMS for r in f.roles if r.suffix}


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def spelled(source: str) -> list[tuple[int, str]]:
    """(line, constant) of every string constant that spells a suffix or an expert-name regex."""
    tree = ast.parse(source)
    docs = _docstrings(tree)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            text = node.value
            if any(text.startswith(s) for s in SUFFIXES) or r"\.experts" in text or text.endswith(".experts"):
                out.append((node.lineno, text))
    return out


@pytest.mark.parametrize("name", CHECKED)
def test_no_suffix_or_expert_pattern_is_spelled_outside_the_records(name):
    assert spelled((ROOT / "fp4pass" / "checkpoint" / name).read_text()) == []


@pytest.mark.parametrize("source", ['x = name.endswith(".weight")', 'f"{module}.scale"', 'p + "_weight_scale"',
                                    r're.compile(r"^(.*)\.experts\.(\d+)$")', 'k.endswith(".experts")'])
def test_the_check_sees_a_suffix_or_pattern_wherever_it_is_spelled(source):
    assert spelled(source)


def test_docstrings_and_prose_are_not_counted():
    source = ('"""M.weight_scale [N, K/16]."""\ndef f():\n    """P_blocks"""\n'
              '    raise E("no weight_packed/weight_scale")\n')
    assert spelled(source) == []
