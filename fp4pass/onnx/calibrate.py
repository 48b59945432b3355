"""The ONNX calibration run: stream data through the model, collect activation statistics, pick the scales.

Steps (ModelOpt's staging: targets -> session -> collect -> compute):

1. Targets: the activation input of every quantizable consumer of an FP4 weight
   (:func:`fp4pass.onnx.matching.find_fp4_consumers`: MatMul / Gemm / Einsum, and QMoE's input), each
   activation once however many consumers it feeds. Declined, with the reason: an activation blocked along
   another axis than its last (Gemm transA=1, MatMul with the weight as input A, an Einsum whose activation
   does not contract its last axis), a constant, one computed inside a subgraph (an outer activation that a
   consumer inside an If / Loop / Scan body reads is a target), one read inside a local function's body.
2. Session: a copy of the model lowered for onnxruntime (:func:`fp4pass.onnx.lower.lower_for_ort`, exact)
   with the targets added as graph outputs, run by :func:`fp4pass.onnx.runtime.make_session` (CUDA EP when
   present).
3. Collect: one ``session.run`` per feed (into reused output buffers, :class:`_TargetOutputs`); each target's batch goes into its
   :class:`~fp4pass.calib.stats.ActivationStats` (reduced in torch, on the GPU when torch has one); the
   activations themselves are dropped after each batch.
4. Compute (:func:`fp4pass.calib.compute.scale_for`, shared with the fx and checkpoint runs): the calibrator
   turns the statistics into ``g_amax``; the report adds B_min/B_max, the fractions of blocks that go
   subnormal / saturate at that g_amax, and the SNR on the held sample.

Data (``data``):

- a path to one ``.npz``: arrays named after the graph inputs; each array is fed whole (its first axis is
  the batch the model sees), or cut along the first axis into ``batch_size`` pieces when that is given;
- a path to a folder: every ``*.npz`` in it, in name order, loaded one file at a time (never all at once);
- an iterable of feed dicts ``{input_name: array}``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import onnx_ir as ir
import torch

from fp4pass.calib.calibrators import make_calibrator
from fp4pass.calib.compute import scale_for
from fp4pass.calib.errors import CalibrationDataError
from fp4pass.calib.scales import ActivationScales
from fp4pass.calib.stats import ActivationStats
from fp4pass.errors import ModelError, NonFiniteError
from fp4pass.npz import npz_files, read_npz
from fp4pass.onnx.activations import activation_axis_reason, einsum_contracts_last
from fp4pass.onnx.feeds import dims_mismatch
from fp4pass.progress import progress

__all__ = ["calibrate_model", "calibration_targets", "activation_axis_reason", "einsum_contracts_last", "iter_feeds",
           "scale_for", "CalibrationTarget", "CalibrationDataError"]  # scale_for, the error: fp4pass.calib's, for all

log = logging.getLogger(__name__)


@dataclass
class CalibrationTarget:
    """An activation to calibrate: its value name and the consumer nodes that quantize it."""

    name: str
    consumers: list[str]


def calibration_targets(model: ir.Model) -> tuple[list[CalibrationTarget], list[dict]]:
    """(targets, declined): the activations to calibrate, in graph order, and those declined with a reason."""
    from fp4pass.onnx.passes import function_graphs, function_label, function_of
    from fp4pass.onnx.matching import find_fp4_consumers

    targets: dict[str, CalibrationTarget] = {}
    declined: list[dict] = []
    main_values = {id(v) for v in model.graph.inputs} | {id(v) for node in model.graph for v in node.outputs}
    owners = function_graphs(model)
    for node, activation_input, _weight in find_fp4_consumers(model):
        value = node.inputs[activation_input] if activation_input < len(node.inputs) else None
        label = node.name or node.op_type
        reason = None
        function = function_of(node, owners)
        if value is None:
            reason = "no activation input"
        elif function is not None:
            reason = (f"consumer is inside function {function_label(function)}, whose values calibration does not "
                      "observe; inline the function to calibrate it")
        elif id(value) not in main_values and value.const_value is None:
            reason = "activation is computed inside a subgraph (calibration observes the main graph's values)"
        elif value.const_value is not None and not value.is_graph_input():
            reason = f"activation {value.name!r} is a constant"
        else:
            reason = activation_axis_reason(node, activation_input)
        if reason:
            declined.append({"node": label, "activation": value.name if value is not None else None, "reason": reason})
            continue
        targets.setdefault(value.name, CalibrationTarget(value.name, [])).consumers.append(label)
    return list(targets.values()), declined


# -- data ------------------------------------------------------------------------------------------------


def _check_dims(array: np.ndarray, value: ir.Value, where: str, name: str) -> None:
    """The array's rank and static dims against the graph input, and at least one row, before onnxruntime."""
    _check_layout(tuple(array.shape), array.dtype, value, where, name)


def _check_layout(dims: tuple, dtype: np.dtype, value: ir.Value, where: str, name: str) -> None:
    """:func:`_check_dims` from an array's shape and dtype alone (an .npy header, before its data is read)."""
    if dtype.kind not in "biufc":
        raise CalibrationDataError(f"{where}: array {name!r} is {dtype}, not numbers")
    if math.prod(dims) == 0:
        raise CalibrationDataError(f"{where}: array {name!r} has shape {list(dims)}: no rows to calibrate on")
    shape = value.shape
    if shape is None:
        return
    reason = dims_mismatch(dims, shape)  # the same words as diff's and convert --check's --inputs
    if reason:
        raise CalibrationDataError(f"{where}: array {name!r} {reason}")


def _check_feed(feed: dict, inputs: dict[str, ir.Value], where: str) -> dict[str, np.ndarray]:
    missing = [name for name in inputs if name not in feed]
    if missing:
        raise CalibrationDataError(f"{where}: no array for graph input {missing[0]!r} "
                                   f"(has: {', '.join(sorted(feed)) or 'nothing'})")
    extra = sorted(set(feed) - set(inputs))
    if extra:
        log.warning("%s: arrays %s are not graph inputs; ignored", where, ", ".join(extra))
    checked = {}
    for name, value in inputs.items():
        array = np.asarray(feed[name])
        _check_dims(array, value, where, name)
        if array.dtype.kind == "f" and not np.isfinite(array).all():
            index = tuple(int(i) for i in np.argwhere(~np.isfinite(array))[0])
            raise NonFiniteError(f"{where}: array {name!r} holds {array[index]} at index {index}")
        expected = value.dtype.numpy() if value.dtype is not None else array.dtype
        if array.dtype != expected:
            if array.dtype.kind != np.dtype(expected).kind:
                raise CalibrationDataError(f"{where}: array {name!r} is {array.dtype}, graph input wants {expected}")
            array = array.astype(expected)
        checked[name] = array
    return checked


def iter_feeds(data, inputs: dict[str, ir.Value], batch_size: int | None = None) -> Iterator[tuple[str, dict]]:
    """Yield (where, feed) pairs from an .npz path, a folder of .npz files, or an iterable of dicts."""

    def split(where: str, feed: dict) -> Iterator[tuple[str, dict]]:
        feed = _check_feed(feed, inputs, where)
        if not batch_size:
            yield where, feed
            return
        rows = {a.shape[0] if a.ndim else 1 for a in feed.values()}
        if len(rows) != 1:
            raise CalibrationDataError(f"{where}: arrays differ in their first axis {sorted(rows)}; cannot batch")
        (n,) = rows
        for start in range(0, n, batch_size):
            yield f"{where}[{start}:{start + batch_size}]", {k: v[start:start + batch_size] for k, v in feed.items()}

    def npz(path: Path) -> Iterator[tuple[str, dict]]:
        # each array checked from its .npy header before it is inflated (fp4pass.npz); extras never read
        def check(name: str, dims: tuple, dtype: np.dtype) -> None:
            _check_layout(dims, dtype, inputs[name], str(path), name)

        feed, extra = read_npz(path, error=CalibrationDataError, names=set(inputs), check=check)
        if extra and not feed:  # nothing to feed: name what the file has and what the model wants
            raise CalibrationDataError(f"{path}: none of its arrays ({', '.join(sorted(extra))}) names a graph "
                                       f"input; the model's inputs are {', '.join(map(repr, inputs))}")
        if extra:
            log.warning("%s: arrays %s are not graph inputs; ignored", path, ", ".join(sorted(extra)))
        yield from split(str(path), feed)

    if isinstance(data, (str, os.PathLike)):
        path = Path(data)
        if path.is_dir():
            files = npz_files(path, CalibrationDataError)  # regular files only: a FIFO would block forever
            if not files:
                raise CalibrationDataError(f"{path}: folder holds no .npz files")
            for file in files:
                yield from npz(file)
        elif os.path.lexists(path):
            yield from npz(path)  # read_npz refuses what is not a regular file
        else:
            raise CalibrationDataError(f"{path}: no such file or folder")
        return
    if isinstance(data, dict):
        data = [data]
    for i, feed in enumerate(data):
        if not isinstance(feed, dict):
            raise CalibrationDataError(f"calibration feed #{i}: expected a dict of arrays, got {type(feed).__name__}")
        yield from split(f"calibration feed #{i}", feed)


# -- session ---------------------------------------------------------------------------------------------


def _session(model: ir.Model, names: list[str], provider: str):
    """An onnxruntime session over a lowered copy of ``model`` whose outputs include ``names``."""
    from fp4pass.onnx.lower import lower_for_ort
    from fp4pass.onnx.runtime import make_session

    lowered = lower_for_ort(model)
    values = {v.name: v for node in lowered.graph for v in node.outputs}
    outputs = {v.name for v in lowered.graph.outputs}
    for name in names:
        if name in outputs or name not in values:
            continue
        lowered.graph.outputs.append(values[name])
    return make_session(lowered, provider, options=_session_options())


def _session_options():
    """onnxruntime options for calibration: its CPU thread pools stop spin-waiting as soon as a run returns.

    By default onnxruntime's worker threads keep spinning for a while after ``run`` returns, waiting for the
    next one; here the statistics of the batch run next on the same cores, and measured 10-20x slower while
    the pools spun (2 cores, the calibration benchmark). ``session.force_spinning_stop`` keeps the spinning inside
    a run (its speed) and stops it when the run returns.
    """
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3  # as make_session's default: errors only
    options.add_session_config_entry("session.force_spinning_stop", "1")
    return options


class _TargetOutputs:
    """``session.run`` for the target activations, written into buffers reused from batch to batch.

    The first batch runs plainly; while later feeds have the same shapes, the targets are bound (onnxruntime
    IO binding) to the previous batch's output arrays, so onnxruntime writes them in place instead of
    allocating and copying fresh ones each batch (measured ~4% of the run on the calibration benchmark). The
    statistics never keep a view of a batch, so reusing its memory is safe. Any failure (a shape that
    depends on the data, a dtype numpy cannot hold) falls back to plain runs for good.
    """

    _DTYPES = (np.float32, np.float16, np.float64)

    def __init__(self, session, names: list[str], reuse: bool = True):
        self.session, self.names, self.reuse = session, names, reuse
        self.buffers: dict[str, np.ndarray] | None = None
        self.shapes: dict[str, tuple] | None = None
        self.binding = None

    def run(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        shapes = {name: (array.shape, array.dtype) for name, array in feed.items()}
        if self.reuse and self.buffers is not None and shapes == self.shapes:
            try:
                return self._run_bound(feed)
            except Exception as exc:  # noqa: BLE001 - onnxruntime's own exception types; plain runs still work
                log.debug("calibration: IO binding failed (%s); running without it", exc)
                self.reuse = False
        results = dict(zip(self.names, self.session.run(self.names, feed)))
        if self.reuse and all(isinstance(a, np.ndarray) and a.dtype in self._DTYPES and a.flags.c_contiguous
                              and a.flags.writeable for a in results.values()):
            self.buffers, self.shapes = results, shapes
        return results

    def _run_bound(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self.binding is None:
            self.binding = self.session.io_binding()
        binding = self.binding
        binding.clear_binding_inputs()
        binding.clear_binding_outputs()
        for name, array in feed.items():
            binding.bind_cpu_input(name, np.ascontiguousarray(array))
        for name, buffer in self.buffers.items():
            binding.bind_output(name, "cpu", 0, buffer.dtype, buffer.shape, buffer.ctypes.data)
        self.session.run_with_iobinding(binding)
        return self.buffers


def _stats_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


# -- the run ---------------------------------------------------------------------------------------------


def calibrate_model(model, data, calibrator="max", provider: str = "auto", *, activations: list[str] | None = None,
                    batch_size: int | None = None, device=None, show_progress: bool | None = False,
                    **calibrator_options) -> ActivationScales:
    """Calibrate the NVFP4 activation scales of ``model`` on ``data`` (module docstring).

    ``model``: an ``onnx_ir.Model`` (or anything :func:`fp4pass.onnx.loading.load` reads); it is not changed.
    ``calibrator``: "max" | "percentile" | "headroom" | "mse" or a :class:`Calibrator`; ``calibrator_options``
    go to its constructor (rho, margin, percentile, ...). ``activations``: calibrate these tensors instead of
    the FP4 consumers' inputs. Returns :class:`ActivationScales` (``.report()`` has the per-activation report).
    """
    if not isinstance(model, ir.Model):
        from fp4pass.onnx.loading import load

        model = load(model).model
    method = make_calibrator(calibrator, **calibrator_options)
    if activations is None:
        targets, declined = calibration_targets(model)
        for entry in declined:
            log.info("calibration: node %s declined: %s", entry["node"], entry["reason"])
    else:
        targets = [CalibrationTarget(name, []) for name in activations]
    if not targets:
        raise ModelError("no activation to calibrate: no MatMul/Gemm/Einsum/QMoE consumes an FP4 weight")
    graph_inputs = {v.name: v for v in model.graph.inputs if v.const_value is None or v.name not in model.graph.initializers}
    names = [t.name for t in targets]
    known = {v.name for node in model.graph for v in node.outputs} | set(graph_inputs)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ModelError(f"activation {unknown[0]!r} is not a tensor of the model's main graph")
    run_names = [n for n in names if n not in graph_inputs]

    session, provider_used, note = _session(model, run_names, provider)
    if note:
        log.info("calibration: %s", note)
    device = torch.device(device) if device is not None else _stats_device()
    stats = {n: ActivationStats(n, device=device, abs_histogram=method.needs_abs_histogram,
                                reservoir=method.reservoir, top_k=method.top_k) for n in names}
    outputs = _TargetOutputs(session, run_names, reuse=provider_used == "cpu")
    with _single_torch_thread(device.type == "cpu"):
        batches = _collect(outputs, stats, names, graph_inputs, iter_feeds(data, graph_inputs, batch_size),
                           show_progress)
    if batches == 0:
        raise CalibrationDataError("calibration data holds no feed")
    scales = ActivationScales(method.name, provider=provider_used, batches=batches)
    for name in names:
        scales.tensors[name] = scale_for(stats[name], method)
    return scales


@contextlib.contextmanager
def _single_torch_thread(enabled: bool):
    """Run the CPU statistics on one torch thread, restoring torch's thread count after.

    The per-batch statistics are a few memory-bound passes of ~1 ms; torch's parallel regions cost more than
    they save there, and on shared, loaded cores a parallel region waits for a descheduled thread: measured
    16 updates of a [512, 4096] batch at 55 ms on one thread vs 2.5 s on two (2 cores, one busy elsewhere).
    """
    if not enabled:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _collect(outputs, stats, names, graph_inputs, feeds, show_progress) -> int:
    """Run every feed and add each target's batch to its statistics; returns the number of feeds."""
    batches = 0
    for where, feed in progress(feeds, desc="calibrate", enabled=show_progress, unit="batch"):
        try:
            results = outputs.run(feed) if outputs.names else {}
        except Exception as exc:  # noqa: BLE001 - onnxruntime's own types (InvalidArgument: an id out of range)
            if not type(exc).__module__.startswith("onnxruntime"):
                raise
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise CalibrationDataError(f"{where}: onnxruntime refused the feed: {first}") from None
        for name in names:
            value = feed[name] if name in graph_inputs else results[name]
            try:
                stats[name].update(torch.from_numpy(np.ascontiguousarray(value)))
            except NonFiniteError as exc:
                raise NonFiniteError(f"{where}: {exc}") from None
        batches += 1
    return batches
