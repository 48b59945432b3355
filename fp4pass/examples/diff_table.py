"""The checkpoint diff's results table of docs/checkpoint.md: fp4pass's conversion against plain NVFP4
requantization of the same weights (ModelOpt's recipe: dequantize, then amax/2688 global scales and E4M3 block
scales), on the bundled examples, W4A16 and W4A4 (both with the same calibrated input scales).

    python -m fp4pass.examples.diff_table            # prints the markdown table (about a minute on 2 cores)

For each bundled MXFP4 checkpoint and form: ``convert --method auto`` and ``--method requant``, then
``fp4pass.checkpoint.diff`` of each against the source on ``models/checkpoints/calib_tokens.npz``.
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "models" / "checkpoints"
TOKENS = ROOT / "calib_tokens.npz"
#: bundled example -> the form written (gpt-oss's fused stacks have only ModelOpt's)
EXAMPLES = {"gpt_oss": "modelopt", "deepseek_v3": "compressed-tensors", "deepseek": "compressed-tensors"}
BATCH = 4


def _worst(result) -> str:
    rows = [r for r in result.layers if r["snr_db_local"] is not None]
    if not rows:
        return "identical"
    row = min(rows, key=lambda r: r["snr_db_local"])
    return f"{row['index']} ({row['snr_db_local']:.2f} dB)"


def _cells(result) -> list[str]:
    lg = result.logits
    kl = "0" if lg["kl_mean"] == 0 else f"{lg['kl_mean']:.3g}"
    e2e = result.layers[-1]["snr_db_end_to_end"]
    last = "identical" if e2e is None else ("NaN/Inf" if not math.isfinite(e2e) else f"{e2e:.2f}")
    return [kl, f"{lg['top1_agreement']:.2%}", _worst(result), last]


def table() -> str:
    import fp4pass.checkpoint

    lines = ["| model | form | activations | method | KL mean (nats) | top-1 agreement | worst layer (local SNR) "
             "| last layer end-to-end SNR (dB) |", "|---|---|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory(prefix="fp4pass-diff-table-") as tmp:
        for name, fmt in EXAMPLES.items():
            scales = fp4pass.checkpoint.calibrate(ROOT / name, TOKENS, batch_size=BATCH, device="cpu")
            for activations, given in (("W4A16", None), ("W4A4", scales)):
                for method in ("auto", "requant"):
                    out = Path(tmp) / f"{name}-{activations}-{method}"
                    fp4pass.checkpoint.convert(ROOT / name, out, format=fmt, scales=given, method=method)
                    result = fp4pass.checkpoint.diff(ROOT / name, out, TOKENS, batch_size=BATCH, device="cpu")
                    label = "fp4pass (auto)" if method == "auto" else "plain requantization"
                    lines.append("| " + " | ".join([name, fmt, activations, label, *_cells(result)]) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
