"""What the checkpoint diff checks before it reads a weight, and how it names what it finds in the checkpoint.

A downloaded NVFP4 folder is a stranger's input: its shard headers decide what the layer runner reads and
allocates. A header may declare a tensor of 8 GiB where the model needs 2 KiB, or block scales of another
shape than their codes; read as they are, the first allocates 8 GiB and the second fails deep in a reshape.
So :func:`check_stored_shapes` compares every tensor the runner will read, on both sides, with what the model
transformers builds from config.json needs (on the meta device: no memory), by the rules the runner fills it
with (:mod:`fp4pass.checkpoint.layerwise`), before anything is read: a mismatch is exit 2 naming the tensor,
its shape and the one expected. For an NVFP4 module of the model's ``[N, K]`` (``e2m1`` codes two a byte,
E4M3 block scales one per 16 inputs):

- a Linear (ModelOpt, compressed-tensors): codes ``[N, K/2]``, block scales ``[N, K/16]``, one global scale,
  at most one input scale;
- a gpt-oss expert stack of E experts: codes ``[E, K/2, N]``, block scales ``[E, K/16, N]`` (E4M3), global
  and input scales one or one per expert.

Scales that are NaN or infinite (:func:`nonfinite_scales`) are no bad input but a checkpoint that fails: the
diff runs and exits 1, naming the first layer and tensor where they appear.

:class:`CheckpointNames` gives a model module (``layers.1.self_attn.o_proj``) the name it has in the
checkpoint (``model.layers.1.self_attn.o_proj``; DeepSeek-V4's ``layers.1.attn.wo_b`` for
``layers.1.self_attn.o_b_proj``), so that what the diff reports can be looked up in the folder.
"""

from __future__ import annotations

import math
import re

import torch

from fp4pass.safetensors.files import CheckpointError
from fp4pass.formats.constants import NV_BLOCK_SIZE

__all__ = ["check_stored_shapes", "nonfinite_scales", "CheckpointNames"]

#: bytes of E4M3: an NVFP4 block scale's one dtype
_BLOCK_DTYPE = "F8_E4M3"
#: rows and columns of one FP8 block-scaled weight's scale
_FP8_BLOCK = 128
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _shape(entry) -> list[int]:
    return [int(d) for d in entry.shape]


def _refuse(entry, expected, what: str) -> CheckpointError:
    return CheckpointError(f"{entry.name}: shape {_shape(entry)}, but the model of config.json needs "
                           f"{list(expected)} ({what})")


def _check(entry, expected, what: str) -> None:
    if entry is not None and _shape(entry) != list(expected):
        raise _refuse(entry, expected, what)


def _check_scale(entry, counts: tuple[int, ...], what: str) -> None:
    """A global or input scale holds one value (or one per expert: ``counts``)."""
    if entry is not None and math.prod(_shape(entry)) not in counts:
        n = " or ".join(str(c) for c in dict.fromkeys(counts))
        raise CheckpointError(f"{entry.name}: shape {_shape(entry)} holds {math.prod(_shape(entry))} values, but "
                              f"the model of config.json needs {n} ({what})")


def _whole_blocks(k: int, entry, what: str) -> None:
    if k % NV_BLOCK_SIZE:
        raise CheckpointError(f"{entry.name}: {what} has {k} inputs, not a multiple of NVFP4's block of "
                              f"{NV_BLOCK_SIZE}: an NVFP4 checkpoint cannot hold it")


def _check_linear(unit, n: int, k: int, what: str) -> None:
    """An NVFP4 Linear (``decode``) or an MXFP4 one for a model weight [n, k]."""
    if hasattr(unit, "global_"):  # NVFP4
        _whole_blocks(k, unit.codes, what)
        _check(unit.codes, (n, k // 2), f"{what}: NVFP4 codes [N, K/2] of [{n}, {k}]")
        _check(unit.block, (n, k // NV_BLOCK_SIZE), f"{what}: block scales [N, K/16] of [{n}, {k}]")
        _check_scale(unit.global_, (1,), f"{what}: one global scale")
        _check_scale(unit.input, (1,), f"{what}: one input scale")
        return
    if [unit.rows, unit.cols] != [n, k]:
        raise _refuse(unit.codes, (n, k // 2), f"{what}: MXFP4 codes [N, K/2] of [{n}, {k}]")


def _check_stack(unit, e: int, n: int, k: int, what: str) -> None:
    """A gpt-oss expert stack for the model's [e, n, k] (checkpoint order)."""
    if not hasattr(unit, "global_"):  # MXFP4: the runner checks the whole before reading
        if [unit.experts, unit.rows, unit.cols] != [e, n, k]:
            raise _refuse(unit.codes, (e, n, k // 2), f"{what}: MXFP4 codes [E, N, K/2] of [{e}, {n}, {k}]")
        return
    _whole_blocks(k, unit.codes, what)
    _check(unit.codes, (e, k // 2, n), f"{what}: NVFP4 codes [E, K/2, N] of [{e}, {n}, {k}]")
    _check(unit.block, (e, k // NV_BLOCK_SIZE, n), f"{what}: block scales [E, K/16, N] of [{e}, {n}, {k}]")
    if unit.block.dtype != _BLOCK_DTYPE:
        raise CheckpointError(f"{unit.block.name}: {unit.block.dtype}, but NVFP4 block scales are {_BLOCK_DTYPE}")
    _check_scale(unit.global_, (1, e), f"{what}: one global scale, or one per expert")
    _check_scale(unit.input, (1, e), f"{what}: one input scale, or one per expert")


def _check_plain(catalog, source, shape: list[int], what: str) -> None:
    """A tensor read as it is (or an FP8 weight with its block scales) for the model's ``shape``: the same
    shape, or as many values where both have at most one dimension (the runner's rule)."""
    entry = catalog.tensors[source.name]
    held = _shape(entry)
    if held != shape and not (math.prod(held) == math.prod(shape) and len(held) <= 1 and len(shape) <= 1):
        raise _refuse(entry, shape, what)
    if source.kind == "fp8" and len(shape) == 2:
        blocks = [-(-d // _FP8_BLOCK) for d in shape]
        _check(catalog.tensors[source.scale], blocks, f"{what}: one FP8 scale per {_FP8_BLOCK}x{_FP8_BLOCK} block")


def _check_part(catalog, source, n: int, k: int, what: str) -> None:
    if source.kind in ("mx", "decoded"):
        _check_linear(source.unit, n, k, what)
    else:
        _check_plain(catalog, source, [n, k], what)


def _check_experts(catalog, parts: dict, key: str, shape: list[int], transposed: bool) -> None:
    """Per-expert weights of a model stack ``key`` [E, R, C]: each expert's parts (gate and up, or down), [R/2, C]
    or [R, C] each; [C/2, R] / [C, R] where the model keeps the stack transposed."""
    gate_up = key.endswith("gate_up_proj")
    need = (0, 1) if gate_up else (0,)
    count, rows, cols = shape
    n, k = (cols, rows) if transposed else (rows, cols)
    if n % len(need):
        raise CheckpointError(f"{catalog.folder}: the model's {key} {shape} cannot hold gate and up halves")
    for e in range(count):
        found = parts.get(e, {})
        missing = [p for p in need if p not in found]
        if missing:
            what = ("gate", "up")[missing[0]] if gate_up else "down"
            raise CheckpointError(f"{catalog.folder}: no {what} weight for expert {e} of {key}")
        for p in need:
            part = ("gate", "up")[p] if gate_up else "down"
            _check_part(catalog, found[p], n // len(need), k, f"expert {e}'s {part} of the model's {key} {shape}")


def check_stored_shapes(catalog, found, model_type: str, cfg) -> None:
    """Every tensor of ``catalog`` that the layer runner reads for the model of ``cfg`` (``found``: its quantized
    units, MXFP4 or NVFP4) has the shape the model needs (module docstring), checked on the headers alone."""
    from fp4pass.checkpoint.layerwise.model import WeightSources, build_skeleton

    _, base = build_skeleton(model_type, cfg)
    sources = WeightSources.build(catalog, found, model_type)
    for key, tensor in base.state_dict(keep_vars=True).items():
        owner = base.get_submodule(key.rpartition(".")[0]) if "." in key else base
        transposed = bool(getattr(owner, "is_transposed", False))
        shape = list(tensor.shape)
        if key in sources.experts:
            _check_experts(catalog, sources.experts[key], key, shape, transposed)
            continue
        source = sources.plain.get(key)
        if source is None:
            continue  # no source at all: check_fits_shards names it
        what = f"the model's {key} {shape}"
        if source.kind in ("fused", "decoded-stack"):
            e, rows, cols = shape
            n, k = (cols, rows) if transposed else (rows, cols)
            _check_stack(source.unit, e, n, k, what)
        elif source.kind in ("mx", "decoded"):
            _check_linear(source.unit, *shape, what)
        else:
            _check_plain(catalog, source, shape, what)


def layer_of(name: str) -> int | None:
    """The decoder layer a checkpoint name lies in (``...layers.<i>....``), or None."""
    match = _LAYER.search(name)
    return None if match is None else int(match.group(1))


def _describe(values: torch.Tensor) -> str:
    bad = values[~torch.isfinite(values)]
    first = float(bad[0])
    return "NaN" if math.isnan(first) else ("inf" if first > 0 else "-inf")


def nonfinite_scales(catalog, weights) -> list[dict]:
    """The global and input scales of ``weights`` (the NVFP4 units) that hold NaN or Inf, the first layer first:
    ``{"layer", "tensor", "found"}`` (``found``: NaN / inf / -inf, the first such value)."""
    found = []
    for unit in weights.units:
        for entry, what in ((unit.global_, "global scale"), (unit.input, "input scale")):
            if entry is None:
                continue
            values = catalog.read(entry.name).float().reshape(-1)
            if not torch.isfinite(values).all():
                found.append({"layer": layer_of(entry.name), "tensor": entry.name,
                              "found": f"{what} {_describe(values)}"})
    order = {name: i for i, name in enumerate(catalog.tensors)}
    found.sort(key=lambda p: (math.inf if p["layer"] is None else p["layer"], order.get(p["tensor"], 0)))
    return found


class CheckpointNames:
    """A model module's name in the checkpoint, from the layer runner's sources (``WeightSources``): where its
    first tensor comes from, less the same trailing parts."""

    def __init__(self, sources):
        self.sources = sources
        self._keys: dict[str, str] = {}  # model tensor -> its source, as a tensor name
        for key, source in sources.plain.items():
            self._keys[key] = source.name + (".weight" if source.kind in ("mx", "decoded") else "")

    @staticmethod
    def _strip(name: str, parts: int) -> str:
        """``name`` less its last ``parts`` dotted parts."""
        return name.rsplit(".", parts)[0]

    def module(self, path: str) -> str:
        """The checkpoint's name for model module ``path`` (base-model relative, e.g. ``layers.0``); ``path``
        itself when no tensor of the checkpoint feeds it."""
        for proj in ("gate_up_proj", "down_proj"):
            experts = self.sources.experts.get(f"{path}.{proj}")
            if experts:  # per-expert weights: the folder holding them
                return self._strip(self.expert(path, min(experts)), 1)
        head = path + "."
        for key, name in self._keys.items():
            tail = key.count(".") - path.count(".")
            if key.startswith(head) and name.count(".") >= tail:
                return self._strip(name, tail)
        return path

    def expert(self, stack: str, e: int) -> str:
        """The checkpoint module holding expert ``e`` of model stack ``stack``: its own (``...experts.3``), or the
        stack holding every expert (gpt-oss: ``...experts``, the expert an index along its first axis)."""
        for proj in ("gate_up_proj", "down_proj"):
            parts = self.sources.experts.get(f"{stack}.{proj}", {}).get(e)
            if parts:
                source = parts[min(parts)]
                name = source.name + (".weight" if source.kind in ("mx", "decoded") else "")
                return self._strip(name, 2)  # ...experts.<e>.w1.weight
        return self.module(stack)
