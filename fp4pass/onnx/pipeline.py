"""The ONNX stages of ``fp4pass.onnx.convert`` (MXFP4 -> NVFP4 over a whole ONNX model), which
:func:`fp4pass.pipeline.convert` runs in this order. Stages 4-6 are ``onnx_ir`` in-place passes
(``ir.passes.InPlacePass``: ``call(model) -> PassResult(model, modified)``) run by ``ir.passes.PassManager``
(:func:`fp4pass.onnx.passes.run_passes`); each is configured in its ``__init__`` and reports through the result
its ``call`` returns (a ``PassResult`` with the pass's report added: :class:`RewriteResult`, ...).
docs/passes.md has the whole list, with what each pass walks and declines.

1. load       - path / ModelProto / onnx_ir.Model / graphsurgeon Graph into onnx_ir (external data lazy, checked)
2. match      - :func:`fp4pass.onnx.sharing.find_weights`: the MXFP4 patterns in the main graph, its subgraphs
                (If / Loop / Scan bodies) and local function bodies (one record per weight, however many
                dequantize nodes read it), and near-misses with a reason. A weight inside a function body is
                declined: the reason names the function and says what converts it (inline, lift constants)
3. validate   - every weight's scales read and checked (shapes, E8M0 code 255) before anything is written
                (``WeightConversion``)
4. rewrite    - :class:`RewriteMXFP4Weights` (records and conversions in; :class:`RewriteResult` ``done``,
                ``alphas``, ``wrote_dq`` out): per weight :mod:`rewrite_trt` (``dq`` / ``alpha`` form,
                GatherBlockQuantized) or
                :mod:`rewrite_qmoe` (QMoE 'fp4' -> 'nvfp4'); new tensors are lazy and go to the graph that
                holds the codes (an outer-scope initializer read in a branch: the main graph), new nodes to
                the graph of the node they serve. A Quark weight becomes an MXFP4 DQ first.
                :class:`FoldQuarkFakeQuants` (:class:`FoldResult` ``entries`` out): the Quark fake-quants left
                are folded (constants) or go with the activations (:mod:`rewrite_quark`)
5. clean up   - :class:`rewrite_cleanup.SetOpsetAndIR` (``wrote_dq`` in, ``versions`` out), :class:`GroupInitializers`
6. activations (optional) - calibration (``fp4pass.onnx.calibrate``, not a pass: it measures), then
                :class:`fp4pass.onnx.act_quant.InsertActivationQuantizers` (``entries`` out; one quantizer per
                graph that holds consumers, a consumer in a function body declined); run by the pipeline
                above both (:mod:`fp4pass.pipeline`), so that this package never imports the calibration
7. write      - streamed with external data (one weight's conversion in memory at a time), or materialized
8. check (optional) - ``fp4pass.onnx.numerics.diff`` between the input and the output (both lowered by the
                passes of :mod:`fp4pass.onnx.lower`)

Removal stays with the rewrite that orphans something (a replaced node, an old scale initializer nothing
reads, the com.amd.quark import once no node uses it), at once, because the freed name goes to the new
value. ``onnx_ir``'s ``RemoveUnusedNodesPass`` / ``RemoveUnusedOpsetsPass`` are not run on the written model:
they would also delete what the input itself leaves unused (a dead layer, with weights the report lists as
converted; unused opset imports; unused optional outputs), which is not fp4pass's to change. The lowering,
whose copy is only run, uses ``RemoveUnusedOpsetsPass``.

Targets: ``trt`` and ``reference`` write linear weights in the ModelOpt two-DQ form; ``ort`` writes the same
two-DQ form for linear weights (runnable after ``fp4pass.onnx.lower``; MatMulBlockQuantizedFp4Weight is
CUDA-only and needs fp16 activations, so it is not used) and QMoE 'nvfp4' for MoE blocks (QMoE is rewritten
to 'nvfp4' under every target: it is the only NVFP4 form of that op).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import onnx_ir as ir

from fp4pass.choices import ExternalData, Method, Provider, ScaleForm, Target, values
from fp4pass.errors import UsageError
from fp4pass.onnx.passes import run_passes
from fp4pass.onnx.rewrite_cleanup import SetOpsetAndIR
from fp4pass.onnx.rewrite_common import UniqueNames
from fp4pass.onnx.rewrite_qmoe import QMoEToNVFP4
from fp4pass.onnx.rewrite_quark import (activation_declines, drop_unused_quark_opset, fold_constants,
                                        materialize_weight, remove_activation_fake_quants)
from fp4pass.onnx.rewrite_trt import AlphaNVFP4, DequantizeToNVFP4, GatherToNVFP4, alpha_note
from fp4pass.onnx.sharing import sharing_note

__all__ = ["RewriteMXFP4Weights", "RewriteResult", "FoldQuarkFakeQuants", "FoldResult", "SetOpsetAndIR",
           "GroupInitializers", "WeightStages", "run_weight_passes", "quark_replaced", "materialize", "METHODS",
           "SCALE_FORMS", "TARGETS", "EXTERNAL_DATA"]

log = logging.getLogger(__name__)

METHODS = values(Method)
SCALE_FORMS = values(ScaleForm)
TARGETS = values(Target)
EXTERNAL_DATA = values(ExternalData)
PROVIDERS = values(Provider)


def check_choice(name: str, value: str, allowed) -> None:
    if value not in allowed:
        raise UsageError(f"{name} must be one of {', '.join(allowed)}, not {value!r}")


def materialize(model: ir.Model) -> None:
    """Replace every lazy initializer by its computed tensor (for a model returned in memory)."""
    for graph in model.graphs():
        for value in graph.initializers.values():
            if isinstance(value.const_value, ir.LazyTensor):
                tensor = value.const_value.raw()
                tensor.name = value.name
                value.const_value = tensor


@dataclass
class RewriteResult(ir.passes.PassResult):
    """What :class:`RewriteMXFP4Weights` did: ``done`` [(record, conv, form, note)] for the report, ``alphas``
    {consumer node: alpha initializer} (the ``alpha`` form), ``wrote_dq`` whether an FP4 DequantizeLinear (or
    GatherBlockQuantized with a DQ scale) was written. ``modified``: at least one weight was rewritten."""

    done: list = field(default_factory=list)
    alphas: dict = field(default_factory=dict)
    wrote_dq: bool = False


class RewriteMXFP4Weights(ir.passes.InPlacePass):
    """Stage 4: rewrite every matched weight (``records``, each with its lazy ``convs`` entry) into NVFP4;
    returns a :class:`RewriteResult`."""

    def __init__(self, records, convs, scale_form: str) -> None:
        super().__init__()
        self.records, self.convs, self.scale_form = list(records), list(convs), scale_form

    def call(self, model: ir.Model) -> RewriteResult:
        result = RewriteResult(model, bool(self.records))
        scale_form = self.scale_form
        names = UniqueNames(model.graph)  # one for every rewrite: new tensor names never clash
        alpha_pass, dq_pass, gbq_pass = AlphaNVFP4(names), DequantizeToNVFP4(names), GatherToNVFP4(names)
        qmoe_pass = QMoEToNVFP4()
        for record, conv in zip(self.records, self.convs):
            note = conv.lossy_reason
            if record.pattern == "quark":
                materialize_weight(record)
            if record.pattern in ("dq", "dq_float", "quark"):
                result.wrote_dq = True
                reason = alpha_pass.check(record) if scale_form == "alpha" else None
                if scale_form == "alpha" and reason is None:
                    out = alpha_pass.rewrite(record, conv)
                    result.alphas.update(out["alphas"])
                    if out["gemm_alpha"]:
                        note = "; ".join(filter(None, [note, f"global scale in Gemm alpha of {', '.join(out['gemm_alpha'])}"]))
                    if out["cast"]:  # worded once the global scale is known (after the conversion)
                        note = _joined_note(note, lambda out=out, conv=conv: alpha_note(out, conv))
                else:
                    if reason:
                        note = "; ".join(filter(None, [note, f"alpha form not possible ({reason}); wrote the dq form"]))
                    out = dq_pass.rewrite(record, conv)
            elif record.pattern == "gbq":
                result.wrote_dq = True
                out = gbq_pass.rewrite(record, conv)
            else:
                out = qmoe_pass.rewrite(record, conv)
                if conv.prior_global is not None:
                    note = "global scale multiplied by the input's fc*_global_scale"
            shared = sharing_note(record)
            if shared:
                note = _joined_note(shared, note) if callable(note) else "; ".join(n for n in (shared, note) if n)
            result.done.append((record, conv, out["form"], note))
        return result


def _joined_note(first: str | None, later):
    """A note completed after the conversion ran: ``first``, then what ``later()`` says."""
    return lambda: "; ".join(n for n in (first, later()) if n)


@dataclass
class FoldResult(ir.passes.PassResult):
    """What :class:`FoldQuarkFakeQuants` did: ``entries``, the report's "quark" list."""

    entries: list = field(default_factory=list)


class FoldQuarkFakeQuants(ir.passes.InPlacePass):
    """Stage 4, Quark's rest: the Quark fake-quants left after the weights. Constants are folded; activations
    removed when ``calibrated`` quantizers replace them, else kept and their declines appended to
    ``declined`` (running them needs Quark's custom-op library); the com.amd.quark import goes once no node
    uses it. Returns a :class:`FoldResult`; ``modified``: a node was folded or removed."""

    def __init__(self, calibrated: bool, declined: list) -> None:
        super().__init__()
        self.calibrated, self.declined = calibrated, declined

    def call(self, model: ir.Model) -> FoldResult:
        entries = fold_constants(model, self.declined)
        if self.calibrated:
            entries += remove_activation_fake_quants(model)
        else:
            self.declined.extend(activation_declines(model))
        dropped = drop_unused_quark_opset(model)
        return FoldResult(model, bool(entries) or dropped, entries)


def quark_replaced(entries: list[dict], activations: list[dict]) -> None:
    """Say, per removed Quark activation fake-quant, whether a calibrated NVFP4 quantizer took its place."""
    inserted = {a["activation"] for a in activations if a.get("inserted")}
    for entry in entries:
        if entry["kind"] == "activation":
            entry["action"] = ("removed; replaced by a calibrated NVFP4 quantizer" if entry["tensor"] in inserted else
                               "removed; not replaced: it feeds no FP4 GEMM (NVFP4 quantizes only FP4 GEMM inputs)")


class GroupInitializers(ir.passes.InPlacePass):
    """Stage 5: put each weight's new scale initializers right after its codes, so that ``ir.save`` writes a
    weight's parts one after another and its conversion is freed before the next one starts (peak memory ~
    one weight). ``modified``: the order of some graph's initializers changed."""

    def __init__(self, records) -> None:
        super().__init__()
        self.records = list(records)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        companions: dict[str, list[str]] = {}
        for record in self.records:
            w = record.name
            companions[w] = [f"{w}_scale_e4m3", f"{w}_global_scale", f"{w}_scale_one"]
        modified = False
        for graph in model.graphs():
            order: list[str] = []
            placed: set[str] = set()
            for name in list(graph.initializers):
                if name in placed:
                    continue
                order.append(name)
                placed.add(name)
                for extra in companions.get(name, ()):
                    if extra in graph.initializers and extra not in placed:
                        order.append(extra)
                        placed.add(extra)
            if order == list(graph.initializers):
                continue
            modified = True
            values = [graph.initializers[name] for name in order]
            graph.initializers.clear()
            for value in values:
                graph.initializers[value.name] = value
        return ir.passes.PassResult(model, modified)


@dataclass
class WeightStages:
    """The results of stages 4 and 5, one per pass, in the order they ran."""

    rewrite: RewriteResult
    quark: FoldResult
    versions: ir.passes.PassResult
    grouped: ir.passes.PassResult


def run_weight_passes(model: ir.Model, records, convs, scale_form: str, calibrated: bool,
                      declined: list) -> WeightStages:
    """Stages 4 and 5 as onnx_ir passes, in order (module docstring). The opset pass is configured with what
    the rewrite's result says (an FP4 DequantizeLinear written or not), so it runs once the rewrite has."""
    rewrite, quark = run_passes([RewriteMXFP4Weights(records, convs, scale_form),
                                 FoldQuarkFakeQuants(calibrated, declined)], model)
    versions, grouped = run_passes([SetOpsetAndIR(rewrite.wrote_dq), GroupInitializers(records)], model)
    return WeightStages(rewrite, quark, versions, grouped)
