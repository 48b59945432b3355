"""``fp4pass.onnx.diff``: run two models on the same inputs under onnxruntime and measure how far apart they are.

Signature::

    result = diff(original, rewritten, inputs=None, provider="auto", *, intermediates=False, snr_min=None,
                  seed=0, shapes=None, show_progress=None, intermediate_budget_bytes=1 << 30, past_length=0)

1. Both models (path, ``onnx.ModelProto`` or ``onnx_ir.Model``) are read (:mod:`fp4pass.onnx.loading`) and
   lowered for onnxruntime, exactly (:func:`fp4pass.onnx.lower.lower`).
2. Inputs: ``inputs`` (a dict or an .npz path, arrays named after graph inputs) wins; every other input of
   ``original`` is drawn from ``numpy.random.default_rng(seed)``: floats standard normal, integers uniform in
   [0, 16), bools fair coins, and a note says which inputs were made up. Symbolic dims take ``shapes[name]``
   (the input's full dims), else the graph's own shapes settle them (:mod:`fp4pass.onnx.feeds`: a dim name
   shared with a given input, a KV cache's past length ``past_length`` (default 0), its head dim, an all-ones
   ``attention_mask``); a symbolic dim still open is 1, and a note says so.
3. Sessions come from :func:`fp4pass.onnx.runtime.make_session` ("auto": CUDA EP if it loads, else CPU).
   On the CUDA EP (TF32 off: ``provider_options`` says what the session took) the first run of each model is
   profiled: ``placement`` counts the nodes each EP ran, and ``provider`` is "cuda" only when every node that
   reads weights ran on the CUDA EP, else "cuda (N nodes on cpu)" with a note naming them.
   ``provider="reference"`` runs both models with ``onnx.reference`` instead (numpy: slow, for small models),
   lowering only TensorRT's activation quantizer: what onnxruntime's CPU kernels cannot run (bfloat16
   MatMul) still gets a diff. Where onnxruntime has no kernel for a node (its NOT_IMPLEMENTED), the diff
   falls back to ``reference`` by itself, and the first note says so.
4. Outputs are matched by name (by position, with a note, when no name is shared); each gets the
   :mod:`fp4pass.metrics` figures, ``original`` being the reference ``a``.
5. ``intermediates``: every tensor produced by a node in both graphs (as given, before lowering) under the
   same name is exposed as an extra output, except one that a model holds without its NVFP4 global scale
   (alpha form) while the other holds it with the scale: they differ by that scale by design, and a note
   names them (:mod:`fp4pass.onnx.alpha_scope`). They are fetched in chunks whose estimated size stays under
   ``intermediate_budget_bytes`` per model, compared, and dropped: memory stays near the budget plus the
   largest tensor, whatever the model. Each chunk is one run of each model.
6. ``first_divergent``: the first node of ``original`` (as given) in topological order with a compared output
   under ``snr_min`` dB (or with NaN/Inf the original does not have); with ``intermediates`` and no
   ``snr_min``, the first whose output differs at all: ``{"node", "op_type", "tensor", "snr_db"}``.
7. ``passed``: no *output* under ``snr_min`` and no output with new NaN/Inf (intermediates inform, the
   outputs decide). Without ``snr_min`` only the NaN/Inf rule applies.
"""

from __future__ import annotations

import logging
import math
import os
import re
import tempfile

import numpy as np
import onnx_ir as ir

from fp4pass.choices import CheckProvider
from fp4pass.errors import ModelError, UsageError
from fp4pass.metrics import TensorMetrics, compare
from fp4pass.npz import read_npz
from fp4pass.onnx.alpha_scope import missing_global_scale
from fp4pass.onnx.diff_plot import PLOT_SNR_CAP, PlotPoints, plot_diff, plot_points  # noqa: F401  (public here)
from fp4pass.onnx.diff_result import DiffResult, worst_first  # noqa: F401  (DiffResult: public here too)
from fp4pass.onnx.feeds import dims_mismatch, kv_cache_pairs, plan_feeds
from fp4pass.onnx.initializer_inputs import initializer_inputs, unlist_initializer_inputs
from fp4pass.onnx.loading import load
from fp4pass.onnx.lower import lower
from fp4pass.onnx.runtime import (Placement, cuda_available, end_profile, make_session, node_placement, profiling,
                                  run_with_past_buffers)
from fp4pass.onnx.runtime import provider_options as session_provider_options
from fp4pass.progress import progress

__all__ = ["diff", "DiffResult", "make_inputs", "plot_diff", "plot_points", "PlotPoints", "PLOT_SNR_CAP", "REFERENCE"]

logger = logging.getLogger(__name__)

#: the provider that runs both models with onnx.reference (numpy; slow, exact, runs what onnxruntime's CPU
#: kernels do not: bfloat16 MatMul, FP4 DequantizeLinear unlowered)
REFERENCE = CheckProvider.REFERENCE.value
_ERROR_SAMPLE = 200_000  # |a-b| values kept from the worst output, for the histogram
_DEFAULT_ELEMENTS = 1 << 20  # size assumed for a tensor whose shape is not known statically
#: the most elements drawn for one random input (4 GiB of float32), static dims and --shape alike
MAX_RANDOM_ELEMENTS = 2**30


def _static_dims(value: ir.Value, shapes: dict, notes: list[str]) -> tuple[int, ...]:
    name = value.name
    if name in shapes:
        dims = tuple(int(d) for d in shapes[name])
        if value.shape is not None and len(dims) != len(value.shape):
            raise UsageError(f"--shape {name}: {len(dims)} dims given, the input has {len(value.shape)}")
        return dims
    if value.shape is None:
        raise UsageError(f"input {name!r} has no shape in the model; give it with --shape {name}=D0,D1,...")
    dims = []
    for i, d in enumerate(value.shape):
        if isinstance(d, int):
            dims.append(d)
        else:
            notes.append(f"input {name!r} dim {i} ({d}) is symbolic; used 1 (set it with --shape {name}=...)")
            dims.append(1)
    return tuple(dims)


def _random_dims(name: str, dims: tuple[int, ...]) -> tuple[int, ...]:
    """``dims`` of a random input, refused (one line) when negative or above :data:`MAX_RANDOM_ELEMENTS` (the
    non-zero dims' product: an empty array of a dim above it is refused by numpy too)."""
    if any(d < 0 for d in dims):
        raise UsageError(f"input {name!r}: dims {list(dims)} are negative")
    # counted with 0 dims as 1: numpy refuses [0, 2^62] as it refuses [2^62]
    if math.prod(max(d, 1) for d in dims) > MAX_RANDOM_ELEMENTS:
        raise UsageError(f"input {name!r}: dims {list(dims)} are {math.prod(dims)} elements; at most "
                         f"{MAX_RANDOM_ELEMENTS} (2^30) are drawn at random per input (give it in --inputs, or "
                         f"smaller dims with --shape {name}=...)")
    return dims


def _as_input_type(name: str, array: np.ndarray, dtype: np.dtype, notes: list[str]) -> np.ndarray:
    """A given array in the input's type. ``np.savez`` of an ml_dtypes array (bfloat16, float8) reads back as
    raw bytes ('V2', 'V1'): those are the input's values when the item sizes agree, and are viewed as such."""
    if array.dtype == dtype:
        return array
    if array.dtype.kind == "V" and array.dtype.itemsize == dtype.itemsize:
        notes.append(f"input {name!r}: given as raw {array.dtype.itemsize}-byte items, read as {dtype}")
        return array.view(dtype)
    try:
        cast = array.astype(dtype)
    except (TypeError, ValueError) as error:
        raise UsageError(f"input {name!r}: the given {array.dtype} array cannot be cast to the input's type "
                         f"{dtype} ({error})") from None
    notes.append(f"input {name!r}: given {array.dtype}, cast to {dtype}")
    return cast


def make_inputs(model: ir.Model, given: dict | None = None, *, seed: int = 0, shapes: dict | None = None,
                notes: list[str] | None = None, past_length: int = 0) -> dict[str, np.ndarray]:
    """Feeds for every graph input of ``model``: ``given`` arrays, the rest seeded random (module docstring), their
    symbolic dims settled from the graph's own shapes (:mod:`fp4pass.onnx.feeds`; ``past_length``: of a KV cache)."""
    given = dict(given or {})
    shapes = shapes or {}
    notes = notes if notes is not None else []
    rng = np.random.default_rng(seed)
    feeds = {}
    names = [v.name for v in model.graph.inputs]
    unknown = sorted(set(given) - set(names))
    if unknown:
        raise UsageError(f"inputs {unknown} are not graph inputs of the model (inputs: {names})")
    unknown_shapes = sorted(set(shapes) - set(names))
    if unknown_shapes:
        raise UsageError(f"--shape names {unknown_shapes} that are not graph inputs (inputs: {names})")
    given, shapes = plan_feeds(model, given, shapes, past_length, notes)
    for value in model.graph.inputs:
        dtype = value.dtype.numpy() if value.dtype is not None else np.dtype(np.float32)
        if value.name in given:
            array = np.asarray(given[value.name])
            reason = dims_mismatch(array.shape, value.shape)
            if reason:
                raise UsageError(f"input {value.name!r}: the given array {reason}")
            feeds[value.name] = _as_input_type(value.name, array, dtype, notes)
            continue
        if value.const_value is not None:
            continue  # an input with a default initializer (old IR)
        dims = _random_dims(value.name, _static_dims(value, shapes, notes))
        if np.issubdtype(dtype, np.floating) or (value.dtype is not None and value.dtype.is_floating_point()):
            # drawn in float32 (never a float64 array then a copy), rounded once to the input's type when it is
            # another (ml_dtypes' bfloat16 and float8 included)
            feeds[value.name] = rng.standard_normal(dims, dtype=np.float32).astype(dtype, copy=False)
        elif np.issubdtype(dtype, np.integer):
            feeds[value.name] = rng.integers(0, 16, size=dims, dtype=dtype)
        elif dtype == np.bool_:
            feeds[value.name] = rng.integers(0, 2, size=dims, dtype=np.bool_)
        else:
            raise UsageError(f"input {value.name!r} of type {value.dtype} cannot be drawn at random; "
                             "give it in --inputs")
    drawn = [n for n in feeds if n not in given]
    if drawn:
        notes.append(f"inputs {drawn} are not given: made up (random values, seed {seed}), not real data; "
                     "give them with --inputs DATA.npz")
    return feeds


def _load_inputs(inputs, model: ir.Model) -> dict | None:
    """The arrays of an .npz (:func:`fp4pass.npz.read_npz`), each checked from its header against ``model``'s
    graph inputs (the name, the rank) before its data is inflated."""
    if inputs is None or isinstance(inputs, dict):
        return inputs
    graph_inputs = {v.name: v for v in model.graph.inputs}

    def check(name: str, dims: tuple, _dtype: np.dtype) -> None:  # the type is cast later, with its own message
        if name not in graph_inputs:
            raise UsageError(f"{inputs}: array {name!r} is not a graph input of the model "
                             f"(inputs: {list(graph_inputs)})")
        reason = dims_mismatch(dims, graph_inputs[name].shape)  # rank and static dims, as calibrate checks
        if reason:
            raise UsageError(f"{inputs}: array {name!r} {reason}")

    return read_npz(inputs, error=UsageError, check=check)[0]


def _node_outputs(model: ir.Model) -> dict[str, tuple[ir.Node, ir.Value]]:
    """name -> (producer, value) for every node output, in graph (topological) order."""
    found = {}
    for node in model.graph:
        for out in node.outputs:
            if out.name:
                found[out.name] = (node, out)
    return found


def _estimate_bytes(value: ir.Value, default: int) -> int:
    if value.shape is None or not all(isinstance(d, int) for d in value.shape):
        return default
    itemsize = value.dtype.itemsize if value.dtype is not None else 4
    return int(math.prod(value.shape) * itemsize)


def _chunks(names: list[str], sizes: dict[str, int], budget: int) -> list[list[str]]:
    chunks, current, used = [], [], 0
    for name in names:
        if current and used + sizes[name] > budget:
            chunks.append(current)
            current, used = [], 0
        current.append(name)
        used += sizes[name]
    if current:
        chunks.append(current)
    return chunks


def _with_outputs(model: ir.Model, names: list[str]) -> ir.Model:
    """A copy of ``model`` whose graph also outputs the node outputs ``names`` (tensors shared, not copied)."""
    copy = model.clone()
    produced = _node_outputs(copy)
    have = {v.name for v in copy.graph.outputs}
    for name in names:
        if name not in have:
            copy.graph.outputs.append(produced[name][1])
    return copy


def _ort_log_severity() -> int:
    """onnxruntime's own log lines (its C++ logger writes to stderr itself): errors (3) when INFO logging is on
    (``-v``, ``--debug``), else only fatal ones (4); its failures reach the user as fp4pass errors anyway."""
    return 3 if logging.getLogger().isEnabledFor(logging.INFO) else 4


def _session_options():
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = _ort_log_severity()
    return options


def _run_options():
    import onnxruntime as ort

    options = ort.RunOptions()
    options.log_severity_level = _ort_log_severity()
    return options


class _Runner:
    """One model lowered once; runs it with extra outputs, creating a session per output set (or, for the
    ``reference`` provider, an ``onnx.reference.ReferenceEvaluator``)."""

    def __init__(self, model: ir.Model, provider: str, label: str, notes: list[str], fed=()):
        self.label = label
        self.reference = provider == REFERENCE
        if initializer_inputs(model, fed):
            model = model.clone()  # the caller's model stays as it is
            listed = unlist_initializer_inputs(model, fed)
            if listed:
                more = f" and {len(listed) - 3} more" if len(listed) > 3 else ""
                shown = ", ".join(repr(n) for n in listed[:3]) + more
                notes.append(f"{label}: {len(listed)} initializers also listed as graph inputs ({shown}) and not fed: "
                             "their stored values are used, as onnxruntime does")
        self.model, report = lower(model, for_reference=self.reference)
        runtime = "onnx.reference" if self.reference else "onnxruntime"
        if report.lowered or report.declined:
            notes.append(f"{label}: lowered for {runtime}: {report.summary()}")
        notes.extend(f"{label}: not lowered: {reason}" for reason in report.declined)
        if self.reference:
            ir.external_data.load_to_model(self.model)  # the evaluator reads tensors from the proto itself
        self.provider_arg = provider
        self.provider = None
        self.note = None
        self.placement: Placement | None = None  # of the first run on the CUDA EP
        self.provider_options: dict = {}
        self.input_names = [v.name for v in self.model.graph.inputs if v.const_value is None]
        self.output_names = [v.name for v in self.model.graph.outputs]
        self.notes = notes
        self.kv_pairs = kv_cache_pairs(self.model)  # {present output: past input}
        self.past_buffers: dict[str, str] | None = None  # the pairs of equal shapes, learned on the first run

    def run(self, feeds: dict, extra: list[str] = ()) -> dict[str, np.ndarray]:
        model = _with_outputs(self.model, list(extra)) if extra else self.model
        if self.reference:
            return self._run_reference(model, feeds)
        options = _session_options()
        profile_dir = None
        if self.placement is None and self.provider_arg != "cpu" and cuda_available()[0]:
            profile_dir = tempfile.TemporaryDirectory(prefix="fp4pass-profile-")
            profiling(options, profile_dir.name)
        try:
            return self._run_session(model, options, feeds, profiled=profile_dir is not None)
        finally:
            if profile_dir is not None:
                profile_dir.cleanup()

    def _run_session(self, model: ir.Model, options, feeds: dict, profiled: bool) -> dict[str, np.ndarray]:
        try:
            session, self.provider, self.note = make_session(model, self.provider_arg, options=options)
        except ModelError as exc:
            kind = _NoKernel if "NOT_IMPLEMENTED" in str(exc) else ModelError
            raise kind(f"{self.label}: {exc}") from None
        self.provider_options = session_provider_options(session)
        names = [o.name for o in session.get_outputs()]
        missing = [n for n in self.input_names if n not in feeds]
        if missing:
            raise ModelError(f"{self.label}: needs inputs {missing} that the original model does not have")
        try:
            values = self._run_feeds(session, names, {n: feeds[n] for n in self.input_names})
        except Exception as exc:  # onnxruntime's own error types
            first = str(exc).strip().splitlines()[0]
            raise ModelError(f"{self.label}: onnxruntime failed to run it: {first}") from None
        if profiled:
            events = end_profile(session)
            if self.provider == "cuda":
                self.placement = node_placement(events, model)
        return dict(zip(names, values))

    def _run_feeds(self, session, names: list[str], feeds: dict) -> list:
        """One run. A present output of the same shape as its non-empty past input (a ring buffer longer than
        the tokens) gets a copy of the past as its buffer (:func:`run_with_past_buffers`): the attention kernel
        writes only the new rows, and the rest would be uninitialised memory, different from run to run. Which
        presents have their past's shape is learned once, by a plain run whose values are dropped."""
        if self.past_buffers is None:
            candidates = {p: q for p, q in self.kv_pairs.items() if p in names and q in feeds and feeds[q].size}
            self.past_buffers = {}
            if candidates:
                plain = dict(zip(names, session.run(names, feeds, _run_options())))
                self.past_buffers = {p: q for p, q in candidates.items() if plain[p].shape == feeds[q].shape}
                del plain
            if self.past_buffers:
                self.notes.append(f"{self.label}: outputs {sorted(self.past_buffers)} have their past input's shape: "
                                  "run in a copy of it (the rows the attention kernel does not write keep the past's "
                                  "values, as in onnxruntime-genai's shared buffer)")
        if not self.past_buffers:
            return session.run(names, feeds, _run_options())
        return run_with_past_buffers(session, names, feeds, self.past_buffers, self.provider, _run_options())

    def _run_reference(self, model: ir.Model, feeds: dict) -> dict[str, np.ndarray]:
        from onnx.reference import ReferenceEvaluator

        self.provider = REFERENCE
        missing = [n for n in self.input_names if n not in feeds]
        if missing:
            raise ModelError(f"{self.label}: needs inputs {missing} that the original model does not have")
        names = [v.name for v in model.graph.outputs]
        try:
            evaluator = ReferenceEvaluator(ir.serde.serialize_model(model))
            values = evaluator.run(names, {n: feeds[n] for n in self.input_names})
        except Exception as exc:  # onnx.reference raises whatever numpy or its op raises
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ModelError(f"{self.label}: onnx.reference failed to run it: {first}") from None
        return dict(zip(names, values))


class _NoKernel(ModelError):
    """onnxruntime has no kernel for a node of the model (bfloat16 MatMul on CPU, for one)."""


def diff(reference, candidate, inputs=None, provider: str = "auto", *, intermediates: bool = False,
         snr_min: float | None = None, seed: int = 0, shapes: dict | None = None,
         show_progress: bool | None = None, intermediate_budget_bytes: int = 1 << 30,
         past_length: int = 0, base_dir: str | os.PathLike | None = None) -> DiffResult:
    """Compare ``candidate`` (the rewritten model) against ``reference`` (the original) under onnxruntime (module
    docstring for every step).

    ``base_dir``: the folder the external data of a model given as a proto or ``onnx_ir.Model`` resolves
    against (:func:`fp4pass.onnx.loading.load`); a path's own folder always wins.
    """
    options = dict(intermediates=intermediates, snr_min=snr_min, seed=seed, shapes=shapes,
                   show_progress=show_progress, intermediate_budget_bytes=intermediate_budget_bytes,
                   past_length=past_length, base_dir=base_dir)
    try:
        return _diff(reference, candidate, inputs, provider, **options)
    except _NoKernel as exc:
        if provider == REFERENCE:
            raise
        reason = str(exc)
        found = re.search(r"Could not find an implementation for (.*)", reason)
        reason = found.group(1).strip() if found else reason
    logger.debug("diff: onnxruntime cannot run it (%s); running onnx.reference instead", reason)
    result = _diff(reference, candidate, inputs, REFERENCE, **options)
    result.notes.insert(0, f"onnxruntime has no kernel for {reason}: both models ran under onnx.reference "
                           "instead (as with --provider reference: numpy, slow on big models)")
    return result


def _diff(original, rewritten, inputs, provider: str, *, intermediates: bool, snr_min: float | None, seed: int,
          shapes: dict | None, show_progress: bool | None, intermediate_budget_bytes: int,
          past_length: int, base_dir: str | os.PathLike | None) -> DiffResult:
    notes: list[str] = []
    model_a = load(original, base_dir).model
    model_b = load(rewritten, base_dir).model
    label_a = str(original) if isinstance(original, (str, os.PathLike)) else "original"
    label_b = str(rewritten) if isinstance(rewritten, (str, os.PathLike)) else "rewritten"
    given = _load_inputs(inputs, model_a)
    runner_a = _Runner(model_a, provider, label_a, notes, fed=given or ())
    runner_b = _Runner(model_b, provider, label_b, notes, fed=given or ())
    feeds = make_inputs(runner_a.model, given, seed=seed, shapes=shapes, notes=notes,
                        past_length=past_length)

    pairs = [(n, n) for n in runner_a.output_names if n in runner_b.output_names]
    if not pairs and len(runner_a.output_names) == len(runner_b.output_names):
        pairs = list(zip(runner_a.output_names, runner_b.output_names))
        notes.append("no output name is shared; outputs matched by position")
    missing = [n for n in runner_a.output_names if n not in {a for a, _ in pairs}]
    if missing:
        notes.append(f"outputs of the original not in the rewritten model: {missing}")
    if not pairs:
        raise ModelError(f"{label_a} and {label_b} share no output to compare")

    produced_a = _node_outputs(runner_a.model)
    produced_b = _node_outputs(runner_b.model)
    inter_names = []
    if intermediates:
        inter_names = _comparable(model_a, model_b, runner_a, runner_b, label_a, label_b, notes)
    sizes = {n: max(_estimate_bytes(produced_a[n][1], _DEFAULT_ELEMENTS * 4),
                    _estimate_bytes(produced_b[n][1], _DEFAULT_ELEMENTS * 4)) for n in inter_names}
    chunks = _chunks(inter_names, sizes, intermediate_budget_bytes) or [[]]

    output_metrics: list[TensorMetrics] = []
    inter_metrics: list[TensorMetrics] = []
    worst_errors, worst_key = None, None
    sample_rng = np.random.default_rng(seed)
    for i, chunk in enumerate(progress(chunks, desc="diff: running both models", enabled=show_progress)):
        values_a = runner_a.run(feeds, chunk)
        values_b = runner_b.run(feeds, chunk)
        if i == 0:
            for name_a, name_b in pairs:
                try:
                    m, errors = compare(name_a, values_a.pop(name_a), values_b.pop(name_b), keep_errors=True)
                except ValueError as exc:
                    raise ModelError(f"output {exc}") from None
                output_metrics.append(m)
                if worst_key is None or worst_first(m) < worst_key:
                    worst_key = worst_first(m)
                    if errors.size > _ERROR_SAMPLE:
                        errors = sample_rng.choice(errors, _ERROR_SAMPLE, replace=False)
                    worst_errors = errors
        for name in chunk:
            a, b = values_a.pop(name), values_b.pop(name)
            if a.shape != b.shape:
                notes.append(f"intermediate {name!r}: shapes differ ({a.shape} vs {b.shape}); not compared")
                continue
            if not (np.issubdtype(a.dtype, np.number) or a.dtype == np.bool_):
                continue
            inter_metrics.append(compare(name, a, b))
        del values_a, values_b
    provider_used, placement = _placement(runner_a, runner_b, notes)
    provider_notes = sorted({runner_a.note, runner_b.note} - {None})
    notes[:0] = provider_notes

    by_name = {m.name: m for m in [*inter_metrics, *output_metrics]}
    first = _first_divergent(model_a, by_name, snr_min, any_difference=intermediates and snr_min is None)
    passed = not any(m.below(snr_min) for m in output_metrics)
    order = [n for n in produced_a if n in by_name] + [m.name for m in output_metrics if m.name not in produced_a]
    for note in notes:
        logger.debug("diff: %s", note)
    return DiffResult(provider_used, output_metrics, inter_metrics, first, passed, notes, snr_min, order, worst_errors,
                      provider_notes, runner_a.provider_options or runner_b.provider_options, placement)


def _placement(runner_a: _Runner, runner_b: _Runner, notes: list[str]) -> tuple[str, dict | None]:
    """The diff's ``provider`` and ``placement`` (module docstring, step 3): "cuda" when both models' weight nodes
    ran on the CUDA EP, else "cuda (N nodes on cpu)", N the CPU nodes of both; a note per model names its weight
    nodes that ran on the CPU."""
    if runner_a.placement is None and runner_b.placement is None:
        return runner_a.provider, None
    placements = {"original": runner_a.placement, "rewritten": runner_b.placement}
    on_cpu = 0
    for runner, placement in ((runner_a, runner_a.placement), (runner_b, runner_b.placement)):
        if placement is None or not placement.weight_nodes_on_cpu:
            continue
        on_cpu += len(placement.on_cpu)
        shown = ", ".join(repr(n) for n in placement.weight_nodes_on_cpu[:5])
        more = f" and {len(placement.weight_nodes_on_cpu) - 5} more" if len(placement.weight_nodes_on_cpu) > 5 else ""
        notes.append(f"{runner.label}: {len(placement.weight_nodes_on_cpu)} of its {placement.weight_nodes} nodes "
                     f"that read weights ran on the CPU EP (no CUDA kernel): {shown}{more}")
    provider = "cuda" if not on_cpu else f"cuda ({on_cpu} nodes on cpu)"
    return provider, {key: p.to_json() for key, p in placements.items() if p is not None}


def _comparable(model_a: ir.Model, model_b: ir.Model, runner_a: _Runner, runner_b: _Runner, label_a: str,
                label_b: str, notes: list[str]) -> list[str]:
    """The intermediates to compare, in the original's order: produced under the same name by a node of both
    models as given (not by the lowering), not graph outputs, and holding the same quantity in both. A tensor
    one model holds without its global scale (alpha form, :mod:`fp4pass.onnx.alpha_scope`) and the other with
    it is left out, with a note: by name the two differ by that scale, which is not an error."""
    given_a, given_b = _node_outputs(model_a), _node_outputs(model_b)
    run_a, run_b = _node_outputs(runner_a.model), _node_outputs(runner_b.model)
    outputs = {*runner_a.output_names, *runner_b.output_names}
    names = [n for n in given_a if n in given_b and n in run_a and n in run_b and n not in outputs]
    unscaled_a, unscaled_b = missing_global_scale(model_a), missing_global_scale(model_b)
    skipped: dict[tuple[str, str], list[str]] = {}
    for name in names:
        if (name in unscaled_a) != (name in unscaled_b):
            label, appliers = (label_a, unscaled_a[name]) if name in unscaled_a else (label_b, unscaled_b[name])
            skipped.setdefault((label, appliers), []).append(name)
    for (label, appliers), left in skipped.items():
        notes.append(f"intermediates {left} not compared: {label} holds them without the global scale (alpha "
                     f"form; multiplied back in by {appliers}), the other model with it")
    left_out = {n for group in skipped.values() for n in group}
    return [n for n in names if n not in left_out]


def _first_divergent(model: ir.Model, by_name: dict[str, TensorMetrics], snr_min: float | None, *,
                     any_difference: bool = False) -> dict | None:
    """The first node of the original (as given, topological order) with a compared output under ``snr_min``
    dB or with NaN/Inf; ``any_difference`` (intermediates without ``snr_min``): the first whose output differs
    at all."""

    def diverges(m: TensorMetrics) -> bool:
        return m.below(snr_min) or (any_difference and not m.identical)

    for node in model.graph:
        hit = next((by_name[o.name] for o in node.outputs if o is not None and o.name in by_name
                    and diverges(by_name[o.name])), None)
        if hit is not None:
            return {"node": node.name, "op_type": node.op_type, "tensor": hit.name,
                    "snr_db": None if hit.snr_db is None or not math.isfinite(hit.snr_db) else hit.snr_db}
    return None
