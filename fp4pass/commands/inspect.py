"""``fp4pass inspect``: list the FP4 weights of a model and forecast which convert losslessly."""

from __future__ import annotations

import argparse
import sys

from fp4pass import messages
from fp4pass.commands import safety, checkpoint, doors
from fp4pass.io import json_text

EPILOG = """examples:
  fp4pass inspect models/moe.onnx
  fp4pass inspect big/model.onnx --json > fp4.json
""" + checkpoint.INSPECT_EPILOG + """  fp4pass inspect deepseek-v3-nvfp4 --strict  # an NVFP4 folder: warnings (magnitude guesses, an engine that does not load
                                       # the form yet) exit 1 too; without --strict only errors do
"""


def register(sub, common) -> None:
    p = sub.add_parser("inspect", parents=[common], help="list FP4 weights, exponent spread, lossless forecast",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", metavar="IN", help="an ONNX file, or a checkpoint folder (config.json + *.safetensors) "
                                                "or Hugging Face Hub model ID (org/name[@revision])")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    safety.add_allow_invalid(p)
    checkpoint.add_folder_arguments(p)  # IN a checkpoint folder
    p.add_argument("--engine", choices=("vllm", "sglang", "trtllm"), default=None,
                   help="an NVFP4 checkpoint folder: only this engine's verdict and the problems that concern it "
                        "(that it cannot load the form is then a problem, not a warning)")
    p.add_argument("--strict", action="store_true",
                   help="an NVFP4 checkpoint folder: exit 1 on warnings too (magnitude guesses, an engine that does "
                        "not load the form)")
    p.set_defaults(run=run)
    doors.open_doors(p, doors.INSPECT)


def run(args) -> int:
    from fp4pass.safetensors.hub import uncached_hub_id

    remote = uncached_hub_id(args.model)
    if remote is not None:  # not cached: its headers only, never the shards (fp4pass.checkpoint.hub_headers)
        code = checkpoint.inspect_from_headers(args, *remote)
        if code is not None:
            return code
    door = doors.enter(args, doors.INSPECT)
    if door is doors.CHECKPOINT_FOLDER:  # a safetensors checkpoint folder
        return checkpoint.inspect_folder(args)
    safety.refuse_checkpoint_file(args.model)
    doors.refuse_foreign(args, doors.INSPECT, door)
    from fp4pass.onnx.inspection import format_inspection, inspect

    safety.check_model(args, args.model)
    info = inspect(args.model)
    if args.json:
        messages.result(json_text(info))
    else:
        messages.info(format_inspection(info))
    problems = info.get("nvfp4", {}).get("problems")  # NVFP4 scales that break the validator's rules
    if problems and not args.json and messages.quiet():  # the table (info) that lists them is hidden: errors
        lines = [f"{len(problems)} problem(s):", *(f"  {p['kind']}: {p['message']}" for p in problems)]
        messages.error("\n".join(lines), file=sys.stdout)
    return 1 if problems else 0
