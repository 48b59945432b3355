"""MXFP4Tensor against independent oracles: numpy/ml_dtypes formulas, onnx.reference DQ-24, gpt-oss's dequant."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from fp4pass import MXFP4Tensor, ScaleRule
from fp4pass.errors import FormatError, ShapeError, NonFiniteError
from fp4pass.formats import unpack_nibbles
from oracles import mx_dq_model, mx_quantize_np, run_reference


def _wide(rng, shape):
    return (rng.standard_normal(shape) * np.exp2(rng.integers(-40, 40, shape))).astype(np.float32)


@pytest.mark.parametrize("rule", list(ScaleRule))
def test_quantize_matches_the_ocp_formulas(rule, device):
    rng = np.random.default_rng(0)
    for x in (rng.standard_normal((8, 128)).astype(np.float32), _wide(rng, (4, 256))):
        x[0, :32] = 0.0  # an all-zero block
        x[1, 32:64] = 1.5 * 2.0**3  # amax exactly at the RCEIL/EVEN boundaries
        x[1, 64:96] = 1.75
        mx = MXFP4Tensor.quantize(torch.from_numpy(x).to(device), scale_rule=rule)
        codes, scales = mx_quantize_np(x, rule.value)
        np.testing.assert_array_equal(unpack_nibbles(mx.codes).cpu().numpy(), codes)
        np.testing.assert_array_equal(mx.scales.cpu().numpy(), scales)


@settings(max_examples=60, deadline=None)
@given(arrays(np.float32, st.tuples(st.integers(1, 3), st.sampled_from([32, 64])),
              elements=st.floats(-2.0**100, 2.0**100, width=32, allow_subnormal=True)),
       st.sampled_from(list(ScaleRule)))
def test_quantize_property(x, rule):
    mx = MXFP4Tensor.quantize(torch.from_numpy(x), scale_rule=rule)
    codes, scales = mx_quantize_np(x, rule.value)
    np.testing.assert_array_equal(mx.scales.numpy(), scales)
    np.testing.assert_array_equal(unpack_nibbles(mx.codes).numpy(), codes)


def test_dequantize_matches_onnx_reference_dq24(device):
    rng = np.random.default_rng(1)
    codes = rng.integers(0, 256, (3, 16, 32), dtype=np.uint8)  # [E, N, K/2], K = 64
    scales = rng.integers(0, 255, (3, 16, 2), dtype=np.uint8)
    mx = MXFP4Tensor.from_codes(torch.from_numpy(codes).to(device), torch.from_numpy(scales).to(device))
    unpacked = unpack_nibbles(torch.from_numpy(codes)).numpy()
    (expected,) = run_reference(mx_dq_model(unpacked, scales))
    np.testing.assert_array_equal(mx.dequantize().cpu().numpy(), expected)


def test_dequantize_matches_gpt_oss_reference(tmp_path):
    weights = pytest.importorskip("gpt_oss.torch.weights", reason="gpt-oss package not installed")
    from safetensors.torch import save_file

    rng = np.random.default_rng(2)
    blocks = torch.from_numpy(rng.integers(0, 256, (2, 6, 4, 16), dtype=np.uint8))  # [E, N, K/32, 16]
    scales = torch.from_numpy(rng.integers(100, 150, (2, 6, 4), dtype=np.uint8))
    save_file({"w.blocks": blocks, "w.scales": scales}, str(tmp_path / "model.safetensors"))
    checkpoint = weights.Checkpoint(str(tmp_path), torch.device("cpu"))
    expected = checkpoint._get_mxfp4_tensor("w.blocks", "w.scales", dtype=torch.float32)
    ours = MXFP4Tensor.from_gpt_oss(blocks, scales).dequantize()
    assert torch.equal(ours, expected)


def test_from_codes_rejects_nan_scale_and_bad_shapes():
    codes = torch.zeros(4, 32, dtype=torch.uint8)
    scales = torch.full((4, 2), 127, dtype=torch.uint8)
    scales[2, 1] = 255
    with pytest.raises(FormatError, match=r"experts\.w scales: E8M0 code 255 \(NaN\) at index \(2, 1\)"):
        MXFP4Tensor.from_codes(codes, scales, name="experts.w")
    with pytest.raises(ShapeError, match="does not match 3 scales"):
        MXFP4Tensor.from_codes(codes, torch.ones(4, 3, dtype=torch.uint8))
    with pytest.raises(ShapeError, match="not a multiple of block 32"):
        MXFP4Tensor.quantize(torch.ones(2, 48))
    with pytest.raises(NonFiniteError):
        MXFP4Tensor.quantize(torch.tensor([[float("inf")] * 32]))


@pytest.mark.gpu
def test_to_moves_to_cuda_and_back_keeping_bytes():
    mx = MXFP4Tensor.quantize(torch.randn(2, 64), name="w")
    moved = mx.to("cuda")
    assert moved.codes.is_cuda and moved.scales.is_cuda and moved.device.type == "cuda"
    assert (moved.name, moved.block_size, moved.shape) == ("w", 32, (2, 64))
    back = moved.to("cpu")
    assert not back.codes.is_cuda
    assert torch.equal(back.codes, mx.codes) and torch.equal(back.scales, mx.scales)
    assert torch.equal(moved.dequantize().cpu(), mx.dequantize())
