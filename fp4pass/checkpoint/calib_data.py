"""Calibration DATA for a checkpoint: token ids in batches.

Forms:

- ``.npz`` with ``input_ids`` int [N, T] (and optionally ``attention_mask`` [N, T] of 0/1; positions with 0 are
  padding: they run through the model but no statistic counts them), or a folder of such files (name order,
  one file read at a time);
- ``.jsonl`` (one ``{"text": ...}`` object per line) or ``.txt`` (the whole file is text): tokenized with the
  checkpoint's own ``tokenizer.json`` (the ``tokenizers`` package), records joined, cut into ``num_samples``
  sequences of ``seq_len`` tokens.

``seq_len`` also cuts longer ``.npz`` rows; ``num_samples`` caps the rows taken (all when None). Refused
(:class:`~fp4pass.calib.runner.CalibrationDataError`, exit 2), naming the file and the row: a token id outside
[0, vocab_size), a float array, an empty array, no ``input_ids``, a mask of another shape or with values other
than 0/1, a row whose mask is all 0, text without a tokenizer, a line that is not a JSON object with ``text``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fp4pass.calib.runner import CalibrationDataError
from fp4pass.npz import npz_files, read_npz

__all__ = ["Batch", "load_batches", "DEFAULT_SEQ_LEN", "DEFAULT_BATCH_SIZE", "TEXT_SUFFIXES"]

DEFAULT_SEQ_LEN = 512
DEFAULT_BATCH_SIZE = 8
TEXT_SUFFIXES = (".jsonl", ".txt")
TEXT_LIMIT = 1 << 30


@dataclass
class Batch:
    """Rows of token ids [B, T] (int64) and their mask (None: every position counts)."""

    where: str
    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None = None

    @property
    def tokens(self) -> int:
        return int(self.input_ids.numel() if self.attention_mask is None else self.attention_mask.sum())


def _check_ids(ids: np.ndarray, where: str, vocab_size: int) -> None:
    """Every id in [0, vocab_size) (dtype, rank and emptiness are refused from the .npy header, before this)."""
    bad = (ids < 0) | (ids >= vocab_size)
    if bad.any():
        row, col = (int(i) for i in np.argwhere(bad)[0])
        raise CalibrationDataError(f"{where}: row {row}: token id {int(ids[row, col])} at position {col} is outside "
                                   f"the vocabulary [0, {vocab_size})")


def _check_mask(mask: np.ndarray, shape: tuple, where: str) -> None:
    if tuple(mask.shape) != tuple(shape):
        raise CalibrationDataError(f"{where}: attention_mask {list(mask.shape)} does not match input_ids "
                                   f"{list(shape)}")
    if mask.dtype.kind not in "biu" or not np.isin(mask, (0, 1)).all():
        raise CalibrationDataError(f"{where}: attention_mask must hold 0 and 1 only")
    empty = np.flatnonzero(mask.sum(1) == 0)
    if empty.size:
        raise CalibrationDataError(f"{where}: row {int(empty[0])}: attention_mask is all 0 (no token to calibrate on)")


def _npz_rows(path: Path, vocab_size: int, seq_len: int | None):
    def check(name: str, dims: tuple, dtype: np.dtype) -> None:
        if name == "input_ids":
            if dtype.kind not in "iu":
                raise CalibrationDataError(f"{path}: input_ids is {dtype}, not integer token ids")
            if len(dims) != 2:
                raise CalibrationDataError(f"{path}: input_ids has shape {list(dims)}; expected [N, T]")
            if 0 in dims:
                raise CalibrationDataError(f"{path}: input_ids {list(dims)} is empty")

    arrays, _ = read_npz(path, error=CalibrationDataError, names={"input_ids", "attention_mask"}, check=check)
    if "input_ids" not in arrays:
        raise CalibrationDataError(f"{path}: no array named input_ids")
    ids = arrays["input_ids"]
    _check_ids(ids, str(path), vocab_size)
    mask = arrays.get("attention_mask")
    if mask is not None:
        _check_mask(mask, ids.shape, str(path))
    if seq_len is not None:
        ids = ids[:, :seq_len]
        mask = None if mask is None else mask[:, :seq_len]
        if mask is not None:
            _check_mask(mask, ids.shape, f"{path} (first {seq_len} positions)")
    return ids.astype(np.int64), (None if mask is None or mask.all() else mask.astype(np.int64))


def _text(path: Path) -> list[tuple[int, str]]:
    """(line number, text) records of a .jsonl, or [(1, whole text)] of a .txt."""
    from fp4pass.io import read_regular_file

    raw = read_regular_file(path, TEXT_LIMIT, CalibrationDataError)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CalibrationDataError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    if path.suffix == ".txt":
        return [(1, text)]
    records = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except ValueError as exc:
            raise CalibrationDataError(f"{path}: row {number}: not JSON ({exc})") from None
        if not isinstance(item, dict) or not isinstance(item.get("text"), str):
            raise CalibrationDataError(f"{path}: row {number}: expected an object with a string \"text\"")
        records.append((number, item["text"]))
    return records


def _tokenize(path: Path, folder: Path, vocab_size: int, seq_len: int, num_samples: int | None) -> np.ndarray:
    tokenizer_file = folder / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise CalibrationDataError(f"{path}: text needs the checkpoint's tokenizer, and {folder} has no "
                                   "tokenizer.json (give token ids in an .npz instead)")
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_file(str(tokenizer_file))
    except Exception as exc:  # noqa: BLE001 - the tokenizers package raises its own Exception type
        raise CalibrationDataError(f"{tokenizer_file}: the tokenizers package cannot read it ({exc})") from None
    stream: list[int] = []
    wanted = None if num_samples is None else num_samples * seq_len
    for number, text in _text(path):
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        bad = [i for i in ids if not 0 <= i < vocab_size]
        if bad:
            raise CalibrationDataError(f"{path}: row {number}: token id {bad[0]} from {tokenizer_file.name} is "
                                       f"outside the model's vocabulary [0, {vocab_size})")
        stream.extend(ids)
        if wanted is not None and len(stream) >= wanted:
            break
    rows = len(stream) // seq_len
    if rows == 0:
        raise CalibrationDataError(f"{path}: {len(stream)} tokens, fewer than one sequence of --seq-len {seq_len}")
    if num_samples is not None:
        rows = min(rows, num_samples)
    return np.asarray(stream[: rows * seq_len], dtype=np.int64).reshape(rows, seq_len)


def load_batches(data, folder, vocab_size: int, *, seq_len: int | None = None, num_samples: int | None = None,
                 batch_size: int | None = None) -> list[Batch]:
    """The calibration batches of ``data`` (a path, module docstring) for the checkpoint in ``folder``."""
    batch_size = DEFAULT_BATCH_SIZE if batch_size is None else batch_size
    for label, value in (("--batch-size", batch_size), ("--seq-len", seq_len), ("--num-samples", num_samples)):
        if value is not None and value < 1:
            raise CalibrationDataError(f"{label} must be at least 1, got {value}")
    path, folder = Path(data), Path(folder)
    if not os.path.lexists(path):
        raise CalibrationDataError(f"{path}: no such file or folder")
    sources: list[tuple[str, np.ndarray, np.ndarray | None]] = []
    if path.is_dir():
        files = npz_files(path, CalibrationDataError)
        if not files:
            raise CalibrationDataError(f"{path}: folder holds no .npz files")
        taken = 0
        for file in files:
            if num_samples is not None and taken >= num_samples:
                break
            ids, mask = _npz_rows(file, vocab_size, seq_len)
            sources.append((str(file), ids, mask))
            taken += ids.shape[0]
    elif path.suffix in TEXT_SUFFIXES:
        sources.append((str(path), _tokenize(path, folder, vocab_size, seq_len or DEFAULT_SEQ_LEN, num_samples), None))
    elif path.suffix == ".npz" or not path.is_file():
        ids, mask = _npz_rows(path, vocab_size, seq_len)
        sources.append((str(path), ids, mask))
    else:
        raise CalibrationDataError(f"{path}: calibration data must be an .npz of input_ids, a folder of them, or "
                                   f"text ({', '.join(TEXT_SUFFIXES)})")
    batches: list[Batch] = []
    left = num_samples
    for where, ids, mask in sources:
        if left is not None:
            ids, mask = ids[:left], (None if mask is None else mask[:left])
            left -= ids.shape[0]
        for start in range(0, ids.shape[0], batch_size):
            rows = slice(start, start + batch_size)
            part = None if mask is None else torch.from_numpy(np.ascontiguousarray(mask[rows]))
            if part is not None and bool(part.all()):
                part = None
            batches.append(Batch(f"{where}[{start}:{start + ids[rows].shape[0]}]",
                                 torch.from_numpy(np.ascontiguousarray(ids[rows])), part))
    return batches
