"""The README's commands and Python snippets run as written, in a fresh shell, from a folder laid out like a fresh
clone after the install (the bundled models/ and .venv/), print what the README says they print, and write
nothing that git would pick up. docs/usage.md's command table names every flag the commands have.

What git would pick up is asked of git itself, in a scratch repository holding only the project's .gitignore
(``_untracked``): no ``.git`` of the project is needed, so the suite runs the same in a copy without one.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
USAGE = ROOT / "docs" / "usage.md"
INSTALL = "bash .ci/install && "


def _section(text: str, heading: str) -> str:
    """The text under the markdown heading that starts with ``heading`` (any level), up to the next heading of
    the same or a higher level (a ``#`` line inside a code block is no heading)."""
    lines = text.splitlines(keepends=True)
    start = level = None
    fenced = False
    for i, line in enumerate(lines):
        if line.startswith("```"):
            fenced = not fenced
        if fenced or not line.startswith("#"):
            continue
        hashes = len(line) - len(line.lstrip("#"))
        if start is None and line[hashes:].strip().startswith(heading):
            start, level = i + 1, hashes
        elif start is not None and hashes <= level:
            return "".join(lines[start:i])
    assert start is not None, f"no heading {heading!r}"
    return "".join(lines[start:])


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def _snippet(heading: str) -> str:
    (code,) = _blocks(_section(README.read_text(), heading), "python")
    return code


def _commands(block: str) -> list[str]:
    """The command lines of a bash block, as written, their trailing comments dropped."""
    lines = [re.sub(r"\s+#\s.*$", "", line).strip() for line in block.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def _venv() -> Path:
    """The virtual environment these tests run in (what ``bash .ci/install`` made as ./.venv)."""
    if sys.prefix == sys.base_prefix or not (Path(sys.prefix) / "bin" / "fp4pass").exists():
        pytest.skip("not running inside a virtual environment with fp4pass installed (bash .ci/install)")
    return Path(sys.prefix)


def _clone_like(folder: Path) -> Path:
    """A folder with what a fresh clone holds after ``bash .ci/install`` that the examples read."""
    folder.mkdir(exist_ok=True)
    (folder / "models").symlink_to(ROOT / "models", target_is_directory=True)
    (folder / ".venv").symlink_to(_venv(), target_is_directory=True)
    return folder


def _fresh_shell_env() -> dict:
    """The environment of a new shell: no virtual environment activated, the venv's bin/ not on PATH. Only
    PYTHONPATH names this tree, so that a copy of the project (a mutation run) runs its own code rather than
    the checkout the venv's editable install points to."""
    venv_bin = str(_venv() / "bin")
    path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep)
                           if p and os.path.realpath(p) != os.path.realpath(venv_bin))
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    return {**env, "PATH": path, "PYTHONPATH": str(ROOT)}


def _untracked(paths: list[str], scratch: Path) -> list[str]:
    """The relative ``paths`` (a trailing / for a folder) that git would list as untracked in a checkout of this
    project, asked of git in a scratch repository that holds only the project's .gitignore."""
    git = shutil.which("git")
    if git is None:
        pytest.skip("git is not installed: no oracle for .gitignore")
    scratch.mkdir()
    subprocess.run([git, "init", "-q"], cwd=scratch, check=True)
    shutil.copy(ROOT / ".gitignore", scratch / ".gitignore")
    for rel in paths:
        target = scratch / rel.rstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        if rel.endswith("/"):
            target.mkdir(exist_ok=True)
            (target / "model.safetensors").write_bytes(b"")  # git lists files, not empty folders
        else:
            target.write_bytes(b"")
    status = subprocess.run([git, "status", "--porcelain", "--untracked-files=all"], cwd=scratch, check=True,
                            capture_output=True, text=True).stdout.splitlines()
    return [line[3:] for line in status if line[3:] != ".gitignore"]


def _written(folder: Path, before: set[str]) -> list[str]:
    new = []
    for name in sorted(set(os.listdir(folder)) - before):
        new.append(name + "/" if (folder / name).is_dir() else name)
    return new


def _run_python(code: str, folder: Path) -> subprocess.CompletedProcess:
    _clone_like(folder)
    before = set(os.listdir(folder))
    done = subprocess.run([str(folder / ".venv" / "bin" / "python"), "-c", code], cwd=folder, capture_output=True,
                          text=True, timeout=900, env=_fresh_shell_env())
    assert done.returncode == 0, done.stderr[-3000:]
    assert _untracked(_written(folder, before), folder.parent / "git-oracle") == []
    return done


def test_the_git_oracle_sees_what_is_not_ignored(tmp_path):
    """The oracle itself: an ignored name is not listed, a name .gitignore does not cover is."""
    assert _untracked(["tiny_gpt_oss.nvfp4.onnx", "deepseek-v3-nvfp4/", "notes.txt", "models.json"], tmp_path / "o") == \
        ["models.json", "notes.txt"]


def test_onnx_snippet_runs_and_names_fc1(tmp_path):
    out = _run_python(_snippet("Python: ONNX"), tmp_path / "clone").stdout
    readme = README.read_text()
    fc1, y = re.search(r"`fc1`, the first product of 4-bit activations \(([\d.]+) dB; the output `y` ([\d.]+) dB\)",
                       readme).groups()
    assert f"node 'fc1' (MatMul) tensor 'h' snr {fc1} dB" in out
    assert re.search(rf"^y\s+\[256, 64\]\s+{re.escape(y)}\s", out, flags=re.M)
    # the alpha form's weights are not compared with the MXFP4 ones (no row), and the note says so on the terminal
    assert not re.search(r"^experts\.", out, flags=re.M)
    assert re.search(r"^note: intermediates \['experts\.w1_dq', 'experts\.w1_t'\] not compared: .*\(alpha form;", out,
                     flags=re.M), out


def test_fx_snippet_runs_quietly_and_prints_what_the_readme_says(tmp_path):
    pytest.importorskip("transformers", reason="the gpt-oss extra")
    done = _run_python(_snippet("Python: the fx path"), tmp_path / "clone")
    out = done.stdout
    assert out.splitlines()[0] == "6 5"
    snr = re.search(r"named after the fx node that computes them\s+\(`(\w+)`\), at ([\d.]+) dB", README.read_text())
    assert re.search(rf"^{snr.group(1)}\s+\[8, 32, 256\]\s+{re.escape(snr.group(2))}\s", out, flags=re.M)
    assert (tmp_path / "clone" / "tiny_gpt_oss.w4a4.onnx").is_file()
    # torch's own chatter, which says nothing about the user's model, stays out of their terminal
    assert "LeafSpec" not in done.stderr and "torchvision is not installed" not in done.stderr, done.stderr[-2000:]


# -- the shell commands --------------------------------------------------------------------------------------


def _fresh_machine_commands() -> list[str]:
    blocks = _blocks(_section(README.read_text(), "On a fresh machine"), "bash")
    assert len(blocks) == 2, "two commands for a fresh machine: the main job, the tests"
    return [_commands(b)[0] for b in blocks]


def test_fresh_machine_commands_install_then_run_the_main_job_and_cis_tests():
    main_job, tests = _fresh_machine_commands()
    assert main_job.startswith(INSTALL + ".venv/bin/fp4pass convert models/tiny_gpt_oss.onnx ")
    assert "--calib" in main_job and "--check" in main_job
    # .ci/run runs exactly the README's test command after the same install
    ci_run = (ROOT / ".ci" / "run").read_text()
    assert "bash .ci/install" in ci_run
    assert tests.removeprefix(INSTALL) in [line.strip() for line in ci_run.splitlines()]


def _shell_blocks() -> list[str]:
    """The README's bash blocks after "On a fresh machine": each runs as written, in order, in one folder."""
    text = README.read_text()
    rest = text.split("## On a fresh machine", 1)[1]
    rest = rest.split("\n## ", 1)[1]  # the sections after it
    return _blocks(rest, "bash")


def _run_shell(lines: list[str], folder: Path) -> None:
    for line in lines:
        assert line.split()[0].startswith(".venv/bin/"), f"{line!r}: run it through the venv's own programs"
    before = set(os.listdir(folder))
    done = subprocess.run(["bash", "-e", "-c", "\n".join(lines)], cwd=folder, capture_output=True, text=True,
                          timeout=900, env=_fresh_shell_env())
    assert done.returncode == 0, f"{lines}\n{done.stderr[-3000:]}"
    assert _untracked(_written(folder, before), folder.parent / "git-oracle") == []


def _calibrates(line: str) -> bool:
    return " calibrate " in line or " --calib " in line or " --scales " in line


def test_readme_commands_run_as_written_in_a_fresh_shell(tmp_path):
    """Every bash block of the sections after "On a fresh machine" (ONNX files, checkpoint folders), with no
    venv activated: exit 0, and whatever they write is ignored by git. Checkpoint calibration runs
    transformers layer by layer (tens of seconds on 2 loaded cores): its lines run under ``-m slow``, with all
    the others again, in order."""
    pytest.importorskip("compressed_tensors", reason="the checkpoint extra (--check)")
    lines = [line for block in _shell_blocks() for line in _commands(block)]
    assert any(" convert models/checkpoints/" in line for line in lines)
    assert not any("/tmp/" in line for line in lines), "fixed /tmp paths collide between users and runs"
    quick = [line for line in lines if not _calibrates(line) or " --calib models/calib.npz" in line]
    _run_shell(quick, _clone_like(tmp_path / "clone"))


@pytest.mark.slow
def test_every_readme_command_runs_as_written_in_a_fresh_shell(tmp_path):
    """The main job (after its install) and every later block, checkpoint calibration included, in order."""
    main_job, _ = _fresh_machine_commands()
    lines = [main_job.removeprefix(INSTALL)] + [line for block in _shell_blocks() for line in _commands(block)]
    _run_shell(lines, _clone_like(tmp_path / "clone"))


def test_readme_stays_short():
    """What it is, the two commands, one example per front door and links: the rest lives in docs/."""
    lines = README.read_text().splitlines()
    assert len(lines) < 150, f"README.md has {len(lines)} lines; move reference material into docs/"
    for door in ("## ONNX files", "### Python: the fx path", "## Checkpoint folders"):
        assert any(line.startswith(door) for line in lines), door


# -- what --help and the docs name --------------------------------------------------------------------------


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    from fp4pass.cli import build_parser

    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


_OUTPUT_FLAGS = ("-o", "--output", "--report", "--json", "--plot")


def _outputs_of(line: str) -> list[str]:
    """The files and folders an example command line writes in the working folder (a trailing / for a
    folder: convert's OUT when IN is not an .onnx file)."""
    if not line.startswith(("fp4pass ", ".venv/bin/fp4pass ")):
        return []
    words = shlex.split(line, comments=True)
    out = []
    for i, word in enumerate(words[:-1]):
        if word in _OUTPUT_FLAGS or word == ">":
            target = words[i + 1]
            if target.startswith(("-", ">")) or "/" in target.rstrip("/"):
                continue  # a flag (--json alone on inspect), or a path outside the working folder
            folder = word in ("-o", "--output") and "convert" in words and not words[words.index("convert") + 1]\
                .endswith(".onnx") and not target.endswith(".onnx")
            out.append(target.rstrip("/") + ("/" if folder else ""))
    return out


def test_outputs_named_by_the_examples_are_ignored(tmp_path):
    """Every file or folder an example writes in the working folder (README, docs/usage.md, every command's
    --help) is ignored by git: a user who runs them in the checkout gets a clean ``git status``."""
    texts = [README.read_text(), USAGE.read_text()]
    texts += [p.format_help() for p in _subparsers().values()]
    lines = [line.strip().removeprefix(INSTALL) for text in texts for line in text.splitlines()]
    outputs = sorted({o for line in lines for o in _outputs_of(line)})
    assert {"deepseek-v3-report.json", "deepseek-v3-nvfp4/", "report.json", "moe.nvfp4.onnx", "bench.json"} <= set(outputs)
    assert _untracked(outputs, tmp_path / "oracle") == []


def test_usage_table_lists_every_flag_of_every_command():
    """docs/usage.md's command table names each command's flags (those of every command aside: -h, --debug,
    --quiet, -v)."""
    section = _section(USAGE.read_text(), "Command line")
    rows = [line for line in section.splitlines() if line.startswith("| `fp4pass ")]
    common = {"-h", "--help", "--debug", "--quiet", "-v", "--verbose"}
    missing = []
    for name, parser in _subparsers().items():
        cells = " ".join(re.split(r"(?<!\\)\|", row)[1] for row in rows if row.startswith(f"| `fp4pass {name} "))
        assert cells, f"docs/usage.md's command table has no row for fp4pass {name}"
        for action in parser._actions:
            flags = [f for f in action.option_strings if f not in common]
            if flags and not any(re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", cells) for f in flags):
                missing.append(f"{name} {flags[-1]}")
    assert missing == [], f"flags missing from docs/usage.md's command table: {missing}"


def test_docs_links_resolve():
    """Every relative markdown link of the README and docs/ names a file that exists."""
    broken = []
    for doc in [README, *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if "://" not in target and not (doc.parent / target).exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
    assert broken == []


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
