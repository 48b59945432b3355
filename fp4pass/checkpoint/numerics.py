"""What an NVFP4 checkpoint costs in accuracy, layer by layer and expert by expert, before it is served.

::

    result = fp4pass.checkpoint.diff("gpt-oss-20b", "gpt-oss-20b-nvfp4", "calib.jsonl", seq_len=512)
    print(result.format_table()); result.to_json()

Both checkpoints run through transformers' own modeling code, one decoder layer at a time, side by side in the
layer loop that calibration visits too (:func:`fp4pass.checkpoint.layerwise.runner.run_layers`): the source
(MXFP4 of any form fp4pass converts, or a bf16 checkpoint of the same architecture) as it is, the NVFP4 side
from its stored tensors decoded by its form's convention and, for W4A4, with every quantized module's input
fake-quantized to NVFP4 with its stored input scale, as the engines compute
(:mod:`fp4pass.checkpoint.nvfp4_weights`). Memory holds one layer of each model (two while the next loads) and
the hidden states of both.

Figures, with SNR = 10 log10(sum a^2 / sum (a - b)^2) = 20 log10(||a|| / ||a - b||) over the tokens that are
not padding (``None`` where the two are identical), ``a`` the source's:

- per decoder layer, ``snr_db_local``: the NVFP4 layer fed the source's input hidden states, its output against
  the source layer's (where a defect shows); ``snr_db_end_to_end``: each model fed its own previous layer's
  output;
- per routed expert, ``snr_db``: the expert's MLP output (before its routing weight) on the tokens the source
  routed to it, the NVFP4 expert given the source's inputs; experts no token reached are listed apart;
- at the logits (the model's own final norm and ``lm_head``, in float32): ``kl_mean`` / ``kl_max`` of
  KL(source || nvfp4) per token over the vocabulary (natural log), ``top1_agreement``, and the perplexity of
  each on the data's next tokens (the first position of each row is not scored);
- ``first_below``: the first layer whose local SNR is under ``snr_min``;
- ``failed`` (:class:`~fp4pass.checkpoint.diff_report.CheckpointDiff`): each check that failed, for scripts:
  ``snr_min``, ``kl_max``, and ``finite`` (NaN/Inf in an NVFP4 global or input scale, a layer's output or the
  KL, always checked), each with its value, threshold, layer and where in the checkpoint (the first module whose
  output held NaN/Inf, found by forward hooks on the NVFP4 layer; the scales, read before the run). Layers and
  experts are named by their checkpoint module (:class:`~fp4pass.checkpoint.diff_checks.CheckpointNames`): what
  a script looks up in the folder.

Before anything is read, every tensor either side will read is checked against the model on the shard headers
alone (:func:`~fp4pass.checkpoint.diff_checks.check_stored_shapes`): exit 2 naming the tensor.

Under ``torch.distributed`` each rank runs its share of the batches and the sums are all-reduced, as in
calibration.
"""

from __future__ import annotations

import logging
import math
import os
import resource
import time

import torch

from fp4pass.calib.errors import CalibrationDataError
from fp4pass.checkpoint.calib_data import Batch, load_batches
from fp4pass.safetensors.catalog import Catalog
from fp4pass.checkpoint.detect import detect
from fp4pass.checkpoint.diff_checks import CheckpointNames, check_stored_shapes, nonfinite_scales
from fp4pass.checkpoint.diff_figures import (Energy, LogitStats, float32_logits, next_tokens, reduce_sums,
                                             tokens_of, valid_tokens)
from fp4pass.checkpoint.diff_report import WORST_EXPERTS, CheckpointDiff
from fp4pass.checkpoint.layerwise.hidden_states import HiddenStore, hidden_budget
from fp4pass.checkpoint.layerwise.model import experts_modules, resolve_architecture
from fp4pass.checkpoint.layerwise.runner import (LayerRunner, LayerVisitor, default_device, expert_output,
                                                 expert_projection, routed_forward, run_layers, share_batches)
from fp4pass.checkpoint.model_limits import (available_bytes, check_attention_memory, check_config_fields,
                                             check_fits_shards)
from fp4pass.checkpoint.nvfp4_weights import NVFP4Weights, fake_quantize_activation, find_nvfp4
from fp4pass.safetensors.files import CheckpointError

__all__ = ["diff", "CheckpointDiff", "WORST_EXPERTS", "SHAPE_FIELDS"]

log = logging.getLogger(__name__)

#: config fields two checkpoints must agree on to be the same architecture
SHAPE_FIELDS = ("hidden_size", "num_hidden_layers", "vocab_size", "intermediate_size", "moe_intermediate_size",
                "num_local_experts", "n_routed_experts", "num_experts", "num_attention_heads", "num_key_value_heads",
                "head_dim", "hc_mult")
#: bytes of float32 logits computed at once (per model)
LOGITS_CHUNK_BYTES = 1 << 28


class _Quantizer:
    """W4A4: fake-quantizes the inputs of the NVFP4 side's quantized modules (module docstring), as hooks on
    its dense Linears and inside its experts' routed loop."""

    def __init__(self, runner: LayerRunner, weights: NVFP4Weights, notes: list[str]):
        self.active = weights.activations == "W4A4"
        self.dense: dict[str, torch.Tensor] = {}  # model module path -> g
        self.experts: dict[tuple, torch.Tensor] = {}  # (model stack path, expert | None, kind) -> g ([] or [E])
        if not self.active:
            return
        read = runner.catalog.read
        units = weights.modules()
        pairs: dict[tuple, dict] = {}
        for name, (target, expert, kind) in runner.sources.quantized.items():
            g = units[name].activation_scale(read)
            if g is None:
                continue
            g = g.to(runner.device)
            if expert is None and kind == "dense":
                self.dense[target] = g
            elif kind == "gate_up" and expert is not None:
                pairs.setdefault((target, expert), {})[name.rpartition(".")[2]] = g
            else:
                self.experts[(target, expert, kind)] = g
        differ = []
        for (target, expert), halves in pairs.items():
            gate = next((halves[k] for k in ("w1", "gate_proj") if k in halves), None)
            chosen = gate if gate is not None else next(iter(halves.values()))
            self.experts[(target, expert, "gate_up")] = chosen
            if any(not torch.equal(v, chosen) for v in halves.values()):
                differ.append(f"{target}.{expert}")
        if differ:
            notes.append(f"{len(differ)} expert(s) store different gate (w1) and up (w3) input scales; their fused "
                         f"gate/up input is quantized with w1's, as vLLM does (first: {differ[0]})")

    def scale(self, stack: str, expert: int, kind: str) -> torch.Tensor | None:
        g = self.experts.get((stack, expert, kind))
        if g is None:
            g = self.experts.get((stack, None, kind))
            if g is not None and g.dim():
                g = g[expert]
        return g

    def install(self, layer: torch.nn.Module, prefix: str) -> list:
        undo = []
        if not self.active:
            return undo
        for rel, target in ((r, prefix + r) for r in _dense_paths(self.dense, prefix)):
            g = self.dense[target]
            handle = layer.get_submodule(rel).register_forward_pre_hook(
                lambda _m, args, g=g: (fake_quantize_activation(args[0], g), *args[1:]))
            undo.append(handle)
        return undo

    def on_input(self, stack: str, expert: int):
        """``on_input(kind, rows)`` of :func:`expert_output` for one NVFP4 expert."""
        if not self.active:
            return None

        def quantize(kind: str, rows: torch.Tensor):
            g = self.scale(stack, expert, kind)
            return None if g is None else fake_quantize_activation(rows, g)
        return quantize


def _dense_paths(dense: dict, prefix: str) -> list[str]:
    return [t[len(prefix):] for t in dense if t.startswith(prefix)]


class _ExpertRows:
    """Each expert's input rows (the MoE input of its tokens) and outputs in one batch, for the tokens that count:
    not padding (``valid``, flat over the batch's tokens) and, with ``limit``, among the first ``limit`` tokens
    (the local half of an NVFP4 run on the local and end-to-end inputs together)."""

    def __init__(self):
        self.begin(None)

    def begin(self, valid: torch.Tensor | None, limit: int | None = None) -> None:
        self.valid, self.limit = valid, limit
        self.rows: dict[int, torch.Tensor] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def keep(self, rows: torch.Tensor, token_idx: torch.Tensor) -> torch.Tensor:
        if self.limit is not None:
            counted = token_idx < self.limit
            rows, token_idx = rows[counted], token_idx[counted]
        return rows if self.valid is None else rows[self.valid[token_idx]]

    def record(self, rel, expert, kind, rows, token_idx):
        if kind == "gate_up":
            self.rows[expert] = self.keep(rows, token_idx)
        elif kind == "out":
            self.outputs[expert] = self.keep(rows, token_idx)
        return None


class _NVFP4Experts(_ExpertRows):
    """The routed loop of an NVFP4 expert stack: each expert's inputs fake-quantized (W4A4), its local rows and
    outputs kept (an expert whose input rows equal the source's needs no second pass)."""

    def __init__(self, quantizer: _Quantizer, stack: str):
        super().__init__()
        self.quantizer, self.stack = quantizer, stack

    def record(self, rel, expert, kind, rows, token_idx):
        super().record(rel, expert, kind, rows, token_idx)
        if kind == "out":
            return None
        hook = self.quantizer.on_input(self.stack, expert)
        return None if hook is None else hook(kind, rows)


def _same_architecture(src: Catalog, nvfp4: Catalog, trust_remote_code: bool = False) -> tuple[tuple, tuple]:
    """Each folder's (model type, transformers config); two checkpoints of different architectures or shapes are
    refused (exit 2), naming the field."""
    a, b = src.config, nvfp4.config
    for catalog in (src, nvfp4):  # a stranger's counts, before transformers reads them
        check_config_fields(catalog.config, f"{catalog.folder}/config.json", catalog.tensors)
    arch_a = resolve_architecture(a, src.folder, trust_remote_code)
    arch_b = resolve_architecture(b, nvfp4.folder, trust_remote_code)
    type_a, type_b = arch_a[0], arch_b[0]
    if type_a != type_b:
        raise CheckpointError(f"{nvfp4.folder}: a {type_b} model, but {src.folder} is {type_a}: not the same "
                              "architecture")
    for key in SHAPE_FIELDS:
        if key in a and key in b and a[key] != b[key]:
            what = "layer counts" if key == "num_hidden_layers" else key
            raise CheckpointError(f"{nvfp4.folder}: {key} {b[key]!r}, but {src.folder} has {a[key]!r}: the two "
                                  f"checkpoints differ in {what}")
    return arch_a, arch_b


def _peak_rss_mib() -> float:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _source_units(catalog: Catalog):
    """The source's MXFP4 units (none for a bf16 checkpoint); an NVFP4 source is refused."""
    found = detect(catalog.tensors, catalog.config)
    if not found.units:
        try:
            find_nvfp4(catalog)
        except CheckpointError:
            return found
        raise CheckpointError(f"{catalog.folder}: holds NVFP4 weights; give the MXFP4 (or bf16) source first and "
                              "the NVFP4 checkpoint second")
    if found.declined:
        first = found.declined[0]
        raise CheckpointError(f"{first['tensor']}: {first['reason']} (the source cannot run as it is)")
    return found


def diff(reference, candidate, data, *, seq_len: int | None = None, num_samples: int | None = None,
         batch_size: int | None = None, device: str | None = "auto", snr_min: float | None = None,
         kl_max: float | None = None, follow_symlinks: bool = False, hidden_budget_bytes: int | None = None,
         show_progress: bool | None = False, trust_remote_code: bool = False) -> CheckpointDiff:
    """Run ``reference`` (the source checkpoint) and ``candidate`` (its NVFP4 checkpoint) side by side on ``data``
    (any form calibration takes) and measure what the NVFP4 checkpoint loses (module docstring). Each folder may be a Hugging Face Hub model ID
    (``org/name[@revision]``: :func:`fp4pass.safetensors.hub.resolve_checkpoint`). ``device``: auto | cpu | cuda;
    ``hidden_budget_bytes``: hidden states kept in memory (the rest spill to a temporary folder), as in calibration.
    Raises :class:`CheckpointError` / :class:`CalibrationDataError` (exit 2) for unrelated models, bad data, or
    a shard header that does not fit the model (checked before any tensor is read). ``trust_remote_code``: run
    the folders' own modeling code (config.json ``auto_map``), never without it."""
    from fp4pass.safetensors.hub import resolve_checkpoint

    start = time.perf_counter()
    given_src = reference
    src_dir, nvfp4_dir = resolve_checkpoint(reference), resolve_checkpoint(candidate)  # folders, or Hub model IDs
    dev = default_device(device)
    with Catalog.open(src_dir, follow_symlinks) as src, Catalog.open(nvfp4_dir, follow_symlinks) as target:
        src_arch, target_arch = _same_architecture(src, target, trust_remote_code)
        found = _source_units(src)
        weights = find_nvfp4(target)
        model_type, cfg = src_arch
        every = load_batches(data, src_dir, int(cfg.vocab_size), seq_len=seq_len, num_samples=num_samples,
                             batch_size=batch_size)
        # before anything is read or allocated: the source's config.json against its shards, then every tensor
        # either side will read against the model (the NVFP4 side's first: its config is the source's)
        check_fits_shards(src, found, *src_arch)
        check_stored_shapes(src, found, *src_arch)
        check_stored_shapes(target, weights, *target_arch)
        check_fits_shards(target, weights, *target_arch)
        bad_scales = nonfinite_scales(target, weights)
        # the NVFP4 layer runs two copies of a batch at once: half the memory for each
        check_attention_memory(cfg, every, dev, str(data), available_bytes(dev) // 2)
        batches = share_batches(every)
        if not batches:
            raise CalibrationDataError(f"{data}: no rows to run")
        src_runner = LayerRunner(src, found, dev, trust_remote_code=trust_remote_code)
        nv_runner = LayerRunner(target, weights, dev, trust_remote_code=trust_remote_code)
        notes: list[str] = []
        quantizer = _Quantizer(nv_runner, weights, notes)
        budget = hidden_budget(dev, hidden_budget_bytes) // 2
        stores = HiddenStore(budget, dev), HiddenStore(budget, dev)
        run = {"model": _model_name(given_src), "model_type": model_type,
               "config_model_type": src.config.get("model_type"), "architecture": _architecture(src.config),
               "device": str(dev), "layers": src_runner.num_layers,
               "batches": len(every), "tokens": sum(b.tokens for b in every), "nvfp4_form": weights.form,
               "activations": weights.activations, "timings_s": {}}
        try:
            layers, experts, unrouted, logits = _run(src_runner, nv_runner, quantizer, batches, stores, dev, run,
                                                     show_progress)
        finally:
            for store in stores:
                store.close()
    run["seconds"] = time.perf_counter() - start
    run["peak_rss_mib"] = round(_peak_rss_mib(), 1)
    return CheckpointDiff(layers, experts, unrouted, logits, run, notes, snr_min, kl_max, bad_scales)


def _model_name(given) -> str:
    """The source as its user named it: a Hub model ID as given, or the one whose cache snapshot the folder is
    (``.../models--org--name/snapshots/<commit>``), else the folder's own name."""
    from fp4pass.safetensors.hub import parse_hub_id

    text = os.fspath(given)
    if parse_hub_id(text) is not None and not os.path.lexists(text):
        return text
    parts = os.path.normpath(os.path.abspath(text)).split(os.sep)
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return parts[-3][len("models--"):].replace("--", "/")
    return parts[-1]


def _architecture(config: dict) -> str | None:
    names = config.get("architectures")
    return names[0] if isinstance(names, list) and names and isinstance(names[0], str) else None


def _run(src: LayerRunner, nv: LayerRunner, quantizer: _Quantizer, batches: list[Batch], stores, dev, run: dict,
         show_progress) -> tuple:
    """Both models side by side over every layer and batch: (layer rows, expert rows worst first, unrouted experts,
    logit figures)."""
    visitor = _DiffLayers(src, nv, quantizer, batches, stores)
    run_layers([src, nv], stores, batches, visitor, layers=src.num_layers, timings=run["timings_s"], keep_last=True,
               show_progress=show_progress)
    visitor.expert_rows.sort(key=_worst_first)
    return visitor.layers, visitor.expert_rows, visitor.unrouted, visitor.logits


def _worst_first(row: dict) -> float:
    """Sort key: NaN/Inf outputs first, then ascending SNR, identical outputs (None) last."""
    return math.inf if row["snr_db"] is None else row["snr_db"]


class _DiffLayers(LayerVisitor):
    """The diff as a visitor of the layer loop: layer ``i`` of both models on every batch, the NVFP4 side
    fed the source's input (local) and its own (end to end); the layer's row, its experts' rows and its unrouted
    experts once the layer is done; the logit figures after the last layer."""

    desc = "diff (layer x batch)"
    finish_phase = "logits"

    def __init__(self, src: LayerRunner, nv: LayerRunner, quantizer: _Quantizer, batches: list[Batch], stores):
        self.src, self.nv, self.quantizer, self.batches, self.stores = src, nv, quantizer, batches, stores
        self.names = CheckpointNames(nv.sources)
        self.layers: list[dict] = []
        self.expert_rows: list[dict] = []
        self.unrouted: list[dict] = []
        self.logits: dict = {}

    def begin_layer(self, i: int, layers: tuple) -> None:
        src_mod, nv_mod = layers
        self.prefix = prefix = f"layers.{i}."
        src_stacks = dict(experts_modules(src_mod))
        self.nv_stacks = nv_stacks = dict(experts_modules(nv_mod))
        self.shared = [rel for rel in src_stacks if rel in nv_stacks]
        self.seen = {rel: (_ExpertRows(), _NVFP4Experts(self.quantizer, prefix + rel)) for rel in self.shared}
        self.undo = []
        for rel, (src_rows, nv_rows) in self.seen.items():
            src_stacks[rel].forward = routed_forward(src_stacks[rel], rel, src_rows)
            nv_stacks[rel].forward = routed_forward(nv_stacks[rel], rel, nv_rows)
            self.undo += [src_stacks[rel], nv_stacks[rel]]
        self.hooks = self.quantizer.install(nv_mod, prefix)
        self.watch = _NonfiniteWatch(nv_mod)
        self.local, self.e2e = Energy(), Energy()
        self.per_expert: dict[tuple, Energy] = {}
        self.tokens: dict[tuple, int] = {}

    def run_batch(self, runners, i, batch, layers, hidden):
        src, nv = runners
        src_mod, nv_mod = layers
        h_src, h_nv = hidden
        valid = valid_tokens(batch, src.device)
        same_input = h_nv is h_src or torch.equal(h_nv, h_src)
        for src_rows, nv_rows in self.seen.values():
            src_rows.begin(valid)
            nv_rows.begin(valid if same_input else _twice(valid), None if same_input else _local_tokens(batch))
        args_s, kw_s = src.layer_inputs(i, batch.input_ids, batch.attention_mask)
        out_src = src.run_layer(src_mod, h_src, args_s, kw_s)
        out_local, out_e2e = _nvfp4_runs(nv, nv_mod, i, batch, h_src, None if same_input else h_nv)
        self.local.add(tokens_of(out_src, batch), tokens_of(out_local, batch))
        self.e2e.add(tokens_of(out_src, batch), tokens_of(out_e2e, batch))
        for rel, (src_rows, nv_rows) in self.seen.items():
            _compare_experts(rel, src_rows, nv_rows, self.nv_stacks[rel], self.quantizer, self.prefix,
                             self.per_expert, self.tokens)
        return [out_src, out_e2e]

    def end_layer(self, i: int) -> None:
        for module in self.undo:
            del module.forward
        for handle in self.hooks + self.watch.handles:
            handle.remove()

    def after_layer(self, i: int) -> None:
        counts = {rel: self.nv_stacks[rel].num_experts for rel in self.shared}
        row, experts, idle = _layer_rows(i, self.prefix, self.local, self.e2e, self.per_expert, self.tokens, counts,
                                         self.names, self.watch)
        self.layers.append(row)
        self.expert_rows += experts
        self.unrouted += idle

    def finish(self) -> None:
        self.logits = _logit_figures(self.src, self.nv, self.batches, self.stores)


def _local_tokens(batch: Batch) -> int:
    """Tokens in the batch (padding included): the first half of an NVFP4 run on two copies of it."""
    return batch.input_ids.numel()


def _twice(valid: torch.Tensor | None) -> torch.Tensor | None:
    return None if valid is None else torch.cat([valid, valid])


def _nvfp4_runs(nv: LayerRunner, module, i: int, batch: Batch, h_local: torch.Tensor, h_own: torch.Tensor | None):
    """The NVFP4 layer's output on the source's input (local) and on its own (end to end): one run of both
    inputs stacked along the batch (each expert's weights read once for both), or one run where they are equal
    (``h_own`` None)."""
    if h_own is None:
        args, kwargs = nv.layer_inputs(i, batch.input_ids, batch.attention_mask)
        out = nv.run_layer(module, h_local, args, kwargs)
        return out, out
    mask = batch.attention_mask
    args, kwargs = nv.layer_inputs(i, torch.cat([batch.input_ids, batch.input_ids]),
                                   None if mask is None else torch.cat([mask, mask]))
    out = nv.run_layer(module, torch.cat([h_local, h_own]), args, kwargs)
    rows = h_local.shape[0]
    return out[:rows], out[rows:]


def _compare_experts(rel: str, src_rows: _ExpertRows, nv_rows: _NVFP4Experts, experts, quantizer: _Quantizer,
                     prefix: str, per_expert: dict, tokens: dict) -> None:
    """Each routed expert's output on the source's rows: the NVFP4 run's own where its expert saw exactly those
    rows (same MoE input, same routing), else the NVFP4 expert run again on them."""
    project = None
    with torch.no_grad():
        for e, rows in src_rows.rows.items():
            key = (rel, e)
            tokens[key] = tokens.get(key, 0) + rows.shape[0]
            if not rows.shape[0]:
                continue
            theirs = nv_rows.rows.get(e)
            if theirs is not None and theirs.shape == rows.shape and torch.equal(theirs, rows):
                out = nv_rows.outputs[e]
            else:
                project = project or expert_projection(experts)
                out = expert_output(experts, e, rows, project, quantizer.on_input(prefix + rel, e))
            per_expert.setdefault(key, Energy()).add(src_rows.outputs[e], out)


class _NonfiniteWatch:
    """Forward hooks on every module of an NVFP4 layer: which one first gives NaN or Inf, in the order the modules
    finish (a module before the one holding it). Each call adds one device-side flag, read only when the layer's
    output has NaN/Inf: no synchronisation otherwise."""

    def __init__(self, layer: torch.nn.Module):
        self.order: list[str] = []
        self.flags: dict[str, torch.Tensor] = {}
        self.handles = [m.register_forward_hook(self._hook(name)) for name, m in layer.named_modules() if name]

    def _hook(self, name: str):
        def hook(_module, _args, out):
            t = out[0] if isinstance(out, (tuple, list)) and out else out
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                return
            bad = ~torch.isfinite(t).all()
            if name in self.flags:
                self.flags[name] = self.flags[name] | bad
            else:
                self.order.append(name)
                self.flags[name] = bad
        return hook

    def first(self) -> str | None:
        """The first module (relative to the layer) whose output held NaN/Inf, or None."""
        return next((name for name in self.order if bool(self.flags[name])), None)


def _nonfinite_module(i: int, prefix: str, watch: _NonfiniteWatch, names: CheckpointNames, stacks: set,
                      per_expert: dict) -> tuple[str, int | None]:
    """Where layer ``i``'s NaN/Inf first appear, as the checkpoint names it: the first module whose output held
    them; in an expert stack, its first expert whose output did (the module, and that expert)."""
    rel = watch.first()
    if rel is None:
        return names.module(f"layers.{i}"), None
    if rel in stacks:
        bad = sorted(e for (stack, e), energy in per_expert.items() if stack == rel and energy.nonfinite)
        if bad:
            return names.expert(prefix + rel, bad[0]), bad[0]
    return names.module(prefix + rel), None


def _layer_rows(i, prefix, local: Energy, e2e: Energy, per_expert: dict, tokens: dict, counts: dict,
                names: CheckpointNames, watch: _NonfiniteWatch):
    keys = sorted(per_expert)
    flat = local.as_list() + e2e.as_list() + [v for k in keys for v in per_expert[k].as_list()]
    token_keys = [(rel, e) for rel, n in sorted(counts.items()) for e in range(n)]
    flat += [float(tokens.get(k, 0)) for k in token_keys]
    flat, _ = reduce_sums(flat, [])
    local.set(flat[0:4])
    e2e.set(flat[4:8])
    for j, k in enumerate(keys):
        per_expert[k].set(flat[8 + 4 * j: 12 + 4 * j])
    reduced_tokens = dict(zip(token_keys, (int(v) for v in flat[8 + 4 * len(keys):])))
    row = {"index": i, "snr_db_local": local.snr_db(), "snr_db_end_to_end": e2e.snr_db(),
           "checkpoint_module": names.module(f"layers.{i}")}
    if local.nonfinite or e2e.nonfinite:
        row["nonfinite_local"], row["nonfinite_end_to_end"] = local.nonfinite, e2e.nonfinite
        row["nonfinite_module"], expert = _nonfinite_module(i, prefix, watch, names, set(counts), per_expert)
        if expert is not None:
            row["nonfinite_expert"] = expert
    experts, idle = [], []
    for rel, e in token_keys:
        count = reduced_tokens.get((rel, e), 0)
        energy = per_expert.get((rel, e))
        if not count or energy is None:
            idle.append({"layer": i, "expert": e, "module": prefix + rel})
            continue
        experts.append({"layer": i, "expert": e, "snr_db": energy.snr_db(), "tokens": count,
                        "module": prefix + rel, "checkpoint_module": names.expert(prefix + rel, e)})
        if energy.nonfinite:
            experts[-1]["nonfinite"] = energy.nonfinite
    return row, experts, idle


def _logit_figures(src: LayerRunner, nv: LayerRunner, batches: list[Batch], stores) -> dict:
    src_store, nv_store = stores
    heads = src.output_head(), nv.output_head()
    stats = LogitStats()
    vocab = heads[0].weight.shape[0]
    chunk = max(1, LOGITS_CHUNK_BYTES // (vocab * 4))
    for b, batch in enumerate(batches):
        hs = tokens_of(src.final_hidden(src_store.get(b), batch.input_ids, batch.attention_mask), batch)
        hn = tokens_of(nv.final_hidden(nv_store.get(b), batch.input_ids, batch.attention_mask), batch)
        targets = tokens_of(next_tokens(batch, hs.device).unsqueeze(-1), batch).reshape(-1)
        with torch.no_grad():
            for s in range(0, hs.shape[0], chunk):
                stats.add(float32_logits(heads[0], hs[s:s + chunk]), float32_logits(heads[1], hn[s:s + chunk]),
                          targets[s:s + chunk])
    sums, top = reduce_sums(stats.as_list(), [stats.kl_max])
    stats.set(sums, top[0])
    return stats.to_json()
