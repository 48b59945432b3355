"""The README's Python snippets run as written, from a folder laid out like a fresh clone (the bundled models/),
print what the README says they print, and write nothing that git would pick up."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _snippet(heading: str) -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split(f"### {heading}", 1)[1].split("\n### ", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    return code


def _run(code: str, folder: Path) -> str:
    (folder / "models").symlink_to(ROOT / "models", target_is_directory=True)
    before = set(os.listdir(folder))
    done = subprocess.run([sys.executable, "-c", code], cwd=folder, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    for name in set(os.listdir(folder)) - before:  # what a user running it in the checkout would leave behind
        ignored = subprocess.run(["git", "check-ignore", "-q", name], cwd=ROOT)
        assert ignored.returncode == 0, f"{name} is written by the README snippet and not in .gitignore"
    return done.stdout


def test_onnx_snippet_runs_and_names_fc1(tmp_path):
    out = _run(_snippet("Python: ONNX"), tmp_path)
    readme = (ROOT / "README.md").read_text()
    fc1, y = re.search(r"`fc1`, the first product of 4-bit activations \(([\d.]+) dB; the output `y` ([\d.]+) dB\)",
                       readme).groups()
    assert f"node 'fc1' (MatMul) tensor 'h' snr {fc1} dB" in out
    assert re.search(rf"^y\s+\[256, 64\]\s+{re.escape(y)}\s", out, flags=re.M)
    assert "experts." not in out  # the alpha form's weights are not compared with the MXFP4 ones


def test_fx_snippet_runs_and_prints_what_the_readme_says(tmp_path):
    pytest.importorskip("transformers", reason="the gpt-oss extra")
    out = _run(_snippet("Python: the fx path"), tmp_path)
    assert out.splitlines()[0] == "6 5"
    snr = re.search(r"named after the fx node that computes them \(`(\w+)`\), at ([\d.]+) dB",
                    (ROOT / "README.md").read_text())
    assert re.search(rf"^{snr.group(1)}\s+\[8, 32, 256\]\s+{re.escape(snr.group(2))}\s", out, flags=re.M)
    assert (tmp_path / "tiny_gpt_oss.w4a4.onnx").is_file()
