"""A checkpoint folder read leniently, as the validator needs it: configs, index and shard headers.

A shard the index names that is missing or unreadable, or a tensor the index places in a shard that does not
hold it, is a problem of the folder (every engine stops loading at it), not an error of the reading: what can be
read is still checked. Nothing but config.json, hf_quant_config.json, the index and the shards' headers is read
here; symlinks follow the catalog's rule (:func:`fp4pass.safetensors.catalog.member_path`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fp4pass.safetensors.catalog import (CONFIG_NAME, INDEX_LIMIT, INDEX_NAME, QUANT_CONFIG_NAME, member_path,
                                        read_json_file)
from fp4pass.safetensors.files import CheckpointError, SafetensorsFile, TensorEntry
from fp4pass.checkpoint.validate.kinds import Problem

__all__ = ["Folder", "member", "read_folder"]


@dataclass
class Folder:
    """A checkpoint folder read leniently: the shards that could be opened, the problems of the others."""

    path: Path
    config: dict
    quant_config: dict | None  # hf_quant_config.json
    shards: dict[str, SafetensorsFile]
    tensors: dict[str, TensorEntry]
    problems: list[Problem]

    def close(self) -> None:
        for shard in self.shards.values():
            shard.close()


def member(folder: Path, name: str, follow_symlinks: bool) -> Path:
    """``folder / name`` under the catalog's rule on symlinks (a link out of the folder is refused)."""
    return member_path(folder, name, follow_symlinks)


def read_folder(folder, follow_symlinks: bool = False) -> Folder:
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: not a folder")
    config_path = member(folder, CONFIG_NAME, follow_symlinks)
    if not config_path.exists():
        raise CheckpointError(f"{folder}: no {CONFIG_NAME}: not a Hugging Face checkpoint folder")
    config = read_json_file(config_path, CONFIG_NAME)
    quant_path = member(folder, QUANT_CONFIG_NAME, follow_symlinks)
    quant_config = read_json_file(quant_path, QUANT_CONFIG_NAME) if quant_path.exists() else None
    problems: list[Problem] = []
    index_path = member(folder, INDEX_NAME, follow_symlinks)
    weight_map = None
    if index_path.exists():
        index = read_json_file(index_path, "the index", INDEX_LIMIT)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index_path}: weight_map is not an object of tensor name -> shard file")
        names = sorted(set(weight_map.values()))
    else:
        names = sorted(p.name for p in folder.iterdir() if p.name.endswith(".safetensors"))
    if not names:
        raise CheckpointError(f"{folder}: no *.safetensors shards and no index: nothing to read")
    shards: dict[str, SafetensorsFile] = {}
    try:
        for name in names:
            if name in ("", ".", "..") or "/" in name or "\\" in name or "\x00" in name:
                raise CheckpointError(f"{index_path}: shard {name!r} is not a file name in the folder")
            path = member(folder, name, follow_symlinks)
            if not path.exists():
                count = sum(1 for v in weight_map.values() if v == name) if weight_map else 0
                problems.append(Problem(
                    "missing_shard", f"{name}: named by {INDEX_NAME} for {count} tensor(s) but not in the folder; "
                    "every engine stops loading at it; fix: copy the shard in (an interrupted download?) or "
                    "rewrite the index", tensor=name))
                continue
            try:
                shards[name] = SafetensorsFile(path)
            except CheckpointError as exc:
                problems.append(Problem("unreadable_shard", f"{exc}; every engine fails to load it; fix: "
                                        "download or write the shard again", tensor=name))
    except BaseException:
        for shard in shards.values():
            shard.close()
        raise
    tensors: dict[str, TensorEntry] = {}
    for name, shard in shards.items():
        for entry in shard.entries.values():
            if weight_map is not None and weight_map.get(entry.name) != name:
                continue  # a tensor the index does not place here: engines do not read it from this shard
            tensors.setdefault(entry.name, entry)
    if weight_map is not None:
        for tensor, shard_name in weight_map.items():
            if shard_name in shards and tensor not in tensors:
                problems.append(Problem("missing_tensor", f"{tensor}: {INDEX_NAME} places it in {shard_name}, "
                                        "which does not hold it; engines fail to load; fix: rewrite the index",
                                        tensor=tensor))
    return Folder(folder, config, quant_config, shards, tensors, problems)
