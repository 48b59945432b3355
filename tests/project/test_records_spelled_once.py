"""Each checkpoint fact is spelled in its record only: the NVFP4/MXFP4 tensor suffixes in ``checkpoint/forms.py``,
the expert-name patterns in ``forms.py`` and the family records, the engine names in the engine records.

The check reads every ``fp4pass/checkpoint/**.py`` as Python (the AST's string constants, f-string pieces
included, docstrings left out: a docstring may name a tensor). A constant counts as a spelling when it is

- a tensor suffix as code builds or matches names with it: ``"weight_scale_2"``, ``".weight_packed"``,
  ``"_weight_scale"``, or a name that ends in one (``"experts.gate_up_proj_weight_scale"``); gpt-oss's
  ``"_blocks"`` / ``"_scales"`` alone or after a projection (``"gate_up_proj_blocks"``);
- an expert-name regex: a constant with ``experts\\.`` or ``\\.experts`` in it;
- an engine name: ``"vllm"``, ``"sglang"``, ``"trtllm"``.

A bare ``"input_scale"`` does not count: it is also a role's name in ``forms.py`` and a JSON key of the reports.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from fp4pass.checkpoint import forms

ROOT = Path(__file__).resolve().parents[2]
CHECKPOINT = ROOT / "fp4pass" / "checkpoint"

#: where the facts live
RECORDS = ("forms.py", "families/", "engines/records.py")
#: modules still to be moved onto the records: shrink this list, never grow it (every module is on them now)
PENDING: tuple[str, ...] = ()

_SUFFIXES = ("weight_scale_2", "weight_global_scale", "input_global_scale", "weight_packed", "weight_scale",
             "input_scale")
#: a suffix as code writes it: bare (but "input_scale", a role's and a JSON key's name too), or after "." / "_"
_SPELLED = re.compile(r"(?:^|[.]|_)(?:%s)$" % "|".join(_SUFFIXES))
_STACK = re.compile(r"(?:^|proj)_(?:blocks|scales)$")
_EXPERT_REGEX = re.compile(r"experts\\\.|\\\.experts")
ENGINE_NAMES = {"vllm", "sglang", "trtllm"}


def spelling(text: str) -> str | None:
    """What ``text`` spells, or None."""
    if text in ENGINE_NAMES:
        return "engine name"
    if text != "input_scale" and _SPELLED.search(text):
        return "tensor suffix"
    if _STACK.search(text):
        return "tensor suffix"
    if _EXPERT_REGEX.search(text):
        return "expert pattern"
    return None


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def spellings(source: str) -> list[tuple[int, str, str]]:
    """(line, kind, constant) of each spelling in ``source``."""
    tree = ast.parse(source)
    skip = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            kind = spelling(node.value)
            if kind:
                found.append((node.lineno, node.col_offset, kind, node.value))
    return [(line, kind, text) for line, _, kind, text in sorted(found)]


def _module(path: Path) -> str:
    return path.relative_to(CHECKPOINT).as_posix()


def _allowed(module: str) -> bool:
    return any(module == r or (r.endswith("/") and module.startswith(r)) for r in RECORDS) or module in PENDING


def test_no_suffix_expert_pattern_or_engine_name_outside_the_records():
    found = [f"fp4pass/checkpoint/{_module(path)}:{line}: {kind} {text!r}"
             for path in sorted(CHECKPOINT.rglob("*.py")) if not _allowed(_module(path))
             for line, kind, text in spellings(path.read_text())]
    assert found == [], "read it from checkpoint/forms.py, the families or the engine records:\n" + "\n".join(found)


def test_the_pending_modules_exist():
    """A pending module that was renamed or removed is taken off the list, so the list only shrinks."""
    assert [m for m in PENDING if not (CHECKPOINT / m).is_file()] == []


def test_the_check_sees_each_kind_of_spelling():
    """The detector itself, on code that spells each fact and on code that does not."""
    source = '''
"""A docstring may say weight_scale_2, experts\\\\.(\\\\d+) and vllm."""
def f(mod, engine):
    """So may a function's: ".weight_packed"."""
    a = f"{mod}.weight_scale_2"
    b = mod + "_weight_scale"
    c = name.endswith("experts.gate_up_proj_weight_scale")
    d = "gate_up_proj_blocks"
    e = re.compile(r"^(?P<p>.+\\.experts)\\.(\\d+)$")
    g = engine == "trtllm"
    ok = ("input_scale", "block_scales", "global_scale", "weight_scale_inv", "a weight_scale_2 message (x)",
          "vLLM", "weight", ".scale", "experts")
'''
    found = [(kind, text) for _, kind, text in spellings(source)]
    assert found == [("tensor suffix", ".weight_scale_2"), ("tensor suffix", "_weight_scale"),
                     ("tensor suffix", "experts.gate_up_proj_weight_scale"), ("tensor suffix", "gate_up_proj_blocks"),
                     ("expert pattern", r"^(?P<p>.+\.experts)\.(\d+)$"), ("engine name", "trtllm")]


# -- the writer's and reader's modules: no constant starts with any suffix of the forms at all ------------------

#: held to more than the rule above: ``.weight`` and ``.scale`` count too (error prose and docstrings aside)
STRICT = ["run.py", "plan.py", "shards.py", "inspection.py", "output_forms.py", "detect.py", "input_scales.py"]
#: every suffix of the checkpoint forms, written out (MXFP4 inputs, NVFP4 outputs, the tensors beside them), as well
#: as taken from the records, so that a suffix missing from the records is still caught
BY_HAND = ("_blocks", "_scales", ".weight_packed", ".weight_scale", ".scale", ".weight", "_weight_scale",
           "_weight_scale_2", "_input_scale", ".weight_scale_2", ".input_scale", ".weight_global_scale",
           ".input_global_scale", ".weight_shape", ".weight_scale_inv")
SUFFIXES = set(BY_HAND) | {r.suffix for f in forms.MXFP4_FORMS + forms.NVFP4_FORMS for r in f.roles if r.suffix}


def strict_spellings(source: str) -> list[tuple[int, str]]:
    """(line, constant) of every string constant that starts with a suffix or holds an expert-name regex."""
    tree = ast.parse(source)
    skip = _docstrings(tree)
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip
            and (any(node.value.startswith(s) for s in SUFFIXES) or r"\.experts" in node.value
                 or node.value.endswith(".experts"))]


@pytest.mark.parametrize("name", STRICT)
def test_the_writer_and_reader_modules_spell_no_suffix_at_all(name):
    assert strict_spellings((CHECKPOINT / name).read_text()) == []


@pytest.mark.parametrize("source", ['x = name.endswith(".weight")', 'f"{module}.scale"', 'p + "_weight_scale"',
                                    r're.compile(r"^(.*)\.experts\.(\d+)$")', 'k.endswith(".experts")'])
def test_the_strict_check_sees_a_suffix_or_pattern_wherever_it_is_spelled(source):
    assert strict_spellings(source)
