"""A checkpoint folder: config.json, its shards (through model.safetensors.index.json when sharded), other files.

Rules for what is read (docs/checkpoint.md, docs/bad-input.md):

- **where a file may be** (the same rule for config.json, the index, the shards and the side files): a file of
  the folder itself, or a symlink whose final target (every link followed) lies inside the folder, or in the
  Hugging Face cache's blob store of the same repository: the folder is ``<repo>/snapshots/<revision>`` and
  the target is ``<repo>/blobs/<name>`` (the cache's own ``../../blobs/<hash>`` links). Any other symlink is
  refused, naming the link and its target, unless ``follow_symlinks`` (``--follow-symlinks``) is given;
- **what a file may be**: a regular file (no FIFO, device, socket, folder) on a real file system (never
  procfs, sysfs, devtmpfs, ...: :func:`fp4pass.io.pseudo_filesystem`, even through ``--follow-symlinks``),
  whose content is exactly its size: exactly ``st_size`` bytes are read or copied and the file must end
  there (``/proc/self/pagemap`` says 0 bytes and reads forever). Each file is stat'ed when the folder is read,
  and each later opening must find that file still (device, inode, size);
- ``config.json`` (at most :data:`CONFIG_LIMIT` bytes) and the index (:data:`INDEX_LIMIT`) are UTF-8 JSON
  objects without duplicate keys, NaN, Infinity or lone surrogates (what no JSON writer writes back);
- a shard named by the index is a plain file name in the folder (no ``/``, no ``..``): the index cannot make
  fp4pass read a file elsewhere; every shard of the index must exist, and every tensor of a shard must be the
  one the index places there (a tensor in two shards, or in a shard the index does not name for it, is refused);
- without an index, every ``*.safetensors`` file of the folder is a shard;
- the other regular files of the folder (tokenizer, chat template, generation config, licence, ...) are copied;
  sub-folders are not (gpt-oss ships its original-format weights in ``original/``), and the report lists them.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from fp4pass.safetensors.files import CheckpointError, SafetensorsFile, TensorEntry, strict_json
from fp4pass.io import copy_regular_file, open_regular, read_exact

__all__ = ["Catalog", "read_json_file", "INDEX_NAME", "CONFIG_NAME", "QUANT_CONFIG_NAME", "member_path"]

INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
QUANT_CONFIG_NAME = "hf_quant_config.json"
#: config.json: real ones are kilobytes (the largest, with big label maps, a few MB)
CONFIG_LIMIT = 16 * 1024 * 1024
#: the index: one line per tensor (a 100,000-tensor model's is ~10 MB)
INDEX_LIMIT = 64 * 1024 * 1024
JSON_LIMIT = INDEX_LIMIT


def _json_object(raw: bytes, path: Path, what: str) -> dict:
    try:
        data = strict_json(raw)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{path}: {what} is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: {what} is not a JSON object")
    return data


def read_json_file(path: Path, what: str, limit: int = CONFIG_LIMIT) -> dict:
    """A JSON object (:func:`~fp4pass.safetensors.files.strict_json`) from a regular file of at most
    ``limit`` bytes, read exactly (:func:`fp4pass.io.open_regular`: no FIFO, device, pseudo or endless file)."""

    fd, info = open_regular(path, CheckpointError)
    try:
        if info.st_size > limit:
            raise CheckpointError(f"{path}: {info.st_size} bytes; at most {limit} are read from {what}")
        raw = read_exact(fd, info.st_size, path, CheckpointError)
    finally:
        os.close(fd)
    return _json_object(raw, path, what)


def _hf_blob(real: Path, base: Path) -> bool:
    """Whether ``real`` is a blob of the Hugging Face cache repository whose snapshot folder is ``base``
    (both resolved): ``base`` = ``<repo>/snapshots/<revision>`` and ``real`` = ``<repo>/blobs/<name>``."""
    return (base.parent.name == "snapshots" and real.parent.name == "blobs"
            and real.parent.parent == base.parent.parent)


def member_path(folder: Path, name: str, follow_symlinks: bool = False) -> Path:
    """``folder / name`` when the folder's rule on links allows reading it (module docstring): not a symlink,
    or one whose final target lies inside the folder or in its Hugging Face cache blob store; any other
    symlink is refused naming the link and its target, unless ``follow_symlinks``."""
    path = folder / name
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return path
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot be read ({exc.strerror})") from None
    if not stat.S_ISLNK(info.st_mode) or follow_symlinks:
        return path
    real = Path(os.path.realpath(path))
    base = Path(os.path.realpath(folder))
    if real != base and os.path.commonpath([real, base]) == str(base):
        return path
    if _hf_blob(real, base):
        return path
    raise CheckpointError(f"{path}: is a symlink to {real}, outside the checkpoint folder (only links inside it "
                          "or into its Hugging Face cache blobs/ are read); --follow-symlinks reads it anyway")


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
    follow_symlinks: bool = False
    file_stats: dict[str, os.stat_result] = field(default_factory=dict)  # other_files as they were read

    @classmethod
    def open(cls, folder: str | os.PathLike, follow_symlinks: bool = False) -> "Catalog":
        folder = Path(folder)
        if not folder.is_dir():
            raise CheckpointError(f"{folder}: not a folder")
        config_path = member_path(folder, CONFIG_NAME, follow_symlinks)
        if not os.path.lexists(config_path):
            raise CheckpointError(f"{folder}: no {CONFIG_NAME}: not a Hugging Face checkpoint folder")
        config = read_json_file(config_path, CONFIG_NAME, CONFIG_LIMIT)
        index_path = member_path(folder, INDEX_NAME, follow_symlinks)
        index_metadata: dict = {}
        if os.path.lexists(index_path):
            index = read_json_file(index_path, "the index", INDEX_LIMIT)
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
        for name in shard_names:
            shards[name] = _open_shard(folder, name, follow_symlinks)
        tensors = _collect(shards, weight_map, folder)
        other, skipped, stats = _other_files(folder, set(shard_names), follow_symlinks)
        return cls(folder, config, shards, tensors, other, skipped, index_metadata, follow_symlinks, stats)

    def read(self, name: str, out=None):
        entry = self.tensors[name]
        return self.shards[entry.shard].read(name, out)

    def copy_file(self, name: str, dst: str | os.PathLike) -> int:
        """Copy the side file ``name`` (one of ``other_files``) to the new file ``dst``: exactly the bytes it
        had when the folder was read (:func:`fp4pass.io.copy_regular_file`)."""
        path = member_path(self.folder, name, self.follow_symlinks)
        return copy_regular_file(path, dst, CheckpointError, expect=self.file_stats.get(name))

    def close(self) -> None:
        for shard in self.shards.values():
            shard.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _open_shard(folder: Path, name: str, follow_symlinks: bool = False) -> SafetensorsFile:
    if name in ("", ".", "..") or "/" in name or "\\" in name or "\x00" in name:
        raise CheckpointError(f"{folder / INDEX_NAME}: shard {name!r} is not a file name in the folder")
    path = member_path(folder, name, follow_symlinks)
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


def _other_files(folder: Path, shard_names: set[str], follow_symlinks: bool = False
                 ) -> tuple[list[str], list[str], dict[str, os.stat_result]]:
    """(regular files to copy, entries not copied, the copied files' stat) besides the shards, the index,
    config.json and our config. A symlink to a regular file out of the folder is refused (:func:`member_path`),
    a file on a pseudo file system too (:func:`fp4pass.io.open_regular`); what is not a regular file (a
    folder, a FIFO, a device, a dangling link) is never read, only listed as not copied."""
    own = shard_names | {INDEX_NAME, CONFIG_NAME, QUANT_CONFIG_NAME}
    other, skipped, stats = [], [], {}
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        if entry.name in own:
            continue
        if entry.name.endswith(".safetensors"):  # a shard the index does not name: not part of the model
            skipped.append(entry.name)
            continue
        path = folder / entry.name
        try:
            info = os.stat(path)
        except OSError:
            info = None
        if info is not None and stat.S_ISREG(info.st_mode):  # a file that would be read: the rule on links
            path = member_path(folder, entry.name, follow_symlinks)
            fd, info = open_regular(path, CheckpointError)
            os.close(fd)
            other.append(entry.name)
            stats[entry.name] = info
        else:
            skipped.append(entry.name + ("/" if info is not None and stat.S_ISDIR(info.st_mode) else ""))
    return other, skipped, stats
