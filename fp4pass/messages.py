"""What fp4pass says to its user, each message at the level its producer gives it: info, warning or error.

``--quiet`` is a level, not a filter on the words of a line: under it, info is not shown and every warning and
error is, whole. The level is decided where a message is made, by calling :func:`info`, :func:`warning` or
:func:`error` (or :func:`result` for what a command was asked to print, such as ``inspect --json``, shown at any
level). The command line (:mod:`fp4pass.cli`) sets the level once per run with :func:`shown_from`; anything a
command writes with a bare ``print`` counts as info, and Python's own warnings as warnings.

Each function writes to the stream it is given, or to ``sys.stdout`` (info, results) or ``sys.stderr``
(warnings, errors) as they are at the moment of the call, so that the CLI's stream guards and pytest's capture
both see them.
"""

from __future__ import annotations

import contextlib
import enum
import sys
from typing import Iterator, TextIO

__all__ = ["Level", "info", "warning", "error", "result", "shown", "shown_from", "quiet"]


class Level(enum.IntEnum):
    """How much a message matters; ``--quiet`` shows WARNING and above."""

    INFO = 20
    WARNING = 30
    ERROR = 40


#: the lowest level shown in this run (:func:`shown_from`); INFO outside the command line
_lowest = Level.INFO
#: the streams a message at or above ``_lowest`` goes to while bare prints are hidden (:func:`shown_from`)
_real: dict[str, TextIO] = {}


def shown(level: Level) -> bool:
    """Whether a message at ``level`` is shown in this run."""
    return level >= _lowest


def quiet() -> bool:
    """Whether info is hidden in this run (``--quiet``)."""
    return not shown(Level.INFO)


def _stream(name: str, given: TextIO | None) -> TextIO:
    if given is not None:
        return given
    return _real.get(name) or getattr(sys, name)


def _say(level: Level | None, text: str, default: str, file: TextIO | None) -> None:
    """Write ``text`` and a newline when ``level`` is shown (None: always)."""
    if level is not None and not shown(level):
        return
    if file is sys.stdout or file is sys.stderr:  # the named stream, past a guard that hides bare prints
        file = _real.get("stdout" if file is sys.stdout else "stderr", file)
    stream = _stream(default, file)
    stream.write(text + "\n")
    stream.flush()


def info(text: str, file: TextIO | None = None) -> None:
    """A table, summary, note or progress word: not shown under ``--quiet``. Default stream: stdout."""
    _say(Level.INFO, text, "stdout", file)


def warning(text: str, file: TextIO | None = None) -> None:
    """Something the user must see even under ``--quiet`` although the command succeeds (a weight left in
    MXFP4, an engine that will not load the output, a fallback). Default stream: stderr."""
    _say(Level.WARNING, text, "stderr", file)


def error(text: str, file: TextIO | None = None) -> None:
    """Why the command failed (exit 1, 2, 3 or an interruption): always shown. Default stream: stderr."""
    _say(Level.ERROR, text, "stderr", file)


def result(text: str, file: TextIO | None = None) -> None:
    """What the command was asked to print (``inspect --json``): shown at every level. Default stream: stdout."""
    _say(None, text, "stdout", file)


class _Hidden:
    """A stream for bare prints below the level shown: they are info, and info is hidden (never a test of the
    words written). ``isatty`` is False so that nothing draws a progress bar into it."""

    def __init__(self, stream: TextIO):
        self._stream = stream

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _show_python_warning(message, category, filename, lineno, file=None, line=None):
    import warnings

    _stream("stderr", None).write(warnings.formatwarning(message, category, filename, lineno, line))


@contextlib.contextmanager
def shown_from(lowest: Level) -> Iterator[None]:
    """For the block: show messages at ``lowest`` and above. Above INFO, ``sys.stdout`` and ``sys.stderr`` are
    replaced by streams that drop what is written to them (bare prints are info), while :func:`warning`,
    :func:`error`, :func:`result` and Python's warnings reach the streams that were there before."""
    global _lowest
    import warnings

    before, real_before, show_before = _lowest, dict(_real), warnings.showwarning
    streams = sys.stdout, sys.stderr
    _lowest = lowest
    if lowest > Level.INFO:
        _real.update(stdout=sys.stdout, stderr=sys.stderr)
        sys.stdout, sys.stderr = _Hidden(sys.stdout), _Hidden(sys.stderr)
        warnings.showwarning = _show_python_warning
    try:
        yield
    finally:
        _lowest = before
        _real.clear()
        _real.update(real_before)
        if lowest > Level.INFO:
            sys.stdout, sys.stderr = streams
            warnings.showwarning = show_before
