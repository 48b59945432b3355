"""``fp4pass.onnx.diff``: run two models on the same inputs under onnxruntime and measure how far apart they are.

Signature::

    result = diff(original, rewritten, inputs=None, provider="auto", *, intermediates=False, snr_min=None,
                  seed=0, shapes=None, show_progress=None, intermediate_budget_bytes=1 << 30)

1. Both models (path, ``onnx.ModelProto`` or ``onnx_ir.Model``) are read (:mod:`fp4pass.onnx.loading`) and
   lowered for onnxruntime, exactly (:func:`fp4pass.onnx.lower.lower`).
2. Inputs: ``inputs`` (a dict or an .npz path, arrays named after graph inputs) wins; every other input of
   ``original`` is drawn from ``numpy.random.default_rng(seed)``: floats standard normal, integers uniform in
   [0, 16), bools fair coins. Symbolic dims take ``shapes[name]`` (the input's full dims); a symbolic dim
   without one is 1, and a note says so.
3. Sessions come from :func:`fp4pass.onnx.runtime.make_session` ("auto": CUDA EP if it loads, else CPU).
   ``provider="reference"`` runs both models with ``onnx.reference`` instead (numpy: slow, for small models),
   lowering only TensorRT's activation quantizer: what onnxruntime's CPU kernels cannot run (bfloat16
   MatMul) still gets a diff.
4. Outputs are matched by name (by position, with a note, when no name is shared); each gets the
   :mod:`fp4pass.metrics` figures, ``original`` being the reference ``a``.
5. ``intermediates``: every tensor produced by a node in both graphs under the same name is exposed as an
   extra output. They are fetched in chunks whose estimated size stays under ``intermediate_budget_bytes``
   per model, compared, and dropped: memory stays near the budget plus the largest tensor, whatever the
   model. Each chunk is one run of each model.
6. ``first_divergent``: the first node of ``original`` in topological order with a compared output under
   ``snr_min`` dB (or with NaN/Inf the original does not have): ``{"node", "op_type", "tensor", "snr_db"}``.
7. ``passed``: no *output* under ``snr_min`` and no output with new NaN/Inf (intermediates inform, the
   outputs decide). Without ``snr_min`` only the NaN/Inf rule applies.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx_ir as ir

from fp4pass.choices import CheckProvider
from fp4pass.errors import ModelError, UsageError
from fp4pass.metrics import TensorMetrics, compare
from fp4pass.npz import read_npz
from fp4pass.onnx.loading import load
from fp4pass.onnx.lower import lower
from fp4pass.onnx.runtime import make_session
from fp4pass.progress import progress

__all__ = ["diff", "DiffResult", "make_inputs", "plot_diff", "REFERENCE"]

logger = logging.getLogger(__name__)

#: the provider that runs both models with onnx.reference (numpy; slow, exact, runs what onnxruntime's CPU
#: kernels do not: bfloat16 MatMul, FP4 DequantizeLinear unlowered)
REFERENCE = CheckProvider.REFERENCE.value
_ERROR_SAMPLE = 200_000  # |a-b| values kept from the worst output, for the histogram
_DEFAULT_ELEMENTS = 1 << 20  # size assumed for a tensor whose shape is not known statically
#: the most elements drawn for one random input (4 GiB of float32), static dims and --shape alike
MAX_RANDOM_ELEMENTS = 2**30


def _sort_key(m: TensorMetrics) -> tuple:
    """Worst first: new NaN/Inf, then lowest SNR; identical tensors last."""
    snr = math.inf if m.snr_db is None else m.snr_db
    return (not m.new_nonfinite, snr, -m.max_abs_err)


@dataclass
class DiffResult:
    """What :func:`diff` found. ``to_json`` gives the JSON keys of ``fp4pass diff --json``; the rest is for tables and plots."""

    provider: str
    outputs: list[TensorMetrics]
    intermediates: list[TensorMetrics]
    first_divergent: dict | None
    passed: bool
    notes: list[str] = field(default_factory=list)
    snr_min: float | None = None
    order: list[str] = field(default_factory=list)  # compared tensors, topological order of the original
    worst_output_errors: np.ndarray | None = None  # sample of |a-b| of the worst output

    def to_json(self) -> dict:
        return {
            "provider": self.provider,
            "outputs": [m.to_json() for m in self.outputs],
            "intermediates": [m.to_json() for m in self.intermediates],
            "first_divergent": self.first_divergent,
            "passed": self.passed,
        }

    def format_table(self, limit: int = 20) -> str:
        """Outputs, then the worst ``limit`` intermediates, each worst first; then the verdict."""

        def fmt(value, spec):
            return "-" if value is None else format(value, spec)

        header = (f"{'tensor':<40} {'shape':<18} {'snr_db':>8} {'rel_l2':>10} {'cosine':>10} {'max_abs':>10} "
                  f"{'mean_abs':>10} {'p99_abs':>10} {'nan':>5} {'inf':>5}")
        lines = []

        def section(title, rows):
            lines.append(title)
            lines.append(header)
            for m in rows:
                snr = ("identical" if m.identical else "NaN" if m.nan and m.snr_db is None
                       else fmt(m.snr_db, ".2f"))
                cosine = "-" if m.nan and m.snr_db is None else fmt(m.cosine, ".6f")
                mark = " <" if m.below(self.snr_min) else ""
                lines.append(
                    f"{m.name[-40:]:<40} {str(list(m.shape))[:18]:<18} {snr:>8} {fmt(m.rel_l2, '.3e'):>10} "
                    f"{cosine:>10} {fmt(m.max_abs_err, '.3e'):>10} {fmt(m.mean_abs_err, '.3e'):>10} "
                    f"{fmt(m.p99_abs_err, '.3e'):>10} {m.nan:>5} {m.inf:>5}{mark}"
                )

        section(f"outputs ({len(self.outputs)}), provider {self.provider}:", sorted(self.outputs, key=_sort_key))
        if self.intermediates:
            worst = sorted(self.intermediates, key=_sort_key)[:limit]
            section(f"intermediates (worst {len(worst)} of {len(self.intermediates)}):", worst)
        if self.first_divergent:
            fd = self.first_divergent
            lines.append(f"first divergent: node {fd['node']!r} ({fd['op_type']}) tensor {fd['tensor']!r} "
                         f"snr {fmt(fd['snr_db'], '.2f')} dB")
        threshold = "" if self.snr_min is None else f" (snr-min {self.snr_min:g} dB)"
        lines.append(("PASSED" if self.passed else "FAILED") + threshold)
        return "\n".join(lines)


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
                notes: list[str] | None = None) -> dict[str, np.ndarray]:
    """Feeds for every graph input of ``model``: ``given`` arrays, the rest seeded random (module docstring)."""
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
    for value in model.graph.inputs:
        dtype = value.dtype.numpy() if value.dtype is not None else np.dtype(np.float32)
        if value.name in given:
            feeds[value.name] = _as_input_type(value.name, np.asarray(given[value.name]), dtype, notes)
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
            raise UsageError(f"input {value.name!r} of type {value.dtype} cannot be drawn at random; give it in --inputs")
    return feeds


def _load_inputs(inputs, model: ir.Model) -> dict | None:
    """The arrays of an .npz (:func:`fp4pass.npz.read_npz`), each checked from its header against ``model``'s
    graph inputs (the name, the rank) before its data is inflated."""
    if inputs is None or isinstance(inputs, dict):
        return inputs
    graph_inputs = {v.name: v for v in model.graph.inputs}

    def check(name: str, dims: tuple, dtype: np.dtype) -> None:
        if name not in graph_inputs:
            raise UsageError(f"{inputs}: array {name!r} is not a graph input of the model "
                             f"(inputs: {list(graph_inputs)})")
        shape = graph_inputs[name].shape
        if shape is not None and len(shape) != len(dims):
            raise UsageError(f"{inputs}: array {name!r} has rank {len(dims)} {list(dims)}, the input wants rank "
                             f"{len(shape)} {[str(d) for d in shape]}")

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


class _Runner:
    """One model lowered once; runs it with extra outputs, creating a session per output set (or, for the
    ``reference`` provider, an ``onnx.reference.ReferenceEvaluator``)."""

    def __init__(self, model: ir.Model, provider: str, label: str, notes: list[str]):
        self.label = label
        self.reference = provider == REFERENCE
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
        self.input_names = [v.name for v in self.model.graph.inputs if v.const_value is None]
        self.output_names = [v.name for v in self.model.graph.outputs]

    def run(self, feeds: dict, extra: list[str] = ()) -> dict[str, np.ndarray]:
        model = _with_outputs(self.model, list(extra)) if extra else self.model
        if self.reference:
            return self._run_reference(model, feeds)
        try:
            session, self.provider, self.note = make_session(model, self.provider_arg)
        except ModelError as exc:
            raise ModelError(f"{self.label}: {exc}") from None
        names = [o.name for o in session.get_outputs()]
        missing = [n for n in self.input_names if n not in feeds]
        if missing:
            raise ModelError(f"{self.label}: needs inputs {missing} that the original model does not have")
        try:
            values = session.run(names, {n: feeds[n] for n in self.input_names})
        except Exception as exc:  # onnxruntime's own error types
            raise ModelError(f"{self.label}: onnxruntime failed to run it: {str(exc).strip().splitlines()[0]}") from None
        return dict(zip(names, values))

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


def diff(original, rewritten, inputs=None, provider: str = "auto", *, intermediates: bool = False,
         snr_min: float | None = None, seed: int = 0, shapes: dict | None = None,
         show_progress: bool | None = None, intermediate_budget_bytes: int = 1 << 30,
         base_dir: str | os.PathLike | None = None) -> DiffResult:
    """Compare ``rewritten`` against ``original`` under onnxruntime (module docstring for every step).

    ``base_dir``: the folder the external data of a model given as a proto or ``onnx_ir.Model`` resolves
    against (:func:`fp4pass.onnx.loading.load`); a path's own folder always wins.
    """
    notes: list[str] = []
    model_a = load(original, base_dir).model
    model_b = load(rewritten, base_dir).model
    label_a = str(original) if isinstance(original, (str, os.PathLike)) else "original"
    label_b = str(rewritten) if isinstance(rewritten, (str, os.PathLike)) else "rewritten"
    runner_a = _Runner(model_a, provider, label_a, notes)
    runner_b = _Runner(model_b, provider, label_b, notes)
    feeds = make_inputs(runner_a.model, _load_inputs(inputs, runner_a.model), seed=seed, shapes=shapes, notes=notes)

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
    outputs_a = set(runner_a.output_names)
    inter_names = []
    if intermediates:
        inter_names = [n for n in produced_a if n in produced_b and n not in outputs_a
                       and n not in runner_b.output_names]
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
                if worst_key is None or _sort_key(m) < worst_key:
                    worst_key = _sort_key(m)
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
    provider_used = runner_a.provider
    for note in {runner_a.note, runner_b.note} - {None}:
        notes.insert(0, note)

    by_name = {m.name: m for m in [*inter_metrics, *output_metrics]}
    first = None
    if snr_min is not None or any(m.new_nonfinite for m in by_name.values()):
        for node in runner_a.model.graph:
            hit = next((by_name[o.name] for o in node.outputs if o.name in by_name and by_name[o.name].below(snr_min)),
                       None)
            if hit is not None:
                first = {"node": node.name, "op_type": node.op_type, "tensor": hit.name,
                         "snr_db": None if hit.snr_db is None or not math.isfinite(hit.snr_db) else hit.snr_db}
                break
    passed = not any(m.below(snr_min) for m in output_metrics)
    order = [n for n in produced_a if n in by_name] + [m.name for m in output_metrics if m.name not in produced_a]
    for note in notes:
        logger.debug("diff: %s", note)
    return DiffResult(provider_used, output_metrics, inter_metrics, first, passed, notes, snr_min, order, worst_errors)


def plot_diff(result: DiffResult, path) -> None:
    """PNG: SNR (dB) of every compared tensor in graph order, and the |a-b| histogram of the worst output."""
    from fp4pass.extras import require

    matplotlib = require("matplotlib", "plot", "plotting a diff")
    matplotlib.use("Agg")
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    import matplotlib.pyplot as plt

    by_name = {m.name: m for m in [*result.intermediates, *result.outputs]}
    names = [n for n in result.order if n in by_name]
    snrs = [by_name[n].snr_db for n in names]
    finite = [s for s in snrs if s is not None and math.isfinite(s)]
    top = (max(finite) + 10) if finite else 100.0
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 7))
    xs = range(len(names))
    ys = [top if s is None else (s if math.isfinite(s) else min(finite or [0]) - 10) for s in snrs]
    ax1.plot(xs, ys, marker=".", linewidth=0.8)
    ident = [i for i, s in enumerate(snrs) if s is None]
    if ident:
        ax1.scatter(ident, [top] * len(ident), marker="^", color="green", label="identical", zorder=3)
        ax1.legend()
    if result.snr_min is not None:
        ax1.axhline(result.snr_min, color="red", linestyle="--", linewidth=0.8)
    ax1.set_xlabel("tensor (topological order of the original)")
    ax1.set_ylabel("SNR (dB)")
    ax1.set_title(f"per-tensor SNR, provider {result.provider}")
    worst = sorted(result.outputs, key=_sort_key)[0] if result.outputs else None
    errors = result.worst_output_errors
    if worst is not None and errors is not None and errors.size and errors.max() > 0:
        ax2.hist(errors[errors > 0], bins=100, log=True)
        ax2.set_title(f"|a-b| of the worst output {worst.name!r} (non-zero errors)")
    else:
        ax2.set_title("no output differs")
    ax2.set_xlabel("|a - b|")
    fig.tight_layout()
    fig.savefig(path, format=Path(path).suffix.lstrip(".").lower() or "png", dpi=100)
    plt.close(fig)
