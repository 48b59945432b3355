"""``fp4pass.onnx.diff`` on a mid-size model, against two plain onnxruntime sessions on the same inputs.

The model: ``layers`` x (MXFP4 DequantizeLinear [H, H] -> Transpose -> MatMul -> Relu), tokens x H input.
A is that model, B the same with the weights as NVFP4 (ModelOpt two-DQ form). The baseline is what any
check must at least do: create a session for each (already lowered, serialized) model and run it once on
the same inputs. The diff adds reading both files, lowering, and the metrics. Goal: <= 1.5x.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import torch
from onnx import TensorProto, helper, numpy_helper

from fp4pass.bench import BenchResult, measure
from fp4pass.formats import MXFP4Tensor, NVFP4Tensor


def _model(weights: list[torch.Tensor], form: str, tokens: int) -> onnx.ModelProto:
    hidden = weights[0].shape[0]
    nodes, inits, x = [], [], "x"
    for i, w in enumerate(weights):
        if form == "mx":
            mx = MXFP4Tensor.quantize(w)
            codes = mx.element_codes().numpy().view(ml_dtypes.float4_e2m1fn)
            inits += [numpy_helper.from_array(codes, f"w{i}"),
                      numpy_helper.from_array(mx.scales.numpy().view(ml_dtypes.float8_e8m0fnu), f"s{i}")]
            nodes.append(helper.make_node("DequantizeLinear", [f"w{i}", f"s{i}"], [f"w{i}_f"], axis=-1,
                                          block_size=32, output_dtype=TensorProto.FLOAT))
        else:
            nv = NVFP4Tensor.quantize(w)
            codes = nv.element_codes().numpy().view(ml_dtypes.float4_e2m1fn)
            inits += [numpy_helper.from_array(codes, f"w{i}"),
                      numpy_helper.from_array(nv.scales.numpy().view(ml_dtypes.float8_e4m3fn), f"s{i}"),
                      numpy_helper.from_array(nv.global_scale.numpy().astype(np.float32), f"g{i}")]
            nodes += [helper.make_node("DequantizeLinear", [f"s{i}", f"g{i}"], [f"s{i}_f"]),
                      helper.make_node("DequantizeLinear", [f"w{i}", f"s{i}_f"], [f"w{i}_f"], axis=-1, block_size=16)]
        nodes += [helper.make_node("Transpose", [f"w{i}_f"], [f"w{i}_t"], perm=[1, 0]),
                  helper.make_node("MatMul", [x, f"w{i}_t"], [f"h{i}"]),
                  helper.make_node("Relu", [f"h{i}"], [f"a{i}"])]
        x = f"a{i}"
    graph = helper.make_graph(nodes, f"bench_{form}",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [tokens, hidden])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, [tokens, hidden])], initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24)], ir_version=12)


def bench_diff(device: torch.device, quick: bool) -> list[BenchResult]:
    from fp4pass.onnx.lower import lower_for_ort
    from fp4pass.onnx.numerics import diff
    from fp4pass.onnx.runtime import cuda_available

    if device.type != "cpu":
        return []  # the provider is onnxruntime's choice ("auto"), not torch's device: one row is enough
    layers, hidden, tokens = (2, 512, 32) if quick else (8, 2048, 128)
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(hidden, hidden, generator=gen) * 0.02 for _ in range(layers)]
    x = np.random.default_rng(0).standard_normal((tokens, hidden)).astype(np.float32)
    with tempfile.TemporaryDirectory(prefix="fp4pass-bench-diff-") as folder:
        path_a, path_b = Path(folder) / "a.onnx", Path(folder) / "b.onnx"
        onnx.save(_model(weights, "mx", tokens), path_a)
        onnx.save(_model(weights, "nv", tokens), path_b)
        lowered = [ir.serde.serialize_model(lower_for_ort(ir.load(p))).SerializeToString() for p in (path_a, path_b)]
        provider = "cuda" if cuda_available()[0] else "cpu"  # what diff's "auto" picks
        providers = ["CUDAExecutionProvider", "CPUExecutionProvider"] if provider == "cuda" else ["CPUExecutionProvider"]

        def two_sessions():
            for model in lowered:
                ort.InferenceSession(model, providers=providers).run(None, {"x": x})

        def run_diff():
            return diff(path_a, path_b, inputs={"x": x}, show_progress=False)

        baseline = measure(two_sessions, repeat=3)
        seconds = measure(run_diff, repeat=3)
        snr = run_diff().outputs[0].snr_db
    return [BenchResult(
        f"diff {layers}x[{hidden},{hidden}] mx vs nv [{provider}]", seconds,
        "2 plain ORT sessions (create + run), lowered models", baseline, goal=1.5,
        extra={"output_snr_db": snr, "fp4_weight_mb": layers * hidden * hidden / 2 / 2**20},
    )]


BENCHMARKS = [bench_diff]
