"""Dims and values for the graph inputs a diff draws itself, read from the graph's own input shapes.

A decoder exported with a KV cache (onnxruntime-genai's model builder, the torch exporter with ``past_key_values``)
declares inputs such as ``input_ids [batch_size, sequence_length]``, ``attention_mask [batch_size,
total_sequence_length]`` and ``past_key_values.0.key [batch_size, kv_heads, past_sequence_length, kv_cache_dim]``.
Drawn one by one with every symbolic dim 1, these disagree with each other and the attention kernels refuse them.
:func:`plan_feeds` makes them agree:

- a symbolic dim takes the value it has in an array the user gave (``--inputs``) or in a ``--shape``, wherever the
  same name appears (``batch_size`` of ``input_ids`` is ``batch_size`` of every past key);
- a dim named ``past...`` is the past length: 0 (a prompt with an empty cache) or the length the user names
  (a GroupQueryAttention with ``sliding_window_cache`` reads a ring buffer of at least ``local_window_size``);
- a dim named ``total...`` is past length + the dim named by the rest of its name (``total_sequence_length`` =
  past + ``sequence_length``, 1 when that is not known either);
- the head dim of a past key/value that ``com.microsoft::GroupQueryAttention`` or ``MultiHeadAttention`` reads is
  that node's: the query width / num_heads (for GroupQueryAttention with packed QKV, the width /
  (num_heads + 2 kv_num_heads));
- an integer ``attention_mask`` is all ones (every position attends), an integer ``position_ids`` counts on from
  the past length: random integers there would be no sequence at all.

Any other symbolic dim is 1 (the same wherever its name appears), and a note names it.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from fp4pass.formats.constants import MS_DOMAIN as _MS

__all__ = ["plan_feeds", "dims_mismatch", "kv_cache_pairs"]

# input positions of the past key and value in onnxruntime's attention contrib ops
_PAST_INPUTS = {"GroupQueryAttention": (3, 4), "MultiHeadAttention": (6, 7)}


# (past input, present output) positions of the attention contrib ops whose present may be the past's buffer
_PAST_PRESENT = {"GroupQueryAttention": ((3, 1), (4, 2)), "MultiHeadAttention": ((6, 1), (7, 2))}


def kv_cache_pairs(model: ir.Model) -> dict[str, str]:
    """``{present output: past input}`` for each graph output an attention contrib op writes from a graph input
    it reads as its past key/value. A past buffer longer than the tokens (a sliding-window ring buffer,
    onnxruntime-genai's shared past/present buffer) gives a present of the past's shape of which the kernel
    writes only the new token rows: a diff must give those outputs a defined buffer (fp4pass.onnx.numerics)."""
    inputs = {v.name for v in model.graph.inputs if v.const_value is None}
    outputs = {v.name for v in model.graph.outputs}
    pairs = {}
    for node in model.graph:
        if node.domain != _MS:
            continue
        for past_at, present_at in _PAST_PRESENT.get(node.op_type, ()):
            past = node.inputs[past_at] if len(node.inputs) > past_at else None
            present = node.outputs[present_at] if len(node.outputs) > present_at else None
            if past is not None and present is not None and past.name in inputs and present.name in outputs:
                pairs[present.name] = past.name
    return pairs


def _head_size(value: ir.Value) -> int | None:
    """The head dim of a past key/value read by an attention contrib op, from the op's query width."""
    for usage in value.uses():
        node = usage.node
        if node.domain != _MS or usage.idx not in _PAST_INPUTS.get(node.op_type, ()):
            continue
        query = node.inputs[0] if node.inputs else None
        heads = node.attributes.get("num_heads")
        if query is None or query.shape is None or heads is None or not isinstance(query.shape[-1], int):
            continue
        width, heads = query.shape[-1], heads.value
        if node.op_type == "GroupQueryAttention" and (len(node.inputs) < 2 or node.inputs[1] is None):
            kv = node.attributes.get("kv_num_heads")
            heads += 2 * (kv.value if kv is not None else heads)  # packed Q, K, V
        if heads > 0 and width % heads == 0:
            return width // heads
    return None


def _window_capacity(value: ir.Value) -> int | None:
    """The cache capacity a GroupQueryAttention with ``sliding_window_cache`` needs: its ``local_window_size``
    (the past key/value is then a ring buffer of that length, whatever the past length)."""
    for usage in value.uses():
        node = usage.node
        if node.domain != _MS or node.op_type != "GroupQueryAttention" or usage.idx not in (3, 4):
            continue
        ring = node.attributes.get("sliding_window_cache")
        window = node.attributes.get("local_window_size")
        if ring is not None and ring.value and window is not None and window.value > 0:
            return int(window.value)
    return None


def plan_feeds(model: ir.Model, given: dict, shapes: dict, past_length: int = 0,
               notes: list[str] | None = None) -> tuple[dict, dict]:
    """``(given, shapes)`` completed for ``model``'s graph inputs (module docstring): arrays for the mask and
    positions, full dims for every input whose symbolic dims the rules settle. What the user gave wins."""
    notes = notes if notes is not None else []
    given, shapes = dict(given), dict(shapes)
    bound: dict[str, int] = {}
    for value in model.graph.inputs:
        dims = shapes.get(value.name)
        if dims is None and value.name in given:
            dims = np.shape(given[value.name])
        if dims is None or value.shape is None or len(dims) != len(value.shape):
            continue
        for d, n in zip(value.shape, dims):
            if not isinstance(d, int) and d.value:
                bound.setdefault(str(d.value), int(n))

    def settle(value: ir.Value, i: int, name: str) -> int | None:
        if name in bound:
            return bound[name]
        lowered = name.lower()
        if lowered.startswith("past") or "_past" in lowered:
            return max(past_length, _window_capacity(value) or 0)
        if lowered.startswith("total"):
            rest = name[len("total"):].lstrip("_")
            return past_length + bound.get(rest, 1)
        if i == len(value.shape) - 1:
            return _head_size(value)
        return None

    made, defaulted, kv = [], [], []
    for value in model.graph.inputs:
        if value.name in given or value.name in shapes or value.const_value is not None or value.shape is None:
            continue
        dtype = value.dtype.numpy() if value.dtype is not None else None
        lowered = value.name.lower()
        special = (dtype is not None and np.issubdtype(dtype, np.integer)
                   and lowered.endswith(("attention_mask", "position_ids")))
        if not special and all(isinstance(d, int) for d in value.shape):
            continue
        dims = []
        for i, d in enumerate(value.shape):
            if isinstance(d, int):
                dims.append(d)
                continue
            name = str(d.value) if d.value else f"{value.name}[{i}]"
            settled = settle(value, i, name)
            if settled is None:
                settled = 1
                defaulted.append(name)
            if d.value and name not in bound:
                bound[name] = settled  # every input naming this dim gets the same value
            if "past" in name.lower():
                kv.append(value.name)
            dims.append(settled)
        if special and lowered.endswith("attention_mask"):
            given[value.name] = np.ones(dims, dtype)
            made.append(f"{value.name} {list(dims)} all ones")
        elif special:
            given[value.name] = np.broadcast_to(past_length + np.arange(dims[-1], dtype=dtype), dims).copy()
            made.append(f"{value.name} {list(dims)} from {past_length}")
        else:
            shapes[value.name] = tuple(dims)
            if value.name in kv:
                made.append(f"{value.name} {list(dims)}")
    if defaulted:
        notes.append(f"symbolic dims {list(dict.fromkeys(defaulted))} taken as 1 (give an input's dims with "
                     "--shape NAME=D0,D1,...)")
    if made:
        notes.append(f"inputs made from the graph's own shapes (past length {past_length}): {', '.join(made)}")
    return given, shapes


def dims_mismatch(dims: tuple, shape) -> str | None:
    """Why an array of ``dims`` cannot feed a graph input of ``shape`` (``onnx_ir`` dims: ints and symbols):
    its rank, or the first static dim that differs, with the index, what it got and what the input wants;
    None when it fits. Checked before onnxruntime runs, whose own message names neither."""
    if shape is None:
        return None
    wanted = [str(d) for d in shape]
    if len(dims) != len(shape):
        return f"has rank {len(dims)} {list(dims)}, graph input wants rank {len(shape)} {wanted}"
    for axis, (got, want) in enumerate(zip(dims, shape)):
        if isinstance(want, int) and got != want:
            return f"dim {axis} is {got}, graph input wants {want} (shape {wanted})"
    return None
