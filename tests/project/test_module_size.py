"""No module of fp4pass is over 600 lines: a module that grows past it holds more than one concern (split it by
concern, as docs/layout.md lays the packages out)."""

from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "fp4pass"
LIMIT = 600


def _lines() -> dict[str, int]:
    return {str(p.relative_to(PACKAGE.parent)): len(p.read_text().splitlines()) for p in sorted(PACKAGE.rglob("*.py"))}


def test_no_module_is_over_600_lines():
    over = {name: n for name, n in _lines().items() if n > LIMIT}
    assert over == {}, f"split these by concern: {over}"
