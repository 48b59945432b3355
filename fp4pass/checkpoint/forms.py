"""Every on-disk checkpoint form fp4pass reads or writes, declared once as data.

A *form* is how one quantized weight is stored: the tensors of each *role* (its codes, its block scales, its
global scale, its activation scale), each a suffix added to the module's name, with the dtypes it may have, its
shape in N (outputs), K (inputs) and E (experts), and, for the scales, the convention it follows:

- a *multiplier* is applied on dequantize: ``W = e2m1 x block_scale x global_scale``; an activation is quantized
  with ``1 / input_scale`` (ModelOpt);
- a *divisor* divides: ``W = e2m1 x block_scale / global_scale``; an activation is quantized with
  ``input_global_scale`` itself (compressed-tensors).

MXFP4 sources (E8M0 block scales, one per 32; no global scale)::

    gpt-oss (HF)            P_blocks U8 [E, N, K/32, 16]  P_scales U8 [E, N, K/32]     P = ...mlp.experts.gate_up_proj
    compressed-tensors      M.weight_packed U8 [N, K/2]   M.weight_scale U8 [N, K/32]  (mxfp4-pack-quantized)
    DeepSeek-V4 native      M.weight I8|U8 [N, K/2]       M.scale F8_E8M0|U8 [N, K/32]

NVFP4 outputs (E4M3 block scales, one per 16, plus an FP32 global scale)::

    ModelOpt                M.weight U8 [N, K/2]  M.weight_scale F8_E4M3 [N, K/16]  M.weight_scale_2 F32 []  x
                            M.input_scale F32 []  x
    ModelOpt gpt-oss stack  P U8 [E, K/2, N]      P_weight_scale F8_E4M3 [E, K/16, N]  P_weight_scale_2 F32 [] | [E]  x
                            P_input_scale F32 [] | [E]  x
    compressed-tensors      M.weight_packed U8 [N, K/2]  M.weight_scale F8_E4M3 [N, K/16]  M.weight_global_scale F32 [1]
                            /   M.input_global_scale F32 [1]  /            (nvfp4-pack-quantized)

(x: multiplier, /: divisor.) The same names can hold either precision (compressed-tensors writes
``weight_packed`` + ``weight_scale`` for both): the block scale's dtype tells them apart, U8 (E8M0) for MXFP4 and
F8_E4M3 for NVFP4 (:func:`block_precision`), never the names alone.

The module-name patterns every reader shares are here too: an expert ``<experts>.<e>.<proj>``, the gpt-oss
stacks ``<experts>.gate_up_proj`` / ``.down_proj``, and the gate / up / down projection names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["MULTIPLIER", "DIVISOR", "Role", "Form", "GPT_OSS_MXFP4", "CT_MXFP4", "DEEPSEEK_MXFP4", "MODELOPT_LINEAR",
           "MODELOPT_STACK", "CT_NVFP4", "MXFP4_FORMS", "NVFP4_FORMS", "GATE_NAMES", "UP_NAMES", "DOWN_NAMES",
           "STACK_PROJS", "EXPERT", "expert_parts", "role_of_projection", "block_precision", "E8M0_DTYPES",
           "E4M3_DTYPE", "NVFP4_SUFFIXES", "stack_scale_pattern", "WEIGHT_SUFFIX",
           "CT_SHAPE_SUFFIX", "FP8_SCALE_SUFFIXES", "STACK"]

MULTIPLIER, DIVISOR = "multiplier", "divisor"
E8M0_DTYPES = ("U8", "F8_E8M0")  # an E8M0 code read as a byte (HF, compressed-tensors) or typed (DeepSeek-V4)
E4M3_DTYPE = "F8_E4M3"


@dataclass(frozen=True)
class Role:
    """One tensor of a stored weight: ``module + suffix``; ``shape`` in N, K, E (documentation and messages)."""

    role: str  # "codes" | "block_scales" | "global_scale" | "input_scale"
    suffix: str
    dtypes: tuple[str, ...]
    shape: str
    convention: str | None = None

    def name(self, module: str) -> str:
        return module + self.suffix


@dataclass(frozen=True)
class Form:
    """A stored form of one quantized weight: its roles, in writing order."""

    name: str
    precision: str  # "mxfp4" | "nvfp4"
    layout: str  # "linear" (one [N, K] weight) | "stack" (gpt-oss experts [E, N, K] in one tensor)
    roles: tuple[Role, ...]

    def role(self, role: str) -> Role:
        for r in self.roles:
            if r.role == role:
                return r
        raise KeyError(f"form {self.name} has no {role}")

    def tensor(self, module: str, role: str) -> str:
        """The tensor name of ``role`` for ``module``: ``CT_NVFP4.tensor("m", "global_scale")`` is
        ``m.weight_global_scale``."""
        return self.role(role).name(module)

    def split(self, tensor: str) -> tuple[str, Role] | None:
        """(module, role) of a tensor name of this form, the longest suffix first; None when none fits. The
        codes of the gpt-oss NVFP4 stack have no suffix and are never split from a name alone."""
        for r in sorted(self.roles, key=lambda r: -len(r.suffix)):
            if r.suffix and tensor.endswith(r.suffix) and len(tensor) > len(r.suffix):
                return tensor[: -len(r.suffix)], r
        return None

    @property
    def convention(self) -> str | None:
        return next((r.convention for r in self.roles if r.convention), None)


GPT_OSS_MXFP4 = Form("gpt-oss", "mxfp4", "stack", (
    Role("codes", "_blocks", ("U8",), "[E, N, K/32, 16]"),
    Role("block_scales", "_scales", E8M0_DTYPES, "[E, N, K/32]")))
CT_MXFP4 = Form("compressed-tensors", "mxfp4", "linear", (
    Role("codes", ".weight_packed", ("U8",), "[N, K/2]"),
    Role("block_scales", ".weight_scale", E8M0_DTYPES, "[N, K/32]")))
DEEPSEEK_MXFP4 = Form("deepseek", "mxfp4", "linear", (
    Role("codes", ".weight", ("I8", "U8"), "[N, K/2]"),
    Role("block_scales", ".scale", E8M0_DTYPES, "[N, K/32]")))

MODELOPT_LINEAR = Form("modelopt", "nvfp4", "linear", (
    Role("codes", ".weight", ("U8",), "[N, K/2]"),
    Role("block_scales", ".weight_scale", (E4M3_DTYPE,), "[N, K/16]"),
    Role("global_scale", ".weight_scale_2", ("F32",), "[]", MULTIPLIER),
    Role("input_scale", ".input_scale", ("F32",), "[]", MULTIPLIER)))
MODELOPT_STACK = Form("modelopt-gpt-oss-stack", "nvfp4", "stack", (
    Role("codes", "", ("U8",), "[E, K/2, N]"),
    Role("block_scales", "_weight_scale", (E4M3_DTYPE,), "[E, K/16, N]"),
    Role("global_scale", "_weight_scale_2", ("F32",), "[] or [E]", MULTIPLIER),
    Role("input_scale", "_input_scale", ("F32",), "[] or [E]", MULTIPLIER)))
CT_NVFP4 = Form("compressed-tensors", "nvfp4", "linear", (
    Role("codes", ".weight_packed", ("U8",), "[N, K/2]"),
    Role("block_scales", ".weight_scale", (E4M3_DTYPE,), "[N, K/16]"),
    Role("global_scale", ".weight_global_scale", ("F32",), "[1]", DIVISOR),
    Role("input_scale", ".input_global_scale", ("F32",), "[1]", DIVISOR)))

MXFP4_FORMS = (GPT_OSS_MXFP4, CT_MXFP4, DEEPSEEK_MXFP4)
NVFP4_FORMS = (MODELOPT_LINEAR, MODELOPT_STACK, CT_NVFP4)

#: the per-Linear NVFP4 scale suffixes (without the dot) -> (role, convention), of both per-Linear forms
NVFP4_SUFFIXES = {r.suffix[1:]: (r.role, r.convention) for form in (MODELOPT_LINEAR, CT_NVFP4) for r in form.roles
                  if r.role != "codes"}

GATE_NAMES, UP_NAMES, DOWN_NAMES = ("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")
STACK_PROJS = ("gate_up_proj", "down_proj")  # gpt-oss: the two expert stacks of a layer's ``experts`` module

#: one expert's projection: ``<experts>.<e>.<proj>`` (``model.layers.3.mlp.experts.12.w1``)
EXPERT = re.compile(r"^(?P<experts>.+\.experts)\.(?P<e>\d+)\.(?P<proj>[^.]+)$")


def expert_parts(module: str) -> tuple[str, int, str] | None:
    """(experts module, expert number, projection) of an expert's projection, else None."""
    match = EXPERT.match(module)
    return (match["experts"], int(match["e"]), match["proj"]) if match else None


def role_of_projection(leaf: str) -> str | None:
    """"gate", "up" or "down" for a projection's last name part (``w1``, ``up_proj``, ...), else None."""
    for role, names in (("gate", GATE_NAMES), ("up", UP_NAMES), ("down", DOWN_NAMES)):
        if leaf in names:
            return role
    return None


def stack_scale_pattern(form: Form = MODELOPT_STACK) -> re.Pattern:
    """A gpt-oss NVFP4 stack's scale tensors: group ``p`` the stack (``...experts.gate_up_proj``), ``what`` the
    role's suffix without its underscore (``weight_scale_2``)."""
    projs = "|".join(STACK_PROJS)
    whats = "|".join(re.escape(r.suffix[1:]) for r in sorted(form.roles, key=lambda r: -len(r.suffix)) if r.suffix)
    return re.compile(rf"^(?P<p>.+\.experts\.(?:{projs}))_(?P<what>{whats})$")


def block_precision(dtype: str) -> str | None:
    """"mxfp4" for an E8M0 block scale's dtype, "nvfp4" for E4M3, None for anything else."""
    if dtype in E8M0_DTYPES:
        return "mxfp4"
    if dtype == E4M3_DTYPE:
        return "nvfp4"
    return None

#: a Linear's plain weight: ``M.weight`` (copied, or FP8); gpt-oss writes a dense Linear's MXFP4 codes as
#: ``M.weight`` + the gpt-oss codes suffix (``M.weight_blocks``)
WEIGHT_SUFFIX = ".weight"
#: compressed-tensors' record of a packed weight's unpacked shape, beside its codes (consumed with them)
CT_SHAPE_SUFFIX = ".weight_shape"
#: an FP8 weight's block scales, which keep it FP8: DeepSeek-V4's ``M.scale``, DeepSeek-V3's ``M.weight_scale_inv``
FP8_SCALE_SUFFIXES = (".scale", ".weight_scale_inv")
#: a gpt-oss expert stack: ``<experts>.gate_up_proj`` / ``<experts>.down_proj`` (no expert number)
STACK = re.compile(rf"^(?P<experts>.+\.experts)\.(?P<proj>{'|'.join(STACK_PROJS)})$")
