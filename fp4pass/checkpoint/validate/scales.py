"""Each quantized module's dtypes, shapes and scale values, the magnitudes they decode to, and the scales the
engines load for every expert and every w1/w3 pair.

Magnitudes. With ``s_max`` the largest block scale and ``g`` the global scale read as a multiplier, the largest
weight the checkpoint decodes to is ``6 x s_max x g``. A real weight's amax lies in [2^-14, 2^10]; a global
scale stored in the other convention gives ``6 x s_max / g`` instead, which for ModelOpt's ``g = amax / 2688``
is ~7e6 / amax (out of that range by orders of magnitude). So a scale whose stored reading is implausible while
its reciprocal reading is plausible is a divisor stored as a multiplier (or the reverse): an error when the
stored reading is outside even [2^-24, 2^20], else a guess. ``s_max`` is the largest over w1 and w3 of a pair
that shares ``g`` (the scale was made from the pair's amax), per expert where each has its own ``g``.
Activations: the amax ``2688 x input_scale`` must lie in [2^-12, 2^16] under the same test. A global scale of
exactly 1 over block scales at most 16 (448 is E4M3's top) some of which sit on E4M3's lossy subnormals (3, 5, 6
or 7 x 2^-9) means the global scale was folded into the E4M3 block scales: those blocks lost up to a quarter of
their value (power-of-two subnormals, which a lossless conversion writes, are exact and legal).
"""

from __future__ import annotations

import math

import numpy as np

from fp4pass.checkpoint.forms import (CT_NVFP4, DIVISOR, E4M3_DTYPE, EXPERT, GATE_NAMES, MODELOPT_LINEAR, MULTIPLIER,
                                      UP_NAMES)
from fp4pass.safetensors.files import TensorEntry
from fp4pass.checkpoint.validate.configs import Configs
from fp4pass.checkpoint.validate.kinds import Problem
from fp4pass.checkpoint.validate.tensors import FOLDED_BLOCK_MAX, WEIGHT_AMAX_RANGE, Module, usable_multipliers
from fp4pass.formats.constants import E2M1_MAX, NVFP4_AMAX_PER_GLOBAL_SCALE

__all__ = ["check_shapes", "check_values", "check_scalars_only", "check_presence", "check_pairs",
           "OWN_WEIGHT_AMAX_RANGE", "ACT_AMAX_RANGE"]

#: the weight amaxes no weight fp4pass converts can have (its own output's scale_convention guess is a writer bug
#: only outside these: a swapped global scale gives 2688^2 / amax, past 2^20 for every amax below 6.9)
OWN_WEIGHT_AMAX_RANGE = (2.0 ** -24, 2.0 ** 20)
ACT_AMAX_RANGE = (2.0 ** -12, 2.0 ** 16)


def check_shapes(mod: Module, problems: list[Problem]) -> bool:
    """dtype and shape rules of the module's form; False when the scales cannot be read as NVFP4."""
    ok = True

    def bad(tensor: str, what: str, fix: str) -> None:
        nonlocal ok
        ok = False
        problems.append(Problem("dtype_shape", f"{tensor}: {what}; the engine's loader refuses it (shape or dtype "
                                f"mismatch in weight_loader); fix: {fix}", module=mod.name, tensor=tensor))

    codes, block = mod.codes, mod.block
    codes_name = mod.form.tensor(mod.name, "codes")
    if codes is None:
        problems.append(Problem("missing_tensor", f"{codes_name}: missing, but the module has NVFP4 scales; the "
                                "engine builds an NVFP4 layer and finds no weight (\"was never loaded\", or "
                                "garbage); fix: write the packed E2M1 weight", module=mod.name, tensor=codes_name))
        ok = False
    if block is None:
        tensor = mod.form.tensor(mod.name, "block_scales")
        problems.append(Problem("missing_scale", f"{tensor}: missing; the engine's block scales stay uninitialised "
                                "(garbage output) or the load fails; fix: write the E4M3 block scales [N, K/16]",
                                module=mod.name, tensor=tensor))
        ok = False
    rank = 3 if mod.layout == "fused-experts" else 2
    if codes is not None and (codes.dtype != "U8" or len(codes.shape) != rank):
        bad(codes.name, f"{codes.dtype} {list(codes.shape)}, packed E2M1 needs U8 of rank {rank}",
            "two E2M1 codes per byte, uint8")
        codes = None
    if block is not None and (block.dtype != E4M3_DTYPE or len(block.shape) != rank):
        bad(block.name, f"{block.dtype} {list(block.shape)}, NVFP4 block scales are F8_E4M3 of rank {rank}",
            "float8_e4m3fn block scales (an E8M0/U8 scale is MXFP4, not NVFP4)")
        block = None
    if codes is not None and block is not None:
        if rank == 2:
            n, half = codes.shape
            want = [n, -(-2 * half // 16)]
            got = list(block.shape)
            layout = "[N, K/16] beside the weight's [N, K/2]"
        else:
            e, half, n = codes.shape
            want = [e, -(-2 * half // 16), n]
            got = list(block.shape)
            layout = "[E, K/16, N] beside the weight's [E, K/2, N]"
        if got != want:
            bad(block.name, f"shape {got}, expected {want} ({layout} {list(codes.shape)})",
                "block scales of one E4M3 per 16 weights along the input dimension")
    for entry, role in ((mod.global_, "global"), (mod.input, "input")):
        if entry is None:
            continue
        per_expert = mod.layout == "fused-experts" and codes is not None and math.prod(entry.shape) == codes.shape[0]
        if entry.dtype != "F32" or (math.prod(entry.shape) != 1 and not per_expert):
            bad(entry.name, f"{entry.dtype} {list(entry.shape)}, a {role} scale is one F32 ([] or [1])",
                "one float32 number")
    return ok


def _value_problems(mod: Module, entry: TensorEntry, values: np.ndarray, role: str, problems: list[Problem]) -> bool:
    """Zero, negative or non-finite scalar scales; True when every value is a usable positive number."""
    conv = MULTIPLIER if mod.convention == MULTIPLIER else DIVISOR
    what = "input scale" if role == "input" else "weight global scale"
    if role == "input":
        effect = ("the engine quantizes activations with 1/input_scale = inf: NaN output on the prompts that reach "
                  "this module (vLLM #45212)" if conv == MULTIPLIER else
                  "activations quantized with a zero or broken divisor: NaN or zero output")
        fix = ("a finite positive amax/2688 from calibration, or the largest over the layer's experts "
               "(what ModelOpt writes for experts calibration never reached)")
    else:
        effect = "every weight of the module dequantizes to 0, NaN or the wrong sign: the model's output is garbage"
        fix = "the finite positive global scale the block scales were made with"
    if conv == DIVISOR:
        fix = "the reciprocal of " + fix
    good = True
    # a zero the engine inverts (an input multiplier, any divisor) is inf, and inf x 0 is NaN
    zero_outcome = "nan" if role == "input" or conv == DIVISOR else "garbage"
    for kind, mask, adjective, outcome in (
            ("nonfinite_scale", ~np.isfinite(values), "NaN or infinite", "nan"),
            ("zero_scale", values == 0, "zero", zero_outcome),
            ("negative_scale", np.isfinite(values) & (values < 0), "negative", "garbage")):
        if mask.any():
            good = False
            problems.append(Problem(kind, f"{entry.name}: {what} ({conv}) is {adjective} "
                                    f"({_number(values[mask][0])}); {effect}; fix: {fix}", module=mod.name,
                                    tensor=entry.name, outcome=outcome))
    return good


def _number(value) -> str:
    """A number as a message shows it: ``0``, ``-0.5``, ``nan``, ``inf`` (never a numpy repr)."""
    return f"{float(value):.6g}"


def check_values(mod: Module, problems: list[Problem], partner: Module | None = None) -> None:
    """The scales :func:`read_scales` read: their values, then the magnitudes they decode to (with the w1/w3
    ``partner`` that shares the global scale)."""
    sample = mod.extra.pop("block_sample", None)
    if sample is not None:
        size, nan, neg, mod.block_max = sample
        if nan:
            problems.append(Problem("nonfinite_scale", f"{mod.block.name}: {nan} of {size} block scales read are "
                                    "NaN (E4M3 0x7F/0xFF); those blocks dequantize to NaN; fix: finite block scales "
                                    "(at most 448)", module=mod.name, tensor=mod.block.name))
        if neg:
            problems.append(Problem("negative_scale", f"{mod.block.name}: {neg} of {size} block scales read are "
                                    "negative; those blocks dequantize with the wrong sign; fix: non-negative block "
                                    "scales", module=mod.name, tensor=mod.block.name))
    global_ok = False
    if mod.global_value is not None and mod.global_value.size:
        global_ok = _value_problems(mod, mod.global_, mod.global_value, "global", problems)
    input_ok = False
    if mod.input_value is not None and mod.input_value.size:
        input_ok = _value_problems(mod, mod.input, mod.input_value, "input", problems)
    if global_ok and mod.block_max:
        _check_weight_magnitude(mod, problems, partner)
    if input_ok:
        _check_input_magnitude(mod, problems)


def _inside(value: float, bounds: tuple[float, float]) -> bool:
    return bounds[0] <= value <= bounds[1]


def _check_weight_magnitude(mod: Module, problems: list[Problem], partner: Module | None = None) -> None:
    """The weight amax ``6 x s_max x g`` each global scale decodes to (per expert where each has its own), from
    every block scale where :func:`read_exact_blocks` read them all. A w1/w3 ``partner`` that shares the global
    scale is judged with it: the scale was made from the pair's amax, and w3 alone may sit far below w1.

    - folded_global_scale (exact): a multiplier of 1, block scales at most :data:`FOLDED_BLOCK_MAX`, and block
      scales on E4M3's lossy subnormals (3, 5, 6, 7 x 2^-9) that a global scale would have kept normal;
    - scale_convention: the amax as stored is outside :data:`WEIGHT_AMAX_RANGE` while the reciprocal reading is
      inside it; outside :data:`OWN_WEIGHT_AMAX_RANGE` too (no trained weight has such an amax) it is an error,
      else a guess (a warning: a weight with amax above 2^10 exists)."""
    multipliers = usable_multipliers(mod)
    maxima = mod.extra.get("expert_max")
    if maxima is None or maxima.size != multipliers.size:
        maxima = np.full(multipliers.size, mod.block_max)
    lossy = mod.extra.get("lossy_subnormals", np.zeros(maxima.size, dtype=np.int64))
    if partner is not None and "expert_max" in partner.extra and partner.global_value is not None and \
            np.array_equal(partner.global_value, mod.global_value):
        maxima = np.maximum(maxima, partner.extra["expert_max"].max())
    folded = (multipliers == 1.0) & (maxima > 0) & (maxima <= FOLDED_BLOCK_MAX) & (lossy > 0)
    if folded.any():
        e = int(np.argmax(folded))
        problems.append(Problem(
            "folded_global_scale", f"{mod.global_.name}: global scale 1 and the block scales at most "
            f"{maxima[e]:g} (E4M3 reaches 448), {int(lossy[e])} of them on E4M3's subnormals (steps of 2^-9): "
            "the per-tensor scale was folded into the E4M3 block scales, and those blocks lose up to 25% of their "
            "value; fix: requantize with a float32 global scale = amax/2688 and block scales up to 448",
            module=mod.name, tensor=mod.global_.name))
        return
    live = maxima > 0
    as_stored = E2M1_MAX * maxima * multipliers
    other = E2M1_MAX * maxima / multipliers
    swapped = live & ~_within(as_stored, WEIGHT_AMAX_RANGE) & _within(other, WEIGHT_AMAX_RANGE)
    if not swapped.any():
        return
    certain = swapped & ~_within(as_stored, OWN_WEIGHT_AMAX_RANGE)
    e = int(np.argmax(certain)) if certain.any() else int(np.argmax(swapped))
    stored = float(mod.global_value.reshape(-1)[e])
    expected, wrote = ((f"a multiplier ({_leaf_of(MODELOPT_LINEAR)})", "a divisor") if mod.convention == MULTIPLIER
                       else (f"a divisor ({_leaf_of(CT_NVFP4)})", "a multiplier"))
    which = f" (expert {e} of {multipliers.size})" if multipliers.size > 1 else ""
    problems.append(Problem(
        "scale_convention", f"{mod.global_.name}{which}: {stored:.6g} decodes the weights to an amax of "
        f"{as_stored[e]:.3g} (6 x block max {maxima[e]:g} x scale), but to {other[e]:.3g} read the other way: "
        f"{wrote} was stored where the form keeps {expected}; the engine scales the weights by "
        f"{as_stored[e] / other[e]:.3g}x; fix: store its reciprocal {1.0 / stored:.6g}"
        + ("" if certain.any() else " (a guess: a weight of that amax is possible; then nothing is wrong)"),
        module=mod.name, tensor=mod.global_.name, guess=not certain.any(), amax_as_stored=float(as_stored[e])))


def _within(values: np.ndarray, bounds: tuple[float, float]) -> np.ndarray:
    return (values >= bounds[0]) & (values <= bounds[1])


def _check_input_magnitude(mod: Module, problems: list[Problem]) -> None:
    """The activation amax ``2688 x input_scale`` (multiplier) outside :data:`ACT_AMAX_RANGE` while the other
    reading is inside: an error above 2^20 (what a swapped scale gives for an amax below 6.9), else a guess (a
    model's outlier activations can pass 2^16)."""
    stored = float(mod.input_value.max())
    per = NVFP4_AMAX_PER_GLOBAL_SCALE
    as_stored = per * stored if mod.convention == MULTIPLIER else per / stored
    other = per / stored if mod.convention == MULTIPLIER else per * stored
    if not _inside(as_stored, ACT_AMAX_RANGE) and _inside(other, ACT_AMAX_RANGE):
        wrote = "a divisor" if mod.convention == MULTIPLIER else "a multiplier"
        certain = as_stored > OWN_WEIGHT_AMAX_RANGE[1]
        problems.append(Problem(
            "scale_convention", f"{mod.input.name}: {stored:.6g} means an activation amax of {as_stored:.3g}, "
            f"{other:.3g} read the other way: {wrote} was stored; activations are quantized {as_stored / other:.3g}x "
            f"off (all zeros or all clipped); fix: store its reciprocal {1.0 / stored:.6g}"
            + ("" if certain else " (a guess: an activation of that amax is possible; then nothing is wrong)"),
            module=mod.name, tensor=mod.input.name, guess=not certain, amax_as_stored=as_stored))


def _leaf_of(form) -> str:
    """A form's global scale's name after the module's (``weight_scale_2``), as the messages name it."""
    return form.role("global_scale").suffix[1:]


def _input_name(mod: Module) -> str:
    return mod.form.tensor(mod.name, "input_scale")


def _global_name(mod: Module) -> str:
    return mod.form.tensor(mod.name, "global_scale")


def check_presence(modules: dict[str, Module], cfg: Configs, problems: list[Problem]) -> None:
    """Global scales everywhere; input scales where an engine loads them, for all experts of a layer or none."""
    for mod in modules.values():
        if mod.global_ is None:
            tensor = _global_name(mod)
            problems.append(Problem("missing_scale", f"{tensor}: missing; the engine's global scale stays "
                                    "uninitialised (garbage or NaN output; vLLM does not check for missing weights "
                                    "of a quantized model); fix: write the float32 global scale", module=mod.name,
                                    tensor=tensor))
    needing = [e for e, need in cfg.input_needed.items() if need]
    if not needing:
        return
    with_input = [m for m in modules.values() if m.input is not None]
    without = [m for m in modules.values() if m.input is None]
    if not without:
        return
    if not with_input:
        algo = cfg.quant_algo or "input activations quantized"
        problems.append(Problem(
            "missing_scale", f"no module has an input scale, but the config says W4A4 ({algo}); "
            f"{', '.join(needing)} quantize activations with an input scale that was never loaded (garbage, or "
            "1.0 in SGLang); fix: write input scales, or declare weight-only (quant_algo W4A16_NVFP4, "
            "input_activations null)", engines=needing))
        return
    layers: dict[str, list[Module]] = {}
    for mod in modules.values():
        match = EXPERT.match(mod.name)
        if match:
            layers.setdefault(f"{match['experts']}.*.{match['proj']}", []).append(mod)
    reported = set()
    for pattern, mods in layers.items():
        missing = [m for m in mods if m.input is None]
        if missing and len(missing) < len(mods):
            reported.update(m.name for m in missing)
            problems.append(Problem(
                "scale_missing_some_experts", f"{_input_name(missing[0])}: {len(missing)} of {len(mods)} experts "
                f"of {pattern} have no input scale (experts calibration never reached?); the engine reads 0 or "
                "garbage for them: NaN output on the prompts routed there (vLLM #45212); fix: give those experts "
                "the largest input scale of the layer, as ModelOpt does", module=missing[0].name,
                tensor=_input_name(missing[0]), engines=needing))
    for mod in without:
        if mod.name not in reported:
            tensor = _input_name(mod)
            problems.append(Problem("missing_scale", f"{tensor}: missing while the other modules have one (W4A4); "
                                    "the engine's input scale stays uninitialised: NaN or garbage; fix: write its "
                                    "calibrated input scale", module=mod.name, tensor=tensor, engines=needing))


def check_pairs(modules: dict[str, Module], problems: list[Problem]) -> None:
    """w1/w3 (gate/up) of one expert share one weight global scale and one input scale in every engine."""
    pairs: dict[str, dict[str, Module]] = {}
    for mod in modules.values():
        match = EXPERT.match(mod.name)
        if match and match["proj"] in GATE_NAMES + UP_NAMES:
            role = "gate" if match["proj"] in GATE_NAMES else "up"
            pairs.setdefault(f"{match['experts']}.{match['e']}", {})[role] = mod
    for expert, pair in pairs.items():
        if len(pair) != 2:
            continue
        gate, up = pair["gate"], pair["up"]
        for attr, what in (("global_value", "weight global scale"), ("input_value", "input scale")):
            a, b = getattr(gate, attr), getattr(up, attr)
            if a is None or b is None or a.size != 1 or b.size != 1 or np.array_equal(a, b):
                continue  # a scale that is not one number is a dtype_shape problem, named by its shape
            problems.append(Problem(
                "w1_w3_mismatch", f"{expert}: {gate.name.rpartition('.')[2]} and {up.name.rpartition('.')[2]} have "
                f"different {what}s ({float(a[0]):.6g} vs {float(b[0]):.6g}); the engines fuse them into one w13 "
                "with one scale: vLLM keeps w1's with a warning (w3 dequantized wrong), TensorRT-LLM asserts; fix: "
                "requantize both with one shared scale (the larger amax)", module=up.name,
                tensor=_global_name(up) if attr == "global_value" else _input_name(up)))


def check_scalars_only(mod: Module, problems: list[Problem]) -> None:
    """A module whose codes or block scales do not fit: its scalar scales are still checked for their values."""
    for entry, role, values in ((mod.global_, "global", mod.global_value), (mod.input, "input", mod.input_value)):
        if entry is not None and values is not None and values.size:
            _value_problems(mod, entry, values, role, problems)
