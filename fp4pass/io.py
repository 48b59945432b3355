"""Writing outputs safely: never a partial file, never the input overwritten.

Every file fp4pass writes goes through :func:`atomic_output`: the writer fills a temporary file in the
target's own folder (same filesystem), and only a writer that finished is renamed onto the target. A crash,
an error or Ctrl-C leaves the target as it was.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Iterator

from fp4pass.errors import UsageError

__all__ = ["atomic_output", "write_json", "refuse_overwrite"]


def refuse_overwrite(output: str | os.PathLike, *inputs: str | os.PathLike) -> None:
    """Raise :class:`UsageError` if ``output`` is one of ``inputs`` (the same file, by path or inode)."""
    out = Path(output).resolve()
    for given in inputs:
        src = Path(given).resolve()
        if out == src or (out.exists() and src.exists() and os.path.samefile(out, src)):
            raise UsageError(f"{output}: refusing to write over the input {given}")


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike, suffix: str = "") -> Iterator[Path]:
    """Yield a temporary path beside ``path``; rename it onto ``path`` only if the block finishes."""
    target = Path(path)
    folder = target.parent if str(target.parent) else Path(".")
    if not folder.is_dir():
        raise UsageError(f"{path}: folder {folder} does not exist")
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=suffix + ".tmp", dir=folder)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        os.replace(tmp_path, target)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


def write_json(path: str | os.PathLike, data) -> None:
    """Write ``data`` as indented JSON, atomically."""
    with atomic_output(path) as tmp:
        tmp.write_text(json.dumps(data, indent=2, allow_nan=False) + "\n")
