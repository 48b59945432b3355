"""Calibration overhead: ``calibrate_model`` over a data set, as a ratio to a plain onnxruntime run of the same
model over the same feeds (session creation included in both). Goal: <= 1.2x.

The model: an MLP x[T, K] -> MatMul(K, 4K) -> Relu -> MatMul(4K, K), both activations (x and the hidden one)
calibrated with the ``max`` calibrator (what ``convert --calib`` runs by default).
"""

from __future__ import annotations

import time

import numpy as np
import onnx_ir as ir
import torch
from onnx import TensorProto, helper, numpy_helper

from fp4pass.bench import BenchResult


def _mlp(k: int, seed: int = 0) -> ir.Model:
    rng = np.random.default_rng(seed)
    w1 = numpy_helper.from_array((rng.standard_normal((k, 4 * k)) / np.sqrt(k)).astype(np.float32), "w1")
    w2 = numpy_helper.from_array((rng.standard_normal((4 * k, k)) / np.sqrt(4 * k)).astype(np.float32), "w2")
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h_pre"]), helper.make_node("Relu", ["h_pre"], ["h"]),
             helper.make_node("MatMul", ["h", "w2"], ["y"])]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", k])], [w1, w2])
    return ir.serde.deserialize_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)],
                                                        ir_version=10))


def bench_calibration_overhead(device: torch.device, quick: bool) -> list[BenchResult]:
    from fp4pass.onnx.calibrate import calibrate_model
    from fp4pass.onnx.runtime import make_session

    provider = "cuda" if device.type == "cuda" else "cpu"
    k, tokens, batches = (256, 128, 8) if quick else (1024, 512, 16)
    model = _mlp(k)
    rng = np.random.default_rng(1)
    feeds = [{"x": rng.standard_normal((tokens, k)).astype(np.float32)} for _ in range(batches)]

    def plain():
        session, _, _ = make_session(model, provider)
        for feed in feeds:
            session.run(None, feed)

    def calibrate():
        return calibrate_model(model, feeds, "max", provider, activations=["x", "h"], device=device)

    def best(fn, repeat=3):
        fn()
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return min(times)

    base, calib = best(plain), best(calibrate)
    values = 2 * tokens * k * batches + tokens * 4 * k * batches
    return [BenchResult(f"calibrate max, 2 activations [{provider}]", calib, "plain onnxruntime run, same feeds",
                        base, goal=1.2, extra={"activation_values": values, "batches": batches, "k": k})]


BENCHMARKS = [bench_calibration_overhead]
