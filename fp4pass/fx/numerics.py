"""``fp4pass.fx.diff``: run two torch programs on the same inputs, node by node, and measure how far apart they are.

Signature::

    result = diff(a, b, example_inputs, *, intermediates=True, snr_min=None, show_progress=None,
                  intermediate_budget_bytes=1 << 30)

The fx counterpart of :func:`fp4pass.onnx.diff`, with its result type (:class:`~fp4pass.onnx.numerics.
DiffResult`: ``to_json``, ``format_table``; ``plot_diff(result, path)`` draws it) and its metrics
(:func:`fp4pass.metrics.compare`, ``a`` the reference):

1. ``a`` and ``b``: ``ExportedProgram`` (run as ``program.module()``), ``GraphModule``, or another
   ``nn.Module`` exported first with ``torch.export.export(module, example_inputs)``. ``example_inputs``: a
   tuple of positional inputs, a dict of keyword inputs, or one tensor; moved to each model's device.
2. Each model runs through a ``torch.fx.Interpreter`` (``torch.no_grad``) that keeps the outputs of the
   nodes being compared, as CPU copies (floating types other than float16/32/64 as float32).
3. Outputs are matched by position; each is named after the node of ``a`` that produces it.
4. ``intermediates``: every ``call_function`` / ``call_method`` / ``call_module`` node of ``a`` whose name is
   also a node of ``b`` and whose value is a tensor in both (graph inputs and weights are not nodes that
   compute, so they are not compared). They are kept in chunks whose size, estimated from each node's
   ``meta["val"]``, stays under ``intermediate_budget_bytes``; each chunk is one run of each model, so memory
   stays near the budget, whatever the model. Shapes that differ are noted and skipped.
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

from fp4pass.errors import ModelError, UsageError
from fp4pass.metrics import TensorMetrics, compare
from fp4pass.onnx.numerics import DiffResult, plot_diff
from fp4pass.onnx.numerics import _sort_key  # worst first, the ONNX diff's own order
from fp4pass.progress import progress

__all__ = ["diff", "DiffResult", "plot_diff"]

log = logging.getLogger(__name__)

_ERROR_SAMPLE = 200_000  # |a-b| values kept from the worst output, for the histogram
_DEFAULT_BYTES = 4 << 20  # size assumed for a node whose meta holds no tensor shape
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
        return model.module()
    if isinstance(model, torch.fx.GraphModule):
        return model
    if isinstance(model, torch.nn.Module):
        log.info("fx diff: exporting %s (%s) with torch.export.export", label, type(model).__name__)
        return torch.export.export(model, args, kwargs).module()
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


def _estimate_bytes(node: torch.fx.Node) -> int:
    val = node.meta.get("val", node.meta.get("tensor_meta"))
    shape, dtype = getattr(val, "shape", None), getattr(val, "dtype", None)
    if shape is None or dtype is None or not all(isinstance(d, int) for d in shape):
        return _DEFAULT_BYTES
    return int(math.prod(shape)) * max(dtype.itemsize, 4)


def _chunks(names: list[str], sizes: dict[str, int], budget: int) -> list[list[str]]:
    chunks, current, used = [], [], 0
    for name in names:
        if current and used + sizes[name] > budget:
            chunks.append(current)
            current, used = [], 0
        current.append(name)
        used += sizes[name]
    if current:
        chunks.append(current)
    return chunks


class _Recorder(torch.fx.Interpreter):
    """Runs a GraphModule node by node; keeps CPU copies of the tensor outputs of the nodes in ``keep``."""

    def __init__(self, gm: torch.fx.GraphModule, keep: set[str]):
        super().__init__(gm, garbage_collect_values=True)
        self.keep = keep
        self.kept: dict[str, np.ndarray] = {}

    def run_node(self, node: torch.fx.Node):
        result = super().run_node(node)
        if node.name in self.keep and isinstance(result, torch.Tensor):
            self.kept[node.name] = _to_numpy(result)
        return result


class _Runner:
    """One model, its inputs on its device, run through :class:`_Recorder` for a set of node names."""

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

    def run(self, keep: set[str]) -> tuple[dict[str, np.ndarray], list]:
        recorder = _Recorder(self.gm, keep)
        try:
            with torch.no_grad():
                if self.pytree_io:  # the graph flattens (args, kwargs) itself, as the module's forward does
                    out = recorder.run(self.args, self.kwargs)
                else:
                    out = recorder.run(*self.args)
        except Exception as exc:  # noqa: BLE001 - the model's own errors, reported with its label
            raise ModelError(f"fx diff: {self.label} failed to run: {str(exc).strip().splitlines()[0]}") from exc
        leaves = [_to_numpy(v) if isinstance(v, torch.Tensor) else v for v in pytree.tree_leaves(out)]
        return recorder.kept, leaves


def diff(a, b, example_inputs, *, intermediates: bool = True, snr_min: float | None = None,
         show_progress: bool | None = None, intermediate_budget_bytes: int = 1 << 30) -> DiffResult:
    """Compare ``b`` against ``a`` node by node (module docstring for every step)."""
    args, kwargs = _split_inputs(example_inputs)
    runner_a = _Runner(_graph_module(a, args, kwargs, "a"), args, kwargs, "a")
    runner_b = _Runner(_graph_module(b, args, kwargs, "b"), args, kwargs, "b")
    notes: list[str] = []

    out_nodes = runner_a.output_nodes()
    out_names = [n.name if isinstance(n, torch.fx.Node) else f"output_{i}" for i, n in enumerate(out_nodes)]
    inter_names = []
    if intermediates:
        inter_names = [n.name for n in runner_a.gm.graph.nodes
                       if n.op in _COMPUTING and n.name in runner_b.nodes and runner_b.nodes[n.name].op in _COMPUTING
                       and n.name not in out_names]
    sizes = {n: max(_estimate_bytes(runner_a.nodes[n]), _estimate_bytes(runner_b.nodes[n])) for n in inter_names}
    chunks = _chunks(inter_names, sizes, intermediate_budget_bytes) or [[]]

    output_metrics: list[TensorMetrics] = []
    inter_metrics: list[TensorMetrics] = []
    worst_errors, worst_key = None, None
    sample_rng = np.random.default_rng(0)
    for i, chunk in enumerate(progress(chunks, desc="fx diff: running both models", enabled=show_progress)):
        kept_a, leaves_a = runner_a.run(set(chunk))
        kept_b, leaves_b = runner_b.run(set(chunk))
        if i == 0:
            if len(leaves_a) != len(leaves_b):
                raise ModelError(f"fx diff: a has {len(leaves_a)} outputs, b has {len(leaves_b)}")
            for name, value_a, value_b in zip(out_names, leaves_a, leaves_b):
                if not isinstance(value_a, np.ndarray) or not isinstance(value_b, np.ndarray):
                    notes.append(f"output {name!r} is not a tensor in both; not compared")
                    continue
                try:
                    metrics, errors = compare(name, value_a, value_b, keep_errors=True)
                except ValueError as exc:
                    raise ModelError(f"fx diff: output {exc}") from None
                output_metrics.append(metrics)
                key = _sort_key(metrics)
                if worst_key is None or key < worst_key:
                    worst_key = key
                    if errors.size > _ERROR_SAMPLE:
                        errors = sample_rng.choice(errors, _ERROR_SAMPLE, replace=False)
                    worst_errors = errors
        for name in chunk:
            if name not in kept_a or name not in kept_b:
                continue
            value_a, value_b = kept_a.pop(name), kept_b.pop(name)
            if value_a.shape != value_b.shape:
                notes.append(f"node {name!r}: shapes differ ({value_a.shape} vs {value_b.shape}); not compared")
                continue
            if not (np.issubdtype(value_a.dtype, np.number) or value_a.dtype == np.bool_):
                continue
            inter_metrics.append(compare(name, value_a, value_b))
        del kept_a, kept_b

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

