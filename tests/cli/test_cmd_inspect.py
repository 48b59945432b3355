"""``fp4pass inspect``: FP4 tensors, pattern, shape, experts, exponent spread, lossless forecast."""

from __future__ import annotations

import json

import numpy as np
from onnx import numpy_helper

import pytest
from onnx.reference import ReferenceEvaluator

import conversion_oracle as O
import onnx_builders as B
from fp4pass.cli import main
from fp4pass.onnx import convert, inspect
from oracles import mx_dq_model


def test_inspect_moe_json_forecasts_per_expert(capsys):
    assert main(["inspect", "models/moe.onnx", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    w1, w2 = info["tensors"]
    assert (w1["name"], w1["pattern"], w1["shape"], w1["experts"]) == ("experts.w1", "dq", [4, 128, 64], 4)
    assert w1["lossless"] and not w1["lossless_per_tensor_scale"]  # experts 2^6 apart: one scale cannot hold all
    assert [p["lossless"] for p in w2["per_expert"]] == [True, True, True, False]
    assert info["summary"] == {"tensors": 2, "lossless": 1, "experts": 8, "experts_lossless": 7}


def test_inspect_spread_matches_an_independent_count(tmp_path, capsys):
    import onnx

    model = B.expert_model(spread_expert=0)
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    assert main(["inspect", str(path), "--json"]) == 0
    entry = json.loads(capsys.readouterr().out)["tensors"][0]
    codes = numpy_helper.to_array(B.init(model, "W")).astype(np.float32).reshape(3, 32, 2, 32)
    k = np.log2(numpy_helper.to_array(B.init(model, "W_scale")).astype(np.float64)).astype(int)
    holds = (codes != 0).any(-1)
    for e, p in enumerate(entry["per_expert"]):
        assert p["spread"] == k[e][holds[e]].max() - k[e][holds[e]].min()
        assert p["lossless"] == (p["spread"] <= 17)


def test_inspect_table_names_declined_nodes(tmp_path, capsys):
    import onnx

    model = B.make([B.dq_node("W", block=16)], [], [B.vi("W_dq", [4, 64])], B.mx_inits("W", B.weight((4, 64)), block=16))
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "0 MXFP4 tensors" in out
    assert "declined DequantizeLinear node 'W_dq' (tensor 'W'): weight 'W' has block size 16" in out and "[pattern dq]" in out


def test_inspect_bad_file_exits_2(tmp_path, capsys):
    path = tmp_path / "x.onnx"
    path.write_bytes(b"\x01\x02garbage" * 5)
    assert main(["inspect", str(path)]) == 2
    assert "not an ONNX file" in capsys.readouterr().err


def test_inspect_forecast_is_the_auto_conversion_per_expert():
    """The per-expert error forecast equals what converting with auto writes, measured by independent oracles
    (onnx.reference decodes the written weight, numpy the MXFP4 one)."""
    codes, e8m0 = O.expert_codes(12)
    model = mx_dq_model(codes, e8m0)
    info = inspect(model)["tensors"][0]
    out, _ = convert(model)
    (nv,) = ReferenceEvaluator(out).run(None, {})
    nv_codes = numpy_helper.to_array(B.init(out, "w")).view(np.uint8)
    for e, p in enumerate(info["per_expert"]):
        mx = O.mx_dequant(codes[e], e8m0[e]).astype(np.float32)
        assert p["spread"] == O.spread(codes[e], e8m0[e]) and p["lossless"] == (p["spread"] <= 17)
        assert p["mse"] == pytest.approx(O.mse(nv[e], mx), rel=1e-9, abs=0)
        assert p["blocks16_total"] == mx.size // 16
        assert p["blocks16_verbatim"] == O.verbatim_count(codes[e], mx, nv_codes[e], nv[e])
        snr = O.snr_db(mx, nv[e].astype(np.float64) - mx)
        assert p["snr_db"] == (None if snr is None else pytest.approx(snr, rel=1e-9))
    mx_all = O.mx_dequant(codes, e8m0)
    assert info["mse"] == pytest.approx(O.mse(nv, mx_all), rel=1e-9, abs=0)
    assert info["blocks16_verbatim"] == O.verbatim_count(codes, mx_all, nv_codes, nv)
    assert "mse" not in inspect(model, measure=False)["tensors"][0]["per_expert"][0]


def test_inspect_lossless_forecast_needs_no_conversion(monkeypatch):
    """Every expert within spread 17: the forecast is lossless without running the converter."""
    import fp4pass.convert

    monkeypatch.setattr(fp4pass.convert, "mxfp4_to_nvfp4", None)  # would raise if called
    info = inspect(B.expert_model())["tensors"][0]
    assert info["lossless"] and info["mse"] == 0 and info["snr_db"] is None
    assert all(p["blocks16_verbatim"] == p["blocks16_total"] == 32 * 64 // 16 for p in info["per_expert"])
