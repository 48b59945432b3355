"""``fp4pass calibrate``: run calibration data through a model and write SCALES.json."""

from __future__ import annotations

import argparse
import sys

from fp4pass import messages
from fp4pass.commands import checkpoint_calib, safety, doors
from fp4pass.commands.calibrator_flags import add_calibrator_arguments, calibrator_options, check_calibrator_flags
from fp4pass.commands.provenance import KEY, provenance, stamped
from fp4pass.io import RESULT, write_json

EPILOG = """examples:
  fp4pass calibrate model.onnx --data calib.npz -o scales.json
  fp4pass calibrate model.onnx --data calib_dir/ -o scales.json --calibrator headroom --rho 8192
  fp4pass calibrate model.onnx --data calib.npz -o scales.json --calibrator percentile --percentile 99.999
  fp4pass convert model.onnx -o out.onnx --scales scales.json      # reuse the calibration

--data: one .npz whose arrays are named after the graph inputs (each array fed whole, or cut along its
first axis with --batch-size), or a folder of such .npz files, read one at a time.

checkpoint folders (the model runs through transformers, one decoder layer at a time):
  fp4pass calibrate models/checkpoints/gpt_oss --data models/checkpoints/calib_tokens.npz -o scales.json
  fp4pass calibrate kimi-k2 --data calib.jsonl --seq-len 512 --num-samples 512 -o scales.json --device cuda
  fp4pass convert kimi-k2 -o kimi-k2-nvfp4 --format compressed-tensors --scales scales.json
--data: an .npz of input_ids [N, T] (+ attention_mask), a folder of them, or .jsonl ({"text": ...} lines) /
.txt text tokenized with the checkpoint's tokenizer.json into --num-samples sequences of --seq-len tokens.
"""


def register(sub, common) -> None:
    p = sub.add_parser("calibrate", parents=[common], help="calibrate NVFP4 activation scales (SCALES.json)",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", metavar="IN", help="the model to calibrate: an ONNX file, or a checkpoint folder "
                                                "(config.json + *.safetensors) or Hugging Face Hub model ID "
                                                "(org/name[@revision])")
    p.add_argument("--data", required=True, metavar="DATA.npz|DIR", help="calibration inputs")
    p.add_argument("-o", "--output", required=True, metavar="SCALES.json",
                   help="where the activation scales go (the file convert --scales reads)")
    add_calibrator_arguments(p)
    safety.add_provider_arguments(p)
    safety.add_allow_invalid(p)
    p.add_argument("--batch-size", type=safety.positive_int,
                   help="cut each array along its first axis into batches of this size (>= 1)")
    p.add_argument("--activation", action="append", metavar="NAME",
                   help="calibrate this tensor (repeatable) instead of the inputs of FP4 consumers")
    p.add_argument("--report", metavar="REPORT.json", help="write the per-activation calibration report")
    checkpoint_calib.add_arguments(p.add_argument_group("checkpoint folders (IN is a folder: CKPT_DIR)"))
    p.set_defaults(run=run)
    doors.open_doors(p, doors.CALIBRATE)


def run(args) -> int:
    check_calibrator_flags(args, "--data", data_given=True)
    door = doors.enter(args, doors.CALIBRATE)
    doors.refuse_foreign(args, doors.CALIBRATE, door)
    if door is doors.CHECKPOINT_FOLDER:
        return checkpoint_calib.calibrate_folder(args)
    from fp4pass.onnx.calibrate import calibrate_model
    from fp4pass.onnx.loading import load

    inputs = {**safety.model_inputs("the input model", args.model), "--data": args.data}
    safety.check_files({"-o": args.output, "--report": args.report}, inputs)
    safety.check_model(args, args.model)
    safety.refuse_text_data("--data", args.data, args.model)
    safety.check_provider(args)
    options = calibrator_options(args)
    model = load(args.model).model
    scales = calibrate_model(model, args.data, calibrator=args.calibrator, provider=args.provider,
                             activations=args.activation, batch_size=args.batch_size,
                             show_progress=None if not messages.quiet() else False, **options)
    write_json(args.output, stamped(scales.to_json(), args), kind=RESULT)
    if args.report:
        write_json(args.report, {KEY: provenance(args), "calibrator": scales.calibrator, "provider": scales.provider,
                                 "batches": scales.batches, "tensors": scales.report()})
    rows = [f"{'activation':<32} {'g_amax':>11} {'B_min':>10} {'B_max':>10} {'subnorm':>8} {'satur':>7} {'SNR dB':>7}"]
    for row in scales.report():
        fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
        rows.append(f"{row['name']:<32} {row['g_amax']:>11.5g} {row['b_min']:>10.4g} {row['b_max']:>10.4g} "
                    f"{fmt(row['subnormal_fraction'], '>8.2%')} {fmt(row['saturated_fraction'], '>7.2%')} "
                    f"{fmt(row['snr_db'], '>7.2f')}")
    messages.info("\n".join(rows))
    messages.info(f"fp4pass calibrate: {len(scales.tensors)} activations, {scales.batches} batches on "
                  f"{scales.provider} -> {args.output}", file=sys.stderr)
    return 0
