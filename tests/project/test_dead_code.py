"""No dead code in the library: every fp4pass.convert module is used by the library itself (a helper only a
test uses lives with the tests), every function of the ONNX stages is called, no parameter is ignored; and the
suite runs where the optional plot extra is absent."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "fp4pass"

# methods whose parameter is part of an interface the subclasses use (the base ignores it by design)
INTERFACE_PARAMETERS = {("fp4pass/onnx/lower.py", "check_in", "function"), ("fp4pass/onnx/patterns.py", "records", "node")}


def _sources(folder: Path) -> dict[Path, str]:
    return {p: p.read_text() for p in sorted(folder.rglob("*.py"))}


def _imported(path: Path) -> set[str]:
    """Modules ``path`` imports (``from pkg import name`` counts as ``pkg.name`` too), relative ones resolved."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def test_every_convert_module_is_used_by_the_library():
    imports = {p: _imported(p) for p in PACKAGE.rglob("*.py")}
    for path in sorted((PACKAGE / "convert").glob("*.py")):
        if path.name == "__init__.py":
            continue
        module = f"fp4pass.convert.{path.stem}"
        users = [p for p, names in imports.items() if p != path and module in names]
        assert users, f"{module} is imported by no fp4pass module (only by tests?): it belongs with the tests"


def test_every_function_of_the_onnx_stages_is_called():
    path = PACKAGE / "onnx" / "pipeline.py"
    tree = ast.parse(path.read_text())
    others = "\n".join(text for p, text in _sources(PACKAGE).items() if p != path)
    own = path.read_text()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            called_elsewhere = re.search(rf"\b{node.name}\b", others)
            called_here = len(re.findall(rf"\b{node.name}\b", own)) > 2  # beyond its def and __all__
            assert called_elsewhere or called_here, f"fp4pass.onnx.pipeline.{node.name} is never used"


def test_no_library_function_ignores_a_parameter():
    found = []
    for folder in ("onnx", "convert"):
        for path, text in _sources(PACKAGE / folder).items():
            rel = path.relative_to(ROOT).as_posix()
            for node in ast.walk(ast.parse(text)):
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                if isinstance(node.body[-1], ast.Raise) and len(node.body) <= 2:  # an abstract method
                    continue
                args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                used = {n.id for stmt in node.body for n in ast.walk(stmt) if isinstance(n, ast.Name)}
                for arg in args:
                    name = arg.arg
                    if name in ("self", "cls") or name.startswith("_") or (rel, node.name, name) in INTERFACE_PARAMETERS:
                        continue
                    if name not in used:
                        found.append(f"{rel}:{node.lineno} {node.name}({name})")
    assert found == []


def test_the_suite_runs_without_the_plot_extra():
    """matplotlib hidden: the tests that write plots skip that part instead of failing."""
    code = ("import sys; sys.modules['matplotlib'] = None; import pytest; "
            "sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', 'tests/cli/test_cmd_outputs.py', "
            "'-k', 'models_mode or unsupported_plot']))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stdout[-2000:]
