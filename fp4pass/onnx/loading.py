"""Reading and writing models safely, with external data kept on disk until it is needed.

Accepted inputs (:func:`load`): a path, an ``onnx.ModelProto``, an ``onnx_ir.Model`` or an onnx-graphsurgeon
``Graph``; :func:`to_kind` turns the rewritten ``onnx_ir.Model`` back into the kind given.

Safety checks on a model read from a path (:func:`check_external_data`), each a
:class:`~fp4pass.errors.UnsafeExternalDataError` naming the tensor and the reason:

1. a ``location`` that is absolute or leaves the model's folder (``../``, or a symlink resolving outside it:
   CVE-2022-25882, CVE-2024-27318);
2. a data file that is missing, or shorter than ``offset + length`` (truncated);
3. a ``length`` that differs from what the tensor's dtype and shape need.

Writing (:func:`save`): through :func:`fp4pass.io.atomic_output`, so a failure leaves nothing behind. With
external data, ``ir.save`` streams the tensors out one at a time (lazy tensors are computed as they are
written), so peak memory stays near the largest tensor, not the model.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
import onnx_ir as ir
from google.protobuf.message import DecodeError

from fp4pass.errors import ModelError, UnsafeExternalDataError, UsageError
from fp4pass.io import atomic_output, refuse_overwrite

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
]

log = logging.getLogger(__name__)

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


def load(model_or_path) -> Loaded:
    """Read any accepted kind of model into ``onnx_ir`` (external data stays lazy, on disk)."""
    if isinstance(model_or_path, ir.Model):
        return Loaded(model_or_path, "ir")
    if isinstance(model_or_path, onnx.ModelProto):
        return Loaded(ir.serde.deserialize_model(model_or_path), "proto")
    if _is_graphsurgeon_graph(model_or_path):
        import onnx_graphsurgeon as gs

        return Loaded(ir.serde.deserialize_model(gs.export_onnx(model_or_path)), "gs")
    if isinstance(model_or_path, (str, os.PathLike)):
        path = Path(model_or_path)
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
        model = ir.serde.deserialize_model(proto)
        ir.external_data.set_base_dir(model.graph, path.parent)
        for sub in model.graphs():
            ir.external_data.set_base_dir(sub, path.parent)
        check_external_data(model, path.parent, str(path))
        return Loaded(model, "path", path)
    raise UsageError(f"cannot read a model from {type(model_or_path).__name__}; give a path, onnx.ModelProto, "
                     "onnx_ir.Model or onnx_graphsurgeon.Graph")


def to_kind(model: ir.Model, kind: str):
    """The rewritten model as the kind it came in ("path" gives the ``onnx_ir.Model``)."""
    if kind in ("ir", "path"):
        return model
    proto = ir.serde.serialize_model(model)
    if kind == "proto":
        return proto
    if kind == "gs":
        import onnx_graphsurgeon as gs

        return gs.import_onnx(proto)
    raise ValueError(kind)


def _initializers(model: ir.Model):
    for graph in model.graphs():
        yield from graph.initializers.values()


def external_data_files(model: ir.Model) -> set[str]:
    """Real paths of every external data file the model's initializers read from."""
    return {
        os.path.realpath(value.const_value.path)
        for value in _initializers(model)
        if isinstance(value.const_value, ir.ExternalTensor)
    }


def check_external_data(model: ir.Model, base_dir: str | os.PathLike, model_name: str) -> None:
    """Refuse external data that escapes ``base_dir``, is missing or truncated, or has the wrong length."""
    base_real = os.path.realpath(base_dir)
    for value in _initializers(model):
        tensor = value.const_value
        if not isinstance(tensor, ir.ExternalTensor):
            continue
        where = f"{model_name}: initializer {tensor.name!r} external data {str(tensor.location)!r}"
        location = os.fspath(tensor.location)
        if os.path.isabs(location) or os.path.normpath(location).split(os.sep)[0] == "..":
            raise UnsafeExternalDataError(f"{where} leaves the model's folder; refusing to read it")
        real = os.path.realpath(os.path.join(base_dir, location))
        if os.path.commonpath([real, base_real]) != base_real:
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


def save(
    model: ir.Model,
    path: str | os.PathLike,
    *,
    external_data: str = "auto",
    inputs: tuple = (),
    input_had_external: bool = False,
    on_tensor: Callable[[ir.TensorProtocol, int], None] | None = None,
) -> bool:
    """Write ``model`` to ``path`` atomically; returns whether external data was used.

    ``external_data``: "always", "never", or "auto" (external when the input had external data or the
    initializers exceed protobuf's 2 GiB). The data file is ``<path name>.data`` beside the model.
    ``inputs``: files (models and their data) that must not be overwritten. ``on_tensor(tensor, total)`` is
    called after each external tensor is written (a progress bar).
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

    with atomic_output(path) as tmp_model:
        staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".d", dir=tmp_model.parent))
        try:
            staged = staging / path.name
            if use_external:
                ir.save(model, staged, external_data=data_name, callback=callback)
            else:
                ir.external_data.load_to_model(model)  # the output must not point at the input's data file
                ir.save(model, staged)
            os.replace(staged, tmp_model)
            if use_external:
                # The data lands first; the model that names it is renamed in last, by atomic_output.
                os.replace(staging / data_name, path.parent / data_name)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return use_external
