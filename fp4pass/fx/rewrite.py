"""The fx pass: ``fp4pass.dequantize_mxfp4(get_attr codes, get_attr scales)`` -> ``fp4pass.dequantize_nvfp4``.

For each MXFP4 dequant node whose codes and scales are constants of the GraphModule (``get_attr``), the
weight is converted with :func:`fp4pass.convert.mxfp4_to_nvfp4` and the node is replaced by an NVFP4
dequant of three new buffers: ``{weight}_nvfp4_codes``, ``{weight}_nvfp4_scales`` (E4M3 codes, never
multiplied by the global scale) and ``{weight}_nvfp4_global_scale`` (FP32, per expert for 3-D weights).

Declined, with the reason in the report:
1. codes or scales computed in the graph or passed as inputs (not a constant we can rewrite);
2. anything :class:`~fp4pass.formats.MXFP4Tensor` rejects (shape mismatch, E8M0 code 255): raised, since
   that is bad input, not a pattern to skip.
"""

from __future__ import annotations

import logging

import torch
import torch.fx

from fp4pass.formats import MXFP4Tensor

# Registers torch.ops.fp4pass.* before the graph is searched.
from fp4pass.fx import ops  # noqa: F401

__all__ = ["MXFP4ToNVFP4FxPass", "convert"]

log = logging.getLogger(__name__)


def _fetch_attr(gm: torch.nn.Module, target: str) -> torch.Tensor:
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


class MXFP4ToNVFP4FxPass:
    """Rewrite constant MXFP4 dequant nodes into NVFP4 dequant nodes (see the module docstring)."""

    def __init__(self, method: str = "auto", group_dims: int | None = None):
        self.method = method
        self.group_dims = group_dims

    def check(self, node: torch.fx.Node) -> str | None:
        """Why ``node`` cannot be rewritten, or None when it can."""
        for role, arg in zip(("codes", "scales"), node.args[:2]):
            if not isinstance(arg, torch.fx.Node) or arg.op != "get_attr":
                return f"{role} is not a constant of the module (op {getattr(arg, 'op', type(arg).__name__)})"
        return None

    def __call__(self, gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, dict]:
        report = {"tensors": [], "declined": []}
        # symbolic_trace records the op packet, torch.export its default overload
        targets = (torch.ops.fp4pass.dequantize_mxfp4, torch.ops.fp4pass.dequantize_mxfp4.default)
        for node in list(gm.graph.nodes):
            if node.op != "call_function" or node.target not in targets:
                continue
            reason = self.check(node)
            if reason:
                report["declined"].append({"node": node.name, "reason": reason})
                log.info("fx: %s declined: %s", node.name, reason)
                continue
            from fp4pass.convert import mxfp4_to_nvfp4

            codes_attr, scales_attr = node.args[0].target, node.args[1].target
            weight = codes_attr.rsplit(".", 1)[0] if "." in codes_attr else codes_attr
            mx = MXFP4Tensor.from_codes(_fetch_attr(gm, codes_attr), _fetch_attr(gm, scales_attr), name=weight)
            nv, stats = mxfp4_to_nvfp4(mx, method=self.method, group_dims=self.group_dims)
            base = weight.replace(".", "_")
            names = [f"{base}_nvfp4_codes", f"{base}_nvfp4_scales", f"{base}_nvfp4_global_scale"]
            for name, tensor in zip(names, (nv.codes, nv.scales, nv.global_scale)):
                gm.register_buffer(name, tensor)
            with gm.graph.inserting_before(node):
                attrs = [gm.graph.get_attr(name) for name in names]
                replacement = gm.graph.call_function(torch.ops.fp4pass.dequantize_nvfp4.default, tuple(attrs))
            replacement.meta.update(node.meta)
            node.replace_all_uses_with(replacement)
            gm.graph.erase_node(node)
            report["tensors"].append({"node": node.name, "weight": weight, **stats})
        gm.graph.eliminate_dead_code()
        gm.delete_all_unused_submodules()
        gm.recompile()
        return gm, report


def convert(graph_module: torch.fx.GraphModule, method: str = "auto", group_dims: int | None = None):
    """Rewrite every constant MXFP4 dequant of ``graph_module`` to NVFP4 in place; return (gm, report)."""
    return MXFP4ToNVFP4FxPass(method, group_dims)(graph_module)
