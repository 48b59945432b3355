"""Running the ``fp4pass`` command in-process, as the CLI tests do."""

from __future__ import annotations

from fp4pass.cli import main
from fp4pass.io import TMP_PREFIX


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


def run_cli(capsys, *argv):
    """``(exit code, stdout, stderr)`` of ``fp4pass ARGV`` run in-process."""
    code = main(list(map(str, argv)))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def nothing_left(out_dir):
    """No ``out_dir`` and no temporary folder of a run beside it."""
    assert not out_dir.exists()
    assert not [p for p in out_dir.parent.iterdir() if p.name.startswith(TMP_PREFIX)]
