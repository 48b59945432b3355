"""The conversion study: 27 tensor scenarios x every MXFP4 -> NVFP4 method (docs/conversion.md).

Each scenario draws a float32 tensor (shape 256x1024 unless named; ``torch.manual_seed(0)`` before each),
quantizes it to MXFP4 with the OCP FLOOR rule, converts it with every method and measures

- ``mse``: mean (x_nvfp4 - x_mxfp4)^2, the conversion's own error (0 = lossless),
- ``mse_vs_original``: mean (x_nvfp4 - x)^2, against the float tensor the MXFP4 came from,
- ``blocks16_verbatim`` / ``blocks16_total``: 16-halves whose nibbles were kept and reproduced exactly.

``spread`` is k_max - k_min over the MX blocks that hold a non-zero value (lossless verbatim iff <= 17).
The scenarios are named after common weight distributions and stress cases; their generators are
documented per scenario. The conv weight [64, 64, 4, 4] is blocked along its flattened fan-in (64*4*4).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from fp4pass.convert import mxfp4_to_nvfp4
from fp4pass.convert.layout import GroupLayout, exponent_range
from fp4pass.formats import MXFP4Tensor
from fp4pass.progress import progress

__all__ = ["Scenario", "SCENARIOS", "STUDY_METHODS", "run_scenario", "run_study", "format_study_table",
           "lossy_summary"]

#: study column -> (method, m_rule)
STUDY_METHODS = {
    "requant": ("requant", "search"),
    "verbatim_midpoint": ("verbatim", "midpoint"),
    "verbatim_search": ("verbatim", "search"),
    "hybrid": ("hybrid", "search"),
    "auto": ("auto", "search"),
}

SHAPE = (256, 1024)


@dataclass(frozen=True)
class Scenario:
    name: str
    make: Callable[[], torch.Tensor]  # float32 tensor, called right after torch.manual_seed(0)
    shape: tuple[int, ...] = SHAPE
    description: str = ""


def _signs(shape) -> torch.Tensor:
    return torch.where(torch.rand(shape) < 0.5, -1.0, 1.0)


def _exact_spread(spread: int, shape=SHAPE) -> torch.Tensor:
    """Blocks of 32 whose FLOOR-rule MX exponents take values 0..spread (both ends present): spread exact."""
    rows, k = shape
    blocks = torch.rand(rows, k // 32, 32) * 8 - 4  # |v| < 4 (k = floor(log2 amax) - 2 = 0 needs amax in [4, 8))
    blocks[..., 0] = _signs((rows, k // 32)) * (4 + torch.rand(rows, k // 32) * 3.99)
    exponent = torch.randint(0, spread + 1, (rows, k // 32)).float()
    exponent.view(-1)[0], exponent.view(-1)[1] = 0.0, float(spread)
    return (blocks * torch.exp2(exponent - spread // 2).unsqueeze(-1)).reshape(shape)


def _outliers(rate: float, factor: float) -> torch.Tensor:
    x = torch.randn(SHAPE)
    return torch.where(torch.rand(SHAPE) < rate, x * factor, x)


def _single_outlier() -> torch.Tensor:
    x = torch.randn(SHAPE) * 0.01
    x[0, 0] = 1e4
    return x


def _per_row() -> torch.Tensor:
    x = torch.randn(SHAPE)
    x[torch.rand(SHAPE[0]) < 0.02] *= 100
    return x


def _per_column() -> torch.Tensor:
    x = torch.randn(SHAPE)
    x[:, torch.rand(SHAPE[1]) < 0.02] *= 100
    return x


SCENARIOS: tuple[Scenario, ...] = (
    Scenario("uniform[-1,1]", lambda: torch.rand(SHAPE) * 2 - 1),
    Scenario("gaussian", lambda: torch.randn(SHAPE)),
    Scenario("heavy-tail N*|N|", lambda: torch.randn(SHAPE) * torch.randn(SHAPE).abs()),
    Scenario("narrow around 1.0", lambda: 1 + 0.01 * torch.randn(SHAPE)),
    Scenario("bimodal", lambda: _signs(SHAPE) + 0.1 * torch.randn(SHAPE), description="±1 + N(0, 0.1)"),
    Scenario("Pareto(1.5)", lambda: _signs(SHAPE) * torch.distributions.Pareto(1.0, 1.5).sample(SHAPE)),
    Scenario("strong bimodal signs", lambda: _signs(SHAPE) * (4 + 0.01 * torch.randn(SHAPE)), description="±4 + N(0, 0.01)"),
    Scenario("constant 1.5", lambda: torch.full(SHAPE, 1.5)),
    Scenario("rare outliers (1e-3, x100)", lambda: _outliers(1e-3, 100.0)),
    Scenario("per-row outliers", _per_row, description="2% of rows x100"),
    Scenario("per-column outliers", _per_column, description="2% of columns x100"),
    Scenario("single extreme outlier", _single_outlier, description="N(0, 0.01^2) with one 1e4"),
    Scenario("mixed block scales (spread 25)", lambda: _exact_spread(25)),
    Scenario("spread 15", lambda: _exact_spread(15)),
    Scenario("spread 17", lambda: _exact_spread(17)),
    Scenario("spread 18", lambda: _exact_spread(18)),
    Scenario("spread 50", lambda: _exact_spread(50)),
    Scenario("typical LLM weight", lambda: torch.randn(SHAPE) * 0.02, description="N(0, 0.02^2)"),
    Scenario("mostly zeros (1% non-zero)", lambda: torch.randn(SHAPE) * (torch.rand(SHAPE) < 0.01)),
    Scenario("subnormal-heavy (1e-8)", lambda: torch.randn(SHAPE) * torch.where(torch.rand(SHAPE) < 0.9, 1e-8, 1.0),
             description="N(0,1) with 90% of the values scaled by 1e-8"),
    Scenario("saturating at 6", lambda: (torch.randn(SHAPE) * 4).clamp(-6, 6)),
    Scenario("QKV 4096x4096", lambda: torch.randn(4096, 4096) * 0.02, (4096, 4096)),
    Scenario("MLP 1024x4096", lambda: torch.randn(1024, 4096) * 0.02, (1024, 4096)),
    Scenario("embedding 2048x1024", lambda: torch.randn(2048, 1024), (2048, 1024)),
    Scenario("LayerNorm gain", lambda: 1 + 0.05 * torch.randn(SHAPE)),
    Scenario("conv 64x64x4x4", lambda: torch.randn(64, 64, 4, 4) * math.sqrt(2 / (64 * 16)), (64, 64, 4, 4)),
    Scenario("large flat 1024x4096", lambda: torch.rand(1024, 4096) * 2 - 1, (1024, 4096)),
)


def make_tensor(scenario: Scenario, device: torch.device | str = "cpu") -> torch.Tensor:
    """The scenario's float32 tensor, 2-D (blocks along the last axis), drawn after torch.manual_seed(0)."""
    torch.manual_seed(0)
    x = scenario.make().float()
    return x.reshape(x.shape[0], -1).to(device)


def run_scenario(scenario: Scenario, device: torch.device | str = "cpu", methods=STUDY_METHODS) -> dict:
    """One row of the study JSON: {"name", "shape", "spread", "methods": {METHOD: {...}}}."""
    x = make_tensor(scenario, device)
    mx = MXFP4Tensor.quantize(x, scale_rule="floor", name=scenario.name)
    codes, scales = mx.codes, mx.scales
    k_max, k_min = exponent_range(codes, scales, GroupLayout.of(mx, 0))
    row = {"name": scenario.name, "shape": list(scenario.shape), "spread": int(k_max[0] - k_min[0]), "methods": {}}
    for column, (method, m_rule) in methods.items():
        _, stats = mxfp4_to_nvfp4(mx, method, group_dims=0, reference=x, m_rule=m_rule)
        row["methods"][column] = {
            "mse": stats.mse,
            "mse_vs_original": stats.mse_vs_reference,
            "blocks16_verbatim": stats.blocks16_verbatim,
            "blocks16_total": stats.blocks16_total,
        }
    return row


def run_study(device: torch.device | str = "cpu", scenarios=SCENARIOS, show_progress: bool | None = None) -> dict:
    """The whole study as JSON: {"device", "scenarios": [...]} (``fp4pass study --json``)."""
    rows = [run_scenario(s, device) for s in progress(scenarios, desc="study", enabled=show_progress)]
    return {"device": str(device), "scenarios": rows}


def format_study_table(study: dict) -> str:
    """A readable table: MSE vs MXFP4 per method, verbatim fraction of auto, and the winner(s)."""
    columns = list(STUDY_METHODS)
    header = f"{'scenario':<32} {'spread':>6} " + " ".join(f"{c:>17}" for c in columns) + f" {'auto verb%':>10}  best"
    lines = [header, "-" * len(header)]
    for row in study["scenarios"]:
        mses = {c: row["methods"][c]["mse"] for c in columns}
        best = min(mses.values())
        winners = [c for c in columns if mses[c] == best]
        auto = row["methods"]["auto"]
        verb = 100.0 * auto["blocks16_verbatim"] / auto["blocks16_total"]
        cells = " ".join(f"{mses[c]:>17.6e}" for c in columns)
        tag = "all lossless" if best == 0 and len(winners) >= 3 else ",".join(winners)
        lines.append(f"{row['name']:<32} {row['spread']:>6} {cells} {verb:>9.1f}%  {tag}")
    lines.append("mse: mean squared error vs the MXFP4 tensor (0 = lossless); mse_vs_original is in the JSON.")
    summary = lossy_summary(study)
    if summary["scenarios"]:
        lines.append(f"lossy scenarios ({summary['scenarios']}): geomean auto mse {summary['auto_geomean']:.6e}, "
                     f"geomean auto / min(requant, hybrid) {summary['auto_vs_best_peer']:.4f}")
    return "\n".join(lines)


def lossy_summary(study: dict) -> dict:
    """Over the scenarios where hybrid is lossy (auto's search runs there): geometric means of auto's MSE and
    of auto's MSE / min(requant, hybrid). {"scenarios": n, "auto_geomean", "auto_vs_best_peer"} (None if n = 0).
    """
    rows = [r["methods"] for r in study["scenarios"] if r["methods"]["hybrid"]["mse"] > 0]
    if not rows:
        return {"scenarios": 0, "auto_geomean": None, "auto_vs_best_peer": None}
    auto = [m["auto"]["mse"] for m in rows]
    ratio = [m["auto"]["mse"] / min(m["requant"]["mse"], m["hybrid"]["mse"]) for m in rows]
    mean_log = lambda values: sum(math.log(v) for v in values) / len(values)  # noqa: E731
    return {"scenarios": len(rows), "auto_geomean": math.exp(mean_log(auto)),
            "auto_vs_best_peer": math.exp(mean_log(ratio))}
