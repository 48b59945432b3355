"""onnxruntime sessions: which execution provider runs, and sessions for models of any size.

``make_session(model, provider="auto") -> (session, provider_used, note)``

- ``provider``: "auto" = the CUDA EP when it loads, else CPU; "cuda" = the CUDA EP, falling back to CPU with
  a note saying so when it cannot load; "cpu" = CPU only. ``provider_used`` is "cuda" or "cpu", read back
  from the session (onnxruntime-gpu lists the CUDA EP even where its libraries or the GPU are missing, and
  silently falls back; the probe below hides that noise and finds out once per process).
- ``model``: a path, an ``onnx.ModelProto`` or an ``onnx_ir.Model``. In-memory models whose initializers
  exceed ~1.8 GB are saved to a temporary folder with external data and loaded by path (protobuf's 2 GB
  limit); the folder lives as long as the session.
- CUDA sessions run with :data:`CUDA_OPTIONS` (TF32 off: float32 products keep their 24-bit mantissa instead of
  TensorFloat-32's 11, which would put ~1e-3 relative error into every float32 MatMul of a numerics check);
  :func:`provider_options` reads back what the session took.
- :func:`node_placement` tells which execution provider ran each node, from onnxruntime's profile of one run
  (:func:`profiling`, :func:`end_profile`): a CUDA session places what the CUDA EP has no kernel for (and
  shape arithmetic) on the CPU. The nodes that carry the weights decide whether a run "ran on CUDA".
- External data resolves against the model's own folder, whatever the working folder: a path is loaded by
  path (onnxruntime reads the data beside it), and an ``onnx_ir.Model`` whose external tensors all live in one
  folder gets that folder as the session's ``session.model_external_initializers_file_folder_path`` (a model
  given as bytes would otherwise resolve them against the working folder). Tensors from several folders go
  through a temporary file, as above.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import io
import json
import logging
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import onnx
import onnx_ir as ir
import onnxruntime as ort

from fp4pass.choices import Provider, values
from fp4pass.errors import ModelError, UsageError
from fp4pass.formats.constants import QUARK_DOMAIN
from fp4pass.onnx.loading import external_tensors, proto_tensors

__all__ = ["make_session", "cuda_available", "installed_runtimes", "provider_options", "profiling", "end_profile",
           "node_placement", "weight_nodes", "run_with_past_buffers", "Placement", "CUDA_OPTIONS", "PROVIDERS",
           "RUNTIME_DISTRIBUTIONS"]

logger = logging.getLogger(__name__)

PROVIDERS = values(Provider)
_CUDA_EP, _CPU_EP = "CUDAExecutionProvider", "CPUExecutionProvider"
_INLINE_LIMIT = int(1.8 * 2**30)  # bytes of initializers above which a model goes through a file

#: the CUDA EP's options on every session fp4pass makes: float32 MatMul/Conv in float32, not TensorFloat-32
CUDA_OPTIONS = {"use_tf32": "0"}


#: the PyPI distributions that install the ``onnxruntime`` module (any one of them serves fp4pass)
RUNTIME_DISTRIBUTIONS = ("onnxruntime-gpu", "onnxruntime")


def installed_runtimes() -> list[str]:
    """"name version" of each onnxruntime distribution installed here (normally one: docs/runtime.md)."""
    found = []
    for name in RUNTIME_DISTRIBUTIONS:
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


@functools.lru_cache(maxsize=1)
def _warn_if_both_installed() -> None:
    found = installed_runtimes()
    if len(found) > 1:
        logger.warning("both %s are installed; they write the same onnxruntime package over each other, so which "
                       "one runs is unclear. Keep one: pip uninstall -y onnxruntime onnxruntime-gpu, then "
                       "pip install onnxruntime-gpu (CUDA) or onnxruntime (CPU)", " and ".join(found))


def _no_cuda_ep_reason() -> str:
    found = installed_runtimes()
    build = f" ({', '.join(found)})" if found else ""
    hint = "" if any(f.startswith("onnxruntime-gpu ") for f in found) else (
        "; for the CUDA EP replace it: pip uninstall -y onnxruntime && pip install onnxruntime-gpu")
    return f"this onnxruntime build{build} has no CUDA execution provider{hint}"


def _preload_cuda_libraries() -> None:
    """onnxruntime-gpu's ``preload_dlls()`` (1.21 and later): load the CUDA and cuDNN libraries of the
    ``nvidia-*`` pip packages (torch's among them), which the CUDA EP does not find on its own unless torch
    loaded them first or they are on the library path. Where they are not installed it does nothing useful,
    and the probe below says why the CUDA EP did not start."""
    preload = getattr(ort, "preload_dlls", None)
    if preload is None:
        return
    said = io.StringIO()  # it prints what it could not load, and hints: the probe says it once, in our words
    try:
        with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
            preload()
    except Exception as exc:  # noqa: BLE001 - best effort: the probe reports what matters
        logger.debug("onnxruntime.preload_dlls() failed: %s", exc)
    if said.getvalue().strip():
        logger.debug("onnxruntime.preload_dlls(): %s", said.getvalue().strip())


@functools.lru_cache(maxsize=1)
def cuda_available() -> tuple[bool, str | None]:
    """(True, None) when the CUDA EP really runs here; else (False, why). Probed once with a 1-node model."""
    _warn_if_both_installed()
    if _CUDA_EP not in ort.get_available_providers():
        return False, _no_cuda_ep_reason()
    _preload_cuda_libraries()
    probe = onnx.helper.make_model(
        onnx.helper.make_graph(
            [onnx.helper.make_node("Identity", ["x"], ["y"])], "probe",
            [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
            [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])],
        ),
        opset_imports=[onnx.helper.make_opsetid("", 13)], ir_version=8,
    )
    options = ort.SessionOptions()
    options.log_severity_level = 4  # the failed provider load is expected here; say it once, in our words
    ort.set_default_logger_severity(4)
    try:
        session = ort.InferenceSession(probe.SerializeToString(), options, providers=[_CUDA_EP, _CPU_EP])
    except Exception as exc:  # noqa: BLE001 - any failure means "no CUDA here"
        return False, f"the CUDA execution provider failed to start ({exc})"
    finally:
        ort.set_default_logger_severity(2)  # onnxruntime's default: warnings
    if _CUDA_EP not in session.get_providers():
        return False, "the CUDA execution provider did not load (no GPU, or CUDA/cuDNN libraries missing)"
    return True, None


def _providers(provider: str) -> tuple[list[str], str, str | None]:
    if provider not in PROVIDERS:
        raise UsageError(f"provider {provider!r}: choose one of {', '.join(PROVIDERS)}")
    _warn_if_both_installed()
    if provider == "cpu":
        return [_CPU_EP], "cpu", None
    ok, why = cuda_available()
    if ok:
        return [(_CUDA_EP, dict(CUDA_OPTIONS)), _CPU_EP], "cuda", None
    note = f"CUDA requested but {why}; running on CPU" if provider == "cuda" else None
    return [_CPU_EP], "cpu", note


def _initializer_bytes(model: ir.Model) -> int:
    total = 0
    for value in model.graph.initializers.values():
        tensor = value.const_value
        if tensor is not None:
            total += tensor.nbytes
    return total


_EXTERNAL_FOLDER_KEY = "session.model_external_initializers_file_folder_path"


def _external_folders(model: ir.Model) -> set[str]:
    """The folders the model's external tensors (initializers, Constant values, functions) are read from:
    their ``base_dir``, resolved. :func:`fp4pass.onnx.loading.load` gave every one of them a folder."""
    return {os.path.realpath(tensor.base_dir) for _, tensor in external_tensors(model)}




#: external tensors up to this size are read into the proto before onnxruntime sees it (see below)
_SMALL_EXTERNAL_BYTES = 4096


def _inline_small_external(proto: onnx.ModelProto, folder: str) -> None:
    """Read the small external tensors of ``proto`` (all graphs) into it, from ``folder``.

    onnxruntime reads external data of a model given as bytes only when it loads the initializers, not when
    its graph resolution needs a constant's value (Unsqueeze axes, Reshape shapes): a model saved with
    ``size_threshold=0`` then fails with "Cannot parse data from external tensors". Such constants are tiny;
    weights, which stay external, are not read this way. The locations were checked to stay inside the
    model's folder when the model was loaded.
    """
    from onnx.external_data_helper import load_external_data_for_tensor, uses_external_data

    for tensor in proto_tensors(proto):
        if not uses_external_data(tensor):
            continue
        info = {entry.key: entry.value for entry in tensor.external_data}
        length = int(info.get("length", -1) or -1)
        if 0 <= length <= _SMALL_EXTERNAL_BYTES:
            load_external_data_for_tensor(tensor, folder)
            tensor.data_location = onnx.TensorProto.DEFAULT
            del tensor.external_data[:]


def _with_quark_ops(options: ort.SessionOptions, exc: Exception) -> ort.SessionOptions:
    """A model with AMD Quark's custom ops (``com.amd.quark``, e.g. MX fake-quant on activations) runs only
    with Quark's custom-op library: registered when the ``amd-quark`` package is installed, else a clear error."""
    try:
        from quark.onnx.operators.custom_ops import get_library_path

        library = get_library_path("CPU")
    except Exception:  # not installed, or its library cannot be built here
        raise ModelError("the model has AMD Quark custom ops (com.amd.quark); onnxruntime runs them only with "
                         "Quark's custom-op library (pip install amd-quark), or convert with --calib to replace "
                         "Quark's activation fake-quants") from exc
    options.register_custom_ops_library(library)
    return options


def make_session(model, provider: str = "auto", *, options: ort.SessionOptions | None = None):
    """Create an ``ort.InferenceSession`` for ``model``; returns ``(session, provider_used, note)``."""
    providers, provider_used, note = _providers(provider)
    if options is None:
        options = ort.SessionOptions()
        options.log_severity_level = 3  # errors only: unused-initializer warnings are noise here
    tmpdir = None
    if isinstance(model, (str, os.PathLike)):
        source = str(model)
    elif isinstance(model, onnx.ModelProto):
        if model.ByteSize() < _INLINE_LIMIT:
            source = model.SerializeToString()
        else:  # a proto that big only exists with external data already attached: go through the IR
            model = ir.serde.deserialize_model(model)
    if isinstance(model, ir.Model):
        folders = _external_folders(model)
        if _initializer_bytes(model) < _INLINE_LIMIT and len(folders) <= 1:
            proto = ir.serde.serialize_model(model)
            if folders:
                folder = folders.pop()
                _inline_small_external(proto, folder)
                options.add_session_config_entry(_EXTERNAL_FOLDER_KEY, folder)
            source = proto.SerializeToString()
        else:
            tmpdir = tempfile.TemporaryDirectory(prefix="fp4pass-ort-")
            path = Path(tmpdir.name) / "model.onnx"
            logger.info("saving the model with external data to %s for onnxruntime (over 2 GB)", path)
            ir.save(model, path, external_data="model.onnx.data")
            source = str(path)
    elif not isinstance(model, (str, os.PathLike, onnx.ModelProto)):
        raise ModelError(f"cannot make a session from {type(model).__name__}")
    try:
        try:
            session = ort.InferenceSession(source, options, providers=providers)
        except Exception as exc:
            if QUARK_DOMAIN not in str(exc):
                raise
            session = ort.InferenceSession(source, _with_quark_ops(options, exc), providers=providers)
    except Exception as exc:  # onnxruntime raises its own exception types; name what failed
        if tmpdir is not None:
            tmpdir.cleanup()
        if isinstance(exc, ModelError):
            raise
        raise ModelError(f"onnxruntime could not load the model: {str(exc).strip().splitlines()[0]}") from exc
    if tmpdir is not None:
        session._fp4pass_tmpdir = tmpdir  # keep the external data alive with the session
    if provider_used == "cuda" and _CUDA_EP not in session.get_providers():
        provider_used = "cpu"
        note = "the CUDA execution provider did not load for this model; running on CPU"
    return session, provider_used, note


def run_with_past_buffers(session, names: list[str], feeds: dict, past_of: dict[str, str], provider: str,
                          run_options=None) -> list:
    """``session.run(names, feeds)`` with each output in ``past_of`` (``{present: past input}``, same shapes)
    written into a copy of its past input, through onnxruntime's IOBinding.

    An attention kernel given a past buffer longer than the tokens writes only the new rows of its present;
    left to onnxruntime's allocator the other rows hold whatever memory held before, so two runs differ.
    Given the past's own values (as onnxruntime-genai's shared past/present buffer holds them), every row is
    defined. On the CUDA EP the buffers live on the GPU, so that no uninitialised device copy is made."""
    import numpy as np

    device = "cuda" if provider == "cuda" else "cpu"
    binding = session.io_binding()
    for name, value in feeds.items():
        binding.bind_cpu_input(name, value)
    buffers = {}
    for name in names:
        if name in past_of:
            copy = np.ascontiguousarray(feeds[past_of[name]]).copy()
            buffers[name] = ort.OrtValue.ortvalue_from_numpy(copy, device, 0)
            binding.bind_ortvalue_output(name, buffers[name])
        else:
            binding.bind_output(name, "cpu")
    if run_options is None:
        session.run_with_iobinding(binding)
    else:
        session.run_with_iobinding(binding, run_options)
    return binding.copy_outputs_to_cpu()


def provider_options(session) -> dict[str, str]:
    """The :data:`CUDA_OPTIONS` keys as ``session`` reports them back from its CUDA EP ({} when the CUDA EP does not
    run it): proof that the options took effect, for the report."""
    if _CUDA_EP not in session.get_providers():
        return {}
    taken = session.get_provider_options().get(_CUDA_EP, {})
    return {key: taken.get(key) for key in CUDA_OPTIONS}


def profiling(options, folder: str | os.PathLike) -> None:
    """Set ``options`` (an ``ort.SessionOptions``) to write onnxruntime's profile of each run into ``folder``."""
    options.enable_profiling = True
    options.profile_file_prefix = str(Path(folder) / "ort_profile")


def end_profile(session) -> list[dict]:
    """Stop ``session``'s profiling; its events (onnxruntime's Chrome-trace JSON list), the file removed."""
    path = session.end_profiling()
    if not path:
        return []
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    finally:
        Path(path).unlink(missing_ok=True)


#: an initializer of at least this many elements is a weight (smaller ones: shapes, axes, biases of tiny models)
WEIGHT_MIN_ELEMENTS = 1024
#: op types that read weights; they count as weight nodes when onnxruntime made them (fusions name nodes anew)
_WEIGHT_OPS = frozenset({"MatMul", "Gemm", "FusedMatMul", "FusedGemm", "MatMulNBits", "MoE", "QMoE", "Conv",
                         "FusedConv", "GatherBlockQuantized", "DequantizeLinear", "DynamicQuantizeMatMul",
                         "MatMulIntegerToFloat", "QLinearMatMul"})
_KERNEL_SUFFIX = "_kernel_time"  # onnxruntime's profile names a node's event "<node name>_kernel_time"
_SHORT = {_CUDA_EP: "cuda", _CPU_EP: "cpu"}


def _large(tensor) -> bool:
    return tensor is not None and tensor.size >= WEIGHT_MIN_ELEMENTS


def weight_nodes(model: ir.Model) -> tuple[set[str], set[str]]:
    """(names of the nodes of ``model``'s main graph that read weights, names of all its nodes).

    A weight is an initializer (or a Constant node's value) of >= :data:`WEIGHT_MIN_ELEMENTS` elements, and
    what constant-only nodes make of it (a dequantized, transposed, cast weight: onnxruntime may fold those
    nodes at load, and then the node that reads their output is the one that carries the weight). A node reads
    weights when one of its inputs is a weight: the dequantizing nodes themselves when they run, and the
    MatMul, Gemm or MoE at the end of the chain.
    """
    constant: set[ir.Value] = set()
    weight: set[ir.Value] = set()
    readers, names = set(), set()
    for node in model.graph:
        names.add(node.name)
        inputs = [v for v in node.inputs if v is not None]
        for value in inputs:
            if value.const_value is not None:
                constant.add(value)
                if _large(value.const_value):
                    weight.add(value)
        if any(v in weight for v in inputs):
            readers.add(node.name)
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
            value_attr = node.attributes.get("value")
            big = value_attr is not None and _large(value_attr.value)
            constant.update(node.outputs)
            if big:
                weight.update(node.outputs)
        elif inputs and all(v in constant for v in inputs):
            constant.update(node.outputs)
            if any(v in weight for v in inputs):
                weight.update(node.outputs)
    return readers, names


@dataclass
class Placement:
    """Where the nodes of one profiled run ran.

    ``nodes``: executed nodes per provider ("cuda", "cpu"; onnxruntime's own Memcpy nodes left out);
    ``on_cpu``: the nodes (name, op type) that ran on the CPU EP; ``weight_nodes``: how many nodes that read
    weights ran; ``weight_nodes_on_cpu``: those of them that ran on the CPU EP (names)."""

    nodes: dict[str, int] = field(default_factory=dict)
    on_cpu: list[tuple[str, str]] = field(default_factory=list)
    weight_nodes: int = 0
    weight_nodes_on_cpu: list[str] = field(default_factory=list)

    def provider_label(self) -> str:
        """"cuda" when every weight node ran on the CUDA EP, else "cuda (N nodes on cpu)", N every CPU node."""
        if not self.weight_nodes_on_cpu:
            return "cuda"
        return f"cuda ({len(self.on_cpu)} nodes on cpu)"

    def to_json(self) -> dict:
        return {"nodes": dict(self.nodes), "on_cpu": [f"{name} ({op})" for name, op in self.on_cpu],
                "weight_nodes": self.weight_nodes, "weight_nodes_on_cpu": list(self.weight_nodes_on_cpu)}


def node_placement(events: list[dict], model: ir.Model) -> Placement:
    """The :class:`Placement` of one run of ``model`` from onnxruntime's profile ``events``.

    onnxruntime writes one event per executed node and run: ``{"cat": "Node", "name": "<node>_kernel_time",
    "args": {"op_name": ..., "provider": "CUDAExecutionProvider", ...}}``. A node counts once however many runs
    the profile holds. A node reads weights when ``model``'s node of that name reads an initializer of
    >= :data:`WEIGHT_MIN_ELEMENTS` elements, or when onnxruntime made it (no node of ``model`` has its name: a
    fusion) and its op type reads weights (MatMul, Gemm, MoE, ...). Nodes onnxruntime folded into constants at
    load do not run and are not counted.
    """
    weights, names = weight_nodes(model)
    placement, seen = Placement(), set()
    for event in events:
        name = event.get("name", "")
        args = event.get("args") or {}
        if event.get("cat") != "Node" or not name.endswith(_KERNEL_SUFFIX) or "provider" not in args:
            continue
        node, op_type = name[: -len(_KERNEL_SUFFIX)], args.get("op_name", "?")
        if node in seen or op_type.startswith("Memcpy"):
            continue
        seen.add(node)
        where = _SHORT.get(args["provider"], args["provider"])
        placement.nodes[where] = placement.nodes.get(where, 0) + 1
        reads_weights = node in weights or (node not in names and op_type in _WEIGHT_OPS)
        placement.weight_nodes += reads_weights
        if where == "cpu":
            placement.on_cpu.append((node, op_type))
            if reads_weights:
                placement.weight_nodes_on_cpu.append(node)
    return placement
