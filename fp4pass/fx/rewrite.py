"""The fx pass: ``fp4pass.dequantize_mxfp4(codes, scales)`` -> ``fp4pass.dequantize_nvfp4(codes16, scales16, g)``.

Takes a ``torch.export.ExportedProgram`` (weights lifted to placeholders, mapped by its graph signature) or a
``torch.fx.GraphModule`` (weights read by ``get_attr``) and gives back the same kind. For each MXFP4
dequantize node (numbered as in :meth:`MXFP4ToNVFP4FxPass.rewrite_node`):

1. codes and scales are followed back through shape-only ops (view, reshape, flatten, unflatten,
   contiguous, clone: gpt-oss blocks [E, N, K/32, 16] are flattened to [E, N, K/2]) to stored tensors;
   anything else (a user input, a computed tensor) is declined with the reason in the report. Bad bytes
   (E8M0 code 255, shapes that do not fit) raise: that is bad input, not a pattern to skip.
2. the weight is converted with :func:`fp4pass.convert.mxfp4_to_nvfp4` (``method``; one FP32 global scale
   per expert for 3-D weights, per tensor for 2-D), once per stored weight however many nodes read it.
3. ``dq`` form: the node becomes ``dequantize_nvfp4(codes, scales, global_scale)`` =
   e2m1(code) * e4m3(scale) * G, the product formed in FP32 at run time (the E4M3 scales never hold G).
   ``alpha`` form (:mod:`fp4pass.fx.alpha`), where every reader is a matmul-like op: the node dequantizes
   with G = 1 and each consumer's output is multiplied by G (per expert: reshaped onto the output's expert
   axis); elsewhere it falls back to ``dq`` and the report says why.
4. new tensors are buffers named after the weight: weight ``W`` (the codes' name without ``_blocks``,
   ``.blocks``, ``_codes``, ``.codes``; ``weight`` for a bare ``codes``) gets ``W_nvfp4_codes`` (uint8
   [..., K/2]), ``W_nvfp4_scales`` (E4M3 codes, uint8 [..., K/16]), ``W_nvfp4_global_scale`` (FP32 [] or
   [E]); in the alpha form ``W_nvfp4_scale_one`` (1.0) and ``W_nvfp4_alpha`` (G shaped for the output).
   The MXFP4 codes and scales are removed once nothing reads them.
5. a GraphModule with no MXFP4 node but float constants on the MXFP4 grid was made by ``symbolic_trace``,
   which runs the custom op at trace time and keeps its result as a constant: a warning names the fix
   (trace with ``torch.export.export``) and the report lists each such constant under ``declined``.

The report has the ONNX pass's keys (:mod:`fp4pass.onnx.report`), one ``tensors`` entry per weight.
"""

from __future__ import annotations

import logging
import time
import warnings
from dataclasses import dataclass

import torch
import torch.fx

from fp4pass.choices import Effort, Method, ScaleForm, values
from fp4pass.errors import UsageError
from fp4pass.formats import MXFP4Tensor

# Registers torch.ops.fp4pass.* before the graph is searched.
from fp4pass.fx import ops  # noqa: F401
from fp4pass.fx.alpha import alpha_plan
from fp4pass.fx.program import GraphConstants, constants_of
from fp4pass.onnx.report import group_stats, summarize, summary_line, tensor_entry

__all__ = ["MXFP4ToNVFP4FxPass", "convert", "METHODS", "SCALE_FORMS", "PATTERN"]

log = logging.getLogger(__name__)

METHODS = values(Method)
SCALE_FORMS = values(ScaleForm)
EFFORTS = values(Effort)
DEFAULT_EFFORT = "best"
#: one intra-op thread per conversion: measured fastest on small shared machines (fp4pass.convert's default)
DEFAULT_THREADS = 1
PATTERN = "dequantize_mxfp4"

aten = torch.ops.aten
# symbolic_trace records the op packet, torch.export its default overload
_MXFP4 = (torch.ops.fp4pass.dequantize_mxfp4, torch.ops.fp4pass.dequantize_mxfp4.default)
_NVFP4 = torch.ops.fp4pass.dequantize_nvfp4.default
_SHAPE_FUNCTIONS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.flatten.using_ints,
                    aten.unflatten.int, aten.contiguous.default, aten.clone.default, aten.alias.default,
                    torch.flatten, torch.reshape, torch.unflatten}
_SHAPE_METHODS = {"view", "reshape", "flatten", "unflatten", "contiguous"}
_SUFFIXES = ("_blocks", ".blocks", "_codes", ".codes")


@dataclass
class _Record:
    """What :func:`fp4pass.onnx.report.tensor_entry` reads about a weight (the fx counterpart of FP4Weight)."""

    name: str
    node: torch.fx.Node
    shape: tuple[int, ...]
    pattern: str = PATTERN
    slot: str = "weight"

    @property
    def experts(self) -> int | None:
        return self.shape[0] if len(self.shape) == 3 else None


@dataclass
class _Conversion:
    nv: object
    stats: dict
    seconds: float
    per_expert: list | None = None  # one dict per global-scale group (fp4pass.onnx.report.group_stats)


def weight_name(codes_name: str) -> str:
    """The weight a codes tensor belongs to: ``a.gate_up_proj_blocks`` -> ``a.gate_up_proj``,
    ``a.codes`` -> ``a.weight``."""
    for suffix in _SUFFIXES:
        if codes_name.endswith(suffix):
            base = codes_name[: -len(suffix)]
            return base if base and not base.endswith(".") else f"{base}weight"
    if codes_name in ("codes", "blocks"):
        return "weight"
    return codes_name


def _is_shape_op(node: torch.fx.Node) -> bool:
    if node.op == "call_method":
        return node.target in _SHAPE_METHODS
    return node.op == "call_function" and node.target in _SHAPE_FUNCTIONS


def _apply(node: torch.fx.Node, tensor: torch.Tensor) -> torch.Tensor:
    args, kwargs = node.args[1:], node.kwargs
    if node.op == "call_method":
        return getattr(tensor, node.target)(*args, **kwargs)
    return node.target(tensor, *args, **kwargs)


def _stored(store: GraphConstants, node, role: str) -> tuple[str, torch.Tensor, list] | str:
    """(name, tensor as the dequant reads it, [shape ops..., source node]) for a stored tensor, or why not."""
    path = []
    current = node
    while True:
        found = store.tensor(current)
        if found is not None:
            name, tensor = found
            for op in reversed(path):
                tensor = _apply(op, tensor)
            return name, tensor, [*path, current]
        if isinstance(current, torch.fx.Node) and _is_shape_op(current):
            if any(isinstance(a, torch.fx.Node) for a in (*current.args[1:], *current.kwargs.values())):
                return f"{role} is reshaped by a size computed in the graph ({current.name})"
            path.append(current)
            current = current.args[0]
            continue
        return f"{role} is not a stored tensor: {store.describe(current)}"


def _on_mxfp4_grid(t: torch.Tensor) -> bool:
    """Whether a float tensor is exactly an MXFP4 dequantization (each block of 32 is e2m1 * 2^k)."""
    if not t.is_floating_point() or t.dim() < 2 or t.shape[-1] % 32 or t.numel() == 0:
        return False
    t = t.detach().float()
    if not bool(torch.isfinite(t).all()) or not bool((t != 0).any()):
        return False
    first_row = t.reshape(-1, t.shape[-1])[:1]  # most float weights are off the grid in their first blocks
    if not torch.equal(MXFP4Tensor.quantize(first_row).dequantize(), first_row):
        return False
    return bool(torch.equal(MXFP4Tensor.quantize(t).dequantize(), t))


class MXFP4ToNVFP4FxPass:
    """Rewrite every stored-weight MXFP4 dequant node into NVFP4 (see the module docstring)."""

    def __init__(self, method: str = "auto", scale_form: str = "dq", group_dims: int | None = None, *,
                 effort: str = DEFAULT_EFFORT, threads: int | None = DEFAULT_THREADS):
        if method not in METHODS:
            raise UsageError(f"method must be one of {', '.join(METHODS)}, not {method!r}")
        if scale_form not in SCALE_FORMS:
            raise UsageError(f"scale_form must be one of {', '.join(SCALE_FORMS)}, not {scale_form!r}")
        if effort not in EFFORTS:
            raise UsageError(f"effort must be one of {', '.join(EFFORTS)}, not {effort!r}")
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise UsageError(f"threads must be a positive integer or None, not {threads!r}")
        self.method, self.scale_form, self.group_dims = method, scale_form, group_dims
        self.effort, self.threads = effort, threads

    # -- 1. match ----------------------------------------------------------------------------------------
    def check(self, store: GraphConstants, node: torch.fx.Node) -> str | None:
        """Why ``node`` cannot be rewritten, or None when it can."""
        for role, arg in zip(("codes", "scales"), node.args[:2]):
            found = _stored(store, arg, role)
            if isinstance(found, str):
                return found
        return None

    # -- 2. convert --------------------------------------------------------------------------------------
    def _convert(self, name: str, codes: torch.Tensor, scales: torch.Tensor) -> _Conversion:
        from fp4pass.convert import mxfp4_to_nvfp4

        start = time.perf_counter()
        mx = MXFP4Tensor.from_codes(codes, scales, name=name)
        group_dims = self._group_dims(len(mx.shape))
        # effort and threads always named: no process-wide default reaches an fx conversion
        nv, stats = mxfp4_to_nvfp4(mx, method=self.method, group_dims=group_dims, effort=self.effort,
                                   threads=self.threads)
        per_expert = group_stats(mx, nv, group_dims, stats)
        return _Conversion(nv, stats, time.perf_counter() - start, per_expert)

    def _group_dims(self, rank: int) -> int:
        return self.group_dims if self.group_dims is not None else (1 if rank == 3 else 0)

    # -- 3./4. rewrite -----------------------------------------------------------------------------------
    def rewrite_node(self, store: GraphConstants, node: torch.fx.Node, cache: dict) -> dict:
        codes_name, codes, codes_path = _stored(store, node.args[0], "codes")
        scales_name, scales, scales_path = _stored(store, node.args[1], "scales")
        weight = weight_name(codes_name)
        key = (codes_name, tuple(codes.shape), scales_name)
        first = key not in cache
        if first:
            cache[key] = self._convert(weight, codes, scales)
        conv = cache[key]
        nv = conv.nv

        def buffer(suffix: str, tensor: torch.Tensor, before: torch.fx.Node) -> torch.fx.Node:
            # one buffer per weight, however many nodes read it
            if (key, suffix) not in cache:
                cache[key, suffix] = store.add(f"{weight}_nvfp4_{suffix}", tensor.contiguous(), before)
            return cache[key, suffix]

        shape = (*nv.codes.shape[:-1], nv.codes.shape[-1] * 2)
        rank = len(shape)
        form, note, plan = "dq", None, None
        if self.scale_form == "alpha":
            plan = alpha_plan(node, rank, self._group_dims(rank), shape[0] if rank == 3 else None)
            if isinstance(plan, str):
                note, plan = f"alpha form not possible ({plan}); wrote the dq form", None
            else:
                form = "alpha"
        inputs = [buffer("codes", nv.codes, node), buffer("scales", nv.scales, node)]
        if plan is None:
            inputs.append(buffer("global_scale", nv.global_scale.float(), node))
        else:
            inputs.append(buffer("scale_one", torch.ones((), dtype=torch.float32), node))
        graph = store.graph
        with graph.inserting_before(node):
            replacement = graph.call_function(_NVFP4, tuple(inputs))
        replacement.meta.update(node.meta)
        node.replace_all_uses_with(replacement)
        graph.erase_node(node)
        for i, use in enumerate(plan or ()):
            suffix = "alpha" if i == 0 else f"alpha_{i}"
            alpha = store.add(f"{weight}_nvfp4_{suffix}", nv.global_scale.float().reshape(use.shape).contiguous(),
                              use.consumer)
            _scale_output(graph, use, alpha)
        for path in (codes_path, scales_path):
            for dead in path:
                _drop_dead(store, dead)
        return {"record": _Record(weight, node, tuple(shape)), "conv": conv, "form": form, "note": note,
                "first": first}

    def __call__(self, model):
        start = time.perf_counter()
        store = constants_of(model)
        before = _describe(store)
        tensors, declined, cache = [], [], {}
        found = [n for n in store.graph.nodes if n.op == "call_function" and n.target in _MXFP4]
        for node in found:
            reason = self.check(store, node)
            if reason:
                declined.append({"pattern": PATTERN, "node": node.name, "tensor": getattr(node.args[0], "name", None),
                                 "reason": reason})
                log.info("fx: %s declined: %s", node.name, reason)
                continue
            done = self.rewrite_node(store, node, cache)
            if done["first"]:  # one entry per weight, however many nodes read it
                tensors.append(tensor_entry(done["record"], done["conv"], done["form"], done["note"]))
        if not found and isinstance(model, torch.fx.GraphModule):
            declined.extend(_folded_constants(store))
        result = store.result()
        report = {
            "input": f"<{store.kind}>",
            "output": None,
            "method": self.method,
            "effort": self.effort,
            "threads": self.threads,
            "scale_form": self.scale_form,
            "target": "fx",
            "external_data": False,
            "model": {"before": before, "after": _describe(store)},
            "tensors": tensors,
            "declined": declined,
        }
        report["summary"] = summarize(tensors, declined, time.perf_counter() - start)
        log.debug("%s", summary_line(report))
        return result, report


def _describe(store: GraphConstants) -> dict:
    nodes = list(store.graph.nodes)
    return {"kind": store.kind, "nodes": len(nodes),
            "mxfp4_nodes": sum(n.op == "call_function" and n.target in _MXFP4 for n in nodes),
            "nvfp4_nodes": sum(n.op == "call_function" and n.target == _NVFP4 for n in nodes)}


def _drop_dead(store: GraphConstants, node) -> None:
    if isinstance(node, torch.fx.Node) and not getattr(node, "_erased", False) and not node.users:
        store.drop(node)


def _scale_output(graph: torch.fx.Graph, use, alpha: torch.fx.Node) -> None:
    """consumer -> consumer * alpha (+ bias moved after the scaling), readers moved to the new end."""
    consumer = use.consumer
    aten_graph = isinstance(consumer.target, torch._ops.OpOverload)
    mul_op = aten.mul.Tensor if aten_graph else torch.mul
    add_op = aten.add.Tensor if aten_graph else torch.add
    if use.bias is not None:
        args = list(consumer.args)
        if len(args) > 2:
            args[2] = None
        consumer.args = tuple(args)
        consumer.kwargs = {k: v for k, v in consumer.kwargs.items() if k != "bias"}
    with graph.inserting_after(consumer):
        end = graph.call_function(mul_op, (consumer, alpha))
    _copy_meta(consumer, end)
    if use.bias is not None:
        with graph.inserting_after(end):
            scaled = end
            end = graph.call_function(add_op, (scaled, use.bias))
        _copy_meta(consumer, end)
    keep = {end} if use.bias is None else {end, end.args[0]}
    consumer.replace_all_uses_with(end, delete_user_cb=lambda user: user not in keep)


def _copy_meta(source: torch.fx.Node, target: torch.fx.Node) -> None:
    for key in ("nn_module_stack", "stack_trace", "source_fn_stack", "val", "tensor_meta"):
        if key in source.meta:
            target.meta[key] = source.meta[key]


def _folded_constants(store: GraphConstants) -> list[dict]:
    """Float constants that are MXFP4 dequantizations computed at trace time (symbolic_trace), with a warning."""
    out = []
    for node in store.graph.nodes:
        found = store.tensor(node)
        if found is None or not _on_mxfp4_grid(found[1]):
            continue
        out.append({"pattern": PATTERN, "node": node.name, "tensor": found[0],
                    "reason": "float constant on the MXFP4 grid: symbolic_trace ran fp4pass.dequantize_mxfp4 at "
                              "trace time and kept its result; trace with torch.export.export(model, args) "
                              "to keep the op"})
    if out:
        names = ", ".join(d["tensor"] for d in out[:3]) + (" ..." if len(out) > 3 else "")
        warnings.warn(
            f"fp4pass.fx.convert: no fp4pass.dequantize_mxfp4 node, but {len(out)} constant(s) ({names}) hold "
            "MXFP4-dequantized weights: torch.fx.symbolic_trace evaluates the op at trace time and folds it "
            "into a float constant. Trace with torch.export.export(model, example_args) instead (pass the "
            "ExportedProgram, or its .module()).", UserWarning, stacklevel=3)
    return out


def convert(model, method: str = "auto", scale_form: str = "dq", group_dims: int | None = None, *,
            effort: str = DEFAULT_EFFORT, threads: int | None = DEFAULT_THREADS):
    """Rewrite every stored MXFP4 dequant of ``model`` into NVFP4; returns ``(model, report)``.

    ``model``: a ``torch.export.ExportedProgram`` (returns a new ExportedProgram; the input is left as it
    was) or a ``torch.fx.GraphModule`` (rewritten in place). ``method``: auto | hybrid | requant | verbatim
    (:func:`fp4pass.mxfp4_to_nvfp4`). ``scale_form``: ``dq`` (global scale inside the dequantize) or
    ``alpha`` (on the matmul's output where the consumer allows it). ``group_dims``: leading axes with their
    own global scale (default: 1 for 3-D expert weights, else 0). ``effort``: auto's search, ``best`` (wide)
    or ``fast`` (narrow). ``threads``: torch intra-op threads while a weight converts (restored after it;
    None leaves torch's setting). Both are passed to every weight's conversion explicitly, whatever any
    process-wide default says. The report has the ONNX pass's keys.
    """
    return MXFP4ToNVFP4FxPass(method, scale_form, group_dims, effort=effort, threads=threads)(model)
