"""``fp4pass.fx.calibrate`` (this module: ``fp4pass.fx.calibration``): NVFP4 activation scales for a torch program.

Signature::

    program, scales = calibrate(model, batches, calibrator="max", *, device=None, dynamic_shapes=None,
                                process_group=None, show_progress=False, **calibrator_options)

1. ``model``: a ``torch.export.ExportedProgram`` or a ``torch.fx.GraphModule`` (returned as the same kind), or
   any other ``nn.Module``, which is first exported with ``torch.export.export(model, *first batch*,
   dynamic_shapes=dynamic_shapes)`` and returned as an ``ExportedProgram``. The input is not changed: the
   result is a new program (or GraphModule) that shares the input's weights.
2. Targets (:func:`calibration_targets`): the activation operand of every matmul whose other operand is an
   FP4 weight, i.e. comes from ``torch.ops.fp4pass.dequantize_mxfp4`` / ``dequantize_nvfp4`` through
   view, transpose, dtype, indexing and split ops. Matmuls are ``aten.mm / matmul / bmm / linear / addmm /
   baddbmm / _grouped_mm / einsum`` (and ``torch.matmul``, ``@``, ``F.linear``, ... in a ``symbolic_trace``
   graph). Each activation is calibrated once however many FP4 matmuls read it. Declined, with the reason (logged):
   an activation not contracted along its last axis (the weight is ``mm``'s first operand, an einsum that
   does not contract it), a constant activation, a last dim that is not a multiple of 16.
3. Check: each batch's inputs against the shapes the program was exported for (a dim fixed at export, or
   outside its ``torch.export.Dim`` range, is a ShapeError that names it and shows how to export it as
   dynamic), and against what the model reads (an empty input; token ids read by an embedding that are not
   integers or fall outside its vocabulary: a CalibrationDataError naming the batch and the input). A list
   or tuple of batches is checked whole before any batch runs; another iterable, each batch before it runs.
   A failure of the model itself on a batch is a CalibrationDataError naming the batch.
4. Collect: the batches are streamed, one at a time, through a copy of the graph with an observer after each
   target (``torch.no_grad``); each observer feeds the tensor to its
   :class:`~fp4pass.calib.stats.ActivationStats`, the same statistics as ``fp4pass calibrate`` on ONNX, kept on
   the model's device (CUDA when the model is there). A batch is a tuple of positional inputs, a dict of
   keyword inputs, or one tensor; tensors are moved to the model's device.
5. Distributed: when a ``torch.distributed`` process group is initialised, the statistics are reduced over
   its ranks (:func:`fp4pass.calib.distributed.all_reduce_stats`: MAX for amax, SUM for counts and
   histograms) before the scales are computed, so every rank gets the scales of all ranks' data.
6. Compute: the calibrator (:func:`fp4pass.calib.make_calibrator`; max, percentile, headroom, mse) gives
   ``g_amax``; :func:`fp4pass.calib.scale_for` the :class:`~fp4pass.calib.ActivationScale`
   (``input_scale = g_amax / (6*448)``, FP32).
7. Insert: ``torch.ops.fp4pass.fake_quantize_nvfp4(x, input_scale)`` (:mod:`fp4pass.fx.act_ops`) after each
   calibrated activation ``x``, node name ``{x}_fake_quantize_nvfp4``; only the FP4 matmuls are rewired to
   it, other readers keep the float ``x``.

``scales`` is an :class:`~fp4pass.calib.ActivationScales` keyed by the fx node name of each activation (the
name ``fp4pass.fx.export`` gives that tensor in ONNX); ``scales.save(path)`` writes SCALES.json.
"""

from __future__ import annotations

import copy
import itertools
import logging
from dataclasses import dataclass, field

import torch
import torch.fx
from torch.utils import _pytree as pytree

from fp4pass.calib import ActivationScales, ActivationStats, make_calibrator
from fp4pass.calib.distributed import all_reduce_stats, distributed_ready
from fp4pass.calib import CalibrationDataError, scale_for
from fp4pass.onnx.activations import einsum_contracts_last
from fp4pass.errors import FP4PassError, ModelError, NonFiniteError, UsageError
from fp4pass.formats import NV_BLOCK_SIZE
from fp4pass.fx import act_ops  # noqa: F401  (registers torch.ops.fp4pass.fake_quantize_nvfp4)
from fp4pass.fx import ops  # noqa: F401  (registers torch.ops.fp4pass.dequantize_*)
from fp4pass.fx.program import copy_graph_module, program_module
from fp4pass.fx.shapes import check_inputs, guard_error, input_problem
from fp4pass.progress import progress
from fp4pass.fx.noise import quiet_torch

__all__ = ["calibrate", "calibration_targets", "insert_fake_quantizers", "FxCalibrationTarget", "DEQUANT_TARGETS"]

log = logging.getLogger(__name__)

DEQUANT_TARGETS = (
    torch.ops.fp4pass.dequantize_mxfp4, torch.ops.fp4pass.dequantize_mxfp4.default,
    torch.ops.fp4pass.dequantize_nvfp4, torch.ops.fp4pass.dequantize_nvfp4.default,
)
# ops that move or view a weight without touching its values or its blocking: followed from matmul to dequant
_PASSTHROUGH = frozenset({
    "t", "transpose", "permute", "numpy_T", "T", "mT", "view", "reshape", "_unsafe_view", "expand", "expand_as",
    "contiguous", "clone", "alias", "detach", "_to_copy", "to", "type", "type_as", "float", "half", "bfloat16",
    "unsqueeze", "squeeze", "select", "index", "slice", "narrow", "flatten", "unflatten", "movedim", "swapaxes",
    "swapdims", "getitem", "getattr", "split", "split_with_sizes", "chunk", "unbind",
})
# matmul name -> (operand positions, the position whose last axis is contracted)
_MATMULS = {
    "mm": ((0, 1), 0), "matmul": ((0, 1), 0), "bmm": ((0, 1), 0), "linear": ((0, 1), 0),
    "addmm": ((1, 2), 1), "baddbmm": ((1, 2), 1), "addbmm": ((1, 2), 1),
    "_grouped_mm": ((0, 1), 0), "grouped_mm": ((0, 1), 0),
}
_FAKE_QUANT = torch.ops.fp4pass.fake_quantize_nvfp4.default


@dataclass
class FxCalibrationTarget:
    """An activation to calibrate: its fx node name and the FP4 matmul nodes that read it."""

    name: str
    consumers: list[str] = field(default_factory=list)


def _op_name(node: torch.fx.Node) -> str | None:
    """The op's short name (``aten.mm.default`` -> ``mm``, ``torch.matmul`` -> ``matmul``), or None."""
    if node.op == "call_method":
        return node.target
    if node.op != "call_function":
        return None
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target._opname if target.namespace in ("aten", "prims") else None
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target.__name__ if target._qualified_op_name.startswith("aten::") else None
    name = getattr(target, "__name__", None)
    if name == "getattr" and len(node.args) > 1:
        return node.args[1] if node.args[1] in ("T", "mT") else None
    return name.strip("_") if name else None


def _dequant_source(value) -> torch.fx.Node | None:
    """The FP4 dequant node ``value`` is computed from through pass-through ops, or None."""
    while isinstance(value, torch.fx.Node):
        if value.op == "call_function" and value.target in DEQUANT_TARGETS:
            return value
        if _op_name(value) not in _PASSTHROUGH or not value.args:
            return None
        value = value.args[0]
    return None


def _operands(node: torch.fx.Node) -> tuple[list, int | None, str | None]:
    """(operands, index of the operand contracted along its last axis, einsum equation) of a matmul node."""
    name = _op_name(node)
    if name == "einsum":
        equation, *rest = node.args
        operands = list(rest[0]) if len(rest) == 1 and isinstance(rest[0], (list, tuple)) else list(rest)
        return operands, None, equation
    positions, contracted = _MATMULS[name]
    args = list(node.args) + [None] * 3
    return [args[p] for p in positions], positions.index(contracted), None


def _constant_names(graph_owner) -> set[str]:
    """Placeholder names that stand for parameters, buffers or constants of an ExportedProgram."""
    if not isinstance(graph_owner, torch.export.ExportedProgram):
        return set()
    kinds = (torch.export.graph_signature.InputKind.USER_INPUT, torch.export.graph_signature.InputKind.TOKEN)
    return {spec.arg.name for spec in graph_owner.graph_signature.input_specs if spec.kind not in kinds}


def _activation_reason(activation, constants: set[str]) -> str | None:
    if not isinstance(activation, torch.fx.Node):
        return "activation is not a tensor of the graph"
    if activation.op == "get_attr" or activation.name in constants:
        return f"activation {activation.name!r} is a constant"
    if _dequant_source(activation) is not None:
        return "both operands are FP4 weights"
    val = activation.meta.get("val")
    if isinstance(val, torch.Tensor):
        if not val.dtype.is_floating_point:
            return f"activation {activation.name!r} is {val.dtype}, not floating point"
        last = val.shape[-1] if val.dim() else None
        if last is None:
            return f"activation {activation.name!r} is a scalar"
        if isinstance(last, int) and last % NV_BLOCK_SIZE:
            return f"activation {activation.name!r}: last dim {last} is not a multiple of 16"
    return None


def calibration_targets(program) -> tuple[list[FxCalibrationTarget], list[dict]]:
    """(targets, declined): the activations of FP4 matmuls in ``program`` (ExportedProgram or GraphModule).

    Module docstring, step 2. ``declined`` entries: ``{"node", "activation", "reason"}``.
    """
    graph = program.graph
    constants = _constant_names(program)
    targets: dict[str, FxCalibrationTarget] = {}
    declined: list[dict] = []
    for node in graph.nodes:
        name = _op_name(node)
        if name != "einsum" and name not in _MATMULS:
            continue
        operands, contracted, equation = _operands(node)
        weights = [i for i, operand in enumerate(operands) if _dequant_source(operand) is not None]
        if not weights or len(operands) != 2:
            continue
        activation_index = 1 - weights[0]
        activation = operands[activation_index]
        if equation is not None:
            ok = einsum_contracts_last(equation, activation_index)
            reason = None if ok else "einsum does not contract the activation's last axis"
        else:
            reason = None if activation_index == contracted else \
                "activation is the second operand (its last axis is not contracted)"
        reason = reason or _activation_reason(activation, constants)
        if reason:
            entry = {"node": node.name, "activation": getattr(activation, "name", None), "reason": reason}
            declined.append(entry)
            log.info("fx calibration: node %s declined: %s", node.name, reason)
            continue
        targets.setdefault(activation.name, FxCalibrationTarget(activation.name)).consumers.append(node.name)
    return list(targets.values()), declined


# -- the program ---------------------------------------------------------------------------------------------


def _split_batch(batch) -> tuple[tuple, dict]:
    if isinstance(batch, dict):
        return (), dict(batch)
    if isinstance(batch, (tuple, list)):
        return tuple(batch), {}
    if isinstance(batch, torch.Tensor):
        return (batch,), {}
    raise CalibrationDataError(f"calibration batch: expected a tuple of inputs, a dict or a tensor, "
                               f"got {type(batch).__name__}")


def _as_program(model, first_batch, dynamic_shapes):
    """(program, kind): an ExportedProgram / GraphModule as is; another nn.Module exported on ``first_batch``."""
    if isinstance(model, (torch.export.ExportedProgram, torch.fx.GraphModule)):
        return model
    if isinstance(model, torch.nn.Module):
        args, kwargs = _split_batch(first_batch)
        log.info("fx calibration: exporting %s with torch.export.export on the first batch", type(model).__name__)
        return torch.export.export(model, args, kwargs, dynamic_shapes=dynamic_shapes)
    raise UsageError(f"fx calibrate: expected an ExportedProgram, a GraphModule or an nn.Module, "
                     f"got {type(model).__name__}")


def _fetch(module: torch.nn.Module, target: str):
    obj = module
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _copy_sharing_weights(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A deep copy of ``gm`` (graph, submodules, hooks) whose parameters, buffers and tensor attributes are the
    same tensors as ``gm``'s: editing the copy's graph leaves ``gm`` as it was, and no weight is copied."""
    tensors = itertools.chain(gm.parameters(), gm.buffers(),
                              (_fetch(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr"))
    memo = {id(t): t for t in tensors if isinstance(t, torch.Tensor)}
    return copy_graph_module(gm, memo)


def _runnable(program) -> torch.fx.GraphModule:
    """A GraphModule of ``program`` to run and to edit, sharing its weights (node names are kept)."""
    if isinstance(program, torch.export.ExportedProgram):
        return program_module(program)
    return _copy_sharing_weights(program)


def _device_of(module: torch.nn.Module) -> torch.device:
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        return tensor.device
    return torch.device("cpu")


class _Observer(torch.nn.Module):
    """Feeds each batch of one activation into its statistics; returns nothing."""

    def __init__(self, stats: ActivationStats):
        super().__init__()
        self.stats = stats

    def forward(self, x: torch.Tensor) -> None:
        self.stats.update(x.detach())


def _observed(gm: torch.fx.GraphModule, stats: dict[str, ActivationStats]) -> torch.fx.GraphModule:
    nodes = {n.name: n for n in gm.graph.nodes}
    last_placeholder = [n for n in gm.graph.nodes if n.op == "placeholder"][-1:]
    for i, (name, activation_stats) in enumerate(stats.items()):
        node = nodes.get(name)
        if node is None:
            raise ModelError(f"fx calibration: activation {name!r} is not a node of the runnable graph")
        where = last_placeholder[0] if node.op == "placeholder" else node
        observer = f"fp4pass_observer_{i}"
        gm.add_submodule(observer, _Observer(activation_stats))
        with gm.graph.inserting_after(where):
            gm.graph.call_module(observer, (node,))
    gm.recompile()
    return gm


def _prepend(box: list, rest):
    """The one batch in ``box``, then ``rest``; the box is emptied so that nothing here holds a used batch."""
    yield box.pop()
    yield from rest


def _check_batch(program, batch, index: int) -> tuple[tuple, dict]:
    """The batch as (args, kwargs), after the checks that need no run: shapes the program was exported for,
    empty inputs, token ids (:mod:`fp4pass.fx.shapes`)."""
    args, kwargs = _split_batch(batch)
    what = f"fx calibrate: calibration batch #{index}"
    check_inputs(program, args, kwargs, what)
    problem = input_problem(program, args, kwargs)
    if problem:
        raise CalibrationDataError(f"{what}: {problem}")
    return args, kwargs


def _collect(gm, program, stream, device, show_progress) -> int:
    """Run every batch of ``stream`` through the observed ``gm``; hold none of them past its own run."""
    count = 0

    def move(value):
        return value.to(device) if isinstance(value, torch.Tensor) else value

    with torch.no_grad():
        for batch in progress(stream, desc="fx calibrate", enabled=show_progress, unit="batch"):
            args, kwargs = pytree.tree_map(move, _check_batch(program, batch, count))
            try:
                gm(*args, **kwargs)
            except NonFiniteError as exc:
                raise NonFiniteError(f"calibration batch #{count}: {exc}") from None
            except FP4PassError:
                raise
            except Exception as exc:  # noqa: BLE001 - the model's own failure on this batch, named
                what = f"fx calibrate: calibration batch #{count}"
                shape = guard_error(exc, what)
                if shape is not None:
                    raise shape from None
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                raise CalibrationDataError(f"{what}: the model failed on it ({type(exc).__name__}: {first})") \
                    from exc
            count += 1
            del batch, args, kwargs  # before the next batch is drawn
    return count


# -- insertion -----------------------------------------------------------------------------------------------


def insert_fake_quantizers(graph: torch.fx.Graph, scales: ActivationScales,
                           targets: list[FxCalibrationTarget]) -> dict[str, str]:
    """Insert ``fake_quantize_nvfp4(x, input_scale)`` for each target in ``scales``; returns x -> new node name."""
    nodes = {n.name: n for n in graph.nodes}
    last_placeholder = [n for n in graph.nodes if n.op == "placeholder"][-1:]
    inserted = {}
    for target in targets:
        scale = scales.tensors.get(target.name)
        if scale is None:
            continue
        x = nodes[target.name]
        with graph.inserting_after(last_placeholder[0] if x.op == "placeholder" else x):
            quantized = graph.create_node("call_function", _FAKE_QUANT, (x, float(scale.input_scale)),
                                          name=f"{x.name}_fake_quantize_nvfp4")
        if "val" in x.meta:
            quantized.meta["val"] = x.meta["val"]
        for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
            if key in x.meta:
                quantized.meta[key] = x.meta[key]
        for consumer in target.consumers:
            nodes[consumer].replace_input_with(x, quantized)
        inserted[target.name] = quantized.name
    return inserted


def _with_fake_quantizers(program, scales: ActivationScales, targets: list[FxCalibrationTarget]):
    if isinstance(program, torch.export.ExportedProgram):
        gm = copy_graph_module(program.graph_module)
        insert_fake_quantizers(gm.graph, scales, targets)
        gm.recompile()
        with quiet_torch():  # copying the call graph's treespecs warns of torch's own LeafSpec deprecation
            call_graph = copy.deepcopy(program.module_call_graph)
        return torch.export.ExportedProgram(
            root=gm, graph=gm.graph, graph_signature=copy.deepcopy(program.graph_signature),
            state_dict=program.state_dict, range_constraints=copy.deepcopy(program.range_constraints),
            module_call_graph=call_graph, example_inputs=program.example_inputs,
            constants=program.constants, verifiers=program.verifiers)
    gm = _copy_sharing_weights(program)
    insert_fake_quantizers(gm.graph, scales, targets)
    gm.recompile()
    return gm


# -- the run -------------------------------------------------------------------------------------------------


def calibrate(model, batches, calibrator="max", *, device=None, dynamic_shapes=None, process_group=None,
              show_progress: bool = False, **calibrator_options):
    """Calibrate the NVFP4 activations of ``model`` on ``batches``; return ``(program, scales)``.

    Every step is in the module docstring. ``calibrator``: "max" | "percentile" | "headroom" | "mse" or a
    :class:`~fp4pass.calib.Calibrator`, ``calibrator_options`` its constructor's (rho, margin, percentile, ...).
    ``device``: where the statistics are reduced (default: the model's device). ``process_group``: the
    ``torch.distributed`` group to reduce the statistics over (default: the whole world, when initialised).
    """
    method = make_calibrator(calibrator, **calibrator_options)
    stream = iter(batches)
    first = next(stream, None)
    if first is None:
        raise CalibrationDataError("fx calibrate: the batches hold no batch")
    program = _as_program(model, first, dynamic_shapes)
    if isinstance(batches, (list, tuple)):
        for i, batch in enumerate(batches):  # a list is checked whole: an error before any batch runs
            _check_batch(program, batch, i)
    targets, _declined = calibration_targets(program)
    if not targets:
        folded = any(n.op == "get_attr" and n.target.startswith("_tensor_constant") for n in program.graph.nodes)
        hint = ("; symbolic_trace folded a dequant of buffers into a constant: export the model with "
                "torch.export.export instead") if folded else ""
        raise ModelError("fx calibrate: no activation to calibrate: no matmul reads an FP4 weight "
                         f"(torch.ops.fp4pass.dequantize_mxfp4 / dequantize_nvfp4){hint}")
    gm = _runnable(program)
    model_device = _device_of(gm)
    stats_device = torch.device(device) if device is not None else model_device
    stats = {t.name: ActivationStats(t.name, device=stats_device, abs_histogram=method.needs_abs_histogram,
                                     reservoir=method.reservoir, top_k=method.top_k) for t in targets}
    stream = _prepend([first], stream)
    del first
    count = _collect(_observed(gm, stats), program, stream, model_device, show_progress)
    if distributed_ready():
        all_reduce_stats(list(stats.values()), group=process_group)
    scales = ActivationScales(method.name, provider=f"torch:{model_device.type}", batches=count)
    for name, activation_stats in stats.items():
        scales.tensors[name] = scale_for(activation_stats, method)
    return _with_fake_quantizers(program, scales, targets), scales
