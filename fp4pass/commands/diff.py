"""``fp4pass diff A.onnx B.onnx``: run both under onnxruntime on the same inputs and report how far B is from A.
``fp4pass diff SRC_DIR NVFP4_DIR --data DATA``: two checkpoint folders, layer by layer through transformers
(:mod:`fp4pass.checkpoint.numerics`).

Exit codes: 0 passed, 1 an output under ``--snr-min`` (or with NaN/Inf that A does not have; for folders a
layer under ``--snr-min``, a mean KL over ``--kl-max``, or NaN/Inf in a scale, a layer's output or the KL), 2 bad
input (for folders also a shard header that does not fit the model).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

from fp4pass import messages
from fp4pass.commands import safety, doors
from fp4pass.commands.provenance import stamped
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

checkpoint folders (A: the MXFP4 or bf16 source, B: any NVFP4 checkpoint of that model, whoever wrote it):
  fp4pass diff models/checkpoints/deepseek_v3 deepseek-v3-nvfp4 --data models/checkpoints/calib_tokens.npz
  fp4pass diff gpt-oss-20b gpt-oss-20b-nvfp4 --data calib.jsonl --seq-len 512 --num-samples 64 --json diff.json
  fp4pass diff deepseek-v4 deepseek-v4-nvfp4 --data calib.npz --snr-min 15 --kl-max 0.05 --plot snr.png
Both run through transformers' own modeling code, one decoder layer at a time; the NVFP4 side decodes its
weights by its form's convention and, where input scales are stored (W4A4), quantizes every quantized
module's input to NVFP4 as the engines do. Figures: per layer the SNR of its output fed the source's input
(local) and fed its own previous output (end-to-end); per routed expert the SNR of its output on the tokens
the source routed to it (the worst in the table, every one in --json, by its checkpoint module); at the logits
KL(source || nvfp4), top-1 agreement and both perplexities. It fails (exit 1, a FAILED line each, "failed" in
--json) on a limit not met and on NaN/Inf in a scale, an output or the KL, named at the first layer and module.
--data takes what calibrate takes (.npz of input_ids, a folder of them, .jsonl/.txt text).
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
    p = sub.add_parser("diff", parents=[common], help="compare two models numerically (ONNX files under "
                                                       "onnxruntime, or checkpoint folders through transformers)",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("original", metavar="A", help="the reference: A.onnx, or the source checkpoint folder SRC_DIR")
    p.add_argument("rewritten", metavar="B", help="the model to check against A: B.onnx, or NVFP4_DIR")
    add_input_arguments(p, "both models")
    p.add_argument("--seed", type=safety.seed, default=0, help="seed of the random inputs (default 0, >= 0)")
    safety.add_provider_arguments(p, reference=True)
    safety.add_allow_invalid(p)
    p.add_argument("--intermediates", action="store_true", help="also compare tensors both graphs name alike")
    p.add_argument("--json", metavar="REPORT.json", help="write the result as JSON")
    p.add_argument("--snr-min", type=safety.finite_float, metavar="DB",
                   help="fail (exit 1) when an output's SNR is below DB (folders: a layer's local SNR)")
    p.add_argument("--plot", metavar="OUT.png", type=safety.plot_path,
                   help="per-tensor SNR and the worst output's error histogram; for folders, each layer's "
                        "SNR and its experts' spread (.png, or .pdf/.svg/...)")
    g = p.add_argument_group("checkpoint folders (A and B are folders)")
    g.add_argument("--data", metavar="DATA", help="token ids or text to run: what calibrate --data takes")
    g.add_argument("--seq-len", type=safety.positive_int, metavar="T",
                   help="tokens per sequence (text is cut into sequences of T; default 512)")
    g.add_argument("--num-samples", type=safety.positive_int, metavar="N", help="at most N sequences")
    g.add_argument("--batch-size", type=safety.positive_int, metavar="B", help="sequences per batch (default 8)")
    g.add_argument("--kl-max", type=safety.finite_float, metavar="X",
                   help="fail (exit 1) when the mean KL(source || nvfp4) of the logits is above X (nats)")
    g.add_argument("--device", choices=("auto", "cpu", "cuda"), default=None,
                   help="where each layer runs (auto: CUDA when torch has a GPU)")
    g.add_argument("--follow-symlinks", action="store_true", default=None,
                   help="read symlinks of the folders that lead out of them")
    g.add_argument("--trust-remote-code", action="store_true", default=None,
                   help="run the folders' own modeling code (config.json auto_map), as transformers and vLLM do "
                        "with this flag; it executes that code")
    p.set_defaults(run=run)
    doors.open_doors(p, doors.DIFF)


def _run_folders(args) -> int:
    """``fp4pass diff SRC_DIR NVFP4_DIR --data DATA`` (its ONNX models' flags refused already)."""
    from fp4pass.checkpoint.diff_plot import plot_checkpoint_diff
    from fp4pass.checkpoint.numerics import diff as checkpoint_diff

    if doors.door_of(args, doors.DIFF, args.rewritten) is not doors.CHECKPOINT_FOLDER:
        raise UsageError(f"{args.rewritten}: not a folder; SRC_DIR {args.original} is one, so B must be the NVFP4 "
                         "checkpoint folder to compare with it")
    if args.data is None:
        raise UsageError("checkpoint folders need --data: the token ids or text to run (what calibrate --data "
                         "takes, e.g. models/checkpoints/calib_tokens.npz)")
    args.original, args.rewritten = doors.resolve(args.original, args), doors.resolve(args.rewritten, args)
    safety.check_files({"--json": args.json, "--plot": args.plot},
                        {"SRC_DIR": args.original, "NVFP4_DIR": args.rewritten, "--data": args.data})
    if args.plot:
        require("matplotlib", "plot", "--plot")
    result = checkpoint_diff(args.original, args.rewritten, args.data, seq_len=args.seq_len,
                             num_samples=args.num_samples, batch_size=args.batch_size, device=args.device or "auto",
                             snr_min=args.snr_min, kl_max=args.kl_max, follow_symlinks=bool(args.follow_symlinks),
                             show_progress=False if args.quiet else None,
                             trust_remote_code=bool(args.trust_remote_code))
    return _report(args, result.format_table(), result, plot_checkpoint_diff)


def _report(args, table: str, result, plot) -> int:
    """Print the table, write --json and --plot (``plot(result, path)``); exit 0 when it passed, else 1."""
    print(table)
    if not result.passed and messages.quiet():  # the table (info) is hidden; its last line, the verdict, is an error
        messages.error(f"fp4pass diff: {table.splitlines()[-1]}")
    if args.json:
        write_json(args.json, stamped(result.to_json(), args))
    if args.plot:
        with atomic_output(args.plot, suffix=Path(args.plot).suffix, kind=REPORT) as tmp:
            plot(result, tmp)
    return 0 if result.passed else 1


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
    door = doors.door_of(args, doors.DIFF)  # the Hub IDs are resolved once, after the flags are checked
    doors.refuse_foreign(args, doors.DIFF, door)
    if door is doors.CHECKPOINT_FOLDER:
        return _run_folders(args)
    if os.path.isdir(args.rewritten):
        raise UsageError(f"{args.rewritten}: a folder, but A ({args.original}) is not: give two ONNX files, or the "
                         "source checkpoint folder and the NVFP4 checkpoint folder")
    from fp4pass.onnx.numerics import diff, plot_diff

    shapes = dict(parse_shape(s) for s in args.shape)
    inputs = {**safety.model_inputs("A", args.original), **safety.model_inputs("B", args.rewritten),
              "--inputs": args.inputs}
    safety.check_files({"--json": args.json, "--plot": args.plot}, inputs)
    if args.plot:
        require("matplotlib", "plot", "--plot")  # before any work
    safety.check_model(args, args.original, args.rewritten)
    safety.check_provider(args)
    result = diff(
        args.original, args.rewritten, args.inputs, args.provider, intermediates=args.intermediates,
        snr_min=args.snr_min, seed=args.seed, shapes=shapes, past_length=args.past_length,
        show_progress=False if args.quiet else None,
    )
    print_notes("diff", result.notes, args, result.provider_notes)  # on stderr, once: not in the table too
    return _report(args, result.format_table(notes=False), result, plot_diff)
