"""``fp4pass.onnx.convert``: MXFP4 -> NVFP4 over a whole ONNX model, staged like a compiler pass pipeline.

1. load       - path / ModelProto / onnx_ir.Model / graphsurgeon Graph into onnx_ir (external data lazy, checked)
2. match      - :func:`fp4pass.onnx.sharing.find_weights`: the MXFP4 patterns (one record per weight, however
                many dequantize nodes read it), and near-misses with a reason
3. validate   - every weight's scales read and checked (shapes, E8M0 code 255) before anything is written
4. rewrite    - per weight: :mod:`rewrite_trt` (``dq`` / ``alpha`` form, GatherBlockQuantized) or
                :mod:`rewrite_qmoe` (QMoE 'fp4' -> 'nvfp4'); new tensors are lazy. A Quark weight becomes an
                MXFP4 DQ first; the Quark fake-quants left are folded (constants) or go with the activations
                (:mod:`rewrite_quark`)
5. clean up   - :class:`rewrite_cleanup.SetOpsetAndIR`
6. activations (optional) - ``fp4pass.calib.calibrate_model`` then ``fp4pass.onnx.act_quant``
7. write      - streamed with external data (one weight's conversion in memory at a time), or materialized
8. check (optional) - ``fp4pass.onnx.numerics.diff`` between the input and the output

Targets: ``trt`` and ``reference`` write linear weights in the ModelOpt two-DQ form; ``ort`` writes the same
two-DQ form for linear weights (runnable after ``fp4pass.onnx.lower``; MatMulBlockQuantizedFp4Weight is
CUDA-only and needs fp16 activations, so it is not used) and QMoE 'nvfp4' for MoE blocks (QMoE is rewritten
to 'nvfp4' under every target: it is the only NVFP4 form of that op).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import onnx_ir as ir

from fp4pass.errors import CheckError, FP4PassError, UsageError
from fp4pass.onnx import loading
from fp4pass.onnx.report import jsonable, summarize, summary_line, tensor_entry
from fp4pass.onnx.rewrite_cleanup import SetOpsetAndIR
from fp4pass.onnx.rewrite_common import UniqueNames, WeightConversion
from fp4pass.onnx.rewrite_qmoe import QMoEToNVFP4, prior_global_scale
from fp4pass.onnx.rewrite_quark import (activation_declines, drop_unused_quark_opset, fold_constants,
                                        materialize_weight, remove_activation_fake_quants)
from fp4pass.onnx.rewrite_trt import AlphaNVFP4, DequantizeToNVFP4, GatherToNVFP4, alpha_note
from fp4pass.onnx.sharing import find_weights, sharing_note
from fp4pass.progress import progress

__all__ = ["convert", "METHODS", "SCALE_FORMS", "TARGETS", "EXTERNAL_DATA"]

log = logging.getLogger(__name__)

METHODS = ("auto", "hybrid", "requant", "verbatim")
SCALE_FORMS = ("dq", "alpha")
TARGETS = ("trt", "ort", "reference")
EXTERNAL_DATA = ("auto", "always", "never")
PROVIDERS = ("auto", "cuda", "cpu")


def _check_choice(name: str, value: str, allowed) -> None:
    if value not in allowed:
        raise UsageError(f"{name} must be one of {', '.join(allowed)}, not {value!r}")


def _materialize(model: ir.Model) -> None:
    """Replace every lazy initializer by its computed tensor (for a model returned in memory)."""
    for graph in model.graphs():
        for value in graph.initializers.values():
            if isinstance(value.const_value, ir.LazyTensor):
                tensor = value.const_value.raw()
                tensor.name = value.name
                value.const_value = tensor


def _rewrite(records, convs, scale_form: str) -> tuple[list[tuple], dict[str, str], bool]:
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


def _quark_rest(model: ir.Model, calibrated: bool, declined: list) -> list[dict]:
    """Quark fake-quants left after the weights: constants folded; activations removed when calibrated
    quantizers replace them, else kept and declined (running them needs Quark's custom-op library)."""
    entries = fold_constants(model)
    if calibrated:
        entries += remove_activation_fake_quants(model)
    else:
        declined.extend(activation_declines(model))
    drop_unused_quark_opset(model)
    return entries


def _quark_replaced(entries: list[dict], activations: list[dict]) -> None:
    """Say, per removed Quark activation fake-quant, whether a calibrated NVFP4 quantizer took its place."""
    inserted = {a["activation"] for a in activations if a.get("inserted")}
    for entry in entries:
        if entry["kind"] == "activation":
            entry["action"] = ("removed; replaced by a calibrated NVFP4 quantizer" if entry["tensor"] in inserted else
                               "removed; not replaced: it feeds no FP4 GEMM (NVFP4 quantizes only FP4 GEMM inputs)")


def _group_initializers(model: ir.Model, records) -> None:
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


def _activations(model, calib, calibrator, scales, target, scale_form, alphas, provider,
                 calibrator_options) -> list[dict]:
    try:
        from fp4pass.calib import ActivationScales, calibrate_model
        from fp4pass.onnx.act_quant import insert_activation_quantizers
    except ImportError:
        raise UsageError("activation calibration is not available in this build") from None
    _materialize(model)
    if calib is not None:
        act_scales = calibrate_model(model, calib, calibrator=calibrator, provider=provider, **calibrator_options)
    elif isinstance(scales, dict):
        act_scales = ActivationScales.from_json(scales)
    else:
        act_scales = ActivationScales.load(scales)
    act_target = "trt" if target == "trt" else "reference"
    return insert_activation_quantizers(model, act_scales, target=act_target, scale_form=scale_form, alphas=alphas)


def _diff_function():
    try:
        from fp4pass.onnx.numerics import diff
    except ImportError:
        raise UsageError("--check is not available in this build (fp4pass.onnx.numerics missing)") from None
    return diff


def _check(original, rewritten, provider: str, inputs=None, snr_min: float | None = None) -> dict:
    try:
        result = _diff_function()(original, rewritten, inputs=inputs, provider=provider, snr_min=snr_min)
    except FP4PassError as exc:
        raise CheckError(f"--check could not run: {exc}") from exc
    data = jsonable(result.to_json() if hasattr(result, "to_json") else result)
    data["snr_min"] = snr_min
    return data


def convert(
    model_or_path,
    method: str = "auto",
    scale_form: str = "dq",
    target: str = "trt",
    calib=None,
    calibrator: str = "max",
    scales=None,
    provider: str = "auto",
    *,
    output: str | os.PathLike | None = None,
    external_data: str = "auto",
    check: bool = False,
    show_progress: bool | None = False,
    calibrator_options: dict | None = None,
    snr_min: float | None = None,
    allow_invalid: bool | None = None,
):
    """Rewrite every MXFP4 weight of a model into NVFP4 (module docstring); returns ``(model, report)``.

    ``model_or_path``: a path, ``onnx.ModelProto``, ``onnx_ir.Model`` (rewritten in place) or
    onnx-graphsurgeon ``Graph``; the model comes back as the same kind (an ``onnx_ir.Model`` for a path, or the
    output path when ``output`` is given). ``output``: write the model there (atomically; streamed with
    external data per ``external_data`` = auto | always | never). ``calib``: an .npz file or a folder of them
    to calibrate activation scales with ``calibrator``; ``scales``: a SCALES.json path or dict to reuse.
    ``check``: run ``fp4pass.onnx.diff`` between input and output and store its result under "check".
    ``calibrator_options``: keyword options of the calibrator (rho, margin, percentile). ``snr_min``: the
    check fails (``report["check"]["passed"]`` false) when an output's SNR is below it, in dB.
    ``allow_invalid``: True when the input may fail the ONNX checker (then so may the output, with a
    warning); False when it was checked (an output the checker refuses is a bug: nothing is written);
    None: the input is checked here when ``output`` is given (:func:`fp4pass.onnx.loading.save`).
    A check that cannot run raises :class:`~fp4pass.errors.CheckError`.
    """
    _check_choice("method", method, METHODS)
    _check_choice("scale_form", scale_form, SCALE_FORMS)
    _check_choice("target", target, TARGETS)
    _check_choice("external_data", external_data, EXTERNAL_DATA)
    _check_choice("provider", provider, PROVIDERS)
    if calib is not None and scales is not None:
        raise UsageError("give either calib (to calibrate) or scales (to reuse a calibration), not both")
    if check:
        _diff_function()  # fail before any work when the check cannot run
    start = time.perf_counter()
    if output is not None and allow_invalid is None:
        allow_invalid = not loading.passes_checker(model_or_path)
    loaded = loading.load(model_or_path)
    model = loaded.model
    input_files = ()
    if loaded.path is not None:
        input_files = (loaded.path, *loading.external_data_files(model))
        if output is not None:
            from fp4pass.io import refuse_overwrite

            refuse_overwrite(output, *input_files)
    had_external = loaded.had_external_data
    original_for_check = None
    if check:
        original_for_check = str(loaded.path) if loaded.path is not None else ir.serde.serialize_model(model)

    records, declined = find_weights(model, loaded.path.parent if loaded.path is not None else None)
    convs = [WeightConversion(r, method, prior_global_scale(r) if r.pattern == "qmoe" else None) for r in records]
    done, alphas, wrote_dq = _rewrite(records, convs, scale_form)
    quark = _quark_rest(model, calibrated=calib is not None or scales is not None, declined=declined)
    versions = SetOpsetAndIR().call(model, wrote_dq)
    _group_initializers(model, records)

    activations = None
    if calib is not None or scales is not None:
        activations = _activations(model, calib, calibrator, scales, target, scale_form, alphas, provider,
                                   calibrator_options or {})
        versions["after"]["ir_version"] = model.ir_version
        _quark_replaced(quark, activations)

    used_external = False
    if output is not None:
        bar = None

        def on_tensor(tensor, total):
            nonlocal bar
            if bar is None:
                bar = progress(iter(range(total)), total, "writing", enabled=show_progress)
            next(bar, None)

        used_external = loading.save(model, output, external_data=external_data, inputs=input_files,
                                     input_had_external=had_external, on_tensor=on_tensor,
                                     allow_invalid=allow_invalid)
        if bar is not None:
            for _ in bar:
                pass
    else:
        for conv in progress(convs, desc="converting", enabled=show_progress):
            conv.materialize()
        _materialize(model)
    for conv in convs:
        if conv.stats is None:  # a tensor ir.save never read (cannot happen for initializers; keeps stats whole)
            conv.materialize()

    tensors = [tensor_entry(r, c, form, note() if callable(note) else note) for r, c, form, note in done]
    declined_json = [d.to_json() for d in declined]
    report = {
        "input": str(loaded.path) if loaded.path is not None else f"<{loaded.kind}>",
        "output": None if output is None else str(output),
        "method": method,
        "scale_form": scale_form,
        "target": target,
        "external_data": used_external,
        "model": versions,
        "tensors": tensors,
        "declined": declined_json,
    }
    if activations is not None:
        report["activations"] = jsonable(activations)
    if quark:
        report["quark"] = quark
    report["summary"] = summarize(tensors, declined_json, time.perf_counter() - start)
    if check:
        rewritten = str(output) if output is not None else ir.serde.serialize_model(model)
        # the calibration data are the most telling inputs; else diff draws seeded random ones
        check_inputs = calib if calib is not None and Path(calib).is_file() else None
        report["check"] = _check(original_for_check, rewritten, provider, check_inputs, snr_min)
    log.debug("%s", summary_line(report))
    if output is not None and loaded.kind == "path":
        return Path(output), report
    return loading.to_kind(model, loaded.kind), report
