"""Hugging Face Hub model IDs where a checkpoint folder is taken (``fp4pass convert openai/gpt-oss-20b -o out``).

:func:`resolve_checkpoint` turns ``org/name`` or ``org/name@revision`` into the folder of that revision in the
local Hugging Face cache (``HF_HUB_CACHE``: ``models--org--name/blobs/``, ``snapshots/<commit>/``, ``refs/``):

1. an existing local path always wins, and anything that is not shaped like a Hub ID comes back unchanged
   (a missing file is then refused by whatever reads it);
2. the cache first: a snapshot of the revision (a branch or tag through ``refs/``, or a commit) that holds
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

import json
import logging
import os
import re
from pathlib import Path

from fp4pass.errors import UsageError

__all__ = ["HubError", "HUB_FILES", "missing_files", "parse_hub_id", "resolve_checkpoint"]

log = logging.getLogger(__name__)

#: the top-level files of a Hub repository that conversion reads or copies (huggingface_hub's allow_patterns)
HUB_FILES = ("*.safetensors", "*.json", "*.jinja", "*.py", "tokenizer.model", "tiktoken.model", "*.tiktoken",
             "vocab.txt", "merges.txt")
#: files in sub-folders are never fetched (huggingface_hub's patterns match across "/")
HUB_IGNORED = ("*/*",)

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


def missing_files(folder) -> list[str]:
    """What a snapshot folder lacks to be converted: config.json, and every shard its index names (without an
    index, at least one ``*.safetensors``). Empty when it is complete."""
    folder = Path(folder)
    missing = [] if (folder / "config.json").is_file() else ["config.json"]
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
        except (OSError, ValueError, AttributeError):
            return missing  # an unreadable index is the checkpoint reader's to name
        missing += [s for s in shards if isinstance(s, str) and not (folder / s).is_file()]
    elif not any(folder.glob("*.safetensors")):
        missing.append("*.safetensors")
    return missing


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
