"""Hugging Face Hub model IDs where a checkpoint folder is taken (``fp4pass convert openai/gpt-oss-20b -o out``).

:func:`resolve_checkpoint` turns ``org/name`` or ``org/name@revision`` into the folder of that revision in the
local Hugging Face cache (``HF_HUB_CACHE``: ``models--org--name/blobs/``, ``snapshots/<commit>/``, ``refs/``):

1. an existing local path always wins, and anything that is not shaped like a Hub ID comes back unchanged
   (a missing file is then refused by whatever reads it);
2. the cache first, by huggingface_hub's rules (:func:`cached_snapshot`: a ref is a regular file holding a
   40-hex commit hash, the snapshot lies inside the repository's ``snapshots/``; a link out of the snapshot
   is never opened unless it leads into the repository's ``blobs/``): a snapshot of the revision that holds
   config.json and every shard (those of ``model.safetensors.index.json``, or at least one ``*.safetensors``)
   is used as it is, without asking the Hub;
3. otherwise the top-level files conversion needs (:data:`HUB_FILES`: the safetensors shards and their index,
   config, generation and quantization configs, tokenizer files, chat template, model code) are downloaded
   with huggingface_hub into the cache, with its progress bars; sub-folders (gpt-oss's ``original/`` and
   ``metal/`` weights) and everything else are left on the Hub;
4. offline (``HF_HUB_OFFLINE=1``, or the Hub cannot be reached), a model that is not cached, or is cached
   without some of its shards, is a :class:`HubError` (exit 2) saying so in one line.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from fp4pass.errors import UsageError

__all__ = ["HubError", "HUB_FILES", "cached_snapshot", "missing_files", "parse_hub_id", "resolve_checkpoint", "uncached_hub_id", "hub_cache"]

log = logging.getLogger(__name__)

#: the top-level files of a Hub repository that conversion reads or copies (huggingface_hub's allow_patterns)
HUB_FILES = ("*.safetensors", "*.json", "*.jinja", "*.py", "tokenizer.model", "tiktoken.model", "*.tiktoken",
             "vocab.txt", "merges.txt")
#: files in sub-folders are never fetched (huggingface_hub's patterns match across "/")
HUB_IGNORED = ("*/*",)
#: the longest ref file read (``refs/main``): a commit hash is 40 hex characters, written without a newline
REF_MAX_BYTES = 64
#: the largest index read to see which shards a snapshot lacks (the checkpoint reader's own bound)
INDEX_MAX_BYTES = 64 << 20
_COMMIT = re.compile(r"[0-9a-f]{40}")

# org/name as the Hub spells repository IDs (letters, digits, "-", "_", "."; no "--" or ".." inside)
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}")
_REVISION = re.compile(r"[\w][\w./-]{0,255}")
# a missing file given where a model is taken, not a Hub repository
_FILE_SUFFIXES = (".onnx", ".npz", ".json", ".jsonl", ".txt", ".safetensors", ".data", ".pb", ".pt", ".bin")
_TRUE = {"1", "ON", "YES", "TRUE"}


class HubError(UsageError):
    """A Hub model ID that cannot be resolved to a complete snapshot folder (not cached offline, no such
    model or revision, a gated model without a token, the Hub unreachable)."""


def parse_hub_id(text) -> tuple[str, str | None] | None:
    """``(repo_id, revision)`` when ``text`` is shaped like a Hub model ID (``org/name`` or ``org/name@rev``,
    a ``str``), else None. Whether a local path of that name exists is not looked at here."""
    if not isinstance(text, str):
        return None
    repo_id, _, revision = text.partition("@")
    if not _REPO_ID.fullmatch(repo_id) or "--" in repo_id or ".." in repo_id or repo_id.endswith(".git"):
        return None
    if repo_id.lower().endswith(_FILE_SUFFIXES):
        return None
    if "@" in text and (not _REVISION.fullmatch(revision) or ".." in revision):
        return None
    return repo_id, (revision or None)


def _offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) as it is now, or as huggingface_hub read it at import."""
    from huggingface_hub import constants

    env = any(os.environ.get(name, "").upper() in _TRUE for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    return env or bool(constants.HF_HUB_OFFLINE)


def _cache_dir() -> str:
    """The Hub cache as the environment names it now (huggingface_hub reads it once, at import)."""
    from huggingface_hub import constants

    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(name):
            return os.path.expanduser(os.environ[name])
    if os.environ.get("HF_HOME"):
        return os.path.join(os.path.expanduser(os.environ["HF_HOME"]), "hub")
    return constants.HF_HUB_CACHE


def _readable_member(folder: Path, name: str) -> bool:
    """Whether ``folder / name`` may be opened by the checkpoint folder's rule on links (decided before any
    open): not a symlink, or one that resolves inside the folder or into its cache repository's ``blobs/``."""
    path = folder / name
    try:
        if not os.path.islink(path):
            return True
    except OSError:
        return False
    real, base = os.path.realpath(path), os.path.realpath(folder)
    if os.path.commonpath([real, base]) == base:
        return True
    base_path = Path(base)
    return base_path.parent.name == "snapshots" and Path(real).parent == base_path.parent.parent / "blobs"


def missing_files(folder) -> list[str]:
    """What a snapshot folder lacks to be converted: config.json, and every shard its index names (without an
    index, at least one ``*.safetensors``). Empty when it is complete. The index is opened only when the
    link rule allows it (:func:`_readable_member`), and read with the checkpoint reader's bounds; one that
    cannot be read is the checkpoint reader's to name."""
    from fp4pass.io import read_regular_file, strict_json

    folder = Path(folder)
    missing = [] if (folder / "config.json").is_file() else ["config.json"]
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        if not _readable_member(folder, index.name):
            return missing
        try:
            raw = read_regular_file(index, INDEX_MAX_BYTES, HubError)
            shards = sorted({s for s in strict_json(raw).get("weight_map", {}).values() if isinstance(s, str)})
        except (HubError, ValueError, AttributeError, UnicodeDecodeError):
            return missing
        missing += [s for s in shards if not (folder / s).is_file()]
    elif not any(folder.glob("*.safetensors")):
        missing.append("*.safetensors")
    return missing


def _repo_folder(cache_dir: str, repo_id: str) -> Path:
    return Path(cache_dir) / ("models--" + repo_id.replace("/", "--"))


def _within(path: str, folder: str) -> bool:
    real, base = os.path.realpath(path), os.path.realpath(folder)
    return real != base and os.path.commonpath([real, base]) == base


def cached_snapshot(repo_id: str, revision: str | None, cache_dir: str) -> Path | None:
    """The snapshot folder of ``revision`` (default ``main``) in the cache by huggingface_hub's own rules, or
    None when it is not cached: a commit hash names ``snapshots/<hash>``; a branch or tag is read from
    ``refs/<name>``, a regular file inside ``refs/`` of at most :data:`REF_MAX_BYTES` bytes that holds a commit
    hash (40 hex characters) and nothing else. The snapshot must lie inside the repository's ``snapshots/``.
    A ref or snapshot that breaks these rules (a path, a FIFO, ``/dev/zero``, a link out of the cache) is a
    :class:`HubError` naming it; nothing is opened before its rule is checked."""
    from fp4pass.io import read_regular_file

    repo = _repo_folder(cache_dir, repo_id)
    if not os.path.isdir(repo):
        return None
    rev = revision or "main"
    if _COMMIT.fullmatch(rev):
        commit = rev
    else:
        ref = repo / "refs" / rev
        if not os.path.lexists(ref):
            return None
        if not _within(ref, repo / "refs"):
            raise HubError(f"{ref}: leads out of the cache's {repo / 'refs'} (to {os.path.realpath(ref)}); "
                           f"huggingface_hub never writes such a ref: remove it, or fetch {repo_id} again")
        raw = read_regular_file(ref, REF_MAX_BYTES, HubError)
        text = raw.decode("ascii", errors="replace")
        if not _COMMIT.fullmatch(text.strip()):
            raise HubError(f"{ref}: holds {text[:50]!r}, not a commit hash (40 hex characters, as huggingface_hub "
                           f"writes refs); the cache is damaged: remove {repo}, or fetch {repo_id} again")
        commit = text.strip()
    snapshot = repo / "snapshots" / commit
    if not os.path.lexists(snapshot):
        return None
    if not os.path.isdir(snapshot) or not _within(snapshot, repo / "snapshots"):
        raise HubError(f"{snapshot}: not a folder inside the cache's {repo / 'snapshots'} (it leads to "
                       f"{os.path.realpath(snapshot)}); remove it, or fetch {repo_id} again")
    return snapshot


def _snapshot(repo_id: str, revision: str | None, cache_dir: str, local_only: bool, show_progress) -> str:
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    hide = show_progress is False and not are_progress_bars_disabled()
    if hide:
        disable_progress_bars()
    try:
        return snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, local_files_only=local_only,
                                 allow_patterns=list(HUB_FILES), ignore_patterns=list(HUB_IGNORED))
    finally:
        if hide:
            enable_progress_bars()


def _cached(repo_id: str, revision: str | None, cache_dir: str) -> tuple[str | None, list[str]]:
    """(the cached snapshot folder of the revision or None, what it lacks)."""
    from huggingface_hub import errors

    incomplete = getattr(errors, "IncompleteSnapshotError", ())  # huggingface_hub >= 2: its listing is cached
    cached_snapshot(repo_id, revision, cache_dir)  # the cache's rules checked before huggingface_hub reads it
    try:
        folder = _snapshot(repo_id, revision, cache_dir, True, False)
    except incomplete as exc:  # the files the Hub listed for that commit are not all there
        folder = exc.snapshot_path
        return folder, missing_files(folder) or ["files of the Hub's listing of it"]
    except errors.LocalEntryNotFoundError:
        return None, []
    return folder, missing_files(folder)


def _name(repo_id: str, revision: str | None) -> str:
    return repo_id + (f"@{revision}" if revision else "")


def _not_available(name: str, cache_dir: str, folder, missing: list[str], why: str) -> HubError:
    if folder is None:
        return HubError(f"{name}: no such file or folder, and as a Hugging Face Hub model it is not in the cache "
                        f"({cache_dir}); {why}")
    return HubError(f"{name}: the cached snapshot {folder} lacks {', '.join(missing[:3])}"
                    f"{' and more' if len(missing) > 3 else ''}; {why}")


def _download(repo_id: str, revision: str | None, cache_dir: str, show_progress) -> str:
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    name = _name(repo_id, revision)
    log.info("%s: fetching its safetensors, configs and tokenizer from the Hugging Face Hub into %s", name, cache_dir)
    try:
        return _snapshot(repo_id, revision, cache_dir, False, show_progress)
    except RevisionNotFoundError:
        raise HubError(f"{name}: the Hub has no revision {revision!r} of {repo_id}") from None
    except GatedRepoError:
        raise HubError(f"{name}: a gated model; accept its terms on huggingface.co and log in (hf auth login, "
                       "or HF_TOKEN)") from None
    except RepositoryNotFoundError:
        raise HubError(f"{name}: no such file or folder, and no such model on the Hugging Face Hub (or a private "
                       "one: log in with hf auth login, or set HF_TOKEN)") from None
    except LocalEntryNotFoundError as exc:  # huggingface_hub's word for "unreachable, and not (all) cached"
        partial = getattr(exc, "snapshot_path", None)
        cached = f"its cached snapshot {partial} is incomplete" if partial else f"it is not in the cache ({cache_dir})"
        raise HubError(f"{name}: no such file or folder; the Hugging Face Hub cannot be reached and {cached}") from None
    except HfHubHTTPError as exc:
        raise HubError(f"{name}: the Hugging Face Hub refused it ({str(exc).splitlines()[0]})") from None
    except OSError as exc:
        raise HubError(f"{name}: cannot be downloaded into {cache_dir} ({exc.strerror or exc})") from None


def resolve_checkpoint(path_or_id, *, show_progress: bool | None = None):
    """The checkpoint folder ``path_or_id`` names: a local path as given (it always wins), or a Hub model ID
    (``org/name[@revision]``) as its snapshot folder in the local cache, fetched where needed (module
    docstring). ``show_progress``: False hides huggingface_hub's download bars; None keeps its default."""
    parsed = parse_hub_id(path_or_id)
    if parsed is None or os.path.lexists(path_or_id):
        return path_or_id
    repo_id, revision = parsed
    try:
        import huggingface_hub  # noqa: F401  (a dependency of fp4pass; an environment may still lack it)
    except ImportError:
        raise HubError(f"{path_or_id}: no such file or folder; as a Hugging Face Hub model ID it needs "
                       "huggingface_hub (pip install huggingface_hub)") from None
    name, cache_dir = _name(repo_id, revision), _cache_dir()
    folder, missing = _cached(repo_id, revision, cache_dir)
    if folder is not None and not missing:
        log.info("%s: the Hugging Face cache's %s", name, folder)
        return folder
    if _offline():
        fetch = f"hf download {repo_id}" + (f" --revision {revision}" if revision else "")  # the @rev asked for
        raise _not_available(name, cache_dir, folder, missing, "HF_HUB_OFFLINE is set, so it is not downloaded "
                             f"(unset it, or run {fetch} where the Hub can be reached)")
    folder = _download(repo_id, revision, cache_dir, show_progress)
    missing = missing_files(folder)
    if missing:
        raise _not_available(name, cache_dir, folder, missing, "the Hub did not provide them (it cannot be "
                             "reached, or the repository holds no safetensors checkpoint at its top level)")
    return folder


def uncached_hub_id(path_or_id) -> tuple[str, str | None] | None:
    """``(repo_id, revision)`` when ``path_or_id`` is a Hub model ID that is no local path and has no complete
    snapshot in the cache, and the Hub may be asked (not offline): what :func:`resolve_checkpoint` would
    download. None otherwise (a local path, a complete cached snapshot, or offline: then
    :func:`resolve_checkpoint` decides, with its own errors)."""
    parsed = parse_hub_id(path_or_id)
    if parsed is None or os.path.lexists(path_or_id):
        return None
    try:
        import huggingface_hub  # noqa: F401
    except ImportError:
        return None
    if _offline():
        return None
    folder, missing = _cached(*parsed, _cache_dir())
    return None if folder is not None and not missing else parsed


def hub_cache() -> str:
    """The Hub cache folder as the environment names it now (``HF_HUB_CACHE``, ``HF_HOME``/hub, or
    huggingface_hub's default)."""
    return _cache_dir()
