"""JSON out (strict RFC 8259: no NaN or Infinity) and JSON in (one strict reader for every file a stranger
hands in: bounded in size and depth, no key twice, no NaN/Infinity, valid Unicode)."""

from __future__ import annotations

import json

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

