"""``fp4pass study``: 27 tensor scenarios x every MXFP4 -> NVFP4 method, as a table and JSON."""

from __future__ import annotations

import argparse

from fp4pass import messages
from fp4pass.choices import Device, values
from fp4pass.commands.provenance import stamped
from fp4pass.io import check_outputs, write_json

EPILOG = """examples:
  fp4pass study                      # the table on stdout (CPU: well under a minute)
  fp4pass study --json study.json --device cuda
"""


def register(sub, common) -> None:
    p = sub.add_parser("study", parents=[common], help="MSE of every conversion method on 27 tensor scenarios",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", metavar="OUT.json", help="write the study as JSON")
    p.add_argument("--device", choices=values(Device), default=Device.AUTO.value,
                   help="where the study runs: auto (default: CUDA where torch sees a GPU, else CPU), cpu, cuda")
    p.set_defaults(run=run)


def run_study(device, show_progress=None):
    """:func:`fp4pass.study.run_study`, imported when the command runs (and torch with it)."""
    from fp4pass.study import run_study as study

    return study(device, show_progress=show_progress)


def run(args) -> int:
    import torch  # here, not at import: `fp4pass --help` and every other command's start do not pay for it

    from fp4pass.study import format_study_table

    check_outputs({"--json": args.json})
    if args.device == "cuda" and not torch.cuda.is_available():
        messages.warning("fp4pass study: warning: --device cuda: CUDA is not available; running on CPU")
    use_cuda = args.device in ("auto", "cuda") and torch.cuda.is_available()
    device = torch.device("cuda" if use_cuda else "cpu")
    study = run_study(device, show_progress=None if not messages.quiet() else False)
    messages.info(format_study_table(study))
    if args.json:
        write_json(args.json, stamped(study, args, with_source=False))
    return 0
