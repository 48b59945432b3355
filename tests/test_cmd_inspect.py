"""``fp4pass inspect``: FP4 tensors, pattern, shape, experts, exponent spread, lossless forecast."""

from __future__ import annotations

import json

import numpy as np
from onnx import numpy_helper

from fp4pass.cli import main
import onnx_builders as B


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
    assert "0 MXFP4 tensors" in out and "declined dq node 'W_dq' (W): weight 'W' has block size 16" in out


def test_inspect_bad_file_exits_2(tmp_path, capsys):
    path = tmp_path / "x.onnx"
    path.write_bytes(b"\x01\x02garbage" * 5)
    assert main(["inspect", str(path)]) == 2
    assert "not an ONNX file" in capsys.readouterr().err
