"""Optional dependencies (pyproject extras): imported when a feature needs them, with a one-line install hint.

- ``plot``: matplotlib, for ``fp4pass diff --plot`` and ``plot_diff``;
- ``graphsurgeon``: onnx-graphsurgeon, for ``onnx_graphsurgeon.Graph`` inputs and outputs;
- ``gpt-oss``: transformers, for ``fp4pass.fx.load_gpt_oss``.
"""

from __future__ import annotations

import importlib

from fp4pass.errors import UsageError

__all__ = ["require"]

_DISTRIBUTIONS = {"matplotlib": "matplotlib", "onnx_graphsurgeon": "onnx-graphsurgeon", "transformers": "transformers",
                  "compressed_tensors": "compressed-tensors"}


def require(module: str, extra: str, feature: str):
    """Import ``module``, or raise :class:`UsageError` naming ``feature`` and the extra that installs it.

    Only a missing ``module`` (or its top-level package) becomes the usage error; a broken installation (a
    module that fails while importing, or one of its own missing dependencies) raises as it is.
    """
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        top = module.partition(".")[0]
        if exc.name not in (module, top):
            raise
        dist = _DISTRIBUTIONS.get(top, top)
        raise UsageError(f"{feature} needs {dist}, which is not installed: pip install 'fp4pass[{extra}]'") from None
