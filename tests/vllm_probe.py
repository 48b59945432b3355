"""Run vLLM 0.33.0's own loader code on CPU against checkpoint folders; print what it decides, as JSON.

Run as a script in a separate process (``python tests/vllm_probe.py FOLDER...``) with the unpacked vLLM wheel
and its pure-Python dependencies first on ``sys.path`` (:func:`vllm_path`); nothing of vLLM's compiled part is
imported. ``python tests/vllm_probe.py --fetch`` puts them in ``~/.cache/fp4pass-test`` (or
``$FP4PASS_TEST_CACHE``). Per folder it reports:

- ``quant_method``: what vLLM's ``ModelConfig._verify_quantization`` resolves (config.json's
  ``quantization_config``, else hf_quant_config.json; transformers_utils/config.py), after
  ``ModelArchConfigConvertorBase._normalize_quantization_config``, through every method's
  ``override_quantization_method`` in vLLM's order of preference (config/model.py);
- ``config_class`` and ``algo`` (ModelOpt's resolved ``quant_method``: NVFP4 or W4A16_NVFP4; for
  compressed-tensors "W4A4"/"W4A16" from the scheme of the first NVFP4 module; for DeepSeek-V4's FP8 config its
  ``moe_quant_algo``), or ``error`` where vLLM raises;
- ``modules``: each Linear of the folder under vLLM's name (the model class's ``hf_to_vllm_mapper``), fused as
  its ``packed_modules_mapping`` fuses them, with whether vLLM's exclusion code keeps it unquantized
  (ModelOpt ``is_layer_excluded``, compressed-tensors ``should_ignore_layer``, FP8 ``is_layer_skipped``) or
  the error it raises;
- ``moe``: the MoE layer prefixes and whether they are excluded;
- ``unmapped``: tensors whose vLLM name no parameter of the MoE takes (gpt-oss: the names
  ``_load_weights_other`` skips silently);
- ``moe_params``: the parameters ``ModelOptNvFp4FusedMoE.create_weights`` registers (name, dtype, shape) for
  the folder's expert shapes, where the folder has per-expert ModelOpt tensors.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

CACHE = Path(os.environ.get("FP4PASS_TEST_CACHE", Path.home() / ".cache" / "fp4pass-test"))
VLLM_DIR = CACHE / "vllm-0.33.0"
DEPS_DIR = CACHE / "vllm-deps"


def vllm_path() -> list[str]:
    """The folders to put first on sys.path, or [] when the unpacked wheel is absent."""
    if not (VLLM_DIR / "vllm" / "__init__.py").exists() or not DEPS_DIR.is_dir():
        return []
    return [str(VLLM_DIR), str(DEPS_DIR)]


MODEL_CLASSES = {
    "GptOssForCausalLM": ("vllm.model_executor.models.gpt_oss", "GptOssForCausalLM"),
    "KimiK3ForConditionalGeneration": ("vllm.models.kimi_k3.nvidia.model", "KimiK3ForConditionalGeneration"),
    "DeepseekV3ForCausalLM": ("vllm.model_executor.models.deepseek_v2", "DeepseekV3ForCausalLM"),
    "DeepseekV4ForCausalLM": ("vllm.models.deepseek_v4.nvidia.model", "DeepseekV4ForCausalLM"),
}


#: model classes whose packed_modules_mapping is their text model's (SupportsQuant collects the children's)
PACKED_FROM = {"KimiK3ForConditionalGeneration": ("vllm.models.kimi_k3.nvidia.model", "KimiLinearModel")}


def _stub_parallel_state() -> None:
    """The only stubs: tensor-parallel rank and size (no process group exists on this CPU)."""
    import vllm.distributed.parallel_state as ps

    for name in ("get_tensor_model_parallel_rank", "get_tp_group_rank"):
        if hasattr(ps, name):
            setattr(ps, name, lambda *a, **k: 0)
    for name in ("get_tensor_model_parallel_world_size",):
        setattr(ps, name, lambda *a, **k: 1)
    import vllm.distributed as dist

    dist.get_tensor_model_parallel_rank = ps.get_tensor_model_parallel_rank
    dist.get_tensor_model_parallel_world_size = ps.get_tensor_model_parallel_world_size


def _tensor_names(folder: Path) -> list[str]:
    import struct

    names = []
    for shard in sorted(folder.glob("*.safetensors")):
        with open(shard, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(n))
        names += [k for k in header if k != "__metadata__"]
    return names


def _resolve(config: dict, folder: Path):
    """vLLM's quant_method for the folder (config/model.py ``_verify_quantization``), and the config dict."""
    from types import SimpleNamespace
    from typing import get_args

    from vllm.model_executor.layers import quantization as me_quant
    from vllm.transformers_utils.model_arch_config_convertor import ModelArchConfigConvertorBase

    qc = config.get("quantization_config")
    if qc is None and (folder / "hf_quant_config.json").exists():
        qc = json.loads((folder / "hf_quant_config.json").read_text())
    if qc is None:
        return None, None
    qc = json.loads(json.dumps(qc))
    hf_config = SimpleNamespace(**{k: v for k, v in config.items() if k != "quantization_config"},
                                quantization_config=qc)
    qc = ModelArchConfigConvertorBase._normalize_quantization_config(None, hf_config)
    quant_method = qc["quant_method"]
    overrides = ["auto_gptq", "gptq", "gptq_marlin", "auto_awq", "awq", "awq_marlin", "inc", "moe_wna16",
                 "modelopt", "modelopt_fp4", "modelopt_mxfp8", "mxfp8", "modelopt_mixed", "mxfp4", "gpt_oss_mxfp4",
                 "deepseek_v4_fp8"]
    methods = [m for m in me_quant.QUANTIZATION_METHODS if m not in overrides] + overrides
    for name in methods:
        method = me_quant.get_quantization_config(name)
        override = method.override_quantization_method(qc, None, hf_config=hf_config)
        if override is not None:
            if name in get_args(me_quant.QuantizationMethods) and name not in overrides:
                raise ValueError(f"{name} overrides outside vLLM's list")
            quant_method = override
            break
    return quant_method, qc


def _excluded(quant_config, prefix: str) -> bool:
    from vllm.model_executor.layers.quantization.compressed_tensors.utils import should_ignore_layer
    from vllm.model_executor.layers.quantization.utils.quant_utils import is_layer_skipped

    if hasattr(quant_config, "is_layer_excluded"):  # ModelOpt
        return bool(quant_config.is_layer_excluded(prefix))
    if hasattr(quant_config, "target_scheme_map"):  # compressed-tensors
        return bool(should_ignore_layer(prefix, ignore=quant_config.ignore,
                                        fused_mapping=quant_config.packed_modules_mapping))
    return bool(is_layer_skipped(prefix=prefix, ignored_layers=quant_config.ignored_layers,
                                 fused_mapping=quant_config.packed_modules_mapping,
                                 match_mode=quant_config.ignored_layers_match_mode))


def _moe_params(quant_config, experts: int, hidden: int, inter: int) -> list:
    """ModelOptNvFp4FusedMoE.create_weights on a bare module: the parameters it registers."""
    import torch
    from vllm.model_executor.layers.quantization import modelopt

    method = object.__new__(modelopt.ModelOptNvFp4FusedMoE)
    method.quant_config = quant_config
    method.moe = type("Moe", (), {"is_act_and_mul": True})()
    method.use_global_sf = False
    layer = torch.nn.Module()
    method.create_weights(layer, experts, hidden, inter, torch.bfloat16, weight_loader=lambda *a, **k: None,
                          global_num_experts=experts)
    return [[n, str(p.dtype).replace("torch.", ""), list(p.shape)] for n, p in layer.named_parameters()]


def _hf_config(folder: Path, config: dict) -> dict:
    """config.json as vLLM's own config loader reads it (transformers_utils/config.py ``get_config``), for a
    nested config: Kimi-K3's ``KimiK3Config`` (transformers_utils/configs/kimi_k3.py) copies
    ``text_config.quantization_config`` up to the top."""
    if not any(isinstance(v, dict) and "quantization_config" in v for v in config.values()):
        return config
    from vllm.transformers_utils.config import get_config

    parsed = get_config(str(folder), trust_remote_code=False)
    out = dict(config)
    qc = getattr(parsed, "quantization_config", None)
    if qc is not None:
        out["quantization_config"] = qc if isinstance(qc, dict) else qc.to_dict()
    return out


def probe(folder: Path) -> dict:
    import importlib

    from vllm.model_executor.layers.quantization import get_quantization_config

    config = _hf_config(folder, json.loads((folder / "config.json").read_text()))
    arch = config["architectures"][0]
    module_name, class_name = MODEL_CLASSES[arch]
    model_cls = getattr(importlib.import_module(module_name), class_name)
    mapper = getattr(model_cls, "hf_to_vllm_mapper", None)
    packed = dict(getattr(model_cls, "packed_modules_mapping", {}))
    if arch in PACKED_FROM:  # a wrapper whose SupportsQuant takes its text model's mapping when it is built
        packed = dict(getattr(importlib.import_module(PACKED_FROM[arch][0]), PACKED_FROM[arch][1])
                      .packed_modules_mapping)
    if arch == "DeepseekV3ForCausalLM" and config.get("q_lora_rank") is not None:
        packed["fused_qkv_a_proj"] = ["q_a_proj", "kv_a_proj_with_mqa"]  # DeepseekV2ForCausalLM.__init__
    out: dict = {"architecture": arch}
    try:
        quant_method, qc = _resolve(config, folder)
        out["quant_method"] = quant_method
        cls = get_quantization_config(quant_method)
        quant_config = cls.from_config(qc)
        out["config_class"] = type(quant_config).__name__
        quant_config.packed_modules_mapping = packed  # what vLLM's configure_quant_config sets
        if mapper is not None:
            quant_config.apply_vllm_mapper(mapper)
    except Exception as exc:  # noqa: BLE001 - vLLM's refusal is the result
        out["error"] = f"{type(exc).__name__}: {exc}"
        return out
    out["exclude_after_mapper"] = list(getattr(quant_config, "exclude_modules", None)
                                       or getattr(quant_config, "ignore", None)
                                       or getattr(quant_config, "ignored_layers", None) or [])
    names = _tensor_names(folder)
    vname = (lambda n: mapper._map_name(n)) if mapper is not None else (lambda n: n)
    kinds: dict[str, str] = {}
    for n in names:
        for suffix, kind in ((".weight_scale_2", "nvfp4"), (".weight_global_scale", "nvfp4"), (".weight", "plain"),
                             (".weight_packed", "nvfp4")):
            if n.endswith(suffix):
                v = vname(n)
                if v is None:
                    continue
                module = v[: -len(suffix)] if v.endswith(suffix) else v.rsplit(".", 1)[0]
                if kind == "nvfp4" or module not in kinds:
                    kinds[module] = kind
    expert_re = re.compile(r"^(.*\.experts)\.\d+\.[^.]+$")
    moe = sorted({expert_re.match(m)[1] for m in kinds if expert_re.match(m)})
    linear = {m: k for m, k in kinds.items() if not expert_re.match(m) and ".experts." not in m
              and not re.search(r"norm[^.]*$", m) and not m.endswith(("embed_tokens", "embed", "embedding"))}
    modules = []
    taken = set()
    parents = sorted({m.rsplit(".", 1)[0] for m in linear})
    for parent in parents:
        for fused, shards in packed.items():
            full = [f"{parent}.{s}" for s in shards]
            if all(s in linear and s not in taken for s in full) and len(full) > 1:
                modules.append((f"{parent}.{fused}", full))
                taken.update(full)
    modules += [(m, [m]) for m in linear if m not in taken]
    rows = []
    fp8 = not hasattr(quant_config, "is_layer_excluded") and not hasattr(quant_config, "target_scheme_map")
    for name, members in modules:
        row = {"name": name, "kinds": sorted({linear[m] for m in members})}
        try:
            # fp8.py Fp8Config.get_quant_method quantizes LinearBase layers only; lm_head is a ParallelLMHead
            row["excluded"] = True if fp8 and name == "lm_head" else _excluded(quant_config, name)
        except Exception as exc:  # noqa: BLE001
            row["error"] = f"{type(exc).__name__}: {exc}"
        rows.append(row)
    out["modules"] = rows
    out["moe"] = []
    for prefix in moe:
        try:
            excluded = (quant_config.is_layer_excluded(prefix) if hasattr(quant_config, "is_layer_excluded")
                        else _excluded(quant_config, prefix))
        except Exception as exc:  # noqa: BLE001
            excluded = f"{type(exc).__name__}: {exc}"
        out["moe"].append({"name": prefix, "excluded": excluded})
    if hasattr(quant_config, "quant_method") and isinstance(quant_config.quant_method, str):
        out["algo"] = quant_config.quant_method
    if hasattr(quant_config, "moe_quant_algo"):
        out["moe_quant_algo"] = str((qc or {}).get("moe_quant_algo") or "").upper()
    if hasattr(quant_config, "target_scheme_map"):
        out["input_activations"] = [s.get("input_activations") is not None
                                    for s in quant_config.target_scheme_map.values()]
    # gpt-oss: which expert tensors vLLM's mapper leaves without a parameter (gpt_oss.py _load_weights_other
    # takes only names with .w13_weight, .w2_weight, .w13_bias, .w2_bias)
    if arch == "GptOssForCausalLM":
        mapped = {n: vname(n) for n in names if ".mlp.experts." in n}
        out["unmapped"] = sorted(n for n, v in mapped.items()
                                 if not re.search(r"\.(w13_weight|w2_weight|w13_bias|w2_bias)$", v or ""))
        out["mapped"] = mapped
    else:
        out["expert_names"] = sorted({re.sub(r"\.experts\.\d+\.", ".experts.E.", vname(n) or "") for n in names
                                      if ".experts." in n})
    if out.get("config_class") == "ModelOptNvFp4Config" and moe:
        out["moe_params"] = _moe_params(quant_config, 3, 64, 32)
    return out


# vLLM 0.33.0's pure-Python imports on the path the probe takes (config parsing, quantization, the models'
# modules), installed with --no-deps beside it; torch, transformers, compressed-tensors, pydantic, numpy, ...
# come from the test environment
DEPS = ["aiohappyeyeballs==2.7.1", "aiohttp==3.14.5", "aiosignal==1.4.0", "apache-tvm-ffi==0.1.11", "attrs==26.1.0",
        "cachetools==8.0.2", "cbor2==6.3.0", "certifi==2026.10.19.post1", "charset-normalizer==3.5.3",
        "cloudpickle==3.1.3", "einops==0.8.2", "fastapi==0.165.0", "frozenlist==1.8.0", "llguidance==1.9.1",
        "msgspec==0.22.0", "multidict==7.2.1", "openai==3.57.0", "openai-harmony==0.0.8", "opentelemetry-api==1.45.2",
        "partial-json-parser==0.2.1.1.post7", "prometheus-client==0.26.0", "propcache==0.5.4", "py-cpuinfo==9.0.0",
        "pybase64==1.5.1", "pyzmq==27.3.0", "requests==2.34.2", "sniffio==1.3.1", "starlette==1.10.0",
        "urllib3==2.8.0", "uvloop==0.23.0", "xgrammar==0.2.8", "yarl==1.25.1"]


def fetch() -> None:
    """Download the vllm 0.33.0 wheel (~340 MB) with pip, unpack its Python files into the cache (~60 MB), and
    install :data:`DEPS` beside it (~100 MB). Nothing is installed into the environment itself."""
    import shutil
    import tempfile
    import zipfile

    with tempfile.TemporaryDirectory() as tmp:
        subprocess_run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "vllm==0.33.0", "-d", tmp])
        wheel = next(Path(tmp).glob("vllm-0.33.0-*.whl"))
        partial = VLLM_DIR.with_name(VLLM_DIR.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        with zipfile.ZipFile(wheel) as z:
            z.extractall(partial, [n for n in z.namelist() if n.endswith((".py", ".json", "METADATA"))])
    subprocess_run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--upgrade", "--target",
                    str(DEPS_DIR), *DEPS])
    shutil.rmtree(VLLM_DIR, ignore_errors=True)
    partial.rename(VLLM_DIR)


def subprocess_run(cmd: list[str]) -> None:
    import subprocess

    subprocess.run(cmd, check=True)


def rules(cases: list[dict]) -> list:
    """vLLM's exclusion code on hand-made cases: ``{"form", "module", "exclude", "packed"}`` -> True / False /
    the error it raises. ModelOpt: ``ModelOptNvFp4Config.is_layer_excluded`` after ``apply_vllm_mapper`` with an
    identity mapper (which splits ``X*`` into ``X``, ``X.*``); compressed-tensors: ``should_ignore_layer``."""
    from vllm.model_executor.layers.quantization.compressed_tensors.utils import should_ignore_layer
    from vllm.model_executor.layers.quantization.modelopt import ModelOptNvFp4Config
    from vllm.model_executor.models.utils import WeightsMapper

    out = []
    for case in cases:
        try:
            if case["form"] == "modelopt":
                qc = ModelOptNvFp4Config("NVFP4", True, None, list(case["exclude"]), 16)
                qc.packed_modules_mapping = case["packed"]
                qc.apply_vllm_mapper(WeightsMapper())
                out.append(bool(qc.is_layer_excluded(case["module"])))
            else:
                out.append(bool(should_ignore_layer(case["module"], ignore=case["exclude"],
                                                    fused_mapping=case["packed"])))
        except Exception as exc:  # noqa: BLE001 - vLLM's refusal is the result
            out.append(f"{type(exc).__name__}: {exc}")
    return out


def load(folder: Path) -> dict:
    """Build the folder's model with vLLM's own classes on CPU (``ModelConfig`` and ``VllmConfig`` from the
    folder, ``initialize_model``) and give every tensor of the folder to the model's ``load_weights``, one at a
    time: ``{"model", "params", "unloaded_params", "skipped_tensors", "errors"}``. ``skipped_tensors``: the
    tensors ``load_weights`` took into no parameter (skipped in silence); ``errors``: those it raised on;
    ``{"build_error"}`` where vLLM cannot build the model from the folder's config.

    Stubs, beyond the probe's TP rank and size: CUDA streams and events (no CUDA here), the platform's device
    (CPU, set after the config is checked), the NVFP4 MoE kernel choice (vLLM's EMULATION backend: no GPU
    kernel is selectable on a CPU), and Kimi-K3's GEMM all-reduce flags off (they need NVLink)."""
    import glob

    import torch
    from safetensors import safe_open

    import vllm.platforms as platforms
    from vllm.config import DeviceConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.fused_moe.oracle.nvfp4 import NvFp4MoeBackend
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.platforms.cpu import CpuPlatform

    class _Stream:
        def __init__(self, *args, **kwargs):
            pass

        def wait_stream(self, *args):
            pass

    torch.cuda.Stream = torch.cuda.Event = _Stream
    model_config = ModelConfig(model=str(folder), tokenizer=str(folder), dtype="bfloat16", skip_tokenizer_init=True)
    vllm_config = VllmConfig(model_config=model_config, device_config=DeviceConfig(device="cpu"))
    previous = platforms._current_platform
    platforms._current_platform = CpuPlatform()
    emulation = (NvFp4MoeBackend.EMULATION, None)
    stubbed = []
    for name in ("vllm.model_executor.layers.quantization.modelopt",
                 "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe."
                 "compressed_tensors_moe_w4a4_nvfp4"):
        module = __import__(name, fromlist=["_"])
        stubbed.append((module, module.select_nvfp4_moe_backend))
        module.select_nvfp4_moe_backend = lambda **kwargs: emulation
    for module_name in ("vllm.models.kimi_k3.nvidia.model",):
        module = __import__(module_name, fromlist=["_"])
        module.current_platform = platforms._current_platform
    try:
        with set_current_vllm_config(vllm_config), torch.device("cpu"):
            _init_distributed()
            try:
                model = initialize_model(vllm_config=vllm_config)
            except Exception as exc:  # noqa: BLE001 - vLLM's refusal to build the model is the result
                return {"build_error": f"{type(exc).__name__}: {str(exc)[:300]}",
                        "quantization": model_config.quantization}
            params = {n for n, _ in model.named_parameters()}
            loaded: set[str] = set()
            skipped, errors = [], []
            for shard in sorted(glob.glob(str(folder / "*.safetensors"))):
                with safe_open(shard, "pt") as f:
                    for name in f.keys():
                        try:
                            got = set(model.load_weights([(name, f.get_tensor(name))]))
                        except Exception as exc:  # noqa: BLE001 - vLLM's refusal is the result
                            errors.append({"tensor": name, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
                            continue
                        if not got:
                            skipped.append(name)
                        loaded |= got
    finally:
        platforms._current_platform = previous
        for module, original in stubbed:
            module.select_nvfp4_moe_backend = original
    return {"model": type(model).__name__, "quantization": model_config.quantization, "params": len(params),
            "unloaded_params": sorted(params - loaded), "skipped_tensors": skipped, "errors": errors}


def _init_distributed() -> None:
    """One process group of one CPU rank (gloo), as vLLM's own CPU tests make: the models' layers ask for it.
    Once a process."""
    import socket

    import vllm.distributed.parallel_state as ps
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    if ps._PP is not None:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("VLLM_KIMI_K3_GEMM_AR", "0")
    os.environ.setdefault("VLLM_ENABLE_GEMM_RS", "0")
    init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}",
                                 local_rank=0, backend="gloo")
    initialize_model_parallel(1, 1)


def main(args: list[str]) -> None:
    """``[--rules CASES.json] FOLDER...``: one JSON line, ``{FOLDER: probe, ..., "--rules": [answers]}`` (one
    import of vLLM for everything); ``--load FOLDER...``: ``{FOLDER: load}``."""
    if args[:1] == ["--load"]:  # build each folder's model and load its tensors (needs a process of its own)
        print(json.dumps({f: load(Path(f)) for f in args[1:]}))
        return
    _stub_parallel_state()
    out = {}
    if args[:1] == ["--rules"]:
        out["--rules"] = rules(json.loads(Path(args[1]).read_text()))
        args = args[2:]
    out.update({f: probe(Path(f)) for f in args})
    print(json.dumps(out))


if __name__ == "__main__":
    if sys.argv[1:] == ["--fetch"]:
        fetch()
    else:
        sys.path[:0] = vllm_path()
        main(sys.argv[1:])
