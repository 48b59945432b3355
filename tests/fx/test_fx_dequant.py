"""The lean FP4 dequant (fp4pass.fx.dequant) against independent oracles: the gpt-oss package's reference
dequant (gpt_oss.torch.weights) per expert, and ml_dtypes' float4_e2m1fn / float8_e8m0fnu / float8_e4m3fn
decoders. Also: the output is the only large allocation (chunks), and bad bytes are refused."""

import ml_dtypes
import numpy as np
import pytest
import torch

from fp4pass.errors import FormatError, ShapeError
from fp4pass.fx import dequant


def _np_unpack(codes: np.ndarray) -> np.ndarray:
    """Packed bytes [..., K/2] -> E2M1 codes [..., K], element 2i in the low nibble."""
    out = np.empty((*codes.shape[:-1], codes.shape[-1] * 2), dtype=np.uint8)
    out[..., 0::2] = codes & 0x0F
    out[..., 1::2] = codes >> 4
    return out


def _e2m1(codes: np.ndarray) -> np.ndarray:
    return _np_unpack(codes).view(ml_dtypes.float4_e2m1fn).astype(np.float32)


def _mx_oracle(codes, scales):
    scale = scales.view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    values = _e2m1(codes)
    with np.errstate(over="ignore"):  # 6 * 2^127 is inf in float32, as in the format's float32 decode
        return (values.reshape(*scales.shape, 32) * scale[..., None]).reshape(values.shape)


def _nv_oracle(codes, scales, g):
    block = scales.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    g = np.asarray(g, dtype=np.float32).reshape(*np.shape(g), *([1] * (scales.ndim - np.ndim(g))))
    values = _e2m1(codes)
    return (values.reshape(*scales.shape, 16) * (block * g)[..., None]).reshape(values.shape)


def _random_mx(shape, seed):
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 256, (*shape[:-1], shape[-1] // 2), dtype=np.uint8)
    scales = rng.integers(0, 255, (*shape[:-1], shape[-1] // 32), dtype=np.uint8)  # the whole finite range
    scales.flat[:3] = (0, 254, 127)  # 2^-127 (subnormal products), 2^127 (6 * 2^127 overflows to inf), 1
    return codes, scales


@pytest.mark.parametrize("chunk", [dequant.CHUNK_ELEMENTS, 64, 100])  # whole rows per chunk, even when < a row
def test_mxfp4_matches_ml_dtypes_bit_for_bit(chunk):
    codes, scales = _random_mx((3, 10, 96), seed=chunk)
    got = dequant.dequantize_mxfp4(torch.from_numpy(codes), torch.from_numpy(scales), chunk_elements=chunk)
    want = _mx_oracle(codes, scales)
    assert got.dtype == torch.float32 and tuple(got.shape) == want.shape
    np.testing.assert_array_equal(got.numpy().view(np.uint32), want.view(np.uint32))  # -0.0 and inf included
    assert np.isinf(want).any() and (want.view(np.uint32) == 0x80000000).any()


@pytest.mark.parametrize("g_shape, tables", [((), 256), ((3,), 256), ((3, 10), 256), ((3, 10), 0), ((3,), 0)])
def test_nvfp4_matches_ml_dtypes_bit_for_bit(g_shape, tables, monkeypatch):
    """A table per global-scale group, or (past ``_MAX_TABLES`` groups) a multiply pass: the same bits."""
    monkeypatch.setattr(dequant, "_MAX_TABLES", tables)
    rng = np.random.default_rng(len(g_shape))
    codes = rng.integers(0, 256, (3, 10, 48), dtype=np.uint8)
    scales = rng.integers(0, 0x7F, (3, 10, 6), dtype=np.uint8)  # every finite E4M3 code, subnormals included
    g = (rng.random(g_shape) * 2.0 ** rng.integers(-20, 5, g_shape) + 1e-6).astype(np.float32)
    got = dequant.dequantize_nvfp4(torch.from_numpy(codes), torch.from_numpy(scales), torch.from_numpy(np.asarray(g)),
                                   chunk_elements=200)
    np.testing.assert_array_equal(got.numpy().view(np.uint32), _nv_oracle(codes, scales, g).view(np.uint32))


def test_each_expert_equals_the_gpt_oss_reference_dequant(tmp_path):
    """Per expert, bit for bit, with the gpt-oss package's own chunked dequant (float32 and bf16)."""
    weights = pytest.importorskip("gpt_oss.torch.weights")
    from safetensors.torch import save_file

    codes, scales = _random_mx((4, 24, 64), seed=7)
    blocks = torch.from_numpy(codes).reshape(4, 24, 2, 16)
    save_file({"w.blocks": blocks.contiguous(), "w.scales": torch.from_numpy(scales)},
              str(tmp_path / "model.safetensors"))
    ck = weights.Checkpoint(str(tmp_path), torch.device("cpu"))
    ours = dequant.dequantize_mxfp4(torch.from_numpy(codes), torch.from_numpy(scales), chunk_elements=3 * 64)
    for dtype in (torch.float32, torch.bfloat16):
        ref = ck._get_mxfp4_tensor("w.blocks", "w.scales", dtype=dtype)
        for e in range(4):
            assert torch.equal(ours[e].to(dtype).view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                               ref[e].view(torch.int16 if dtype == torch.bfloat16 else torch.int32)), (dtype, e)


def test_custom_ops_use_the_lean_path_and_agree_with_it():
    codes, scales = _random_mx((2, 8, 64), seed=3)
    c, s = torch.from_numpy(codes), torch.from_numpy(scales)
    assert torch.equal(torch.ops.fp4pass.dequantize_mxfp4(c, s).view(torch.int32),
                       torch.from_numpy(_mx_oracle(codes, scales)).view(torch.int32))
    s4 = torch.randint(0, 0x7F, (2, 8, 4), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    g = torch.tensor([0.25, 3.0])
    want = _nv_oracle(codes, s4.numpy(), g.numpy())
    assert torch.equal(torch.ops.fp4pass.dequantize_nvfp4(c, s4, g).view(torch.int32),
                       torch.from_numpy(want).view(torch.int32))


def test_peak_temporaries_stay_a_chunk(monkeypatch):
    """Every temporary the loop allocates is at most a chunk: no wide index over the whole tensor."""
    codes, scales = _random_mx((8, 64, 128), seed=5)
    seen = []
    real_to = torch.Tensor.to

    def spy(self, *args, **kwargs):
        out = real_to(self, *args, **kwargs)
        seen.append(out.numel())
        return out

    monkeypatch.setattr(torch.Tensor, "to", spy)
    chunk = 1024
    dequant.dequantize_mxfp4(torch.from_numpy(codes), torch.from_numpy(scales), chunk_elements=chunk)
    assert seen and max(seen) <= chunk // 2  # int32 index: one per packed byte of a chunk


def test_bad_bytes_and_shapes_are_refused():
    codes, scales = _random_mx((2, 64), seed=1)
    scales[1, 1] = 255
    with pytest.raises(FormatError, match="255"):
        dequant.dequantize_mxfp4(torch.from_numpy(codes), torch.from_numpy(scales))
    with pytest.raises(ShapeError, match="K=64"):
        dequant.dequantize_mxfp4(torch.from_numpy(codes), torch.from_numpy(scales[:, :1]))
    s4 = torch.zeros(2, 4, dtype=torch.uint8)
    with pytest.raises(ShapeError, match="global scale"):
        dequant.dequantize_nvfp4(torch.from_numpy(codes), s4, torch.ones(3))
    with pytest.raises(FormatError, match="finite"):
        dequant.dequantize_nvfp4(torch.from_numpy(codes), s4, torch.tensor(float("nan")))
