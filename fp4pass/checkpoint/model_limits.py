"""What a checkpoint's ``config.json`` may ask of the calibration's model, checked before anything is allocated.

A downloaded checkpoint is hostile input: its config.json decides the sizes of the model that transformers
builds, and so the memory the layer runner allocates. Each rule is exit 2 naming the field (CheckpointError):

1. :func:`check_config_fields`, on config.json's own values (before transformers reads them: a gpt-oss config
   of ``num_hidden_layers`` 10^9 makes a list of 10^9 layer types): every count in :data:`COUNT_FIELDS` that
   is given is a whole number >= 1; ``num_attention_heads`` a multiple of ``num_key_value_heads``; the experts
   a token is routed to (:data:`TOP_K_FIELDS`) at most the experts there are (and, routed by groups, at most
   those of the ``topk_group`` groups it picks of ``n_group``); ``hidden_act`` an activation
   transformers has; with the shards' tensor names, ``num_hidden_layers`` at most the decoder layers they hold
   (the largest ``layers.<i>`` index + 1; every tensor counted when no name has one).
2. :func:`check_fits_shards`, on the model transformers builds from it (on the meta device: no memory): every
   tensor the layer runner fills has a source in the shards holding at least as many elements. A lie about a
   size (``vocab_size``, ``hidden_size``, ``intermediate_size``, an expert count) makes some tensor larger than
   what the shards hold for it; the field whose value gives the differing dimension is named. A model that
   transformers cannot even build from it (a size past what a tensor can hold) names its largest counts.
3. :func:`check_attention_memory`, on the calibration batches: eager attention holds a score per (row, head,
   query, key), ``B x heads x T x T`` of them, at :data:`ATTENTION_BYTES_PER_SCORE` bytes (the scores in bf16,
   their float32 softmax, its bf16 copy); more than the device has available is refused, saying which
   ``--seq-len`` (and batch size) fits.
"""

from __future__ import annotations

import contextlib
import math
import os
import re

import torch

from fp4pass.safetensors.files import CheckpointError

__all__ = ["check_config_fields", "check_fits_shards", "check_attention_memory", "attention_bytes",
           "available_bytes", "COUNT_FIELDS", "TOP_K_FIELDS", "EXPERT_COUNT_FIELDS", "ATTENTION_BYTES_PER_SCORE"]

#: config.json fields that count something the model is made of (when given and not null: a whole number >= 1)
COUNT_FIELDS = {"num_hidden_layers": "decoder layers", "num_attention_heads": "attention heads",
                "num_key_value_heads": "key/value heads", "hidden_size": "hidden features",
                "vocab_size": "vocabulary entries", "intermediate_size": "MLP features",
                "moe_intermediate_size": "expert features", "head_dim": "features per head",
                "num_experts_per_tok": "experts per token", "experts_per_token": "experts per token",
                "n_routed_experts": "experts", "num_local_experts": "experts", "num_experts": "experts",
                "n_group": "expert groups", "topk_group": "expert groups per token"}
#: the experts of a MoE layer (the first given), and the experts each token is routed to
EXPERT_COUNT_FIELDS = ("n_routed_experts", "num_local_experts", "num_experts")
TOP_K_FIELDS = ("num_experts_per_tok", "experts_per_token")
#: bytes per attention score of transformers' eager attention: the scores in bf16 (2), their softmax in
#: float32 (4), and that softmax cast back to bf16 (2), alive together
ATTENTION_BYTES_PER_SCORE = 8

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_config_fields(config: dict, where: str, tensors=None) -> None:
    """Rule 1 of the module docstring on ``config`` (config.json's dict); ``where``: the file, for messages;
    ``tensors``: the shards' tensor names (an iterable), when the folder is open."""
    for name, what in COUNT_FIELDS.items():
        value = config.get(name)
        if value is not None and (not _is_count(value) or value < 1):
            raise CheckpointError(f"{where}: {name} is {value!r}; it counts the model's {what}, so it must be a "
                                  "whole number of at least 1")
    heads, groups = config.get("num_attention_heads"), config.get("num_key_value_heads")
    if heads is not None and groups is not None and heads % groups:
        raise CheckpointError(f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads "
                              f"{groups} (each key/value head serves a whole group of query heads)")
    experts = next(((f, config[f]) for f in EXPERT_COUNT_FIELDS if config.get(f) is not None), None)
    for name in TOP_K_FIELDS:
        top_k = config.get(name)
        if experts is not None and top_k is not None and top_k > experts[1]:
            raise CheckpointError(f"{where}: {name} {top_k} is more than the {experts[1]} experts ({experts[0]}) a "
                                  "token can be routed to")
    if experts is not None:
        _check_groups(config, where, *experts)
    _check_activation(config, where)
    layers = config.get("num_hidden_layers")
    if tensors is not None and layers is not None:
        held = layers_held(tensors)
        if layers > held:
            raise CheckpointError(f"{where}: num_hidden_layers {layers}, but the shards hold {held} decoder "
                                  "layer(s): config.json does not describe these shards")


def _check_groups(config: dict, where: str, field: str, experts: int) -> None:
    """DeepSeek's grouped routing: the experts split into ``n_group`` equal groups, a token picks ``topk_group``
    of them and its ``num_experts_per_tok`` experts among theirs."""
    groups, picked = config.get("n_group"), config.get("topk_group")
    if groups is None:
        return
    if experts % groups:
        raise CheckpointError(f"{where}: {field} {experts} does not split into n_group {groups} equal groups")
    if picked is None:
        return
    if picked > groups:
        raise CheckpointError(f"{where}: topk_group {picked} is more than the n_group {groups} groups")
    top_k = config.get("num_experts_per_tok")
    reachable = picked * (experts // groups)
    if top_k is not None and top_k > reachable:
        raise CheckpointError(f"{where}: num_experts_per_tok {top_k} is more than the {reachable} experts of the "
                              f"topk_group {picked} groups a token picks ({experts} experts in n_group {groups})")


def layers_held(tensors) -> int:
    """The decoder layers that tensor names can hold: the largest ``layers.<i>`` index + 1, or, when no name has
    one, the number of tensors (each layer needs one at least)."""
    names = list(tensors)
    indices = [int(m.group(1)) for m in map(_LAYER.search, names) if m]
    return max(indices) + 1 if indices else len(names)


def _check_activation(config: dict, where: str) -> None:
    act = config.get("hidden_act")
    if act is None:
        return
    from transformers.activations import ACT2FN

    if not isinstance(act, str) or act not in ACT2FN:
        raise CheckpointError(f"{where}: hidden_act {act!r} is no activation transformers has (it has "
                              f"{', '.join(sorted(ACT2FN))})")


def _elements(shape) -> int:
    return math.prod(int(d) for d in shape)


def _source_shape(catalog, source) -> list[int]:
    """The shape a source holds: a tensor's own; a quantized Linear's [N, K] (MXFP4, or another form decoded);
    a gpt-oss stack's [E, N, K]."""
    unit = source.unit
    if source.kind in ("mx", "decoded"):
        return [unit.rows, unit.cols]
    if source.kind in ("fused", "decoded-stack"):
        return [unit.experts, unit.rows, unit.cols]
    return list(catalog.tensors[source.name].shape)


def _held(catalog, sources, key: str):
    """(elements, shape, source name) the shards hold for model tensor ``key``; None when they hold none. An
    expert stack of per-expert weights: [experts, rows of one expert's parts (gate + up), columns]."""
    if key in sources.experts:
        experts = list(sources.experts[key].values())
        parts = [s for expert in experts for s in expert.values()]
        one = [_source_shape(catalog, s) for s in experts[0].values()]
        shape = [len(experts), sum(rows for rows, *_ in one), one[0][-1]]
        return sum(_elements(_source_shape(catalog, s)) for s in parts), shape, parts[0].name
    source = sources.plain.get(key)
    if source is None:
        return None
    shape = _source_shape(catalog, source)
    return _elements(shape), shape, source.name


def _differing(wanted: list[int], held: list[int]) -> list[int]:
    """The dimensions of ``wanted`` that ``held`` lacks (as multisets)."""
    rest, out = list(held), []
    for d in wanted:
        if d in rest:
            rest.remove(d)
        else:
            out.append(d)
    return out


def _fields_behind(dims: list[int], config: dict) -> list[str]:
    """config.json's count fields whose value gives one of ``dims``: equal to it or half of it (a gate/up pair);
    else the larger factor of a product of two fields' values (heads x features per head)."""
    counts = {k: v for k, v in config.items() if _is_count(v) and v > 1}
    alone = [k for k, v in counts.items() if any(d in (v, 2 * v) for d in dims)]
    if alone:
        return alone
    values = set(counts.values())
    return [k for k, v in counts.items() if any(d % v == 0 and d // v in values and v >= d // v for d in dims)]


def _largest_counts(config: dict, many: int = 3) -> str:
    counts = sorted(((v, k) for k, v in config.items() if _is_count(v)), reverse=True)[:many]
    return ", ".join(f"{k} {v}" for v, k in counts) or "none"


def check_fits_shards(catalog, found, model_type: str, cfg) -> None:
    """Rule 2 of the module docstring: the decoder transformers builds from ``cfg`` (on the meta device) against
    the shards of ``catalog`` (``found``: its detected MXFP4 units), tensor by tensor, as the layer runner will
    fill it (:class:`~fp4pass.checkpoint.layerwise.model.WeightSources`)."""
    from fp4pass.checkpoint.layerwise.model import WeightSources, build_skeleton

    where = f"{catalog.folder}/config.json"
    try:
        _, base = build_skeleton(model_type, cfg)
    except CheckpointError:
        raise
    except (RuntimeError, ValueError, TypeError, OverflowError, ZeroDivisionError, KeyError, IndexError) as exc:
        raise CheckpointError(f"{where}: transformers cannot build the {model_type} model it describes ({exc}); "
                              f"its largest counts: {_largest_counts(catalog.config)}") from None
    sources = WeightSources.build(catalog, found, model_type)
    for key, tensor in base.state_dict(keep_vars=True).items():
        held = _held(catalog, sources, key)
        if held is None:
            raise CheckpointError(f"{catalog.folder}: no tensor for the model's {key} (transformers' "
                                  f"{model_type} model that config.json describes needs it to run)")
        elements, shape, name = held
        if tensor.numel() > elements:
            wanted = list(tensor.shape)
            fields = _fields_behind(_differing(wanted, shape), catalog.config)
            blame = ", ".join(f"{f} {catalog.config[f]}" for f in fields) if fields else "its sizes"
            raise CheckpointError(f"{where}: {blame}: the model it describes needs {key} {wanted} "
                                  f"({tensor.numel()} values), but the shards hold {shape} for it ({name}): "
                                  "config.json does not describe these shards")


def _small_text(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read(1 << 16)
    except OSError:
        return None


def _machine_bytes() -> int:
    """MemAvailable of ``/proc/meminfo`` (free memory plus what the page cache can give back), else the
    physical memory."""
    text = _small_text("/proc/meminfo") or ""
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            with contextlib.suppress(ValueError, IndexError):
                return int(line.split()[1]) * 1024
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1 << 62


def rlimit_headroom() -> int | None:
    """What RLIMIT_AS (``ulimit -v``) still lets this process map: its soft limit less the address space in use
    (VmSize of ``/proc/self/status``); None without a limit."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY or soft < 0:
        return None
    used = 0
    for line in (_small_text("/proc/self/status") or "").splitlines():
        if line.startswith("VmSize:"):
            with contextlib.suppress(ValueError, IndexError):
                used = int(line.split()[1]) * 1024
    return max(soft - used, 0)


def cgroup_headroom(root: str = "/sys/fs/cgroup", membership: str = "/proc/self/cgroup") -> int | None:
    """What this process's memory cgroup still allows: ``memory.max`` less ``memory.current`` (cgroup v2), or
    ``memory.limit_in_bytes`` less ``memory.usage_in_bytes`` (v1), the smallest over the cgroup and the ones
    above it; None where no limit is set or none can be read."""
    found: list[int] = []
    for line in (_small_text(membership) or "").splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            names, base = ("memory.max", "memory.current"), root
        elif "memory" in controllers.split(","):
            names, base = ("memory.limit_in_bytes", "memory.usage_in_bytes"), os.path.join(root, "memory")
        else:
            continue
        parts = [p for p in path.strip().split("/") if p]
        for depth in range(len(parts), -1, -1):
            folder = os.path.join(base, *parts[:depth])
            limit, usage = (_small_text(os.path.join(folder, name)) for name in names)
            try:
                limit_value = int(limit.strip()) if limit is not None else None
            except ValueError:
                limit_value = None  # "max": no limit at this level
            if limit_value is None or limit_value >= 1 << 60:
                continue
            try:
                used = int(usage.strip()) if usage is not None else 0
            except ValueError:
                used = 0
            found.append(max(limit_value - used, 0))
    return min(found) if found else None


def available_bytes(device: torch.device) -> int:
    """Memory the run may still take: the free GPU memory on CUDA; on the CPU, the least of the machine's
    MemAvailable (:func:`_machine_bytes`), what RLIMIT_AS still allows (:func:`rlimit_headroom`) and what the
    process's memory cgroup still allows (:func:`cgroup_headroom`, a container's memory.max): past either of
    the last two an allocation fails (MemoryError, or the kernel kills the process) though the machine has
    memory to spare."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    limits = [_machine_bytes(), rlimit_headroom(), cgroup_headroom()]
    return min(v for v in limits if v is not None)


def attention_bytes(rows: int, heads: int, tokens: int) -> int:
    """Bytes of one eager attention over a batch of ``rows`` sequences of ``tokens``:
    rows x heads x tokens x tokens x :data:`ATTENTION_BYTES_PER_SCORE`."""
    return rows * heads * tokens * tokens * ATTENTION_BYTES_PER_SCORE


def check_attention_memory(cfg, batches, device: torch.device, where: str, available: int | None = None) -> None:
    """Rule 3 of the module docstring for the largest batch (rows) and longest sequence of ``batches``;
    ``available``: bytes (default :func:`available_bytes` of ``device``)."""
    if not batches:
        return
    heads = int(getattr(cfg, "num_attention_heads", 1) or 1)
    rows = max(int(b.input_ids.shape[0]) for b in batches)
    tokens = max(int(b.input_ids.shape[1]) for b in batches)
    need = attention_bytes(rows, heads, tokens)
    available = available_bytes(device) if available is None else available
    if need <= available:
        return
    per_score = rows * heads * ATTENTION_BYTES_PER_SCORE
    fits_len = math.isqrt(available // per_score)
    fits_rows = available // attention_bytes(1, heads, tokens)
    hint = f"--seq-len {fits_len} fits" if fits_len >= 1 else "no --seq-len fits batches of that size"
    if fits_rows >= 1:
        hint += f", or batches of {fits_rows} sequence(s) of {tokens} (--batch-size; convert: --calib-batch-size)"
    raise CheckpointError(f"{where}: eager attention over {rows} sequence(s) of {tokens} tokens needs {rows} x "
                          f"{heads} heads x {tokens} x {tokens} x {ATTENTION_BYTES_PER_SCORE} bytes = "
                          f"{need / 2**30:.3g} GiB, more than the {available / 2**30:.3g} GiB available on "
                          f"{device.type}: {hint}")
