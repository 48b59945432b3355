"""What the README, docs/ and --help examples say about their outputs holds: a report file name names one kind of
report, a documented conversion of a bundled checkpoint writes a form some engine loads (unless none does for
that family), the counts printed for the DeepSeek-V3-architecture example count what they say, and fp4pass.onnx.convert
returns what docs/usage.md says for each kind of input.

Oracles: the engine verdicts are fp4pass's encoded engine rules (tested against vLLM's own code in
tests/checkpoint/test_checkpoint_engines.py); the weights' roles come from their names; return types from ``type()``.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import onnx
import onnx_ir as ir
import pytest

from cli_helpers import run_cli

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
KIMI = ROOT / "models" / "checkpoints" / "deepseek_v3"


def _help_texts() -> list[str]:
    import argparse

    from fp4pass.cli import build_parser

    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return [parser.format_help() for parser in sub.choices.values()]


def _command_lines() -> list[tuple[str, str]]:
    """(where, line) of every ``fp4pass SUBCOMMAND ...`` line in the README, docs/ and every --help."""
    texts = [(doc.name, doc.read_text()) for doc in DOCS] + [("--help", text) for text in _help_texts()]
    found = []
    for where, text in texts:
        for line in text.splitlines():
            match = re.search(r"(?:^|\s|`)(?:\.venv/bin/)?(fp4pass \w.*)$", line.strip())
            if match:
                found.append((where, match.group(1).split("`")[0]))
    return found


def _words(line: str) -> list[str]:
    try:
        return shlex.split(line, comments=True)
    except ValueError:
        return []


def test_a_report_file_name_names_one_kind_of_report():
    """``--report NAME``: the same NAME is not a convert report in one place and a calibrate report in another
    (placeholders such as REPORT.json aside)."""
    kinds: dict[str, set[str]] = {}
    for where, line in _command_lines():
        words = _words(line)
        if "--report" not in words[:-1] or len(words) < 2:
            continue
        name = words[words.index("--report") + 1]
        if name.startswith("-") or Path(name).stem.isupper():
            continue
        kinds.setdefault(name, set()).add(f"{words[1]} ({where})")
    sources = {kind.split("(")[1].rstrip(")") for found in kinds.values() for kind in found}
    assert {"README.md", "checkpoint.md", "--help"} <= sources, kinds
    shared = {name: sorted(k) for name, k in kinds.items() if len({k.split()[0] for k in k}) > 1}
    assert shared == {}, f"one report name for different reports: {shared}"


# -- documented conversions of the bundled checkpoints --------------------------------------------------------

_CALIBRATION_FLAGS = {"--calib", "--scales", "--seq-len", "--num-samples", "--calibrator", "--rho", "--margin",
                      "--percentile", "--calib-batch-size", "--device"}


def _bundled_conversions() -> list[tuple[str, list[str]]]:
    found = []
    for where, line in _command_lines():
        words = _words(line)
        if words[1:2] == ["convert"] and len(words) > 2 and words[2].startswith("models/checkpoints/"):
            found.append((where, words[2:]))
    return found


def _as_quick_run(words: list[str], out: Path, report: Path) -> tuple[list[str], str]:
    """The same conversion (source, form, W4A4 or weight-only) without calibration or --check: a calibrated
    run's input scales become one --input-scale; returns (argv, format)."""
    argv, fmt, w4a4, i = [str(ROOT / words[0])], "modelopt", False, 1
    while i < len(words):
        word = words[i]
        if word in ("-o", "--output", "--report"):
            i += 2
            continue
        if word in _CALIBRATION_FLAGS:
            w4a4 = w4a4 or word in ("--calib", "--scales")
            i += 2
            continue
        if word == "--format":
            fmt = words[i + 1]
        if word != "--check":
            argv.append(word)
        i += 1
    argv += ["--input-scale", "0.01"] if w4a4 else []
    return ["convert", *argv, "-o", str(out), "--report", str(report)], fmt


def _loading_engines(capsys, argv: list[str], report: Path) -> list[str] | None:
    """The engines that load the output of ``fp4pass ARGV``; None when convert refuses the form."""
    code, _, err = run_cli(capsys, *argv)
    if code == 2:
        return None
    assert code == 0, err
    return [name for name, verdict in json.loads(report.read_text())["engines"].items() if verdict["loads"]]


def _other_format(argv: list[str], fmt: str) -> list[str]:
    other = "compressed-tensors" if fmt == "modelopt" else "modelopt"
    if "--format" in argv:
        argv = list(argv)
        argv[argv.index("--format") + 1] = other
        return argv
    return [*argv, "--format", other]


def test_documented_bundled_conversions_write_a_form_an_engine_loads(tmp_path, capsys):
    """Each documented ``convert models/checkpoints/...`` writes a form some engine loads; where none does, the
    other form loads nowhere either (gpt-oss: compressed-tensors is refused, ModelOpt loads nowhere yet)."""
    conversions = _bundled_conversions()
    assert {words[0] for _, words in conversions} >= {"models/checkpoints/deepseek_v3", "models/checkpoints/gpt_oss",
                                                        "models/checkpoints/deepseek"}
    wrong = []
    for n, (where, words) in enumerate(conversions):
        report = tmp_path / f"report{n}.json"
        argv, fmt = _as_quick_run(words, tmp_path / f"out{n}", report)
        if _loading_engines(capsys, argv, report):
            continue
        other = _other_format(argv, fmt)
        other[other.index("-o") + 1] = str(tmp_path / f"other{n}")
        loads = _loading_engines(capsys, other, report)
        if loads:
            wrong.append(f"{where}: {' '.join(words)} writes {fmt}, which no engine loads; the other form loads "
                         f"in {', '.join(loads)}")
    assert wrong == []


# -- counts of the DeepSeek-V3-architecture example ------------------------------------------------------------------------


def _expert_matrices(weights: list[dict]) -> int:
    """Matrices of experts, by name: a module under ``.experts.`` (one each), a stacked weight (its experts)."""
    return sum(w["experts"] for w in weights if ".experts." in w["name"] + ".")


def _expert_counts(line: str) -> list[int]:
    """The totals a line calls experts: "19/20 experts ..." gives [20]."""
    return [int(total) for total in re.findall(r"\d+/(\d+) experts", line)]


def test_kimi_counts_say_weights_where_attention_is_counted_too(tmp_path, capsys):
    """The bundled DeepSeek-V3-architecture example has 18 expert weights and 2 attention o_proj Linears in MXFP4: no count
    of all 20 may call them experts, in inspect's or convert's summary, and the README quotes inspect's line."""
    import fp4pass.checkpoint

    info = fp4pass.checkpoint.inspect(KIMI)
    assert len(info["weights"]) == 20 and _expert_matrices(info["weights"]) == 18  # the case in point
    code, out, err = run_cli(capsys, "inspect", KIMI)
    assert code == 0, err
    summary = out.strip().splitlines()[-1]
    assert all(total == 18 for total in _expert_counts(summary)), summary
    code, out, err = run_cli(capsys, "convert", KIMI, "-o", tmp_path / "out")
    assert code == 0, err
    (converted,) = [line for line in err.splitlines() if "weights converted" in line]
    assert all(total == 18 for total in _expert_counts(converted)), converted
    (comment,) = re.findall(r"fp4pass inspect models/checkpoints/deepseek_v3\s+# (.*)$", README.read_text(), flags=re.M)
    assert comment == summary


# -- fp4pass.onnx.convert's return, as docs/usage.md says it -----------------------------------------------------


def test_usage_doc_says_what_onnx_convert_returns_for_each_kind(tmp_path):
    import fp4pass.onnx

    source = ROOT / "models" / "moe.onnx"
    from_path, _ = fp4pass.onnx.convert(str(source))
    written, _ = fp4pass.onnx.convert(str(source), output=tmp_path / "moe.nvfp4.onnx")
    from_proto, _ = fp4pass.onnx.convert(onnx.load(source))
    given = ir.load(source)
    from_ir, _ = fp4pass.onnx.convert(given)
    assert isinstance(from_path, ir.Model) and isinstance(from_proto, onnx.ModelProto) and from_ir is given
    assert isinstance(written, Path) and written == tmp_path / "moe.nvfp4.onnx"

    text = " ".join((ROOT / "docs" / "usage.md").read_text().split())
    (claim,) = re.findall(r"`fp4pass\.onnx\.convert\(.*?\.(?= `fp4pass\.onnx\.diff)", text)
    assert "a path comes back as an `onnx_ir.Model`" in claim, claim
    assert "`pathlib.Path` when `output=` is given" in claim, claim
