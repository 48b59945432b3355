"""torch modules that hold MXFP4 weights packed and dequantize them with ``torch.ops.fp4pass.dequantize_mxfp4``.

Each weight is stored the way gpt-oss checkpoints store it, as two uint8 buffers:

- ``{w}_blocks`` [..., N, K/32, 16]: E2M1 codes, two per byte, element 2i in the low nibble, 2i+1 in the high;
- ``{w}_scales`` [..., N, K/32]: E8M0 codes, block scale 2^(code - 127), a multiplier applied on dequantize.

``forward`` calls the custom op once per weight (``W = e2m1(code) * 2^(scale - 127)``, float32 [..., N, K]),
so ``torch.export`` keeps one ``fp4pass.dequantize_mxfp4`` node per weight: the node the fx pass rewrites into
NVFP4. Nothing is dequantized ahead of time; memory holds the packed bytes (a quarter of bf16 plus 1/32).

- :class:`MXFP4Linear`: ``y = x @ W^T + b`` for W [N, K], a drop-in for ``torch.nn.Linear``.
- :class:`MXFP4Experts`: gpt-oss's MoE experts, a drop-in for transformers' ``GptOssExperts`` (same call,
  same math), W1 = ``gate_up_proj`` [E, 2I, H] with gate/up rows interleaved (row 2j gate, 2j+1 up),
  W2 = ``down_proj`` [E, H, I].
- :func:`quantize_linears`: put MXFP4Linear in place of a float model's linear layers (``nn.Linear``, its
  subclasses, transformers' ``Conv1D``), listing those it skips with the reason.
"""

from __future__ import annotations

import fnmatch
import logging

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from fp4pass.errors import ShapeError
from fp4pass.formats import E8M0_BIAS, MX_BLOCK_SIZE, MXFP4Tensor, ScaleRule

# Registers torch.ops.fp4pass.* before any forward runs.
from fp4pass.fx import dequant, ops  # noqa: F401

__all__ = ["MXFP4Linear", "MXFP4Experts", "quantize_linears", "gpt_oss_blocks"]

log = logging.getLogger(__name__)

_BLOCK_BYTES = MX_BLOCK_SIZE // 2


def gpt_oss_blocks(mx: MXFP4Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``MXFP4Tensor`` [..., K] -> (blocks uint8 [..., K/32, 16], scales uint8 [..., K/32]), gpt-oss layout.

    The same bytes as ``mx.codes`` (a view), grouped by scale block.
    """
    if mx.block_size != MX_BLOCK_SIZE:
        raise ShapeError(f"{mx.name}: gpt-oss layout needs block size 32, got {mx.block_size}")
    return mx.codes.reshape(*mx.codes.shape[:-1], -1, _BLOCK_BYTES), mx.scales


def _dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float [..., K] from gpt-oss blocks [..., K/32, 16] and scales [..., K/32]: one custom-op node."""
    weight = torch.ops.fp4pass.dequantize_mxfp4(blocks.flatten(-2), scales)
    if isinstance(dtype, torch.dtype) and dtype == torch.float32:  # a Proxy under symbolic_trace
        return weight
    return weight.to(dtype)


def _expert_weight(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One expert's float weight [N, K] from its blocks [N, K/32, 16] and scales [N, K/32] (eager, no graph node).

    In chunks of the default size: an index as large as the expert (one step) measured a third slower than
    chunks whose index stays in the cache."""
    weight = dequant.dequantize_mxfp4(blocks.flatten(-2), scales)
    return weight if dtype == torch.float32 else weight.to(dtype)


def _tracing(x) -> bool:
    """Whether the forward is being traced (torch.export, torch.compile, symbolic_trace) rather than run."""
    return isinstance(x, torch.fx.Proxy) or torch.compiler.is_compiling() or torch.compiler.is_exporting()


def _check_k(name: str, k: int) -> None:
    if k % MX_BLOCK_SIZE:
        raise ShapeError(f"{name}: K={k} is not a multiple of the MXFP4 block {MX_BLOCK_SIZE}")


class MXFP4Linear(nn.Module):
    """``y = x @ W^T + b`` with W [out_features, in_features] held in MXFP4 (``weight_blocks``, ``weight_scales``).

    ``bias`` stays a float parameter. The dequantized weight is float32, cast to the input's dtype.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, device=None,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        _check_k("MXFP4Linear", in_features)
        self.in_features, self.out_features = in_features, out_features
        blocks = in_features // MX_BLOCK_SIZE
        self.register_buffer("weight_blocks", torch.zeros(out_features, blocks, _BLOCK_BYTES, dtype=torch.uint8,
                                                          device=device))
        self.register_buffer("weight_scales", torch.full((out_features, blocks), E8M0_BIAS, dtype=torch.uint8,
                                                         device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device)) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, scale_rule: ScaleRule | str = ScaleRule.FLOOR,
                    *, name: str = "linear") -> "MXFP4Linear":
        """Quantize ``linear.weight`` to MXFP4 with ``scale_rule`` (see :class:`fp4pass.ScaleRule`)."""
        weight = linear.weight.detach()
        _check_k(f"{name}.weight", weight.shape[-1])
        module = cls(linear.in_features, linear.out_features, linear.bias is not None, device=weight.device,
                     dtype=weight.dtype)
        blocks, scales = gpt_oss_blocks(MXFP4Tensor.quantize(weight, scale_rule=scale_rule, name=f"{name}.weight"))
        module.weight_blocks.copy_(blocks)
        module.weight_scales.copy_(scales)
        if linear.bias is not None:
            module.bias.data.copy_(linear.bias.detach())
        return module

    @classmethod
    def from_conv1d(cls, conv, scale_rule: ScaleRule | str = ScaleRule.FLOOR, *, name: str = "conv1d") -> "MXFP4Linear":
        """Quantize transformers' ``Conv1D`` (GPT-2 style: ``y = x @ W + b`` with W [in, out]): the weight is
        transposed to [out, in], so that its blocks of 32 run along the contracted axis, as for a Linear."""
        weight = conv.weight.detach().t()  # [out, in]
        _check_k(f"{name}.weight", weight.shape[-1])
        out_features, in_features = weight.shape
        module = cls(in_features, out_features, conv.bias is not None, device=weight.device, dtype=weight.dtype)
        blocks, scales = gpt_oss_blocks(MXFP4Tensor.quantize(weight, scale_rule=scale_rule, name=f"{name}.weight"))
        module.weight_blocks.copy_(blocks)
        module.weight_scales.copy_(scales)
        if conv.bias is not None:
            module.bias.data.copy_(conv.bias.detach())
        return module

    def dequantized_weight(self) -> torch.Tensor:
        """float32 [out_features, in_features]."""
        return _dequantize(self.weight_blocks, self.weight_scales, torch.float32)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight, float32 [out_features, in_features], computed on each read (one dequant node
        when traced): for modules that read their child's ``.weight`` instead of calling it, such as
        ``nn.MultiheadAttention`` with its ``out_proj``."""
        return self.dequantized_weight()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, _dequantize(self.weight_blocks, self.weight_scales, x.dtype), self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class MXFP4Experts(nn.Module):
    """gpt-oss MoE experts with MXFP4 weights; called like transformers' ``GptOssExperts``.

    Buffers (checkpoint names and layout): ``gate_up_proj_blocks`` [E, 2I, H/32, 16], ``gate_up_proj_scales``
    [E, 2I, H/32], ``down_proj_blocks`` [E, H, I/32, 16], ``down_proj_scales`` [E, H, I/32]; float parameters
    ``gate_up_proj_bias`` [E, 2I], ``down_proj_bias`` [E, H].

    ``forward(hidden_states [T, H], router_indices [T, k], routing_weights [T, k]) -> [T, H]``, per token t
    and each of its k experts e (weight r)::

        gate_up = x_t @ W1[e]^T + b1[e]           # [2I], gate = gate_up[0::2], up = gate_up[1::2]
        gate    = min(gate, limit);  up = clamp(up, -limit, limit)
        h       = (up + 1) * gate * sigmoid(alpha * gate)          # alpha 1.702, limit 7 in gpt-oss
        y_t    += r * (h @ W2[e]^T + b2[e])                        # summed in increasing expert order

    Two forwards compute this sum:

    - dense (traced, and eager when ``routed`` is False): every expert runs on every token as one batched
      matmul (a routing weight of zero for tokens that did not pick it). No data-dependent shapes, so the
      module exports with ``torch.export`` as two dequant nodes and two ``bmm`` per layer, at E/k times the
      arithmetic of a routed kernel. ``down_proj`` is dequantized after ``gate_up_proj``'s matmul, so that a
      graph run frees the first float weight before it builds the second.
    - routed (eager only, when ``routed`` is True): the experts stay packed; each expert that at least one
      token picked is dequantized on its own ([2I, H] and [H, I], float32) and multiplies only its tokens,
      the top-k work of a serving kernel. Results are added in increasing expert order; they equal the dense
      forward's up to float summation order. Under ``torch.export`` / ``torch.compile`` / ``symbolic_trace``
      the dense forward is traced whatever ``routed`` says, so the exported graph is the same.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *, alpha: float = 1.702,
                 limit: float = 7.0, device=None, dtype: torch.dtype = torch.float32, routed: bool = False) -> None:
        super().__init__()
        self.routed = routed
        _check_k("MXFP4Experts gate_up_proj (hidden_size)", hidden_size)
        _check_k("MXFP4Experts down_proj (intermediate_size)", intermediate_size)
        e, h, i = num_experts, hidden_size, intermediate_size
        self.num_experts, self.hidden_size, self.intermediate_size = e, h, i
        self.alpha, self.limit = alpha, limit

        def blocks(n, k):
            return torch.zeros(e, n, k // MX_BLOCK_SIZE, _BLOCK_BYTES, dtype=torch.uint8, device=device)

        def scales(n, k):
            return torch.full((e, n, k // MX_BLOCK_SIZE), E8M0_BIAS, dtype=torch.uint8, device=device)

        self.register_buffer("gate_up_proj_blocks", blocks(2 * i, h))
        self.register_buffer("gate_up_proj_scales", scales(2 * i, h))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(e, 2 * i, dtype=dtype, device=device))
        self.register_buffer("down_proj_blocks", blocks(h, i))
        self.register_buffer("down_proj_scales", scales(h, i))
        self.down_proj_bias = nn.Parameter(torch.zeros(e, h, dtype=dtype, device=device))

    @classmethod
    def from_config(cls, config, *, device=None, dtype: torch.dtype = torch.float32,
                    routed: bool = False) -> "MXFP4Experts":
        """Empty experts shaped by a transformers ``GptOssConfig``."""
        return cls(config.num_local_experts, config.hidden_size, config.intermediate_size,
                   alpha=getattr(config, "swiglu_alpha", 1.702), limit=config.swiglu_limit, device=device,
                   dtype=dtype, routed=routed)

    @classmethod
    def from_experts(cls, experts: nn.Module, scale_rule: ScaleRule | str = ScaleRule.FLOOR,
                     *, name: str = "experts") -> "MXFP4Experts":
        """Quantize a float ``GptOssExperts`` (``gate_up_proj`` [E, H, 2I], ``down_proj`` [E, I, H], x @ W)."""
        gate_up = experts.gate_up_proj.detach()
        down = experts.down_proj.detach()
        e, h, two_i = gate_up.shape
        module = cls(e, h, two_i // 2, alpha=experts.alpha, limit=experts.limit, device=gate_up.device,
                     dtype=gate_up.dtype)
        for proj, weight in (("gate_up_proj", gate_up), ("down_proj", down)):
            mx = MXFP4Tensor.quantize(weight.transpose(1, 2), scale_rule=scale_rule, name=f"{name}.{proj}")
            blocks, scales = gpt_oss_blocks(mx)
            getattr(module, f"{proj}_blocks").copy_(blocks)
            getattr(module, f"{proj}_scales").copy_(scales)
        module.gate_up_proj_bias.data.copy_(experts.gate_up_proj_bias.detach())
        module.down_proj_bias.data.copy_(experts.down_proj_bias.detach())
        return module

    def dequantized(self, proj: str) -> torch.Tensor:
        """float32 weight of ``proj`` ("gate_up_proj" [E, 2I, H] or "down_proj" [E, H, I])."""
        return _dequantize(getattr(self, f"{proj}_blocks"), getattr(self, f"{proj}_scales"), torch.float32)

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        glu = gate * torch.sigmoid(gate * self.alpha)
        return (up + 1) * glu

    def forward(self, hidden_states: torch.Tensor, router_indices=None, routing_weights=None) -> torch.Tensor:
        if self.routed and not _tracing(hidden_states):
            return self.routed_forward(hidden_states, router_indices, routing_weights)
        return self.dense_forward(hidden_states, router_indices, routing_weights)

    def dense_forward(self, hidden_states: torch.Tensor, router_indices, routing_weights) -> torch.Tensor:
        """Every expert on every token (class docstring): the forward that torch.export traces."""
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, self.hidden_size)
        dtype = x.dtype
        w1 = _dequantize(self.gate_up_proj_blocks, self.gate_up_proj_scales, dtype)  # [E, 2I, H]
        xe = x.unsqueeze(0).expand(self.num_experts, -1, -1)  # [E, T, H]
        gate_up = torch.bmm(xe, w1.transpose(1, 2)) + self.gate_up_proj_bias.unsqueeze(1)  # [E, T, 2I]
        del w1  # eager: free it before the second weight exists (a graph run frees it after its last use)
        w2 = _dequantize(self.down_proj_blocks, self.down_proj_scales, dtype)  # [E, H, I]
        out = torch.bmm(self._apply_gate(gate_up), w2.transpose(1, 2)) + self.down_proj_bias.unsqueeze(1)
        # routing weight per (token, expert), zero where the token did not pick the expert
        dense = torch.zeros(x.shape[0], self.num_experts, dtype=routing_weights.dtype, device=x.device)
        dense = dense.scatter(1, router_indices.reshape(x.shape[0], -1), routing_weights.reshape(x.shape[0], -1))
        weighted = out * dense.transpose(0, 1).unsqueeze(-1).to(out.dtype)  # [E, T, H]
        return weighted.sum(0).to(dtype).reshape(shape)

    def routed_forward(self, hidden_states: torch.Tensor, router_indices, routing_weights) -> torch.Tensor:
        """Each picked expert dequantized alone and run on its tokens only (class docstring); eager only."""
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, self.hidden_size)
        dtype, tokens = x.dtype, x.shape[0]
        indices = router_indices.reshape(tokens, -1)
        weights = routing_weights.reshape(tokens, -1)
        out = torch.zeros(tokens, self.hidden_size, dtype=dtype, device=x.device)
        for expert in torch.unique(indices).tolist():  # sorted: increasing expert order
            token, slot = torch.where(indices == expert)
            w1 = _expert_weight(self.gate_up_proj_blocks[expert], self.gate_up_proj_scales[expert], dtype)
            gate_up = x[token] @ w1.t() + self.gate_up_proj_bias[expert]
            del w1
            w2 = _expert_weight(self.down_proj_blocks[expert], self.down_proj_scales[expert], dtype)
            y = self._apply_gate(gate_up) @ w2.t() + self.down_proj_bias[expert]
            del w2
            out[token] += y * weights[token, slot].unsqueeze(-1).to(y.dtype)  # a token picks an expert once
        return out.reshape(shape)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
                f"intermediate_size={self.intermediate_size}, alpha={self.alpha}, limit={self.limit}")


def _kind(module: nn.Module) -> str | None:
    """"linear" for ``nn.Linear`` and its subclasses, "conv1d" for transformers' ``Conv1D`` (weight [in, out])."""
    if isinstance(module, nn.Linear):
        return "linear"
    cls = type(module)
    if cls.__name__ == "Conv1D" and cls.__module__.startswith("transformers") and hasattr(module, "nf"):
        return "conv1d"
    return None


def _skip_reason(name: str, module: nn.Module, kind: str, exclude: tuple[str, ...]) -> str | None:
    pattern = next((p for p in exclude if fnmatch.fnmatchcase(name, p)), None)
    if pattern is not None:
        return f"excluded by pattern {pattern!r}"
    if kind == "linear" and type(module).forward is not nn.Linear.forward:
        return (f"{type(module).__name__} subclasses nn.Linear with its own forward; replacing it would drop what "
                "that forward adds")
    in_features = module.in_features if kind == "linear" else module.weight.shape[0]
    if in_features % MX_BLOCK_SIZE:
        return f"in_features {in_features} is not a multiple of {MX_BLOCK_SIZE} (the MXFP4 block)"
    weight = module.weight
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point() or weight.is_meta:
        return "its weight is not a float tensor with data"
    return None


def _quantized(module: nn.Module, kind: str, rule: ScaleRule, name: str) -> MXFP4Linear:
    if kind == "conv1d":
        return MXFP4Linear.from_conv1d(module, rule, name=name)
    return MXFP4Linear.from_linear(module, rule, name=name)


def quantize_linears(model: nn.Module, scale_rule: ScaleRule | str = "floor", *, exclude: tuple[str, ...] = (),
                     return_skipped: bool = False):
    """Put an :class:`MXFP4Linear` in place of every linear layer of ``model`` (in place; returns ``model``).

    Linear layers: ``nn.Linear`` and its subclasses that keep its forward (``nn.MultiheadAttention``'s
    ``out_proj``, which its parent reads as ``.weight``: :attr:`MXFP4Linear.weight` gives the dequantized
    weight), and transformers' ``Conv1D`` (GPT-2; ``y = x @ W + b`` with W [in, out], quantized as W^T so that
    the blocks run along the contracted axis). The weights are quantized with ``scale_rule`` (floor | ceil |
    even | rceil, see :class:`fp4pass.ScaleRule`).

    Skipped, each with its reason: module names matching a pattern of ``exclude`` (fnmatch, e.g.
    ``"lm_head"``, ``"*.router"``), ``in_features`` not a multiple of 32, subclasses of ``nn.Linear`` with a
    forward of their own. Each is logged (INFO), and a summary line (WARNING) counts them;
    ``return_skipped=True`` returns ``(model, skipped)`` with ``skipped`` a list of ``(name, reason)``.
    """
    rule = ScaleRule(scale_rule)
    skipped: list[tuple[str, str]] = []
    kind = _kind(model)
    if kind is not None:
        reason = _skip_reason("", model, kind, exclude)
        if reason is None:
            model = _quantized(model, kind, rule, "linear")
        else:
            skipped.append(("", reason))
    else:
        targets = [(name, module, k) for name, module in model.named_modules() if (k := _kind(module)) is not None]
        for name, module, k in targets:
            reason = _skip_reason(name, module, k, exclude)
            if reason is not None:
                skipped.append((name, reason))
                continue
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, _quantized(module, k, rule, name))
    for name, reason in skipped:
        log.info("quantize_linears: %s skipped: %s", name or "<model>", reason)
    if skipped:
        log.warning("quantize_linears: %d linear layer(s) left in float: %s", len(skipped),
                    "; ".join(f"{n or '<model>'} ({r})" for n, r in skipped[:8]) + (" ..." if len(skipped) > 8 else ""))
    return (model, skipped) if return_skipped else model
