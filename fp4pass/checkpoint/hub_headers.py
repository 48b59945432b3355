"""``inspect`` of a Hugging Face Hub model ID that is not in the local cache: its configs and its shards' headers
only, never their tensors.

A safetensors shard starts with an 8-byte length and a JSON header naming every tensor with its dtype, shape and
byte range. huggingface_hub reads that header with HTTP range requests (``HfApi.get_safetensors_metadata``:
the first 100,000 bytes of each shard, and the rest of the header in a second request when it is longer), so a
checkpoint of 1.6 TB in 64 shards costs about 6.4 MB, and config.json, hf_quant_config.json and the index a few
more. From those alone ``inspect`` says what the folder holds:

- MXFP4: the input forms and every MXFP4 weight with its shape and experts, the tensors convert would copy, the
  weights it would decline (:func:`fp4pass.checkpoint.detect.detect` needs names, dtypes and shapes only);
- NVFP4: each engine's verdict (:func:`fp4pass.checkpoint.engines.engine_verdicts` reads the configs and the
  tensor names).

What needs tensor values is not computed, and the result says so (``headers_only``): the MXFP4 lossless forecast
reads every E8M0 block scale (1 byte per 32 values: about 6% of an MXFP4 weight's bytes, 100 GB of a 1.6 TB
model), and the NVFP4 value rules read the global and block scales. ``fp4pass inspect`` of a local copy (or of
the Hub ID once it is cached: ``hf download ORG/NAME``) gives both.
"""

from __future__ import annotations

from pathlib import Path

from fp4pass.safetensors.catalog import CONFIG_LIMIT, CONFIG_NAME, INDEX_NAME, QUANT_CONFIG_NAME, read_json_file
from fp4pass.checkpoint.detect import FusedExperts, Linear, detect
from fp4pass.checkpoint.forms import block_precision
from fp4pass.safetensors.files import DTYPES, CheckpointError, TensorEntry
from fp4pass.safetensors.hub import HubError, hub_cache

__all__ = ["inspect_hub_headers", "format_hub_inspection", "read_hub_headers"]

#: the value checks a headers-only inspection leaves out, as the result names them
NOT_READ = {"mxfp4": "the lossless forecast (it reads every E8M0 block scale)",
            "nvfp4": "the scale value rules (global and block scales, input scales)"}


class HubUnavailable(Exception):
    """The Hub cannot say: unreachable, no such repository or revision, or a gated one. :func:`fp4pass.safetensors.hub.
    resolve_checkpoint` then names the reason in its own words (it fetches nothing in these cases)."""


def _hub_json(repo_id: str, revision: str | None, filename: str, endpoint: str) -> dict | None:
    """One small JSON file of the repository, at most :data:`CONFIG_LIMIT` bytes (its size asked first), parsed
    as the checkpoint reader parses it; None when the repository has no such file."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_download, hf_hub_url
    from huggingface_hub.errors import RemoteEntryNotFoundError

    try:
        size = get_hf_file_metadata(hf_hub_url(repo_id, filename, revision=revision, endpoint=endpoint)).size
    except RemoteEntryNotFoundError:
        return None
    if size is None or size > CONFIG_LIMIT:
        raise CheckpointError(f"{repo_id}: {filename} is {size} bytes on the Hub, more than a config may be "
                              f"({CONFIG_LIMIT})")
    path = hf_hub_download(repo_id, filename, revision=revision, cache_dir=hub_cache())
    return read_json_file(Path(path), filename, CONFIG_LIMIT)


def _transport_errors() -> tuple[type[BaseException], ...]:
    """What the HTTP client huggingface_hub uses raises when the Hub cannot be reached (httpx's
    ``TransportError`` and its kin), and OSError."""
    import sys

    from huggingface_hub import get_session

    client = sys.modules.get(type(get_session()).__module__.split(".")[0])
    return tuple(t for t in (getattr(client, "TransportError", None), OSError) if isinstance(t, type))


def read_hub_headers(repo_id: str, revision: str | None = None):
    """``(config, hf_quant_config or None, tensors)`` of a Hub repository from its configs and its shards'
    headers; ``tensors``: name -> :class:`TensorEntry` in file order (shard by shard, offset by offset), with
    offsets relative to the shard's data area: entries to read names, dtypes and shapes from, never bytes.
    Raises :class:`HubUnavailable` where the Hub cannot answer, CheckpointError for what it holds."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, NotASafetensorsRepoError,
                                        RepositoryNotFoundError, RevisionNotFoundError, SafetensorsParsingError)

    api = HfApi()
    name = repo_id + (f"@{revision}" if revision else "")
    try:
        config = _hub_json(repo_id, revision, CONFIG_NAME, api.endpoint)
        if config is None:
            raise CheckpointError(f"{name}: no {CONFIG_NAME} on the Hub: not a Hugging Face checkpoint")
        quant = _hub_json(repo_id, revision, QUANT_CONFIG_NAME, api.endpoint)
        meta = api.get_safetensors_metadata(repo_id, revision=revision)
    except (RepositoryNotFoundError, RevisionNotFoundError, GatedRepoError, *_transport_errors()) as exc:
        raise HubUnavailable(str(exc)) from None
    except NotASafetensorsRepoError:
        raise CheckpointError(f"{name}: no model.safetensors nor {INDEX_NAME} on the Hub") from None
    except SafetensorsParsingError as exc:
        raise CheckpointError(f"{name}: a shard's header cannot be parsed ({str(exc).splitlines()[0]})") from None
    except HfHubHTTPError as exc:
        raise HubError(f"{name}: the Hugging Face Hub refused it ({str(exc).splitlines()[0]})") from None
    tensors: dict[str, TensorEntry] = {}
    for shard in sorted(meta.files_metadata):
        infos = meta.files_metadata[shard].tensors
        for tensor, info in sorted(infos.items(), key=lambda kv: kv[1].data_offsets[0]):
            if info.dtype not in DTYPES:
                raise CheckpointError(f"{name}: {shard}: tensor {tensor!r} has dtype {info.dtype!r}, not a "
                                      "safetensors dtype")
            if meta.weight_map.get(tensor) != shard:
                raise CheckpointError(f"{name}: {shard}: tensor {tensor!r}: the index places it "
                                      f"{'in ' + meta.weight_map[tensor] if tensor in meta.weight_map else 'nowhere'}")
            tensors[tensor] = TensorEntry(tensor, info.dtype, tuple(info.shape), *info.data_offsets, shard)
    missing = [t for t in meta.weight_map if t not in tensors]
    if missing:
        raise CheckpointError(f"{name}: {INDEX_NAME}: tensor {missing[0]!r} is not in its shard "
                              f"{meta.weight_map[missing[0]]} ({len(missing)} missing)")
    return config, quant, tensors


def _weights(units) -> list[dict]:
    """One entry per MXFP4 weight: a Linear (each member of a gate/up pair apart) or a gpt-oss stack."""
    out = []
    for unit in units:
        if isinstance(unit, FusedExperts):
            out.append({"name": f"{unit.prefix}.{unit.proj}", "form": unit.form,
                        "shape": [unit.experts, unit.rows, unit.cols], "experts": unit.experts})
            continue
        for lin in ([unit] if isinstance(unit, Linear) else list(unit)):
            out.append({"name": lin.module, "form": lin.form, "shape": [lin.rows, lin.cols], "experts": 1})
    return out


def inspect_hub_headers(repo_id: str, revision: str | None = None, show_progress: bool | None = None) -> dict:
    """What ``fp4pass inspect ORG/NAME`` says of a repository that is not cached, from its headers (module
    docstring): MXFP4 weights, or an NVFP4 checkpoint's engine verdicts; ``headers_only`` names what was not
    read. ``show_progress``: False hides huggingface_hub's bar over the shards' headers."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    from fp4pass.checkpoint.engines import engine_verdicts

    hide = show_progress is False and not are_progress_bars_disabled()
    if hide:
        disable_progress_bars()
    try:
        config, quant, tensors = read_hub_headers(repo_id, revision)
    finally:
        if hide:
            enable_progress_bars()
    source = repo_id + (f"@{revision}" if revision else "")
    base = {"source": source, "headers_only": True, "shards": sorted({e.shard for e in tensors.values()}),
            "tensors": len(tensors), "bytes": sum(e.nbytes for e in tensors.values())}
    if any(block_precision(e.dtype) == "nvfp4" for e in tensors.values()):  # E4M3 block scales: NVFP4
        return {**base, "precision": "nvfp4", "not_read": NOT_READ["nvfp4"],
                "engines": engine_verdicts(config, quant, list(tensors))}
    found = detect(tensors, config)
    if not (found.units or found.declined):
        raise CheckpointError(f"{source}: neither MXFP4 weights nor NVFP4 scales in its shards' headers")
    weights = _weights(found.units)
    return {**base, "precision": "mxfp4", "not_read": NOT_READ["mxfp4"], "input_forms": sorted(found.forms),
            "weights": weights, "declined": found.declined, "copied": [n for n in tensors if n not in found.consumed],
            "summary": {"weights": len(weights), "experts_total": sum(w["experts"] for w in weights),
                        "experts_lossless_forecast": None}}


def format_hub_inspection(info: dict) -> str:
    """The terminal's view of :func:`inspect_hub_headers`: what was read, the weights or the verdicts, and what
    was not read with how to get it."""
    lines = [f"{info['source']}: headers only ({len(info['shards'])} shard(s), {info['tensors']} tensors, "
             f"{info['bytes'] / 1e9:.3g} GB not downloaded)"]
    if info["precision"] == "mxfp4":
        lines[0] += f"; input forms {', '.join(info['input_forms']) or 'none'}"
        lines.append(f"{'weight':<60} {'form':<18} {'shape':<20} experts")
        for w in info["weights"]:
            lines.append(f"{w['name']:<60} {w['form']:<18} {'x'.join(map(str, w['shape'])):<20} {w['experts']}")
        for d in info["declined"]:
            lines.append(f"declined {d['tensor']}: {d['reason']}")
        s = info["summary"]
        lines.append(f"{s['weights']} MXFP4 weights, {s['experts_total']} matrices; "
                     f"{len(info['copied'])} tensors copied as they are")
    else:
        for engine, v in info["engines"].items():
            lines.append(f"{engine}: {'loads ' + v['mode'] if v['loads'] else 'does not load'} ({v['why']})")
    repo = info["source"].split("@")[0]
    fetch = f"hf download {repo}" + (f" --revision {info['source'].split('@', 1)[1]}" if "@" in info["source"] else "")
    lines.append(f"not read: {info['not_read']}; inspect a local copy for it ({fetch})")
    return "\n".join(lines)
