"""``--check``: read a converted checkpoint back with readers fp4pass did not write, and compare each expert.

Readers: the ``safetensors`` package opens every output shard; compressed-tensors 0.20 decodes the NVFP4
weights (``NVFP4PackedCompressor.decompress``, on CPU):

- ``--format compressed-tensors``: the module's ``weight_packed``, ``weight_scale``, ``weight_global_scale`` as
  written;
- ``--format modelopt``, one Linear: first through compressed-tensors' own ModelOpt reader
  (``ModelOptNvfp4Converter``, which renames ``weight`` and turns the multipliers ``weight_scale_2`` /
  ``input_scale`` into the divisors ``weight_global_scale`` / ``input_global_scale``), then decompressed;
- ``--format modelopt``, gpt-oss expert stacks: no reader knows that layout; each expert [K/2, N] is transposed
  back to [N, K/2] and decompressed with weight_global_scale = 1 / weight_scale_2.

The source is decoded independently of the conversion (numpy + ml_dtypes: E2M1 nibbles, E8M0 scales viewed as
bytes). Per expert (per Linear, or per expert of a stack): where the exponent spread of the blocks that hold a
value is at most 17 over the group that shares the global scale (and the method is not ``requant``), the
decoded values must equal the source exactly; elsewhere the squared error must be no larger than that of plain
NVFP4 requantization of the same values (ModelOpt's formulas, decoded by the same reader), with a relative
slack of 1e-3 for the reader's bf16 arithmetic.

A w1/w3 (gate/up) pair shares one global scale S (engines load it as one fused weight and keep w1's), so it is
compared as one group: sum_m ||y_m - x_m||^2 over both halves against plain requantization of both under one
S = amax(|x_w1|, |x_w3|) / (6 * 448), summed likewise. Each half's own bound would be wrong: under the pair's S
a w3 whose range lies far below w1's cannot reach the error of its own requantization. A pair written with two
different global scales fails as such. Each expert of a gpt-oss stack (ModelOpt's layout: one global scale for
the whole stack) is compared alone, against its plain requantization under one S from the whole stack's amax.

The result: ``{"passed", "reader", "experts_checked", "experts_identical", "failures": [...],
"decoded_in_float64": [...]}``; a pair's failure is named ``<expert>.w1+w3`` (the pair's own projection names)
and gives both halves' errors.

Where compressed-tensors cannot hold the values (its decode runs in bf16/float32): an expert whose source
reaches :data:`F32_HIGH` (E8M0 codes near 254: up to 6 * 2^127, past float32's largest) or holds a non-zero
magnitude below :data:`F32_LOW` (codes near 0: float32 subnormals, where bf16 keeps no precision), or whose
decode by the reader is not finite, is decoded here instead, in float64, from the bytes in the output file
(E2M1 nibbles, E4M3 block scales through ml_dtypes, the global scale as written): ``decoded_in_float64``
lists each such expert and why. Its requantization baseline is computed on the values scaled by a power of
two into float32's range (NVFP4 quantization commutes with such a scaling), and the error scaled back.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch

from fp4pass.checkpoint.detect import FusedExperts
from fp4pass.checkpoint.forms import CT_NVFP4, MODELOPT_LINEAR, MODELOPT_STACK
from fp4pass.checkpoint.output_forms import MODELOPT
from fp4pass.safetensors.files import CheckpointError
from fp4pass.errors import FP4PassError
from fp4pass.extras import require
from fp4pass.formats.constants import E2M1_VALUES, E8M0_BIAS, LOSSLESS_SPREAD
from fp4pass.progress import progress

__all__ = ["check_checkpoint", "decode_mxfp4"]

SLACK = 1e-3
#: a compressed-tensors role -> its name in the compressor's parameters (its tensor's suffix without the dot)
_CT_PARAM = {r.role: r.suffix[1:] for r in CT_NVFP4.roles}


def _linear_form(fmt: str):
    """The per-Linear form of an output written with ``--format fmt``."""
    return MODELOPT_LINEAR if fmt == MODELOPT else CT_NVFP4


#: source magnitudes from which compressed-tensors' bf16/float32 decode overflows (2^127: an E2M1 value of 2 or
#: more times an E8M0 scale of 2^127 is past float32's largest), and below which it loses precision (float32
#: subnormals)
F32_HIGH = 2.0**E8M0_BIAS  # the scale of E8M0 code 254
F32_LOW = float(np.finfo(np.float32).tiny)
E2M1 = np.array(E2M1_VALUES, dtype=np.float64)


def decode_mxfp4(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float64 [..., K] from packed codes uint8 [..., K/2] (low nibble first) and E8M0 bytes [..., K/32]."""
    nibbles = np.stack((codes & 0x0F, codes >> 4), axis=-1)  # [..., K/2, 2]: element order, low nibble first
    values = E2M1[nibbles].reshape(*scales.shape, 32)
    scale = scales.view(ml_dtypes.float8_e8m0fnu).astype(np.float64)
    return (values * scale[..., None]).reshape(*codes.shape[:-1], -1)


def _held_spread(codes: np.ndarray, scales: np.ndarray) -> int:
    """Exponent spread over the 32-blocks that hold a non-zero value (0 when none does)."""
    holds = ((codes & 0x77) != 0).reshape(*scales.shape, 16).any(-1)
    k = scales.astype(np.int64)[holds]
    return int(k.max() - k.min()) if k.size else 0


def decode_nvfp4(packed: np.ndarray, scales_e4m3: np.ndarray, multiplier: float) -> np.ndarray:
    """float64 [N, K] from packed E2M1 codes uint8 [N, K/2] (low nibble first), E4M3 block scales (their bytes,
    [N, K/16]) and the global multiplier: code * scale * multiplier, exact in float64 (no rounding: 4 + 4 + 24
    significant bits)."""
    nibbles = np.stack((packed & 0x0F, packed >> 4), axis=-1)  # [N, K/2, 2]: element order, low nibble first
    values = E2M1[nibbles].reshape(*scales_e4m3.shape, 16)
    scale = np.ascontiguousarray(scales_e4m3).view(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    return (values * scale[..., None] * float(multiplier)).reshape(packed.shape[0], -1)


def _why_float64(x: np.ndarray, y: np.ndarray) -> str | None:
    """Why the reader's decode ``y`` of the source values ``x`` cannot be compared (module docstring), or None."""
    magnitude = np.abs(x)
    top = float(magnitude.max())  # never empty: a weight with no element is refused before
    held = magnitude[magnitude > 0]
    low = float(held.min()) if held.size else None
    if top >= F32_HIGH:
        return f"source values up to {top:.6g} (E8M0 codes near 254): compressed-tensors' float32/bf16 overflows"
    if low is not None and low < F32_LOW:
        return (f"source values down to {low:.6g} (E8M0 codes near 0): below float32's normal range, where "
                "compressed-tensors' float32/bf16 loses them")
    if not np.isfinite(y).all():
        return "compressed-tensors' decode is not finite"
    return None


def _group_amax(xs: list[np.ndarray]) -> float:
    """max |x| over every member of a group that shares one global scale: what plain requantization of the group
    takes that scale from (never empty: a weight with no element is refused before)."""
    return max(float(np.abs(x).max()) for x in xs)


def _requant_sse_scaled(xs: list[np.ndarray], top: float) -> float:
    """:func:`_requant_sse` for values of any float64 range, decoded in float64: the group is scaled by one power
    of two 2^-p into float32's range, quantized, decoded and scaled back (the error by 4^p)."""
    from fp4pass.formats import NVFP4Tensor, global_scale_from_amax

    p = int(np.floor(np.log2(top))) if top > 0 else 0
    x = np.ldexp(np.concatenate(xs), -p)
    nv = NVFP4Tensor.quantize(torch.from_numpy(x).float(), global_scale=global_scale_from_amax(np.ldexp(top, -p)))
    y = decode_nvfp4(nv.codes.numpy(), nv.scales.view(torch.uint8).numpy(), float(nv.global_scale.reshape(())))
    return float(((y - x) ** 2).sum()) * 4.0**p


def _requant_sse(xs: list[np.ndarray], decode, amax: float) -> float:
    """SSE of plain NVFP4 quantization of a group ``xs`` (members [N_m, K]) under one global scale,
    S = ``amax`` / (6 * 448) (ModelOpt's formulas; ``amax`` the group's, :func:`_group_amax`, or a whole stack's),
    decoded by ``decode``, summed over the members."""
    from fp4pass.formats import NVFP4Tensor, global_scale_from_amax

    x = np.concatenate(xs)  # rows of every member: blocks never cross a row, so each member quantizes as alone
    nv = NVFP4Tensor.quantize(torch.from_numpy(x).float(), global_scale=global_scale_from_amax(amax))
    g = float(nv.global_scale.reshape(()))
    y = decode(nv.codes, nv.scales.view(torch.float8_e4m3fn), 1.0 / g)
    return float(((y - x) ** 2).sum())


class _Reader:
    def __init__(self):
        require("compressed_tensors", "checkpoint", "--check")
        from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
        from compressed_tensors.quantization import preset_name_to_scheme

        self.compressor = NVFP4PackedCompressor
        self.scheme = preset_name_to_scheme("NVFP4A16", ["Linear"])

    def decode(self, packed: torch.Tensor, scale_e4m3: torch.Tensor, global_divisor) -> np.ndarray:
        g = torch.as_tensor(global_divisor, dtype=torch.float32).reshape(1)
        # compressed-tensors' compression_param_names are the form's suffixes: weight_packed, weight_scale, ...
        params = {_CT_PARAM[role]: t for role, t in (("codes", packed), ("block_scales", scale_e4m3),
                                                     ("global_scale", g))}
        out = self.compressor.decompress(params, self.scheme)["weight"]
        return out.float().double().numpy()


def _modelopt_linear(f, module: str) -> dict:
    from compressed_tensors.entrypoints.convert import ModelOptNvfp4Converter

    names = [MODELOPT_LINEAR.tensor(module, role) for role in ("codes", "block_scales", "global_scale")]
    tensors = {name: f.get_tensor(name) for name in names}
    input_scale = MODELOPT_LINEAR.tensor(module, "input_scale")
    if input_scale in f.keys():
        tensors[input_scale] = f.get_tensor(input_scale)
    out = ModelOptNvfp4Converter(targets=["Linear"]).process(tensors)
    return {found[1].role: v for k, v in out.items() if (found := CT_NVFP4.split(k))}  # by role, in its form


def _compare(names: list[str], xs: list[np.ndarray], ys: list[np.ndarray], spread: int, reader: _Reader,
             result: dict, owns: list, stack_amax: float | None = None) -> None:
    """Compare one group that shares a global scale: a Linear, a w1/w3 pair, or one expert of a gpt-oss stack
    (``stack_amax``: the amax of the whole stack, whose one global scale the expert shares). ``names`` its
    modules, ``xs`` their source values, ``ys`` the reader's decodes of the output, ``owns`` their float64 decodes
    (:func:`decode_nvfp4`, used where the reader cannot hold the values); ``spread`` the exponent spread over
    everything that shares the scale. Within the lossless spread every member must be exact; beyond it the group
    is held to :func:`_compare_bound`."""
    result["experts_checked"] += len(names)
    if spread > result["exact_up_to_spread"]:
        _compare_bound(names, xs, ys, reader, result, owns, stack_amax)
        return
    for name, x, y, own in zip(names, xs, ys, owns):
        why = _why_float64(x, y)
        if why is not None:
            y = own()
            result["decoded_in_float64"].append({"expert": name, "why": why})
        if np.array_equal(x, y):
            result["experts_identical"] += 1
            continue
        bad = np.argwhere(x != y)[0]
        result["failures"].append({"expert": name, "reason": f"spread {spread} <= 17 but value at {bad.tolist()} is "
                                                             f"{float(y[tuple(bad)])!r}, source "
                                                             f"{float(x[tuple(bad)])!r}"})


def _compare_bound(names: list[str], xs: list[np.ndarray], ys: list[np.ndarray], reader: _Reader, result: dict,
                   owns: list, stack_amax: float | None = None) -> None:
    """The group's squared error sum_m ||y_m - x_m||^2 against plain NVFP4 requantization of its members under one
    global scale taken from the group's joint amax (amax over every member / (6 * 448): the scale requantization
    would choose for the group), summed over the members likewise. A single Linear is a group of one: its own
    amax; an expert of a gpt-oss stack is a group of one under the stack's amax (``stack_amax``). Where one member
    cannot be decoded by the reader (:func:`_why_float64`), or the shared amax is past float32's range, every
    member is decoded in float64 and the bound computed there too (only a member with its own reason is listed
    in ``decoded_in_float64``)."""
    amax = _group_amax(xs) if stack_amax is None else stack_amax
    whys = [_why_float64(x, y) for x, y in zip(xs, ys)]
    wide = any(why is not None for why in whys) or amax >= F32_HIGH or 0 < amax < F32_LOW
    if wide:
        ys = [own() for own in owns]
        result["decoded_in_float64"].extend({"expert": n, "why": w} for n, w in zip(names, whys) if w is not None)
    errors = [float(((y - x) ** 2).sum()) for x, y in zip(xs, ys)]
    group = _group_name(names)
    try:
        baseline = _requant_sse_scaled(xs, amax) if wide else _requant_sse(xs, reader.decode, amax)
    except FP4PassError as exc:
        raise CheckpointError(f"--check: expert {group}: plain requantization of its source (the baseline) "
                              f"failed: {exc}") from None
    sse = sum(errors)
    result["experts_identical"] += sum(e == 0 for e in errors)
    if not np.isfinite(sse):  # a NaN is above no bound: it would pass the comparison below
        name = next(n for n, e in zip(names, errors) if not np.isfinite(e))
        result["failures"].append({"expert": name, "reason": f"SSE {errors[names.index(name)]}: the output decodes "
                                                             "to values that are not finite"})
    elif sse > baseline * (1 + SLACK):
        result["failures"].append({"expert": group, "reason": _above_bound(names, errors, baseline,
                                                                           stack_amax is not None)})


def _group_name(names: list[str]) -> str:
    """One Linear's module name, or a pair's: ``layers.0.ffn.experts.10.w1+w3``."""
    parents = {n.rpartition(".")[0] for n in names}
    if len(names) == 1 or len(parents) != 1:
        return "+".join(names)
    return f"{parents.pop()}." + "+".join(n.rpartition(".")[2] for n in names)


def _above_bound(names: list[str], errors: list[float], baseline: float, in_stack: bool) -> str:
    if in_stack:
        return f"SSE {errors[0]:.6g} above plain requantization's {baseline:.6g} under the stack's global scale"
    if len(names) == 1:
        return f"SSE {errors[0]:.6g} above plain requantization's {baseline:.6g}"
    parts = ", ".join(f"{n.rpartition('.')[2]} {e:.6g}" for n, e in zip(names, errors))
    return (f"SSE {sum(errors):.6g} ({parts}) above plain requantization's {baseline:.6g} under the global scale "
            "the pair shares")


def check_checkpoint(catalog, found, out_dir, fmt: str, method: str = "auto",
                     show_progress: bool | None = None) -> dict:
    """Compare every converted expert of ``out_dir`` with its source in ``catalog`` (module docstring).

    ``method`` "requant" promises no exact expert: every one is held to the requantization bound.
    ``show_progress``: a bar over the converted units on stderr (:mod:`fp4pass.progress`; None: on a terminal);
    reading back takes about as long as the conversion.
    """
    reader = _Reader()
    safe_open = require("safetensors", "checkpoint", "--check").safe_open

    result = {"reader": "compressed-tensors NVFP4PackedCompressor" + (" via ModelOptNvfp4Converter"
                                                                     if fmt == MODELOPT else ""),
              "experts_checked": 0, "experts_identical": 0, "failures": [], "decoded_in_float64": [],
              "exact_up_to_spread": -1 if method == "requant" else LOSSLESS_SPREAD}
    index = {}
    handles = {}
    for path in sorted(out_dir.glob("*.safetensors")):
        handles[path.name] = safe_open(str(path), framework="pt")
        for key in handles[path.name].keys():
            index[key] = handles[path.name]
    for unit in progress(found.units, total=len(found.units), desc="check", enabled=show_progress, unit="unit"):
        if isinstance(unit, FusedExperts):
            _check_fused(unit, catalog, index, reader, result)
            continue
        members = list(unit) if isinstance(unit, tuple) else [unit]
        sources = [(catalog.read(m.codes.name).view(torch.uint8).reshape(m.rows, -1).numpy(),
                    catalog.read(m.scales.name).view(torch.uint8).reshape(m.rows, -1).numpy()) for m in members]
        spread = _held_spread(np.concatenate([c for c, _ in sources]), np.concatenate([s for _, s in sources]))
        files = [index[_linear_form(fmt).tensor(lin.module, "codes")] for lin in members]
        unequal = _unequal_global_scales(files, [lin.module for lin in members], fmt)
        if unequal is not None:
            result["experts_checked"] += len(members)
            result["failures"].append({"expert": _group_name([lin.module for lin in members]), "reason": unequal})
            continue
        _compare([lin.module for lin in members], [decode_mxfp4(codes, scales) for codes, scales in sources],
                 [_read_linear(f, lin.module, fmt, reader) for f, lin in zip(files, members)], spread, reader, result,
                 [_own_linear(f, lin.module, fmt) for f, lin in zip(files, members)])
    result["passed"] = not result["failures"]
    return result


def _check_fused(unit: FusedExperts, catalog, index, reader: _Reader, result: dict) -> None:
    p = unit.name
    f = index[p]
    codes_t = f.get_tensor(p)  # [E, K/2, N]
    scales_t = f.get_tensor(MODELOPT_STACK.tensor(p, "block_scales"))  # [E, K/16, N]
    divisor = 1.0 / f.get_tensor(MODELOPT_STACK.tensor(p, "global_scale")).float()
    src_codes = catalog.read(unit.codes.name).view(torch.uint8).reshape(unit.experts, unit.rows, -1).numpy()
    src_scales = catalog.read(unit.scales.name).view(torch.uint8).numpy()
    spread = _held_spread(src_codes, src_scales)
    multiplier = float(f.get_tensor(MODELOPT_STACK.tensor(p, "global_scale")).double())
    stack_amax = _mxfp4_amax(src_codes, src_scales)
    for e in range(unit.experts):
        packed, block = codes_t[e].t().contiguous(), scales_t[e].t().contiguous()
        y = reader.decode(packed, block, divisor)
        _compare([f"{p}[{e}]"], [decode_mxfp4(src_codes[e], src_scales[e])], [y], spread, reader, result,
                 [lambda: decode_nvfp4(packed.numpy(), block.view(torch.uint8).numpy(), multiplier)], stack_amax)


def _mxfp4_amax(codes: np.ndarray, scales: np.ndarray) -> float:
    """max |x| of MXFP4 values from their packed codes [..., K/2] and E8M0 bytes [..., K/32], without decoding
    them all: the largest E2M1 magnitude code of each block (magnitudes grow with the code) times its scale."""
    top = np.maximum(codes & 0x07, (codes >> 4) & 0x07).reshape(*scales.shape, 16).max(-1)
    return float((E2M1[top] * scales.view(ml_dtypes.float8_e8m0fnu).astype(np.float64)).max())


def _unequal_global_scales(files: list, modules: list[str], fmt: str) -> str | None:
    """Why the members of a group do not share one global scale as written, or None. Engines load a w1/w3 pair as
    one fused weight and keep w1's global scale for both, so a w3 written with another one decodes wrong there."""
    form = _linear_form(fmt)
    field = form.role("global_scale").suffix[1:]
    written = [f.get_tensor(form.tensor(m, "global_scale")).reshape(-1) for f, m in zip(files, modules)]
    if all(torch.equal(w, written[0]) for w in written[1:]):
        return None
    values = ", ".join(f"{m.rpartition('.')[2]} {float(w[0])!r}" for m, w in zip(modules, written))
    return (f"the pair is written with different {field}s ({values}): engines keep "
            f"{modules[0].rpartition('.')[2]}'s for both")


def _read_linear(f, module: str, fmt: str, reader: _Reader) -> np.ndarray:
    """The reader's decode of one Linear as written in the output (ModelOpt's through its converter)."""
    if fmt == MODELOPT:
        t = _modelopt_linear(f, module)
    else:
        t = {role: f.get_tensor(CT_NVFP4.tensor(module, role)) for role in ("codes", "block_scales", "global_scale")}
    return reader.decode(t["codes"], t["block_scales"], t["global_scale"])


def _own_linear(f, module: str, fmt: str):
    """The float64 decode of one Linear as written in the output (:func:`decode_nvfp4`), for :func:`_compare`."""
    def decode() -> np.ndarray:
        form = _linear_form(fmt)
        packed, block = f.get_tensor(form.tensor(module, "codes")), f.get_tensor(form.tensor(module, "block_scales"))
        stored = f.get_tensor(form.tensor(module, "global_scale")).double()
        if fmt == MODELOPT:
            multiplier = float(stored)
        else:
            multiplier = 1.0 / float(stored.reshape(()))
        return decode_nvfp4(packed.view(torch.uint8).numpy(), block.view(torch.uint8).numpy(), multiplier)
    return decode
