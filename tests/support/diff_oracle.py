"""An independent oracle for the checkpoint diff: two whole transformers models and hooks, no fp4pass code.

- The source: the bundled MXFP4 checkpoint decoded to bf16 by tests/support/checkpoint_oracles.py (numpy), or a bf16
  checkpoint, loaded with ``from_pretrained``.
- The NVFP4 side: the same bf16 folder with every NVFP4 weight replaced by its decode (numpy + ml_dtypes:
  ``e2m1 * e4m3 * multiplier``, or ``/ divisor`` for compressed-tensors), loaded with ``from_pretrained``; for
  W4A4 every quantized module's input goes through compressed-tensors' own ``fake_quantize`` with its NVFP4
  scheme and the stored activation global scale (computed on the float32 input: compressed-tensors run on a
  bf16 input would round its block scales in bf16, which no engine does). Experts run an expert loop written
  here after transformers' eager one, with those quantizers inside.
- Figures: both models' whole forward with hooks on every decoder layer (inputs with their keyword arguments,
  outputs); local = the NVFP4 layer called on the source layer's recorded inputs; per expert = the NVFP4
  expert on the source's routed rows; logits from both models' own forward.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
import torch

from checkpoint_oracles import Folder, as_bytes, nv_decode

ROOT = Path(__file__).resolve().parents[2] / "models" / "checkpoints"
THIRD_PARTY = Path(__file__).resolve().parents[1] / "fixtures" / "nvfp4_thirdparty"
KIMI_PARTS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_GATE = ("w1", "gate_proj")
_UP = ("w3", "up_proj")


def ct_fake_quant(x: torch.Tensor, g: float) -> torch.Tensor:
    """compressed-tensors' NVFP4 activation fake-quant of ``x`` [..., K] with global scale ``g``, on x.float()."""
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    args = preset_name_to_scheme("NVFP4", ["Linear"]).input_activations
    rows = x.float().reshape(-1, x.shape[-1])
    groups = rows.reshape(rows.shape[0], -1, 16)
    gt = torch.tensor([float(g)], dtype=torch.float32)
    scale, zp = calculate_qparams(groups.amin(-1), groups.amax(-1), args, global_scale=gt)
    return fake_quantize(rows, scale, zp, args, global_scale=gt).reshape(x.shape).to(x.dtype)


def _bf16(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32)).to(torch.bfloat16)


def _model_name(module: str, model_type: str) -> str:
    """A checkpoint module's name in the bf16 copy (Kimi's w1/w2/w3 experts in Hugging Face's names)."""
    parent, _, leaf = module.rpartition(".")
    if model_type == "deepseek_v3" and ".experts." in module and leaf in KIMI_PARTS:
        return f"{parent}.{KIMI_PARTS[leaf]}"
    return module


class NVFP4Reading:
    """The NVFP4 folder read by the test: decoded weights and activation global scales per module."""

    def __init__(self, folder: Path):
        self.folder = Folder(folder)
        self.weights: dict[str, np.ndarray] = {}  # module (or gpt-oss stack) -> float64 [N, K] or [E, N, K]
        self.act: dict[str, np.ndarray] = {}  # module -> g (compressed-tensors convention), [] or [E]
        f = self.folder
        for name in f.keys():
            if name.endswith("_weight_scale") and ".experts." in name:
                p = name[: -len("_weight_scale")]
                codes, scales = as_bytes(f.get(p)), as_bytes(f.get(name))
                g = f.get(p + "_weight_scale_2").float().numpy().reshape(-1)
                g = np.broadcast_to(g, (codes.shape[0],))
                self.weights[p] = np.stack([nv_decode(codes[e].T.copy(), scales[e].T.copy(), g[e])
                                            for e in range(codes.shape[0])])
                if p + "_input_scale" in f:
                    self.act[p] = 1.0 / f.get(p + "_input_scale").float().numpy().reshape(-1)
                continue
            module, _, leaf = name.rpartition(".")
            if leaf != "weight_scale" or f.dtype(name) != "F8_E4M3":
                continue
            codes_name = module + ".weight_packed" if module + ".weight_packed" in f else module + ".weight"
            if codes_name not in f or f.dtype(codes_name) != "U8":
                continue
            codes, scales = as_bytes(f.get(codes_name)), as_bytes(f.get(name))
            if module + ".weight_scale_2" in f:
                self.weights[module] = nv_decode(codes, scales, float(f.get(module + ".weight_scale_2")))
            else:
                divisor = np.float32(f.get(module + ".weight_global_scale").float().numpy().reshape(-1)[0])
                block = (scales.view(ml_dtypes.float8_e4m3fn).astype(np.float32) / divisor).astype(np.float64)
                self.weights[module] = nv_decode(codes, np.full(scales.shape, 0x38, np.uint8), 1.0) * np.repeat(
                    block, 16, axis=-1)
            if module + ".input_scale" in f:
                self.act[module] = 1.0 / f.get(module + ".input_scale").float().numpy().reshape(-1)
            elif module + ".input_global_scale" in f:
                self.act[module] = f.get(module + ".input_global_scale").float().numpy().reshape(-1)

    def w4a4(self) -> bool:
        config = json.loads((self.folder.folder / "config.json").read_text()).get("quantization_config") or {}
        hq = self.folder.folder / "hf_quant_config.json"
        algo = json.loads(hq.read_text())["quantization"].get("quant_algo") if hq.exists() else config.get("quant_algo")
        return bool(self.act) and algo != "W4A16_NVFP4"


def nvfp4_copy(source_bf16: Path, reading: NVFP4Reading, dst: Path, model_type: str) -> Path:
    """``source_bf16`` with every NVFP4 weight replaced by its decode (names as the bf16 copy has them)."""
    from safetensors.torch import save_file

    src = Folder(source_bf16)
    out = {name: src.get(name) for name in src.keys()}
    for module, w in reading.weights.items():
        if w.ndim == 3:  # a gpt-oss stack: transformers' [E, K, N]
            assert module in out, module
            out[module] = _bf16(np.swapaxes(w, 1, 2))
            continue
        key = _model_name(module, model_type) + ".weight"
        assert key in out, key
        out[key] = _bf16(w)
    dst.mkdir()
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    for name in ("config.json", "generation_config.json"):
        if (source_bf16 / name).exists():
            shutil.copy(source_bf16 / name, dst / name)
    return dst


def load(folder: Path):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, attn_implementation="eager",
                                                       experts_implementation="eager", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval()


def _expert_mlp(mod, e: int, rows: torch.Tensor, quant=None) -> torch.Tensor:
    """Expert ``e``'s output on ``rows`` (transformers' eager expert code, inputs quantized by ``quant``)."""
    x = rows if quant is None else quant("gate_up", rows)
    w = mod.gate_up_proj[e]
    y = x @ w if getattr(mod, "is_transposed", False) else torch.nn.functional.linear(x, w)
    if getattr(mod, "has_bias", False):
        y = y + mod.gate_up_proj_bias[e]
    act = mod._apply_gate(y)
    act = act if quant is None else quant("down", act)
    w = mod.down_proj[e]
    out = act @ w if getattr(mod, "is_transposed", False) else torch.nn.functional.linear(act, w)
    if getattr(mod, "has_bias", False):
        out = out + mod.down_proj_bias[e]
    return out


def _loop(mod, quant_for=None, seen=None):
    """transformers' eager expert loop; ``quant_for(e)``: expert e's input quantizer; ``seen``: {e: [(rows, out)]}
    gets each expert's rows and outputs."""
    def forward(hidden_states, top_k_index, top_k_weights):
        final = torch.zeros_like(hidden_states)
        mask = torch.nn.functional.one_hot(top_k_index, num_classes=mod.num_experts + 1).permute(2, 1, 0)
        for e in range(mod.num_experts):
            top_k_pos, token_idx = torch.where(mask[e])
            if not token_idx.numel():
                continue
            rows = hidden_states[token_idx]
            out = _expert_mlp(mod, e, rows, None if quant_for is None else quant_for(e))
            if seen is not None:
                seen.setdefault(e, []).append((rows, out))
            final.index_add_(0, token_idx, (out * top_k_weights[token_idx, top_k_pos, None]).to(final.dtype))
        return final
    return forward


def _experts_of(layer):
    return [m for m in layer.modules() if hasattr(m, "gate_up_proj") and hasattr(m, "_apply_gate")]


class _Quant:
    """The NVFP4 model's W4A4 quantizers, per model module: dense hooks and per-expert global scales."""

    def __init__(self, model, reading: NVFP4Reading, model_type: str, dense_names: dict):
        self.dense, self.experts = {}, {}  # model module -> g ; (stack module, e, kind) -> g
        if not reading.w4a4():
            return
        for module, g in reading.act.items():
            layer = int(re.search(r"layers\.(\d+)\.", module).group(1))
            stack = re.match(r"^(?P<s>.*\.experts)(?:\.(?P<e>\d+)\.(?P<p>[^.]+)|\.(?P<f>gate_up_proj|down_proj))$",
                             module)
            if stack is None:
                name = dense_names.get(module, module)
                self.dense[model.get_submodule(name)] = float(g[0])
                continue
            experts = _experts_of(model.model.layers[layer])[0]
            if stack["f"]:
                kind = "gate_up" if stack["f"] == "gate_up_proj" else "down"
                for e in range(experts.num_experts):
                    self.experts[(experts, e, kind)] = float(g[e] if g.size > 1 else g[0])
            else:
                proj, e = stack["p"], int(stack["e"])
                kind = "down" if proj not in _GATE + _UP else "gate_up"
                if proj in _UP and (experts, e, kind) in self.experts:
                    continue  # the fused gate/up input takes w1's scale, as vLLM does
                self.experts[(experts, e, kind)] = float(g[0])

    def install(self, model) -> None:
        for module, g in self.dense.items():
            module.register_forward_pre_hook(lambda _m, args, g=g: (ct_fake_quant(args[0], g), *args[1:]))
        for layer in model.model.layers:
            for experts in _experts_of(layer):
                experts.forward = _loop(experts, self.for_expert(experts))

    def for_expert(self, experts):
        def make(e):
            def quant(kind, x):
                g = self.experts.get((experts, e, kind))
                return x if g is None else ct_fake_quant(x, g)
            return quant
        return make


def _energy(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    a, b = a.double(), b.double()
    return float((a * a).sum()), float(((a - b) ** 2).sum())


def _db(signal: float, error: float) -> float | None:
    return None if error == 0 else 10 * math.log10(signal / error)


def figures(source_bf16: Path, nvfp4: Path, model_type: str, ids: torch.Tensor, batch: int, tmp: Path,
            dense_names: dict | None = None) -> dict:
    """The oracle's figures: {"layers": [(local dB, e2e dB)], "experts": {(layer, e): (dB, tokens)}, "logits"}."""
    reading = NVFP4Reading(nvfp4)
    src = load(source_bf16)
    nv = load(nvfp4_copy(source_bf16, reading, tmp / "nvfp4-decoded", model_type))
    quant = _Quant(nv, reading, model_type, dense_names or {})
    quant.install(nv)
    n_layers = len(src.model.layers)
    local = [[0.0, 0.0] for _ in range(n_layers)]
    e2e = [[0.0, 0.0] for _ in range(n_layers)]
    experts: dict = {}
    kl, agree, count, nll = 0.0, 0, 0, [0.0, 0.0]
    for start in range(0, ids.shape[0], batch):
        rows = ids[start:start + batch]
        inputs, outputs, nv_out, seen = {}, {}, {}, {}
        hooks = []
        for i, layer in enumerate(src.model.layers):
            hooks.append(layer.register_forward_pre_hook(
                lambda _m, args, kwargs, i=i: inputs.__setitem__(i, (args, kwargs)), with_kwargs=True))
            hooks.append(layer.register_forward_hook(
                lambda _m, _a, out, i=i: outputs.__setitem__(i, out[0] if isinstance(out, tuple) else out)))
            for experts_mod in _experts_of(layer):
                experts_mod.forward = _loop(experts_mod, seen=seen.setdefault(i, {}))
        for i, layer in enumerate(nv.model.layers):
            hooks.append(layer.register_forward_hook(
                lambda _m, _a, out, i=i: nv_out.__setitem__(i, out[0] if isinstance(out, tuple) else out)))
        with torch.no_grad():
            logits_src = src(input_ids=rows, use_cache=False).logits.float()
            logits_nv = nv(input_ids=rows, use_cache=False).logits.float()
        for h in hooks:
            h.remove()
        with torch.no_grad():
            for i in range(n_layers):
                args, kwargs = inputs[i]
                out = nv.model.layers[i](*args, **kwargs)
                out = out[0] if isinstance(out, tuple) else out
                s, err = _energy(outputs[i], out)
                local[i][0] += s
                local[i][1] += err
                s, err = _energy(outputs[i], nv_out[i])
                e2e[i][0] += s
                e2e[i][1] += err
                nv_experts = _experts_of(nv.model.layers[i])
                for e, pairs in seen.get(i, {}).items():
                    for x, y in pairs:
                        got = _expert_mlp(nv_experts[0], e, x, quant.for_expert(nv_experts[0])(e))
                        s, err = _energy(y, got)
                        old = experts.get((i, e), (0.0, 0.0, 0))
                        experts[(i, e)] = (old[0] + s, old[1] + err, old[2] + x.shape[0])
        for layer in src.model.layers:
            for experts_mod in _experts_of(layer):
                del experts_mod.forward
        log_p, log_q = torch.log_softmax(logits_src, -1), torch.log_softmax(logits_nv, -1)
        kl += float((log_p.exp() * (log_p - log_q)).sum(-1).double().sum())
        agree += int((logits_src.argmax(-1) == logits_nv.argmax(-1)).sum())
        count += rows.numel()
        targets = rows[:, 1:].unsqueeze(-1)
        nll[0] -= float(log_p[:, :-1].gather(-1, targets).double().sum())
        nll[1] -= float(log_q[:, :-1].gather(-1, targets).double().sum())
    scored = ids.shape[0] * (ids.shape[1] - 1)  # rows of one token have no next token: no perplexity

    def ppl(total: float) -> float | None:
        return math.exp(total / scored) if scored else None
    return {"layers": [(_db(*local[i]), _db(*e2e[i])) for i in range(n_layers)],
            "experts": {k: (_db(s, err), n) for k, (s, err, n) in experts.items()},
            "logits": {"kl_mean": kl / count, "top1_agreement": agree / count,
                       "ppl_source": ppl(nll[0]), "ppl_nvfp4": ppl(nll[1])}}


def bf16_source(name: str, tmp: Path) -> Path:
    """The bf16 source of a bundled MXFP4 example (tests/checkpoint/test_checkpoint_calibrate.py's decoded copy)."""
    from test_checkpoint_calibrate import FAMILIES, dequantized_copy

    return dequantized_copy(ROOT / name, tmp / f"{name}-bf16", FAMILIES[name][0])


def third_party_source(which: str, tmp: Path) -> Path:
    """The bf16 model a third-party fixture was quantized from, rebuilt by its recipe's own builders
    (tests/fixtures/make_nvfp4_thirdparty.py, ``torch.manual_seed(0)``), saved by transformers."""
    import sys

    sys.path.insert(0, str(THIRD_PARTY.parent))
    import make_nvfp4_thirdparty as recipe

    torch.manual_seed(0)
    model = recipe._gpt_oss() if which == "gpt_oss" else recipe._qwen3_moe()
    out = tmp / f"bf16-{which}"
    model.save_pretrained(out)
    return out
