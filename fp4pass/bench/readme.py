"""The deterministic results tables of docs/results.md, computed by the code: ``python -m fp4pass.bench.readme``.

Three tables, printed as markdown, each to be pasted under its heading in docs/results.md
(``tests/project/test_readme_tables.py`` checks that the committed file holds what this module computes):

- ``main`` (under the heading starting "The main job"): the README's first command, ``fp4pass convert
  models/tiny_gpt_oss.onnx --calib models/tiny_gpt_oss_calib.npz --check``, in the example table's columns,
  with a row for each expert that is not lossless.
- ``example`` (under the heading starting "The example model"): ``fp4pass convert models/moe.onnx --calib
  models/calib.npz --check``, i.e. method auto, TensorRT activation quantizers, ``max`` calibrator, checked
  under onnxruntime CPU on the calibration rows. One row per converted weight (16-halves kept verbatim,
  MSE against the MXFP4 weight, SNR), then one row per model output (SNR of the W4A4 model vs the original).
- ``study`` (under the heading starting "Conversion:"): :mod:`fp4pass.study`'s 27 scenarios, the MSE of each
  method against the MXFP4 tensor, auto's verbatim 16-halves and its MSE against the float tensor.

Numbers are printed with 4 significant digits (``format(x, ".4g")``; weights' MSE with 3), SNRs with 2
decimals, so the tables are stable across machines while any real change of a method shows.

    python -m fp4pass.bench.readme                 # both tables (the study takes ~10 s on CPU)
    python -m fp4pass.bench.readme --table example
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["example_rows", "main_job_rows", "study_rows", "markdown", "EXAMPLE_HEADER", "STUDY_HEADER",
           "EXAMPLE_HEADING", "MAIN_JOB_HEADING", "STUDY_HEADING", "MODELS_DIR"]

#: the example model and its calibration data
MODELS_DIR = Path(__file__).resolve().parent.parent.parent / "models"

#: the docs/results.md headings the tables sit under (the start of the heading's text)
EXAMPLE_HEADING = "The example model"
MAIN_JOB_HEADING = "The main job"
STUDY_HEADING = "Conversion:"

EXAMPLE_HEADER = ["tensor", "blocks16 verbatim", "MSE vs MXFP4", "SNR dB"]
STUDY_HEADER = ["scenario", "spread", "requant", "verbatim (midpoint)", "verbatim (search)", "hybrid", "auto",
                "auto verbatim halves", "auto MSE vs original"]
_STUDY_COLUMNS = ["requant", "verbatim_midpoint", "verbatim_search", "hybrid", "auto"]


def _g(value: float, digits: int = 4) -> str:
    return "0" if value == 0 else format(value, f".{digits}g")


def _cell(text: str) -> str:
    return text.replace("|", "&#124;")


def example_rows(model: str | Path | None = None, calib: str | Path | None = None) -> list[list[str]]:
    """The example table's rows (cells as strings) for ``model`` converted and checked with ``calib``."""
    from fp4pass.onnx import convert

    model = MODELS_DIR / "moe.onnx" if model is None else model
    calib = MODELS_DIR / "calib.npz" if calib is None else calib
    _, report = convert(str(model), calib=str(calib), calibrator="max", check=True, provider="cpu")
    rows = []
    for t in report["tensors"]:
        rows.append([f"{t['name']} {list(t['shape'])}", f"{t['blocks16_verbatim']}/{t['blocks16_total']}",
                     _g(t["mse"], 3), _snr(t)])
        groups = t.get("per_expert") or []
        if len(groups) > 1:
            rows += [[f"{t['name']} expert {g['expert']}", f"{g['blocks16_verbatim']}/{g['blocks16_total']}",
                      _g(g["mse"], 3), _snr(g)] for g in groups if not g["lossless"]]
    for o in report["check"]["outputs"]:
        snr = "identical" if o["snr_db"] is None else format(o["snr_db"], ".2f")
        rows.append([f"output `{o['name']}` (weights + 4-bit activations)", "", "", snr])
    return rows


def _snr(stats: dict) -> str:
    return "lossless" if stats["snr_db"] is None and stats["mse"] == 0 else format(stats["snr_db"], ".2f")


def main_job_rows() -> list[list[str]]:
    """The main job's rows: the tiny gpt-oss converted, calibrated and checked as the README's first command."""
    return example_rows(MODELS_DIR / "tiny_gpt_oss.onnx", MODELS_DIR / "tiny_gpt_oss_calib.npz")


def study_rows(device: str = "cpu") -> list[list[str]]:
    """The study table's rows (cells as strings), computed on ``device``."""
    from fp4pass.study import run_study

    study = run_study(device, show_progress=False)
    rows = []
    for row in study["scenarios"]:
        methods = row["methods"]
        auto = methods["auto"]
        verbatim = 100.0 * auto["blocks16_verbatim"] / auto["blocks16_total"]
        rows.append([_cell(row["name"]), str(row["spread"]), *(_g(methods[c]["mse"]) for c in _STUDY_COLUMNS),
                     f"{verbatim:.1f}%", _g(auto["mse_vs_original"])])
    return rows


def markdown(header: list[str], rows: list[list[str]]) -> str:
    """A GitHub markdown table: header, separator, one line per row."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["|" + "|".join(f" {c} " if c else " " for c in cells) + "|" for cells in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fp4pass.bench.readme",
                                     description="Print the deterministic results tables of docs/results.md as markdown.")
    parser.add_argument("--table", choices=["main", "example", "study", "all"], default="all")
    parser.add_argument("--device", default="cpu", help="device of the study (default cpu)")
    args = parser.parse_args(argv)
    blocks = []
    if args.table in ("main", "all"):
        blocks.append(f"<!-- under the heading '### {MAIN_JOB_HEADING}...' -->\n"
                      + markdown(EXAMPLE_HEADER, main_job_rows()))
    if args.table in ("example", "all"):
        blocks.append(f"<!-- under the heading '### {EXAMPLE_HEADING}...' -->\n"
                      + markdown(EXAMPLE_HEADER, example_rows()))
    if args.table in ("study", "all"):
        blocks.append(f"<!-- under the heading '### {STUDY_HEADING}...' -->\n"
                      + markdown(STUDY_HEADER, study_rows(args.device)))
    print("\n\n".join(blocks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
