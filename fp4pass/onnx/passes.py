"""What the ONNX passes of fp4pass share: where a node lives, and how a list of onnx_ir passes runs.

Scopes. A model's nodes live in its main graph, in subgraphs (the ``then_branch`` / ``else_branch`` of If,
the ``body`` of Loop and Scan, recursively) and in the bodies of its local functions (``model.functions``,
each an ``ir.Function`` whose nodes sit in ``function.graph``). A subgraph reads the values of the graphs
around it by reference (an outer-scope initializer is the same ``ir.Value`` in every branch that reads it).
A function body is closed: it reads only its inputs and holds no initializers, so a constant in it is a
``Constant`` node. :func:`all_nodes` visits every node of the three kinds; :func:`function_of` tells which
function, if any, a node's graph belongs to.

Running. :func:`run_passes` runs ``onnx_ir.passes.PassManager`` (one step: each pass once, in order) and
re-raises a pass's own exception rather than the ``PassError`` the manager wraps it in, so that fp4pass's
errors (:mod:`fp4pass.errors`, which the command line maps to exit codes) come through unchanged.

Results. A pass is configured in its ``__init__`` and reports only through what its ``call`` returns: an
``onnx_ir.passes.PassResult`` (``model``, ``modified``), or a dataclass derived from it that adds the pass's
report (``RewriteResult.done``, ``VersionsResult.versions``, ...). The manager itself returns only whether
anything changed, so :func:`run_passes` hands back each pass's own result, in order.
"""

from __future__ import annotations

from collections.abc import Sequence

import onnx_ir as ir

__all__ = ["all_nodes", "function_graphs", "function_of", "function_label", "constant_tensor", "run_passes",
           "ModelNames"]

_WRAPPERS = (ir.passes.PassError, ir.passes.PreconditionError, ir.passes.PostconditionError)


def all_nodes(model: ir.Model) -> list[ir.Node]:
    """Every node of the main graph and its subgraphs, then of each function body and its subgraphs."""
    nodes = list(ir.traversal.RecursiveGraphIterator(model.graph))
    for function in model.functions.values():
        nodes.extend(ir.traversal.RecursiveGraphIterator(function))
    return nodes


def function_graphs(model: ir.Model) -> dict[int, ir.Function]:
    """``id(graph) -> function`` for every function body and every subgraph inside one."""
    owners: dict[int, ir.Function] = {}
    for function in model.functions.values():
        owners[id(function.graph)] = function
        for sub in function.subgraphs():
            owners[id(sub)] = function
    return owners


def function_of(node: ir.Node, owners: dict[int, ir.Function]) -> ir.Function | None:
    """The function whose body holds ``node`` (``owners`` from :func:`function_graphs`), or None."""
    return owners.get(id(node.graph)) if node.graph is not None else None


def function_label(function: ir.Function) -> str:
    """``domain::name`` (with ``:overload`` when it has one), as the report names a function."""
    label = f"{function.domain}::{function.name}"
    return f"{label}:{function.overload}" if function.overload else label


def constant_tensor(value: ir.Value | None) -> ir.TensorProtocol | None:
    """The tensor ``value`` always holds: an initializer's, or a ``Constant`` node's ``value`` attribute
    (how a function body stores constants); None for anything computed at run time or a graph input."""
    if value is None or value.is_graph_input():
        return None
    if value.const_value is not None:
        return value.const_value
    producer = value.producer()
    if producer is not None and producer.op_type == "Constant" and producer.domain == "":
        attr = producer.attributes.get("value")
        if attr is not None and attr.type == ir.AttributeType.TENSOR:
            return attr.value
    return None


class ModelNames:
    """Value names taken anywhere in a model (graphs, subgraphs, function bodies); :meth:`take` hands out
    ``base``, else ``base_1``, ``base_2`` ... so that a new value never shadows or repeats another's name."""

    def __init__(self, model: ir.Model) -> None:
        names: set[str] = set()
        graphs = [*model.graphs()] + [g for f in model.functions.values() for g in (f.graph, *f.subgraphs())]
        for graph in graphs:
            names.update(v.name for v in graph.inputs if v.name)
            names.update(graph.initializers)
            for node in graph:
                names.update(v.name for v in node.outputs if v is not None and v.name)
        self._taken = names

    def take(self, base: str) -> str:
        name, n = base, 0
        while name in self._taken:
            n += 1
            name = f"{base}_{n}"
        self._taken.add(name)
        return name


class _Kept(ir.passes.PassBase):
    """One pass as the manager runs it, its result kept for :func:`run_passes` (the manager returns only
    whether anything changed); in place or not as the pass itself is."""

    def __init__(self, inner: ir.passes.PassBase, results: list) -> None:
        self.inner, self.results = inner, results

    @property
    def in_place(self) -> bool:
        return self.inner.in_place

    @property
    def changes_input(self) -> bool:
        return self.inner.changes_input

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        result = self.inner(model)
        self.results.append(result)
        return result


def run_passes(passes: Sequence[ir.passes.PassBase], model: ir.Model) -> list[ir.passes.PassResult]:
    """Run ``passes`` in order on ``model`` with ``ir.passes.PassManager``; each pass's own result, in order
    (module docstring)."""
    results: list[ir.passes.PassResult] = []
    manager = ir.passes.PassManager([_Kept(p, results) for p in passes], steps=1)
    try:
        manager(model)
        return results
    except _WRAPPERS as exc:
        cause: BaseException = exc
        while isinstance(cause, _WRAPPERS) and cause.__cause__ is not None:
            cause = cause.__cause__
        if cause is exc:
            raise
        raise cause.with_traceback(cause.__traceback__) from cause.__cause__
