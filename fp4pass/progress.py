"""Progress bars on stderr (tqdm), the one place fp4pass draws them: counts with rate and ETA for items
(calibration batches, diff chunks, study scenarios), bytes with rate for writing a model.

Silent when ``enabled`` is False (``--quiet``) and, when it is None, whenever stderr is not a terminal.
"""

from __future__ import annotations

import shutil
import sys
from typing import Iterable, Iterator, TypeVar

from tqdm import tqdm

T = TypeVar("T")

__all__ = ["progress", "byte_progress"]


def _size() -> dict:
    """The terminal's size, 100 x 20 where it reports none (tqdm hides every bar on a terminal of size 0)."""
    size = shutil.get_terminal_size((100, 20))
    return {"ncols": size.columns or 100, "nrows": size.lines or 20}


def _enabled(enabled: bool | None) -> bool:
    return sys.stderr.isatty() if enabled is None else bool(enabled)


def progress(items: Iterable[T], total: int | None = None, desc: str = "", enabled: bool | None = None,
             unit: str = "it") -> Iterator[T]:
    """Yield ``items`` under a bar ``desc  40%|####    | 4/10 [00:02<00:03, 1.9 batch/s]`` on stderr."""
    if not _enabled(enabled):
        yield from items
        return
    with tqdm(items, total=total, desc=desc, unit=unit, file=sys.stderr, leave=True, **_size()) as bar:
        yield from bar


def byte_progress(total_bytes: int, desc: str = "", enabled: bool | None = None) -> tqdm:
    """A bar counting bytes (``bar.update(n)``) with rate in B/s, KiB/s, ...; a disabled one when silent.
    Use it as a context manager (it is closed on exit)."""
    return tqdm(total=total_bytes, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
                disable=not _enabled(enabled), **_size())
