"""Which onnxruntime distribution fp4pass installs and how it talks about the one it finds."""

import importlib.metadata
import logging
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from fp4pass.onnx import runtime

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")

PLATFORMS = {  # (platform_system, platform_machine) -> the distribution PyPI has wheels of
    ("Linux", "x86_64"): "onnxruntime-gpu",
    ("Windows", "AMD64"): "onnxruntime-gpu",
    ("Linux", "aarch64"): "onnxruntime",  # no onnxruntime-gpu wheel on PyPI for aarch64
    ("Darwin", "arm64"): "onnxruntime",
    ("Darwin", "x86_64"): "onnxruntime",  # nor for macOS
}


def _runtime_requirements():
    data = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    reqs = [Requirement(r) for r in data["project"]["dependencies"]]
    return [r for r in reqs if r.name in runtime.RUNTIME_DISTRIBUTIONS]


@pytest.mark.parametrize("system,machine", sorted(PLATFORMS))
def test_exactly_one_runtime_per_platform(system, machine):
    """The CUDA build where PyPI has a wheel of it, the CPU build elsewhere; never both, never none."""
    env = {"platform_system": system, "platform_machine": machine, "sys_platform": system.lower(),
           "python_version": "3.11", "os_name": "posix"}
    chosen = [r.name for r in _runtime_requirements() if r.marker is None or r.marker.evaluate(env)]
    assert chosen == [PLATFORMS[(system, machine)]]


def _fake_versions(monkeypatch, installed: dict):
    def version(name):
        if name in installed:
            return installed[name]
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(runtime.importlib.metadata, "version", version)


def test_no_cuda_reason_says_how_to_get_it(monkeypatch):
    _fake_versions(monkeypatch, {"onnxruntime": "1.31.0"})
    reason = runtime._no_cuda_ep_reason()
    assert "onnxruntime 1.31.0" in reason and "pip install onnxruntime-gpu" in reason
    _fake_versions(monkeypatch, {"onnxruntime-gpu": "1.31.0"})
    reason = runtime._no_cuda_ep_reason()
    assert "onnxruntime-gpu 1.31.0" in reason and "pip install" not in reason


def test_both_distributions_installed_warns_once(monkeypatch, caplog):
    _fake_versions(monkeypatch, {"onnxruntime": "1.31.0", "onnxruntime-gpu": "1.31.0"})
    runtime._warn_if_both_installed.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=runtime.logger.name):
            runtime._warn_if_both_installed()
            runtime._warn_if_both_installed()
        hits = [r for r in caplog.records if "both onnxruntime-gpu 1.31.0 and onnxruntime 1.31.0" in r.getMessage()]
        assert len(hits) == 1
    finally:
        runtime._warn_if_both_installed.cache_clear()


def test_this_machine_has_one_runtime():
    """The install (.ci/install, the README's commands) leaves exactly one onnxruntime distribution."""
    assert len(runtime.installed_runtimes()) == 1, runtime.installed_runtimes()
