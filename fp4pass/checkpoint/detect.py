"""Which tensors of a checkpoint hold MXFP4 weights, in which of the three input forms, and how they group.

Forms, recognised from tensor names, dtypes and shapes (the config is not trusted for this):

- ``gpt-oss`` (Hugging Face naming): ``P_blocks`` uint8 [E, N, K/32, 16] + ``P_scales`` uint8 E8M0 [E, N, K/32]
  (a fused expert stack, rows = outputs, ``P`` e.g. ``model.layers.0.mlp.experts.gate_up_proj``; gate and up
  rows interleaved); a rank-3 ``M.weight_blocks`` [N, K/32, 16] is a dense Linear ``M``;
- ``compressed-tensors`` (``mxfp4-pack-quantized``): ``M.weight_packed`` uint8 [N, K/2] + ``M.weight_scale``
  uint8 E8M0 [N, K/32];
- ``deepseek`` (DeepSeek-V4 native): ``M.weight`` int8/uint8 packed E2M1 [N, K/2] + ``M.scale`` float8_e8m0fnu
  [N, K/32].

Packed bytes are the same in all three: two E2M1 codes per byte, the even element (along K) in the low nibble.
An E8M0 code is the exponent byte 2^(code-127), read as a byte, never cast as a number.

Grouping: ``w1``/``gate_proj`` and ``w3``/``up_proj`` of one module (same parent, same shape) form a pair
that shares one ``weight_scale_2`` and one ``input_scale``; every other weight is on its own. Expert modules
(``<layer>.experts.<e>.<proj>``) are grouped by layer and projection for filling missing input scales.

Declined: an MXFP4 weight that cannot be converted as a whole (codes without their scales tensor, codes and
scales whose shapes or dtypes do not fit, a DeepSeek expert ``.weight`` without its ``.scale`` where the config
or the other experts of its layer and projection say the experts are FP4), and the other half of a gate/up pair
one of whose halves is declined (the pair shares its scales: both or neither). ``convert`` refuses a checkpoint
with any decline unless asked to copy them in their source form (``allow_partial``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fp4pass.checkpoint.forms import (CT_MXFP4, CT_SHAPE_SUFFIX, DEEPSEEK_MXFP4, DOWN_NAMES, E8M0_DTYPES, EXPERT,
                                      GATE_NAMES, GPT_OSS_MXFP4, UP_NAMES, WEIGHT_SUFFIX, block_precision)
from fp4pass.safetensors.files import TensorEntry

__all__ = ["Linear", "FusedExperts", "Detected", "detect", "GPT_OSS", "COMPRESSED_TENSORS", "DEEPSEEK"]

GPT_OSS, COMPRESSED_TENSORS, DEEPSEEK = "gpt-oss", "compressed-tensors", "deepseek"
# the suffixes of the three MXFP4 input forms (fp4pass.checkpoint.forms)
_GPT_OSS_CODES, _GPT_OSS_SCALES = GPT_OSS_MXFP4.role("codes"), GPT_OSS_MXFP4.role("block_scales")
_CT_CODES, _CT_SCALES = CT_MXFP4.role("codes").suffix, CT_MXFP4.role("block_scales").suffix
_DEEPSEEK_CODES, _DEEPSEEK_SCALES = DEEPSEEK_MXFP4.role("codes"), DEEPSEEK_MXFP4.role("block_scales").suffix


def _layer_and_projection(module: str) -> tuple[str, str] | None:
    """(the module holding ``experts``, projection) of an expert's projection (``forms.EXPERT``), else None."""
    match = EXPERT.match(module)
    return (match["experts"].rpartition(".")[0], match["proj"]) if match else None


@dataclass
class Linear:
    """One MXFP4 weight [N, K] of module ``module``: source codes and scales, and the source names it replaces."""

    module: str
    form: str
    codes: TensorEntry
    scales: TensorEntry
    rows: int  # N (outputs)
    cols: int  # K (inputs)
    consumed: list[str] = field(default_factory=list)

    @property
    def role(self) -> str | None:
        last = self.module.rpartition(".")[2]
        return "gate" if last in GATE_NAMES else "up" if last in UP_NAMES else "down" if last in DOWN_NAMES else None

    @property
    def fill_group(self) -> tuple[str, str] | None:
        """(layer, projection kind) for experts: the experts whose input scales fill a missing one."""
        parts = _layer_and_projection(self.module)
        if not parts:
            return None
        role = self.role
        return parts[0], "gate_up" if role in ("gate", "up") else parts[1]


@dataclass
class FusedExperts:
    """A gpt-oss expert stack ``prefix.proj`` [E, N, K] (``_blocks`` + ``_scales``), one global scale for all."""

    prefix: str  # module, e.g. model.layers.0.mlp.experts
    proj: str  # gate_up_proj | down_proj
    codes: TensorEntry
    scales: TensorEntry
    experts: int
    rows: int
    cols: int
    form: str = GPT_OSS

    @property
    def name(self) -> str:
        return f"{self.prefix}.{self.proj}"

    @property
    def consumed(self) -> list[str]:
        return [self.codes.name, self.scales.name]


@dataclass
class Detected:
    """Conversion units in source order (a Linear, a (gate, up) pair of Linears, or FusedExperts); ``declined``:
    ``{"tensor", "shard", "reason"}`` of each MXFP4 weight left out (module docstring), in source order."""

    units: list
    consumed: set[str]
    declined: list[dict]
    forms: set[str]


def _decline(declined: list[dict], gone: set[str], entry: TensorEntry, module: str, reason: str) -> None:
    """Decline the codes ``entry`` of ``module`` (named in ``gone``, for its gate/up partner)."""
    declined.append({"tensor": entry.name, "shard": entry.shard, "reason": reason})
    gone.add(module)


def _ct_dtype_mismatch(codes: TensorEntry, scales: TensorEntry) -> str:
    """Why compressed-tensors names (``weight_packed`` + ``weight_scale``, shared by its MXFP4 and NVFP4
    forms) are not an MXFP4 weight: the dtypes decide, and the message names both what the names and what the
    dtypes say."""
    if block_precision(scales.dtype) == "nvfp4":
        return (f"weight_packed {codes.dtype} with weight_scale {scales.dtype}: the names are compressed-tensors' "
                f"(MXFP4 or NVFP4), the {scales.dtype} block scale is NVFP4's, not MXFP4's U8 E8M0: this weight "
                "is NVFP4 already (check the folder with fp4pass inspect)")
    return (f"weight_packed {codes.dtype} with weight_scale {scales.dtype}: the names are compressed-tensors' "
            "MXFP4 form, the dtypes are not (expected U8 codes with U8 E8M0 block scales)")


def _packed_mismatch(codes: TensorEntry, scales: TensorEntry) -> str | None:
    """Why packed codes [N, K/2] and E8M0 scales [N, K/32] do not fit; None when they do."""
    if len(codes.shape) != 2 or len(scales.shape) != 2 or codes.shape[0] != scales.shape[0] \
            or codes.shape[1] != scales.shape[1] * 16:
        return (f"packed codes {list(codes.shape)} do not match scales {scales.name!r} {list(scales.shape)} "
                "(expected [N, K/2] and [N, K/32])")
    return None


def detect(tensors: dict[str, TensorEntry], config: dict) -> Detected:
    """Find the MXFP4 weights of ``tensors`` (name -> entry, in file order)."""
    units_at: dict[str, object] = {}  # first source name -> unit, to keep file order
    consumed: set[str] = set()
    declined: list[dict] = []
    gone: set[str] = set()  # the modules declined
    forms: set[str] = set()
    linears: list[Linear] = []
    unscaled: list[TensorEntry] = []  # DeepSeek-form expert weights without a .scale
    for name, entry in tensors.items():
        if name.endswith(_GPT_OSS_CODES.suffix):
            base = name[: -len(_GPT_OSS_CODES.suffix)]
            module = base[: -len(WEIGHT_SUFFIX)] if base.endswith(WEIGHT_SUFFIX) else base
            scales = tensors.get(_GPT_OSS_SCALES.name(base))
            if scales is None:
                _decline(declined, gone, entry, module,
                         f"MXFP4 codes without their scales tensor {_GPT_OSS_SCALES.name(base)!r}")
                continue
            if entry.dtype not in _GPT_OSS_CODES.dtypes or scales.dtype not in E8M0_DTYPES:
                _decline(declined, gone, entry, module, f"blocks {entry.dtype} / scales {scales.dtype}: not uint8 "
                                                        "E2M1 codes with E8M0 scales")
                continue
            if len(entry.shape) < 3 or entry.shape[-1] != 16 or tuple(scales.shape) != tuple(entry.shape[:-1]):
                _decline(declined, gone, entry, module, f"gpt-oss blocks {list(entry.shape)} do not match scales "
                                                        f"{scales.name!r} {list(scales.shape)} (expected "
                                                        "[..., N, K/32, 16] and [..., N, K/32])")
                continue
            k = entry.shape[-2] * 32
            if len(entry.shape) == 4:
                prefix, _, proj = base.rpartition(".")
                unit = FusedExperts(prefix, proj, entry, scales, entry.shape[0], entry.shape[1], k)
                units_at[name] = unit
            elif len(entry.shape) == 3:
                linears.append(Linear(module, GPT_OSS, entry, scales, entry.shape[0], k, [name, scales.name]))
            else:
                _decline(declined, gone, entry, module, f"gpt-oss blocks of rank {len(entry.shape)}")
                continue
            consumed.update((name, scales.name))
            forms.add(GPT_OSS)
        elif name.endswith(_CT_CODES):
            module = name[: -len(_CT_CODES)]
            scales = tensors.get(module + _CT_SCALES)
            if scales is None:
                _decline(declined, gone, entry, module,
                         f"MXFP4 codes without their scales tensor {module + _CT_SCALES!r}")
                continue
            if entry.dtype not in CT_MXFP4.role("codes").dtypes or scales.dtype not in E8M0_DTYPES:
                _decline(declined, gone, entry, module, _ct_dtype_mismatch(entry, scales))
                continue
            mismatch = _packed_mismatch(entry, scales)
            if mismatch:
                _decline(declined, gone, entry, module, mismatch)
                continue
            rows, cols = entry.shape[0], entry.shape[1] * 2
            used = [name, scales.name] + [n for n in (module + CT_SHAPE_SUFFIX,) if n in tensors]
            linears.append(Linear(module, COMPRESSED_TENSORS, entry, scales, rows, cols, used))
            consumed.update(used)
            forms.add(COMPRESSED_TENSORS)
        elif name.endswith(_DEEPSEEK_CODES.suffix) and entry.dtype in _DEEPSEEK_CODES.dtypes:
            module = name[: -len(_DEEPSEEK_CODES.suffix)]
            scale_name = module + _DEEPSEEK_SCALES
            if scale_name not in tensors:
                if _layer_and_projection(module):
                    unscaled.append(entry)
                continue
            scales = tensors[scale_name]
            if scales.dtype not in E8M0_DTYPES:
                continue
            mismatch = _packed_mismatch(entry, scales)
            if mismatch:
                _decline(declined, gone, entry, module, mismatch)
                continue
            rows, cols = entry.shape[0], entry.shape[1] * 2
            linears.append(Linear(module, DEEPSEEK, entry, scales, rows, cols, [name, scale_name]))
            consumed.update((name, scale_name))
            forms.add(DEEPSEEK)
    _decline_unscaled_experts(unscaled, linears, _deepseek_fp4(config), declined, gone)
    order = {name: i for i, name in enumerate(tensors)}
    declined.sort(key=lambda d: order[d["tensor"]])  # the weights that cannot convert first, then their partners
    linears = _decline_partners(linears, declined, gone, consumed)
    for unit in _pairs(linears):
        first = unit[0] if isinstance(unit, tuple) else unit
        units_at[first.codes.name] = unit
    units = [units_at[k] for k in sorted(units_at, key=order.__getitem__)]
    return Detected(units, consumed, declined, forms)


def _decline_unscaled_experts(unscaled: list[TensorEntry], linears: list[Linear], fp4_config: bool,
                              declined: list[dict], gone: set[str]) -> None:
    """A DeepSeek-form expert ``.weight`` (int8/uint8) without its ``.scale`` is an MXFP4 expert missing its
    scales when the config says the experts are FP4, or when another expert of its layer and projection is a
    DeepSeek MXFP4 weight; else it is some other integer weight, copied as it is."""
    fp4_experts = {_layer_and_projection(lin.module) for lin in linears if lin.form == DEEPSEEK}
    for entry in unscaled:
        module = entry.name[: -len(_DEEPSEEK_CODES.suffix)]
        if fp4_config or _layer_and_projection(module) in fp4_experts:
            _decline(declined, gone, entry, module, f"MXFP4 expert weight without its scales tensor "
                                                    f"{module + _DEEPSEEK_SCALES!r}")


def _partner_name(module: str) -> str | None:
    parent, _, last = module.rpartition(".")
    for mine, other in ((GATE_NAMES, UP_NAMES), (UP_NAMES, GATE_NAMES)):
        if last in mine:
            name = other[mine.index(last)]
            return f"{parent}.{name}" if parent else name
    return None


def _decline_partners(linears: list[Linear], declined: list[dict], gone: set[str], consumed: set[str]) -> list:
    """The Linears left once those whose gate/up partner is a declined module (``gone``) are declined too: the
    pair shares one global scale and one input scale."""
    out = []
    for lin in linears:
        partner = _partner_name(lin.module)
        if partner in gone:
            declined.append({"tensor": lin.codes.name, "shard": lin.codes.shard,
                             "reason": f"the other half of its gate/up pair, {partner}, is declined (the pair shares "
                                       "one global scale and one input scale: both or neither)"})
            consumed.difference_update(lin.consumed)
        else:
            out.append(lin)
    return out


def _pairs(linears: list[Linear]) -> list:
    """Linears as units: (gate, up) tuples where both exist with one shape, else single Linears."""
    by_module = {lin.module: lin for lin in linears}
    used: set[str] = set()
    units: list = []
    for lin in linears:
        if lin.module in used:
            continue
        parent, _, last = lin.module.rpartition(".")
        partner = None
        if lin.role in ("gate", "up"):
            names = UP_NAMES if lin.role == "gate" else GATE_NAMES
            index = (GATE_NAMES if lin.role == "gate" else UP_NAMES).index(last)
            other = by_module.get(f"{parent}.{names[index]}" if parent else names[index])
            if other is not None and (other.rows, other.cols) == (lin.rows, lin.cols) and other.module not in used:
                partner = other
        if partner is None:
            units.append(lin)
            used.add(lin.module)
        else:
            gate, up = (lin, partner) if lin.role == "gate" else (partner, lin)
            units.append((gate, up))
            used.update((gate.module, up.module))
    return units


def _deepseek_fp4(config: dict) -> bool:
    """Whether config.json says the experts are FP4 (DeepSeek-V4: quant_method fp8 with expert_dtype fp4)."""
    quant = config.get("quantization_config")
    if not isinstance(quant, dict):
        return False
    return str(config.get("expert_dtype", quant.get("expert_dtype", ""))).lower() in ("fp4", "mxfp4")
