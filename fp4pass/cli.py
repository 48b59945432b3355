"""The ``fp4pass`` command: parse, call one function, print.

Each subcommand lives in ``fp4pass/commands/<name>.py`` with ``register(subparsers)`` and ``run(args) -> int``.
Failures are caught here, once, each as one line on stderr (``--debug`` adds the traceback):

- exit 2: input a user can fix (:class:`~fp4pass.errors.FP4PassError`, a file that cannot be read or
  written, memory exhausted by the sizes asked for);
- exit 3: a bug (any other exception, or an output the ONNX checker refuses): "please report";
- exit 130 on Ctrl-C, 143 on SIGTERM (handled alike: temporaries removed).

Every command runs inside a :func:`fp4pass.io.output_session`: on a non-zero exit the outputs it renamed
into place are removed again (``OutputSession.rollback``: exit 1 keeps the reports, ``--keep-unchecked``
the model). A closed stdout (``fp4pass inspect --json | head``) is not an error: the rest of the output is
dropped quietly and the exit code is the command's own.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import errno
import importlib
import io as _stdio
import logging
import os
import re
import signal
import sys
import threading
import traceback

from fp4pass import __version__, messages
from fp4pass import io as fio
from fp4pass.errors import CheckError, FP4PassError

COMMANDS = ("convert", "inspect", "calibrate", "diff", "study", "bench", "clean")
EXIT_USAGE, EXIT_BUG, EXIT_INTERRUPTED, EXIT_TERMINATED = 2, 3, 130, 143
QUIET_HELP = ("warnings and errors only, on every command: no progress bar, note, table or summary (the exit code, "
              "the files written and inspect --json still give the result)")

EPILOG = """examples:
  fp4pass inspect models/moe.onnx
  fp4pass convert models/moe.onnx -o moe.nvfp4.onnx --report report.json --check
  fp4pass diff models/moe.onnx moe.nvfp4.onnx --intermediates --snr-min 30
  fp4pass study --json study.json
  fp4pass clean out/                 # temporaries left by a killed run

exit codes: 0 done, 1 a numeric check failed, 2 bad input or usage, 3 a bug (please report).
"""


#: flags every subcommand takes (after its name: ``fp4pass convert --quiet``, not ``fp4pass --quiet convert``)
COMMON_FLAGS = ("--debug", "--quiet", "-v", "--verbose")
_INVALID_CHOICE = re.compile(r"invalid choice: '(?P<given>[^']*)' \(choose from (?P<choices>.*)\)$")


def _choice_hint(message: str) -> str:
    """`` (did you mean X?)`` for argparse's "invalid choice" message when one choice is close to the value
    given (``compressed_tensors`` for ``compressed-tensors``: ``_`` and ``-`` alike, case ignored)."""
    found = _INVALID_CHOICE.search(message)
    if found is None:
        return ""
    choices = [c.strip().strip("'\"") for c in found["choices"].split(",")]
    given = found["given"].lower().replace("_", "-")
    close = [c for c in choices if c.lower() == given] or difflib.get_close_matches(given, choices, n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # usage errors: one line of usage, the error line, exit 2 (argparse's code)
        self.exit(2, f"{self.short_usage()}\n{self.prog}: error: {message}{_choice_hint(message)}\n")

    def short_usage(self) -> str:
        """One line: the positionals and the required flags, then where the rest is listed."""
        parts = []
        for action in self._actions:
            if action.option_strings and action.required:
                parts.append(f"{action.option_strings[0]} {action.metavar or action.dest.upper()}")
            elif not action.option_strings and action.help is not argparse.SUPPRESS:
                parts.append(str(action.metavar or action.dest))
        return f"usage: {self.prog} {' '.join(parts)} [options]  ({self.prog} -h lists them)"


class _TopParser(_Parser):
    """``fp4pass``'s own parser: a subcommand's flag given before the subcommand is named as such."""

    def parse_known_args(self, args=None, namespace=None):
        given = sys.argv[1:] if args is None else list(args)
        for i, arg in enumerate(given):
            if arg in COMMANDS:
                early = [a for a in given[:i] if a.split("=", 1)[0] in COMMON_FLAGS]
                if early:
                    self.error(f"{early[0]} belongs after the subcommand: fp4pass {arg} {early[0]} ...")
                break
        return super().parse_known_args(args, namespace)


#: the three names calibration data goes by, one per command: given to a command that takes another, the error
#: names the one it takes
DATA_FLAGS = ("--calib", "--data", "--inputs")
DATA_FLAG_HINTS = {
    "convert": "convert takes calibration data as --calib DATA, and the inputs of --check on an ONNX model as "
               "--inputs DATA.npz",
    "calibrate": "calibrate takes its calibration data as --data DATA",
    "diff": "diff takes its data as --data DATA for checkpoint folders, --inputs DATA.npz for ONNX models",
}


class _CommandParser(_Parser):
    """A subcommand's parser: an argument it does not know is its own error (its usage, ``fp4pass convert:``),
    with the closest flag it has, rather than the top-level parser's after the fact.

    Flags are named whole (``allow_abbrev=False``): ``calibrate --calib X`` is not read as ``--calibrator X``,
    and a flag added later never changes what a shortened one meant. Another command's name for calibration
    data (:data:`DATA_FLAGS`) gets the name this command takes, whatever the error it leads to."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self._given: list[str] = []

    def parse_known_args(self, args=None, namespace=None):
        self._given = sys.argv[1:] if args is None else list(args)
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}{self._suggestion(extras)}")
        return namespace, extras

    def error(self, message: str):
        wrong = [a.split("=", 1)[0] for a in self._given if a.split("=", 1)[0] in DATA_FLAGS]
        wrong = [flag for flag in wrong if flag not in self._option_string_actions]
        hint = DATA_FLAG_HINTS.get(self.prog.rpartition(" ")[2])
        if wrong and hint:
            message = f"{message.split(' (did you mean ')[0]} ({wrong[0]} is not a flag of this command: {hint})"
        super().error(message)

    def _suggestion(self, extras: list[str]) -> str:
        flags = [flag for flag in self._option_string_actions if flag.startswith("--")]
        for extra in extras:
            if extra.startswith("-"):
                close = difflib.get_close_matches(extra.split("=", 1)[0], flags, n=1, cutoff=0.6)
                if close:
                    return f" (did you mean {close[0]}?)"
        return ""


def build_parser() -> argparse.ArgumentParser:
    parser = _TopParser(
        prog="fp4pass",
        description="Rewrite MXFP4 models into NVFP4, calibrate NVFP4 activations, and prove the result.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"fp4pass {__version__}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", help="show tracebacks and debug logging")
    common.add_argument("--quiet", action="store_true", help=QUIET_HELP)
    common.add_argument("-v", "--verbose", action="store_true",
                        help="also show the log lines of the libraries fp4pass runs (onnx_ir, onnxruntime)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_CommandParser)
    for name in COMMANDS:
        importlib.import_module(f"fp4pass.commands.{name}").register(sub, common)
    return parser


class Terminated(BaseException):
    """SIGTERM, raised in the main thread so that cleanup runs as it does for Ctrl-C."""


def _on_sigterm(signum, frame):
    raise Terminated()


@contextlib.contextmanager
def _sigterm_handled():
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _importing(frame) -> bool:
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


class _Interrupts:
    """Ctrl-C during a command (:meth:`on_sigint`): KeyboardInterrupt, except in the middle of an import.

    A module interrupted half-way stays broken for the rest of the process (torch's then fail with a
    RecursionError or RuntimeError far from the cause), so there the signal is only noted (``pending``) and
    sent again a moment later, once the import is done. ``seen``: any Ctrl-C this run, so that an exception
    that follows one is reported as the interruption it is, and a run that ends with one still pending counts
    as interrupted.
    """

    seen = False
    pending = False

    @classmethod
    def on_sigint(cls, signum, frame):
        cls.seen = True
        if _importing(frame):
            cls.pending = True
            timer = threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGINT))
            timer.daemon = True
            timer.start()
            return
        cls.pending = False
        raise KeyboardInterrupt

    @classmethod
    @contextlib.contextmanager
    def handled(cls, after=None):
        """:meth:`on_sigint` for the block; then the previous handler again, or ``after``."""
        cls.seen = cls.pending = False
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = signal.signal(signal.SIGINT, cls.on_sigint)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous if after is None else after)


class _QuietPipe:
    """stdout that drops what it cannot write once the reader has gone (BrokenPipeError), instead of failing."""

    def __init__(self, stream):
        self._stream = stream
        self.broken = False

    def write(self, text):
        if not self.broken:
            try:
                return self._stream.write(text)
            except BrokenPipeError:
                self._broke()
        return len(text)

    def flush(self):
        if not self.broken:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._broke()

    def _broke(self):
        self.broken = True
        with contextlib.suppress(OSError, ValueError, AttributeError, _stdio.UnsupportedOperation):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())  # the interpreter's last flush must not fail either
            os.close(devnull)

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


def _os_message(exc: OSError) -> str:
    where = exc.filename if exc.filename is not None else ""
    reason = exc.strerror or _one_line(exc)
    return f"{where}: {reason}" if where else reason


def _run(args) -> tuple[int, BaseException | None]:
    """Run the command; returns (exit code, the exception that ended it or None). Prints the one line."""
    name = args.command

    def fail(code, message, exc):  # errors: shown whole at every level, --quiet included
        if args.debug:
            messages.error("".join(traceback.format_exception(exc)).rstrip("\n"))
        messages.error(f"fp4pass {name}: {message}")
        return code, exc

    try:
        return int(args.run(args) or 0), None
    except FP4PassError as exc:
        return fail(exc.exit_code, f"error: {_one_line(exc)}", exc)
    except (OSError, RuntimeError) as exc:
        if _out_of_threads(exc):  # the system's limit on threads, reached at the count asked for
            return fail(EXIT_USAGE, f"error: cannot start another thread ({_one_line(exc)}); {_threads_hint(args)}",
                        exc)
        if isinstance(exc, RuntimeError):
            return _bug(args, fail, exc)
        return fail(EXIT_USAGE, f"error: {_os_message(exc)}", exc)  # a file: the name and the system's reason
    except MemoryError as exc:
        return fail(EXIT_USAGE, "error: not enough memory for the sizes asked for", exc)
    except KeyboardInterrupt as exc:
        return fail(EXIT_INTERRUPTED, "interrupted", exc)
    except Terminated as exc:
        return fail(EXIT_TERMINATED, "terminated", exc)
    except Exception as exc:  # noqa: BLE001 - anything else is a bug: say so in one line
        return _bug(args, fail, exc)


def _bug(args, fail, exc: BaseException) -> tuple[int, BaseException]:
    if _Interrupts.seen:  # a library that Ctrl-C broke on its way out (an import cut short)
        return fail(EXIT_INTERRUPTED, "interrupted", exc)
    hint = "" if args.debug else "; --debug shows the traceback"
    return fail(EXIT_BUG, f"internal error: {type(exc).__name__}: {_one_line(exc)} "
                          f"(a bug in fp4pass, please report it{hint})", exc)


#: how Python (threading), torch/OpenMP (pthread_create) and the C library say that no thread could be started
_THREAD_FAILURES = ("can't start new thread", "pthread_create", "thread creation failed", "cannot create thread")


def _out_of_threads(exc: BaseException) -> bool:
    if isinstance(exc, OSError) and exc.filename is None and exc.errno == errno.EAGAIN:
        return True  # EAGAIN with no file: fork/clone refused by the process or user thread limit
    text = str(exc).lower()
    return any(words in text for words in _THREAD_FAILURES)


def _threads_hint(args) -> str:
    asked = getattr(args, "threads", None)
    if asked is not None:
        return f"--threads {asked} is more than this system allows; give a smaller --threads"
    return "the system's thread limit is reached (ulimit -u); fewer threads, or fewer processes at once"


def main(argv: list[str] | None = None, *, _sigint_after=None) -> int:
    """The ``fp4pass`` command. Ctrl-C at any moment, even while the command modules are still being imported
    or the arguments parsed, is exit 130 with one line (never inside an import: :class:`_Interrupts`)."""
    with _Interrupts.handled(_sigint_after):
        try:
            parser = build_parser()
            args = parser.parse_args(argv)
            args.argv = [str(a) for a in (sys.argv[1:] if argv is None else argv)]  # for the JSON files' provenance
            args.given_model = getattr(args, "model", None)  # as given: a Hub ID is replaced by its snapshot folder
        except KeyboardInterrupt:
            print("fp4pass: interrupted", file=sys.stderr)
            return EXIT_INTERRUPTED
        return _main(parser, args)


def _main(parser, args) -> int:
    if args.command is None:
        parser.print_help()
        return 2
    # fp4pass's own lines at INFO; the libraries' (onnx_ir's pass manager, ...) only with -v or --debug
    own = logging.DEBUG if args.debug else (logging.WARNING if args.quiet else logging.INFO)
    libraries = logging.DEBUG if args.debug else (logging.INFO if args.verbose else logging.WARNING)
    logging.basicConfig(level=libraries, format="fp4pass: %(message)s", stream=sys.stderr)
    logging.getLogger().setLevel(libraries)
    logging.getLogger("fp4pass").setLevel(own)
    stdout, stderr = sys.stdout, sys.stderr
    sys.stdout = guard = _QuietPipe(stdout)
    lowest = messages.Level.WARNING if args.quiet else messages.Level.INFO  # after logging took its stream
    try:
        with messages.shown_from(lowest), _sigterm_handled(), fio.output_session() as session:
            try:
                code, exc = _run(args)
                if code == 0 and _Interrupts.pending:  # Ctrl-C came before the end; it waited for an import
                    messages.error(f"fp4pass {args.command}: interrupted")
                    code, exc = EXIT_INTERRUPTED, None
            except (KeyboardInterrupt, Terminated) as late:  # arrived outside the command, while unwinding
                code, exc = (EXIT_TERMINATED if isinstance(late, Terminated) else EXIT_INTERRUPTED), late
            if code != 0:
                keep = getattr(args, "keep_unchecked", False) and (code == 1 or isinstance(exc, CheckError))
                for path in session.rollback(code, keep_results=keep):
                    logging.getLogger(__name__).debug("removed %s (exit %d)", path, code)
            guard.flush()
            return code
    finally:
        sys.stdout, sys.stderr = stdout, stderr


def entry() -> int:
    """The installed ``fp4pass`` program (and ``python -m fp4pass``): :func:`main`, then Ctrl-C is ignored while
    the interpreter shuts down, so that a run whose outputs are all in place ends with its own exit code
    rather than a signal's."""
    return main(_sigint_after=signal.SIG_IGN)


if __name__ == "__main__":
    sys.exit(entry())
