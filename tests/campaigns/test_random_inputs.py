"""Random inputs of ``diff`` and ``convert --check``: static dims held to the same 2^30-element limit as
``--shape``, and drawn in the input's own width (no float64 array on the way)."""

from __future__ import annotations

import tracemalloc

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

import onnx_builders as B
from cli_helpers import cli
from fp4pass.commands.diff import MAX_INPUT_ELEMENTS
from fp4pass.errors import UsageError
from fp4pass.onnx.numerics import MAX_RANDOM_ELEMENTS, make_inputs


def identity_model(dims, dtype=TensorProto.FLOAT) -> onnx.ModelProto:
    node = helper.make_node("Identity", ["x"], ["y"], name="id")
    return B.make([node], [B.vi("x", dims, dtype)], [B.vi("y", dims, dtype)], [])


def test_the_limit_is_the_one_shape_documents():
    assert MAX_RANDOM_ELEMENTS == MAX_INPUT_ELEMENTS == 2**30


@pytest.mark.parametrize("dims", [[2**62, 4], [2**31, 1], [2**15, 2**15 + 1], [0, 2**62], [2**40, 0, 3]])
def test_a_huge_static_dim_is_exit_2_naming_the_input(tmp_path, capsys, dims):
    path = tmp_path / "m.onnx"
    onnx.save(identity_model(dims), path)
    code, err = cli(capsys, "diff", path, path, "--quiet")
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err
    assert "'x'" in lines[0] and "2^30" in lines[0]


def test_static_dims_at_the_limit_are_drawn():
    """2^30 elements pass the check (the limit is inclusive), shown without drawing them: a smaller model
    proves the same code path draws."""
    model = ir.serde.deserialize_model(identity_model([4, 8]))
    feeds = make_inputs(model)
    assert feeds["x"].shape == (4, 8) and feeds["x"].dtype == np.float32


def test_shape_counts_a_zero_dim_as_one(capsys, tmp_path):
    """--shape x=0,2^62 is refused like the static dims: numpy cannot make that array, empty or not."""
    path = tmp_path / "m.onnx"
    onnx.save(identity_model(["n", "m"]), path)
    code, err = cli(capsys, "diff", path, path, "--shape", f"x=0,{2**62}", "--quiet")
    assert code == 2 and "2^30" in err and "Traceback" not in err


def test_negative_dims_given_through_the_api_are_refused():
    model = ir.serde.deserialize_model(identity_model(["n", 8]))
    with pytest.raises(UsageError, match="negative"):
        make_inputs(model, shapes={"x": (-1, 8)})


@pytest.mark.parametrize("dtype, itemsize, peak_per_element", [
    (TensorProto.FLOAT, 4, 4), (TensorProto.FLOAT16, 2, 4 + 2), (TensorProto.INT32, 4, 4), (TensorProto.BOOL, 1, 1)])
def test_inputs_are_drawn_without_a_wider_array_on_the_way(dtype, itemsize, peak_per_element):
    """numpy reports its buffers to tracemalloc: the peak of drawing 1 Mi elements stays within the result
    (float16: the float32 draw, then the rounded copy), where a float64 draw and a copy peaked at 8 + itemsize
    bytes per element (int64 + copy for int32, float64 for bool)."""
    n = 1 << 20
    model = ir.serde.deserialize_model(identity_model([1024, 1024], dtype))
    tracemalloc.start()
    try:
        feeds = make_inputs(model, seed=3)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    x = feeds["x"]
    assert x.shape == (1024, 1024) and x.dtype.itemsize == itemsize
    assert peak < n * peak_per_element * 1.1 + (1 << 16), peak


def test_float_draws_look_standard_normal():
    model = ir.serde.deserialize_model(identity_model([512, 512]))
    x = make_inputs(model, seed=1)["x"]
    assert abs(float(x.mean())) < 0.01 and abs(float(x.std()) - 1) < 0.01
    assert not np.array_equal(x, make_inputs(model, seed=2)["x"])
    assert np.array_equal(x, make_inputs(model, seed=1)["x"])
