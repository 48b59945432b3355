"""Calibration DATA for a checkpoint: token ids in batches.

Forms:

- ``.npz`` with ``input_ids`` int [N, T] (and optionally ``attention_mask`` [N, T] of 0/1; positions with 0 are
  padding: they run through the model but no statistic counts them), or a folder of such files (name order,
  one file read at a time);
- ``.jsonl`` (one ``{"text": ...}`` object per line) or ``.txt`` (the whole file is text): tokenized with the
  checkpoint's own ``tokenizer.json`` (the ``tokenizers`` package), records joined, cut into ``num_samples``
  sequences of ``seq_len`` tokens. Rows are read one at a time and only as far as those tokens need: a row
  longer than the tokens still wanted can cover is cut, with a note (:func:`_tokenize`), and no tokenizer call
  sees more than :data:`ENCODE_CHARS` characters (:func:`_encode`), whatever the vocabulary holds.

``seq_len`` also cuts longer ``.npz`` rows; ``num_samples`` caps the rows taken (all when None). Refused
(:class:`~fp4pass.calib.errors.CalibrationDataError`, exit 2), naming the file and the row: a token id outside
[0, vocab_size), a float array, an empty array, no ``input_ids``, a mask of another shape or with values other
than 0/1, a row whose mask is all 0, text without a tokenizer, a line that is not a JSON object with ``text``
or whose text holds a lone surrogate (``"\\ud800"``: no UTF-8 text, no tokenizer can take it).
"""

from __future__ import annotations

import io
import json
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fp4pass.calib.errors import CalibrationDataError
from fp4pass.io.jsonio import strict_json
from fp4pass.io import open_regular
from fp4pass.npz import npz_files, read_npz

__all__ = ["Batch", "load_batches", "DEFAULT_SEQ_LEN", "DEFAULT_BATCH_SIZE", "TEXT_SUFFIXES"]

DEFAULT_SEQ_LEN = 512
DEFAULT_BATCH_SIZE = 8
TEXT_SUFFIXES = (".jsonl", ".txt")
#: characters read past what the wanted tokens can cover, so that a cut row's changed last tokens are not taken
CUT_SLACK = 1024
#: the longest .jsonl row read (its JSON object is parsed whole), and the largest .txt read whole (no --num-samples)
ROW_LIMIT = 256 << 20
TEXT_LIMIT = 1 << 30
#: the most characters one tokenizer call sees: a longer row is tokenized piece by piece (:func:`_encode`), so
#: the tokenizer's memory is bounded whatever its vocabulary holds (one entry of 8 million characters defeats
#: the cut of a row by the tokens wanted, and tokenizing 256 MB at once aborts the process)
ENCODE_CHARS = 1 << 20

log = logging.getLogger(__name__)


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


def _jsonl_rows(path: Path, chars: Callable[[], int | None]) -> Iterator[tuple[int, str]]:
    """(row number, text) of each non-blank line of a .jsonl, read one line at a time; ``chars()``: how many
    characters of the next row can be needed (None: all), asked before each row."""
    fd, info = open_regular(path, CalibrationDataError)
    offset = 0
    with os.fdopen(fd, "rb") as stream:
        for number, raw in enumerate(iter(lambda: stream.readline(ROW_LIMIT + 1), b""), 1):
            if len(raw) > ROW_LIMIT:
                raise CalibrationDataError(f"{path}: row {number} is longer than {ROW_LIMIT} bytes (one JSON object "
                                           "is parsed whole: split the text into rows)")
            offset += len(raw)
            if offset > info.st_size:
                raise CalibrationDataError(f"{path}: holds more than the {info.st_size} bytes its size says (it "
                                           "changed while read)")
            if not raw.strip():
                continue
            try:
                item = strict_json(raw)
            except UnicodeDecodeError as exc:
                raise CalibrationDataError(f"{path}: not UTF-8 text (byte {offset - len(raw) + exc.start}) in row "
                                           f"{number}") from None
            except json.JSONDecodeError as exc:
                raise CalibrationDataError(f"{path}: row {number}: not JSON ({exc})") from None
            except RecursionError:
                raise CalibrationDataError(f"{path}: row {number}: not JSON (nested too deep)") from None
            except ValueError as exc:  # a lone surrogate (strict_json): no tokenizer can take it
                raise CalibrationDataError(f"{path}: row {number}: {exc}") from None
            if not isinstance(item, dict) or not isinstance(item.get("text"), str):
                raise CalibrationDataError(f"{path}: row {number}: expected an object with a string \"text\"")
            yield number, _cut(path, number, item["text"], chars())


def _txt_row(path: Path, chars: int | None) -> tuple[int, str]:
    """(1, the text of a .txt), at most ``chars`` characters of it read (None: all)."""
    fd, info = open_regular(path, CalibrationDataError)
    if chars is None and info.st_size > TEXT_LIMIT:
        os.close(fd)
        raise CalibrationDataError(f"{path}: {info.st_size} bytes, more than the {TEXT_LIMIT} read whole; give "
                                   "--num-samples (only what its samples need is read)")
    with os.fdopen(fd, "rb") as raw, io.TextIOWrapper(raw, encoding="utf-8", newline="") as stream:
        try:
            text = stream.read(-1 if chars is None else chars)
            more = chars is not None and bool(stream.read(1))
        except UnicodeDecodeError as exc:
            raise CalibrationDataError(f"{path}: not UTF-8 text ({exc.reason})") from None
    if more:
        _note_cut(path, 1, chars)
    return 1, text


def _cut(path: Path, number: int, text: str, chars: int | None) -> str:
    if chars is None or len(text) <= chars:
        return text
    _note_cut(path, number, chars, len(text))
    return text[:chars]


def _note_cut(path: Path, number: int, chars: int, total: int | None = None) -> None:
    of = "" if total is None else f" of its {total}"
    log.info(f"note: {path}: row {number}: only its first {chars}{of} characters are tokenized (all that the "
             "--num-samples x --seq-len tokens still wanted can need); the rest is left out")


def max_token_chars(tokenizer) -> int:
    """The most characters one token of ``tokenizer`` can stand for: its longest vocabulary entry (a byte-level
    entry of n symbols is n bytes, at most n characters)."""
    return max((len(piece) for piece in tokenizer.get_vocab(with_added_tokens=True)), default=1)


def _encode(tokenizer, text: str, need: int | None) -> np.ndarray:
    """The token ids of ``text``, in pieces of at most :data:`ENCODE_CHARS` characters: of each piece but the
    last, the tokens that end before its last :data:`CUT_SLACK` characters are kept (the cut changes only
    those after), and the next piece starts where the last kept one ended; stops once ``need`` tokens are
    there (None: all)."""
    ids: list[int] = []
    pos = 0
    while pos < len(text) and (need is None or len(ids) < need):
        piece = text[pos:pos + ENCODE_CHARS]
        encoded = tokenizer.encode(piece, add_special_tokens=False)
        if pos + len(piece) >= len(text):
            ids.extend(encoded.ids)
            break
        keep = 0
        for k, (_, end) in enumerate(encoded.offsets):
            if end > len(piece) - CUT_SLACK:
                break
            keep = k + 1
        if keep == 0:  # one token longer than the piece: taken whole, the next piece after it
            ids.extend(encoded.ids)
            pos += len(piece)
            continue
        ids.extend(encoded.ids[:keep])
        pos += encoded.offsets[keep - 1][1]
    return np.asarray(ids, dtype=np.int64)


def _tokenize(path: Path, folder: Path, vocab_size: int, seq_len: int, num_samples: int | None) -> np.ndarray:
    """Token ids [rows, seq_len] of a .jsonl / .txt: its rows tokenized in order and joined, read and tokenized
    only as far as ``num_samples * seq_len`` tokens need. A row is cut after ``wanted * L + CUT_SLACK``
    characters (``wanted``: the tokens still missing; ``L``: :func:`max_token_chars`; a token covers at most L
    characters, and the slack keeps the cut's last, changed tokens out of the ones taken), with a note."""
    tokenizer_file = folder / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise CalibrationDataError(f"{path}: text needs the checkpoint's tokenizer, and {folder} has no "
                                   "tokenizer.json (give token ids in an .npz instead)")
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_file(str(tokenizer_file))
    except Exception as exc:  # noqa: BLE001 - the tokenizers package raises its own Exception type
        raise CalibrationDataError(f"{tokenizer_file}: the tokenizers package cannot read it ({exc})") from None
    wanted = None if num_samples is None else num_samples * seq_len
    per_token = max_token_chars(tokenizer)
    parts: list[np.ndarray] = []
    count = 0

    def chars() -> int | None:  # never past what a .txt is read whole (a .jsonl row has its own ROW_LIMIT)
        return None if wanted is None else min((wanted - count) * per_token + CUT_SLACK, TEXT_LIMIT)

    rows = [_txt_row(path, chars())] if path.suffix == ".txt" else _jsonl_rows(path, chars)
    last_read = None  # the row where the samples were complete (None: every row was read)
    for number, text in rows:
        ids = _encode(tokenizer, text, None if wanted is None else wanted - count)
        bad = ids[(ids < 0) | (ids >= vocab_size)]
        if bad.size:
            raise CalibrationDataError(f"{path}: row {number}: token id {int(bad[0])} from {tokenizer_file.name} "
                                       f"is outside the model's vocabulary [0, {vocab_size})")
        parts.append(ids if wanted is None else ids[: wanted - count])
        count += parts[-1].size
        if wanted is not None and count >= wanted:
            last_read = (number, ids.size - parts[-1].size)
            break
    stream = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    rows_made = stream.size // seq_len
    if rows_made == 0:
        raise CalibrationDataError(f"{path}: {stream.size} tokens, fewer than one sequence of --seq-len {seq_len}")
    if num_samples is not None:
        rows_made = min(rows_made, num_samples)
    _note_dropped(path, rows_made, seq_len, num_samples, stream.size - rows_made * seq_len, last_read)
    return stream[: rows_made * seq_len].reshape(rows_made, seq_len)


def _note_dropped(path: Path, rows: int, seq_len: int, num_samples: int | None, tail: int,
                  last_read: tuple[int, int] | None) -> None:
    """A note of the text that --seq-len x --num-samples left out: past the samples (``last_read``: the row
    that completed them and how many of its tokens were not taken), or a tail too short for a sequence."""
    taken = f"{rows} sequence(s) of --seq-len {seq_len} ({rows * seq_len} tokens) taken"
    if last_read is not None:
        number, rest = last_read
        log.info(f"note: {path}: {taken}; left out: {rest} more tokens of row {number} and every row after it "
                 "(--num-samples x --seq-len sets how much of the text is used)")
    elif tail:
        short = f", fewer than the --num-samples {num_samples} asked" if num_samples and rows < num_samples else ""
        log.info(f"note: {path}: {taken}{short}; left out: the last {tail} tokens, too few for another sequence")


def _refuse_links_out(folder: Path, files: list[Path]) -> None:
    """A data folder's entry that is a symlink to a file outside the folder is refused before anything is read,
    as a checkpoint folder's are (:mod:`fp4pass.safetensors.catalog`): the folder given is what is read."""
    base = os.path.realpath(folder)
    for file in files:
        if os.path.islink(file):
            real = os.path.realpath(file)
            if os.path.commonpath([real, base]) != base:
                raise CalibrationDataError(f"{file}: is a symlink to {real}, outside the data folder {folder}; only "
                                           "files inside it are read (copy the file in, or give it as --data itself)")


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
        _refuse_links_out(path, files)
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
