"""An NVFP4 checkpoint's weights, decoded the way an engine reads them, for the model's own forward.

Any writer's form (fp4pass, ModelOpt, llm-compressor), each by its own convention, with ``e2m1`` the packed
values (even element in the low nibble) and ``s`` the E4M3 block scale of each 16 along the input axis:

- ModelOpt (``M.weight``, ``M.weight_scale``, ``M.weight_scale_2``, ``M.input_scale``): the global scale is a
  MULTIPLIER, ``W = e2m1 * (s * weight_scale_2)``; activations are quantized with the global scale
  ``1 / input_scale``;
- compressed-tensors ``nvfp4-pack-quantized`` (``M.weight_packed``, ``M.weight_scale``,
  ``M.weight_global_scale``, ``M.input_global_scale``): the global scale is a DIVISOR,
  ``W = e2m1 * (s / weight_global_scale)`` (compressed-tensors' own ``_dequantize``); activations are
  quantized with the global scale ``input_global_scale``;
- ModelOpt's gpt-oss expert stacks (``P`` = ``...experts.gate_up_proj`` or ``...experts.down_proj``): ``P`` U8
  [E, K/2, N] and ``P_weight_scale`` [E, K/16, N] (the [E, N, .] bytes transposed), ``P_weight_scale_2`` and
  ``P_input_scale`` F32 [] (all experts) or [E] (one per expert), multipliers.

Activations (W4A4), as the engines compute them (vLLM's ``ref_nvfp4_quant`` emulation, compressed-tensors'
``fake_quantize`` with its NVFP4 scheme), with ``g`` the activation global scale above and ``a`` a block's
amax of 16 along the last axis::

    s = e4m3(min(g * (a / 6), 448))      (round to nearest even)
    y = rne_e2m1(clamp(x / (s / g), -6, 6)) * (s / g)       (a block whose s is 0 gives 0)

A checkpoint is W4A4 where input scales are stored and its config does not say weight-only (ModelOpt's
``quant_algo: W4A16_NVFP4``, or compressed-tensors groups whose ``input_activations`` are all null).
Decoded weights are rounded once to the model's dtype (bf16: a relative 2^-9, far below NVFP4's own step).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch

from fp4pass.safetensors.catalog import QUANT_CONFIG_NAME, Catalog, member_path, read_json_file
from fp4pass.checkpoint.forms import (CT_NVFP4, DIVISOR, E4M3_DTYPE, MODELOPT_LINEAR, MODELOPT_STACK, MULTIPLIER,
                                      stack_scale_pattern)
from fp4pass.safetensors.files import CheckpointError, TensorEntry
from fp4pass.formats.byte_tables import word_values
from fp4pass.formats.codecs import E2M1_MAX, E4M3_MAX, decode_e2m1
from fp4pass.formats.constants import NV_BLOCK_SIZE

__all__ = ["NVLinear", "NVExpertStack", "NVFP4Weights", "find_nvfp4", "decode_nvfp4", "fake_quantize_activation",
           "rne_e2m1_values", "MULTIPLIER", "DIVISOR"]

_STACK_SCALE = stack_scale_pattern()  # ``P_weight_scale``, ``P_weight_scale_2``, ``P_input_scale`` of a stack P
_STACK_ROLE = {r.suffix[1:]: r.role for r in MODELOPT_STACK.roles if r.suffix}  # "weight_scale_2" -> global_scale
_LINEAR_FORMS = (MODELOPT_LINEAR, CT_NVFP4)
_BLOCK_SCALES = MODELOPT_LINEAR.role("block_scales").suffix  # ".weight_scale", in both per-Linear forms
#: a global / input scale's suffix -> its convention, the multiplier (ModelOpt) first
_GLOBAL = {form.role("global_scale").suffix: form.convention for form in _LINEAR_FORMS}
_INPUT = {form.role("input_scale").suffix: form.convention for form in _LINEAR_FORMS}


def decode_nvfp4(codes: torch.Tensor, block_scales: torch.Tensor, global_scale: torch.Tensor, convention: str,
                 out: torch.Tensor | None = None, work: torch.Tensor | None = None) -> torch.Tensor:
    """[..., K] of packed E2M1 codes uint8 [..., K/2], E4M3 block-scale bytes [..., K/16] and a float32 global
    scale broadcastable to [...] (a multiplier or a divisor, as ``convention`` says): each pair of bytes looked up
    as its four values, each block of 16 multiplied by its scale ``s * g`` (or ``s / g``) formed in float32, the
    product rounded once to ``out``'s dtype (float32 when ``out`` is None; ``out``: contiguous, [..., K]).
    ``work``: with ``out``, a float32 buffer of at least as many elements as the result to decode in (reused from
    one expert to the next: no fresh pages each time)."""
    lead, half = codes.shape[:-1], codes.shape[-1]
    count = codes.numel() * 2
    buffer = work.view(-1)[:count].view(-1, 4) if out is not None and work is not None and work.numel() >= count \
        else None
    if sys.byteorder == "little":  # K/2 is a multiple of 8 (16 values a block): the bytes pair up
        words = codes.contiguous().view(torch.int16).reshape(-1).to(torch.int32) & 0xFFFF
        values = torch.index_select(word_values(codes.device), 0, words, out=buffer)
    else:
        values, buffer = decode_e2m1(torch.stack([codes & 0x0F, codes >> 4], -1).reshape(-1)), None
    s = block_scales.view(torch.float8_e4m3fn).float()
    g = global_scale.float()
    scale = (s * g if convention == MULTIPLIER else s / g).unsqueeze(-1)
    blocks = values.view(*lead, half * 2 // NV_BLOCK_SIZE, NV_BLOCK_SIZE).mul_(scale)
    if out is None:
        return blocks.reshape(*lead, half * 2)
    out.view(blocks.shape).copy_(blocks)
    return out


def fake_quantize_activation(x: torch.Tensor, global_scale: torch.Tensor | float) -> torch.Tensor:
    """``x`` [..., K] (K a multiple of 16) quantized to NVFP4 and back, in ``x``'s dtype (module docstring's
    formula; ``global_scale`` in compressed-tensors' convention: 1 / ModelOpt's ``input_scale``). A block
    holding NaN gives NaN (its amax, so its scale, is NaN); values beyond 6 steps saturate there."""
    g = torch.as_tensor(global_scale, dtype=torch.float32, device=x.device)
    blocks = x.float().reshape(*x.shape[:-1], x.shape[-1] // NV_BLOCK_SIZE, NV_BLOCK_SIZE)
    amax = blocks.abs().amax(-1, keepdim=True)
    s = (g * (amax / E2M1_MAX)).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn).float()
    step = s / g
    q = rne_e2m1_values((blocks / step).clamp(-E2M1_MAX, E2M1_MAX)) * step
    return q.masked_fill(step == 0, 0.0).reshape(x.shape).to(x.dtype)


def rne_e2m1_values(v: torch.Tensor) -> torch.Tensor:
    """float32 ``v`` with |v| <= 6 rounded to the nearest E2M1 value, ties to even: the grid 0, .5, 1, 1.5, 2, 3,
    4, 6 has the step 0.5 below 2, 1 below 4 and 2 above, and ``round(a / step) * step`` with ``torch.round``
    (halves to even) lands on an even grid point at a tie. NaN stays NaN. Equal to
    :func:`fp4pass.formats.codecs.round_e2m1` on every input in [-6, 6] (tests)."""
    a = v.abs()
    step = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))
    return torch.copysign(torch.round(a / step) * step, v)


def _scalar(read, entry: TensorEntry) -> torch.Tensor:
    value = read(entry.name).float().reshape(-1)
    if value.numel() != 1:
        raise CheckpointError(f"{entry.name}: {list(entry.shape)} holds {value.numel()} values; a per-tensor "
                              "scale holds one")
    return value[0]


class _Stored:
    """What an NVFP4 unit's stored tensors give: K from the packed codes' second axis (two values a byte), and the
    names of the tensors it consumes."""

    @property
    def cols(self) -> int:
        return int(self.codes.shape[1]) * 2

    @property
    def consumed(self) -> list[str]:
        return [e.name for e in (self.codes, self.block, self.global_, self.input) if e is not None]


@dataclass
class NVLinear(_Stored):
    """One NVFP4 Linear ``module`` [N, K]: its stored tensors and their convention."""

    module: str
    codes: TensorEntry
    block: TensorEntry
    global_: TensorEntry
    convention: str
    input: TensorEntry | None = None
    input_convention: str | None = None

    @property
    def rows(self) -> int:
        return int(self.codes.shape[0])

    def decode(self, read, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        codes = read(self.codes.name).view(torch.uint8).reshape(self.rows, self.cols // 2).to(device)
        block = read(self.block.name).view(torch.uint8).reshape(self.rows, self.cols // NV_BLOCK_SIZE).to(device)
        out = torch.empty(self.rows, self.cols, dtype=dtype, device=device)
        return decode_nvfp4(codes, block, _scalar(read, self.global_).to(device), self.convention, out=out)

    def activation_scale(self, read) -> torch.Tensor | None:
        """The activation global scale ``g`` (compressed-tensors' convention), or None when none is stored."""
        if self.input is None:
            return None
        value = _scalar(read, self.input)
        return 1.0 / value if self.input_convention == MULTIPLIER else value


@dataclass
class NVExpertStack(_Stored):
    """ModelOpt's gpt-oss expert stack ``prefix.proj``: codes [E, K/2, N], block scales [E, K/16, N], global
    and input scales (multipliers) [] or [E]."""

    prefix: str
    proj: str
    codes: TensorEntry
    block: TensorEntry
    global_: TensorEntry
    input: TensorEntry | None = None

    @property
    def name(self) -> str:
        return f"{self.prefix}.{self.proj}"

    @property
    def experts(self) -> int:
        return int(self.codes.shape[0])

    @property
    def rows(self) -> int:
        return int(self.codes.shape[2])

    def _per_expert(self, read, entry: TensorEntry) -> torch.Tensor:
        value = read(entry.name).float().reshape(-1)
        if value.numel() == 1:
            return value.expand(self.experts)
        if value.numel() != self.experts:
            raise CheckpointError(f"{entry.name}: {list(entry.shape)} is neither one scale nor one per expert "
                                  f"({self.experts})")
        return value

    def fill_stack(self, read, out: torch.Tensor, transposed: bool) -> None:
        """Decode every expert into ``out``: [E, N, K], or [E, K, N] when ``transposed`` (gpt-oss's ``x @ W``)."""
        e, n, k = self.experts, self.rows, self.cols
        if tuple(out.shape) != ((e, k, n) if transposed else (e, n, k)):
            raise CheckpointError(f"{self.codes.name}: experts {[e, n, k]} do not fit the model's {self.name} "
                                  f"{list(out.shape)}")
        codes = read(self.codes.name).view(torch.uint8).reshape(e, k // 2, n)
        block = read(self.block.name).view(torch.uint8).reshape(e, k // NV_BLOCK_SIZE, n)
        scale = self._per_expert(read, self.global_)
        work = torch.empty(n * k, dtype=torch.float32, device=out.device)
        for i in range(e):
            target = out[i].t() if transposed else out[i]  # [N, K]: contiguous where stored in checkpoint order
            direct = target.is_contiguous()
            w = decode_nvfp4(codes[i].t().contiguous().to(out.device), block[i].t().contiguous().to(out.device),
                             scale[i].to(out.device), MULTIPLIER, out=target if direct else None,
                             work=work if direct else None)
            if not direct:
                target.copy_(w)

    def activation_scale(self, read) -> torch.Tensor | None:
        """Per expert [E]: the activation global scale ``g`` (1 / input_scale), or None."""
        return None if self.input is None else 1.0 / self._per_expert(read, self.input)


@dataclass
class NVFP4Weights:
    """The NVFP4 modules of a checkpoint folder, shaped as :class:`fp4pass.checkpoint.detect.Detected` is for
    the layer runner: ``units`` (NVLinear | NVExpertStack), ``consumed`` (their tensor names)."""

    units: list
    consumed: set[str]
    form: str  # "modelopt" | "compressed-tensors"
    weight_only: bool  # the config says W4A16
    declined: list = field(default_factory=list)

    @property
    def activations(self) -> str:
        """"W4A4" when some module's inputs are quantized, else "W4A16"."""
        quantized = not self.weight_only and any(u.input is not None for u in self.units)
        return "W4A4" if quantized else "W4A16"

    def modules(self) -> dict[str, object]:
        return {(u.name if isinstance(u, NVExpertStack) else u.module): u for u in self.units}


def _weight_only(catalog: Catalog) -> bool:
    """Whether the folder's configs say weight-only NVFP4 (module docstring)."""
    qc = catalog.config.get("quantization_config")
    qc = qc if isinstance(qc, dict) else {}
    algos = [qc.get("quant_algo"), qc.get("moe_quant_algo")]
    path = member_path(catalog.folder, QUANT_CONFIG_NAME, catalog.follow_symlinks)
    if path.exists():
        hq = read_json_file(path, QUANT_CONFIG_NAME).get("quantization")
        algos.append(hq.get("quant_algo") if isinstance(hq, dict) else None)
    if any(isinstance(a, str) and a.upper() == "W4A16_NVFP4" for a in algos):
        return True
    groups = qc.get("config_groups")
    if qc.get("quant_method") == "compressed-tensors" and isinstance(groups, dict) and groups:
        return all(isinstance(g, dict) and not g.get("input_activations") for g in groups.values())
    return False


def find_nvfp4(catalog: Catalog) -> NVFP4Weights:
    """Every NVFP4 module of ``catalog`` (module docstring's forms); a module with packed U8 codes, E4M3 block
    scales and a global scale. Modules with a missing part are refused, naming the tensor."""
    tensors = catalog.tensors
    units: list = []
    stacks: dict[str, dict] = {}
    for name in tensors:
        match = _STACK_SCALE.match(name)
        if match:
            stacks.setdefault(match["p"], {})[_STACK_ROLE[match["what"]]] = tensors[name]
    for p, parts in stacks.items():
        codes = tensors.get(p)
        if codes is None or codes.dtype != "U8" or len(codes.shape) != 3:
            raise CheckpointError(f"{catalog.folder}: {MODELOPT_STACK.tensor(p, 'block_scales')} has no U8 "
                                  f"[E, K/2, N] stack {p}")
        for need in ("block_scales", "global_scale"):
            if need not in parts:
                raise CheckpointError(f"{catalog.folder}: the NVFP4 expert stack {p} has no "
                                      f"{MODELOPT_STACK.tensor(p, need)}")
        prefix, _, proj = p.rpartition(".")
        units.append(NVExpertStack(prefix, proj, codes, parts["block_scales"], parts["global_scale"],
                                   parts.get("input_scale")))
    forms = set()
    for name, entry in tensors.items():
        module = name[: -len(_BLOCK_SCALES)]
        if not name.endswith(_BLOCK_SCALES) or entry.dtype != E4M3_DTYPE or not module:
            continue
        codes = tensors.get(CT_NVFP4.tensor(module, "codes")) or tensors.get(MODELOPT_LINEAR.tensor(module, "codes"))
        if codes is None or codes.dtype != "U8":
            continue  # an FP8 block-scaled weight (F8 codes), not NVFP4
        found = [(tensors[module + s], c) for s, c in _GLOBAL.items() if module + s in tensors]
        if not found:
            raise CheckpointError(f"{catalog.folder}: the NVFP4 weight {codes.name} has no global scale "
                                  f"({' or '.join(module + s for s in _GLOBAL)})")
        (global_, convention), = found[:1]
        inputs = [(tensors[module + s], c) for s, c in _INPUT.items() if module + s in tensors]
        input_, input_convention = inputs[0] if inputs else (None, None)
        if len(codes.shape) != 2 or tuple(entry.shape) != (codes.shape[0], codes.shape[1] * 2 // NV_BLOCK_SIZE):
            raise CheckpointError(f"{codes.name}: codes {list(codes.shape)} do not match block scales "
                                  f"{entry.name} {list(entry.shape)} (expected [N, K/2] and [N, K/16])")
        units.append(NVLinear(module, codes, entry, global_, convention, input_, input_convention))
        forms.add("compressed-tensors" if convention == DIVISOR else "modelopt")
    if stacks:
        forms.add("modelopt")
    if not units:
        raise CheckpointError(f"{catalog.folder}: no NVFP4 weights found (packed U8 codes with E4M3 block scales "
                              "and a global scale)")
    consumed = {n for u in units for n in u.consumed}
    form = "compressed-tensors" if forms == {"compressed-tensors"} else "modelopt" if forms == {"modelopt"} \
        else "mixed"
    return NVFP4Weights(units, consumed, form, _weight_only(catalog))
