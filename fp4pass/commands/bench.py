"""``fp4pass bench``: the benchmarks, each a ratio to a baseline run in the same process."""

from __future__ import annotations

import argparse

from fp4pass import messages
from fp4pass.bench import AREAS, HEADER, RATIO_NOTE, format_row, run_benchmarks
from fp4pass.choices import Device, values
from fp4pass.commands.provenance import KEY, provenance
from fp4pass.errors import FP4PassError
from fp4pass.io import check_outputs, write_json

EPILOG = """examples:
  fp4pass bench                      # everything, on CPU and CUDA where present
  fp4pass bench --quick --area formats --json bench.json
  fp4pass bench --peers --rounds 5        # fp4pass vs ModelOpt's casts (pip install 'fp4pass[peers]')
"""


def register(sub, common) -> None:
    p = sub.add_parser("bench", parents=[common], help="run the benchmarks (ratios to same-process baselines)",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", metavar="OUT.json", help="write the results as JSON")
    p.add_argument("--device", choices=values(Device), default=Device.AUTO.value,
                   help="auto (default): CPU, and CUDA too where torch sees a GPU; cpu; cuda")
    p.add_argument("--area", action="append", choices=AREAS, help="only these areas (repeatable)")
    p.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")
    p.add_argument("--peers", action="store_true",
                   help="only fp4pass vs NVIDIA ModelOpt's MXFP4->NVFP4 casts, interleaved, same tensors")
    p.add_argument("--rounds", type=int, default=3, help="--peers: interleaved rounds (median reported)")
    p.set_defaults(run=run)


def run(args) -> int:
    import torch  # here, not at import: `fp4pass --help` and every other command's start do not pay for it

    check_outputs({"--json": args.json})
    if args.device == "cuda" and not torch.cuda.is_available():
        messages.warning("fp4pass bench: warning: --device cuda: CUDA is not available; running on CPU")
    use_cuda = args.device in ("auto", "cuda") and torch.cuda.is_available()
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if use_cuda else [])
    if args.peers:
        from fp4pass.bench import peers

        if not peers.peers_available():
            messages.error(f"fp4pass bench: {peers.INSTALL_HINT}")
            return 2

        def measured(device, log):
            rows = peers.bench_peers(device, args.quick, args.rounds)  # interleaved: the rows come at the end
            for row in rows:
                log(format_row(row))
            return rows
    else:
        def measured(device, log):
            return run_benchmarks(device, args.quick, args.area or AREAS, log=log)

    print(HEADER, flush=True)  # the table, one row as each is measured (long runs), on stdout only
    results = []
    for device in devices:
        results += _benchmarks_own_input(lambda: measured(device, _row))
    print(RATIO_NOTE)
    if args.json:
        write_json(args.json, {KEY: provenance(args, with_source=False), "devices": [str(d) for d in devices],
                               "quick": args.quick, "results": [r.to_json() for r in results]})
    return 0


def _row(row: str) -> None:
    print(row, flush=True)


def _benchmarks_own_input(measure):
    """Run ``measure()``. The benchmarks build every tensor, model and option they pass, so an input error
    raised inside them is fp4pass's own bug (exit 3), never the user's bad input (exit 2)."""
    try:
        return measure()
    except FP4PassError as exc:
        raise BenchmarkBug(f"a benchmark passed fp4pass input it refuses: {exc}") from exc


class BenchmarkBug(RuntimeError):
    """An :class:`~fp4pass.errors.FP4PassError` raised from inside a benchmark (see ``_benchmarks_own_input``)."""
