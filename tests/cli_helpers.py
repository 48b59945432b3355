"""Running the ``fp4pass`` command in-process, as the CLI tests do."""

from __future__ import annotations

from fp4pass.cli import main


def cli(capsys, *argv):
    """``(exit code, stderr)`` of ``fp4pass ARGV`` (argparse's own exit included)."""
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


def one_line(err: str) -> str:
    """The single line a failure prints (asserted: one line, no traceback)."""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]
