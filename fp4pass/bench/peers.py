"""fp4pass against NVIDIA ModelOpt's MXFP4 -> NVFP4 casts, side by side in one process on the same tensors.

Needs the optional extra ``peers`` (``pip install 'fp4pass[peers]'``: nvidia-modelopt 0.47.0, whose import
also needs requests and huggingface_hub). Pairs measured, each on the same MXFP4 bytes:

- ``auto`` (ours) against ModelOpt's closed-form cast ``quantize_mxfp4_to_nvfp4_lossless`` (k_max from
  ``mxfp4_to_nvfp4_global_amax``, one global scale per tensor);
- ``requant`` (ours) against ModelOpt's ``quantize_mxfp4_to_nvfp4`` (dequantize to BF16, NVFP4 with the
  synthesized amax/(6*448)).

The four calls run interleaved (ours, theirs, ours, theirs) for ``rounds`` rounds, so that load from other
processes on a shared machine hits both sides alike; each figure is the median of its rounds and ``noise`` is
(max - min) / median over them. MSE is against the MXFP4 values (float64), both outputs dequantized by
:meth:`NVFP4Tensor.dequantize`; ``same_values`` says whether both dequantize to the same tensor (ModelOpt's
requant and ours differ in bits only where a zero is signed, -0 ours, and in the unused block scale of an
all-zero half). Both sides use one global scale per tensor (ModelOpt's layout; ours would give each expert its
own). ModelOpt runs at torch's current intra-op threads, ours at its own default.
"""

from __future__ import annotations

import statistics
import time
import warnings

import torch

from fp4pass.bench import BenchResult
from fp4pass.convert import mxfp4_to_nvfp4
from fp4pass.formats import MXFP4Tensor, NVFP4Tensor

__all__ = ["peers_available", "INSTALL_HINT", "bench_peers", "lossy_expert_weight"]

INSTALL_HINT = ("fp4pass bench --peers needs NVIDIA ModelOpt: pip install 'fp4pass[peers]' "
                "(nvidia-modelopt==0.47.0, requests, huggingface_hub)")


def _modelopt():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from modelopt.torch.export import shard_cast_utils
        from modelopt.torch.quantization.utils import numeric_utils
    return shard_cast_utils, numeric_utils


def peers_available() -> bool:
    try:
        _modelopt()
    except ImportError:
        return False
    return True


def lossy_expert_weight(device: torch.device, shape=(8, 2880, 2880)) -> MXFP4Tensor:
    """N(0, 0.02^2) with one 1e4 per expert: spread ~20, most halves requantized (the lossy benchmark)."""
    torch.manual_seed(0)
    x = torch.randn(shape, device=device) * 0.02
    x[:, 0, 0] = 1e4
    return MXFP4Tensor.quantize(x)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device):
    _sync(device)
    start = time.perf_counter()
    out = fn()
    _sync(device)
    return time.perf_counter() - start, out


def _mse(nv: NVFP4Tensor, reference: torch.Tensor) -> float:
    return float((nv.dequantize().double() - reference).square().mean())


def bench_peers(device: torch.device, quick: bool = False, rounds: int = 3, log=print) -> list[BenchResult]:
    """The two pairs above, as BenchResults (ours vs ModelOpt's, ratio = ours / theirs; extra: MSEs, noise)."""
    sc, nu = _modelopt()
    shape = (2, 256, 2880) if quick else (8, 2880, 2880)
    mx = lossy_expert_weight(device, shape)
    reference = mx.dequantize().double()
    dev = str(device)
    k_max = nu.mxfp4_to_nvfp4_global_amax(mx.scales)[1]["k_max"]

    def theirs_cast():
        q, s, s2, _, _ = sc.quantize_mxfp4_to_nvfp4_lossless(mx.codes, mx.scales, k_max, dev)
        return NVFP4Tensor(q.view(torch.uint8), s.view(torch.uint8), s2.float())

    def theirs_requant():
        q, s, s2, _ = sc.quantize_mxfp4_to_nvfp4(mx.codes, mx.scales, None, dev)
        return NVFP4Tensor(q.view(torch.uint8), s.view(torch.uint8), s2.float())

    pairs = (("auto", lambda: mxfp4_to_nvfp4(mx, "auto", group_dims=0)[0], "ModelOpt cast (closed form)", theirs_cast),
             ("requant", lambda: mxfp4_to_nvfp4(mx, "requant", group_dims=0)[0], "ModelOpt requant", theirs_requant))
    times = {name: ([], []) for name, *_ in pairs}
    outputs = {}
    for _ in range(max(1, rounds)):
        for name, ours, _, theirs in pairs:
            t_ours, outputs[name, "ours"] = _timed(ours, device)
            t_theirs, outputs[name, "theirs"] = _timed(theirs, device)
            times[name][0].append(t_ours)
            times[name][1].append(t_theirs)
    results = []
    label = "x".join(map(str, shape))
    for name, _, peer, _ in pairs:
        ours_t, theirs_t = times[name]
        mine, other = outputs[name, "ours"], outputs[name, "theirs"]
        extra = {
            "peer_ms": statistics.median(theirs_t) * 1e3,
            "shape": label,
            "mse": _mse(mine, reference),
            "peer_mse": _mse(other, reference),
            "noise": (max(ours_t) - min(ours_t)) / statistics.median(ours_t),
            "peer_noise": (max(theirs_t) - min(theirs_t)) / statistics.median(theirs_t),
            "rounds": len(ours_t),
            "peer_threads": torch.get_num_threads(),
        }
        extra["mse_ratio"] = extra["mse"] / extra["peer_mse"] if extra["peer_mse"] > 0 else float("nan")
        extra["same_values"] = bool(torch.equal(mine.dequantize(), other.dequantize()))
        results.append(BenchResult(f"peers {name} lossy [{device.type}]", statistics.median(ours_t), peer,
                                   statistics.median(theirs_t), 1.0, extra, quick=quick))
    return results
