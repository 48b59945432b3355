"""tests/gpu_check.sh without a GPU: its install step against a fake onnxruntime-gpu carried in parts (joined,
checked against SHA256SUMS, installed into its own folder put first on PYTHONPATH, preload_dlls() called), and
the summary it writes (tests/gpu_check_summary.py) from real pytest JUnit XML."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "gpu_check.sh"
WHEEL = "onnxruntime_gpu-1.31.1-py3-none-any.whl"

sys.path.insert(0, str(ROOT / "tests"))
import gpu_check_summary  # noqa: E402

FAKE_ORT = textwrap.dedent('''\
    """A stand-in for onnxruntime-gpu: says which file it is and that preload_dlls ran."""
    __version__ = "1.31.1-fake"
    preloaded = []

    def preload_dlls():
        preloaded.append(True)
        print("fake onnxruntime: preload_dlls called")

    def get_available_providers():
        return ["CUDAExecutionProvider", "CPUExecutionProvider"] if preloaded else ["CPUExecutionProvider"]
    ''')


def _fake_wheel(path: Path) -> bytes:
    """A wheel of a fake ``onnxruntime`` package (pip installs it offline), padded so that it splits in parts."""
    files = {"onnxruntime/__init__.py": FAKE_ORT, "onnxruntime/padding.txt": "0123456789abcdef" * 4096,
             "onnxruntime_gpu-1.31.1.dist-info/METADATA": "Metadata-Version: 2.1\nName: onnxruntime-gpu\n"
                                                          "Version: 1.31.1\n",
             "onnxruntime_gpu-1.31.1.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                                       "Tag: py3-none-any\n"}
    record = "".join(f"{name},,\n" for name in files) + "onnxruntime_gpu-1.31.1.dist-info/RECORD,,\n"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as wheel:
        for name, text in files.items():
            wheel.writestr(name, text)
        wheel.writestr("onnxruntime_gpu-1.31.1.dist-info/RECORD", record)
    return path.read_bytes()


@pytest.fixture
def parts(tmp_path) -> Path:
    """A folder as the carrying leaves it: part-00 .. part-02 of the wheel, NAME, SHA256SUMS ("hash  name")."""
    folder = tmp_path / "ort-gpu"
    folder.mkdir()
    data = _fake_wheel(tmp_path / WHEEL)
    size = len(data) // 3 + 1
    for i in range(3):
        (folder / f"part-{i:02d}").write_bytes(data[i * size:(i + 1) * size])
    (folder / "NAME").write_text(WHEEL + "\n")
    (folder / "SHA256SUMS").write_text(f"{hashlib.sha256(data).hexdigest()}  {WHEEL}\n")
    return folder


def _run(out: Path, parts: Path, site: Path, steps: str = "install", **env_vars) -> subprocess.CompletedProcess:
    env = {**os.environ, "FP4PASS_ORT_PARTS": str(parts), "FP4PASS_ORT_SITE": str(site),
           "FP4PASS_GPU_CHECK_STEPS": steps, "PYTHON": sys.executable, **env_vars}
    env.pop("PYTHONPATH", None)
    return subprocess.run(["bash", str(SCRIPT), str(out)], capture_output=True, text=True, env=env, timeout=300)


def test_install_joins_checks_and_installs_the_carried_wheel_first_on_the_path(parts, tmp_path):
    out, site = tmp_path / "out", tmp_path / "site"
    run = _run(out, parts, site)
    assert run.returncode == 0, run.stdout + run.stderr
    assert (site / "onnxruntime" / "__init__.py").read_text() == FAKE_ORT
    ort = json.loads((out / "ort.json").read_text())
    assert ort["version"] == "1.31.1-fake"  # the carried package was imported, not the venv's onnxruntime
    assert ort["file"] == str(site / "onnxruntime" / "__init__.py")
    assert ort["providers"][0] == "CUDAExecutionProvider"  # preload_dlls ran before the providers were read
    assert "fake onnxruntime: preload_dlls called" in (out / "gpu_check.log").read_text()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == [{"name": "install", "exit": 0, "seconds": summary["steps"][0]["seconds"],
                                 "note": f"onnxruntime-gpu from {WHEEL}"}]
    assert summary["onnxruntime_gpu"]["version"] == "1.31.1-fake" and summary["verdict"] == "1 steps passed"
    assert "gpu_check: install: exit 0" in run.stdout


def test_the_installed_wheel_is_what_later_steps_import(parts, tmp_path):
    """The env step runs after install with the carried package first on PYTHONPATH, and preloads its libraries
    too; the fake one cannot make sessions, so fp4pass's probe says the CUDA EP is absent, and why."""
    out, site = tmp_path / "out", tmp_path / "site"
    run = _run(out, parts, site, steps="install,env")
    assert run.returncode == 0, run.stdout + run.stderr
    env = json.loads((out / "env.json").read_text())
    assert env["onnxruntime_file"] == str(site / "onnxruntime" / "__init__.py")
    assert env["onnxruntime"] == "1.31.1-fake" and env["available_providers"][0] == "CUDAExecutionProvider"
    assert env["cuda_ep"] is False and "probe failed" in env["cuda_ep_reason"]
    assert "fake onnxruntime: preload_dlls called" in (out / "gpu_check.log").read_text().split("=== env:")[1]
    summary = json.loads((out / "summary.json").read_text())
    assert "CUDA EP absent: fp4pass's probe failed" in summary["verdict"]


def test_a_damaged_part_stops_it_with_one_clear_line_and_installs_nothing(parts, tmp_path):
    damaged = bytearray((parts / "part-01").read_bytes())
    damaged[100] ^= 0xFF
    (parts / "part-01").write_bytes(bytes(damaged))
    out, site = tmp_path / "out", tmp_path / "site"
    run = _run(out, parts, site, steps="install,env")
    assert run.returncode == 2
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "does not match SHA256SUMS" in lines[0] and WHEEL in lines[0], run.stderr
    assert not site.exists()
    summary = json.loads((out / "summary.json").read_text())
    assert [s["name"] for s in summary["steps"]] == ["install"]  # the later steps did not run
    assert summary["verdict"].startswith("failed: install (exit 2")


def test_a_missing_part_list_or_checksum_file_is_refused(parts, tmp_path):
    (parts / "SHA256SUMS").unlink()
    run = _run(tmp_path / "out", parts, tmp_path / "site")
    assert run.returncode == 2 and "SHA256SUMS missing" in run.stderr
    for part in parts.glob("part-*"):
        part.unlink()
    run = _run(tmp_path / "out2", parts, tmp_path / "site")
    assert run.returncode == 2 and "no part-* files" in run.stderr


def test_a_name_that_is_not_a_bare_wheel_name_is_refused(parts, tmp_path):
    (parts / "NAME").write_text("../../elsewhere.whl\n")
    run = _run(tmp_path / "out", parts, tmp_path / "site")
    assert run.returncode == 2 and "not a bare file name" in run.stderr
    assert not (tmp_path / "elsewhere.whl").exists()


def test_without_carried_parts_it_says_the_cuda_ep_may_be_absent(tmp_path):
    run = _run(tmp_path / "out", tmp_path / "nothing-here", tmp_path / "site")
    assert run.returncode == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert "CUDA EP absent unless already installed" in summary["steps"][0]["note"]
    assert summary["onnxruntime_gpu"] is None


def test_a_step_past_the_runs_time_budget_is_recorded_as_not_run(tmp_path):
    run = _run(tmp_path / "out", tmp_path / "nothing-here", tmp_path / "site", steps="install,env",
               FP4PASS_GPU_CHECK_SECONDS="5")
    assert run.returncode == 1
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["steps"][1] == {"name": "env", "exit": 124, "seconds": 0,
                                   "note": "not run: the run's 5 s were spent"}
    assert not (tmp_path / "out" / "env.json").exists()


def test_usage_without_an_output_folder():
    run = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=30)
    assert run.returncode == 2 and run.stderr.startswith("usage: tests/gpu_check.sh OUT_DIR")


def _junit(tmp_path: Path) -> Path:
    """pytest's own JUnit XML of 1 pass, 1 failure, 2 skips with one reason and 1 with another."""
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "test_sample.py").write_text(textwrap.dedent('''\
        import pytest

        def test_passes():
            pass

        def test_fails():
            assert 1 == 2

        @pytest.mark.parametrize("i", [1, 2])
        def test_needs_a_gpu(i):
            pytest.skip("needs onnxruntime's CUDA execution provider; none here")

        def test_other_skip():
            pytest.skip("slow")
        '''))
    xml = tmp_path / "pytest.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--junitxml", str(xml),
                    str(tmp_path / "t")], capture_output=True, timeout=120, cwd=tmp_path)
    return xml


def test_summary_counts_tests_names_failures_and_groups_skip_reasons(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    _junit(tmp_path).rename(out / "pytest.xml")
    (out / "steps.tsv").write_text("install\t0\t3\tonnxruntime-gpu from x.whl\nenv\t0\t5\t\n"
                                   "pytest\t1\t40\t\nbench\t124\t240\tstopped after 240 s\n")
    (out / "env.json").write_text(json.dumps({"cuda_ep": False, "cuda_device": "NVIDIA H200",
                                              "cuda_ep_reason": "the CUDA execution provider did not load"}))
    (out / "bench_calibrate.json").write_text(json.dumps({"results": [{"name": "calibrate-checkpoint"}]}))
    assert gpu_check_summary.main([str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["pytest"] == {
        "tests": 5, "passed": 1, "failed": 1, "errors": 0, "skipped": 3, "failed_tests": ["t.test_sample::test_fails"],
        "skip_reasons": {"needs onnxruntime's CUDA execution provider; none here": 2, "slow": 1}}
    assert summary["verdict"] == ("failed: pytest (exit 1), bench (exit 124, stopped after 240 s); "
                                  "CUDA EP absent: the CUDA execution provider did not load")
    assert summary["steps"][3] == {"name": "bench", "exit": 124, "seconds": 240, "note": "stopped after 240 s"}
    assert summary["bench"] == {"bench_calibrate": {"results": [{"name": "calibrate-checkpoint"}]}}
    assert summary["qmoe_cuda"] is None
