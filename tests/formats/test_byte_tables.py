"""``fp4pass.formats.byte_tables``: every E2M1 byte table against ml_dtypes' float4_e2m1fn, and the one cache.

The oracle decodes each nibble on its own (ml_dtypes, never fp4pass's codecs); packed bytes are read in element
order, low nibble first, and words as numpy reads two little-endian bytes, so a table with its nibbles or its
bytes the wrong way round fails here, and so does a caller that keeps a table of its own.
"""

from __future__ import annotations

import sys
import threading

import ml_dtypes
import numpy as np
import pytest
import torch

from fp4pass.formats import byte_tables

E2M1 = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)


def _elements(packed: np.ndarray) -> np.ndarray:
    """float32 values of packed bytes in element order (each byte's low nibble first), by ml_dtypes."""
    return E2M1[np.stack([packed & 0x0F, packed >> 4], axis=-1)].reshape(-1)


def test_byte_values_are_each_bytes_two_nibbles_low_first():
    table = byte_tables.byte_values().numpy()
    assert table.shape == (256, 2) and table.dtype == np.float32
    expected = _elements(np.arange(256, dtype=np.uint8)).reshape(256, 2)
    np.testing.assert_array_equal(table.view(np.uint32), expected.view(np.uint32))  # -0.0 kept apart from 0.0


@pytest.mark.skipif(sys.byteorder != "little", reason="the word tables read two bytes as a little-endian int16")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_word_values_decode_packed_bytes_read_as_words(dtype):
    packed = np.random.default_rng(7).integers(0, 256, size=4096, dtype=np.uint8)
    packed[:4] = [0x01, 0x80, 0xF7, 0x2E]  # different nibbles in each half of both bytes of a word
    words = torch.from_numpy(packed.view(np.int16).astype(np.int64) & 0xFFFF)
    table = byte_tables.word_values("cpu", dtype)
    assert table.shape == (65536, 4) and table.dtype == dtype
    got = table[words].float().reshape(-1).numpy()
    np.testing.assert_array_equal(got.view(np.uint32), _elements(packed).view(np.uint32))


def test_scaled_pairs_multiply_each_scale_codes_row():
    multipliers = torch.from_numpy(np.geomspace(1e-3, 7e2, 256).astype(np.float32))  # 256 distinct scales
    table = byte_tables.scaled_pairs(multipliers).view(torch.float32).reshape(256, 256, 2).numpy()
    pairs = _elements(np.arange(256, dtype=np.uint8)).reshape(1, 256, 2)
    expected = (pairs * multipliers.numpy().reshape(256, 1, 1)).astype(np.float32)  # one float32 rounding
    np.testing.assert_array_equal(table, expected)


def test_mxfp4_scaled_pairs_are_powers_of_two_of_the_e8m0_code():
    table = byte_tables.mxfp4_scaled_pairs().view(torch.float32).reshape(256, 256, 2).numpy().astype(np.float64)
    pairs = _elements(np.arange(256, dtype=np.uint8)).reshape(1, 256, 2).astype(np.float64)
    power = np.arange(255, dtype=np.uint8).view(ml_dtypes.float8_e8m0fnu).astype(np.float64).reshape(255, 1, 1)
    with np.errstate(over="ignore"):  # 6 * 2^127 is past float32's largest: inf, in the table too
        expected = (pairs * power).astype(np.float32)
    np.testing.assert_array_equal(table[:255], expected)  # code 255 (NaN) is refused before any lookup


def test_one_table_per_device_and_dtype_however_many_threads_ask():
    byte_tables._TABLES.clear()
    found: list[torch.Tensor] = []
    threads = [threading.Thread(target=lambda: found.append(byte_tables.word_values("cpu", torch.bfloat16)))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(t) for t in found}) == 1 and found[0].dtype == torch.bfloat16
    assert byte_tables.word_values("cpu") is byte_tables.word_values(torch.device("cpu"))
    assert byte_tables.word_values("cpu").dtype == torch.float32 and byte_tables.word_values("cpu") is not found[0]


def test_every_byte_table_decoder_reads_the_one_cache():
    """The fx dequant, the checkpoint loader's MXFP4 decode and the NVFP4 reader take their tables from here."""
    from fp4pass.checkpoint.layerwise.decode import mx_dequantize
    from fp4pass.checkpoint.nvfp4_weights import MULTIPLIER, decode_nvfp4
    from fp4pass.fx.dequant import dequantize_mxfp4

    codes = torch.arange(32, dtype=torch.uint8).reshape(2, 16)
    byte_tables._TABLES.clear()
    dequantize_mxfp4(codes, torch.full((2, 1), 127, dtype=torch.uint8))
    assert {key[0] for key in byte_tables._TABLES} == {"mxfp4 pairs", "bytes"}
    byte_tables._TABLES.clear()
    mx_dequantize(codes, torch.full((2, 1), 127, dtype=torch.uint8), torch.bfloat16, "w")
    assert [key[::2] for key in byte_tables._TABLES] == [("words", torch.bfloat16)]
    byte_tables._TABLES.clear()
    decode_nvfp4(codes, torch.full((2, 2), 0x38, dtype=torch.uint8), torch.tensor(1.0), MULTIPLIER)
    assert [key[::2] for key in byte_tables._TABLES] == [("words", torch.float32)]
