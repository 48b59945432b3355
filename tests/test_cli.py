"""The command's contract: --help with examples, usage errors exit 2 with one line, no traceback."""

import subprocess
import sys

from fp4pass.cli import main


def test_help_lists_examples(capsys):
    try:
        main(["--help"])
    except SystemExit as exc:
        assert exc.code == 0
    out = capsys.readouterr().out
    assert "examples:" in out and "fp4pass convert" in out


def test_no_command_prints_help_and_exits_2(capsys):
    assert main([]) == 2


def test_unknown_command_is_a_usage_error():
    proc = subprocess.run([sys.executable, "-m", "fp4pass", "frobnicate"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "invalid choice" in proc.stderr and "Traceback" not in proc.stderr
