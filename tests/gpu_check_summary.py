"""The summary of a tests/gpu_check.sh run: ``python tests/gpu_check_summary.py OUT_DIR`` writes OUT_DIR/summary.json.

It reads what the steps left in OUT_DIR (standard library only, so that it runs whatever the steps broke):

- ``steps.tsv``: one row per step, ``name<TAB>exit code<TAB>seconds<TAB>note``;
- ``ort.json`` (install: the carried onnxruntime-gpu's version and providers), ``env.json`` (torch, the device,
  whether onnxruntime's CUDA EP really runs and why not);
- ``pytest.xml`` (pytest's JUnit XML): counts, the failed tests, and the skip reasons with their counts;
- ``qmoe_cuda.json`` (tests/qmoe_cuda_check.py) and ``bench_*.json`` (the benches), as written.

``verdict`` is one line: "N steps passed", or the steps that did not, and "CUDA EP absent: why" when
onnxruntime's CUDA EP did not run (its tests then skipped: not a pass).
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def _json(path: Path):
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        return {"unreadable": f"{path.name}: {exc}"}


def read_steps(path: Path) -> list[dict]:
    """The rows of steps.tsv: ``{"name", "exit", "seconds", "note"}``."""
    steps = []
    if not path.is_file():
        return steps
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        name, code, seconds, note = (line.split("\t") + ["", "", ""])[:4]
        steps.append({"name": name, "exit": int(code), "seconds": int(seconds), "note": note})
    return steps


def read_junit(path: Path) -> dict | None:
    """Counts of pytest's JUnit XML, the failed tests (``module::name``) and each skip reason with its count."""
    if not path.is_file():
        return None
    root = ET.parse(path).getroot()
    counts = {"tests": 0, "passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failed, skips = [], {}
    for case in root.iter("testcase"):
        counts["tests"] += 1
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        if case.find("failure") is not None:
            counts["failed"] += 1
            failed.append(name)
        elif case.find("error") is not None:
            counts["errors"] += 1
            failed.append(name)
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
            reason = case.find("skipped").get("message", "")
            skips[reason] = skips.get(reason, 0) + 1
        else:
            counts["passed"] += 1
    return {**counts, "failed_tests": failed, "skip_reasons": skips}


def _verdict(steps: list[dict], env: dict | None) -> str:
    bad = [f"{s['name']} (exit {s['exit']}{', ' + s['note'] if s['note'] else ''})" for s in steps if s["exit"]]
    words = [f"failed: {', '.join(bad)}"] if bad else [f"{len(steps)} steps passed"]
    if env is not None and not env.get("cuda_ep", False):
        words.append(f"CUDA EP absent: {env.get('cuda_ep_reason') or 'unknown'}")
    if env is not None and not env.get("cuda_device"):
        words.append("no CUDA device for torch")
    return "; ".join(words)


def summarize(out: Path) -> dict:
    """The summary of the run whose files are in ``out`` (module docstring)."""
    steps = read_steps(out / "steps.tsv")
    env = _json(out / "env.json")
    summary = {
        "verdict": _verdict(steps, env),
        "steps": steps,
        "onnxruntime_gpu": _json(out / "ort.json"),
        "env": env,
        "pytest": read_junit(out / "pytest.xml"),
        "qmoe_cuda": _json(out / "qmoe_cuda.json"),
        "bench": {p.stem: _json(p) for p in sorted(out.glob("bench_*.json"))},
    }
    return summary


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python tests/gpu_check_summary.py OUT_DIR", file=sys.stderr)
        return 2
    out = Path(argv[0])
    summary = summarize(out)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(summary["verdict"])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
