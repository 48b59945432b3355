"""One expert stack through the three front doors: the ONNX pass, fx.convert and the checkpoint engine write the
same NVFP4 bytes, each expert as it converts alone.

The stack [5, 32, 128] has lossless experts (E8M0 spread <= 17) around one lossy expert (spread 23), one expert
whose all-zero block sits 3 octaves above its values, and one expert so small that 2^(k_max - 8) is a
float32 subnormal. Oracles: ml_dtypes decodes of the bytes (tests/support/fx_builders.py), the global scale
2^(max E8M0 - 127 - 8) of a lossless expert read off its scale bytes, and the per-expert call
``mxfp4_to_nvfp4(expert, group_dims=0)``, which sees no neighbour.
"""

from __future__ import annotations

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper

import fp4pass
import fp4pass.fx
import fp4pass.onnx
from fp4pass import MXFP4Tensor
from fp4pass.checkpoint.engine import convert_experts
from fx_builders import mxfp4_weight, nvfp4_weight

E, N, K = 5, 32, 128
LOSSY, ZERO_ABOVE, TINY = 2, 0, 4


def _stack() -> tuple[torch.Tensor, torch.Tensor]:
    rng = np.random.default_rng(11)
    scales = rng.integers(118, 125, (E, N, K // 32)) + np.array([0, 5, -3, 9, 0])[:, None, None]
    codes = rng.integers(0, 256, (E, N, K // 2), dtype=np.uint8)
    scales[LOSSY, 3, 1] = 97  # 23 octaves under the expert's top: lossy
    codes[LOSSY, 3, 16:32] = 0x77
    scales[ZERO_ABOVE, 5, 2] = 130  # an all-zero block, above every block that holds a value
    codes[ZERO_ABOVE, 5, 32:48] = 0x88  # -0 and -0
    scales[TINY] = rng.integers(1, 6, (N, K // 32))  # k_max - 8 < -126
    return torch.from_numpy(codes), torch.from_numpy(scales.astype(np.uint8))


def _through_fx(codes, scales):
    root = torch.nn.Module()
    root.register_buffer("codes", codes)
    root.register_buffer("scales", scales)
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    w = graph.call_function(torch.ops.fp4pass.dequantize_mxfp4.default, (graph.get_attr("codes"),
                                                                           graph.get_attr("scales")))
    y = graph.call_function(torch.ops.aten.bmm.default,
                            (x, graph.call_function(torch.ops.aten.transpose.int, (w, 1, 2))))
    graph.output(y)
    gm, report = fp4pass.fx.convert(torch.fx.GraphModule(root, graph))
    (node,) = [n for n in gm.graph.nodes if n.target == torch.ops.fp4pass.dequantize_nvfp4.default]
    parts = [getattr(gm, a.target) for a in node.args]
    return parts, report["tensors"][0]


def _through_onnx(codes, scales):
    inits = [helper.make_tensor("W", TensorProto.FLOAT4E2M1, [E, N, K], vals=codes.numpy().tobytes(), raw=True),
             helper.make_tensor("W_scale", TensorProto.FLOAT8E8M0, [E, N, K // 32], vals=scales.numpy().tobytes(),
                                raw=True)]
    nodes = [helper.make_node("DequantizeLinear", ["W", "W_scale"], ["W_dq"], name="dq", axis=-1, block_size=32,
                              output_dtype=TensorProto.FLOAT),
             helper.make_node("Transpose", ["W_dq"], ["W_t"], name="t", perm=[0, 2, 1]),
             helper.make_node("MatMul", ["x", "W_t"], ["y"], name="mm")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [E, "t", K])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [E, "t", N])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24)], ir_version=12)
    out, report = fp4pass.onnx.convert(model)
    found = {t.name: t for t in out.graph.initializer}
    assert found["W"].data_type == TensorProto.FLOAT4E2M1
    assert found["W_scale_e4m3"].data_type == TensorProto.FLOAT8E4M3FN
    parts = [torch.frombuffer(bytearray(found["W"].raw_data), dtype=torch.uint8).reshape(E, N, K // 2),
             torch.frombuffer(bytearray(found["W_scale_e4m3"].raw_data), dtype=torch.uint8).reshape(E, N, K // 16),
             torch.from_numpy(onnx.numpy_helper.to_array(found["W_global_scale"]).copy())]
    return parts, report["tensors"][0]


def test_three_front_doors_write_the_same_bytes_expert_by_expert():
    codes, scales = _stack()
    source = codes.clone(), scales.clone()
    mx = MXFP4Tensor(codes, scales, 32, name="W")
    nv, parts = convert_experts(mx)
    checkpoint = [nv.codes, nv.scales, nv.global_scale]
    fx, fx_entry = _through_fx(codes, scales)
    onnx_parts, onnx_entry = _through_onnx(codes, scales)
    for door in (fx, onnx_parts):
        for mine, theirs in zip(door, checkpoint):
            assert torch.equal(mine.reshape(theirs.shape), theirs)
    assert torch.equal(codes, source[0]) and torch.equal(scales, source[1])  # no door writes its input
    # each expert exactly as it converts alone (no neighbour in sight)
    for e in range(E):
        alone, stats = fp4pass.mxfp4_to_nvfp4(MXFP4Tensor(codes[e], scales[e], 32), group_dims=0)
        assert torch.equal(alone.codes, nv.codes[e]) and torch.equal(alone.scales, nv.scales[e])
        assert float(alone.global_scale) == float(nv.global_scale[e])
        assert parts[e]["blocks16_requantized"] == stats.blocks16_requantized
    # lossless experts: the MXFP4 values bit for bit, the global scale 2^(max E8M0 - 127 - 8) from the bytes
    for e in range(E):
        if e in (LOSSY, TINY):
            continue
        assert float(nv.global_scale[e]) == 2.0 ** (int(scales[e].max()) - 127 - 8)
        np.testing.assert_array_equal(nvfp4_weight(nv.codes[e], nv.scales[e], nv.global_scale[e]),
                                      mxfp4_weight(codes[e], scales[e]))
    lossless = [not (e == LOSSY) for e in range(E)]
    assert [p["lossless"] for p in parts] == lossless
    assert [p["lossless"] for p in fx_entry["per_expert"]] == lossless
    assert [p["lossless"] for p in onnx_entry["per_expert"]] == lossless
    requantized = parts[LOSSY]["blocks16_requantized"]
    assert fx_entry["blocks16_requantized"] == onnx_entry["blocks16_requantized"] == requantized > 0
    # the tensor's SNR: signal over all five experts (decoded here), error of the lossy one only
    x = mxfp4_weight(codes, scales).astype(np.float64)
    y = nvfp4_weight(nv.codes, nv.scales, nv.global_scale).astype(np.float64)
    snr = 10 * np.log10(np.square(x).sum() / np.square(y - x).sum())
    assert abs(fx_entry["snr_db"] - snr) < 1e-9 and abs(onnx_entry["snr_db"] - snr) < 1e-9
    lossy_x, lossy_y = x[LOSSY], y[LOSSY]
    expert_snr = 10 * np.log10(np.square(lossy_x).sum() / np.square(lossy_y - lossy_x).sum())
    assert abs(fx_entry["per_expert"][LOSSY]["snr_db"] - expert_snr) < 1e-9
    assert abs(parts[LOSSY]["snr_db"] - expert_snr) < 1e-9
