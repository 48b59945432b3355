"""JSON out (strict RFC 8259: no NaN or Infinity) and JSON in (one strict reader for every file a stranger
hands in: configs, indexes, safetensors headers, Hub indexes, calibration rows, SCALES.json; bounded in size,
depth and integer digits, no key twice, no NaN/Infinity, valid Unicode)."""

from __future__ import annotations

import json
import re

#: the key under which :func:`json_text` lists the places of the non-finite numbers it wrote as null
NON_FINITE_NOTE = "non_finite_as_null"
_NOTE_PLACES = 100


def finite_json(data, path: str = "$") -> tuple[object, list[str]]:
    """(``data`` with every non-finite float (NaN, Infinity, -Infinity; numpy's float64 too) replaced by None,
    the places replaced as ``$.modules[3].global_scale: nan``). Dicts, lists and tuples are copied where they
    hold one; everything else is returned as it is."""
    places: list[str] = []

    def walk(value, where: str):
        if isinstance(value, float):
            if value != value or value in (float("inf"), float("-inf")):
                places.append(f"{where}: {value!r}")
                return None
            return value
        if isinstance(value, dict):
            return {k: walk(v, f"{where}.{k}") for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [walk(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return value

    return walk(data, path), places


def json_text(data, indent: int | None = 2) -> str:
    """``data`` as strict JSON (RFC 8259: no NaN or Infinity, which strict readers refuse): each non-finite
    number is written as null, and an object gets the key :data:`NON_FINITE_NOTE` listing where (at most
    100 places, then how many more)."""
    clean, places = finite_json(data)
    if places and isinstance(clean, dict):
        more = [f"... and {len(places) - _NOTE_PLACES} more"] if len(places) > _NOTE_PLACES else []
        clean[NON_FINITE_NOTE] = places[:_NOTE_PLACES] + more
    return json.dumps(clean, indent=indent, allow_nan=False)



# -- reading JSON a stranger hands in ---------------------------------------------------------------------

#: the deepest nesting of arrays and objects :func:`strict_json` reads; real configs, indexes, tokenizers and
#: SCALES.json nest under 10 deep, and past about 1000 Python's parser (and every walk of the result) raises
#: RecursionError far from the file
JSON_MAX_DEPTH = 64
# a string literal (its escapes included): what lies between strings is the structure
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.S)
#: the most digits a JSON integer may have: FP32's largest value, 3.4e38, needs 39, and no count, size or offset
#: of a checkpoint needs 21; Python spends quadratic time on thousands of digits, and refuses past 4300
JSON_INT_MAX_DIGITS = 40
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def no_duplicate_keys(pairs):
    """``json.loads``' ``object_pairs_hook``: a dict, or ValueError when a key is given twice."""
    out = {}
    for key, value in pairs:
        if key in out:  # json.loads would keep the last and hide the first (a NaN amax before a good one)
            raise ValueError(f"duplicate key {key!r} appears twice in one object")
        out[key] = value
    return out


def _bounded_int(digits: str) -> int:
    count = len(digits.lstrip("-"))
    if count > JSON_INT_MAX_DIGITS:
        raise ValueError(f"an integer of {count} digits; at most {JSON_INT_MAX_DIGITS}")
    return int(digits)


def json_depth(raw: bytes) -> int:
    """How deep the arrays and objects of the JSON text ``raw`` nest (brackets inside strings do not count), in
    time and memory linear in ``len(raw)``: the bracket sequence's running sum, in numpy where it is long."""
    brackets = _STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    if len(brackets) < 4096:
        depth = deepest = 0
        for byte in brackets:
            depth += 1 if byte in b"[{" else -1
            deepest = max(deepest, depth)
        return deepest
    import numpy as np

    codes = np.frombuffer(brackets, dtype=np.uint8)
    steps = np.where((codes == ord("[")) | (codes == ord("{")), 1, -1).astype(np.int64)
    return int(np.cumsum(steps).max(initial=0))


def strict_json(raw: bytes, max_depth: int = JSON_MAX_DEPTH):
    """Parse UTF-8 JSON a stranger handed in: no key twice, no NaN/Infinity, no integer of more than
    :data:`JSON_INT_MAX_DIGITS` digits, no string that is not valid Unicode (a lone surrogate escape such as
    ``\\ud800``, which no UTF-8 writer can write back), nested at most ``max_depth`` deep (checked before the
    parse). ValueError says why (UnicodeDecodeError, a ValueError, for bytes that are not UTF-8); a key given
    twice is named before a NaN among its values. The caller bounds the size (it reads the file with
    :func:`fp4pass.io.read_regular_file` or :func:`fp4pass.io.open_regular` and a limit)."""
    depth = json_depth(raw)
    if depth > max_depth:
        raise ValueError(f"arrays and objects nested {depth} deep; at most {max_depth} are read")
    constants: list[str] = []

    def constant(name: str) -> float:
        constants.append(name)  # refused after the parse, so that a duplicate key holding it is named first
        return float("nan")

    data = json.loads(raw.decode("utf-8"), object_pairs_hook=no_duplicate_keys, parse_constant=constant,
                      parse_int=_bounded_int)
    if constants:
        raise ValueError(f"{constants[0]} is not a JSON number")
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = exc.object[max(exc.start - 20, 0):exc.end + 20] if isinstance(exc.object, str) else ""
        raise ValueError(f"a string holds a lone surrogate, not valid Unicode (near {bad!r})") from None
    return data


def read_small_json(path, limit: int, max_depth: int):
    """The JSON of ``path`` when it is a regular file of at most ``limit`` bytes, opened without following a
    link and without blocking on a FIFO, nested at most ``max_depth`` deep; None for anything else (no such
    file, a link, a device, too large, not strict JSON). For the small files fp4pass itself leaves (output
    markers, temporaries' markers, swap states), which a stranger may have replaced."""
    import os
    import stat

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        return None if size > limit else strict_json(b"".join(chunks), max_depth=max_depth)
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
