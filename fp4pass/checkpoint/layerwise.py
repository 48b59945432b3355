"""A checkpoint's model, built by transformers' own modeling code, run one decoder layer at a time.

Which model: ``config.json``'s ``model_type`` when transformers has that model type, else the first entry of
``architectures`` that transformers has (Kimi-K2 ships ``model_type: kimi_k2`` with ``architectures:
["DeepseekV3ForCausalLM"]``); neither is refused, naming the model type. The skeleton is built on the meta
device (no memory) with eager attention and the eager expert loop (the forms every backend agrees with).

Which weight goes where: each checkpoint name is renamed by transformers' own ``WeightRenaming`` rules for the
model type (DeepSeek-V4's native names ``layers.0.attn.wq_a`` -> ``layers.0.self_attn.q_a_proj``), without the
``model.`` prefix. Per-expert weights ``<layer>.experts.<e>.w1|gate_proj`` and ``w3|up_proj`` fill row halves
(gate first) of expert e of the model's ``<layer>.experts.gate_up_proj`` [E, 2I, H], ``w2|down_proj`` its
``down_proj`` [E, H, I] (what transformers' ``MergeModulelist`` + ``Concatenate`` converters do). MXFP4 weights
are dequantized with :class:`fp4pass.formats.MXFP4Tensor` (exact in bf16), a gpt-oss stack [E, N, K] into the
model's [E, K, N] parameter expert by expert; FP8 (E4M3) weights with 128x128 block scales are dequantized too.

The run (:class:`LayerRunner`):

1. the embeddings, rotary tables and masks are made by the model's own ``forward``, with every decoder layer
   replaced by a recorder that keeps the layer's inputs (hidden states and keyword arguments: masks, position
   embeddings, ``input_ids`` for hash routing) and stops the forward there;
2. for each layer: its weights are read from the shards into a module of its own class (allocated, filled,
   run, then returned to the meta device; gpt-oss's [E, K, N] expert stacks over memory in the checkpoint's
   [E, N, K] order, :func:`store_in_checkpoint_order`), and every batch goes through its ``forward``; its
   outputs replace its inputs (one set of hidden states at a time, on disk when they exceed the budget). The
   next layer's weights are read and dequantized by a background thread (:class:`LayerPrefetcher`) while a
   layer runs.

Peak memory: the embedding table + two layers' weights (experts dequantized to bf16: the one running and the
one loading) + the hidden states of all calibration tokens (``tokens * hidden * 2`` bytes, or ``hc_mult`` times
that for DeepSeek-V4) unless they spill to disk + one batch's activations. It does not grow with the number of
layers.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import shutil
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fp4pass.safetensors.catalog import Catalog
from fp4pass.checkpoint.detect import FusedExperts, Linear
from fp4pass.safetensors.files import CheckpointError
from fp4pass.formats import MXFP4Tensor
from fp4pass.formats.byte_tables import word_values

__all__ = ["resolve_architecture", "build_skeleton", "WeightSources", "LayerRunner", "LayerPrefetcher", "HiddenStore",
           "experts_modules", "mx_dequantize", "decode_experts", "store_in_checkpoint_order",
           "float32_products", "float32_linears", "return_freed_memory"]

log = logging.getLogger(__name__)

_EXPERT_PART = re.compile(r"^(?P<experts>.*\.experts)\.(?P<e>\d+)\.(?P<proj>w1|w2|w3|gate_proj|up_proj|down_proj)"
                          r"\.weight$")
_GATE_UP = {"w1": 0, "gate_proj": 0, "w3": 1, "up_proj": 1}
_FP8_DTYPES = ("F8_E4M3",)
FP8_BLOCK = 128


def resolve_architecture(config: dict, folder, trust_remote_code: bool = False) -> tuple[str, object]:
    """(model type, transformers config object) for ``config.json`` (module docstring's rule). A config from a
    stranger has its counts checked before this (:func:`fp4pass.checkpoint.model_limits.check_config_fields`);
    what transformers' config class itself refuses is a :class:`CheckpointError` naming it.

    A folder that ships its own modeling code (config.json ``auto_map``) runs through that code only under
    ``trust_remote_code`` (it executes the folder's Python files, as transformers, vLLM and ModelOpt do with the
    same flag); then the folder's code is taken even where transformers has a model of that type. Without the
    flag, and without a transformers model, it is a :class:`CheckpointError` naming the flag."""
    import transformers
    from transformers import CONFIG_MAPPING

    model_type = config.get("model_type")
    auto_map = config.get("auto_map") if isinstance(config.get("auto_map"), dict) else {}
    fields = {k: v for k, v in config.items() if k not in ("model_type", "quantization_config", "architectures",
                                                           "transformers_version", "auto_map")}
    if trust_remote_code and auto_map:
        return _remote_architecture(auto_map, fields, folder)
    chosen = model_type if isinstance(model_type, str) and model_type in CONFIG_MAPPING else None
    if chosen is None:
        for arch in config.get("architectures") or []:
            cls = getattr(transformers, arch, None) if isinstance(arch, str) else None
            config_class = getattr(cls, "config_class", None)
            if config_class is not None and getattr(config_class, "model_type", None) in CONFIG_MAPPING:
                chosen = config_class.model_type
                break
    if chosen is None and auto_map:
        raise CheckpointError(f"{folder}: model_type {model_type!r} runs only through the folder's own modeling "
                              f"code (config.json auto_map: {', '.join(sorted(map(str, auto_map.values())))}); "
                              "give --trust-remote-code to run it (it executes that code), or convert without "
                              "calibration: --input-scale X or --scales SCALES.json")
    if chosen is None:
        raise CheckpointError(f"{folder}: model_type {model_type!r} (architectures {config.get('architectures')}): "
                              f"transformers {transformers.__version__} has no such model, so its forward cannot "
                              "run for calibration or a diff; convert it without one: --input-scale X (one "
                              "activation scale for every expert) or --scales SCALES.json (calibrated elsewhere)")
    try:
        cfg = CONFIG_MAPPING[chosen](**fields)
    except (TypeError, ValueError, _config_validation_error()) as exc:
        raise CheckpointError(f"{folder}/config.json: transformers' {chosen} config refuses it ({exc})") from None
    return chosen, cfg


def _remote_architecture(auto_map: dict, fields: dict, folder) -> tuple[str, object]:
    """The folder's own config class (``auto_map["AutoConfig"]``) built from config.json's fields, remembering
    the folder and the map so that :func:`build_skeleton` builds the folder's own causal LM."""
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    for key in ("AutoConfig", "AutoModelForCausalLM"):
        if not isinstance(auto_map.get(key), str):
            raise CheckpointError(f"{folder}/config.json: auto_map has no {key} entry, which calibration needs to "
                                  "build the folder's model from its own code")
    try:
        config_class = get_class_from_dynamic_module(auto_map["AutoConfig"], str(folder))
        cfg = config_class(**fields)
    except (OSError, ImportError, AttributeError, TypeError, ValueError, SyntaxError,
            _config_validation_error()) as exc:
        raise CheckpointError(f"{folder}: its own config code ({auto_map['AutoConfig']}) fails: "
                              f"{type(exc).__name__}: {exc}") from None
    cfg._name_or_path = str(folder)  # where from_config finds the modeling code
    cfg.auto_map = dict(auto_map)
    return str(getattr(cfg, "model_type", "") or config_class.__name__), cfg


def _is_remote(cfg) -> bool:
    """A config object made by :func:`_remote_architecture` (its class loaded from a folder's own code)."""
    return bool(getattr(cfg, "auto_map", None)) and type(cfg).__module__.startswith("transformers_modules")


def _config_validation_error() -> type[Exception]:
    """The error transformers' strict config classes raise for a field of the wrong type or value
    (huggingface_hub's ``StrictDataclassError``, no TypeError or ValueError); TypeError where there is none."""
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:
        return TypeError
    return StrictDataclassError


def build_skeleton(model_type: str, cfg, dtype=torch.bfloat16):
    """The causal LM of ``cfg`` on the meta device (eager attention, eager experts); (model, base model)."""
    from transformers import AutoModelForCausalLM

    remote = {"trust_remote_code": True} if _is_remote(cfg) else {}  # consent was given where cfg was made
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="eager",
                                                 experts_implementation="eager", **remote)
    model.eval()
    base = getattr(model, model.base_model_prefix, model)
    if not isinstance(getattr(base, "layers", None), torch.nn.ModuleList):
        raise CheckpointError(f"{model_type}: the transformers model has no decoder layer list to run layer by layer")
    return model, base


def _renamings(model_type: str) -> list:
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightRenaming

    return [t for t in (get_checkpoint_conversion_mapping(model_type) or []) if isinstance(t, WeightRenaming)]


def _rename(name: str, renamings: list) -> str:
    from transformers.core_model_loading import rename_source_key

    if renamings:
        name, _ = rename_source_key(name, renamings, [])
    return name[len("model."):] if name.startswith("model.") else name


@dataclass
class Source:
    """Where one model tensor (or one expert's part of it) comes from."""

    kind: str  # plain | mx | fused | fp8 | decoded | decoded-stack
    name: str  # checkpoint tensor (plain, fp8) or module (mx, fused, decoded, decoded-stack)
    #: Linear | FusedExperts (MXFP4); for "decoded" a unit with ``decode(read, device, dtype)`` -> [N, K], for
    #: "decoded-stack" one with ``fill_stack(read, out, transposed)`` (another quantized form: NVFP4)
    unit: object = None
    scale: str | None = None  # fp8 block scales


@dataclass
class WeightSources:
    """Model tensor name (base-model relative) -> its source; expert stacks -> {expert: [part sources]}."""

    plain: dict[str, Source] = field(default_factory=dict)
    experts: dict[str, dict[int, dict[int, Source]]] = field(default_factory=dict)
    #: checkpoint MXFP4 module -> (model module, expert or None, "gate_up" | "down" | "dense")
    quantized: dict[str, tuple[str, int | None, str]] = field(default_factory=dict)

    @classmethod
    def build(cls, catalog: Catalog, found, model_type: str) -> "WeightSources":
        renamings = _renamings(model_type)
        out = cls()
        sources: list[tuple[str, Source]] = []
        for unit in found.units:
            if isinstance(unit, FusedExperts) or hasattr(unit, "fill_stack"):
                target = _rename(unit.name, renamings)
                kind = "fused" if isinstance(unit, FusedExperts) else "decoded-stack"
                out.plain[target] = Source(kind, unit.name, unit)
                stack = target.rpartition(".")[0]
                out.quantized[unit.name] = (stack, None, "gate_up" if unit.proj.startswith("gate_up") else "down")
                continue
            for lin in unit if isinstance(unit, tuple) else (unit,):
                kind = "decoded" if hasattr(lin, "decode") else "mx"
                sources.append((lin.module + ".weight", Source(kind, lin.module, lin)))
        fp8_scales = set()
        for name, entry in catalog.tensors.items():
            if name in found.consumed:
                continue
            if entry.dtype in _FP8_DTYPES and name.endswith(".weight"):
                module = name[: -len(".weight")]
                scale = next((s for s in (module + ".scale", module + ".weight_scale_inv") if s in catalog.tensors),
                             None)
                if scale is not None:
                    fp8_scales.add(scale)
                    sources.append((name, Source("fp8", name, scale=scale)))
                    continue
            sources.append((name, Source("plain", name)))
        for name, source in sources:
            if source.kind == "plain" and name in fp8_scales:
                continue
            target = _rename(name, renamings)
            match = _EXPERT_PART.match(target)
            if match:
                proj, e = match.group("proj"), int(match.group("e"))
                stack = match.group("experts")
                tensor = f"{stack}.gate_up_proj" if proj in _GATE_UP else f"{stack}.down_proj"
                out.experts.setdefault(tensor, {}).setdefault(e, {})[_GATE_UP.get(proj, 0)] = source
                if source.kind in ("mx", "decoded"):
                    out.quantized[source.name] = (stack, e, "gate_up" if proj in _GATE_UP else "down")
                continue
            out.plain[target] = source
            if source.kind in ("mx", "decoded"):
                out.quantized[source.name] = (target[: -len(".weight")], None, "dense")
        return out

    def names(self) -> set[str]:
        return set(self.plain) | set(self.experts)


def experts_modules(module: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The expert stacks of ``module``: modules holding ``gate_up_proj`` and ``down_proj`` [E, ., .] parameters."""
    out = []
    for name, sub in module.named_modules():
        params = dict(sub.named_parameters(recurse=False))
        if "gate_up_proj" in params and "down_proj" in params and params["gate_up_proj"].dim() == 3:
            out.append((name, sub))
    return out


class WeightLoader:
    """Fills a module's tensors from the checkpoint (sources above), dequantizing on ``device``."""

    def __init__(self, catalog: Catalog, sources: WeightSources, device: torch.device):
        self.catalog, self.sources, self.device = catalog, sources, device
        #: set to stop a fill in progress (another thread's prefetch) at its next tensor or expert
        self.cancel = threading.Event()

    def _read(self, name: str) -> torch.Tensor:
        return self.catalog.read(name)

    def _mx(self, lin: Linear, dtype=torch.float32, out: torch.Tensor | None = None) -> torch.Tensor:
        codes = self._read(lin.codes.name).view(torch.uint8).reshape(lin.rows, lin.cols // 2)
        scales = self._read(lin.scales.name).view(torch.uint8).reshape(lin.rows, lin.cols // 32)
        return mx_dequantize(codes.to(self.device), scales.to(self.device), dtype, lin.module, out=out)

    def _fp8(self, source: Source) -> torch.Tensor:
        weight = self._read(source.name).to(self.device).float()
        scale = self._read(source.scale).to(self.device).float()
        rows, cols = weight.shape
        full = scale.repeat_interleave(FP8_BLOCK, 0)[:rows].repeat_interleave(FP8_BLOCK, 1)[:, :cols]
        return weight * full

    def value(self, source: Source, dtype=torch.float32) -> torch.Tensor:
        """The source's tensor; MXFP4 dequantized straight into ``dtype`` (the parameter's: exact in bf16)."""
        if source.kind == "mx":
            return self._mx(source.unit, dtype)
        if source.kind == "fp8":
            return self._fp8(source)
        if source.kind == "decoded":
            return source.unit.decode(self._read, self.device, dtype)
        return self._read(source.name)

    def fill(self, target: str, tensor: torch.Tensor, owner: torch.nn.Module | None = None) -> None:
        """Copy the checkpoint's value of model tensor ``target`` into ``tensor`` (its dtype and layout);
        ``owner``: the module holding it (an expert stack says whether it is stored transposed, [E, K, N])."""
        with torch.no_grad():
            if target in self.sources.experts:
                self._fill_experts(target, tensor)
                return
            source = self.sources.plain[target]
            if source.kind == "fused":
                self._fill_fused(source.unit, tensor, target, bool(getattr(owner, "is_transposed", False)))
                return
            if source.kind == "decoded-stack":
                source.unit.fill_stack(self._read, tensor, bool(getattr(owner, "is_transposed", False)))
                return
            value = self.value(source, tensor.dtype)
            if tuple(value.shape) != tuple(tensor.shape):
                if value.numel() == tensor.numel() and value.dim() <= 1 and tensor.dim() <= 1:
                    value = value.reshape(tensor.shape)
                else:
                    raise CheckpointError(f"{source.name}: shape {list(value.shape)}, but the model's {target} is "
                                          f"{list(tensor.shape)}")
            tensor.copy_(value)

    def _fill_fused(self, unit: FusedExperts, tensor: torch.Tensor, target: str, transposed: bool) -> None:
        e, n, k = unit.experts, unit.rows, unit.cols
        if tuple(tensor.shape) != ((e, k, n) if transposed else (e, n, k)):
            raise CheckpointError(f"{unit.codes.name}: experts {[e, n, k]} do not fit the model's {target} "
                                  f"{list(tensor.shape)}")
        codes = self._read(unit.codes.name).view(torch.uint8).reshape(e, n, k // 2)
        scales = self._read(unit.scales.name).view(torch.uint8).reshape(e, n, k // 32)
        decode_experts(codes, scales, tensor, transposed, unit.name, cancel=self.cancel)

    def _fill_experts(self, target: str, tensor: torch.Tensor) -> None:
        parts = self.sources.experts[target]
        count = tensor.shape[0]
        gate_up = target.endswith("gate_up_proj")
        for e in range(count):
            found = parts.get(e, {})
            need = (0, 1) if gate_up else (0,)
            missing = [p for p in need if p not in found]
            if missing:
                what = ("gate", "up")[missing[0]] if gate_up else "down"
                raise CheckpointError(f"{self.catalog.folder}: no {what} weight for expert {e} of {target}")
            if self.cancel.is_set():
                raise _Cancelled
            if self._fill_expert_in_place(found, need, tensor[e]):
                continue
            values = [self.value(found[p], tensor.dtype) for p in need]
            value = torch.cat(values, 0) if gate_up else values[0]
            if tuple(value.shape) == tuple(tensor.shape[1:]):
                tensor[e].copy_(value)
            elif tuple(value.shape[::-1]) == tuple(tensor.shape[1:]):
                tensor[e].copy_(value.t())
            else:
                raise CheckpointError(f"{found[0].name}: expert weight {list(value.shape)} does not fit the model's "
                                      f"{target} {list(tensor.shape)}")

    def _fill_expert_in_place(self, found: dict, need: tuple, out: torch.Tensor) -> bool:
        """Decode MXFP4 parts (gate rows, then up rows) straight into expert ``out`` [rows, K] when they tile it
        untransposed; False (nothing written) otherwise."""
        parts = [found[p] for p in need]
        if out.dtype != torch.bfloat16 or not out.is_contiguous() or any(p.kind != "mx" for p in parts):
            return False
        if sum(p.unit.rows for p in parts) != out.shape[0] or any(p.unit.cols != out.shape[1] for p in parts):
            return False
        row = 0
        for p in parts:
            self._mx(p.unit, out.dtype, out=out[row:row + p.unit.rows])
            row += p.unit.rows
        return True


class _Cancelled(Exception):
    """A fill stopped by :attr:`WeightLoader.cancel`."""


def mx_dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, name: str,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """MXFP4 codes [N, K/2] + E8M0 scales [N, K/32] -> [N, K] in ``dtype``, exact, on the codes' device.

    bf16 holds every MXFP4 value e2m1 * 2^(code-127) that float32 holds (same exponent range; 2^-128 is a bf16
    subnormal), so for bf16 each pair of bytes is looked up as its four bf16 values (a 65536-entry table, low
    nibble first) and multiplied in place by the power of two in bf16: the numbers of
    ``MXFP4Tensor.dequantize()`` cast to bf16, in two passes instead of six, the same operations on the CPU and
    on a GPU. ``out``: a contiguous tensor of ``dtype`` and N*K elements on the codes' device to decode into
    (an expert of a parameter: no temporary copy). Other dtypes go through ``MXFP4Tensor.dequantize()``
    (float32). Scale code 255 (NaN) is refused, naming the tensor.
    """
    tensor = MXFP4Tensor.from_codes(codes, scales, name=name)  # checks shapes and NaN scales
    k = codes.shape[-1] * 2
    shape = (*codes.shape[:-1], k)
    if out is not None and (out.numel() != codes.numel() * 2 or out.dtype != dtype or not out.is_contiguous()
                            or out.device != codes.device):
        raise ValueError(f"{name}: cannot decode {list(shape)} into {out.dtype} {list(out.shape)} on {out.device}")
    if dtype != torch.bfloat16 or sys.byteorder != "little" or codes.shape[-1] % 2:
        value = tensor.dequantize().to(dtype)
        if out is None:
            return value
        out.copy_(value.reshape(out.shape))
        return out
    table = word_values(codes.device, torch.bfloat16).view(torch.int64).reshape(65536)
    words = codes.contiguous().view(torch.uint16).reshape(-1).to(torch.int32)
    if out is None:
        out = torch.empty(shape, dtype=torch.bfloat16, device=codes.device)
    torch.index_select(table, 0, words, out=out.view(-1).view(torch.int64))
    # from_codes has refused code 255 (NaN): every other E8M0 code is a power of two that bf16 holds
    out.view(*scales.shape, 32).mul_(scales.view(torch.float8_e8m0fnu).to(torch.bfloat16).unsqueeze(-1))
    return out.view(shape) if out.shape != shape else out


def decode_experts(codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, transposed: bool, name: str,
                   cancel: threading.Event | None = None) -> None:
    """MXFP4 expert stack: codes [E, N, K/2] + E8M0 scales [E, N, K/32] (any device) -> ``out`` [E, N, K], or
    [E, K, N] when ``transposed``, in place, by :func:`mx_dequantize` expert by expert on ``out``'s device.

    On a GPU the packed codes and scales (4.25 bits a weight) cross the bus once and are decoded there, not the
    16-bit values; on the CPU each expert decodes straight into its slot of ``out`` (each operation spread over
    torch's intra-op threads). A transposed ``out`` stored in the checkpoint's order (a [E, K, N] view of
    [E, N, K] memory: :func:`store_in_checkpoint_order`) is decoded straight into; another transposed one
    through one reused [N, K] buffer. The numbers are those of the CPU decode on every device (a table lookup
    and a multiplication by a power of two, both exact).
    ``cancel``: checked before each expert; when set, :class:`_Cancelled` is raised.
    """
    device = out.device
    codes, scales = codes.to(device), scales.to(device)
    e, n = codes.shape[0], codes.shape[1]
    direct = transposed and out[0].t().is_contiguous()
    buffer = torch.empty(n, codes.shape[2] * 2, dtype=out.dtype, device=device) if transposed and not direct else None
    for i in range(e):
        if cancel is not None and cancel.is_set():
            raise _Cancelled
        if direct:
            mx_dequantize(codes[i], scales[i], out.dtype, f"{name}[{i}]", out=out[i].t())
        elif transposed:
            out[i].copy_(mx_dequantize(codes[i], scales[i], out.dtype, f"{name}[{i}]", out=buffer).t())
        elif out[i].is_contiguous():
            mx_dequantize(codes[i], scales[i], out.dtype, f"{name}[{i}]", out=out[i])
        else:
            out[i].copy_(mx_dequantize(codes[i], scales[i], out.dtype, f"{name}[{i}]"))


def _rebuild_buffers(module: torch.nn.Module, cfg, device) -> None:
    """Recompute the non-persistent buffers (rotary tables) that ``to_empty`` left uninitialised: each owning
    submodule is built afresh from the config on the CPU and its buffers copied."""
    for name, sub in module.named_modules():
        transient = [b for b in sub._buffers if b in sub._non_persistent_buffers_set and sub._buffers[b] is not None]
        if not transient:
            continue
        try:
            fresh = type(sub)(cfg)
        except Exception as exc:  # noqa: BLE001 - any constructor failure: say which module
            raise CheckpointError(f"cannot rebuild the buffers of {name or type(sub).__name__} "
                                  f"({type(sub).__name__}: {exc})") from None
        for b in transient:
            sub._buffers[b] = fresh._buffers[b].to(device)
        for attr in ("attention_scaling",):
            if hasattr(fresh, attr):
                setattr(sub, attr, getattr(fresh, attr))


def store_in_checkpoint_order(module: torch.nn.Module) -> None:
    """Give ``module``'s transposed expert stacks (``is_transposed``: gpt-oss's [E, K, N] ``gate_up_proj`` and
    ``down_proj``, used as ``x @ W``) memory in the checkpoint's [E, N, K] order, still on the meta device: each
    parameter becomes the [E, K, N] transposed view of an [E, N, K] tensor, which ``to_empty`` keeps.

    The values and shapes are the model's; only the strides differ. ``x @ W`` then multiplies by an [N, K]
    matrix read transposed, the layout every BLAS runs fastest (on CPUs without bf16 matrix instructions a bf16
    [K, N] operand takes a path ~50x slower), and :func:`decode_experts` decodes each expert straight into it.
    """
    for _, sub in experts_modules(module):
        if not getattr(sub, "is_transposed", False):
            continue
        for name in ("gate_up_proj", "down_proj"):
            param = sub._parameters[name]
            if param.device.type != "meta":
                continue
            e, k, n = param.shape
            view = torch.empty(e, n, k, dtype=param.dtype, device="meta").transpose(1, 2)
            sub._parameters[name] = torch.nn.Parameter(view, requires_grad=param.requires_grad)


def materialize(module: torch.nn.Module, prefix: str, loader: WeightLoader, cfg, device) -> None:
    """Allocate ``module`` (on the meta device) on ``device`` and fill every tensor of its state dict from the
    checkpoint; a tensor with no source is refused, naming it."""
    module.to_empty(device=device)
    _rebuild_buffers(module, cfg, device)
    names = loader.sources.names()
    for key, tensor in module.state_dict(keep_vars=True).items():
        if loader.cancel.is_set():
            raise _Cancelled
        target = f"{prefix}{key}"
        if target not in names:
            raise CheckpointError(f"{loader.catalog.folder}: no tensor for the model's {target} (transformers' "
                                  f"{type(module).__name__} needs it to run)")
        owner = module.get_submodule(key.rpartition(".")[0]) if "." in key else module
        loader.fill(target, tensor, owner)


def float32_products(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a layer's bf16 matmuls (its Linears' and its experts') run as float32 ones rounded to bf16: on a
    CPU without bf16 matrix instructions (AVX512-BF16, AMX). There a bf16 GEMM converts its operands to float32 anyway and is ~5x slower
    than the float32 GEMM (18 against 92 GFLOP/s on a 2-core AVX2 EPYC, [256, 2880] x [2880, 5760]).

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


class HiddenStore:
    """The hidden states of every calibration batch: in memory while their total stays within ``budget`` bytes,
    then in files of a temporary folder (removed by :meth:`close`, also on Ctrl-C)."""

    def __init__(self, budget: int, device: torch.device):
        self.budget, self.device = budget, device
        self.memory: dict[int, torch.Tensor] = {}
        self.used = 0
        self.folder: Path | None = None
        self.on_disk: dict[int, tuple] = {}

    def put(self, index: int, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        old = self.memory.pop(index, None)
        if old is not None:
            self.used -= old.numel() * old.element_size()
        if index in self.on_disk or self.used + size > self.budget:
            if self.folder is None:
                self.folder = Path(tempfile.mkdtemp(prefix="fp4pass-calib-"))
            path = self.folder / f"{index}.bin"
            cpu = tensor.detach().to("cpu").contiguous()
            cpu.view(-1).view(torch.uint8).numpy().tofile(path)
            self.on_disk[index] = (tuple(cpu.shape), cpu.dtype)
            return
        self.memory[index] = tensor.detach()
        self.used += size

    def get(self, index: int) -> torch.Tensor:
        if index in self.memory:
            return self.memory[index]
        shape, dtype = self.on_disk[index]
        import numpy as np

        raw = torch.from_numpy(np.fromfile(self.folder / f"{index}.bin", dtype=np.uint8))
        return raw.view(dtype).reshape(shape).to(self.device)

    @property
    def spilled(self) -> int:
        return len(self.on_disk)

    def close(self) -> None:
        self.memory.clear()
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None


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


def hidden_budget(device: torch.device, requested: int | None) -> int:
    """Bytes of hidden states kept in memory: ``requested``, else half the free GPU memory on CUDA, else a
    quarter of the machine's available memory."""
    if requested is not None:
        return requested
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free // 2
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 4
    except (ValueError, OSError, AttributeError):
        return 4 << 30
