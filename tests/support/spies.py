"""Spies that tests put in place of a library function with ``monkeypatch``, recording how it was called."""

from __future__ import annotations


def spy_conversion_options(monkeypatch, module) -> list[tuple]:
    """Wrap ``module.mxfp4_to_nvfp4`` (the name a caller looks up); the list it returns receives the
    ``(effort, threads)`` keyword arguments of every call, which still runs the real conversion."""
    seen: list[tuple] = []
    real = module.mxfp4_to_nvfp4

    def spy(mx, *args, **kwargs):
        seen.append((kwargs.get("effort"), kwargs.get("threads")))
        return real(mx, *args, **kwargs)

    monkeypatch.setattr(module, "mxfp4_to_nvfp4", spy)
    return seen
