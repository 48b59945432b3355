"""Checkpoint-folder calibration from the command line: ``fp4pass calibrate CKPT_DIR`` and
``fp4pass convert CKPT_DIR --calib DATA`` (the flags both take, and the run)."""

from __future__ import annotations

import sys

from fp4pass import messages
from fp4pass.commands.calibrator_flags import calibrator_options
from fp4pass.commands.provenance import stamped
from fp4pass.commands.safety import positive_int
from fp4pass.errors import UsageError

DEVICES = ("auto", "cpu", "cuda")


def add_arguments(g, batch_size: bool = False) -> None:
    """``--device``, ``--seq-len``, ``--num-samples``, ``--trust-remote-code`` (and ``--calib-batch-size`` for
    convert)."""
    g.add_argument("--device", choices=DEVICES, default=None,
                   help="checkpoint calibration: where each layer runs (auto: CUDA when torch has a GPU)")
    g.add_argument("--seq-len", type=positive_int, default=None, metavar="T",
                   help="checkpoint calibration: tokens per sequence (text is cut into sequences of T; default "
                        "512; longer .npz rows are cut)")
    g.add_argument("--num-samples", type=positive_int, default=None, metavar="N",
                   help="checkpoint calibration: at most N sequences (default: all of DATA)")
    g.add_argument("--trust-remote-code", action="store_true", default=None,
                   help="checkpoint calibration: run the folder's own modeling code (config.json auto_map), as "
                        "transformers and vLLM do with this flag; it executes that code")
    if batch_size:
        g.add_argument("--calib-batch-size", type=positive_int, default=None, metavar="B",
                       help="checkpoint calibration: sequences per forward batch (default 8)")


def run_calibration(args, data, batch_size, detail: bool = False):
    """Calibrate the checkpoint folder ``args.model`` on ``data``; the :class:`CheckpointScales`."""
    from fp4pass.checkpoint import calibrate

    return calibrate(args.model, data, calibrator=args.calibrator, device=args.device or "auto",
                     batch_size=batch_size, seq_len=args.seq_len, num_samples=args.num_samples,
                     show_progress=None if not messages.quiet() else False, report_detail=detail,
                     trust_remote_code=bool(args.trust_remote_code), **calibrator_options(args))


def print_summary(scales, output: str) -> None:
    unrouted = len(scales.unrouted)
    messages.info(f"fp4pass calibrate: {len(scales.tensors)} module scales from {scales.tokens} tokens "
                  f"({scales.batches} batches) through {scales.layers} layers of {scales.model_type} on "
                  f"{scales.device} in {scales.seconds:.1f} s; {unrouted} expert(s) unrouted (they take their "
                  f"layer's max) -> {output}", file=sys.stderr)


def calibrate_folder(args) -> int:
    """``fp4pass calibrate CKPT_DIR --data DATA -o SCALES.json`` (its ONNX models' flags refused already)."""
    from fp4pass.commands import safety
    from fp4pass.io import RESULT, write_json

    safety.check_files({"-o": args.output, "--report": args.report}, {"CKPT_DIR": args.model, "--data": args.data})
    scales = run_calibration(args, args.data, args.batch_size, detail=bool(args.report))
    write_json(args.output, stamped(scales.to_json(), args), kind=RESULT)
    if args.report:
        write_json(args.report, stamped(scales.report_json(), args))
    rows = [f"{'module':<52} {'tokens':>8} {'amax':>11} {'input_scale':>12}"]
    tokens = {}
    for row in scales.experts:
        for module in row.get("checkpoint_modules", []):
            tokens[module] = tokens.get(module, 0) + row["tokens"]
    for name, scale in scales.tensors.items():
        count = tokens.get(name, "-") if name in tokens else "all"
        rows.append(f"{name:<52} {count!s:>8} {scale.amax:>11.5g} {scale.input_scale:>12.5g}")
    for row in scales.unrouted:  # a gpt-oss stack's modules are the whole stack's: say which expert
        rows.append(f"unrouted (no token routed; the layer's max fills it): expert {row['expert']} of "
                    f"{', '.join(row['checkpoint_modules']) or row['module']}")
    messages.info("\n".join(rows))
    print_summary(scales, args.output)
    return 0


def scales_for_convert(args):
    """``convert CKPT_DIR --calib DATA``: the calibrated scales (None without ``--calib``)."""
    if not args.calib:
        return args.scales
    if args.scales or args.input_scale is not None:
        raise UsageError("give --calib, --scales or --input-scale, not two of them")
    scales = run_calibration(args, args.calib, args.calib_batch_size)
    print_summary(scales, args.output)
    return scales
