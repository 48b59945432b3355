"""The model of a checkpoint run one decoder layer at a time, every batch through a layer before the next loads.

The run (:class:`LayerRunner`):

1. the embeddings, rotary tables and masks are made by the model's own ``forward``, with every decoder layer
   replaced by a recorder that keeps the layer's inputs (hidden states and keyword arguments: masks, position
   embeddings, ``input_ids`` for hash routing) and stops the forward there;
2. for each layer: its weights are read from the shards into a module of its own class (allocated, filled,
   run, then returned to the meta device; gpt-oss's [E, K, N] expert stacks over memory in the checkpoint's
   [E, N, K] order, :func:`~fp4pass.checkpoint.layerwise.model.store_in_checkpoint_order`), and every batch goes
   through its ``forward``; its outputs replace its inputs (one set of hidden states at a time, on disk when
   they exceed the budget). The next layer's weights are read and dequantized by a background thread
   (:class:`LayerPrefetcher`) while a layer runs.

The loop (:func:`run_layers`) is written once, for one model (calibration) or two side by side (the diff):
prefetch, capture the first layer's inputs, then per layer take it, install the visitor's hooks, run every
batch, propagate the outputs, release the layer, and time each phase. What a use of it records is a
:class:`LayerVisitor` (llm-compressor's ``SequentialPipeline``, with the calibration as hooks): calibration's
statistics, the diff's figures. Inside a layer, :func:`routed_forward` replaces an expert stack's ``forward``
by transformers' eager expert loop that also shows each expert's rows to the visitor.

Peak memory: the embedding table + two layers' weights (experts dequantized to bf16: the one running and the
one loading) + the hidden states of all calibration tokens (``tokens * hidden * 2`` bytes, or ``hc_mult`` times
that for DeepSeek-V4) unless they spill to disk + one batch's activations. It does not grow with the number of
layers.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Sequence

import torch

from fp4pass.calib.errors import CalibrationDataError
from fp4pass.safetensors.catalog import Catalog
from fp4pass.checkpoint.layerwise.hidden_states import HiddenStore
from fp4pass.checkpoint.layerwise.model import (WeightLoader, WeightSources, build_skeleton, materialize,
                                                resolve_architecture, store_in_checkpoint_order)
from fp4pass.safetensors.files import CheckpointError

__all__ = ["LayerRunner", "LayerPrefetcher", "LayerVisitor", "run_layers", "Clock", "share_batches",
           "routed_forward", "expert_output", "expert_projection", "float32_products", "float32_linears",
           "return_freed_memory", "default_device"]


def float32_products(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a layer's bf16 matmuls (its Linears' and its experts') run as float32 ones rounded to bf16: on a
    CPU without bf16 matrix instructions (AVX512-BF16, AMX). There a bf16 GEMM converts its operands to float32
    anyway and is ~5x slower than the float32 GEMM (18 against 92 GFLOP/s on a 2-core AVX2 EPYC, [256, 2880] x
    [2880, 5760]).

    The result is the same up to the order of the float32 additions: each output is the float32 sum of exact
    products of bf16 numbers, rounded once to bf16, as a bf16 GEMM with float32 accumulation computes it (1 bf16
    ulp apart for ~2 in 10,000 outputs of that product, where a sum lands next to a rounding boundary).
    """
    if device.type != "cpu" or dtype != torch.bfloat16:
        return False
    cpu = torch.cpu
    native = (getattr(cpu, "_is_avx512_bf16_supported", lambda: False)()
              or getattr(cpu, "_is_amx_tile_supported", lambda: False)())
    return not native


def _linear_in_float32(linear: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``linear(x)`` as float32 products rounded once to ``x``'s dtype (the bias inside the sum, as a bf16
    GEMM with a bias adds it before its one rounding)."""
    bias = None if linear.bias is None else linear.bias.float()
    return torch.nn.functional.linear(x.float(), linear.weight.float(), bias).to(x.dtype)


@contextlib.contextmanager
def float32_linears(module: torch.nn.Module):
    """Within the block, every bf16 ``torch.nn.Linear`` of ``module`` computes in float32 and rounds to bf16
    (:func:`float32_products`) when the module's device calls for it; otherwise nothing changes."""
    linears = [m for m in module.modules() if type(m) is torch.nn.Linear and m.weight.dtype == torch.bfloat16
               and float32_products(m.weight.device, m.weight.dtype)]
    for linear in linears:
        linear.forward = functools.partial(_linear_in_float32, linear)
    try:
        yield
    finally:
        for linear in linears:
            del linear.forward


class _Stop(Exception):
    """Raised by a recorder to end the capture forward."""


class _Recorder(torch.nn.Module):
    """Stands in for decoder layer ``index``: records its inputs when it is the wanted one, returns the hidden
    states put in ``box["inject"]`` when it is the last layer and they are given (the model's own tail, its final
    norm, then runs on them), else passes its inputs on."""

    def __init__(self, index: int, box: dict):
        super().__init__()
        self.index, self.box = index, box

    def forward(self, hidden_states, *args, **kwargs):
        if self.box["want"] == self.index:
            self.box["hidden"], self.box["args"], self.box["kwargs"] = hidden_states, args, kwargs
            raise _Stop
        inject = self.box.get("inject")
        if inject is not None and inject[0] == self.index:
            return inject[1]
        return hidden_states


class LayerRunner:
    """The model of a checkpoint, run layer by layer on ``batches`` (module docstring)."""

    def __init__(self, catalog: Catalog, found, device: torch.device, dtype=torch.bfloat16,
                 config: dict | None = None, trust_remote_code: bool = False):
        """``found``: the checkpoint's quantized units (:func:`fp4pass.checkpoint.detect.detect`, or another
        form's decoded units); ``config``: the model's config.json when it is not the catalog's own;
        ``trust_remote_code``: run the folder's own modeling code (:func:`resolve_architecture`)."""
        self.catalog, self.device = catalog, device
        self.model_type, self.cfg = resolve_architecture(catalog.config if config is None else config, catalog.folder,
                                                         trust_remote_code)
        self.model, self.base = build_skeleton(self.model_type, self.cfg, dtype)
        self.sources = WeightSources.build(catalog, found, self.model_type)
        self.loader = WeightLoader(catalog, self.sources, device)
        self.layers = list(self.base.layers)
        self.box: dict = {"want": None}
        self.base.layers = torch.nn.ModuleList([_Recorder(i, self.box) for i in range(len(self.layers))])
        for name, child in self.base.named_children():
            if name != "layers":
                materialize(child, f"{name}.", self.loader, self.cfg, device)
        self._kwargs_cache: dict = {}

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def vocab_size(self) -> int:
        return int(self.cfg.vocab_size)

    def capture(self, index: int, input_ids: torch.Tensor, attention_mask: torch.Tensor | None):
        """(hidden states, args, kwargs) that the model's forward passes to decoder layer ``index``."""
        self.box["want"] = index
        try:
            with torch.no_grad():
                self.base(input_ids=input_ids.to(self.device),
                          attention_mask=None if attention_mask is None else attention_mask.to(self.device),
                          use_cache=False)
        except _Stop:
            pass
        else:
            raise RuntimeError(f"decoder layer {index} was never called by the model's forward")
        finally:
            self.box["want"] = None
        return self.box.pop("hidden"), self.box.pop("args"), self.box.pop("kwargs")

    def layer_inputs(self, index: int, input_ids: torch.Tensor, attention_mask: torch.Tensor | None):
        """(args, kwargs) of layer ``index`` for this batch; reused across batches of one shape without a mask."""
        key = (index, tuple(input_ids.shape)) if attention_mask is None else None
        if key is not None and key in self._kwargs_cache:
            args, kwargs = self._kwargs_cache[key]
        else:
            _, args, kwargs = self.capture(index, input_ids, attention_mask)
            if key is not None:
                self._kwargs_cache[key] = (args, kwargs)
        if "input_ids" in kwargs:
            kwargs = {**kwargs, "input_ids": input_ids.to(self.device)}
        return args, kwargs

    def drop_cached(self, index: int) -> None:
        for key in [k for k in self._kwargs_cache if k[0] == index]:
            del self._kwargs_cache[key]

    @contextlib.contextmanager
    def layer(self, index: int):
        """Decoder layer ``index`` with its weights loaded on the device; back to the meta device after."""
        module = self.load_layer(index)
        try:
            yield module
        finally:
            self.release_layer(index)

    def load_layer(self, index: int) -> torch.nn.Module:
        """Decoder layer ``index`` allocated on the device and filled from the checkpoint (any thread); on
        failure it is back on the meta device."""
        module = self.layers[index]
        try:
            store_in_checkpoint_order(module)
            materialize(module, f"layers.{index}.", self.loader, self.cfg, self.device)
        except BaseException:
            module.to_empty(device="meta")
            raise
        return module.eval()

    def release_layer(self, index: int) -> None:
        """Decoder layer ``index`` back on the meta device (its weights freed)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # no kernel still reads memory that the allocator hands out again
        self.layers[index].to_empty(device="meta")
        self.drop_cached(index)
        return_freed_memory()

    def run_layer(self, module, hidden: torch.Tensor, args, kwargs) -> torch.Tensor:
        with torch.no_grad(), float32_linears(module):
            out = module(hidden, *args, **kwargs)
        return out[0] if isinstance(out, tuple) else out

    def final_hidden(self, last: torch.Tensor, input_ids: torch.Tensor,
                     attention_mask: torch.Tensor | None) -> torch.Tensor:
        """The base model's output for a batch whose last decoder layer gave ``last``: the model's own forward
        with ``last`` put in place of that layer's output, so its tail (final norm; DeepSeek-V4's
        hyper-connection head) runs as the model runs it."""
        self.box["inject"] = (len(self.layers) - 1, last)
        try:
            with torch.no_grad():
                out = self.base(input_ids=input_ids.to(self.device),
                                attention_mask=None if attention_mask is None else attention_mask.to(self.device),
                                use_cache=False)
        finally:
            self.box["inject"] = None
        return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]

    def output_head(self) -> torch.nn.Module:
        """The causal LM's output embedding (``lm_head``), loaded on first use: from the checkpoint, or the
        input embedding's weight where the config ties them."""
        head = self.model.get_output_embeddings()
        if head is None:
            raise CheckpointError(f"{self.model_type}: the transformers model has no output embedding (lm_head)")
        if head.weight.device.type == "meta":
            if bool(getattr(self.cfg, "tie_word_embeddings", False)) and "lm_head.weight" not in self.sources.plain:
                head.weight = self.model.get_input_embeddings().weight
            else:
                prefix = next(n for n, m in self.model.named_modules() if m is head)
                materialize(head, f"{prefix}.", self.loader, self.cfg, self.device)
        return head


_LIBC_TRIM = None


def return_freed_memory() -> bool:
    """Give the C heap's free pages back to the system (glibc's ``malloc_trim(0)``); False where there is no
    glibc. Called after each layer: a layer's transient buffers (a few MiB each: float32 operands, gathered rows)
    come from the heap, and what they leave free between larger blocks is otherwise kept, so the process's peak
    memory crept up with depth (16 layers 1.24-1.26x the peak of 4 in the bench; 1.00-1.03x with the trim)."""
    global _LIBC_TRIM
    if _LIBC_TRIM is None:
        import ctypes
        import ctypes.util

        try:
            _LIBC_TRIM = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _LIBC_TRIM = False
    if not _LIBC_TRIM:
        return False
    _LIBC_TRIM(0)
    return True


class LayerPrefetcher:
    """Loads decoder layers in one background thread while the caller runs the previous one.

    Reading the shards (``os.preadv``) and the dequantization (torch operations) release the GIL, so layer
    i + 1's weights are read and decoded while layer i runs its batches; on CUDA on a stream of its own, the
    copies and decode kernels beside the layer's kernels. At most one layer loads while one runs: two layers'
    weights at the peak. An error of the load (a missing tensor, a NaN scale) is raised by :meth:`take`.
    """

    def __init__(self, runner: LayerRunner):
        from concurrent.futures import ThreadPoolExecutor

        self.runner = runner
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fp4pass-layer-load")
        self.pending: dict = {}
        self.taken: set[int] = set()
        #: seconds the background thread spent loading layers (hidden behind the runs, or waited for)
        self.busy = 0.0

    def _load(self, index: int) -> torch.nn.Module:
        import time

        start = time.perf_counter()
        try:
            device = self.runner.device
            if device.type != "cuda":
                return self.runner.load_layer(index)
            stream = torch.cuda.Stream(device)
            with torch.cuda.stream(stream):
                module = self.runner.load_layer(index)
            stream.synchronize()
            return module
        finally:
            self.busy += time.perf_counter() - start

    def start(self, index: int) -> None:
        """Begin loading layer ``index`` in the background."""
        self.pending[index] = self.pool.submit(self._load, index)

    def take(self, index: int) -> torch.nn.Module:
        """Layer ``index``, loaded (waits for its load; starts it when it was not started)."""
        if index not in self.pending:
            self.start(index)
        module = self.pending.pop(index).result()
        self.taken.add(index)
        return module

    def release(self, index: int) -> None:
        """Layer ``index`` (taken) back on the meta device."""
        self.taken.discard(index)
        self.runner.release_layer(index)

    def close(self) -> None:
        """Stop a load in progress, wait for the thread, and return every loaded layer to the meta device."""
        loader = self.runner.loader
        loader.cancel.set()
        try:
            for index, future in list(self.pending.items()):
                try:
                    future.result()
                except BaseException:  # noqa: BLE001 - a cancelled or failed load is on the meta device already
                    continue
                self.runner.release_layer(index)
            self.pending.clear()
            for index in list(self.taken):
                self.release(index)
        finally:
            self.pool.shutdown(wait=True)
            loader.cancel.clear()


def default_device(device: str | None) -> torch.device:
    """``auto``: CUDA when torch has a GPU, else the CPU."""
    from fp4pass.errors import UsageError

    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: torch sees no CUDA device")
    if device not in ("cpu", "cuda"):
        raise UsageError(f"--device {device!r}: choose auto, cpu or cuda")
    return torch.device(device)


class Clock:
    """Seconds per phase, added up in ``into`` (the device synchronised at each lap, so GPU work is counted
    in its phase)."""

    def __init__(self, device: torch.device, into: dict):
        self.device, self.into = device, into
        self.last = time.perf_counter()

    def lap(self, phase: str) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.into[phase] = self.into.get(phase, 0.0) + now - self.last
        self.last = now


def share_batches(batches: list) -> list:
    """This rank's batches under ``torch.distributed`` (rank r takes r, r + world, ...); all of them otherwise."""
    from fp4pass.calib.distributed import distributed_ready

    if not distributed_ready():
        return batches
    import torch.distributed as dist

    world = dist.get_world_size()
    if len(batches) < world:  # every rank sees the same count, so all refuse (none waits in an all-reduce)
        raise CalibrationDataError(f"{len(batches)} calibration batch(es) for {world} ranks: each rank needs at "
                                   "least one (a smaller batch size gives more)")
    return batches[dist.get_rank()::world]


def expert_projection(experts: torch.nn.Module):
    """``project(x, weight, bias)``: one product of the model's experts as transformers' eager loop computes it
    (gpt-oss: ``x @ W + b`` on [E, K, N] stacks; DeepSeek: ``linear(x, W)``). On a CPU without bf16 matrix
    instructions the product runs in float32 and is rounded to the model's dtype (:func:`float32_products`);
    the bias is then added in the model's dtype, as the model does."""
    import torch.nn.functional as F

    transposed = bool(getattr(experts, "is_transposed", False))
    upcast = float32_products(experts.gate_up_proj.device, experts.gate_up_proj.dtype)

    def project(x, weight, bias):
        a, w = (x.float(), weight.float()) if upcast else (x, weight)
        y = a @ w if transposed else F.linear(a, w)
        y = y.to(x.dtype)
        return y + bias if bias is not None else y

    return project


def expert_output(experts: torch.nn.Module, e: int, rows: torch.Tensor, project, on_input=None) -> torch.Tensor:
    """Expert ``e``'s MLP on ``rows`` [n, H] (before the routing weight): gate/up product, the model's gated
    activation (``_apply_gate``), down product. ``on_input(kind, x)`` sees the input of each product (``kind``
    "gate_up" or "down") and may return a replacement for it (a fake-quantized copy), or None to keep it."""
    biased = bool(getattr(experts, "has_bias", False))
    if on_input is not None:
        rows = _replaced(rows, on_input("gate_up", rows))
    gate_up = project(rows, experts.gate_up_proj[e], experts.gate_up_proj_bias[e] if biased else None)
    gated = experts._apply_gate(gate_up)
    if on_input is not None:
        gated = _replaced(gated, on_input("down", gated))
    return project(gated, experts.down_proj[e], experts.down_proj_bias[e] if biased else None)


def _replaced(rows: torch.Tensor, replacement: torch.Tensor | None) -> torch.Tensor:
    return rows if replacement is None else replacement


def routed_forward(experts: torch.nn.Module, rel: str, recorder):
    """The eager expert loop of transformers' MoE experts (same order, same operations: :func:`expert_output`),
    with each expert's rows shown to ``recorder.record(rel, e, kind, rows, token_idx)`` (a visitor's account of
    one stack): kind "gate_up" (the MoE input of its tokens) and "down" (its intermediate activation), whose
    return value, when not None, replaces the rows; then "out" (its output before the routing weight; the return
    value is ignored). ``token_idx``: the rows' token positions in the flattened batch."""
    num = experts.num_experts
    project = expert_projection(experts)

    def forward(hidden_states, top_k_index, top_k_weights):
        final = torch.zeros_like(hidden_states)
        tokens = top_k_index.shape[0]
        with torch.no_grad():
            # position-major flat routing, j = top-k position * tokens + token; a stable sort by expert keeps
            # each expert's entries in j order, the order of torch.where on transformers' one-hot mask
            flat = top_k_index.t().reshape(-1)
            order = torch.argsort(flat, stable=True)
            counts = torch.bincount(flat, minlength=num + 1)[:num].tolist()  # index num: no expert
        start = 0
        for e, count in enumerate(counts):
            if not count:
                continue
            picked = order[start:start + count]
            start += count
            top_k_pos, token_idx = picked // tokens, picked % tokens
            out = expert_output(experts, e, hidden_states[token_idx], project,
                                lambda kind, rows: recorder.record(rel, e, kind, rows, token_idx))
            recorder.record(rel, e, "out", out, token_idx)
            out = out * top_k_weights[token_idx, top_k_pos, None]
            # index_add_ in transformers' loop; a token meets each expert once, so each row gets one addition
            # either way (the same numbers), and index_put_ is ~9x faster on the CPU for bf16
            final.index_put_((token_idx,), out.to(final.dtype), accumulate=True)
        return final

    return forward


class LayerVisitor:
    """What one use of :func:`run_layers` does at each step of the loop; the loop owns the order.

    ``begin_layer`` installs the hooks on the loaded layers (one per runner), ``run_batch`` runs them on one
    batch and returns their outputs (the default: each runner's layer on its own hidden states),
    ``end_layer`` removes the hooks (also when a batch fails), ``after_layer`` takes the layer's results once
    its weights are freed, ``finish`` runs after the last layer. ``after_phase`` and ``finish_phase`` name the
    timing phase of those two (None: their time counts in the next phase)."""

    desc = "layer x batch"  # the progress bar's label
    after_phase: str | None = None
    finish_phase: str | None = None

    def begin_layer(self, index: int, layers: tuple) -> None:
        pass

    def run_batch(self, runners: Sequence[LayerRunner], index: int, batch, layers: tuple,
                  hidden: list[torch.Tensor]) -> list[torch.Tensor]:
        out = []
        for runner, layer, states in zip(runners, layers, hidden):
            args, kwargs = runner.layer_inputs(index, batch.input_ids, batch.attention_mask)
            out.append(runner.run_layer(layer, states, args, kwargs))
        return out

    def end_layer(self, index: int) -> None:
        pass

    def after_layer(self, index: int) -> None:
        pass

    def finish(self) -> None:
        pass


def run_layers(runners: Sequence[LayerRunner], stores: Sequence[HiddenStore], batches: list, visitor: LayerVisitor,
               *, layers: int, timings: dict, keep_last: bool = False, show_progress: bool | None = False) -> None:
    """Decoder layers ``0 .. layers - 1`` of every runner (one model, or two side by side) over every batch, in
    lockstep: the first layer's inputs captured into ``stores`` (one per runner), then per layer its weights
    taken from the prefetcher (the next layer's load started), the visitor's hooks installed, every batch run and
    its outputs put in place of its inputs (the last layer's too with ``keep_last``), the layer released. Seconds
    per phase go into ``timings`` (``embed``, ``load``, ``layers``, ``release``, the visitor's phases, and
    ``load_background``: the background thread's own time reading and decoding, overlapping the rest)."""
    from fp4pass.progress import progress

    clock = Clock(runners[0].device, timings)
    fetch = [LayerPrefetcher(runner) for runner in runners]
    try:
        if layers:
            for f in fetch:
                f.start(0)  # layer 0's weights load while the batches reach its input
        for b, batch in enumerate(batches):
            for runner, store in zip(runners, stores):
                store.put(b, runner.capture(0, batch.input_ids, batch.attention_mask)[0])
        clock.lap("embed")
        steps = iter(progress(range(layers * len(batches)), total=layers * len(batches), desc=visitor.desc,
                              enabled=show_progress, unit="batch"))
        for i in range(layers):
            taken = tuple(f.take(i) for f in fetch)
            clock.lap("load")  # the wait for layer i's weights: the part of their load not hidden
            if i + 1 < layers:
                for f in fetch:
                    f.start(i + 1)
            visitor.begin_layer(i, taken)
            try:
                for b, batch in enumerate(batches):
                    next(steps, None)
                    outputs = visitor.run_batch(runners, i, batch, taken, [store.get(b) for store in stores])
                    if keep_last or i + 1 < layers:
                        for store, out in zip(stores, outputs):
                            store.put(b, out)
                clock.lap("layers")
            finally:
                visitor.end_layer(i)
                for f in fetch:
                    f.release(i)
                clock.lap("release")  # the layer's memory back: freed, and the heap trimmed
            visitor.after_layer(i)
            if visitor.after_phase:
                clock.lap(visitor.after_phase)
        next(steps, None)  # the bar's last count, and its end
        visitor.finish()
        if visitor.finish_phase:
            clock.lap(visitor.finish_phase)
    finally:
        for f in fetch:
            f.close()
        timings["load_background"] = sum(f.busy for f in fetch)
