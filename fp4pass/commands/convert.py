"""``fp4pass convert``: rewrite every MXFP4 weight of an ONNX model into NVFP4."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from fp4pass import messages
from fp4pass.choices import Effort, ExternalData, Method, ScaleForm, Target, values
from fp4pass.commands import safety, checkpoint, doors
from fp4pass.commands.calibrator_flags import add_calibrator_arguments, calibrator_options, check_calibrator_flags
from fp4pass.commands.diff import add_input_arguments, parse_shape, print_notes
from fp4pass.commands.provenance import stamped
from fp4pass.errors import UsageError

# --check thresholds, in dB, when --snr-min is not given (docs/bad-input.md has the measurements behind them).
# Weight-only: the example models measure >= 100 dB (or identical) with the default method and 21.8-23.9 dB
# with requant (plain NVFP4 quantization, the lossiest); faults such as a scale off by 2x, a transposed or
# zeroed weight give <= 6 dB. 15 dB sits between with margin on both sides. With activation quantizers the
# examples measure 16.9-18.4 dB for two layers, and the error grows with depth (~10 log10(layers) dB), so
# no default separates a fault from the expected error on every model: none applies; give --snr-min.
SNR_MIN_WEIGHT_ONLY = 15.0
SNR_MIN_WITH_ACTIVATIONS = None

EPILOG = """examples:
  fp4pass convert models/moe.onnx -o moe.nvfp4.onnx --report report.json --check
  fp4pass convert model.onnx -o model.nvfp4.onnx --scale-form alpha --calib calib.npz
  fp4pass convert model.onnx -o model.ort.onnx --target ort --external-data always
  fp4pass convert model.onnx -o model.nvfp4.onnx --check --inputs batch.npz --past-length 16

exit codes: 0 converted (and --check passed), 1 --check failed (an output below --snr-min, default 15 dB
without activation quantizers, none with them), 2 bad input or usage (or the check could not run), 3 a bug.
On a non-zero exit no model is left under OUT.onnx (--keep-unchecked keeps it when only the check failed).
"""


def register(sub, common) -> None:
    p = sub.add_parser("convert", parents=[common], help="rewrite MXFP4 weights into NVFP4",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", metavar="IN", help="the MXFP4 model: an ONNX file, or a checkpoint folder "
                                                "(config.json + *.safetensors) or Hugging Face Hub model ID "
                                                "(org/name[@revision])")
    p.add_argument("-o", "--output", metavar="OUT", required=True,
                   help="the NVFP4 result: an ONNX file for an ONNX IN, a new or empty folder for a checkpoint")
    p.add_argument("--method", choices=values(Method), default=Method.AUTO.value,
                   help="auto (default): lossless where the exponent spread allows, else the least error of "
                        "requant and hybrid and more; hybrid, requant (plain NVFP4 quantization), verbatim: "
                        "one method everywhere (docs/conversion.md)")
    p.add_argument("--scale-form", choices=values(ScaleForm), default=ScaleForm.DQ.value,
                   help="dq: global scale in the scale DQ; alpha: on the consumer's output")
    p.add_argument("--target", choices=values(Target), default=Target.TRT.value,
                   help="the runtime the ONNX model is written for: trt (TensorRT, ModelOpt's forms; default), "
                        "ort (onnxruntime: QMoE nvfp4), reference (standard ops only)")
    p.add_argument("--calib", metavar="DATA.npz|DIR", help="calibrate and insert activation quantizers")
    add_calibrator_arguments(p)
    p.add_argument("--scales", metavar="SCALES.json", help="reuse a saved calibration")
    p.add_argument("--report", metavar="REPORT.json", help="write the per-tensor report")
    p.add_argument("--check", action="store_true", help="diff input and output under onnxruntime")
    p.add_argument("--external-data", choices=values(ExternalData), default=ExternalData.AUTO.value,
                   help="tensors in OUT.data beside OUT: auto (default: when the input had external data or "
                        "the model is over 2 GB), always, never")
    p.add_argument("--effort", choices=values(Effort), default=Effort.BEST.value,
                   help="auto's search on lossy groups: best (wide) or fast (narrow)")
    p.add_argument("--threads", type=safety.thread_count, default=1, metavar="N",
                   help="torch intra-op threads for the weight conversion (default 1: fastest on 2 shared cores)")
    _add_safety_arguments(p)
    checkpoint.add_convert_arguments(p)  # IN a folder: a safetensors checkpoint (fp4pass.commands.checkpoint)
    p.set_defaults(run=run)
    doors.open_doors(p, doors.CONVERT)


def _add_safety_arguments(p) -> None:
    safety.add_provider_arguments(p, reference=True)
    safety.add_allow_invalid(p)
    p.add_argument("--snr-min", type=safety.finite_float, metavar="DB",
                   help="--check fails (exit 1) when an output's SNR is below DB (default: 15 for weight-only "
                        "conversions, none with --calib/--scales)")
    add_input_arguments(p, "--check (default: the --calib file when it is one)")
    p.add_argument("--keep-unchecked", action="store_true",
                   help="keep the converted model when --check fails or cannot run (it is removed by default)")


def _check_before_work(args) -> float | None:
    """Everything that can be refused before converting; returns the --check threshold."""
    _refuse_folder_output(args.output, args.model)
    inputs = {**safety.model_inputs("the input model", args.model), "--calib": args.calib, "--scales": args.scales,
              "--inputs": args.inputs}
    outputs = {"-o": args.output, "--report": args.report}
    if args.external_data != "never":
        outputs["-o's external data"] = args.output + ".data"
    safety.check_files(outputs, inputs)
    for flag, given in (("--snr-min", args.snr_min is not None), ("--inputs", args.inputs),
                        ("--shape", args.shape), ("--past-length", args.past_length)):
        if given and not args.check:
            raise UsageError(f"{flag} applies to --check; add --check")
    safety.check_model(args, args.model)
    safety.refuse_text_data("--calib", args.calib, args.model)
    safety.refuse_text_data("--inputs", args.inputs, args.model)
    _refuse_nvfp4_model(args)
    safety.check_provider(args)
    if args.scales:
        _check_scales(args.scales, args.model)
    if args.snr_min is not None:
        return args.snr_min
    return SNR_MIN_WITH_ACTIVATIONS if (args.calib or args.scales) else SNR_MIN_WEIGHT_ONLY


def _refuse_folder_output(output: str, model: str) -> None:
    """``-o NEWDIR/`` or ``-o EXISTING_DIR`` for an ONNX model: it converts into one file (and its external data
    beside it), never into a folder; said before the external-data name built from it (``NEWDIR/.data``)."""
    example = os.path.join(output, Path(model).stem + ".nvfp4.onnx")
    if os.path.isdir(output):
        raise UsageError(f"-o {output}: is a directory; an ONNX model converts into one file: give its name, e.g. "
                         f"-o {example}")
    if output.endswith(("/", os.sep)):
        raise UsageError(f"-o {output}: names a folder (it ends in /); an ONNX model converts into one file: give "
                         f"its name, e.g. -o {example}, in a folder that exists")


def _refuse_nvfp4_model(args) -> None:
    """A model fp4pass already converted (NVFP4 weights, no MXFP4 one left): exit 2 pointing at ``inspect``,
    unless it holds weights only and ``--calib``/``--scales`` asks for its activation quantizers."""
    from fp4pass.onnx.loading import load
    from fp4pass.onnx.nvfp4_forms import find_nvfp4, scheme
    from fp4pass.onnx.sharing import find_weights

    loaded = load(args.model)
    mxfp4, declined = find_weights(loaded.model, loaded.path.parent)
    weights, quantizers = find_nvfp4(loaded.model)
    if mxfp4 or declined or not (weights or quantizers):
        return
    if (args.calib or args.scales) and not quantizers:
        return  # activation quantizers added to an NVFP4 weight-only model
    forms = ", ".join(sorted({w.form for w in weights})) or "activations"
    again = "; its activations are quantized already" if quantizers and (args.calib or args.scales) else ""
    raise UsageError(f"{args.model}: already NVFP4 ({forms} form, {scheme(quantizers)}){again}; nothing to "
                     f"convert; check it with `fp4pass inspect {args.model}`")


def _check_scales(path: str, model_path: str) -> None:
    """SCALES.json readable, its values in range, every tensor one that an FP4 consumer reads."""
    from fp4pass.calib import ActivationScales
    from fp4pass.onnx.calibrate import calibration_targets
    from fp4pass.calib.scales import ScalesFileError
    from fp4pass.onnx.loading import load

    scales = ActivationScales.load(path)
    targets, declined = calibration_targets(load(model_path).model)
    known = [t.name for t in targets] + [d["activation"] for d in declined if d["activation"]]
    unknown = [name for name in scales.tensors if name not in known]
    if unknown:
        raise ScalesFileError(f"{path}: tensor {unknown[0]!r} is not an activation any FP4 consumer reads "
                              f"(known: {', '.join(known) or 'none'})")


def _check_verdict(check: dict) -> str | None:
    """One line naming the output that failed --check and how far below the threshold it is."""
    if check.get("passed", True):
        return None
    threshold = check.get("snr_min")
    worst = []
    for out in check.get("outputs", []):
        snr = out.get("snr_db")
        if out.get("nan") or out.get("inf"):
            worst.append(f"output {out['name']!r} has {out.get('nan', 0)} NaN, {out.get('inf', 0)} Inf")
        elif threshold is not None and snr is not None and snr < threshold:
            worst.append(f"output {out['name']!r} SNR {snr:.2f} dB < {threshold:g} dB ({threshold - snr:.2f} dB short)")
    return "check FAILED: " + ("; ".join(worst) or "see the report")


def run(args) -> int:
    door = doors.enter(args, doors.CONVERT)
    if door is doors.CHECKPOINT_FOLDER:
        return checkpoint.convert_folder(args)
    doors.refuse_foreign(args, doors.CONVERT, door)
    check_calibrator_flags(args, "--calib", data_given=bool(args.calib))
    snr_min = _check_before_work(args)
    from fp4pass.io import write_json
    from fp4pass.pipeline import convert
    from fp4pass.onnx.report import format_report, summary_line
    _, report = convert(
        args.model, method=args.method, scale_form=args.scale_form, target=args.target, calib=args.calib,
        calibrator=args.calibrator, scales=args.scales, provider=args.provider, output=args.output,
        external_data=args.external_data, check=args.check, show_progress=None if not args.quiet else False,
        calibrator_options=calibrator_options(args), snr_min=snr_min, allow_invalid=args.allow_invalid,
        check_inputs=args.inputs, check_shapes=dict(parse_shape(s) for s in args.shape),
        past_length=args.past_length, effort=args.effort, threads=args.threads,
    )
    if args.report:
        write_json(args.report, stamped(report, args))
    _print_report(report, format_report)
    messages.info(f"fp4pass convert: {summary_line(report)}", file=sys.stderr)
    check = report.get("check")
    if check is not None:
        print_notes("convert", check.get("notes", ()), args, check.get("provider_notes", ()))
    verdict = _check_verdict(check) if check is not None else None
    if verdict:
        kept = "kept (--keep-unchecked)" if args.keep_unchecked else "removed (--keep-unchecked keeps it)"
        messages.error(f"fp4pass convert: {verdict}; {args.output} {kept}")
    return 1 if check is not None and not check.get("passed", False) else 0


def _print_report(report: dict, format_report) -> None:
    """The tables (info), then each declined pattern (a warning: its weight stays MXFP4), on stdout."""
    from fp4pass.onnx.patterns import declined_line

    messages.info(format_report({**report, "declined": []}))
    for entry in report.get("declined", []):
        messages.warning(declined_line(entry), file=sys.stdout)
