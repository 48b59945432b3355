"""``fp4pass.onnx.convert``: MXFP4 -> NVFP4 over a whole ONNX model, with optional activation calibration
and a numerical check.

This is the orchestration above both the ONNX passes (:mod:`fp4pass.onnx`) and the ONNX calibration run
(:mod:`fp4pass.onnx.calibrate`): the passes take plain values (a mapping activation -> input_scale), the
calibration produces them, and the passes never import it. The stages, in order, are those of
:mod:`fp4pass.onnx.pipeline` (load, match, validate, rewrite, clean up), then the activations
(:func:`fp4pass.onnx.calibrate.calibrate_model` or a
SCALES.json, then :func:`fp4pass.onnx.act_quant.insert_activation_quantizers`), the write, and the check
(:func:`fp4pass.onnx.numerics.diff`). ``fp4pass.onnx.convert`` is this module's :func:`convert`.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import onnx_ir as ir

from fp4pass.calib import ActivationScales
from fp4pass.convert import DEFAULT_EFFORT, DEFAULT_THREADS
from fp4pass.errors import CheckError, FP4PassError, UsageError
from fp4pass.onnx import loading
from fp4pass.onnx.calibrate import calibrate_model
from fp4pass.onnx import pipeline as onnx_stages
from fp4pass.onnx.act_quant import QuantizerScale, insert_activation_quantizers
from fp4pass.onnx.initializer_inputs import unlist_initializer_inputs
from fp4pass.onnx.numerics import REFERENCE, diff
from fp4pass.onnx.pipeline import EXTERNAL_DATA, METHODS, PROVIDERS, SCALE_FORMS, TARGETS
from fp4pass.onnx.report import jsonable, summarize, summary_line, tensor_entry
from fp4pass.onnx.rewrite_common import WeightConversion
from fp4pass.onnx.rewrite_qmoe import prior_global_scale
from fp4pass.onnx.sharing import find_weights
from fp4pass.progress import byte_progress, progress

__all__ = ["convert"]

log = logging.getLogger(__name__)


def _activations(model, calib, calibrator, scales, target, scale_form, alphas, provider,
                 calibrator_options, show_progress=False) -> list[dict]:
    onnx_stages.materialize(model)
    if calib is not None:
        act_scales = calibrate_model(model, calib, calibrator=calibrator, provider=provider,
                                     show_progress=show_progress, **calibrator_options)
    elif isinstance(scales, dict):
        act_scales = ActivationScales.from_json(scales)
    else:
        act_scales = ActivationScales.load(scales)
    act_target = "trt" if target == "trt" else "reference"
    plain = {name: QuantizerScale(s.input_scale, s.g_amax) for name, s in act_scales.tensors.items()}
    return insert_activation_quantizers(model, plain, target=act_target, scale_form=scale_form, alphas=alphas)


def _check(original, rewritten, provider: str, inputs=None, snr_min: float | None = None, *,
           shapes: dict | None = None, past_length: int = 0, base_dir=None) -> dict:
    try:
        result = diff(original, rewritten, inputs=inputs, provider=provider, snr_min=snr_min, shapes=shapes,
                      past_length=past_length, base_dir=base_dir)
    except FP4PassError as exc:
        hint = "" if inputs is not None else " (give the model's inputs with --inputs DATA.npz, or dims with --shape)"
        raise CheckError(f"--check could not run: {exc}{hint}") from exc
    data = jsonable(result.to_json() if hasattr(result, "to_json") else result)
    data["snr_min"] = snr_min
    data["notes"] = list(result.notes)
    data["provider_notes"] = list(result.provider_notes)
    return data


def _initializer_bytes(model: ir.Model) -> int:
    """Bytes of every initializer (lazy ones from their shape and type, without computing them)."""
    return sum(value.const_value.nbytes for graph in model.graphs() for value in graph.initializers.values()
               if value.const_value is not None)


def _nothing_to_convert(loaded) -> str:
    """Exit 2's line for a model holding no MXFP4 weight at all, converted or declined, when no activation
    quantizers were asked for either (``calib``/``scales``): the same rule as a checkpoint folder's."""
    from fp4pass.onnx.nvfp4_forms import find_nvfp4, scheme

    where = str(loaded.path) if loaded.path is not None else f"the {loaded.kind} given"
    weights, quantizers = find_nvfp4(loaded.model)
    if weights or quantizers:  # fp4pass's own output, or another NVFP4 model: say so, as the CLI does
        forms = ", ".join(sorted({w.form for w in weights})) or "activations"
        return (f"{where}: already NVFP4 ({forms} form, {scheme(quantizers)}); nothing to convert; check it with "
                f"`fp4pass inspect`")
    return (f"{where}: no MXFP4 weights found (no FP4 DequantizeLinear, QMoE 'fp4', GatherBlockQuantized or "
            "Quark MX fake-quant on an initializer); nothing to convert")


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
    check_inputs=None,
    check_shapes: dict | None = None,
    past_length: int = 0,
    base_dir: str | os.PathLike | None = None,
    effort: str = DEFAULT_EFFORT,
    threads: int | None = DEFAULT_THREADS,
):
    """Rewrite every MXFP4 weight of a model into NVFP4 (module docstring); returns ``(model, report)``.

    ``model_or_path``: a path, ``onnx.ModelProto``, ``onnx_ir.Model`` (rewritten in place) or
    onnx-graphsurgeon ``Graph``; the model comes back as the kind given, except a path: an ``onnx_ir.Model``, or
    ``Path(output)`` when ``output`` is given. ``output``: write the model there (atomically; streamed with
    external data per ``external_data`` = auto | always | never). ``calib``: an .npz file or a folder of them
    to calibrate activation scales with ``calibrator``; ``scales``: a SCALES.json path or dict to reuse.
    ``check``: run ``fp4pass.onnx.diff`` between input and output and store its result under "check"
    (``provider`` "reference": under onnx.reference, for what onnxruntime cannot run, e.g. bfloat16).
    ``calibrator_options``: keyword options of the calibrator (rho, margin, percentile). ``snr_min``: the
    check fails (``report["check"]["passed"]`` false) when an output's SNR is below it, in dB. ``check_inputs``
    (a dict or .npz path; default the ``calib`` file when it is one), ``check_shapes`` (input name -> dims) and
    ``past_length`` (of a KV cache) are the check's inputs, as :func:`fp4pass.onnx.diff` takes them; its notes
    (inputs made up at random among them) are in ``report["check"]["notes"]``.
    ``allow_invalid``: True when the input may fail the ONNX checker (then so may the output, with a
    warning); False when it was checked (an output the checker refuses is a bug: nothing is written);
    None: the input is checked here when ``output`` is given (:func:`fp4pass.onnx.loading.save`).
    ``effort`` ("best" | "fast") and ``threads`` (torch intra-op threads, None: the caller's): of every
    weight's conversion (:func:`fp4pass.convert.mxfp4_to_nvfp4`).
    ``base_dir``: the folder external data resolves against when the model is not a path (a
    ``ModelProto`` or graphsurgeon ``Graph`` with external data is refused without it; nothing is read from
    outside that folder). A check that cannot run raises :class:`~fp4pass.errors.CheckError`.
    """
    onnx_stages.check_choice("method", method, METHODS)
    onnx_stages.check_choice("scale_form", scale_form, SCALE_FORMS)
    onnx_stages.check_choice("target", target, TARGETS)
    onnx_stages.check_choice("external_data", external_data, EXTERNAL_DATA)
    onnx_stages.check_choice("provider", provider, (*PROVIDERS, REFERENCE))
    if provider == REFERENCE and calib is not None:
        raise UsageError("provider 'reference' runs the check with onnx.reference; calibration needs onnxruntime "
                         "(provider auto, cpu or cuda), or reuse a calibration with scales")
    if calib is not None and scales is not None:
        raise UsageError("give either calib (to calibrate) or scales (to reuse a calibration), not both")
    start = time.perf_counter()
    if output is not None and allow_invalid is None:
        allow_invalid = not loading.passes_checker(model_or_path)
    loaded = loading.load(model_or_path, base_dir)
    model = loaded.model
    folder = loaded.path.parent if loaded.path is not None else base_dir
    # the model file and every data file it reads (whatever kind it came as) are never written over
    input_files = (*([loaded.path] if loaded.path is not None else []), *sorted(loading.external_data_files(model)))
    if output is not None:
        from fp4pass.io import refuse_overwrite

        refuse_overwrite(output, *input_files)
        refuse_overwrite(Path(output).with_name(Path(output).name + ".data"), *input_files)
    had_external = loaded.had_external_data
    original_for_check = None
    if check:
        original_for_check = str(loaded.path) if loaded.path is not None else ir.serde.serialize_model(model)

    # an initializer also listed as a graph input is an initializer (as onnxruntime takes it without a feed)
    listed_inputs = unlist_initializer_inputs(model)
    if listed_inputs:
        log.info("%d initializers were also listed as graph inputs; converted as initializers and no longer "
                 "listed as inputs", len(listed_inputs))
    records, declined = find_weights(model, folder)
    if not records and not declined and calib is None and scales is None:  # nothing found, nothing asked for
        raise UsageError(_nothing_to_convert(loaded))
    convs = [WeightConversion(r, method, prior_global_scale(r) if r.pattern == "qmoe" else None, effort=effort,
                              threads=threads) for r in records]
    # stages 4-5 (rewrite, Quark's rest, opset and IR, initializer order): onnx_ir passes, run in order
    stages = onnx_stages.run_weight_passes(model, records, convs, scale_form,
                                           calibrated=calib is not None or scales is not None, declined=declined)
    done, alphas, quark, versions = (stages.rewrite.done, stages.rewrite.alphas, stages.quark.entries,
                                     stages.versions.versions)

    activations = None
    if calib is not None or scales is not None:
        activations = _activations(model, calib, calibrator, scales, target, scale_form, alphas, provider,
                                   calibrator_options or {}, show_progress)
        versions["after"]["ir_version"] = model.ir_version
        onnx_stages.quark_replaced(quark, activations)

    used_external = False
    if output is not None:
        # each weight is converted as ir.save reaches it: the bytes written are the conversion's progress
        with byte_progress(_initializer_bytes(model), "converting and writing", enabled=show_progress) as bar:
            used_external = loading.save(model, output, external_data=external_data, inputs=input_files,
                                         input_had_external=had_external,
                                         on_tensor=lambda tensor, total: bar.update(tensor.nbytes),
                                         allow_invalid=allow_invalid)
            bar.update(bar.total - bar.n)
    else:
        for conv in progress(convs, desc="converting", enabled=show_progress, unit="weight"):
            conv.materialize()
        onnx_stages.materialize(model)
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
    if listed_inputs:
        report["initializer_inputs"] = {
            "names": listed_inputs,
            "note": "initializers also listed as graph inputs: taken as initializers, as onnxruntime does when "
                    "no feed is given, and no longer listed as inputs in the output",
        }
    if activations is not None:
        report["activations"] = jsonable(activations)
    if quark:
        report["quark"] = quark
    report["summary"] = summarize(tensors, declined_json, time.perf_counter() - start)
    if check:
        rewritten = str(output) if output is not None else ir.serde.serialize_model(model)
        # the calibration data are the most telling inputs; else diff draws seeded random ones
        if check_inputs is None and calib is not None and Path(calib).is_file():
            check_inputs = calib
        report["check"] = _check(original_for_check, rewritten, provider, check_inputs, snr_min,
                                 shapes=check_shapes, past_length=past_length, base_dir=folder)
    log.debug("%s", summary_line(report))
    if output is not None and loaded.kind == "path":
        return Path(output), report
    return loading.to_kind(model, loaded.kind), report
