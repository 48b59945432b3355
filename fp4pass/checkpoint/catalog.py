"""A checkpoint folder: config.json, its shards (through model.safetensors.index.json when sharded), other files.

Rules for what is read (docs/checkpoint.md):

- ``config.json`` and the index are regular files (after symlinks: the Hugging Face cache links into its
  blob store) of at most 64 MiB, UTF-8 JSON objects without duplicate keys;
- a shard named by the index is a plain file name in the folder (no ``/``, no ``..``): the index cannot make
  fp4pass read a file elsewhere; every shard of the index must exist, and every tensor of a shard must be the
  one the index places there (a tensor in two shards, or in a shard the index does not name for it, is refused);
- without an index, every ``*.safetensors`` file of the folder is a shard;
- the other regular files of the folder (tokenizer, chat template, generation config, licence, ...) are copied;
  sub-folders are not (gpt-oss ships its original-format weights in ``original/``), and the report lists them.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from fp4pass.checkpoint.safetensors_io import CheckpointError, SafetensorsFile, TensorEntry, no_duplicate_keys
from fp4pass.io import read_regular_file

__all__ = ["Catalog", "read_json_file", "INDEX_NAME", "CONFIG_NAME", "QUANT_CONFIG_NAME"]

INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
QUANT_CONFIG_NAME = "hf_quant_config.json"
JSON_LIMIT = 64 * 1024 * 1024


def read_json_file(path: Path, what: str) -> dict:
    """A JSON object from a regular file of at most 64 MiB (no FIFO, device or endless file is read:
    :func:`fp4pass.io.read_regular_file`); a key given twice is refused."""
    raw = read_regular_file(path, JSON_LIMIT, CheckpointError)
    try:
        data = json.loads(raw.decode("utf-8"), object_pairs_hook=no_duplicate_keys)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{path}: {what} is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: {what} is not a JSON object")
    return data


@dataclass
class Catalog:
    """Every tensor of a checkpoint folder, its shard, and the files around them."""

    folder: Path
    config: dict
    shards: dict[str, SafetensorsFile]
    tensors: dict[str, TensorEntry]  # in file order: shard by shard, offset by offset
    other_files: list[str] = field(default_factory=list)  # copied as they are
    skipped: list[str] = field(default_factory=list)  # sub-folders and special files, not copied
    index_metadata: dict = field(default_factory=dict)

    @classmethod
    def open(cls, folder: str | os.PathLike) -> "Catalog":
        folder = Path(folder)
        if not folder.is_dir():
            raise CheckpointError(f"{folder}: not a folder")
        config_path = folder / CONFIG_NAME
        if not config_path.exists():
            raise CheckpointError(f"{folder}: no {CONFIG_NAME}: not a Hugging Face checkpoint folder")
        config = read_json_file(config_path, CONFIG_NAME)
        index_path = folder / INDEX_NAME
        index_metadata: dict = {}
        if index_path.exists():
            index = read_json_file(index_path, "the index")
            weight_map = index.get("weight_map")
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise CheckpointError(f"{index_path}: weight_map is not an object of tensor name -> shard file")
            index_metadata = index.get("metadata") if isinstance(index.get("metadata"), dict) else {}
            shard_names = sorted(set(weight_map.values()))
        else:
            weight_map = None
            shard_names = sorted(p.name for p in folder.iterdir() if p.name.endswith(".safetensors"))
        if not shard_names:
            raise CheckpointError(f"{folder}: no *.safetensors shards")
        shards: dict[str, SafetensorsFile] = {}
        try:
            for name in shard_names:
                shards[name] = _open_shard(folder, name)
            tensors = _collect(shards, weight_map, folder)
        except BaseException:
            for shard in shards.values():
                shard.close()
            raise
        other, skipped = _other_files(folder, set(shard_names))
        return cls(folder, config, shards, tensors, other, skipped, index_metadata)

    def read(self, name: str, out=None):
        entry = self.tensors[name]
        return self.shards[entry.shard].read(name, out)

    def close(self) -> None:
        for shard in self.shards.values():
            shard.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _open_shard(folder: Path, name: str) -> SafetensorsFile:
    if name in ("", ".", "..") or "/" in name or "\\" in name or "\x00" in name:
        raise CheckpointError(f"{folder / INDEX_NAME}: shard {name!r} is not a file name in the folder")
    path = folder / name
    try:
        info = os.stat(path)
    except OSError as exc:
        raise CheckpointError(f"{folder}: shard {name} cannot be read ({exc.strerror})") from None
    if not stat.S_ISREG(info.st_mode):
        raise CheckpointError(f"{folder}: shard {name} is not a regular file")
    return SafetensorsFile(path)


def _collect(shards: dict[str, SafetensorsFile], weight_map: dict | None, folder: Path) -> dict[str, TensorEntry]:
    tensors: dict[str, TensorEntry] = {}
    for shard_name, shard in shards.items():
        for entry in sorted(shard.entries.values(), key=lambda e: e.begin):
            if entry.name in tensors:
                raise CheckpointError(f"{shard_name}: tensor {entry.name!r} is also in {tensors[entry.name].shard}")
            if weight_map is not None and weight_map.get(entry.name) != shard_name:
                where = weight_map.get(entry.name)
                raise CheckpointError(f"{shard_name}: tensor {entry.name!r}: the index places it "
                                      f"{'in ' + where if where else 'nowhere'}")
            tensors[entry.name] = entry
    if weight_map is not None:
        missing = [n for n in weight_map if n not in tensors]
        if missing:
            raise CheckpointError(f"{folder / INDEX_NAME}: tensor {missing[0]!r} is not in its shard "
                                  f"{weight_map[missing[0]]} ({len(missing)} missing)")
    return tensors


def _other_files(folder: Path, shard_names: set[str]) -> tuple[list[str], list[str]]:
    """(regular files to copy, entries not copied) besides the shards, the index, config.json and our config."""
    own = shard_names | {INDEX_NAME, CONFIG_NAME, QUANT_CONFIG_NAME}
    other, skipped = [], []
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        if entry.name in own:
            continue
        if entry.name.endswith(".safetensors"):  # a shard the index does not name: not part of the model
            skipped.append(entry.name)
            continue
        try:
            regular = entry.is_file(follow_symlinks=True)
        except OSError:
            regular = False
        if regular and stat.S_ISREG(os.stat(entry.path).st_mode):
            other.append(entry.name)
        else:
            skipped.append(entry.name + ("/" if entry.is_dir() else ""))
    return other, skipped
