"""Activation ``input_scale`` per converted module: a constant, or a SCALES.json mapped onto module names.

``input_scale`` is a multiplier (ModelOpt's convention): the activation's amax / (6 * 448); engines quantize the
activation with its reciprocal (compressed-tensors stores that reciprocal as ``input_global_scale``).

Mapping a SCALES.json (what ``fp4pass calibrate`` and ``fp4pass.fx.calibrate`` write) onto a checkpoint: an
entry applies to a module when its key is the module's name (``model.layers.0.mlp.experts.3.w1``; for a
gpt-oss expert stack, ``model.layers.0.mlp.experts.gate_up_proj``), or that name with every ``.`` written as
``_`` (fx node names), optionally followed by ``.input`` / ``_input``. Keys that match no module are listed in
the report.

Rules that hold for every module when input scales are asked for:

- w1 and w3 of one expert (gate and up) take one value, the larger of theirs (they read the same activation);
- an expert module without a calibrated value takes the largest value among the experts of its layer with the
  same projection (ModelOpt's rule); the report lists each one filled that way;
- every value is finite and positive; a dense module with no value, or a layer none of whose experts has one,
  is refused (exit 2) with its name.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from fp4pass.checkpoint.detect import FusedExperts, Linear
from fp4pass.checkpoint.forms import DOWN_NAMES, GATE_NAMES, STACK, UP_NAMES, expert_parts
from fp4pass.safetensors.files import CheckpointError

__all__ = ["InputScales", "resolve_input_scales"]


@dataclass
class InputScales:
    """module name -> input_scale (float32 value as a float), and how each was found."""

    values: dict[str, float] = field(default_factory=dict)
    filled: list[dict] = field(default_factory=list)  # {"module", "from_layer", "input_scale"}
    unmatched: list[str] = field(default_factory=list)  # SCALES.json keys that map to no module
    source: str = "none"  # none | constant | SCALES.json path

    def to_json(self) -> dict:
        return {"source": self.source, "filled_from_layer_max": self.filled, "unmatched_keys": self.unmatched}


def _modules(units) -> list:
    out = []
    for unit in units:
        out.extend(unit if isinstance(unit, tuple) else [unit])
    return out


def _name(item) -> str:
    return item.name if isinstance(item, FusedExperts) else item.module


def _check(value: float, where: str) -> float:
    from fp4pass.calib.scales import INPUT_SCALE_MAX, INPUT_SCALE_MIN

    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise CheckpointError(f"{where}: input_scale {value!r} is not a finite positive number")
    if not INPUT_SCALE_MIN <= value <= INPUT_SCALE_MAX:  # the range SCALES.json holds its values to
        raise CheckpointError(f"{where}: input_scale {value!r} is outside [{INPUT_SCALE_MIN:.4g}, "
                              f"{INPUT_SCALE_MAX:.4g}] (float32 would make it inf or 0, or the block scales times "
                              "it would not be finite)")
    return float(value)


def _deepseek_v4_expert(key: str) -> bool:
    """DeepSeek-V4's native names: ``layers.N.ffn.experts.E.w1`` (w1, w2 or w3: its experts live under ``ffn``)."""
    parts = expert_parts(key)
    if parts is None or parts[2] not in (GATE_NAMES[0], UP_NAMES[0], DOWN_NAMES[0]):
        return False
    return parts[0].rpartition(".")[0].rpartition(".")[2] == "ffn"


#: key forms of the SCALES.json files fp4pass writes, and whose they are (the names of forms.STACK, forms.EXPERT)
_FAMILIES = ((lambda key: STACK.match(key) is not None, "gpt-oss's (fused expert stacks)"),
             (_deepseek_v4_expert, "DeepSeek-V4's (layers.N.ffn.experts.E.w1)"),
             (lambda key: expert_parts(key) is not None, "another MoE checkpoint's (model.layers.N.mlp.experts.E.w1)"),
             (re.compile(r"^[^.]+$").search, "an ONNX model's activations (fp4pass calibrate on an ONNX file)"))


def _whose(keys: list[str]) -> str:
    """``; they look like gpt-oss's ...`` for keys of a form fp4pass knows, else nothing."""
    for looks_like, family in _FAMILIES:
        if all(looks_like(key) for key in keys):
            return f"; they look like {family}"
    return f" (first {keys[0]!r})"


def resolve_input_scales(units, constant: float | None = None, scales=None, scales_path: str = "SCALES.json"
                         ) -> InputScales:
    """The input_scale of every module of ``units`` (empty when neither ``constant`` nor ``scales`` is given).

    ``scales``: an :class:`fp4pass.calib.ActivationScales` (its ``tensors`` map a key to ``.input_scale``).
    """
    if constant is not None and scales is not None:
        raise CheckpointError("give either a constant input scale or a SCALES.json, not both")
    items = _modules(units)
    result = InputScales()
    if constant is None and scales is None:
        return result
    if constant is not None:
        value = _check(constant, "--input-scale")
        result.source = "constant"
        result.values = {_name(item): value for item in items}
        return result
    result.source = str(scales_path)
    lookup: dict[str, str] = {}
    for item in items:
        name = _name(item)
        for key in (name, name.replace(".", "_")):
            for suffix in ("", ".input", "_input"):
                lookup.setdefault(key + suffix, name)
    found: dict[str, float] = {}
    for key, entry in scales.tensors.items():
        module = lookup.get(key)
        if module is None:
            result.unmatched.append(key)
            continue
        value = _check(entry.input_scale, f"{scales_path}: tensor {key!r}")
        found[module] = max(found.get(module, 0.0), value)
    if not found and result.unmatched:  # a SCALES.json of another model: say whose it looks like
        raise CheckpointError(f"{scales_path}: none of its {len(result.unmatched)} keys match this checkpoint"
                              f"{_whose(result.unmatched)}, this checkpoint's modules are named like "
                              f"{_name(items[0])}; calibrate this checkpoint (fp4pass calibrate CKPT_DIR) or give "
                              "--input-scale")
    # gate and up of one pair share the larger value
    for unit in units:
        if isinstance(unit, tuple):
            names = [u.module for u in unit]
            known = [found[n] for n in names if n in found]
            if known:
                for n in names:
                    found[n] = max(known)
    # experts without a value: the max over their layer's experts of the same projection
    layer_max: dict[tuple[str, str], float] = {}
    for item in items:
        group = item.fill_group if isinstance(item, Linear) else None
        if group is not None and _name(item) in found:
            layer_max[group] = max(layer_max.get(group, 0.0), found[_name(item)])
    for item in items:
        name = _name(item)
        if name in found:
            continue
        group = item.fill_group if isinstance(item, Linear) else None
        if group is None:
            raise CheckpointError(f"{scales_path}: no input scale for {name} (not one expert of many, so there "
                                  "is none to borrow); calibrate it or give --input-scale")
        if group not in layer_max:
            raise CheckpointError(f"{scales_path}: no input scale for any expert of {group[0]} ({group[1]}); "
                                  f"calibrate them or give --input-scale")
        found[name] = layer_max[group]
        result.filled.append({"module": name, "from_layer": group[0], "projection": group[1],
                              "input_scale": layer_max[group]})
    result.values = found
    return result
