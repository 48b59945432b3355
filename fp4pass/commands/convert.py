"""``fp4pass convert``: rewrite every MXFP4 weight of an ONNX model into NVFP4."""

from __future__ import annotations

import argparse
import sys

from fp4pass.commands._calibrator_flags import add_calibrator_arguments, calibrator_options

EPILOG = """examples:
  fp4pass convert models/moe.onnx -o moe.nvfp4.onnx --report report.json --check
  fp4pass convert model.onnx -o model.nvfp4.onnx --scale-form alpha --calib calib.npz
  fp4pass convert model.onnx -o model.ort.onnx --target ort --external-data always

exit codes: 0 converted (and --check passed), 1 --check failed, 2 bad input or usage.
"""


def register(sub, common) -> None:
    p = sub.add_parser("convert", parents=[common], help="rewrite MXFP4 weights into NVFP4",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", metavar="IN.onnx")
    p.add_argument("-o", "--output", metavar="OUT.onnx", required=True)
    p.add_argument("--method", choices=["auto", "hybrid", "requant", "verbatim"], default="auto")
    p.add_argument("--scale-form", choices=["dq", "alpha"], default="dq",
                   help="dq: global scale in the scale DQ; alpha: on the consumer's output")
    p.add_argument("--target", choices=["trt", "ort", "reference"], default="trt")
    p.add_argument("--calib", metavar="DATA.npz|DIR", help="calibrate and insert activation quantizers")
    add_calibrator_arguments(p)
    p.add_argument("--scales", metavar="SCALES.json", help="reuse a saved calibration")
    p.add_argument("--report", metavar="REPORT.json", help="write the per-tensor report")
    p.add_argument("--check", action="store_true", help="diff input and output under onnxruntime")
    p.add_argument("--external-data", choices=["auto", "always", "never"], default="auto")
    p.add_argument("--provider", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--effort", choices=["best", "fast"], default="best",
                   help="auto's search on lossy groups: best (wide) or fast (narrow)")
    p.add_argument("--threads", type=int, default=1, metavar="N",
                   help="torch intra-op threads for the weight conversion (default 1: fastest on 2 shared cores)")
    p.set_defaults(run=run)


def run(args) -> int:
    from fp4pass.io import write_json
    from fp4pass.onnx.pipeline import convert
    from fp4pass.onnx.report import format_report, summary_line
    from fp4pass.convert import set_defaults

    set_defaults(effort=args.effort, threads=args.threads)  # every weight conversion of this command
    _, report = convert(
        args.model, method=args.method, scale_form=args.scale_form, target=args.target, calib=args.calib,
        calibrator=args.calibrator, scales=args.scales, provider=args.provider, output=args.output,
        external_data=args.external_data, check=args.check, show_progress=None if not args.quiet else False,
        calibrator_options=calibrator_options(args),
    )
    if args.report:
        write_json(args.report, report)
    if not args.quiet:
        print(format_report(report))
    print(f"fp4pass convert: {summary_line(report)}", file=sys.stderr)
    check = report.get("check")
    return 1 if check is not None and not check.get("passed", False) else 0
