"""``fp4pass.fx.diff``: run two torch programs on the same inputs, node by node, and measure how far apart they are.

Signature::

    result = diff(a, b, example_inputs, *, intermediates=True, weights=False, snr_min=None, show_progress=None,
                  intermediate_budget_bytes=1 << 30)

The fx counterpart of :func:`fp4pass.onnx.diff`, with its result type (:class:`~fp4pass.onnx.numerics.
DiffResult`: ``to_json``, ``format_table``; ``plot_diff(result, path)`` draws it) and its metrics
(:func:`fp4pass.metrics.compare`, ``a`` the reference):

1. ``a`` and ``b``: ``ExportedProgram`` (run as ``program.module()``), ``GraphModule``, or another
   ``nn.Module`` exported first with ``torch.export.export(module, example_inputs)``. ``example_inputs``: a
   tuple of positional inputs, a dict of keyword inputs, or one tensor; moved to each model's device.
2. Each model runs once, through a ``torch.fx.Interpreter`` (``torch.no_grad``) that frees every value after
   its last use. The two runs advance in lockstep: ``a`` runs up to its next compared node, then ``b`` runs
   until it has computed that node, so the values of a compared pair are alive together and nothing else is
   kept. The time is that of one forward of each model plus the metrics, whatever the depth; the memory is
   that of the larger forward plus the CPU copies (floating types other than float16/32/64 as float32) of the
   pairs not yet matched: one, when ``b``'s graph computes the nodes in ``a``'s order (a converted or
   calibrated program), at most ``intermediate_budget_bytes`` otherwise (older unmatched values are dropped
   beyond it, with a note).
3. Outputs are matched by position; each is named after the node of ``a`` that produces it.
4. ``intermediates``: the ``call_function`` / ``call_method`` / ``call_module`` nodes of ``a`` whose name is
   also a node of ``b`` and whose value is a tensor in both (graph inputs and stored weights are not nodes
   that compute, so they are not compared). By default only activations: a node computed from stored
   tensors alone (a dequantized weight, its transpose, a constant mask) is a weight copy, compared only with
   ``weights=True`` (it is as large as the weight, and its error is the conversion's, which the convert
   report already gives). ``result.notes`` says how many nodes were compared and how many weight copies were
   skipped. Shapes that differ are noted and skipped.
5. ``first_divergent``: the first node of ``a`` in graph (topological) order with a compared output under
   ``snr_min`` dB, or with NaN/Inf ``a`` does not have: ``{"node", "op_type", "tensor", "snr_db"}``, where
   ``op_type`` is the node's target (``fp4pass.dequantize_mxfp4.default``, ``aten.matmul.default``, ...).
6. ``passed``: no output under ``snr_min`` and no output with new NaN/Inf. ``provider``: ``torch:DEVICE``
   of ``a``.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import torch
import torch.fx
from torch.utils import _pytree as pytree

from fp4pass.errors import FP4PassError, ModelError, UsageError
from fp4pass.metrics import TensorMetrics, compare
from fp4pass.onnx.numerics import DiffResult, plot_diff
from fp4pass.onnx.diff_result import worst_first  # the ONNX diff's own order
from fp4pass.fx.program import program_module
from fp4pass.fx.shapes import check_inputs, guard_error
from fp4pass.progress import progress

__all__ = ["diff", "DiffResult", "plot_diff"]

log = logging.getLogger(__name__)

_ERROR_SAMPLE = 200_000  # |a-b| values kept from the worst output, for the histogram
_COMPUTING = ("call_function", "call_method", "call_module")
_NUMPY_FLOATS = (torch.float16, torch.float32, torch.float64)


def _split_inputs(example_inputs) -> tuple[tuple, dict]:
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    raise UsageError("fx diff: example_inputs must be a tuple, a dict or a tensor, "
                     f"got {type(example_inputs).__name__}")


def _graph_module(model, args: tuple, kwargs: dict, label: str) -> torch.fx.GraphModule:
    if isinstance(model, torch.export.ExportedProgram):
        return program_module(model)
    if isinstance(model, torch.fx.GraphModule):
        return model
    if isinstance(model, torch.nn.Module):
        log.info("fx diff: exporting %s (%s) with torch.export.export", label, type(model).__name__)
        return program_module(torch.export.export(model, args, kwargs))
    raise UsageError(f"fx diff: {label} must be an ExportedProgram, a GraphModule or an nn.Module, "
                     f"got {type(model).__name__}")


def _device_of(module: torch.nn.Module) -> torch.device:
    for tensor in (*module.parameters(), *module.buffers()):
        return tensor.device
    return torch.device("cpu")


def _to_numpy(value: torch.Tensor) -> np.ndarray:
    value = value.detach()
    if value.dtype.is_floating_point and value.dtype not in _NUMPY_FLOATS:
        value = value.float()
    return value.cpu().numpy()


def _op_type(node: torch.fx.Node) -> str:
    if node.op == "call_module":
        return f"module {node.target}"
    if node.op == "call_method":
        return f"method {node.target}"
    target = node.target
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(target)
    return getattr(target, "__name__", str(target))


class _Stepper(torch.fx.Interpreter):
    """Runs a GraphModule node by node as a generator: yields ``(node, value)`` after each computing node and
    returns the graph's outputs; every value is freed after its last use (``torch.fx.Interpreter.run``'s loop,
    paused between nodes)."""

    def __init__(self, gm: torch.fx.GraphModule):
        super().__init__(gm, garbage_collect_values=True)

    def steps(self, *args):
        self.env = {}
        self.args_iter = iter(self.graph.process_inputs(*args))
        for node in self.graph.nodes:
            value = self.env[node] = self.run_node(node)
            for dead in self.user_to_last_uses.get(node, []):
                del self.env[dead]
            if node.op == "output":
                return self.graph.process_outputs(value)
            if node.op in _COMPUTING:
                yield node, value
            del value
        raise ModelError("fx diff: the graph has no output node")


class _Runner:
    """One model, its inputs on its device, run through :class:`_Stepper`."""

    def __init__(self, gm: torch.fx.GraphModule, args: tuple, kwargs: dict, label: str):
        self.gm, self.label = gm, label
        self.device = _device_of(gm)

        def move(value):
            return value.to(self.device) if isinstance(value, torch.Tensor) else value

        self.args, self.kwargs = pytree.tree_map(move, (args, kwargs))
        self.pytree_io = isinstance(gm.graph._codegen, torch.fx.graph._PyTreeCodeGen)
        if kwargs and not self.pytree_io:
            raise UsageError(f"fx diff: {label} takes positional inputs only (a symbolic_trace GraphModule)")
        self.nodes = {n.name: n for n in gm.graph.nodes}

    def output_nodes(self) -> list:
        (output,) = [n for n in self.gm.graph.nodes if n.op == "output"]
        return pytree.tree_leaves(output.args[0])

    def steps(self):
        """A generator of (node, value) over the computing nodes; its return value is the output leaves."""
        stepper = _Stepper(self.gm)
        inputs = (self.args, self.kwargs) if self.pytree_io else self.args  # pytree graphs flatten (args, kwargs)
        run = stepper.steps(*inputs)
        while True:
            try:
                with torch.no_grad():
                    item = next(run)
            except StopIteration as stop:
                return [_to_numpy(v) if isinstance(v, torch.Tensor) else v for v in pytree.tree_leaves(stop.value)]
            except FP4PassError:
                raise
            except Exception as exc:  # noqa: BLE001 - the model's own errors, reported with its label
                shape = guard_error(exc, f"fx diff: {self.label}")
                if shape is not None:
                    raise shape from None
                raise ModelError(f"fx diff: {self.label} failed to run: "
                                 f"{str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}"
                                 ) from exc
            yield item


def _weight_copies(gm: torch.fx.GraphModule) -> set[str]:
    """Names of the computing nodes whose value depends on no graph input: dequantized weights and views of
    them, constants built in the graph."""
    constant: set[str] = set()
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            constant.add(node.name)
        elif node.op in _COMPUTING:
            inputs = node.all_input_nodes
            if all(n.name in constant for n in inputs):
                constant.add(node.name)
    return {n.name for n in gm.graph.nodes if n.op in _COMPUTING and n.name in constant}


class _Lockstep:
    """Walks both runs so that each compared pair is alive together (module docstring, step 2)."""

    def __init__(self, runner_a: "_Runner", runner_b: "_Runner", names: set[str], budget: int):
        self.run_a, self.run_b = runner_a.steps(), runner_b.steps()
        self.names, self.budget = names, budget
        self.pending_b: dict[str, np.ndarray] = {}  # compared values b computed before a did
        self.pending_bytes = 0
        self.dropped: list[str] = []
        self.leaves_a = self.leaves_b = None

    def _next_b(self):
        if self.leaves_b is not None:
            return None
        try:
            return next(self.run_b)
        except StopIteration as stop:
            self.leaves_b = stop.value
            return None

    def pairs(self):
        """Yield (name, value of a, value of b) for each compared node both runs computed."""
        while True:
            try:
                node, value = next(self.run_a)
            except StopIteration as stop:
                self.leaves_a = stop.value
                break
            if node.name not in self.names or not isinstance(value, torch.Tensor):
                continue
            value_a = _to_numpy(value)
            del value
            if node.name in self.pending_b:
                value_b = self.pending_b.pop(node.name)
                self.pending_bytes -= value_b.nbytes
                yield node.name, value_a, value_b
                continue
            while (step := self._next_b()) is not None:
                node_b, value = step
                if node_b.name == node.name:  # the partner (not compared when it is no tensor in b)
                    if isinstance(value, torch.Tensor):
                        yield node.name, value_a, _to_numpy(value)
                    break
                if node_b.name in self.names and isinstance(value, torch.Tensor):
                    self._hold(node_b.name, _to_numpy(value))
        while self._next_b() is not None:  # b's remaining nodes (its outputs)
            pass

    def _hold(self, name: str, value: np.ndarray) -> None:
        self.pending_b[name] = value
        self.pending_bytes += value.nbytes
        while self.pending_bytes > self.budget and len(self.pending_b) > 1:
            oldest = next(iter(self.pending_b))
            self.pending_bytes -= self.pending_b.pop(oldest).nbytes
            self.dropped.append(oldest)


def diff(reference, candidate, example_inputs, *, intermediates: bool = True, weights: bool = False, snr_min: float | None = None,
         show_progress: bool | None = None, intermediate_budget_bytes: int = 1 << 30) -> DiffResult:
    """Compare ``candidate`` against ``reference`` node by node, each model run once (module docstring for every
    step)."""
    args, kwargs = _split_inputs(example_inputs)
    for label, model in (("a", reference), ("b", candidate)):
        check_inputs(model, args, kwargs, f"fx diff: {label}")  # before either model runs
    runner_a = _Runner(_graph_module(reference, args, kwargs, "a"), args, kwargs, "a")
    runner_b = _Runner(_graph_module(candidate, args, kwargs, "b"), args, kwargs, "b")
    notes: list[str] = []

    out_nodes = runner_a.output_nodes()
    out_names = [n.name if isinstance(n, torch.fx.Node) else f"output_{i}" for i, n in enumerate(out_nodes)]
    inter_names: list[str] = []
    skipped_weights = 0
    if intermediates:
        inter_names = [n.name for n in runner_a.gm.graph.nodes
                       if n.op in _COMPUTING and n.name in runner_b.nodes and runner_b.nodes[n.name].op in _COMPUTING
                       and n.name not in out_names]
        if not weights:
            copies = _weight_copies(runner_a.gm) | _weight_copies(runner_b.gm)
            skipped_weights = sum(name in copies for name in inter_names)
            inter_names = [name for name in inter_names if name not in copies]

    inter_metrics: list[TensorMetrics] = []
    walk = _Lockstep(runner_a, runner_b, set(inter_names), intermediate_budget_bytes)
    pairs = progress(walk.pairs(), desc="fx diff: running both models", enabled=show_progress, total=len(inter_names),
                     unit="node")
    for name, value_a, value_b in pairs:
        if value_a.shape != value_b.shape:
            notes.append(f"node {name!r}: shapes differ ({value_a.shape} vs {value_b.shape}); not compared")
            continue
        if not (np.issubdtype(value_a.dtype, np.number) or value_a.dtype == np.bool_):
            continue
        inter_metrics.append(compare(name, value_a, value_b))
        del value_a, value_b
    if walk.dropped:
        notes.append(f"{len(walk.dropped)} nodes not compared: b computes them too long before a "
                     f"(over intermediate_budget_bytes), e.g. {walk.dropped[0]!r}")
    notes.append(f"compared {len(inter_metrics)} intermediate activations and {len(out_names)} outputs"
                 + (f"; {skipped_weights} weight copies not compared (weights=True compares them)"
                    if skipped_weights else ""))

    leaves_a, leaves_b = walk.leaves_a, walk.leaves_b
    if len(leaves_a) != len(leaves_b):
        raise ModelError(f"fx diff: a has {len(leaves_a)} outputs, b has {len(leaves_b)}")
    output_metrics: list[TensorMetrics] = []
    worst_errors, worst_key = None, None
    sample_rng = np.random.default_rng(0)
    for name, value_a, value_b in zip(out_names, leaves_a, leaves_b):
        if not isinstance(value_a, np.ndarray) or not isinstance(value_b, np.ndarray):
            notes.append(f"output {name!r} is not a tensor in both; not compared")
            continue
        try:
            metrics, errors = compare(name, value_a, value_b, keep_errors=True)
        except ValueError as exc:
            raise ModelError(f"fx diff: output {exc}") from None
        output_metrics.append(metrics)
        key = worst_first(metrics)
        if worst_key is None or key < worst_key:
            worst_key = key
            if errors.size > _ERROR_SAMPLE:
                errors = sample_rng.choice(errors, _ERROR_SAMPLE, replace=False)
            worst_errors = errors

    by_name = {m.name: m for m in [*inter_metrics, *output_metrics]}
    first = None
    if snr_min is not None or any(m.new_nonfinite for m in by_name.values()):
        for node in runner_a.gm.graph.nodes:
            hit = by_name.get(node.name)
            if hit is not None and hit.below(snr_min):
                first = {"node": node.name, "op_type": _op_type(node), "tensor": hit.name,
                         "snr_db": None if hit.snr_db is None or not math.isfinite(hit.snr_db) else hit.snr_db}
                break
    passed = not any(m.below(snr_min) for m in output_metrics)
    order = [n.name for n in runner_a.gm.graph.nodes if n.name in by_name]
    order += [m.name for m in output_metrics if m.name not in order]
    for note in notes:
        log.debug("fx diff: %s", note)
    return DiffResult(f"torch:{runner_a.device.type}", output_metrics, inter_metrics, first, passed, notes, snr_min,
                      order, worst_errors)
