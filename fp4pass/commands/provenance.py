"""Who wrote a JSON file, and from what: every JSON the commands write starts with ``"fp4pass": {"version",
"command"}`` and, for a checkpoint or model, ``"source"`` (the path or Hub ID as given, ``org/name@rev``
included) and ``"revision"`` (the commit of the Hub snapshot read, None for a local folder or file).

Why: a report or SCALES.json outlives the run; without these a reader cannot tell which fp4pass, which
checkpoint revision or which flags made it. Readers of SCALES.json read ``calibrator`` and ``tensors`` only, so
the key is ignored where a file is read back.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path

from fp4pass import __version__

KEY = "fp4pass"


def provenance(args, with_source: bool = True) -> dict:
    """``{"version", "command"[, "source", "revision"]}`` of this run (``args`` as :mod:`fp4pass.cli` parsed it)."""
    who = {"version": __version__, "command": shlex.join(["fp4pass", *getattr(args, "argv", [])])}
    given = getattr(args, "given_model", None)
    if with_source and given is not None:
        resolved = Path(os.fspath(getattr(args, "model", given)))
        from_hub = os.fspath(given) != os.fspath(resolved) and resolved.parent.name == "snapshots"
        who.update(source=os.fspath(given), revision=resolved.name if from_hub else None)
    return who


def stamped(data: dict, args, with_source: bool = True) -> dict:
    """``data`` with the :func:`provenance` of this run first, under ``"fp4pass"``."""
    return {KEY: provenance(args, with_source), **data}
