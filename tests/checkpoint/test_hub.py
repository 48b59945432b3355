"""Hugging Face Hub model IDs where a checkpoint folder is taken: resolved from a cache folder laid out as
huggingface_hub lays it (``models--org--name/blobs/<hash>``, ``snapshots/<commit>/FILE -> ../../blobs/<hash>``,
``refs/<branch or tag>``), offline. No test reaches the network: every socket connection outside this machine
fails the test (``no_network``).

Oracles: the same bundled folder read or converted from its own path; huggingface_hub's own pattern filter for
the files fetched; huggingface_hub's own errors for the Hub that cannot be reached.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import sys
from pathlib import Path

import pytest

import fp4pass.checkpoint
from cli_helpers import cli, one_line
from fp4pass.safetensors import hub
from fp4pass.safetensors.hub import HUB_FILES, HUB_IGNORED, HubError, parse_hub_id, resolve_checkpoint

safetensors_torch = pytest.importorskip("safetensors.torch")

ROOT = Path(__file__).resolve().parents[2]
KIMI, GPT_OSS, DEEPSEEK = (ROOT / "models" / "checkpoints" / name for name in ("deepseek_v3", "gpt_oss", "deepseek"))
COMMIT_A, COMMIT_B = "a1" * 20, "b2" * 20


def add_snapshot(cache: Path, repo_id: str, source: Path, commit: str, refs=("main",), skip=()) -> Path:
    """Put the files of ``source`` into ``cache`` as snapshot ``commit`` of ``repo_id`` (blobs named by their
    sha256, as huggingface_hub names LFS blobs), each ref in ``refs`` pointing at it; the snapshot folder."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True)
    for file in sorted(source.iterdir()):
        if file.name in skip:
            continue
        data = file.read_bytes()
        blob = hashlib.sha256(data).hexdigest()
        (repo / "blobs" / blob).write_bytes(data)
        (snapshot / file.name).symlink_to(Path("..") / ".." / "blobs" / blob)
    for ref in refs:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)  # no newline: huggingface_hub reads it whole
    return snapshot


@pytest.fixture
def no_network(monkeypatch):
    """Any connection beyond this machine fails the test."""
    real = socket.socket.connect

    def connect(self, address):
        host = address[0] if isinstance(address, tuple) else address
        if isinstance(host, str) and host not in ("127.0.0.1", "::1", "localhost") and self.family != socket.AF_UNIX:
            pytest.fail(f"a test reached for the network: {address}")
        return real(self, address)

    monkeypatch.setattr(socket.socket, "connect", connect)


@pytest.fixture
def cache(tmp_path, monkeypatch, no_network) -> Path:
    """An empty Hub cache, named by HF_HUB_CACHE, offline."""
    folder = tmp_path / "hub-cache"
    folder.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(folder))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return folder


def _tensors(folder: Path) -> dict:
    out = {}
    for shard in sorted(folder.glob("*.safetensors")):
        out.update(safetensors_torch.load_file(shard))
    return out


# -- what is taken for a Hub ID ------------------------------------------------------------------------------


@pytest.mark.parametrize("text, expected", [
    ("openai/gpt-oss-20b", ("openai/gpt-oss-20b", None)),
    ("moonshotai/Kimi-K2.5@main", ("moonshotai/Kimi-K2.5", "main")),
    ("org/name@v1.0", ("org/name", "v1.0")),
    ("org/name@refs/pr/12", ("org/name", "refs/pr/12")),
    (f"org/name@{COMMIT_B}", ("org/name", COMMIT_B)),
    ("gpt-oss-20b", None),                   # a folder name: no organisation
    ("models/checkpoints/deepseek_v3", None),       # a path of three parts
    ("models/moe.onnx", None),               # a file
    ("data/calib.npz", None),
    ("/abs/org", None), ("./org/name", None), ("../org/name", None), ("org/name/", None),
    ("org--x/name", None), ("org/na..me", None), ("org/name@", None), ("org/name@../x", None),
    ("-org/name", None),
])
def test_parse_hub_id(text, expected):
    assert parse_hub_id(text) == expected


def test_a_path_object_is_never_a_hub_id():
    assert parse_hub_id(Path("openai/gpt-oss-20b")) is None
    assert resolve_checkpoint(Path("openai/gpt-oss-20b")) == Path("openai/gpt-oss-20b")


def test_only_the_top_level_files_conversion_needs_are_fetched():
    """gpt-oss-20b's listing on the Hub, filtered as snapshot_download filters it (huggingface_hub's own
    filter): the shards, their index, the configs, tokenizer and chat template; not original/, metal/, the
    licence or the README."""
    from huggingface_hub.utils import filter_repo_objects

    listing = [".gitattributes", "LICENSE", "README.md", "USAGE_POLICY", "chat_template.jinja", "config.json",
               "generation_config.json", "metal/model.bin", "model-00000-of-00002.safetensors",
               "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
               "model.safetensors.index.json", "original/config.json", "original/dtypes.json",
               "original/model.safetensors", "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json",
               "hf_quant_config.json", "configuration_deepseek.py", "tiktoken.model", "docs/deploy_guidance.md"]
    fetched = set(filter_repo_objects(listing, allow_patterns=list(HUB_FILES), ignore_patterns=list(HUB_IGNORED)))
    assert fetched == {"chat_template.jinja", "config.json", "generation_config.json",
                       "model-00000-of-00002.safetensors", "model-00001-of-00002.safetensors",
                       "model-00002-of-00002.safetensors", "model.safetensors.index.json", "special_tokens_map.json",
                       "tokenizer.json", "tokenizer_config.json", "hf_quant_config.json", "configuration_deepseek.py",
                       "tiktoken.model"}


# -- from the cache, offline ---------------------------------------------------------------------------------


def test_cli_converts_a_hub_id_from_the_cache_offline(cache, tmp_path, capsys):
    snapshot = add_snapshot(cache, "acme/kimi-tiny", KIMI, COMMIT_A)
    out, local = tmp_path / "out", tmp_path / "local"
    code, err = cli(capsys, "convert", "acme/kimi-tiny", "-o", out, "--format", "compressed-tensors",
                    "--report", tmp_path / "report.json")
    assert code == 0, err
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["source"] == str(snapshot)
    code, err = cli(capsys, "convert", KIMI, "-o", local, "--format", "compressed-tensors")
    assert code == 0, err
    ours, theirs = _tensors(out), _tensors(local)
    assert sorted(ours) == sorted(theirs)
    assert all(ours[name].equal(theirs[name]) for name in ours)
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in local.iterdir())


def test_python_api_takes_a_hub_id(cache, tmp_path):
    """convert, inspect and validate resolve the ID at their top (calibrate too: test_calibrate_*)."""
    add_snapshot(cache, "acme/kimi-tiny", KIMI, COMMIT_A)
    assert fp4pass.checkpoint.inspect("acme/kimi-tiny")["weights"] == fp4pass.checkpoint.inspect(KIMI)["weights"]
    report = fp4pass.checkpoint.convert("acme/kimi-tiny", tmp_path / "nv", input_scale=0.5)
    assert report["summary"]["tensors_converted"] == 20
    add_snapshot(cache, "acme/kimi-tiny-nvfp4", tmp_path / "nv", COMMIT_B)
    from_hub, local = fp4pass.checkpoint.validate("acme/kimi-tiny-nvfp4"), fp4pass.checkpoint.validate(tmp_path / "nv")
    assert from_hub["engines"] == local["engines"] and from_hub["problems"] == local["problems"]
    assert from_hub["form"] == "modelopt" and from_hub["engines"]["vllm"]["loads"]


def test_calibrate_resolves_the_hub_id_before_reading_its_data(cache, tmp_path, capsys):
    """The data file is the first thing wrong: the model was found (an unresolved ID would be refused as a
    missing folder first)."""
    add_snapshot(cache, "acme/kimi-tiny", KIMI, COMMIT_A)
    missing = tmp_path / "absent.npz"
    with pytest.raises(fp4pass.errors.FP4PassError, match="absent.npz"):
        fp4pass.checkpoint.calibrate("acme/kimi-tiny", missing, device="cpu")
    code, err = cli(capsys, "calibrate", "acme/kimi-tiny", "--data", missing, "-o", tmp_path / "s.json")
    assert code == 2 and "absent.npz" in one_line(err) and "acme" not in one_line(err)


@pytest.mark.slow
def test_calibrate_a_hub_id_gives_the_scales_of_its_folder(cache, tmp_path, capsys):
    add_snapshot(cache, "acme/kimi-tiny", KIMI, COMMIT_A)
    data = ROOT / "models" / "checkpoints" / "calib_tokens.npz"
    code, err = cli(capsys, "calibrate", "acme/kimi-tiny", "--data", data, "-o", tmp_path / "s.json")
    assert code == 0, err
    local = fp4pass.checkpoint.calibrate(KIMI, data, device="cpu").to_json()
    assert json.loads((tmp_path / "s.json").read_text())["tensors"] == json.loads(json.dumps(local))["tensors"]


def test_cli_inspect_reads_a_sharded_hub_snapshot(cache, capsys):
    add_snapshot(cache, "acme/deepseek-tiny", DEEPSEEK, COMMIT_A)
    code, err = cli(capsys, "inspect", "acme/deepseek-tiny")
    assert code == 0, err
    info = fp4pass.checkpoint.inspect("acme/deepseek-tiny")
    assert info["shards"] == sorted(p.name for p in DEEPSEEK.glob("*.safetensors"))
    assert info["weights"] == fp4pass.checkpoint.inspect(DEEPSEEK)["weights"]


def test_a_revision_picks_its_snapshot(cache):
    """main -> commit A (kimi), tag v1 -> commit B (gpt-oss); a commit is taken as itself."""
    a = add_snapshot(cache, "acme/model", KIMI, COMMIT_A, refs=("main",))
    b = add_snapshot(cache, "acme/model", GPT_OSS, COMMIT_B, refs=("v1",))
    assert resolve_checkpoint("acme/model") == str(a)
    assert resolve_checkpoint("acme/model@main") == str(a)
    assert resolve_checkpoint("acme/model@v1") == str(b)
    assert resolve_checkpoint(f"acme/model@{COMMIT_B}") == str(b)
    assert fp4pass.checkpoint.inspect("acme/model@v1")["input_forms"] == ["gpt-oss"]
    assert fp4pass.checkpoint.inspect("acme/model")["input_forms"] == ["compressed-tensors"]
    with pytest.raises(HubError, match="acme/model@v2: no such file or folder.*not in the cache"):
        resolve_checkpoint("acme/model@v2")


def test_a_local_path_always_wins(cache, tmp_path, monkeypatch, capsys):
    add_snapshot(cache, "acme/model", KIMI, COMMIT_A)
    monkeypatch.chdir(tmp_path)
    shutil.copytree(GPT_OSS, tmp_path / "acme" / "model")
    assert resolve_checkpoint("acme/model") == "acme/model"
    assert fp4pass.checkpoint.inspect("acme/model")["input_forms"] == ["gpt-oss"]
    code, err = cli(capsys, "inspect", "acme/model")
    assert code == 0, err


def test_not_cached_offline_is_exit_2_in_one_line(cache, tmp_path, capsys):
    for command in (["inspect", "acme/absent"], ["convert", "acme/absent", "-o", tmp_path / "out"],
                    ["calibrate", "acme/absent", "--data", KIMI / "config.json", "-o", tmp_path / "s.json"]):
        code, err = cli(capsys, *command)
        line = one_line(err)
        assert code == 2, err
        assert "acme/absent" in line and "not in the cache" in line and "HF_HUB_OFFLINE" in line, line
        assert str(cache) in line
    assert not (tmp_path / "out").exists()
    with pytest.raises(HubError, match="not in the cache"):
        fp4pass.checkpoint.convert("acme/absent", tmp_path / "out2")


def test_a_snapshot_without_a_shard_of_its_index_is_refused_offline(cache, capsys):
    add_snapshot(cache, "acme/deepseek-tiny", DEEPSEEK, COMMIT_A, skip=("model-00002-of-00003.safetensors",))
    code, err = cli(capsys, "inspect", "acme/deepseek-tiny")
    line = one_line(err)
    assert code == 2 and "lacks model-00002-of-00003.safetensors" in line and "HF_HUB_OFFLINE" in line, line


def test_without_huggingface_hub_a_hub_id_is_exit_2_naming_the_package(cache, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # import fails as when it is not installed
    code, err = cli(capsys, "inspect", "acme/kimi-tiny")
    line = one_line(err)
    assert code == 2 and "acme/kimi-tiny: no such file or folder" in line and "pip install huggingface_hub" in line


def test_a_snapshot_without_weights_is_refused_offline(cache):
    add_snapshot(cache, "acme/kimi-tiny", KIMI, COMMIT_A, skip=("model.safetensors",))
    with pytest.raises(HubError, match=r"lacks \*\.safetensors"):
        resolve_checkpoint("acme/kimi-tiny")


# -- online: the cache first, then a download ---------------------------------------------------------------


@pytest.fixture
def online(cache, monkeypatch):
    """HF_HUB_OFFLINE unset; huggingface_hub's snapshot_download recorded, a download simulated by filling the
    cache (the cache is still read by huggingface_hub's own code)."""
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.utils import are_progress_bars_disabled

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    real = huggingface_hub.snapshot_download
    calls, hub_repos = [], {}

    def snapshot_download(repo_id, **kwargs):
        calls.append((repo_id, kwargs, are_progress_bars_disabled()))
        if not kwargs["local_files_only"]:
            source, commit = hub_repos[repo_id]
            repo = cache / ("models--" + repo_id.replace("/", "--"))
            shutil.rmtree(repo, ignore_errors=True)
            add_snapshot(cache, repo_id, source, commit)
        return real(repo_id, **kwargs)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    return calls, hub_repos


def test_a_cached_model_is_read_without_asking_the_hub(online, cache):
    calls, _ = online
    snapshot = add_snapshot(cache, "acme/kimi-tiny", KIMI, COMMIT_A)
    assert resolve_checkpoint("acme/kimi-tiny") == str(snapshot)
    assert [kwargs["local_files_only"] for _, kwargs, _ in calls] == [True]


def test_a_model_not_cached_is_downloaded_with_the_needed_files_only(online, cache, tmp_path, capsys):
    calls, hub_repos = online
    hub_repos["acme/kimi-tiny"] = (KIMI, COMMIT_B)
    code, err = cli(capsys, "convert", "acme/kimi-tiny", "-o", tmp_path / "out", "--format", "compressed-tensors")
    assert code == 0, err
    (_, first, _), (_, second, _) = calls
    assert first["local_files_only"] and not second["local_files_only"]
    assert second["allow_patterns"] == list(HUB_FILES) and second["ignore_patterns"] == ["*/*"]
    assert second["cache_dir"] == str(cache) and second["revision"] is None


def test_a_partial_snapshot_is_completed_online(online, cache):
    calls, hub_repos = online
    add_snapshot(cache, "acme/deepseek-tiny", DEEPSEEK, COMMIT_A, skip=("model-00003-of-00003.safetensors",))
    hub_repos["acme/deepseek-tiny"] = (DEEPSEEK, COMMIT_A)
    folder = Path(resolve_checkpoint("acme/deepseek-tiny"))
    assert (folder / "model-00003-of-00003.safetensors").is_file()
    assert [kwargs["local_files_only"] for _, kwargs, _ in calls] == [True, False]


def test_hub_unreachable_and_not_cached_says_so(cache, monkeypatch, capsys):
    """huggingface_hub's own code against a Hub that refuses connections (a closed port of this machine)."""
    from huggingface_hub import constants

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    code, err = cli(capsys, "inspect", "acme/absent")
    line = one_line(err)
    assert code == 2 and "cannot be reached" in line and "not in the cache" in line, line


def test_hub_unreachable_and_a_partial_snapshot_names_what_it_lacks(cache, monkeypatch, capsys):
    from huggingface_hub import constants

    add_snapshot(cache, "acme/deepseek-tiny", DEEPSEEK, COMMIT_A, skip=("model-00003-of-00003.safetensors",))
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    code, err = cli(capsys, "inspect", "acme/deepseek-tiny")
    line = one_line(err)
    assert code == 2 and "lacks model-00003-of-00003.safetensors" in line and "cannot be reached" in line, line


@pytest.mark.parametrize("quiet", [True, False])
def test_quiet_hides_the_download_bars(online, tmp_path, capsys, quiet):
    from huggingface_hub.utils import are_progress_bars_disabled

    calls, hub_repos = online
    hub_repos["acme/kimi-tiny"] = (KIMI, COMMIT_A)
    code, err = cli(capsys, "inspect", "acme/kimi-tiny", *(["--quiet"] if quiet else []))
    assert code == 0, err
    download = [bars_hidden for _, kwargs, bars_hidden in calls if not kwargs["local_files_only"]]
    assert download == [quiet]
    assert not are_progress_bars_disabled()  # put back as it was


@pytest.mark.parametrize("variable", ["HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"])
def test_offline_set_after_import_is_honoured(online, monkeypatch, variable):
    """huggingface_hub read HF_HUB_OFFLINE once, at import (here: unset); set later, it still forbids the
    download."""
    calls, hub_repos = online
    hub_repos["acme/kimi-tiny"] = (KIMI, COMMIT_A)
    monkeypatch.setenv(variable, "1")
    with pytest.raises(HubError, match="not in the cache.*HF_HUB_OFFLINE is set"):
        resolve_checkpoint("acme/kimi-tiny")
    assert [kwargs["local_files_only"] for _, kwargs, _ in calls] == [True]


# -- the cache read by huggingface_hub's rules -----------------------------------------------------------------


def _bad_ref(repo: Path, kind: str, elsewhere: Path) -> None:
    ref = repo / "refs" / "main"
    ref.unlink()
    if kind == "a-path":  # a path instead of a commit hash: the folder it names must never be read
        ref.write_text(str(elsewhere))
    elif kind == "fifo":
        os.mkfifo(ref)
    elif kind == "dev-zero":
        ref.symlink_to("/dev/zero")
    elif kind == "link-out":
        (elsewhere / "ref").write_text(COMMIT_A)
        ref.symlink_to(elsewhere / "ref")
    elif kind == "too-long":
        ref.write_text(COMMIT_A + " " * 64)
    else:  # a hash with one letter too many
        ref.write_text(COMMIT_A + "a")


@pytest.mark.parametrize("kind", ["a-path", "fifo", "dev-zero", "link-out", "too-long", "41-hex"])
def test_a_ref_that_is_not_a_commit_hash_in_a_regular_file_is_exit_2_naming_it(cache, tmp_path, capsys, kind):
    snapshot = add_snapshot(cache, "acme/kimi-tiny", KIMI, COMMIT_A)
    repo = snapshot.parent.parent
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(KIMI, elsewhere)
    _bad_ref(repo, kind, elsewhere)
    code, err = cli(capsys, "inspect", "acme/kimi-tiny")
    line = one_line(err)
    assert code == 2 and str(repo / "refs" / "main") in line, line


def test_a_ref_with_a_newline_after_its_hash_is_read(cache):
    snapshot = add_snapshot(cache, "acme/kimi-tiny", KIMI, COMMIT_A)
    (snapshot.parent.parent / "refs" / "main").write_text(COMMIT_A + "\n")
    assert hub.cached_snapshot("acme/kimi-tiny", None, str(cache)) == snapshot


def test_a_snapshot_that_leads_out_of_the_cache_is_refused(cache, tmp_path, capsys):
    snapshot = add_snapshot(cache, "acme/kimi-tiny", KIMI, COMMIT_A)
    shutil.rmtree(snapshot)
    snapshot.symlink_to(KIMI, target_is_directory=True)
    code, err = cli(capsys, "inspect", "acme/kimi-tiny")
    assert code == 2 and "not a folder inside the cache's" in one_line(err), err


def test_an_index_linked_out_of_the_snapshot_is_never_opened(cache, tmp_path, monkeypatch):
    snapshot = add_snapshot(cache, "acme/deepseek-tiny", DEEPSEEK, COMMIT_A)
    outside = tmp_path / "outside.json"
    outside.write_text('{"weight_map": {"a": "missing.safetensors"}}')
    (snapshot / "model.safetensors.index.json").unlink()
    (snapshot / "model.safetensors.index.json").symlink_to(outside)
    import fp4pass.io.inputs as inputs

    opened = []
    real = inputs.open_regular
    monkeypatch.setattr(inputs, "open_regular", lambda path, *a, **k: opened.append(str(path)) or real(path, *a, **k))
    assert hub.missing_files(snapshot) == [] and opened == []
    (snapshot / "model.safetensors.index.json").unlink()
    (snapshot / "model.safetensors.index.json").symlink_to(outside.relative_to(tmp_path, walk_up=True)
                                                          if sys.version_info >= (3, 12) else outside)
    assert hub.missing_files(snapshot) == [] and opened == []
    blob = snapshot.parent.parent / "blobs" / "index"
    blob.write_text('{"weight_map": {"a": "missing.safetensors"}}')
    (snapshot / "model.safetensors.index.json").unlink()
    (snapshot / "model.safetensors.index.json").symlink_to(Path("..") / ".." / "blobs" / "index")
    assert hub.missing_files(snapshot) == ["missing.safetensors"]  # a blob of its own cache is read


def test_the_cache_is_hf_home_slash_hub(tmp_path, monkeypatch, no_network):
    """huggingface_hub's rule: HF_HOME holds the cache in its hub/ sub-folder, not at its top."""
    home = tmp_path / "hf-home"
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    add_snapshot(home, "acme/decoy", KIMI, COMMIT_B)  # at HF_HOME's top: not the cache
    snapshot = add_snapshot(home / "hub", "acme/kimi-tiny", KIMI, COMMIT_A)
    assert hub._cache_dir() == str(home / "hub")
    assert resolve_checkpoint("acme/kimi-tiny") == str(snapshot)
    with pytest.raises(HubError, match="not in the cache"):
        resolve_checkpoint("acme/decoy")


def test_a_gated_model_is_named_gated_not_missing(cache, monkeypatch):
    from huggingface_hub.errors import GatedRepoError

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(hub, "_offline", lambda: False)

    def gated(repo_id, revision, cache_dir, local_only, show_progress):
        if local_only:
            from huggingface_hub.errors import LocalEntryNotFoundError
            raise LocalEntryNotFoundError("not cached")
        raise GatedRepoError("Access to model acme/gated is restricted", response=_response(403))

    monkeypatch.setattr(hub, "_snapshot", gated)
    with pytest.raises(HubError, match="a gated model; accept its terms") as caught:
        resolve_checkpoint("acme/gated")
    assert "no such model" not in str(caught.value)


def _response(status: int):
    try:
        import httpx2 as httpx  # what huggingface_hub 2 builds its errors on
    except ImportError:
        import httpx

    return httpx.Response(status, request=httpx.Request("GET", "https://huggingface.co/api/models/acme/gated"))


def test_diff_json_onto_the_blob_behind_the_source_shard_is_refused(cache, tmp_path, capsys):
    snapshot = add_snapshot(cache, "acme/kimi-tiny", KIMI, COMMIT_A)
    shard = next(snapshot.glob("*.safetensors"))
    blob = Path(os.path.realpath(shard))
    before = blob.read_bytes()
    for target in (blob, blob.parent / "new.json"):
        code, err = cli(capsys, "diff", "acme/kimi-tiny", KIMI, "--data", ROOT / "models" / "checkpoints" /
                        "calib_tokens.npz", "--json", target)
        assert code == 2 and "where the files of the input" in one_line(err), err
    assert blob.read_bytes() == before and not (blob.parent / "new.json").exists()
