"""No module imports another module's private names: a leading underscore says "this module's own", so a name
used elsewhere is made public where it lives (calibration and the diff once shared ``_Clock``, ``_share`` and
``_routed_forward``; they are the layer runner's public names now).

Checked, by parsing each module: ``from fp4pass.x import _y``, and ``m._y`` where ``m`` is an fp4pass module
the file imported (``import fp4pass.x as m``, ``from fp4pass import x``, or the dotted ``fp4pass.x._y``).
Dunder names (``__version__``) are not private. Every module of the package is checked; a module a package
shares among its own modules is a public name of that package (``fp4pass.commands.safety``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECKED = sorted(ROOT.glob("fp4pass/**/*.py"))  # every module of the package


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def private_uses(source: str, filename: str = "<source>") -> list[str]:
    """Each use of another fp4pass module's private name in ``source``: ``line: text``."""
    tree = ast.parse(source, filename)
    modules: dict[str, str] = {}  # local name -> the fp4pass module (or package) it is bound to
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fp4pass") and not node.level:
            for alias in node.names:
                if _private(alias.name):
                    found.append(f"{node.lineno}: from {node.module} import {alias.name}")
                else:
                    modules[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("fp4pass"):
                    modules[alias.asname or alias.name.partition(".")[0]] = alias.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            dotted = _dotted(node.value)
            if dotted is not None and dotted.partition(".")[0] in modules:
                found.append(f"{node.lineno}: {dotted}.{node.attr}")
    return sorted(found, key=lambda s: int(s.partition(":")[0]))


def test_the_checked_modules_exist():
    assert len(CHECKED) >= 150 and all(p.is_file() for p in CHECKED)
    assert ROOT / "fp4pass/checkpoint/layerwise/runner.py" in CHECKED


@pytest.mark.parametrize("path", CHECKED, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_private_name_of_another_module(path):
    assert private_uses(path.read_text(), str(path)) == []


def test_the_check_sees_each_form_of_a_private_use():
    source = "\n".join([
        "from fp4pass.checkpoint.calibration import _LayerStats, CheckpointScales",
        "import fp4pass.checkpoint.layerwise.runner as runner",
        "from fp4pass.checkpoint import numerics",
        "import fp4pass.bench",
        "def f(self, other):",
        "    runner._LIBC_TRIM, numerics._run, fp4pass.bench._helper",
        "    return self._own, other._theirs, runner.__doc__, numerics.diff",
    ])
    assert private_uses(source) == ["1: from fp4pass.checkpoint.calibration import _LayerStats",
                                    "6: runner._LIBC_TRIM", "6: numerics._run", "6: fp4pass.bench._helper"]
