"""Initializers that are also listed as graph inputs, and what fp4pass makes of them.

Some exporters list every initializer among the graph inputs as well (NVIDIA ModelOpt's ONNX exporter, the
TorchScript exporter with ``keep_initializers_as_inputs=True``; IR < 4 required it). Such an input is
optional: a feed for it overrides the stored value, and without one onnxruntime uses the initializer. fp4pass
does the same: an initializer listed as an input that nobody feeds is an initializer, so its FP4 weight
converts and lowers like any other. :func:`unlist_initializer_inputs` takes those names off the input list
(the values and their initializers stay) and returns them, for the report or a note.
"""

from __future__ import annotations

import onnx_ir as ir

__all__ = ["unlist_initializer_inputs", "initializer_inputs"]

# IR 3 and below: every initializer must also be a graph input
_FIRST_IR_WITHOUT_THE_RULE = 4


def initializer_inputs(model: ir.Model, fed=()) -> list[ir.Value]:
    """The main graph's inputs that are also its initializers and are not in ``fed`` (names of given feeds)."""
    graph = model.graph
    fed = set(fed)
    return [v for v in graph.inputs
            if v.name not in fed and v.const_value is not None and graph.initializers.get(v.name) is v]


def unlist_initializer_inputs(model: ir.Model, fed=()) -> list[str]:
    """Take every initializer that is also an unfed graph input off the input list, in place (module
    docstring); returns their names. A model of IR < 4, which must list them, is left as it is."""
    if model.ir_version is not None and model.ir_version < _FIRST_IR_WITHOUT_THE_RULE:
        return []
    found = initializer_inputs(model, fed)
    for value in found:
        model.graph.inputs.remove(value)
    return [v.name for v in found]
