"""NVFP4Tensor against ModelOpt's published formulas (numpy + ml_dtypes) and onnx.reference's two-DQ form."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from fp4pass import NVFP4Tensor
from fp4pass.errors import FormatError, ShapeError
from fp4pass.formats import unpack_nibbles
from oracles import nv_dq_model, nv_quantize_np, run_reference


def _inputs():
    rng = np.random.default_rng(0)
    normal = rng.standard_normal((16, 128)).astype(np.float32)
    heavy = (rng.standard_normal((16, 128)) * np.abs(rng.standard_normal((16, 128))) ** 3).astype(np.float32)
    wide = (rng.standard_normal((8, 256)) * np.exp2(rng.integers(-30, 30, (8, 256)))).astype(np.float32)
    zeros = normal.copy()
    zeros[3, :16] = 0
    return {"normal": normal, "heavy": heavy, "wide": wide, "zero_block": zeros}


@pytest.mark.parametrize("kind", ["normal", "heavy", "wide", "zero_block"])
def test_quantize_matches_modelopt_formulas_bit_for_bit(kind, device):
    x = _inputs()[kind]
    nv = NVFP4Tensor.quantize(torch.from_numpy(x).to(device))
    codes, scales, g = nv_quantize_np(x)
    assert nv.global_scale.item() == g
    np.testing.assert_array_equal(nv.scales.cpu().numpy(), scales)
    np.testing.assert_array_equal(unpack_nibbles(nv.codes).cpu().numpy(), codes)


@settings(max_examples=60, deadline=None)
@given(arrays(np.float32, st.tuples(st.integers(1, 3), st.sampled_from([16, 48])),
              elements=st.floats(-2.0**66, 2.0**66, width=32, allow_subnormal=True)))
def test_quantize_property(x):
    nv = NVFP4Tensor.quantize(torch.from_numpy(x))
    codes, scales, g = nv_quantize_np(x)
    np.testing.assert_array_equal(nv.scales.numpy(), scales)
    np.testing.assert_array_equal(unpack_nibbles(nv.codes).numpy(), codes)


def test_per_group_global_scale_is_each_groups_amax():
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((3, 4, 32)) * np.array([1e-6, 1.0, 1e6])[:, None, None]).astype(np.float32)
    nv = NVFP4Tensor.quantize(torch.from_numpy(x), group_dims=1)
    assert nv.global_scale.shape == (3,)
    for e in range(3):
        codes, scales, g = nv_quantize_np(x[e])
        assert nv.global_scale[e].item() == g
        np.testing.assert_array_equal(nv.scales[e].numpy(), scales)
        np.testing.assert_array_equal(unpack_nibbles(nv.codes[e]).numpy(), codes)


@pytest.mark.parametrize("per_expert", [False, True])
def test_dequantize_matches_onnx_reference_two_dq(per_expert, device):
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((2, 8, 64)) * np.array([1e-3, 10.0])[:, None, None]).astype(np.float32)
    nv = NVFP4Tensor.quantize(torch.from_numpy(x).to(device), group_dims=int(per_expert))
    model = nv_dq_model(unpack_nibbles(nv.codes).cpu().numpy(), nv.scales.cpu().numpy(), nv.global_scale.cpu().numpy())
    (expected,) = run_reference(model)
    np.testing.assert_array_equal(nv.dequantize().cpu().numpy(), expected)


def test_explicit_global_scale_is_used_as_given():
    x = torch.randn(2, 32)
    nv = NVFP4Tensor.quantize(x, global_scale=0.5)
    codes, scales, _ = nv_quantize_np(x.numpy(), np.float32(0.5))
    assert nv.global_scale.item() == 0.5
    np.testing.assert_array_equal(nv.scales.numpy(), scales)


def test_bad_inputs_are_named():
    with pytest.raises(ShapeError, match="not a multiple of block 16"):
        NVFP4Tensor.quantize(torch.ones(2, 24))
    with pytest.raises(FormatError, match="global_scale must be finite and > 0"):
        NVFP4Tensor.quantize(torch.ones(2, 16), global_scale=0.0)
    with pytest.raises(ShapeError, match="does not match leading dims"):
        NVFP4Tensor.from_codes(torch.zeros(3, 8, dtype=torch.uint8), torch.zeros(3, 1, dtype=torch.uint8), torch.ones(4))
    with pytest.raises(ShapeError, match="does not match 2 scales"):
        NVFP4Tensor.from_codes(torch.zeros(3, 8, dtype=torch.uint8), torch.zeros(3, 2, dtype=torch.uint8), 1.0)
