"""fp4pass's QMoE 'nvfp4' on onnxruntime's CUDA QMoE kernel, against the MXFP4 original and fp4pass's own decode.

    python tests/qmoe_cuda_check.py [--json OUT.json] [--tokens 64]

For every QMoE node of each source model (the onnxruntime-genai builder's gpt-oss fixtures, and a bundled
16-expert QMoE 'fp4'), converted by ``fp4pass.onnx.convert(target="ort")``:

1. the node alone, as a one-node model with inputs ``x`` [T, H] and ``router`` [T, E] (:func:`one_node`): the
   original (QMoE 'fp4', E8M0 per 32; its weights in the kernel layout, :mod:`fp4pass.onnx.qmoe_layout`) and the
   converted node (QMoE 'nvfp4', E4M3 per 16 and a per-expert FP32 global scale), both in float16 as the CUDA
   kernel runs them (biases rounded to float16);
2. ``cuda_fp4`` and ``cuda_nvfp4``: each run by onnxruntime's CUDA QMoE kernel, raw (not lowered);
3. ``float32_fp4`` and ``float32_nvfp4``: each lowered by fp4pass into a float32 ``MoE`` whose weights are
   fp4pass's own decode (W = e2m1 * block scale * global scale) and run on the CPU EP, same inputs and biases;
4. per node, SNR (dB, 20 log10 ||a|| / ||a - b||, ``None`` when identical) of ``cuda_nvfp4`` against
   ``cuda_fp4`` (where the conversion was lossless, only the kernel's own rounding differs), of ``cuda_nvfp4``
   against ``float32_nvfp4``, and of ``cuda_fp4`` against ``float32_fp4`` (the kernel's own accuracy, for scale).

A kernel that refuses a model (attribute, layout, swizzle) is reported with onnxruntime's words under
``error``. Steps 1 and 3 run anywhere (tests/onnx/test_qmoe_cuda.py checks them on the CPU); step 2 needs the CUDA EP.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT, ROOT / "tests" / "support"):  # fp4pass, and the test builders (run as a script on the GPU)
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

FIXTURES = ROOT / "tests" / "fixtures"
SOURCES = {"ortgenai_gptoss": FIXTURES / "ortgenai_gptoss" / "model.onnx",
           "ortgenai_gptoss_h64": FIXTURES / "ortgenai_gptoss_h64" / "model.onnx"}
MS_DOMAIN = "com.microsoft"
_FC = {"fc1": (2, 3, 4, 15), "fc2": (5, 6, 7, 16)}  # QMoE input indices: weights, scales, bias, global scale


def bundled_qmoe(experts: int = 16, hidden: int = 64, inter: int = 64) -> onnx.ModelProto:
    """A QMoE 'fp4' of ``experts`` experts (tests/support/onnx_models.py: random codes, E8M0 scales, float biases)."""
    from onnx_models import qmoe_model

    model = qmoe_model(np.random.default_rng(11), "fp4", experts=experts, hidden=hidden, inter=inter, tokens=8)[0]
    model.graph.node[0].name = "bundled/QMoE"
    return model


def _initializers(model: onnx.ModelProto) -> dict[str, onnx.TensorProto]:
    return {t.name: t for t in model.graph.initializer}


def qmoe_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.op_type == "QMoE" and n.domain == MS_DOMAIN]


def _attr(node: onnx.NodeProto, name: str, default=None):
    found = next((a for a in node.attribute if a.name == name), None)
    if found is None:
        return default
    value = helper.get_attribute_value(found)
    return value.decode() if isinstance(value, bytes) else value


def _to_kernel_layout(node: onnx.NodeProto, inits: dict, model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """The node's weights in the CUDA kernel's layout [E, K, N/2] (repacked when stored in the schema's)."""
    import onnx_ir as ir

    from fp4pass.onnx import qmoe_layout

    ir_model = ir.serde.deserialize_model(model)
    ir_node = next(n for n in ir_model.graph if n.name == node.name)
    block = 16 if _attr(node, "quant_type") == "nvfp4" else 32
    detected = qmoe_layout.detect(ir_node, block, qmoe_layout.Hints.of(ir_model))
    if detected.layout is None:
        raise ValueError(f"{node.name}: {detected.reason}")
    weights = {}
    for fc, (w_i, _, _, _) in _FC.items():
        packed = numpy_helper.to_array(inits[node.input[w_i]]).view(np.uint8)
        if detected.layout == qmoe_layout.SCHEMA:
            rows, k = detected.dims[fc]
            packed = qmoe_layout.schema_to_kernel(packed, rows, k)
        weights[fc] = packed
    return weights


def one_node(model: onnx.ModelProto, node: onnx.NodeProto, dtype: int) -> onnx.ModelProto:
    """``node`` (a QMoE of ``model``) alone: inputs ``x`` [T, H] and ``router`` [T, E] of ``dtype``, output
    ``y``; its weights in the kernel layout (a node-metadata hint says so), its scales and global scales as
    stored, its biases in ``dtype`` (the float32 reference takes the float16 biases widened: the same values)."""
    from fp4pass.onnx.qmoe_layout import KERNEL, LAYOUT_KEY

    inits = _initializers(model)
    weights = _to_kernel_layout(node, inits, model)
    np_dtype = helper.tensor_dtype_to_np_dtype(dtype)
    new_inits, inputs = [], ["x", "router"]
    for fc, (w_i, s_i, b_i, g_i) in _FC.items():
        new_inits.append(numpy_helper.from_array(weights[fc], f"{fc}_w"))
        scales = inits[node.input[s_i]]
        new_inits.append(_renamed(scales, f"{fc}_s"))
        if b_i < len(node.input) and node.input[b_i]:
            bias = numpy_helper.to_array(inits[node.input[b_i]]).astype(np.float16).astype(np_dtype)
            new_inits.append(numpy_helper.from_array(bias, f"{fc}_b"))
        if g_i < len(node.input) and node.input[g_i]:
            new_inits.append(_renamed(inits[node.input[g_i]], f"{fc}_g"))
    names = {2: "fc1_w", 3: "fc1_s", 4: "fc1_b", 5: "fc2_w", 6: "fc2_s", 7: "fc2_b", 15: "fc1_g", 16: "fc2_g"}
    for i in range(2, len(node.input)):
        inputs.append(names.get(i, "") if node.input[i] else "")
    experts = new_inits[0].dims[0]
    hidden = int(weights["fc1"].shape[1])  # fc1's K, first in the kernel layout [E, K, N/2]
    copy = helper.make_node("QMoE", inputs, ["y"], domain=MS_DOMAIN, name=node.name)
    copy.attribute.extend(node.attribute)
    copy.metadata_props.add(key=LAYOUT_KEY, value=KERNEL)
    graph = helper.make_graph([copy], "qmoe", [helper.make_tensor_value_info("x", dtype, ["T", hidden]),
                                               helper.make_tensor_value_info("router", dtype, ["T", experts])],
                              [helper.make_tensor_value_info("y", dtype, ["T", hidden])], new_inits)
    opsets = [helper.make_opsetid("", 22), helper.make_opsetid(MS_DOMAIN, 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=10, producer_name="fp4pass qmoe check")


def _renamed(tensor: onnx.TensorProto, name: str) -> onnx.TensorProto:
    copy = onnx.TensorProto()
    copy.CopyFrom(tensor)
    copy.name = name
    return copy


def feeds(model: onnx.ModelProto, tokens: int, dtype, seed: int = 0) -> dict[str, np.ndarray]:
    """x standard normal; router logits per token a random permutation of 0, 1/4, ..., (E-1)/4: exact in float16
    and never tied, so that every implementation picks the same top-k experts."""
    hidden = model.graph.input[0].type.tensor_type.shape.dim[1].dim_value
    experts = model.graph.input[1].type.tensor_type.shape.dim[1].dim_value
    rng = np.random.default_rng(seed)
    router = np.stack([rng.permutation(experts) / 4 for _ in range(tokens)])
    return {"x": rng.standard_normal((tokens, hidden)).astype(dtype), "router": router.astype(dtype)}


def float32_reference(model16: onnx.ModelProto, inputs: dict[str, np.ndarray]) -> np.ndarray:
    """``model16`` (a :func:`one_node` model) with float32 inputs and biases, lowered by fp4pass (its own decode
    of the weights into a float32 MoE) and run on the CPU EP."""
    import onnx_ir as ir

    from fp4pass.onnx.lower import lower
    from fp4pass.onnx.runtime import make_session

    model = onnx.ModelProto()
    model.CopyFrom(model16)
    for value in [*model.graph.input, *model.graph.output]:
        value.type.tensor_type.elem_type = TensorProto.FLOAT
    for i, tensor in enumerate(model.graph.initializer):
        if tensor.name.endswith("_b"):
            model.graph.initializer[i].CopyFrom(
                numpy_helper.from_array(numpy_helper.to_array(tensor).astype(np.float32), tensor.name))
    lowered, report = lower(ir.serde.deserialize_model(model))
    if report.declined:
        raise ValueError(f"fp4pass did not lower it: {report.declined}")
    session, _, _ = make_session(lowered, "cpu")
    return session.run(None, {k: v.astype(np.float32) for k, v in inputs.items()})[0]


def cuda_run(model16: onnx.ModelProto, inputs: dict[str, np.ndarray]) -> np.ndarray:
    """``model16`` as it is (QMoE, not lowered) on onnxruntime's CUDA EP alone (no CPU fallback to hide in)."""
    import onnxruntime as ort

    from fp4pass.onnx.runtime import CUDA_OPTIONS, cuda_available

    ok, why = cuda_available()
    if not ok:
        raise RuntimeError(f"no CUDA EP here: {why}")
    session = ort.InferenceSession(model16.SerializeToString(),
                                   providers=[("CUDAExecutionProvider", dict(CUDA_OPTIONS))])
    if session.get_providers()[0] != "CUDAExecutionProvider":
        raise RuntimeError(f"the CUDA EP did not load (providers: {session.get_providers()})")
    return session.run(None, inputs)[0]


def snr_db(reference: np.ndarray, other: np.ndarray) -> float | None:
    """20 log10(||a|| / ||a - b||) in float64; None when identical; NaN when either holds NaN or Inf."""
    a, b = reference.astype(np.float64), other.astype(np.float64)
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        return float("nan")
    error = np.linalg.norm(a - b)
    if error == 0:
        return None
    return 20 * math.log10(np.linalg.norm(a) / error) if np.linalg.norm(a) > 0 else float("-inf")


@dataclass
class NodeCheck:
    source: str
    node: str
    experts: int
    snr_db: dict = field(default_factory=dict)
    error: str | None = None

    def to_json(self) -> dict:
        clean = {k: (None if v is None or not math.isfinite(v) else round(v, 2)) for k, v in self.snr_db.items()}
        return {"source": self.source, "node": self.node, "experts": self.experts, "snr_db": clean,
                "error": self.error}


def pairs(sources: dict[str, onnx.ModelProto], folder: Path) -> list[tuple[str, onnx.ModelProto, onnx.ModelProto]]:
    """(source name, original, fp4pass's ``--target ort`` conversion) for each source model."""
    import fp4pass

    found = []
    for name, model in sources.items():
        path = folder / f"{name}.nvfp4.onnx"
        fp4pass.onnx.convert(model, output=str(path), target="ort")
        found.append((name, model, onnx.load(str(path))))
    return found


def check_node(source: str, original: onnx.ModelProto, converted: onnx.ModelProto, node_name: str, tokens: int,
               run_cuda=cuda_run) -> NodeCheck:
    """Steps 1-4 of the module docstring for one node."""
    node_a = next(n for n in qmoe_nodes(original) if n.name == node_name)
    node_b = next(n for n in qmoe_nodes(converted) if n.name == node_name)
    fp4 = one_node(original, node_a, TensorProto.FLOAT16)
    nvfp4 = one_node(converted, node_b, TensorProto.FLOAT16)
    result = NodeCheck(source, node_name, fp4.graph.input[1].type.tensor_type.shape.dim[1].dim_value)
    inputs = feeds(fp4, tokens, np.float16)
    ref_fp4, ref_nvfp4 = float32_reference(fp4, inputs), float32_reference(nvfp4, inputs)
    result.snr_db["float32_nvfp4_vs_float32_fp4"] = snr_db(ref_fp4, ref_nvfp4)
    try:
        cuda_fp4, cuda_nvfp4 = run_cuda(fp4, inputs), run_cuda(nvfp4, inputs)
    except Exception as exc:  # onnxruntime's own error types: the kernel's refusal is the finding
        result.error = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return result
    result.snr_db["cuda_nvfp4_vs_cuda_fp4"] = snr_db(cuda_fp4, cuda_nvfp4)
    result.snr_db["cuda_nvfp4_vs_float32_nvfp4"] = snr_db(ref_nvfp4, cuda_nvfp4)
    result.snr_db["cuda_fp4_vs_float32_fp4"] = snr_db(ref_fp4, cuda_fp4)
    return result


def sources() -> dict[str, onnx.ModelProto]:
    found = {name: onnx.load(str(path)) for name, path in SOURCES.items()}
    found["bundled_qmoe_16x"] = bundled_qmoe()
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args(argv)
    import tempfile

    results = []
    with tempfile.TemporaryDirectory(prefix="fp4pass-qmoe-cuda-") as tmp:
        for source, original, converted in pairs(sources(), Path(tmp)):
            for node in qmoe_nodes(original):
                check = check_node(source, original, converted, node.name, args.tokens)
                results.append(check.to_json())
                print(json.dumps(results[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"tokens": args.tokens, "nodes": results}, indent=1))
    return 1 if any(r["error"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
