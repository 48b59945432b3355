"""The ONNX stages of ``fp4pass.onnx.convert`` (MXFP4 -> NVFP4 over a whole ONNX model), which
:func:`fp4pass.pipeline.convert` runs in this order, like a compiler pass pipeline:

1. load       - path / ModelProto / onnx_ir.Model / graphsurgeon Graph into onnx_ir (external data lazy, checked)
2. match      - :func:`fp4pass.onnx.sharing.find_weights`: the MXFP4 patterns (one record per weight, however
                many dequantize nodes read it), and near-misses with a reason
3. validate   - every weight's scales read and checked (shapes, E8M0 code 255) before anything is written
4. rewrite    - per weight (:func:`rewrite_weights`): :mod:`rewrite_trt` (``dq`` / ``alpha`` form,
                GatherBlockQuantized) or :mod:`rewrite_qmoe` (QMoE 'fp4' -> 'nvfp4'); new tensors are lazy.
                A Quark weight becomes an MXFP4 DQ first; the Quark fake-quants left are folded (constants) or
                go with the activations (:func:`quark_rest`, :mod:`rewrite_quark`)
5. clean up   - :class:`rewrite_cleanup.SetOpsetAndIR`, :func:`group_initializers`
6. activations (optional) - calibration (``fp4pass.calib``) then :mod:`fp4pass.onnx.act_quant`: run by
                the pipeline above both (:mod:`fp4pass.pipeline`), so that this package never imports the
                calibration
7. write      - streamed with external data (one weight's conversion in memory at a time), or materialized
8. check (optional) - ``fp4pass.onnx.numerics.diff`` between the input and the output

Targets: ``trt`` and ``reference`` write linear weights in the ModelOpt two-DQ form; ``ort`` writes the same
two-DQ form for linear weights (runnable after ``fp4pass.onnx.lower``; MatMulBlockQuantizedFp4Weight is
CUDA-only and needs fp16 activations, so it is not used) and QMoE 'nvfp4' for MoE blocks (QMoE is rewritten
to 'nvfp4' under every target: it is the only NVFP4 form of that op).
"""

from __future__ import annotations

import logging

import onnx_ir as ir

from fp4pass.choices import ExternalData, Method, Provider, ScaleForm, Target, values
from fp4pass.errors import UsageError
from fp4pass.onnx.rewrite_common import UniqueNames
from fp4pass.onnx.rewrite_qmoe import QMoEToNVFP4
from fp4pass.onnx.rewrite_quark import (activation_declines, drop_unused_quark_opset, fold_constants,
                                        materialize_weight, remove_activation_fake_quants)
from fp4pass.onnx.rewrite_trt import AlphaNVFP4, DequantizeToNVFP4, GatherToNVFP4, alpha_note
from fp4pass.onnx.sharing import sharing_note

__all__ = ["rewrite_weights", "quark_rest", "quark_replaced", "group_initializers", "materialize", "METHODS", "SCALE_FORMS", "TARGETS", "EXTERNAL_DATA"]

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


def rewrite_weights(records, convs, scale_form: str) -> tuple[list[tuple], dict[str, str], bool]:
    """Rewrite every record; returns [(record, conv, form, note)], the alpha initializers, whether an FP4 DQ was written."""
    done, alphas, wrote_dq = [], {}, False
    names = UniqueNames()  # one for every rewrite: new tensor names never clash
    alpha_pass, dq_pass, gbq_pass = AlphaNVFP4(names), DequantizeToNVFP4(names), GatherToNVFP4(names)
    qmoe_pass = QMoEToNVFP4()
    for record, conv in zip(records, convs):
        note = conv.lossy_reason
        if record.pattern == "quark":
            materialize_weight(record)
        if record.pattern in ("dq", "dq_float", "quark"):
            wrote_dq = True
            reason = alpha_pass.check(record) if scale_form == "alpha" else None
            if scale_form == "alpha" and reason is None:
                out = alpha_pass.rewrite(record, conv)
                alphas.update(out["alphas"])
                if out["gemm_alpha"]:
                    note = "; ".join(filter(None, [note, f"global scale in Gemm alpha of {', '.join(out['gemm_alpha'])}"]))
                if out["cast"]:  # worded once the global scale is known (after the conversion)
                    note = _joined_note(note, lambda out=out, conv=conv: alpha_note(out, conv))
            else:
                if reason:
                    note = "; ".join(filter(None, [note, f"alpha form not possible ({reason}); wrote the dq form"]))
                out = dq_pass.rewrite(record, conv)
        elif record.pattern == "gbq":
            wrote_dq = True
            out = gbq_pass.rewrite(record, conv)
        else:
            out = qmoe_pass.rewrite(record, conv)
            if conv.prior_global is not None:
                note = "global scale multiplied by the input's fc*_global_scale"
        shared = sharing_note(record)
        if shared:
            note = _joined_note(shared, note) if callable(note) else "; ".join(n for n in (shared, note) if n)
        done.append((record, conv, out["form"], note))
    return done, alphas, wrote_dq


def _joined_note(first: str | None, later):
    """A note completed after the conversion ran: ``first``, then what ``later()`` says."""
    return lambda: "; ".join(n for n in (first, later()) if n)


def quark_rest(model: ir.Model, calibrated: bool, declined: list) -> list[dict]:
    """Quark fake-quants left after the weights: constants folded; activations removed when calibrated
    quantizers replace them, else kept and declined (running them needs Quark's custom-op library)."""
    entries = fold_constants(model)
    if calibrated:
        entries += remove_activation_fake_quants(model)
    else:
        declined.extend(activation_declines(model))
    drop_unused_quark_opset(model)
    return entries


def quark_replaced(entries: list[dict], activations: list[dict]) -> None:
    """Say, per removed Quark activation fake-quant, whether a calibrated NVFP4 quantizer took its place."""
    inserted = {a["activation"] for a in activations if a.get("inserted")}
    for entry in entries:
        if entry["kind"] == "activation":
            entry["action"] = ("removed; replaced by a calibrated NVFP4 quantizer" if entry["tensor"] in inserted else
                               "removed; not replaced: it feeds no FP4 GEMM (NVFP4 quantizes only FP4 GEMM inputs)")


def group_initializers(model: ir.Model, records) -> None:
    """Put each weight's new scale initializers right after its codes, so that ``ir.save`` writes a weight's
    parts one after another and its conversion is freed before the next one starts (peak memory ~ one weight)."""
    companions: dict[str, list[str]] = {}
    for record in records:
        w = record.name
        companions[w] = [f"{w}_scale_e4m3", f"{w}_global_scale", f"{w}_scale_one"]
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
        values = [graph.initializers[name] for name in order]
        graph.initializers.clear()
        for value in values:
            graph.initializers[value.name] = value
