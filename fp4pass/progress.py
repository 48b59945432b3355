"""A minimal progress bar on stderr for long work; silent when stderr is not a TTY or with ``--quiet``."""

from __future__ import annotations

import sys
import time
from typing import Iterable, Iterator, TypeVar

T = TypeVar("T")

__all__ = ["progress"]


def progress(items: Iterable[T], total: int | None = None, desc: str = "", enabled: bool | None = None) -> Iterator[T]:
    """Yield ``items``, drawing ``desc [#####     ] i/total elapsed`` on stderr at most 10 times a second."""
    if enabled is None:
        enabled = sys.stderr.isatty()
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    if not enabled:
        yield from items
        return
    start = last = time.monotonic()
    count = 0

    def draw(final: bool = False) -> None:
        elapsed = time.monotonic() - start
        if total:
            filled = int(30 * count / total)
            bar = f"[{'#' * filled}{' ' * (30 - filled)}] {count}/{total}"
        else:
            bar = f"{count}"
        sys.stderr.write(f"\r{desc} {bar} {elapsed:.1f}s" + ("\n" if final else ""))
        sys.stderr.flush()

    for item in items:
        yield item
        count += 1
        now = time.monotonic()
        if now - last > 0.1:
            draw()
            last = now
    draw(final=True)
