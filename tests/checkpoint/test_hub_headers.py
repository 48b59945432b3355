"""``fp4pass inspect ORG/NAME`` of a model that is not cached reads its configs and its shards' headers only.

Against a Hub on this machine (tests/support/hub_server.py: the Hub's file API, range requests, its error codes) and
huggingface_hub's own client code: the bytes served of the shards stay under 1% of their size, every shard
request is a range request, nothing of the shards lands in the cache, and what inspect reports agrees with
the folder's own headers read by the ``safetensors`` package.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import fp4pass.checkpoint
from cli_helpers import cli, one_line, run_cli
from hub_server import HubServer

safetensors = pytest.importorskip("safetensors")

ROOT = Path(__file__).resolve().parents[2]
COMMIT = "c3" * 20
LAYERS, EXPERTS, HIDDEN = 2, 6, 1024


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """Start a loopback Hub for the repositories a test adds (``hub.repos``); an empty cache; online."""
    from huggingface_hub import constants

    cache = tmp_path / "hub-cache"
    cache.mkdir()
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    with HubServer({}) as server:
        monkeypatch.setattr(constants, "ENDPOINT", server.endpoint)  # as HF_ENDPOINT set before the import makes them
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", server.endpoint + "/{repo_id}/resolve/{revision}/{filename}")
        monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
        server.cache = cache
        yield server


@pytest.fixture(scope="module")
def big_mxfp4(tmp_path_factory):
    """A compressed-tensors MXFP4 checkpoint of 2 layers x 6 experts at hidden 1024, in shards of 16 MB (huggingface_hub asks 100 kB of each)."""
    from fp4pass.examples.checkpoints import build_checkpoint

    return build_checkpoint(tmp_path_factory.mktemp("big") / "src", "compressed-tensors", layers=LAYERS,
                            experts=EXPERTS, hidden=HIDDEN, intermediate=HIDDEN, shard_bytes=16 << 20)


def _headers(folder: Path) -> dict[str, tuple[str, list[int]]]:
    """name -> (dtype, shape) of every tensor, by the safetensors package's own reader."""
    out = {}
    for shard in sorted(folder.glob("*.safetensors")):
        with safetensors.safe_open(str(shard), framework="pt") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                out[name] = (sl.get_dtype(), list(sl.get_shape()))
    return out


def test_an_uncached_mxfp4_model_is_inspected_from_its_headers(hub, big_mxfp4, capsys):
    hub.repos["acme/big"] = (big_mxfp4, COMMIT)
    code, out, err = run_cli(capsys, "inspect", "acme/big", "--json")
    assert code == 0, err
    info = json.loads(out)
    assert info["headers_only"] is True and info["precision"] == "mxfp4"
    assert info["summary"]["experts_lossless_forecast"] is None and "forecast" in info["not_read"]
    headers = _headers(big_mxfp4)
    modules = sorted(n[: -len(".weight_packed")] for n, (dtype, _) in headers.items()
                     if n.endswith(".weight_packed") and headers[n.replace("weight_packed", "weight_scale")][0] == "U8")
    assert len(modules) == LAYERS * EXPERTS * 3
    assert sorted(w["name"] for w in info["weights"]) == modules
    for w in info["weights"]:
        rows, half = headers[w["name"] + ".weight_packed"][1]
        assert w["shape"] == [rows, 2 * half] and w["experts"] == 1 and w["form"] == "compressed-tensors"
    assert sorted(info["copied"]) == sorted(n for n in headers if n.rpartition(".")[0] not in set(modules))

    shards = {p.name: p.stat().st_size for p in big_mxfp4.glob("*.safetensors")}
    assert len(shards) >= 3
    served = sum(hub.served.get(name, 0) for name in shards)
    assert served < 0.01 * sum(shards.values()), (served, sum(shards.values()))
    shard_gets = [r for r in hub.requests if r[0] == "GET" and r[1].rsplit("/", 1)[-1] in shards]
    assert shard_gets and all(r[2] for r in shard_gets), shard_gets  # every shard read is a range request
    assert not list(hub.cache.rglob("*.safetensors"))  # no shard written into the cache


def test_the_table_says_headers_only_and_how_to_get_the_forecast(hub, big_mxfp4, capsys):
    hub.repos["acme/big"] = (big_mxfp4, COMMIT)
    code, out, err = run_cli(capsys, "inspect", f"acme/big@{COMMIT}")
    assert code == 0, err
    lines = out.strip().splitlines()
    assert lines[0].startswith(f"acme/big@{COMMIT}: headers only") and "compressed-tensors" in lines[0]
    assert f"hf download acme/big --revision {COMMIT}" in lines[-1] and "forecast" in lines[-1]
    assert sum("compressed-tensors" in line for line in lines[2:-2]) == LAYERS * EXPERTS * 3


def test_an_uncached_nvfp4_model_gets_the_engines_verdicts_of_the_local_folder(hub, tmp_path, capsys):
    out_dir = tmp_path / "nvfp4"
    fp4pass.checkpoint.convert(ROOT / "models" / "checkpoints" / "deepseek_v3", out_dir, format="compressed-tensors")
    hub.repos["acme/nvfp4"] = (out_dir, COMMIT)
    code, out, err = run_cli(capsys, "inspect", "acme/nvfp4", "--json")
    assert code == 0, err
    info = json.loads(out)
    local = fp4pass.checkpoint.inspect(out_dir)  # the folder itself, every rule: its verdicts are the same
    assert info["precision"] == "nvfp4"
    assert info["engines"] == {e: {k: v[k] for k in ("loads", "mode", "why")} for e, v in local["engines"].items()}
    assert info["engines"]["vllm"]["loads"] and not info["engines"]["trtllm"]["loads"]
    code, _, err = run_cli(capsys, "inspect", "acme/nvfp4", "--engine", "trtllm")
    assert code == 1, err
    code, _, err = run_cli(capsys, "inspect", "acme/nvfp4", "--engine", "vllm")
    assert code == 0, err


def test_a_model_the_hub_does_not_have_is_exit_2_in_one_line(hub, capsys):
    code, err = cli(capsys, "inspect", "acme/absent")
    line = one_line(err)
    assert code == 2 and "acme/absent" in line and "no such model on the Hugging Face Hub" in line, line


def test_a_flag_that_needs_the_files_is_refused_for_an_uncached_model(hub, big_mxfp4, capsys):
    hub.repos["acme/big"] = (big_mxfp4, COMMIT)
    code, err = cli(capsys, "inspect", "acme/big", "--follow-symlinks")
    line = one_line(err)
    assert code == 2 and "--follow-symlinks" in line and "hf download" in line, line
    assert not hub.requests


def test_a_partly_cached_model_is_inspected_from_its_headers_and_a_whole_one_from_the_cache(hub, tmp_path, capsys):
    """A cached snapshot that lacks a shard is no local copy (headers from the Hub); a complete one is inspected
    from the cache in full (the forecast), without asking the Hub."""
    src = ROOT / "models" / "checkpoints" / "deepseek_v3"
    hub.repos["acme/tiny"] = (src, COMMIT)
    repo = hub.cache / "models--acme--tiny"
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    (snapshot / "config.json").write_bytes((src / "config.json").read_bytes())
    code, out, err = run_cli(capsys, "inspect", "acme/tiny", "--json")
    assert code == 0, err
    assert json.loads(out)["headers_only"] is True
    for file in src.iterdir():
        if file.is_file():
            (snapshot / file.name).write_bytes(file.read_bytes())
    hub.requests.clear()
    code, out, err = run_cli(capsys, "inspect", "acme/tiny", "--json")
    assert code == 0, err
    info = json.loads(out)
    assert "headers_only" not in info and info["summary"]["experts_lossless_forecast"] > 0
    assert not hub.requests
