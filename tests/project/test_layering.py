"""The import graph of fp4pass runs one way (docs/layout.md): no module imports a module of a higher layer,
and no two modules (nor two packages) import each other, directly or through others.

Every ``import`` / ``from ... import`` in a module counts, at module level or inside a function; an import
under ``if TYPE_CHECKING`` counts too. ``from pkg import name`` is an import of ``pkg.name`` when that is a
module, else of ``pkg``. A package's ``__init__`` is not counted as imported by its submodules (Python runs it,
but the code does not depend on it). Lazy public names that point up through ``importlib`` (such as
``fp4pass.onnx.convert`` -> ``fp4pass.pipeline.convert``) are not imports and are listed in docs/layout.md.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "fp4pass"

# lowest first; a module belongs to the longest prefix listed (fp4pass.fx.calibration before fp4pass.fx)
LAYERS = [
    ("base", ["fp4pass.errors", "fp4pass.io", "fp4pass.npz", "fp4pass.metrics", "fp4pass.progress", "fp4pass.choices",
              "fp4pass.extras", "fp4pass.messages"]),
    ("formats", ["fp4pass.formats"]),
    ("convert", ["fp4pass.convert"]),
    ("calib", ["fp4pass.calib"]),  # neutral to the door: statistics, calibrators, scale_for, SCALES.json
    ("safetensors", ["fp4pass.safetensors"]),  # reading checkpoints: files, catalog, bounded patterns, Hub IDs
    ("passes", ["fp4pass.onnx", "fp4pass.fx"]),  # ONNX and fx passes are peers
    # each door's calibration run and diff, above its passes (which never import them)
    ("runs", ["fp4pass.onnx.calibrate", "fp4pass.fx.calibration", "fp4pass.fx.numerics"]),
    ("pipeline", ["fp4pass.pipeline", "fp4pass.study", "fp4pass.checkpoint"]),
    ("commands", ["fp4pass", "fp4pass.cli", "fp4pass.__main__", "fp4pass.commands", "fp4pass.bench",
                  "fp4pass.examples"]),
]
# the units whose mutual imports must also be acyclic, package by package
UNITS = ["fp4pass.formats", "fp4pass.convert", "fp4pass.onnx", "fp4pass.fx", "fp4pass.calib", "fp4pass.safetensors",
         "fp4pass.checkpoint",
         "fp4pass.commands",
         "fp4pass.bench", "fp4pass.examples"]


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imports_of(name: str, path: Path, known) -> dict[str, int]:
    """{imported fp4pass module: first line} for one module."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        for target in targets:
            if (target == "fp4pass" or target.startswith("fp4pass.")) and target != name:
                while target not in known:  # import a.b.c where only a.b is a module of ours: a.b
                    target = target.rpartition(".")[0]
                out.setdefault(target, node.lineno)
    return out


def layer_of(module: str) -> int:
    best, best_len = None, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    return best


def graph() -> dict[str, dict[str, int]]:
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in list(edges):
        if v not in index:
            visit(v)
    return found


def test_every_module_has_a_layer():
    assert [m for m in modules() if layer_of(m) is None] == []


def test_no_upward_import():
    upward = []
    for module, targets in graph().items():
        for target, line in targets.items():
            if layer_of(target) > layer_of(module):
                upward.append(f"{module}:{line} imports {target} "
                              f"({LAYERS[layer_of(module)][0]} -> {LAYERS[layer_of(target)][0]})")
    assert upward == []


def test_no_module_cycle():
    edges = {m: set(t) - {"fp4pass"} for m, t in graph().items()}
    edges = {m: {t for t in ts if not m.startswith(t + ".")} for m, ts in edges.items()}  # no parent __init__
    assert cycles(edges) == []


def test_no_package_cycle():
    def unit(module):
        return next((u for u in UNITS if module == u or module.startswith(u + ".")), module)

    edges: dict[str, set[str]] = {}
    for module, targets in graph().items():
        for target in targets:
            if unit(target) != unit(module) and target != "fp4pass":
                edges.setdefault(unit(module), set()).add(unit(target))
    assert cycles(edges) == []


def _import_graph_of(source: dict[str, str], tmp_path) -> dict[str, dict[str, int]]:
    paths = {}
    for name, text in source.items():
        path = tmp_path / (name.replace(".", "/") + ".py")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        paths[name] = path
    return {name: imports_of(name, path, paths) for name, path in paths.items()}


def test_the_checks_see_function_level_and_relative_imports(tmp_path):
    """The parser itself: a function-level upward import and a two-module cycle are found."""
    found = _import_graph_of({
        "fp4pass.calib.a": "def f():\n    from fp4pass.onnx import calibrate\n",
        "fp4pass.onnx.calibrate": "from ..calib import a\n",
        "fp4pass.calib": "",
        "fp4pass.onnx": "",
    }, tmp_path)
    assert found["fp4pass.calib.a"] == {"fp4pass.onnx.calibrate": 2}
    assert found["fp4pass.onnx.calibrate"] == {"fp4pass.calib.a": 1}
    assert layer_of("fp4pass.onnx.calibrate") > layer_of("fp4pass.calib.a")
    assert cycles({m: set(t) for m, t in found.items()}) == [["fp4pass.calib.a", "fp4pass.onnx.calibrate"]]


@pytest.mark.parametrize("module, layer", [("fp4pass.fx.exporter", "passes"), ("fp4pass.fx.calibration", "runs"),
                                           ("fp4pass.onnx.act_quant", "passes"), ("fp4pass.pipeline", "pipeline"),
                                           ("fp4pass.calib.compute", "calib"), ("fp4pass.onnx.calibrate", "runs")])
def test_layer_assignment(module, layer):
    assert LAYERS[layer_of(module)][0] == layer


def test_checkpoint_calibration_does_not_load_onnx_ir():
    """The checkpoint door calibrates through the neutral fp4pass.calib: importing it loads no ONNX code (a fresh
    interpreter, so that no other test's imports count)."""
    code = ("import sys, fp4pass.checkpoint.calibration, fp4pass.calib\n"
            "print(sorted(m for m in ('onnx_ir', 'onnxruntime') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"
