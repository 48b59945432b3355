"""Calibrated activation scales for an MXFP4 checkpoint, from its own model's forward, one layer at a time.

::

    scales = fp4pass.checkpoint.calibrate("gpt-oss-20b", "calib.npz", calibrator="max", device="auto")
    scales.save("scales.json")                       # SCALES.json: keys are the checkpoint's module names
    fp4pass.checkpoint.convert("gpt-oss-20b", "out", scales=scales)

The model runs through transformers' own modeling code (:mod:`fp4pass.checkpoint.layerwise`), every batch
through one decoder layer before the next layer is loaded; the calibration is a visitor of that loop
(:func:`~fp4pass.checkpoint.layerwise.runner.run_layers`). What is recorded, for every MXFP4 module that
conversion turns into NVFP4:

- an expert's gate/up input: the MoE block's input on the tokens routed to that expert; its down input: its
  own intermediate activation (after the gated activation) on those tokens. The experts' ``forward`` is
  replaced, for the run, by the same routed loop as transformers' eager one (same order, same operations)
  that also hands each expert's rows to its statistics. On a GPU, or a CPU with bf16 matrix instructions,
  the numbers are the model's; on other CPUs each bf16 matmul runs as a float32 one rounded to bf16 (5x
  faster there, equal up to the order of the float32 additions:
  :func:`~fp4pass.checkpoint.layerwise.runner.float32_products`);
- a dense MXFP4 Linear: its input on every token (a forward pre-hook).

Padding (``attention_mask`` 0) runs through the model but is not counted. Each statistic is an
:class:`fp4pass.calib.ActivationStats`; the calibrator (max by default; headroom, percentile, mse) turns it into
``g_amax`` and ``input_scale = g_amax / 2688`` (ModelOpt's multiplier; compressed-tensors stores its
reciprocal, written by convert). Keys of the result: each module's checkpoint name (w1 and w3 of an expert
share one statistic, so one value); a gpt-oss stack (``<layer>.mlp.experts.gate_up_proj``) takes the largest
of its experts' values. An expert that no token reached has no key: convert gives it its layer's max and lists
it; :meth:`CheckpointScales.report_json` lists it too, with every expert's token count.

Under ``torch.distributed`` (a process group initialised, e.g. by ``torchrun``), rank r calibrates batches
r, r + world, ... and the statistics are all-reduced (:func:`fp4pass.calib.distributed.all_reduce_stats`) layer
by layer before the scales are computed, so every rank returns the scales of all the data.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from fp4pass.calib.calibrators import HeadroomCalibrator, MSECalibrator, make_calibrator
from fp4pass.calib import CalibrationDataError, scale_for
from fp4pass.calib.scales import ActivationScale, ActivationScales, input_scale_from_g_amax
from fp4pass.calib.stats import ActivationStats
from fp4pass.checkpoint.calib_data import Batch, load_batches
from fp4pass.safetensors.catalog import Catalog
from fp4pass.checkpoint.detect import detect
from fp4pass.checkpoint.layerwise.hidden_states import HiddenStore, hidden_budget
from fp4pass.checkpoint.layerwise.model import experts_modules, resolve_architecture
from fp4pass.checkpoint.layerwise.runner import (LayerRunner, LayerVisitor, default_device, routed_forward,
                                                 run_layers, share_batches)
from fp4pass.checkpoint.model_limits import check_attention_memory, check_config_fields, check_fits_shards
from fp4pass.safetensors.files import CheckpointError
from fp4pass.safetensors.hub import resolve_checkpoint

__all__ = ["calibrate", "CheckpointScales"]

log = logging.getLogger(__name__)


@dataclass
class CheckpointScales(ActivationScales):
    """SCALES.json of a checkpoint (``tensors``: module name -> ActivationScale) and the run's account."""

    experts: list[dict] = field(default_factory=list)  # {"module", "expert", "tokens", "gate_up_amax", ...}
    unrouted: list[dict] = field(default_factory=list)  # {"module", "expert"}: no token reached it
    dense: list[dict] = field(default_factory=list)
    model_type: str = ""
    device: str = "cpu"
    layers: int = 0
    tokens: int = 0
    seconds: float = 0.0
    spilled_batches: int = 0
    #: where the time went: "embed" (inputs up to the first layer), "load" (waiting for the layers' weights: the
    #: part of their reading and dequantizing not hidden behind the previous layer's run), "layers" (the batches
    #: through the layers, statistics included), "release" (each layer's memory freed, the heap trimmed),
    #: "scales" (the all-reduce and the calibrators); "load_background": the seconds the
    #: background thread spent reading and dequantizing (overlapping the other phases)
    timings: dict = field(default_factory=dict)

    def report_json(self) -> dict:
        """The calibration report: every scale with its figures, every expert's token count, the unrouted."""
        return {"calibrator": self.calibrator, "model_type": self.model_type, "device": self.device,
                "layers": self.layers, "batches": self.batches, "tokens": self.tokens, "seconds": self.seconds,
                "hidden_states_spilled_batches": self.spilled_batches, "timings_s": self.timings,
                "tensors": self.report(),
                "experts": self.experts, "unrouted_experts": self.unrouted, "dense": self.dense}


class _LayerStats:
    """The statistics of one decoder layer's MXFP4 modules, and the hooks that feed them."""

    def __init__(self, runner: LayerRunner, index: int, method, device: torch.device, detailed: bool):
        self.prefix = f"layers.{index}."
        self.method, self.device, self.detailed = method, device, detailed
        # the block sample feeds the mse sweep and the report's SNR only: without them it is not kept
        self.sampled = detailed or isinstance(method, MSECalibrator)
        self.valid: torch.Tensor | None = None  # flat bool [B*T] of the current batch, None = all count
        self.stats: dict[tuple, ActivationStats] = {}
        self.tokens: dict[tuple, int] = {}
        self.names: dict[tuple, list[str]] = {}  # stats key -> checkpoint modules it calibrates
        self.stacks: dict[str, dict] = {}  # model stack path (in the layer) -> {"experts", "fused": name|None}
        self.dense: dict[str, str] = {}  # model module path (in the layer) -> checkpoint module
        for module, (target, expert, kind) in sorted(runner.sources.quantized.items()):
            if not target.startswith(self.prefix):
                continue
            rel = target[len(self.prefix):]
            if kind == "dense":
                self.dense[rel] = module
                self._new((rel, None, "dense"), module)
                continue
            entry = self.stacks.setdefault(rel, {"fused": {}})
            if expert is None:
                entry["fused"][kind] = module
            else:
                self._new((rel, expert, kind), module)

    def _new(self, key: tuple, module: str) -> None:
        if key not in self.stats:
            label = module if key[1] is None else f"{key[0]}.{key[1]}.{key[2]}"
            self.stats[key] = ActivationStats(label, device=self.device,
                                              abs_histogram=self.method.needs_abs_histogram,
                                              reservoir=self.method.reservoir if self.sampled else 0,
                                              top_k=self.method.top_k if self.sampled else 0)
        self.names.setdefault(key, []).append(module)

    def install(self, layer: torch.nn.Module) -> list:
        """Hook the layer's modules; returns what :meth:`remove` undoes."""
        undo = []
        for rel, experts in experts_modules(layer):
            if rel not in self.stacks:
                continue
            entry = self.stacks[rel]
            count = experts.num_experts
            entry["experts"] = count
            for kind, module in entry["fused"].items():
                for e in range(count):
                    self._new((rel, e, kind), module)
            for e in range(count):
                self.tokens[(rel, e)] = 0
            experts.forward = routed_forward(experts, rel, self)
            undo.append(("forward", experts))
        for rel, module in self.dense.items():
            handle = layer.get_submodule(rel).register_forward_pre_hook(self._dense_hook(rel))
            undo.append(("hook", handle))
        return undo

    @staticmethod
    def remove(undo: list) -> None:
        for kind, item in undo:
            if kind == "forward":
                del item.forward
            else:
                item.remove()

    def _dense_hook(self, rel: str):
        def hook(_module, args):
            x = args[0]
            rows = x.reshape(-1, x.shape[-1])
            if self.valid is not None and rows.shape[0] == self.valid.numel():
                rows = rows[self.valid]
            self.stats[(rel, None, "dense")].update(rows)
        return hook

    def record(self, rel: str, expert: int, kind: str, rows: torch.Tensor, token_idx: torch.Tensor) -> None:
        """Count the rows of expert ``expert`` (kind "gate_up" or "down"; "out" is not counted) that are not
        padding into their statistic; the rows are kept as they are (returns None)."""
        if kind == "out":
            return None
        if self.valid is not None:
            rows = rows[self.valid[token_idx]]
        if kind == "gate_up":
            self.tokens[(rel, expert)] += rows.shape[0]
        stats = self.stats.get((rel, expert, kind))
        if stats is not None and rows.shape[0]:
            stats.update(rows)

    def reduce(self) -> None:
        """All-reduce the statistics and token counts over the process group (torch.distributed)."""
        from fp4pass.calib.distributed import all_reduce_stats, distributed_ready

        if not distributed_ready():
            return
        import torch.distributed as dist

        keys = sorted(self.stats, key=repr)
        all_reduce_stats([self.stats[k] for k in keys])
        token_keys = sorted(self.tokens, key=repr)
        if token_keys:
            counts = torch.tensor([self.tokens[k] for k in token_keys], dtype=torch.int64)
            if dist.get_backend() == "nccl":
                counts = counts.cuda()
            dist.all_reduce(counts)
            for k, v in zip(token_keys, counts.tolist()):
                self.tokens[k] = int(v)

    def scale(self, stats: ActivationStats) -> ActivationScale:
        """The calibrated scale; with ``detailed``, the report's block fractions and SNR too (``scale_for``)."""
        if self.detailed:
            return scale_for(stats, self.method)
        g_amax, note = self.method.compute(stats)
        bounds = self.method if isinstance(self.method, HeadroomCalibrator) else HeadroomCalibrator()
        b_min, b_max = bounds.bounds(stats)
        return ActivationScale(amax=stats.amax_value, g_amax=float(g_amax), input_scale=input_scale_from_g_amax(g_amax),
                               b_min=float(b_min or 0.0), b_max=float(b_max or 0.0), blocks=stats.blocks,
                               zero_blocks=int(stats.zero_blocks), note=note)

    def results(self, out: CheckpointScales) -> None:
        """Scales of this layer into ``out`` (module docstring's keys) and the experts' account."""
        for rel, module in self.dense.items():
            scale = self.scale(self.stats[(rel, None, "dense")])
            out.tensors[module] = scale
            out.dense.append({"module": module, "amax": scale.amax, "input_scale": scale.input_scale})
        for rel, entry in self.stacks.items():
            stack = self.prefix + rel
            best: dict[str, object] = {}
            for e in range(entry.get("experts", 0)):
                tokens = self.tokens.get((rel, e), 0)
                row = {"module": stack, "expert": e, "tokens": tokens}
                for kind in ("gate_up", "down"):
                    key = (rel, e, kind)
                    if key not in self.stats:
                        continue
                    row.setdefault("checkpoint_modules", []).extend(self.names[key])
                    if tokens == 0:
                        continue
                    scale = self.scale(self.stats[key])
                    for figure in ("amax", "input_scale"):  # gate_up_amax, down_input_scale, ...
                        row[f"{kind}_{figure}"] = getattr(scale, figure)
                    for module in dict.fromkeys(self.names[key]):
                        if module in entry["fused"].values():
                            if module not in best or scale.g_amax > best[module].g_amax:
                                best[module] = scale
                        else:
                            out.tensors[module] = scale
                out.experts.append(row)
                if tokens == 0:
                    out.unrouted.append({"module": stack, "expert": e,
                                         "checkpoint_modules": row.get("checkpoint_modules", [])})
            out.tensors.update(best)


def calibrate(source, data, *, calibrator="max", device: str | None = "auto", batch_size: int | None = None,
              seq_len: int | None = None, num_samples: int | None = None, hidden_budget_bytes: int | None = None,
              show_progress: bool | None = False, report_detail: bool = False, trust_remote_code: bool = False,
              **calibrator_options) -> CheckpointScales:
    """Calibrate the NVFP4 activation scales of the MXFP4 checkpoint ``source`` (a folder or a Hub model ID) on ``data`` (module docstring).

    ``data``: a path (:mod:`fp4pass.checkpoint.calib_data`). ``calibrator`` and ``calibrator_options``: as
    :func:`fp4pass.calib.make_calibrator`. ``device``: auto | cpu | cuda. ``hidden_budget_bytes``: hidden states
    kept in memory (the rest go to a temporary folder); default half the free GPU memory or a quarter of the
    available RAM. ``report_detail``: also the report's block fractions and SNR of every scale (a sample of blocks
    kept per statistic, and a quantization of it per scale; SCALES.json is the same either way).
    ``trust_remote_code``: a folder whose config.json has an ``auto_map`` runs through its own modeling code
    (never without it). Returns :class:`CheckpointScales`, which :func:`fp4pass.checkpoint.convert` takes as
    ``scales``.
    """
    src_dir = resolve_checkpoint(source)  # a folder, or a Hugging Face Hub model ID (org/name[@revision])
    start = time.perf_counter()
    method = make_calibrator(calibrator, **calibrator_options)
    dev = default_device(device)
    with Catalog.open(src_dir) as catalog:
        found = detect(catalog.tensors, catalog.config)
        if not found.units:
            raise CheckpointError(f"{src_dir}: no MXFP4 weights found, so nothing to calibrate")
        check_config_fields(catalog.config, f"{src_dir}/config.json", catalog.tensors)  # before transformers reads it
        model_type, cfg = resolve_architecture(catalog.config, src_dir, trust_remote_code)
        every = load_batches(data, src_dir, int(cfg.vocab_size), seq_len=seq_len, num_samples=num_samples,
                             batch_size=batch_size)  # the data's own errors first: the user's newest input
        check_fits_shards(catalog, found, model_type, cfg)  # before the model is allocated
        check_attention_memory(cfg, every, dev, str(data))
        batches = share_batches(every)  # this rank's; the report counts all of them, as its per-expert tokens do
        if not batches:
            raise CalibrationDataError(f"{data}: no calibration rows")
        runner = LayerRunner(catalog, found, dev, trust_remote_code=trust_remote_code)
        store = HiddenStore(hidden_budget(dev, hidden_budget_bytes), dev)
        out = CheckpointScales(method.name, model_type=model_type, device=str(dev), layers=runner.num_layers,
                               batches=len(every), tokens=sum(b.tokens for b in every))
        try:
            _run(runner, batches, store, method, dev, out, show_progress, report_detail)
            out.spilled_batches = store.spilled
        finally:
            store.close()
    out.seconds = time.perf_counter() - start
    return out


class _Calibration(LayerVisitor):
    """Calibration as a visitor of the layer loop: each layer's statistics (:class:`_LayerStats`) hooked in
    before its batches, and its scales taken (all-reduced first) once its weights are freed."""

    desc = "calibrate (layer x batch)"
    after_phase = "scales"  # the all-reduce and the calibrators

    def __init__(self, runner: LayerRunner, method, dev, out: CheckpointScales, detailed: bool):
        self.runner, self.method, self.dev, self.out, self.detailed = runner, method, dev, out, detailed
        self.layer_stats: _LayerStats | None = None
        self.undo: list = []

    def begin_layer(self, index: int, layers: tuple) -> None:
        self.layer_stats = _LayerStats(self.runner, index, self.method, self.dev, self.detailed)
        self.undo = self.layer_stats.install(layers[0])

    def run_batch(self, runners, index, batch, layers, hidden):
        mask = batch.attention_mask
        self.layer_stats.valid = None if mask is None else mask.reshape(-1).bool().to(self.dev)
        return super().run_batch(runners, index, batch, layers, hidden)

    def end_layer(self, index: int) -> None:
        _LayerStats.remove(self.undo)
        self.undo = []

    def after_layer(self, index: int) -> None:
        self.layer_stats.reduce()
        self.layer_stats.results(self.out)


def _run(runner: LayerRunner, batches: list[Batch], store: HiddenStore, method, dev, out: CheckpointScales,
         show_progress, detailed: bool) -> None:
    """Layers 0 up to the last one holding an MXFP4 module (the rest change no scale) over every batch."""
    last = max((int(t.split(".")[1]) for t, _, _ in runner.sources.quantized.values()), default=-1)
    run_layers([runner], [store], batches, _Calibration(runner, method, dev, out, detailed), layers=last + 1,
               timings=out.timings, show_progress=show_progress)
