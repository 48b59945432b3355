"""The two byte layouts of ``com.microsoft::QMoE`` FP4 expert weights, and how fp4pass tells them apart.

For one projection (fc1: N = fusion * inter_size, K = hidden_size; fc2: N = hidden_size, K = inter_size), with
``c[e, n, k]`` the 4-bit E2M1 code of the weight W[e, n, k] (y = x @ W[e]^T, K the reduction axis):

- ``schema`` - uint8 [E, N, K/2], what the QMoE operator schema documents: byte [e, n, j] holds c[e, n, 2j] in
  the low nibble and c[e, n, 2j+1] in the high nibble (paired along K, like ONNX FLOAT4E2M1).
- ``kernel`` - uint8 [E, K, N/2], what onnxruntime's CUDA kernels for 'fp4' and 'nvfp4' read and what the
  onnxruntime-genai builder writes (loaders/gptoss.py ``pack_blocks_for_qmoe``): byte [e, k, j] holds
  c[e, 2j, k] in the low nibble and c[e, 2j+1, k] in the high nibble (paired along N, transposed).

In both, the block scales are [E, N, K/B] (B = 32 E8M0 for 'fp4', 16 E4M3 for 'nvfp4') and the global scale
``fc*_global_scale`` is FP32 [E]: W[e, n, k] = e2m1(c[e, n, k]) * scale[e, n, k // B] * global[e].

Recognition (:func:`detect`): per projection, shapes (w = [E, a, b], s = [E, c, d]) fit ``schema`` when
c == a and d*B == 2b, and ``kernel`` when c == 2b and d*B == a. A layout is kept for the node when both
projections fit it and the sizes chain: K1 == N2 (= hidden_size) and N1 == fusion * K2 (fusion 2 for a fused
SwiGLU), and when the fc1/fc2 biases, the input's last dimension and any ``hidden_size``/``inter_size``
attributes agree. fc1 alone is ambiguous when N == K (2I == H with fused SwiGLU), fc2 alone when H == I;
the other projection then decides. Only an unfused node with I == H fits both layouts; then the hints decide,
in this order: the node's metadata ``fp4pass.qmoe_weight_layout`` (fp4pass writes it on every QMoE it
converts), the model's metadata of the same key, a producer known to write the kernel layout
(``producer_name`` onnxruntime-genai, or a ``genai_config.json`` beside the model). Without a hint the node
is declined with that reason: a wrong guess would transpose every expert silently. A node-metadata hint
that contradicts the shapes is declined too.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx_ir as ir

from fp4pass.io import read_regular_file, strict_json

__all__ = [
    "SCHEMA",
    "KERNEL",
    "LAYOUT_KEY",
    "LAYOUT_SHAPES",
    "WRITTEN_LAYOUT",
    "Hints",
    "Detected",
    "detect",
    "kernel_to_schema",
    "schema_to_kernel",
]

SCHEMA = "schema"
KERNEL = "kernel"
LAYOUT_KEY = "fp4pass.qmoe_weight_layout"
LAYOUT_SHAPES = {SCHEMA: "[E, N, K/2]", KERNEL: "[E, K, N/2]"}
#: the byte layout every 'nvfp4' QMoE weight is written in (onnxruntime's CUDA kernel reads it)
WRITTEN_LAYOUT = KERNEL
KERNEL_PRODUCERS = ("onnxruntime-genai",)
GENAI_CONFIG_MAX_BYTES = 16 << 20  # onnxruntime-genai's config is a few KB
_FC = {"fc1": (2, 3, 4), "fc2": (5, 6, 7)}  # weights, scales, bias input indices


@dataclass(frozen=True)
class Hints:
    """Model-level evidence for an ambiguous node: the model's metadata and producer, a genai_config.json."""

    metadata: dict[str, str] = field(default_factory=dict)
    producer: str = ""
    genai_config: bool = False

    @classmethod
    def of(cls, model: ir.Model | None, model_dir: str | Path | None = None) -> "Hints":
        genai = False
        if model_dir is not None:
            path = Path(model_dir) / "genai_config.json"
            try:  # a regular file only (never a FIFO or /dev/zero), and a few MB at most
                genai = (os.path.lexists(path)
                         and "model" in strict_json(read_regular_file(path, GENAI_CONFIG_MAX_BYTES, ValueError)))
            except (ValueError, TypeError, RecursionError):
                genai = False
        if model is None:
            return cls(genai_config=genai)
        return cls(dict(model.metadata_props), model.producer_name or "", genai)


@dataclass(frozen=True)
class Detected:
    """The layout of one QMoE node's weights (None when declined), why, and the logical (N, K) per projection."""

    layout: str | None
    reason: str
    dims: dict[str, tuple[int, int]] = field(default_factory=dict)


def _shape(value: ir.Value | None) -> tuple[int, ...] | None:
    if value is None:
        return None
    if value.const_value is not None:
        return tuple(int(d) for d in value.const_value.shape)
    if value.shape is None or not all(isinstance(d, int) for d in value.shape):
        return None
    return tuple(int(d) for d in value.shape)


def _attr(node: ir.Node, name: str, default=None):
    attr = node.attributes.get(name)
    return default if attr is None else attr.value


def _fusion(node: ir.Node) -> int:
    """2 when fc1 holds gate and up (fused SwiGLU; onnxruntime treats swiglu_fusion 0 as 1 for 'swiglu')."""
    if _attr(node, "swiglu_fusion", 0) in (1, 2):
        return 2
    return 2 if _attr(node, "activation_type", "relu") == "swiglu" else 1


def _fits(w: tuple[int, ...], s: tuple[int, ...], block: int) -> dict[str, tuple[int, int]]:
    """Layouts whose shape rule (w, s) satisfies, with the (N, K) each implies."""
    _, a, b = w
    _, c, d = s
    fits = {}
    if c == a and d * block == 2 * b:
        fits[SCHEMA] = (a, 2 * b)
    if c == 2 * b and d * block == a:
        fits[KERNEL] = (2 * b, a)
    return fits


def _consistent(node: ir.Node, dims: dict[str, tuple[int, int]]) -> str | None:
    """Why (N1, K1), (N2, K2) cannot be this node's projections, or None when every size agrees."""
    (n1, k1), (n2, k2) = dims["fc1"], dims["fc2"]
    fusion = _fusion(node)
    if k1 != n2:
        return f"fc1 K={k1} != fc2 N={n2}"
    if n1 != fusion * k2:
        return f"fc1 N={n1} != {fusion} x fc2 K={k2}"
    for fc, (n, _) in dims.items():
        bias = _shape(node.inputs[_FC[fc][2]]) if len(node.inputs) > _FC[fc][2] else None
        if bias is not None and bias[-1] != n:
            return f"{fc} bias has {bias[-1]} outputs, not N={n}"
    x = node.inputs[0] if node.inputs else None
    features = x.shape[-1] if x is not None and x.shape is not None and len(x.shape) else None
    if isinstance(features, int) and features != k1:
        return f"input has {features} features, not hidden_size={k1}"
    for name, want in (("hidden_size", k1), ("inter_size", k2)):
        got = _attr(node, name)
        if got is not None and got != want:
            return f"attribute {name}={got}, not {want}"
    return None


def _hint(node: ir.Node, hints: Hints) -> tuple[str | None, str]:
    value = node.metadata_props.get(LAYOUT_KEY)
    if value in LAYOUT_SHAPES:
        return value, f"node metadata {LAYOUT_KEY}={value}"
    value = hints.metadata.get(LAYOUT_KEY)
    if value in LAYOUT_SHAPES:
        return value, f"model metadata {LAYOUT_KEY}={value}"
    if any(hints.producer.startswith(p) for p in KERNEL_PRODUCERS):
        return KERNEL, f"producer {hints.producer!r} writes the kernel layout"
    if hints.genai_config:
        return KERNEL, "genai_config.json beside the model (onnxruntime-genai writes the kernel layout)"
    return None, ""


def detect(node: ir.Node, block: int, hints: Hints | None = None) -> Detected:
    """The weight layout of QMoE ``node`` with FP4 blocks of ``block`` elements (module docstring)."""
    hints = hints or Hints()
    shapes = {}
    for fc, (wi, si, _) in _FC.items():
        w = _shape(node.inputs[wi]) if len(node.inputs) > wi else None
        s = _shape(node.inputs[si]) if len(node.inputs) > si else None
        if w is None or s is None or len(w) != 3 or len(s) != 3 or w[0] != s[0]:
            return Detected(None, f"{fc} weights {w} / scales {s} are not 3-D [E, ., .] tensors of known shape")
        shapes[fc] = (w, s)
    fits = {fc: _fits(w, s, block) for fc, (w, s) in shapes.items()}
    candidates: dict[str, dict[str, tuple[int, int]]] = {}
    why_not: list[str] = []
    for layout in (SCHEMA, KERNEL):
        if not all(layout in f for f in fits.values()):
            missing = [fc for fc, f in fits.items() if layout not in f]
            why_not.append(f"{layout} {LAYOUT_SHAPES[layout]}: {', '.join(missing)} shapes do not fit")
            continue
        dims = {fc: f[layout] for fc, f in fits.items()}
        reason = _consistent(node, dims)
        if reason:
            why_not.append(f"{layout} {LAYOUT_SHAPES[layout]}: {reason}")
        else:
            candidates[layout] = dims
    described = "; ".join(f"{fc} weights {list(w)} scales {list(s)}" for fc, (w, s) in shapes.items())
    hint, hint_reason = _hint(node, hints)
    if len(candidates) == 1:
        (layout, dims), = candidates.items()
        explicit = node.metadata_props.get(LAYOUT_KEY)
        if explicit in LAYOUT_SHAPES and explicit != layout:
            return Detected(None, f"node metadata {LAYOUT_KEY}={explicit} contradicts the shapes, which fit only "
                                  f"the {layout} layout {LAYOUT_SHAPES[layout]} ({described})")
        ambiguous = [fc for fc, f in fits.items() if len(f) == 2]
        how = "shapes" + (f"; {', '.join(ambiguous)} alone fits both layouts, the other projection decides"
                          if ambiguous else "")
        return Detected(layout, how, dims)
    if not candidates:
        return Detected(None, f"weights fit neither QMoE layout ({described}): {'; '.join(why_not)}")
    if hint is None:
        return Detected(None, f"weight layout is ambiguous: {described} fit both {SCHEMA} {LAYOUT_SHAPES[SCHEMA]} "
                              f"and {KERNEL} {LAYOUT_SHAPES[KERNEL]} (N == K in fc1 and fc2); name it with node "
                              f"metadata {LAYOUT_KEY}=schema|kernel")
    return Detected(hint, f"shapes fit both layouts; {hint_reason}", candidates[hint])


def _repack(packed: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """uint8 [E, rows, cols/2] paired along cols -> uint8 [E, cols, rows/2] paired along rows (the transpose).

    One expert at a time, so the working set beyond input and output is one expert's codes.
    """
    e = packed.size // (rows * cols // 2)
    packed = np.asarray(packed, np.uint8).reshape(e, rows, cols // 2)
    out = np.empty((e, cols, rows // 2), np.uint8)
    for i in range(e):
        codes = np.empty((rows, cols), np.uint8)
        codes[:, 0::2] = packed[i] & 0x0F
        codes[:, 1::2] = packed[i] >> 4
        t = codes.T  # [cols, rows]
        out[i] = t[:, 0::2] | (t[:, 1::2] << 4)
    return out


def kernel_to_schema(packed: np.ndarray, n: int, k: int) -> np.ndarray:
    """uint8 [E, K, N/2] (nibbles paired along N) -> uint8 [E, N, K/2] (nibbles paired along K)."""
    return _repack(packed, k, n)


def schema_to_kernel(packed: np.ndarray, n: int, k: int) -> np.ndarray:
    """uint8 [E, N, K/2] (nibbles paired along K) -> uint8 [E, K, N/2] (nibbles paired along N)."""
    return _repack(packed, n, k)
