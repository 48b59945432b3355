"""The quantized modules of a folder, found from their scale tensors, and their scales read from the shards.

Only the headers and the scales are read, never the weights' codes: the scalar global and input scales in full,
and at most :data:`BLOCK_SAMPLE_BYTES` of each block-scale tensor (evenly spread, from its first byte to its last),
so a 120B checkpoint is checked in seconds. A module whose sample would make a magnitude finding has its whole
block-scale tensor read (and its w1/w3 partner's), so that finding rests on every block scale.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import torch

from fp4pass.checkpoint.forms import (CT_NVFP4, DIVISOR, E4M3_DTYPE, EXPERT, GATE_NAMES, MODELOPT_LINEAR,
                                      MODELOPT_STACK, MULTIPLIER, NVFP4_SUFFIXES, UP_NAMES, Form, block_precision,
                                      stack_scale_pattern)
from fp4pass.safetensors.files import CheckpointError, TensorEntry
from fp4pass.checkpoint.validate.reading import Folder
from fp4pass.formats.constants import E2M1_MAX, E4M3_MAX_CODE

__all__ = ["Module", "find_modules", "read_scales", "read_exact_blocks", "partner_name", "usable_multipliers",
           "BLOCK_SAMPLE_BYTES", "WEIGHT_AMAX_RANGE", "FOLDED_BLOCK_MAX"]

BLOCK_SAMPLE_BYTES = 16384  # per block-scale tensor: 4 evenly spread pieces of 4 KiB (all of a smaller one)
_PIECES = 4
WEIGHT_AMAX_RANGE = (2.0 ** -14, 2.0 ** 10)
_E4M3_NAN = E4M3_MAX_CODE + 1  # 0x7F: the magnitude bits of E4M3FN's NaN, and their mask
_E4M3_SIGN = 0x80
FOLDED_BLOCK_MAX = 16.0
_STACK_SCALE = stack_scale_pattern()  # ModelOpt's gpt-oss stack: ``P_weight_scale``, ``P_weight_scale_2``, ...
#: a role of forms.py -> the Module attribute that holds its tensor
_ATTRIBUTE = {"block_scales": "block", "global_scale": "global_", "input_scale": "input"}


@dataclass
class Module:
    """A quantized module: a Linear (per expert or dense) or a gpt-oss fused expert stack."""

    name: str
    layout: str  # "linear" | "fused-experts"
    codes: TensorEntry | None = None
    block: TensorEntry | None = None
    global_: TensorEntry | None = None
    input: TensorEntry | None = None
    convention: str | None = None  # "multiplier" (ModelOpt) | "divisor" (compressed-tensors)
    global_value: np.ndarray | None = None  # as stored
    input_value: np.ndarray | None = None
    block_max: float | None = None  # the sample's largest finite block scale
    extra: dict = field(default_factory=dict)

    @property
    def form(self) -> Form:
        """The form its tensors are named by: ModelOpt's gpt-oss stack, compressed-tensors (a divisor), ModelOpt."""
        if self.layout == "fused-experts":
            return MODELOPT_STACK
        return CT_NVFP4 if self.convention == DIVISOR else MODELOPT_LINEAR

    def to_json(self) -> dict:
        out = {"module": self.name, "layout": self.layout}
        if self.codes is not None:
            out["weight"] = self.codes.name
            out["weight_shape"] = list(self.codes.shape)
        if self.convention:
            out["convention"] = self.convention
        for key, value in (("global_scale", self.global_value), ("input_scale", self.input_value)):
            if value is not None and value.size:
                out[key] = float(value.reshape(-1)[0]) if value.size == 1 else [float(v) for v in value.reshape(-1)]
        if self.block_max is not None:
            out["block_scale_max"] = self.block_max
        return out


def find_modules(tensors: dict[str, TensorEntry]) -> dict[str, Module]:
    """Every quantized module, from its scale tensors (a module with no scale tensor is not NVFP4)."""
    modules: dict[str, Module] = {}
    for name, entry in tensors.items():
        stack = _STACK_SCALE.match(name)
        if stack:
            mod = modules.setdefault(stack["p"], Module(stack["p"], "fused-experts", convention=MULTIPLIER))
            role = next(r.role for r in MODELOPT_STACK.roles if r.suffix == "_" + stack["what"])
            setattr(mod, _ATTRIBUTE[role], entry)
            continue
        prefix, _, suffix = name.rpartition(".")
        if suffix not in NVFP4_SUFFIXES or not prefix:
            continue
        role, convention = NVFP4_SUFFIXES[suffix]
        mod = modules.setdefault(prefix, Module(prefix, "linear"))
        setattr(mod, _ATTRIBUTE[role], entry)
        if convention:
            if mod.convention and mod.convention != convention:
                mod.extra["mixed"] = True
            mod.convention = mod.convention or convention
    for mod in modules.values():
        if mod.layout == "fused-experts":
            mod.codes = tensors.get(mod.name)
        else:
            packed = CT_NVFP4.tensor(mod.name, "codes")
            mod.codes = tensors.get(packed) or tensors.get(MODELOPT_LINEAR.tensor(mod.name, "codes"))
            if mod.convention is None:
                mod.convention = DIVISOR if packed in tensors else MULTIPLIER
    # a block scale alone is not NVFP4 (FP8 block-quantized weights carry a weight_scale too, and
    # compressed-tensors' MXFP4 has the same weight_packed + weight_scale names): keep a module when its block
    # scale is E4M3 beside packed U8 codes, or it has an NVFP4 global scale. An E8M0 (U8) block scale without a
    # global scale is an MXFP4 weight, decided by its dtype, not its names.
    out = {}
    for name, mod in modules.items():
        nvfp4_codes = mod.codes is not None and mod.codes.dtype == "U8"
        fp8_weight = mod.codes is not None and mod.codes.dtype.startswith("F8")
        mxfp4_block = mod.block is not None and block_precision(mod.block.dtype) == "mxfp4"
        if (fp8_weight or mxfp4_block) and mod.global_ is None:
            continue
        if mod.global_ is not None or (nvfp4_codes and mod.block is not None) or mod.layout == "fused-experts":
            out[name] = mod
    return out


_E4M3_TABLE = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float64).numpy()
_SCALAR_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "BF16": None}
_SCALAR_LIMIT = 1 << 20  # a "scalar" scale of more bytes is a shape problem, not read
_RUN_GAP = 1 << 16  # scalars this close in a shard are read with one pread


def _pread(fd: int, size: int, offset: int, shard: str) -> bytes:
    parts, done = [], 0
    while done < size:
        got = os.pread(fd, size - done, offset + done)
        if not got:
            raise CheckpointError(f"{shard}: truncated while reading its scales (the file shrank)")
        parts.append(got)
        done += len(got)
    return b"".join(parts)


def _decode_scalar(raw: bytes, dtype: str) -> np.ndarray:
    if dtype == "BF16":
        return (np.frombuffer(raw, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return np.frombuffer(raw, dtype=_SCALAR_DTYPES[dtype]).astype(np.float64)


def _sample_pieces(nbytes: int) -> list[tuple[int, int]]:
    """(offset, size) of the block-scale bytes sampled from a tensor of ``nbytes``: all of it up to
    :data:`BLOCK_SAMPLE_BYTES`, else :data:`_PIECES` pieces evenly spread from its first byte to its last (the
    last piece ends at the tensor's end: its last rows are always read)."""
    if nbytes <= BLOCK_SAMPLE_BYTES:
        return [(0, nbytes)]
    piece = BLOCK_SAMPLE_BYTES // _PIECES
    last = nbytes - piece
    return [(k * last // (_PIECES - 1), piece) for k in range(_PIECES)]


def read_scales(folder: Folder, modules: dict[str, Module]) -> None:
    """Every module's global and input scales (decoded to float64) and a sample of its E4M3 block scales (at most
    :data:`BLOCK_SAMPLE_BYTES`, in evenly spread pieces), shard by shard with one descriptor each and scalars that
    lie together in one read: a per-expert 120B checkpoint has ~28,000 scalars."""
    wanted: dict[str, tuple[list, list]] = {}
    for mod in modules.values():
        for entry, attr in ((mod.global_, "global_value"), (mod.input, "input_value")):
            if entry is not None and entry.dtype in _SCALAR_DTYPES and entry.nbytes <= _SCALAR_LIMIT:
                wanted.setdefault(entry.shard, ([], []))[0].append((entry, mod, attr))
        if mod.block is not None and mod.block.dtype == E4M3_DTYPE and mod.block.nbytes:
            wanted.setdefault(mod.block.shard, ([], []))[1].append(mod)
    for shard_name, (scalars, blocks) in wanted.items():
        shard = folder.shards[shard_name]
        with shard.opened() as fd:
            scalars.sort(key=lambda item: item[0].begin)
            i = 0
            while i < len(scalars):
                j, start, end = i + 1, scalars[i][0].begin, scalars[i][0].end
                while j < len(scalars) and scalars[j][0].begin - end <= _RUN_GAP and scalars[j][0].end - start <= \
                        _SCALAR_LIMIT:
                    end = max(end, scalars[j][0].end)
                    j += 1
                raw = _pread(fd, end - start, start, shard_name)
                for entry, mod, attr in scalars[i:j]:
                    setattr(mod, attr, _decode_scalar(raw[entry.begin - start:entry.end - start], entry.dtype))
                i = j
            for mod in blocks:
                entry = mod.block
                raw = b"".join(_pread(fd, size, entry.begin + offset, shard_name)
                               for offset, size in _sample_pieces(entry.nbytes))
                # on the bytes: E4M3FN 0x7F/0xFF are NaN, bit 7 the sign, and positive codes 0x00..0x7E are
                # ordered as their values, so the largest such code is the largest block scale
                codes = np.frombuffer(raw, dtype=np.uint8)
                magnitude = codes & _E4M3_NAN
                nan = int(np.count_nonzero(magnitude == _E4M3_NAN))
                negative = int(np.count_nonzero((codes >= _E4M3_SIGN) & (magnitude != 0) & (magnitude != _E4M3_NAN)))
                positive = codes[codes < _E4M3_NAN]
                mod.extra["block_sample"] = (codes.size, nan, negative,
                                             float(_E4M3_TABLE[positive.max()]) if positive.size else None)
                mod.block_max = mod.extra["block_sample"][3]


_EXACT_CHUNK = 1 << 24  # bytes of block scales read at a time where a whole tensor is read
#: E4M3 subnormal codes that are not powers of two (3, 5, 6, 7 x 2^-9): a block scale rounded onto them is up to
#: 25% off, where 2^-9, 2^-8 and 2^-7 (codes 1, 2, 4, which a lossless conversion writes) are exact
_LOSSY_SUBNORMALS = np.array([3, 5, 6, 7], dtype=np.uint8)


def read_exact_blocks(folder: Folder, modules: dict[str, Module]) -> None:
    """Every block scale of each module whose magnitudes its sample would call wrong (and of its w1/w3 partner,
    which shares its global scale): the largest block scale per expert and the lossy subnormals per expert, so
    that a magnitude finding rests on the whole tensor, never on a sample. Other modules keep their sample."""
    suspects = {name for name, mod in modules.items() if _magnitude_suspect(mod)}
    suspects |= {partner for name in suspects if (partner := partner_name(name)) in modules}
    by_shard: dict[str, list[Module]] = {}
    for name in sorted(suspects):
        mod = modules[name]
        if mod.block is not None and mod.block.dtype == E4M3_DTYPE and mod.block.nbytes and \
                "block_sample" in mod.extra:
            by_shard.setdefault(mod.block.shard, []).append(mod)
    for shard_name, mods in by_shard.items():
        with folder.shards[shard_name].opened() as fd:
            for mod in mods:
                _read_block_census(fd, mod, shard_name)


def usable_multipliers(mod: Module) -> np.ndarray | None:
    """The module's global scale(s) read as multipliers, or None when one is not a finite positive number."""
    values = mod.global_value
    if values is None or not values.size or not (np.isfinite(values).all() and (values > 0).all()):
        return None
    values = values.reshape(-1)
    return values if mod.convention == MULTIPLIER else 1.0 / values


def _magnitude_suspect(mod: Module) -> bool:
    """Whether the sample's largest block scale, under any of the module's global scales, gives a folded scale
    (a multiplier of 1 over block scales at most :data:`FOLDED_BLOCK_MAX`) or a weight amax outside
    :data:`WEIGHT_AMAX_RANGE`."""
    multipliers = usable_multipliers(mod)
    sample = mod.extra.get("block_sample")
    if multipliers is None or sample is None or not sample[3]:
        return False
    amax = E2M1_MAX * sample[3] * multipliers
    folded = (multipliers == 1.0) & (sample[3] <= FOLDED_BLOCK_MAX)
    return bool(folded.any() or ((amax < WEIGHT_AMAX_RANGE[0]) | (amax > WEIGHT_AMAX_RANGE[1])).any())


def partner_name(name: str) -> str | None:
    """w3's name for w1's (gate_proj's for up_proj's, and the reverse), None for a module of no pair."""
    match = EXPERT.match(name)
    if not match or match["proj"] not in GATE_NAMES + UP_NAMES:
        return None
    i = (GATE_NAMES + UP_NAMES).index(match["proj"])
    other = (UP_NAMES + GATE_NAMES)[i]
    return f"{match['experts']}.{match['e']}.{other}"


def _read_block_census(fd: int, mod: Module, shard: str) -> None:
    """Read all of ``mod``'s E4M3 block scales, expert by expert where each expert has its own global scale (a
    stack [E, K/16, N] holds expert e's in its e-th contiguous slice): ``extra["expert_max"]`` the largest
    positive block scale of each (0 where none), ``extra["lossy_subnormals"]`` how many are lossy subnormals."""
    entry = mod.block
    experts = mod.global_value.size if mod.layout == "fused-experts" and mod.global_value is not None else 1
    experts = experts if experts > 1 and entry.nbytes % experts == 0 else 1
    size = entry.nbytes // experts
    maxima, lossy = np.zeros(experts), np.zeros(experts, dtype=np.int64)
    for e in range(experts):
        top = 0
        for start in range(0, size, _EXACT_CHUNK):
            codes = np.frombuffer(_pread(fd, min(_EXACT_CHUNK, size - start), entry.begin + e * size + start, shard),
                                  dtype=np.uint8)
            positive = codes[codes < _E4M3_NAN]
            top = max(top, int(positive.max()) if positive.size else 0)
            lossy[e] += int(np.isin(positive, _LOSSY_SUBNORMALS).sum())
        maxima[e] = _E4M3_TABLE[top]
    mod.extra["expert_max"], mod.extra["lossy_subnormals"] = maxima, lossy
    size_read, nan, negative, _ = mod.extra["block_sample"]
    mod.extra["block_sample"] = (size_read, nan, negative, float(maxima.max()))
    mod.block_max = float(maxima.max())
