"""A fuzz campaign over the example models: ``inspect``, ``convert`` (some with ``--check``) and ``diff`` (the
mutated model against itself, so through the lowering and onnxruntime) run in-process on seeded mutations.

Invariants, for every case (tests/support/fuzz_mutator.py lists the mutations):
1. exit code 0, 1 or 2 (3 would be a bug, anything else a crash);
2. no traceback on stderr;
3. the input folder unchanged (same files, same bytes) and nothing written outside the output folder;
4. the output folder holds the model (+ its data) and the report after exit 0, only the report after exit 1
   (a check below its threshold), and nothing otherwise: no partial file, no temporary left;
5. a model written with exit 0 loads and passes the ONNX checker (full check; with ``--allow-invalid`` an
   invalid input may give an invalid output, so only loading is required there).

Some cases run with ``--allow-invalid``: the mutated model then reaches the converter itself.

Default run: ``FP4PASS_FUZZ_CASES`` cases (300). ``-m slow``: ``FP4PASS_FUZZ_SLOW_CASES`` (5000), seeds after
the default ones. A failing seed becomes a case in ``REGRESSION_SEEDS``.

The files around a model (tests/support/fuzz_files.py: .npz calibration data and diff inputs, SCALES.json, special
files in their place, static dims of random inputs, QMoE attributes and global scales) get a campaign of their
own with the same invariants, plus: no command blocks (a FIFO is opened for writing after a minute, so a
reader stuck on it fails the case instead of hanging the suite). ``FP4PASS_FUZZ_FILE_CASES`` (24) by
default, ``FP4PASS_FUZZ_FILE_SLOW_CASES`` (600) under ``-m slow``.
"""

from __future__ import annotations

import contextlib
import io
import os
import stat
import threading
import time
import traceback

import onnx
import pytest

from fuzz_files import make_file_case
from fuzz_mutator import make_case, snapshot
from fp4pass.cli import main

DEFAULT_CASES = int(os.environ.get("FP4PASS_FUZZ_CASES", "300"))
SLOW_CASES = int(os.environ.get("FP4PASS_FUZZ_SLOW_CASES", "5000"))
CHUNK = 50
FILE_CASES = int(os.environ.get("FP4PASS_FUZZ_FILE_CASES", "24"))
FILE_SLOW_CASES = int(os.environ.get("FP4PASS_FUZZ_FILE_SLOW_CASES", "600"))
FIFO_PATIENCE_S = 60.0
# Seeds that broke an invariant before the loading checks existed (each ran into a traceback, or gave exit 0
# with an output the ONNX checker refuses); kept so that they stay fixed whatever the default count.
REGRESSION_SEEDS = [
    1, 6, 253,        # duplicate node output: onnx_ir SerdeError
    9, 21,            # non-UTF-8 name / op_type
    22, 67,           # non-UTF-8 external-data location
    24, 58,           # raw_data length that does not fit the dims
    25,               # UNDEFINED data type
    26,               # non-numeric external-data offset
    276, 289,         # external data file truncated
    36, 88, 241,      # data type changed: output refused by the checker
    56, 108,          # dangling input / misspelt op type: invalid input passed through
    495,              # attribute of type UNDEFINED (with --allow-invalid): SerdeError at save
    3082,             # STRING tensor in external data: no byte size
    4287,             # a node with no outputs (with --allow-invalid): IndexError in pattern matching
    2669,             # output_dtype 33 (with --allow-invalid): ValueError in diff's lowering
]

CONVERT_VARIANTS = (
    [],
    ["--external-data", "always"],
    ["--target", "ort", "--method", "requant"],
    ["--scale-form", "alpha", "--method", "hybrid"],
    ["--external-data", "never", "--method", "verbatim"],
    ["--allow-invalid"],
    ["--allow-invalid", "--target", "reference", "--external-data", "always"],
    ["--check", "--provider", "cpu"],
    ["--allow-invalid", "--check", "--provider", "cpu", "--method", "requant"],
)


def _run(argv):
    err = io.StringIO()
    out = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse
            code = exc.code
        except Exception:  # noqa: BLE001 - escaping main() at all is the finding
            code = "an exception escaped main()"
            err.write(traceback.format_exc())
    return code, err.getvalue()


def run_case(seed: int, root) -> list[str]:
    """Run one case under ``root``; returns the broken invariants (empty when all hold)."""
    src, out = root / "in", root / "out"
    src.mkdir()
    out.mkdir()
    model, what = make_case(seed, src)
    before_src = snapshot(src)
    before_root = sorted(os.listdir(root))
    problems = []

    def check(label, code, err, written):
        if code not in (0, 1, 2):
            problems.append(f"{what}: {label} exit {code}: {err.strip()[-300:]}")
        if "Traceback" in err:
            problems.append(f"{what}: {label} printed a traceback: {err.strip()[-300:]}")
        if snapshot(src) != before_src:
            problems.append(f"{what}: {label} changed the input folder")
        if sorted(os.listdir(root)) != before_root:
            problems.append(f"{what}: {label} wrote outside the output folder: {sorted(os.listdir(root))}")
        listing = sorted(os.listdir(out))
        # exit 1 (a check below its threshold) keeps the report that explains it, never the model
        expected = sorted(written) if code == 0 else [n for n in written if n.endswith(".json")] if code == 1 else []
        if code == 0:
            listing = [n for n in listing if n != "o.onnx.data"]
        if listing != expected:
            problems.append(f"{what}: {label} exit {code} left {sorted(os.listdir(out))}")

    allow = ["--allow-invalid"] if seed % 2 else []
    code, err = _run(["inspect", str(model), "--quiet", *allow])
    check("inspect", code, err, [])
    # the model under onnxruntime (lowering, sessions, random inputs): diff against itself
    code_diff, err_diff = _run(["diff", str(model), str(model), "--quiet", "--provider", "cpu", *allow])
    check("diff", code_diff, err_diff, [])
    variant = CONVERT_VARIANTS[seed % len(CONVERT_VARIANTS)]
    argv = ["convert", str(model), "-o", str(out / "o.onnx"), "--report", str(out / "r.json"), "--quiet", *variant]
    code, err = _run(argv)
    check("convert " + " ".join(variant), code, err, ["o.onnx", "r.json"])
    if code == 0:
        try:
            onnx.load(str(out / "o.onnx"))
            if "--allow-invalid" not in variant:  # an invalid input may give an invalid output (with a warning)
                onnx.checker.check_model(str(out / "o.onnx"), full_check=True)
        except Exception as exc:  # noqa: BLE001 - any failure to load is the finding
            problems.append(f"{what}: convert output fails to load or check: {exc}")
    return problems


def _campaign(seeds, tmp_path) -> tuple[list[str], float]:
    start = time.perf_counter()
    problems = []
    for seed in seeds:
        root = tmp_path / f"case{seed}"
        root.mkdir()
        problems += run_case(seed, root)
    return problems, time.perf_counter() - start


@pytest.mark.parametrize("first", range(0, DEFAULT_CASES, CHUNK))
def test_fuzz_default(first, tmp_path):
    problems, _ = _campaign(range(first, min(first + CHUNK, DEFAULT_CASES)), tmp_path)
    assert not problems, "\n".join(problems[:20])


@pytest.mark.parametrize("seed", REGRESSION_SEEDS)
def test_fuzz_regressions(seed, tmp_path):
    assert run_case(seed, tmp_path) == []


@pytest.mark.slow
def test_fuzz_campaign_slow(tmp_path):
    seeds = range(DEFAULT_CASES, DEFAULT_CASES + SLOW_CASES)
    problems, seconds = _campaign(seeds, tmp_path)
    print(f"\nfuzz campaign: {len(seeds)} cases in {seconds:.1f} s, {len(problems)} problems")
    assert not problems, "\n".join(problems[:30])


# -- the files around a model ------------------------------------------------------------------------------


def _unblock_fifos(folder) -> None:
    """Open every FIFO under ``folder`` for writing and close it: a reader blocked in open() gets EOF."""
    for base, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(base, name)
            if stat.S_ISFIFO(os.lstat(path).st_mode):
                with contextlib.suppress(OSError):
                    os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))


def run_file_case(seed: int, root) -> list[str]:
    """One case of tests/support/fuzz_files.py under ``root``; returns the broken invariants."""
    src, out = root / "in", root / "out"
    src.mkdir()
    out.mkdir()
    commands, outputs, what = make_file_case(seed, src)
    before_src = snapshot(src)
    problems = []
    for argv in commands:
        argv = [a.replace("{out}", str(out)) for a in argv]
        label = argv[0]
        watchdog = threading.Timer(FIFO_PATIENCE_S, _unblock_fifos, args=(src,))
        watchdog.start()
        started = time.perf_counter()
        try:
            code, err = _run(argv)
        finally:
            watchdog.cancel()
        if time.perf_counter() - started >= FIFO_PATIENCE_S:
            problems.append(f"seed {seed} {what}: {label} blocked (a FIFO had to be opened to end it)")
        if code not in (0, 1, 2):
            problems.append(f"seed {seed} {what}: {label} exit {code}: {err.strip()[-300:]}")
        if "Traceback" in err:
            problems.append(f"seed {seed} {what}: {label} printed a traceback: {err.strip()[-300:]}")
        if code == 2 and not err.strip().splitlines()[-1].startswith("fp4pass"):
            problems.append(f"seed {seed} {what}: {label} exit 2 without its one line: {err.strip()[-300:]}")
        if snapshot(src) != before_src:
            problems.append(f"seed {seed} {what}: {label} changed the input folder")
        listing = sorted(os.listdir(out))
        allowed = sorted(n for n in outputs if n in listing) if code == 0 else []
        if [n for n in listing if n != "o.onnx.data"] != allowed:
            problems.append(f"seed {seed} {what}: {label} exit {code} left {listing}")
        if code == 0 and "o.onnx" in listing:
            try:
                onnx.checker.check_model(str(out / "o.onnx"), full_check=True)
            except Exception as exc:  # noqa: BLE001 - any failure to check is the finding
                problems.append(f"seed {seed} {what}: {label} output fails the ONNX checker: {exc}")
        for name in os.listdir(out):
            os.remove(out / name)
    return problems


def _file_campaign(seeds, tmp_path) -> list[str]:
    problems = []
    for seed in seeds:
        root = tmp_path / f"file{seed}"
        root.mkdir()
        problems += run_file_case(seed, root)
    return problems


def test_fuzz_files_default(tmp_path):
    problems = _file_campaign(range(FILE_CASES), tmp_path)
    assert not problems, "\n".join(problems[:20])


@pytest.mark.slow
def test_fuzz_files_slow(tmp_path):
    start = time.perf_counter()
    problems = _file_campaign(range(FILE_CASES, FILE_CASES + FILE_SLOW_CASES), tmp_path)
    print(f"\nfile fuzz campaign: {FILE_SLOW_CASES} cases in {time.perf_counter() - start:.1f} s, "
          f"{len(problems)} problems")
    assert not problems, "\n".join(problems[:30])
