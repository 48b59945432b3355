"""Reading and writing models safely, with external data kept on disk until it is needed.

Accepted inputs (:func:`load`): a path, an ``onnx.ModelProto``, an ``onnx_ir.Model`` or an onnx-graphsurgeon
``Graph``; :func:`to_kind` turns the rewritten ``onnx_ir.Model`` back into the kind given.

Safety checks on external data (:func:`check_external_data`), run for every kind of input, on every tensor
stored outside the file: initializers and tensor attributes (``Constant`` values), in the main graph, its
subgraphs and local functions (:func:`external_tensors`). Each failure is an
:class:`~fp4pass.errors.UnsafeExternalDataError` naming the tensor and the reason:

1. a ``location`` that is absolute or leaves the model's folder (``../``, or a symlink resolving outside it:
   CVE-2022-25882, CVE-2024-27318), compared as paths (``model_evil/`` is not inside ``model/``);
2. a data file that is missing, or shorter than ``offset + length`` (truncated);
3. a ``length`` that differs from what the tensor's dtype and shape need.

The model's folder is the file's own for a path, whatever the working folder. An ``onnx.ModelProto`` or a
graphsurgeon ``Graph`` has no folder: external data in one is refused unless the caller names the folder
(``base_dir``). An ``onnx_ir.Model`` keeps a folder per tensor (``ir.load`` sets it to the file's); a tensor
with none is refused likewise, and ``base_dir``, when given, replaces them all.

Before that, :func:`~fp4pass.onnx.proto_checks.validate_proto` reads every field of the file that later code trusts, each failure a
:class:`~fp4pass.errors.ModelError` naming the graph, tensor or node: strings that are not UTF-8; data types
of tensors and attributes that are UNDEFINED or unknown; negative dims; ``raw_data`` (or typed data) whose
length is not what the dims and data type need; external-data entries (``location`` a non-empty relative
path, ``offset``/``length`` decimal numbers); duplicate initializer, input, output or node-output names;
nodes with no outputs, or (for ops ONNX defines) inputs or outputs outside their schema's counts.
:func:`check_model_file` runs the ONNX checker (full check, with shape inference) on a file, for the
commands that refuse invalid models.

Writing (:func:`save`): into a temporary folder beside the output (``fp4pass.io`` names), checked with the
ONNX checker there, then renamed into place (data file first, model last), so a failure leaves nothing
behind. With external data, ``ir.save`` streams the tensors out one at a time (lazy tensors are computed as
they are written), so peak memory stays near the largest tensor, not the model.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
import onnx_ir as ir
from google.protobuf.message import DecodeError

from fp4pass import io as fio
from fp4pass.errors import InvalidOutputError, ModelError, UnsafeExternalDataError, UsageError
from fp4pass.extras import require
from fp4pass.io import refuse_overwrite
from fp4pass.onnx.proto_checks import graph_protos, validate_proto

__all__ = [
    "Loaded",
    "load",
    "to_kind",
    "check_external_data",
    "external_data_files",
    "tensor_bytes",
    "initializer_bytes",
    "save",
    "PROTOBUF_LIMIT",
    "validate_proto",
    "check_model_file",
    "checker_failure",
    "external_data_paths",
    "external_tensors",
    "proto_tensors",
    "set_base_dir",
]

log = logging.getLogger(__name__)

_T = onnx.TensorProto

# protobuf refuses messages of 2 GiB; stay a little under it so the graph itself has room.
PROTOBUF_LIMIT = 2**31 - 2**26


@dataclass
class Loaded:
    """A model read into ``onnx_ir``, with what :func:`to_kind` needs to give it back as it came.

    ``kind`` is one of "path", "proto", "ir", "gs"; ``path`` is the file for kind "path".
    """

    model: ir.Model
    kind: str
    path: Path | None = None

    @property
    def had_external_data(self) -> bool:
        return bool(external_data_files(self.model))


def _is_graphsurgeon_graph(obj) -> bool:
    return type(obj).__module__.startswith("onnx_graphsurgeon") and type(obj).__name__ == "Graph"


def load(model_or_path, base_dir: str | os.PathLike | None = None) -> Loaded:
    """Read any accepted kind of model into ``onnx_ir`` (external data stays lazy, on disk).

    ``base_dir``: the folder external data resolves against, for a model that is not a path (module
    docstring); a path's own folder always wins. Every external tensor is checked (:func:`check_external_data`).
    """
    if isinstance(model_or_path, (str, os.PathLike)):
        return _load_path(Path(model_or_path))
    if isinstance(model_or_path, ir.Model):
        loaded = Loaded(model_or_path, "ir")
    elif isinstance(model_or_path, onnx.ModelProto):
        validate_proto(model_or_path, "model")
        loaded = Loaded(_deserialize(model_or_path, "model"), "proto")
    elif _is_graphsurgeon_graph(model_or_path):
        gs = require("onnx_graphsurgeon", "graphsurgeon", "an onnx-graphsurgeon Graph input")

        loaded = Loaded(_deserialize(gs.export_onnx(model_or_path), "graphsurgeon graph"), "gs")
    else:
        raise UsageError(f"cannot read a model from {type(model_or_path).__name__}; give a path, onnx.ModelProto, "
                         "onnx_ir.Model or onnx_graphsurgeon.Graph")
    where = f"<{loaded.kind}>"
    if base_dir is not None:
        if not os.path.isdir(base_dir):
            raise UsageError(f"base_dir {os.fspath(base_dir)!r}: not a folder")
        set_base_dir(loaded.model, base_dir)
    for label, tensor in external_tensors(loaded.model):
        if not tensor.base_dir:
            raise UnsafeExternalDataError(
                f"{where}: {label} {tensor.name!r} is stored in external data {str(tensor.location)!r}, but the "
                "model has no folder to read it from; pass base_dir= (the model file's folder) to allow it")
        check_external_data(loaded.model, tensor.base_dir, where, only=tensor)
    return loaded


def _load_path(path: Path) -> Loaded:
    if not path.exists():
        raise ModelError(f"{path}: no such file")
    if not path.is_file():
        raise ModelError(f"{path}: not a file")
    try:
        proto = onnx.load(str(path), load_external_data=False)
    except (DecodeError, RuntimeError, ValueError, onnx.onnx_cpp2py_export.checker.ValidationError) as exc:
        raise ModelError(f"{path}: not an ONNX file or truncated ({type(exc).__name__}: {exc})") from None
    if not proto.graph.node and not proto.graph.initializer and not proto.opset_import:
        raise ModelError(f"{path}: not an ONNX file (no graph, no opset imports)")
    validate_proto(proto, str(path))
    model = _deserialize(proto, str(path))
    set_base_dir(model, path.parent)
    check_external_data(model, path.parent, str(path))
    return Loaded(model, "path", path)


def _deserialize(proto: onnx.ModelProto, where: str) -> ir.Model:
    try:
        return ir.serde.deserialize_model(proto)
    except Exception as exc:  # noqa: BLE001 - onnx_ir's SerdeError and what it wraps: the file is malformed
        cause = exc.__cause__ or exc
        raise ModelError(f"{where}: malformed model ({type(cause).__name__}: {_first_line(cause)})") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


#: where :func:`checker_failure` moves operators that only onnxruntime registers, for the checker's second look
_RUNTIME_ONLY_DOMAIN = "fp4pass.onnxruntime_registered"
_UNREGISTERED = re.compile(r"No Op registered for (\S+) with domain_version of \d+")


@functools.lru_cache(maxsize=1)
def _runtime_default_domain_ops() -> frozenset[str]:
    """Operators onnxruntime registers in the default ONNX domain beyond ONNX's own (e.g.
    ``SimplifiedLayerNormalization``, which onnxruntime-genai's model builder writes)."""
    from onnxruntime.capi import _pybind_state

    return frozenset(s.name for s in _pybind_state.get_all_operator_schema() if s.domain in ("", "ai.onnx"))


def _external_as_inputs(proto: onnx.ModelProto) -> None:
    """In a copy checked as a proto (the checker would look for its external files in the working folder):
    each external initializer becomes a graph input of the same type and shape. The files themselves are
    validated by :func:`load`."""
    for graph, _ in graph_protos(proto.graph, "graph"):
        inputs = {v.name for v in graph.input}
        kept = []
        for tensor in graph.initializer:
            if tensor.data_location != _T.EXTERNAL:
                kept.append(tensor)
            elif tensor.name not in inputs:
                graph.input.append(onnx.helper.make_tensor_value_info(tensor.name, tensor.data_type, list(tensor.dims)))
        del graph.initializer[:]
        graph.initializer.extend(kept)


def _second_look(model_or_path) -> onnx.ModelProto:
    """A copy of the model for :func:`checker_failure`'s second look: no ``value_info`` annotations, external
    initializers as typed inputs."""
    if isinstance(model_or_path, (str, os.PathLike)):
        proto = onnx.load(os.fspath(model_or_path), load_external_data=False)
    else:
        proto = onnx.ModelProto()
        proto.CopyFrom(model_or_path)
    _external_as_inputs(proto)
    for graph, _ in graph_protos(proto.graph, "graph"):
        del graph.value_info[:]
    return proto


def checker_failure(model_or_path) -> str | None:
    """The ONNX checker's reason for refusing a model file or ``ModelProto`` (full check, with shape
    inference), or None when it accepts it.

    Two things real producers write are not failures (onnxruntime runs both), so a refusal gets a second look
    on a copy without them:

    1. ``value_info`` annotations that disagree with ONNX's shape inference (onnxruntime-genai's builder
       declares rank-0 shapes for rank-1 Constants): annotations only, dropped in the copy;
    2. default-domain operators that ONNX's registry lacks but onnxruntime registers
       (``SimplifiedLayerNormalization``): moved in the copy to a private domain, where the checker verifies
       their wiring but not their schema.

    Everything else (types, dimensions that do not unify between operators, unknown operators, dangling
    inputs) still fails, with the checker's reason.
    """
    try:
        onnx.checker.check_model(os.fspath(model_or_path) if isinstance(model_or_path, (str, os.PathLike))
                                 else model_or_path, full_check=True)
        return None
    except Exception as exc:  # noqa: BLE001 - the checker raises ValidationError, InferenceError, others
        first = _first_line(exc)
    try:
        proto = _second_look(model_or_path)
    except Exception:  # noqa: BLE001 - unreadable: the first reason stands
        return first
    moved = False
    for _ in range(64):  # one operator type per round
        try:
            onnx.checker.check_model(proto, full_check=True)
            log.debug("ONNX checker: accepted once onnxruntime's own operators and value_info annotations are "
                      "set aside (it first said: %s)", first)
            return None
        except Exception as exc:  # noqa: BLE001
            reason = _first_line(exc)
        match = _UNREGISTERED.search(reason)
        if match is None or match.group(1) not in _runtime_default_domain_ops():
            return reason
        if not moved:
            proto.opset_import.add(domain=_RUNTIME_ONLY_DOMAIN, version=1)
            moved = True
        for graph, _ in graph_protos(proto.graph, "graph"):
            for node in graph.node:
                if node.domain in ("", "ai.onnx") and node.op_type == match.group(1):
                    node.domain = _RUNTIME_ONLY_DOMAIN
    return reason


def check_model_file(path: str | os.PathLike) -> None:
    """Refuse a model file the ONNX checker refuses (:func:`checker_failure`): :class:`ModelError` with its reason."""
    reason = checker_failure(path)
    if reason is not None:
        raise ModelError(f"{path}: fails the ONNX checker: {reason} (--allow-invalid to go on anyway)")


def external_data_paths(path: str | os.PathLike) -> list[str]:
    """The external data files a model file names (resolved against its folder), without reading them."""
    try:
        proto = onnx.load(os.fspath(path), load_external_data=False)
    except Exception:  # noqa: BLE001 - load() reports a malformed file with its own message
        return []
    found = []
    for tensor in proto_tensors(proto):
        if tensor.data_location == _T.EXTERNAL:
            for entry in tensor.external_data:
                if entry.key == "location" and isinstance(entry.value, str) and entry.value:
                    found.append(os.path.join(os.path.dirname(os.fspath(path)) or ".", entry.value))
    return sorted(set(found))


def _graph_proto_tensors(graph: onnx.GraphProto):
    yield from graph.initializer
    yield from _node_proto_tensors(graph.node)


def _node_proto_tensors(nodes):
    for node in nodes:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            if attr.HasField("g"):
                yield from _graph_proto_tensors(attr.g)
            for graph in attr.graphs:
                yield from _graph_proto_tensors(graph)


def proto_tensors(proto: onnx.ModelProto):
    """Every TensorProto of a model: initializers and Constant values, subgraphs and functions included."""
    yield from _graph_proto_tensors(proto.graph)
    for function in proto.functions:
        yield from _node_proto_tensors(function.node)


def to_kind(model: ir.Model, kind: str):
    """The rewritten model as the kind it came in ("path" gives the ``onnx_ir.Model``)."""
    if kind in ("ir", "path"):
        return model
    proto = ir.serde.serialize_model(model)
    if kind == "proto":
        return proto
    if kind == "gs":
        gs = require("onnx_graphsurgeon", "graphsurgeon", "an onnx-graphsurgeon Graph output")

        return gs.import_onnx(proto)
    raise ValueError(kind)


def _initializers(model: ir.Model):
    for graph in model.graphs():
        yield from graph.initializers.values()


def _attribute_tensors(node: ir.Node):
    for attr in node.attributes.values():
        if attr.is_ref() or attr.value is None:
            continue
        if attr.type == ir.AttributeType.TENSOR:
            yield attr.value
        elif attr.type == ir.AttributeType.TENSORS:
            yield from attr.value
        elif attr.type == ir.AttributeType.GRAPH:
            yield from (v.const_value for v in attr.value.initializers.values() if v.const_value is not None)
        elif attr.type == ir.AttributeType.GRAPHS:
            for graph in attr.value:
                yield from (v.const_value for v in graph.initializers.values() if v.const_value is not None)


def external_tensors(model: ir.Model):
    """Every tensor of ``model`` stored as external data, as ``(label, tensor)``: the main graph's
    initializers, then tensor attributes (``Constant`` values) and subgraph initializers of every node, in the
    main graph, its subgraphs and every local function."""
    for value in model.graph.initializers.values():
        if isinstance(value.const_value, ir.ExternalTensor):
            yield "initializer", value.const_value
    scopes = [("", model.graph)] + [(f"function {f.name!r} ", f) for f in model.functions.values()]
    for prefix, scope in scopes:
        for node in ir.traversal.RecursiveGraphIterator(scope):
            for tensor in _attribute_tensors(node):
                if isinstance(tensor, ir.ExternalTensor):
                    yield f"{prefix}node {node.name or node.op_type!r} tensor", tensor


def set_base_dir(model: ir.Model, base_dir: str | os.PathLike) -> None:
    """Make every external tensor of ``model`` (functions included) resolve against ``base_dir``."""
    for _, tensor in external_tensors(model):
        tensor.base_dir = base_dir


def external_data_files(model: ir.Model) -> set[str]:
    """Real paths of every external data file the model's tensors (:func:`external_tensors`) read from."""
    return {os.path.realpath(tensor.path) for _, tensor in external_tensors(model)}


def _inside(real: str, base_real: str) -> bool:
    """Whether ``real`` is ``base_real`` or below it, compared as paths (never as string prefixes)."""
    return os.path.commonpath([real, base_real]) == base_real


def check_external_data(model: ir.Model, base_dir: str | os.PathLike, model_name: str, *,
                        only: ir.ExternalTensor | None = None) -> None:
    """Refuse external data that escapes ``base_dir``, is missing or truncated, or has the wrong length
    (every tensor of :func:`external_tensors`, or ``only`` that one)."""
    base_real = os.path.realpath(base_dir)
    found = [("tensor", only)] if only is not None else external_tensors(model)
    for label, tensor in found:
        where = f"{model_name}: {label} {tensor.name!r} external data {str(tensor.location)!r}"
        location = os.fspath(tensor.location)
        if os.path.isabs(location) or os.path.normpath(location).split(os.sep)[0] == "..":
            raise UnsafeExternalDataError(f"{where} leaves the model's folder; refusing to read it")
        real = os.path.realpath(os.path.join(base_dir, location))
        if not _inside(real, base_real):
            raise UnsafeExternalDataError(f"{where} resolves (through a symlink) outside the model's folder; "
                                          "refusing to read it")
        if not os.path.isfile(real):
            raise UnsafeExternalDataError(f"{where}: data file not found")
        offset = tensor.offset or 0
        expected = tensor.nbytes
        length = tensor.length if tensor.length is not None else expected
        if length != expected:
            raise UnsafeExternalDataError(
                f"{where}: length {length} bytes does not match {expected} bytes for {tensor.dtype.name} "
                f"{list(tensor.shape)}")
        size = os.path.getsize(real)
        if offset + length > size:
            raise UnsafeExternalDataError(
                f"{where}: truncated (needs bytes {offset}..{offset + length}, file has {size})")


def tensor_bytes(tensor: ir.TensorProtocol) -> np.ndarray:
    """The tensor's stored bytes as uint8 (FP4 packed two per byte, low nibble first).

    External tensors are read straight from their file (one read of ``length`` bytes), never unpacked.
    """
    if isinstance(tensor, ir.ExternalTensor):
        with open(tensor.path, "rb") as f:
            f.seek(tensor.offset or 0)
            data = np.fromfile(f, dtype=np.uint8, count=tensor.nbytes)
        if data.size != tensor.nbytes:
            raise UnsafeExternalDataError(f"initializer {tensor.name!r}: external data truncated")
        return data
    return np.frombuffer(tensor.tobytes(), dtype=np.uint8)


def initializer_bytes(model: ir.Model) -> int:
    return sum(v.const_value.nbytes for v in _initializers(model) if v.const_value is not None)


def passes_checker(model_or_path) -> bool:
    """Whether the ONNX checker (:func:`checker_failure`) accepts a model file, ``ModelProto`` or ``onnx_ir.Model``."""
    if isinstance(model_or_path, ir.Model):
        model_or_path = ir.serde.serialize_model(model_or_path)
    return checker_failure(model_or_path) is None


def _check_output(staged: Path, path: Path, allow_invalid: bool) -> None:
    reason = checker_failure(staged)
    if reason is None:
        return
    if allow_invalid:
        log.warning("%s: the output fails the ONNX checker, as the input did: %s", path, reason)
        return
    raise InvalidOutputError(f"{path}: the converted model fails the ONNX checker: {reason}; nothing "
                             "written. This is a bug in fp4pass, please report it")


def save(
    model: ir.Model,
    path: str | os.PathLike,
    *,
    external_data: str = "auto",
    inputs: tuple = (),
    input_had_external: bool = False,
    on_tensor: Callable[[ir.TensorProtocol, int], None] | None = None,
    allow_invalid: bool = False,
) -> bool:
    """Write ``model`` to ``path`` atomically; returns whether external data was used.

    ``external_data``: "always", "never", or "auto" (external when the input had external data or the
    initializers exceed protobuf's 2 GiB). The data file is ``<path name>.data`` beside the model.
    ``inputs``: files (models and their data) that must not be overwritten. ``on_tensor(tensor, total)`` is
    called after each external tensor is written (a progress bar). The written model must pass the ONNX
    checker (full check) before it is renamed in: :class:`InvalidOutputError` otherwise (a bug), unless
    ``allow_invalid`` says the input failed the checker already (then a warning says so and it is written).
    """
    path = Path(path)
    data_name = path.name + ".data"
    refuse_overwrite(path, *inputs)
    total = initializer_bytes(model)
    if external_data == "always":
        use_external = True
    elif external_data == "never":
        if total > PROTOBUF_LIMIT:
            raise UsageError(f"{path}: {total / 2**30:.2f} GiB of weights do not fit in one protobuf (2 GiB); "
                             "use --external-data auto or always")
        use_external = False
    elif external_data == "auto":
        use_external = input_had_external or total > PROTOBUF_LIMIT
    else:
        raise UsageError(f"--external-data must be auto, always or never, not {external_data!r}")
    if use_external:
        data_path = path.parent / data_name
        if os.path.realpath(data_path) in external_data_files(model) or any(
            os.path.exists(i) and data_path.exists() and os.path.samefile(i, data_path) for i in inputs
        ):
            raise UsageError(f"{data_path}: refusing to write over the input's external data")

    def callback(tensor, info) -> None:
        if on_tensor is not None:
            on_tensor(tensor, info.total)

    fio.remove_stale(path.parent, keep=inputs)
    staging = fio.make_temp_folder(path, ".d")  # with its marker: only such folders are ever swept
    try:
        staged = staging / path.name
        if use_external:
            ir.save(model, staged, external_data=data_name, callback=callback)
        else:
            ir.external_data.load_to_model(model)  # the output must not point at the input's data file
            ir.save(model, staged)
        _check_output(staged, path, allow_invalid)
        if use_external:
            # The data lands first; the model that names it is renamed in last.
            fio.finish(staging / data_name, path.parent / data_name)
        fio.finish(staged, path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return use_external
