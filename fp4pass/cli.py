"""The ``fp4pass`` command: parse, call one function, print.

Each subcommand lives in ``fp4pass/commands/<name>.py`` with ``register(subparsers)`` and ``run(args) -> int``.
Errors a user can fix (:class:`~fp4pass.errors.FP4PassError`, missing files) are caught here, once: one line
on stderr, exit code 2, no traceback unless ``--debug``.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from fp4pass import __version__
from fp4pass.errors import FP4PassError

COMMANDS = ("convert", "inspect", "calibrate", "diff", "study", "bench")

EPILOG = """examples:
  fp4pass inspect models/moe.onnx
  fp4pass convert models/moe.onnx -o moe.nvfp4.onnx --report report.json --check
  fp4pass diff models/moe.onnx moe.nvfp4.onnx --intermediates --snr-min 30
  fp4pass study --json study.json
"""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # usage errors: one line, exit 2 (argparse's own convention)
        self.print_usage(sys.stderr)
        self.exit(2, f"fp4pass: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="fp4pass",
        description="Rewrite MXFP4 models into NVFP4, calibrate NVFP4 activations, and prove the result.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"fp4pass {__version__}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", help="show tracebacks and debug logging")
    common.add_argument("--quiet", action="store_true", help="no progress bar, warnings only")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"fp4pass.commands.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"fp4pass.commands.{name}":
                raise
            continue  # a command not built yet
        module.register(sub, common)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    logging.basicConfig(
        level=logging.DEBUG if args.debug else (logging.WARNING if args.quiet else logging.INFO),
        format="fp4pass: %(message)s",
        stream=sys.stderr,
    )
    try:
        return int(args.run(args) or 0)
    except (FP4PassError, FileNotFoundError, IsADirectoryError, PermissionError) as exc:
        if args.debug:
            raise
        print(f"fp4pass {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("fp4pass: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
