"""torch's own chatter during the fx stages, silenced where fp4pass triggers it (never process-wide).

Two messages say nothing about the user's model and are not theirs to act on:

- ``FutureWarning: `isinstance(treespec, LeafSpec)` is deprecated``: torch 2.13's pytree warns whenever an
  ``ExportedProgram``'s call graph is deep-copied (``fx.calibrate`` copies it; ``torch.onnx.export`` runs
  decompositions that copy it);
- ``torchvision is not installed. Skipping torchvision::nms`` (and three more ops): ``torch.onnx.export``
  registering its translation table.

:func:`quiet_torch` drops exactly these for the duration of a block; every other warning and log line passes.
"""

from __future__ import annotations

import contextlib
import logging
import warnings

__all__ = ["quiet_torch"]

LEAF_SPEC_WARNING = r"`isinstance\(treespec, LeafSpec\)` is deprecated"
#: the logger torch.onnx's exporter registers its translation table under
REGISTRATION_LOGGER = "torch.onnx._internal.exporter._registration"


class _NoTorchvisionNotes(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "torchvision is not installed" not in record.getMessage()


@contextlib.contextmanager
def quiet_torch():
    """Inside the block: no LeafSpec FutureWarning, no "torchvision is not installed" log lines."""
    logger = logging.getLogger(REGISTRATION_LOGGER)
    note_filter = _NoTorchvisionNotes()
    logger.addFilter(note_filter)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=LEAF_SPEC_WARNING, category=FutureWarning)
            yield
    finally:
        logger.removeFilter(note_filter)
