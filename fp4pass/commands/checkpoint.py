"""``fp4pass convert`` / ``fp4pass inspect`` when the input is a checkpoint folder (safetensors + config.json).

``convert.py`` and ``inspect.py`` call :func:`convert_folder` / :func:`inspect_folder` when the input came in
through the checkpoint-folder door (:mod:`fp4pass.commands.doors`, which also resolved a Hub ID).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from fp4pass import messages
from fp4pass.commands import checkpoint_calib, safety, doors
from fp4pass.commands.calibrator_flags import check_calibrator_flags
from fp4pass.commands.provenance import stamped
from fp4pass.errors import UsageError
from fp4pass.io import json_text

FORMATS = ("modelopt", "compressed-tensors")

CONVERT_EPILOG = """
checkpoint folders (config.json + *.safetensors, MXFP4 experts in gpt-oss, compressed-tensors mxfp4-pack-quantized
or DeepSeek-V4 form) convert into a new folder:
  fp4pass convert models/checkpoints/deepseek_v3 -o deepseek-v3-nvfp4 --format compressed-tensors --check   # bundled example
  fp4pass convert gpt-oss-20b -o gpt-oss-20b-nvfp4 --format modelopt --check
  fp4pass convert kimi-k3 -o kimi-k3-nvfp4 --format compressed-tensors --input-scale 1.0 --report report.json
  fp4pass convert deepseek-v4 -o deepseek-v4-nvfp4 --scales SCALES.json
OUT_DIR must not exist or be empty (--overwrite: or a folder fp4pass wrote); it appears only when everything is
written (and checked). gpt-oss fused
experts have no compressed-tensors form (exit 2). --check reads the result back with compressed-tensors
(pip install 'fp4pass[checkpoint]') and exits 1 if an expert differs from its source beyond the rules
(identical where the exponent spread is <= 17, else no worse than plain requantization).
"""

INSPECT_EPILOG = """  fp4pass inspect gpt-oss-20b        # a checkpoint folder: MXFP4 weights, spread, lossless forecast
  fp4pass inspect gpt-oss-20b-nvfp4  # an NVFP4 folder (ours, ModelOpt's, llm-compressor's): problems, engine verdicts
  fp4pass inspect Qwen3-30B-A3B-NVFP4 --engine vllm --json   # one engine; exit 0 clean, 1 problems, 2 unreadable
"""

def _size(text: str) -> int:
    import argparse

    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    t = text.strip().upper()
    number = t.rstrip("KMGIB")
    unit = t[len(number):]
    try:
        value = int(float(number) * units[unit])  # inf, 1e400: OverflowError; nan: ValueError
    except (ValueError, KeyError, OverflowError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite size (e.g. 5GB, 500MB, 2GiB)") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1 byte")
    return value


def add_convert_arguments(p) -> None:
    """The checkpoint flags of ``fp4pass convert`` (ignored for ONNX files, refused there when given)."""
    g = p.add_argument_group("checkpoint folders (IN is a folder: CKPT_DIR -o OUT_DIR)")
    g.add_argument("--format", choices=FORMATS, default=None,
                   help="modelopt (vLLM modelopt_fp4, TensorRT-LLM; default) or compressed-tensors "
                        "(nvfp4-pack-quantized)")
    g.add_argument("--input-scale", type=safety.finite_float, metavar="X",
                   help="one activation input_scale (amax/2688, a multiplier) for every converted module")
    g.add_argument("--max-shard-size", type=_size, default=None, metavar="SIZE",
                   help="output shards of at most SIZE (default 5GB)")
    g.add_argument("--allow-partial", action="store_true", default=None,
                   help="copy MXFP4 weights that cannot be converted (named in the output and the report) "
                        "instead of refusing the checkpoint (exit 2)")
    g.add_argument("--engine", choices=("vllm", "sglang", "trtllm"), default=None,
                   help="the serving engine the output is for: refuse (exit 2, nothing written) an output its "
                        "loader would not load; every engine's verdict is printed either way")
    g.add_argument("--overwrite", action="store_true", default=None,
                   help="replace OUT_DIR when fp4pass wrote it (it holds .fp4pass-output.json), once the new one is "
                        "complete; any other existing folder is refused")
    add_folder_arguments(g)
    checkpoint_calib.add_arguments(g, batch_size=True)  # --calib DATA on a folder: calibrate, then convert
    p.epilog = (p.epilog or "") + CONVERT_EPILOG


FOLLOW_HELP = ("read symlinks of the checkpoint folder that lead out of it (by default only links inside the "
               "folder or into its Hugging Face cache blobs/ are read; files of /proc, /sys, /dev never are)")


def add_folder_arguments(g) -> None:
    """Flags of every command that reads a checkpoint folder (``convert``, ``inspect``)."""
    g.add_argument("--follow-symlinks", action="store_true", default=None, help=FOLLOW_HELP)


def _check_flags(args) -> None:
    from fp4pass.io import check_output_folder

    check_calibrator_flags(args, "--calib", data_given=bool(args.calib))
    check_output_folder(args.output, overwrite=bool(args.overwrite),  # before a calibration that may take hours
                        inputs={"CKPT_DIR": args.model, "--scales": args.scales, "--calib": args.calib})
    doors.refuse_foreign(args, doors.CONVERT, doors.CHECKPOINT_FOLDER)
    if args.input_scale is not None and args.scales:
        raise UsageError("give --input-scale or --scales, not both")
    if args.input_scale is not None and not args.input_scale > 0:
        raise UsageError(f"--input-scale {args.input_scale!r} must be positive")
    if args.input_scale is not None:
        from fp4pass.calib.scales import INPUT_SCALE_MAX, INPUT_SCALE_MIN

        if not INPUT_SCALE_MIN <= args.input_scale <= INPUT_SCALE_MAX:  # as a SCALES.json value
            raise UsageError(f"--input-scale {args.input_scale!r} is outside [{INPUT_SCALE_MIN:.4g}, "
                             f"{INPUT_SCALE_MAX:.4g}], the range of a SCALES.json input_scale (float32 would make it "
                             "inf or 0, or the block scales times it would not be finite)")
    if args.report:
        out = Path(os.path.abspath(args.output))
        for report in (Path(os.path.abspath(args.report)), Path(os.path.realpath(args.report))):
            real_out = Path(os.path.realpath(out))
            if report in (out, real_out) or out in report.parents or real_out in report.parents:
                raise UsageError(f"--report {args.report}: is or lies inside OUT_DIR {args.output} (through a "
                                 "symlink or not), which must be new or empty")
    safety.check_files({"--report": args.report}, {"CKPT_DIR": args.model, "--scales": args.scales})


def refuse_nvfp4_folder(folder, follow_symlinks: bool = False) -> None:
    """An NVFP4 checkpoint given to ``convert``: say so, with its form and scheme, and point at ``inspect``."""
    from fp4pass.safetensors.files import CheckpointError
    from fp4pass.checkpoint.validate import is_nvfp4_folder, validate

    if not is_nvfp4_folder(folder, follow_symlinks=follow_symlinks):
        return
    try:
        found = validate(folder, follow_symlinks=follow_symlinks)
        scheme = "W4A4" if found["input_scales"] == "needed" else "W4A16"
        what = f" ({found['form']}, {scheme})"
    except CheckpointError:
        what = ""
    raise UsageError(f"{folder}: already NVFP4{what}; nothing to convert; check it with `fp4pass inspect {folder}`")


def convert_folder(args) -> int:
    """``fp4pass convert CKPT_DIR -o OUT_DIR``: ``args.model`` is the (resolved) checkpoint folder."""
    refuse_nvfp4_folder(args.model, follow_symlinks=bool(args.follow_symlinks))
    _check_flags(args)
    from fp4pass.checkpoint import CheckFailed, convert, format_report, summary_line
    from fp4pass.checkpoint.run import DEFAULT_SHARD_BYTES
    from fp4pass.io import write_json

    try:
        report = convert(args.model, args.output, format=args.format or "modelopt", input_scale=args.input_scale,
                         scales=checkpoint_calib.scales_for_convert(args), method=args.method, check=args.check,
                         max_shard_bytes=args.max_shard_size or DEFAULT_SHARD_BYTES, effort=args.effort,
                         threads=args.threads, allow_partial=bool(args.allow_partial),
                         follow_symlinks=bool(args.follow_symlinks), engine=getattr(args, "engine", None),
                         overwrite=bool(args.overwrite), show_progress=False if messages.quiet() else None,
                         before_rename=(lambda r: write_json(args.report, stamped(r, args))) if args.report else None)
    except CheckFailed as failed:
        if args.report:
            write_json(args.report, stamped(failed.report, args))
        first = failed.report["check"]["failures"][0]
        messages.error(f"fp4pass convert: check FAILED: {len(failed.report['check']['failures'])} expert(s), "
                       f"first {first['expert']}: {first['reason']}; {args.output} not written")
        return 1
    _print_report(report, format_report, summary_line(report))
    if report.get("engines"):
        from fp4pass.checkpoint.engines import verdict_line

        loads = any(v.get("loads") for v in report["engines"].values())  # none: a warning, it serves nowhere yet
        (messages.info if loads else messages.warning)(f"fp4pass convert: engines: {verdict_line(report['engines'])}",
                                                        file=sys.stderr)
    if report.get("check") is not None:  # a failed check raised CheckFailed: this one passed
        messages.info(f"fp4pass convert: {check_line(report['check'])}", file=sys.stderr)
    return 0


def _print_report(report: dict, format_report, summary: str) -> None:
    """The table of converted weights (info, stdout), each weight --allow-partial left in MXFP4 (a warning,
    stdout), then the summary (info, stderr, once, as for ONNX models). --report was written before OUT_DIR
    was renamed into place (before_rename)."""
    from fp4pass.checkpoint.run import declined_line

    table = format_report({**report, "declined": []}).splitlines()[:-1]  # its last line: the summary
    if table:
        messages.info("\n".join(table))
    for d in report.get("declined", []):
        messages.warning(declined_line(d), file=sys.stdout)
    messages.info(f"fp4pass convert: {summary}; {report['summary'].get('seconds', 0):.1f} s", file=sys.stderr)
    if report.get("not_copied"):  # original/ (a release's own weights in another form), special files
        messages.info(f"fp4pass convert: left out, not copied (sub-folders and special files): "
                      f"{', '.join(report['not_copied'])}", file=sys.stderr)


def check_line(check: dict) -> str:
    """--check's verdict in one line: how many experts were compared, how many came out identical to their
    MXFP4 source, and which reader decoded the NVFP4 result."""
    failures = check.get("failures", [])
    verdict = "FAILED" if failures else "PASSED"
    identical = check.get("experts_identical", 0)
    line = (f"check {verdict}: {check.get('experts_checked', 0)} experts compared with their MXFP4 source, "
            f"{identical} identical")
    if check.get("experts_checked", 0) > identical:
        line += ", the rest within plain requantization's error" if not failures else f", {len(failures)} failed"
    wide = check.get("decoded_in_float64") or []
    if wide:  # values past the reader's float32/bf16 range: fp4pass's own float64 decode (fp4pass.checkpoint.check)
        line += (f"; {len(wide)} of them decoded in float64 instead (first {wide[0]['expert']}: "
                 f"{wide[0]['why']})")
    return f"{line}; decoded by {check.get('reader', 'an unnamed reader')}"


def inspect_folder(args) -> int:
    """``fp4pass inspect CKPT_DIR [--json]``: ``args.model`` is the (resolved) checkpoint folder."""
    doors.refuse_foreign(args, doors.INSPECT, doors.CHECKPOINT_FOLDER, settled=False)  # --allow-invalid
    door = doors.refine(args, doors.INSPECT, doors.CHECKPOINT_FOLDER)
    doors.refuse_foreign(args, doors.INSPECT, door)  # --engine, --strict of an MXFP4 folder
    from fp4pass.checkpoint import format_inspection, inspect
    from fp4pass.checkpoint.validate import exit_status, format_validation, validate

    follow = bool(getattr(args, "follow_symlinks", False))
    if door is doors.NVFP4_FOLDER:  # an NVFP4 checkpoint: check it against the engines
        result = validate(args.model, engine=getattr(args, "engine", None), follow_symlinks=follow)
        if args.json:
            messages.result(json_text(result))
        else:
            messages.info(format_validation(result))
            _problems_when_quiet(result)
        return exit_status(result, strict=bool(getattr(args, "strict", False)))
    info = inspect(args.model, follow_symlinks=follow)
    if args.json:
        messages.result(json_text(info))
    else:
        messages.info(format_inspection(info))
    return 0


def inspect_from_headers(args, repo_id: str, revision: str | None) -> int | None:
    """``inspect ORG/NAME`` of a model not in the cache: from its configs and shard headers. Exit 0; 1 when
    ``--engine`` names an engine that does not load that NVFP4 checkpoint. None when the Hub cannot answer
    (unreachable, no such model or revision, gated): resolving the ID then says which, in one line."""
    from fp4pass.checkpoint.hub_headers import HubUnavailable, format_hub_inspection, inspect_hub_headers

    for flag in ("follow_symlinks", "allow_invalid", "strict"):
        if getattr(args, flag, None):
            raise UsageError(f"--{flag.replace('_', '-')} needs the checkpoint's files; {args.model} is not cached "
                             "(inspect reads its headers only): hf download it first")
    try:
        info = inspect_hub_headers(repo_id, revision, show_progress=False if messages.quiet() else None)
    except HubUnavailable:
        return None
    engine = getattr(args, "engine", None)
    if engine and info["precision"] != "nvfp4":
        raise UsageError(f"--engine applies to NVFP4 checkpoint folders; {args.model} is not one")
    if args.json:
        messages.result(json_text(info))
    else:
        messages.info(format_hub_inspection(info))
    return 1 if engine and not info["engines"][engine]["loads"] else 0


def _problems_when_quiet(result: dict) -> None:
    """The validation's problems (errors) and warnings, as its report lists them, where the report itself (info)
    is hidden: ``inspect NVFP4_DIR --quiet`` exits 1 naming what is wrong, and shows every warning it counts."""
    if not messages.quiet():
        return  # the report, shown, holds these lines already
    from fp4pass.checkpoint.validate import problem_line

    errors = [p for p in result["problems"] if p.get("severity") != "warning"]
    warnings = [p for p in result["problems"] if p.get("severity") == "warning"]
    if errors:
        messages.error("\n".join([f"{len(errors)} problem(s):", *map(problem_line, errors)]), file=sys.stdout)
    if warnings:
        messages.warning("\n".join([f"{len(warnings)} warning(s) (exit 0 unless --strict):",
                                    *map(problem_line, warnings)]), file=sys.stdout)
