"""A checkpoint's model, built by transformers' own modeling code, and the loader that fills it from the shards.

Which model: ``config.json``'s ``model_type`` when transformers has that model type, else the first entry of
``architectures`` that transformers has (Kimi-K2 ships ``model_type: kimi_k2`` with ``architectures:
["DeepseekV3ForCausalLM"]``); neither is refused, naming the model type. The skeleton is built on the meta
device (no memory) with eager attention and the eager expert loop (the forms every backend agrees with).

Which weight goes where: each checkpoint name is renamed by transformers' own ``WeightRenaming`` rules for the
model type (DeepSeek-V4's native names ``layers.0.attn.wq_a`` -> ``layers.0.self_attn.q_a_proj``), without the
``model.`` prefix. Per-expert weights ``<layer>.experts.<e>.w1|gate_proj`` and ``w3|up_proj`` fill row halves
(gate first) of expert e of the model's ``<layer>.experts.gate_up_proj`` [E, 2I, H], ``w2|down_proj`` its
``down_proj`` [E, H, I] (what transformers' ``MergeModulelist`` + ``Concatenate`` converters do). MXFP4 weights
are dequantized with :mod:`fp4pass.checkpoint.layerwise.decode` (exact in bf16), a gpt-oss stack [E, N, K] into
the model's [E, K, N] parameter expert by expert; FP8 (E4M3) weights with 128x128 block scales are dequantized
too. :func:`materialize` allocates a module that is on the meta device and fills every tensor of it; the layer
runner (:mod:`fp4pass.checkpoint.layerwise.runner`) does so for one decoder layer at a time.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from fp4pass.safetensors.catalog import Catalog
from fp4pass.checkpoint.detect import FusedExperts, Linear
from fp4pass.checkpoint.forms import DOWN_NAMES, GATE_NAMES, STACK_PROJS, UP_NAMES, WEIGHT_SUFFIX, expert_parts
from fp4pass.checkpoint.layerwise.decode import LoadCancelled, decode_experts, mx_dequantize
from fp4pass.safetensors.files import CheckpointError

__all__ = ["resolve_architecture", "build_skeleton", "Source", "WeightSources", "WeightLoader", "experts_modules",
           "store_in_checkpoint_order", "materialize", "FP8_BLOCK"]

_FP8_DTYPES = ("F8_E4M3",)


def _expert_weight(name: str) -> tuple[str, int, str] | None:
    """(experts module, expert, projection) of one expert's gate, up or down ``.weight`` (transformers' names after
    the renames: ``model.layers.3.mlp.experts.12.gate_proj.weight``, or DeepSeek's ``w1``/``w3``/``w2``)."""
    if not name.endswith(WEIGHT_SUFFIX):
        return None
    parts = expert_parts(name[: -len(WEIGHT_SUFFIX)])
    return parts if parts and parts[2] in GATE_NAMES + UP_NAMES + DOWN_NAMES else None
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
            part = _expert_weight(target)
            if part:
                stack, e, proj = part
                gate_up = proj not in DOWN_NAMES
                tensor = f"{stack}.{STACK_PROJS[0] if gate_up else STACK_PROJS[1]}"
                out.experts.setdefault(tensor, {}).setdefault(e, {})[1 if proj in UP_NAMES else 0] = source
                if source.kind in ("mx", "decoded"):
                    out.quantized[source.name] = (stack, e, "gate_up" if gate_up else "down")
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
                raise LoadCancelled
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
            raise LoadCancelled
        target = f"{prefix}{key}"
        if target not in names:
            raise CheckpointError(f"{loader.catalog.folder}: no tensor for the model's {target} (transformers' "
                                  f"{type(module).__name__} needs it to run)")
        owner = module.get_submodule(key.rpartition(".")[0]) if "." in key else module
        loader.fill(target, tensor, owner)
