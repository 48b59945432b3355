"""``fp4pass diff A.onnx B.onnx``: run both under onnxruntime on the same inputs and report how far B is from A.

Exit codes: 0 passed, 1 an output under ``--snr-min`` (or with NaN/Inf that A does not have), 2 bad input.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from fp4pass.commands import _safety
from fp4pass.extras import require
from fp4pass.errors import UsageError
from fp4pass.io import REPORT, atomic_output, write_json

# the most elements fp4pass draws for one random input (4 GiB of float32): beyond, --shape is a typo
MAX_INPUT_ELEMENTS = 2**30

EPILOG = """examples:
  fp4pass diff model.onnx model.nvfp4.onnx
  fp4pass diff model.onnx model.nvfp4.onnx --snr-min 30 --json diff.json
  fp4pass diff model.onnx model.nvfp4.onnx --intermediates --plot snr.png --shape input_ids=1,128
  fp4pass diff model.onnx model.nvfp4.onnx --inputs batch.npz --provider cuda

A is the reference. Inputs not in --inputs are made up: drawn from a seeded normal distribution (integers
uniform in [0, 16)), and a note says which. --shape gives an input's full dims; other symbolic dims follow the
graph's own shapes (a dim name shared with a given input; past... = --past-length, total... = past + the rest;
a KV cache's head dim from its attention node; attention_mask all ones), else 1 (a note says so).
Metrics: SNR dB = 20 log10(||a|| / ||a-b||) (null when identical), rel_l2 = ||a-b|| / ||a||, cosine,
max/mean/p99 of |a-b|; nan/inf count the values in B. Outputs decide pass/fail; --intermediates compares
every tensor both graphs produce under the same name and names the first divergent node (the first under
--snr-min; without it, the first that differs at all). Tensors an alpha-form model holds without its global
scale are not compared with the other model's (a note names them): they differ by that scale by design.
"""


def parse_shape(text: str) -> tuple[str, tuple[int, ...]]:
    """``name=1,128`` (or ``1x128``) -> ("name", (1, 128))."""
    name, sep, dims = text.rpartition("=")
    try:
        if not sep or not name:
            raise ValueError
        values = tuple(int(d) for d in dims.replace("x", ",").split(",") if d.strip())
        if not values or any(v < 0 for v in values):
            raise ValueError
        if math.prod(max(v, 1) for v in values) > MAX_INPUT_ELEMENTS:  # 0 dims as 1: numpy refuses [0, 2^62]
            raise UsageError(f"--shape {text!r}: {math.prod(values)} elements; at most {MAX_INPUT_ELEMENTS} "
                             "(2^30) per input, counting a 0 dim as 1")
    except ValueError:
        raise UsageError(f"--shape {text!r}: expected NAME=D0,D1,... with non-negative integers") from None
    return name, values


def past_length(text: str) -> int:
    """argparse type: a KV cache's past length, an integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not 0 <= value <= MAX_INPUT_ELEMENTS:
        raise argparse.ArgumentTypeError(f"{value} must be in [0, 2^30]")
    return value


def add_input_arguments(p, what: str) -> None:
    """--inputs, --shape and --past-length: the inputs ``what`` runs the models on (diff and convert --check)."""
    p.add_argument("--inputs", metavar="DATA.npz", help=f"input arrays named after graph inputs, for {what} "
                                                        "(inputs not given are made up at random, with a note)")
    p.add_argument("--shape", action="append", default=[], metavar="NAME=DIMS",
                   help="full dims of an input with symbolic dims, e.g. input_ids=1,128 (repeatable)")
    p.add_argument("--past-length", type=past_length, default=0, metavar="N",
                   help="past length of KV-cache inputs made up from the graph's own shapes (default 0: an "
                        "empty cache)")


def register(sub, common) -> None:
    p = sub.add_parser("diff", parents=[common], help="compare two models numerically under onnxruntime",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("original", metavar="A.onnx", help="the reference model")
    p.add_argument("rewritten", metavar="B.onnx", help="the model to check against A")
    add_input_arguments(p, "both models")
    p.add_argument("--seed", type=_safety.seed, default=0, help="seed of the random inputs (default 0, >= 0)")
    _safety.add_provider_arguments(p, reference=True)
    _safety.add_allow_invalid(p)
    p.add_argument("--intermediates", action="store_true", help="also compare tensors both graphs name alike")
    p.add_argument("--json", metavar="REPORT.json", help="write the result as JSON")
    p.add_argument("--snr-min", type=_safety.finite_float, metavar="DB", help="fail (exit 1) when an output's SNR is below DB")
    p.add_argument("--plot", metavar="OUT.png", type=_safety.plot_path,
                   help="per-tensor SNR and the worst output's error histogram (.png, or .pdf/.svg/...)")
    p.set_defaults(run=run)


def print_notes(command: str, notes, args, provider_notes=()) -> None:
    """The notes of a diff on stderr, one line each; none with --quiet. With --provider cuda the runtime's own
    words on the fallback (``provider_notes``) are left out: the command said so once, before any work."""
    if args.quiet:
        return
    skip = set(provider_notes) if getattr(args, "provider", None) == "cuda" else set()
    for note in notes:
        if note not in skip:
            print(f"fp4pass {command}: note: {note}", file=sys.stderr)


def run(args) -> int:
    from fp4pass.onnx.numerics import diff, plot_diff

    shapes = dict(parse_shape(s) for s in args.shape)
    inputs = {**_safety.model_inputs("A", args.original), **_safety.model_inputs("B", args.rewritten),
              "--inputs": args.inputs}
    _safety.check_files({"--json": args.json, "--plot": args.plot}, inputs)
    if args.plot:
        require("matplotlib", "plot", "--plot")  # before any work
    _safety.check_model(args, args.original, args.rewritten)
    _safety.check_provider(args)
    result = diff(
        args.original, args.rewritten, args.inputs, args.provider, intermediates=args.intermediates,
        snr_min=args.snr_min, seed=args.seed, shapes=shapes, past_length=args.past_length,
        show_progress=False if args.quiet else None,
    )
    print_notes("diff", result.notes, args, result.provider_notes)
    print(result.format_table())
    if args.json:
        write_json(args.json, result.to_json())
    if args.plot:
        with atomic_output(args.plot, suffix=Path(args.plot).suffix, kind=REPORT) as tmp:
            plot_diff(result, tmp)
    return 0 if result.passed else 1
