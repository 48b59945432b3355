"""What an ONNX file says, checked before any later code trusts it (:func:`validate_proto`).

Each failure is a :class:`~fp4pass.errors.ModelError` naming the graph, tensor or node: strings that are not
UTF-8 (protobuf hands those back as bytes); data types of tensors and attributes that are UNDEFINED or unknown;
negative dims; ``raw_data`` (or typed data) whose length is not what the dims and data type need;
external-data entries (``location`` a non-empty relative path, ``offset``/``length`` decimal numbers); duplicate
initializer, input, output or node-output names; nodes with no outputs, or (for ops ONNX defines) inputs or
outputs outside their schema's counts. :func:`graph_protos` walks a graph and its subgraphs, each with a
label for messages. :mod:`fp4pass.onnx.loading` runs these on every model it loads.
"""

from __future__ import annotations

import onnx
import onnx_ir as ir

from fp4pass.errors import ModelError

__all__ = ["validate_proto", "graph_protos"]

_T = onnx.TensorProto
_KNOWN_TYPES = {v for _, v in _T.DataType.items()} - {_T.UNDEFINED}
_ATTRIBUTE_TYPES = {v for _, v in onnx.AttributeProto.AttributeType.items()} - {onnx.AttributeProto.UNDEFINED}
_INT32_FIELD = {_T.INT8, _T.UINT8, _T.INT16, _T.UINT16, _T.INT32, _T.BOOL, _T.FLOAT16, _T.BFLOAT16}


def _string_issue(message, where: str) -> str | None:
    """The first string field (recursively) that is not valid UTF-8: protobuf hands those back as bytes."""
    from google.protobuf.descriptor import FieldDescriptor

    for field, value in message.ListFields():
        if field.type == FieldDescriptor.TYPE_STRING:
            for item in ([value] if isinstance(value, (str, bytes)) else value):
                if not isinstance(item, str):
                    return f"{where}.{field.name} is not valid UTF-8 ({bytes(item)[:40]!r})"
                if "\x00" in item:
                    return f"{where}.{field.name} holds a NUL character"
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            items = [value] if hasattr(value, "ListFields") else value
            for i, item in enumerate(items):
                label = getattr(item, "name", "") or (getattr(item, "op_type", "") if isinstance(item, onnx.NodeProto) else "")
                found = _string_issue(item, f"{where}.{field.name}[{label or i}]")
                if found:
                    return found
    return None


def _tensor_issue(tensor: onnx.TensorProto) -> str | None:
    """Why ``tensor``'s fields do not fit together, or None."""
    if tensor.data_type not in _KNOWN_TYPES:
        kind = "UNDEFINED" if tensor.data_type == _T.UNDEFINED else f"unknown ({tensor.data_type})"
        return f"data type {kind}"
    dims = list(tensor.dims)
    if any(d < 0 for d in dims):
        return f"negative dim in {dims}"
    count = 1
    for d in dims:
        count *= d
    if count > 2**62:
        return f"dims {dims} are too large"
    dtype = ir.DataType(tensor.data_type)
    if tensor.data_location == _T.EXTERNAL:
        if dtype == ir.DataType.STRING:
            return "a STRING tensor cannot be stored as external data"
        entries = {}
        for entry in tensor.external_data:
            if entry.key in entries:
                return f"external data key {entry.key!r} given twice"
            entries[entry.key] = entry.value
        location = entries.get("location")
        if not location:
            return "external data without a location"
        for key in ("offset", "length"):
            if key in entries and not (entries[key].isascii() and entries[key].isdigit()):
                return f"external data {key} {entries[key]!r} is not a non-negative integer"
        return None
    if dtype == ir.DataType.STRING:
        if tensor.HasField("raw_data"):
            return "a STRING tensor cannot hold raw_data"
        have, need = len(tensor.string_data), count
    else:
        need_bytes = -(-count * dtype.bitwidth // 8)
        if tensor.HasField("raw_data"):
            if len(tensor.raw_data) != need_bytes:
                return (f"raw_data holds {len(tensor.raw_data)} bytes, {dtype.name} {dims} needs {need_bytes}")
            return None
        if tensor.data_type == _T.FLOAT:
            have, need = len(tensor.float_data), count
        elif tensor.data_type == _T.COMPLEX64:
            have, need = len(tensor.float_data), 2 * count
        elif tensor.data_type == _T.DOUBLE:
            have, need = len(tensor.double_data), count
        elif tensor.data_type == _T.COMPLEX128:
            have, need = len(tensor.double_data), 2 * count
        elif tensor.data_type == _T.INT64:
            have, need = len(tensor.int64_data), count
        elif tensor.data_type in (_T.UINT32, _T.UINT64):
            have, need = len(tensor.uint64_data), count
        elif tensor.data_type in _INT32_FIELD:
            have, need = len(tensor.int32_data), count
        else:  # 8-bit floats one per int32; 4- and 2-bit types packed into them
            have = len(tensor.int32_data)
            need = count if dtype.bitwidth >= 8 else -(-count * dtype.bitwidth // 8)
    if have != need and not (have == 0 and need == 0):
        return f"holds {have} values, {dtype.name} {dims} needs {need}"
    return None


def graph_protos(graph: onnx.GraphProto, where: str):
    """``graph`` and every subgraph in its nodes' attributes, each with a label for messages."""
    yield graph, where
    for node in graph.node:
        for attr in node.attribute:
            subs = list(attr.graphs) + ([attr.g] if attr.HasField("g") else [])
            for sub in subs:
                yield from graph_protos(sub, f"{where}/node {node.name or node.op_type!r} attribute {attr.name!r}")


def _arity_issue(node: onnx.NodeProto, opsets: dict[str, int]) -> str | None:
    """Inputs and outputs a node has against its schema (for ops ONNX knows); a node always has an output."""
    if not node.output:
        return "has no outputs"
    domain = "" if node.domain in ("", "ai.onnx") else node.domain
    try:
        schema = onnx.defs.get_schema(node.op_type, opsets.get(domain, opsets.get("ai.onnx", 1)), domain)
    except Exception:  # noqa: BLE001 - an op ONNX does not know (custom domains): nothing to compare with
        return None
    inputs, outputs = len(node.input), len(node.output)
    if not schema.min_input <= inputs <= schema.max_input:
        return f"{node.op_type} takes {schema.min_input}..{schema.max_input} inputs, not {inputs}"
    if not schema.min_output <= outputs <= schema.max_output:
        return f"{node.op_type} gives {schema.min_output}..{schema.max_output} outputs, not {outputs}"
    return None


def validate_proto(proto: onnx.ModelProto, where: str) -> None:
    """Refuse a model whose fields contradict each other (module docstring); raises :class:`ModelError`."""
    issue = _string_issue(proto, "model")
    if issue:
        raise ModelError(f"{where}: {issue}")
    opsets = {o.domain: o.version for o in proto.opset_import}
    for graph, label in graph_protos(proto.graph, "graph"):
        names: set[str] = set()
        for tensor in graph.initializer:
            issue = _tensor_issue(tensor)
            if issue:
                raise ModelError(f"{where}: {label}: initializer {tensor.name!r}: {issue}")
            if tensor.name in names:
                raise ModelError(f"{where}: {label}: initializer {tensor.name!r} defined twice")
            names.add(tensor.name)
        inputs: set[str] = set()
        for value in graph.input:
            if value.name in inputs:
                raise ModelError(f"{where}: {label}: graph input {value.name!r} listed twice")
            inputs.add(value.name)
        produced = inputs | names
        for node in graph.node:
            for attr in node.attribute:
                if attr.type not in _ATTRIBUTE_TYPES:
                    raise ModelError(f"{where}: {label}: node {node.name or node.op_type!r} attribute "
                                     f"{attr.name!r}: type {attr.type} is {'UNDEFINED' if attr.type == 0 else 'unknown'}")
                tensors = list(attr.tensors) + ([attr.t] if attr.HasField("t") else [])
                for tensor in tensors:
                    issue = _tensor_issue(tensor)
                    if issue:
                        raise ModelError(f"{where}: {label}: node {node.name or node.op_type!r} attribute "
                                         f"{attr.name!r}: {issue}")
            issue = _arity_issue(node, opsets)
            if issue:
                raise ModelError(f"{where}: {label}: node {node.name or node.op_type!r}: {issue}")
            for out in node.output:
                if not out:
                    continue
                if out in produced:
                    raise ModelError(f"{where}: {label}: tensor {out!r} (output of node "
                                     f"{node.name or node.op_type!r}) is defined twice")
                produced.add(out)
        outputs: set[str] = set()
        for value in graph.output:
            if value.name in outputs:
                raise ModelError(f"{where}: {label}: graph output {value.name!r} listed twice")
            outputs.add(value.name)
