"""The quantization configs as each engine reads them, and their required fields and accepted values.

config.json's ``quantization_config`` (the top level's, else a nested ``text_config``'s) and
hf_quant_config.json's ``quantization`` give the form (``modelopt``, ``compressed-tensors``, DeepSeek-V4's
``deepseek-fp8-moe-nvfp4``), the algorithm, whether each engine runs W4A4 (input scales loaded) or W4A16, and
the exclusion list each engine reads from the file it reads first. A config.json and an hf_quant_config.json that
disagree make the engines serve different models (``config_disagreement``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fp4pass.safetensors.catalog import CONFIG_NAME, QUANT_CONFIG_NAME
from fp4pass.checkpoint.configs import quantization_config
from fp4pass.checkpoint.engines.records import ENGINE_RECORDS, ENGINES
from fp4pass.checkpoint.validate.kinds import Problem

__all__ = ["Configs", "config_groups", "read_configs", "check_configs"]

@dataclass
class Configs:
    form: str
    quant_algo: str | None
    qc: dict | None  # config.json quantization_config
    hq: dict | None  # hf_quant_config.json "quantization"
    input_needed: dict[str, bool]  # per engine: W4A4 (input scales loaded) or W4A16
    exclude: dict[str, list[str] | None]  # per engine: the exclusion list it reads (None: not a list of strings)
    exclude_field: dict[str, str] = field(default_factory=dict)  # per engine: that list's file and field
    quantized_layers: dict | None = None  # ModelOpt MIXED_PRECISION: layer -> {"quant_algo", ...}


def config_groups(qc: dict | None) -> dict:
    groups = (qc or {}).get("config_groups")
    return groups if isinstance(groups, dict) else {}


def read_configs(config: dict, quant_file: dict | None, problems: list[Problem]) -> Configs:
    qc = quantization_config(config)  # the top level's, else a nested text_config's (a multimodal wrapper)
    hq = None
    if quant_file is not None:
        hq = quant_file.get("quantization")
        if not isinstance(hq, dict):
            problems.append(Problem("missing_config_field", f"{QUANT_CONFIG_NAME}: no \"quantization\" object; "
                                    "TensorRT-LLM and vLLM cannot read it; fix: write {\"quantization\": "
                                    "{\"quant_algo\": ..., \"kv_cache_quant_algo\": ..., \"group_size\": 16, "
                                    "\"exclude_modules\": [...]}}", tensor=QUANT_CONFIG_NAME))
            hq = {}
    method = str((qc or {}).get("quant_method", "")).lower()
    if method.startswith("modelopt") or (qc is None and hq is not None):
        form = "modelopt"
        algo = (qc or {}).get("quant_algo") or (hq or {}).get("quant_algo")
    elif method == "compressed-tensors":
        form = "compressed-tensors"
        algo = None
    elif method == "fp8" and (qc or {}).get("moe_quant_algo"):
        form = "deepseek-fp8-moe-nvfp4"
        algo = str(qc["moe_quant_algo"])
    else:
        form = "unknown"
        algo = None
    algo = str(algo).upper() if algo else None
    input_needed = {name: False for name in ENGINES}
    mixed = None
    if form == "modelopt" and algo == "MIXED_PRECISION":  # each layer's algorithm in quantized_layers (vLLM)
        source = qc if isinstance((qc or {}).get("quantized_layers"), dict) else (hq or {})
        mixed = source.get("quantized_layers") if isinstance(source.get("quantized_layers"), dict) else {}
        w4a4 = any(isinstance(v, dict) and str(v.get("quant_algo", "")).upper() == "NVFP4" for v in mixed.values())
        input_needed.update({e.name: w4a4 for e in ENGINE_RECORDS if e.mixed_precision})
    elif form == "modelopt":
        w4a4 = algo == "NVFP4"
        groups = config_groups(qc)
        groups_w4a16 = bool(groups) and all(isinstance(g, dict) and g.get("input_activations") is None
                                            for g in groups.values())
        input_needed = {e.name: w4a4 and not (e.w4a16_from_groups and groups_w4a16) for e in ENGINE_RECORDS}
    elif form == "compressed-tensors":
        w4a4 = any(isinstance(g, dict) and isinstance(g.get("input_activations"), dict)
                   and g["input_activations"].get("dynamic") is not True for g in config_groups(qc).values())
        input_needed = {name: w4a4 for name in ENGINES}
    elif form == "deepseek-fp8-moe-nvfp4":
        input_needed = {name: algo == "NVFP4" for name in ENGINES}
    exclude, where = _exclusion_lists(qc, hq, problems)
    return Configs(form, algo, qc, hq, input_needed, exclude, where, mixed)


def _exclusion_lists(qc: dict | None, hq: dict | None, problems: list[Problem]
                     ) -> tuple[dict[str, list[str] | None], dict[str, str]]:
    """Per engine, the exclusion list it reads and that list's field, from the file the engine reads
    (each engine record's ``reads_first``, as :func:`fp4pass.checkpoint.engines.engine_verdicts` reads it): vLLM
    and SGLang config.json's quantization_config (``ignore``, else ``exclude_modules``) when there is one, else
    hf_quant_config.json's ``quantization.exclude_modules``; TensorRT-LLM hf_quant_config.json when there is one,
    else config.json.
    A list that is not a list of strings is a ``bad_config_value`` (the engine raises on it) and None."""
    from fp4pass.safetensors.patterns import BadPattern, entries

    from_qc = from_hq = None
    if qc is not None:
        key = "ignore" if "ignore" in qc else "exclude_modules"
        from_qc = (qc.get(key), f"{CONFIG_NAME} quantization_config.{key}")
    if hq is not None:
        from_hq = (hq.get("exclude_modules"), f"{QUANT_CONFIG_NAME} quantization.exclude_modules")
    chosen = {e.name: from_hq or from_qc if e.reads_first == QUANT_CONFIG_NAME else from_qc or from_hq
              for e in ENGINE_RECORDS}
    lists: dict[str, list[str] | None] = {}
    where: dict[str, str] = {}
    bad: dict[str, Problem] = {}
    for engine, (value, name) in ((e, c or (None, "no exclusion list")) for e, c in chosen.items()):
        where[engine] = name
        try:
            lists[engine] = entries(value, name)
        except BadPattern as exc:
            lists[engine] = None
            if name not in bad:
                bad[name] = Problem("bad_config_value", f"{exc}; the engine raises on it when it builds the "
                                    "model; fix: a list of module names (strings)",
                                    tensor=name.split(" ")[0], engines=[])
                problems.append(bad[name])
            bad[name].engines.append(engine)
    return lists, where


def _reading_first(name: str) -> list[str]:
    """The engines that read the config file ``name`` first (where both are there, the one they read)."""
    return [e.name for e in ENGINE_RECORDS if e.reads_first == name]


def check_configs(cfg: Configs, problems: list[Problem]) -> None:
    """Required fields, accepted values, and config.json against hf_quant_config.json."""
    hq, qc = cfg.hq, cfg.qc
    if hq is not None and hq != {}:
        missing = [k for k in ("quant_algo", "kv_cache_quant_algo", "group_size", "exclude_modules") if k not in hq]
        readers = _reading_first(QUANT_CONFIG_NAME) if qc is not None else list(ENGINES)
        for key in missing:
            problems.append(Problem(
                "missing_config_field", f"{QUANT_CONFIG_NAME}: quantization.{key} is missing; vLLM refuses the "
                f"file (\"NVFP4 quantization requires the following fields\") and TensorRT-LLM cannot read it; "
                f"fix: add \"{key}\" (null where it does not apply)", tensor=QUANT_CONFIG_NAME, engines=readers))
        if "group_size" in hq and hq["group_size"] != 16:
            problems.append(Problem("bad_config_value", f"{QUANT_CONFIG_NAME}: group_size {hq['group_size']!r}; "
                                    "NVFP4 blocks are 16 elements; fix: \"group_size\": 16",
                                    tensor=QUANT_CONFIG_NAME, engines=readers))
    if cfg.form == "modelopt" and qc is not None and not qc.get("quant_algo"):
        problems.append(Problem("missing_config_field", f"{CONFIG_NAME}: quantization_config.quant_algo is "
                                "missing; vLLM raises \"Missing 'quant_algo' in quantization config\"; fix: "
                                "\"quant_algo\": \"NVFP4\" (or \"W4A16_NVFP4\" without input scales)",
                                tensor=CONFIG_NAME, engines=_reading_first(CONFIG_NAME)))
    if cfg.form == "compressed-tensors":
        groups = config_groups(qc)
        if not groups:
            problems.append(Problem("missing_config_field", f"{CONFIG_NAME}: quantization_config.config_groups is "
                                    "missing or empty; compressed-tensors and vLLM quantize nothing or refuse; "
                                    "fix: one group with targets [\"Linear\"] and the NVFP4 weights arguments",
                                    tensor=CONFIG_NAME))
        top = qc.get("format")
        for gname, group in groups.items():
            group = group if isinstance(group, dict) else {}
            fmt = group.get("format", top)
            if fmt is None:
                problems.append(Problem("missing_config_field", f"{CONFIG_NAME}: quantization_config has no "
                                        f"\"format\" (top level or in {gname}); vLLM cannot tell the packed NVFP4 "
                                        "form; fix: \"format\": \"nvfp4-pack-quantized\"", tensor=CONFIG_NAME))
            elif fmt != "nvfp4-pack-quantized":
                problems.append(Problem("bad_config_value", f"{CONFIG_NAME}: {gname} format {fmt!r} with NVFP4 "
                                        "tensors; engines read the tensors in another layout; fix: "
                                        "\"nvfp4-pack-quantized\"", tensor=CONFIG_NAME))
            weights = group.get("weights")
            if not isinstance(weights, dict):
                problems.append(Problem("missing_config_field", f"{CONFIG_NAME}: {gname} has no \"weights\"; "
                                        "nothing is quantized; fix: the NVFP4 weights arguments",
                                        tensor=CONFIG_NAME))
                continue
            want = {"num_bits": 4, "type": "float", "group_size": 16, "strategy": "tensor_group"}
            for key, value in want.items():
                if weights.get(key) != value:
                    problems.append(Problem("bad_config_value", f"{CONFIG_NAME}: {gname}.weights.{key} is "
                                            f"{weights.get(key)!r}, NVFP4 needs {value!r}; vLLM picks another "
                                            f"scheme or refuses; fix: \"{key}\": {value!r}", tensor=CONFIG_NAME))
    if cfg.form == "unknown":
        problems.append(Problem("missing_config_field", f"{CONFIG_NAME}: no quantization_config that names NVFP4 "
                                f"(quant_method modelopt or compressed-tensors) and no {QUANT_CONFIG_NAME}; "
                                "engines load the NVFP4 tensors as plain weights and fail; fix: write the "
                                "quantization config of the form the tensors are in", tensor=CONFIG_NAME))
    if qc is not None and hq:
        _compare(cfg, qc, hq, problems)


def _compare(cfg: Configs, qc: dict, hq: dict, problems: list[Problem]) -> None:
    def disagree(what: str, a, b) -> None:
        problems.append(Problem("config_disagreement", f"{what}: {CONFIG_NAME} says {a!r}, {QUANT_CONFIG_NAME} "
                                f"says {b!r}; vLLM and SGLang read {CONFIG_NAME}, TensorRT-LLM reads "
                                f"{QUANT_CONFIG_NAME}, so they serve different models; fix: write the same in "
                                "both", tensor=QUANT_CONFIG_NAME))

    if cfg.form != "modelopt":
        disagree("quant_method", qc.get("quant_method"), "modelopt")
        return
    a, b = qc.get("quant_algo"), hq.get("quant_algo")
    if a and b and str(a).upper() != str(b).upper():
        disagree("quant_algo", a, b)
    if "group_size" in qc and "group_size" in hq and qc["group_size"] != hq["group_size"]:
        disagree("group_size", qc["group_size"], hq["group_size"])
    if "kv_cache_quant_algo" in qc and "kv_cache_quant_algo" in hq and qc["kv_cache_quant_algo"] != hq[
            "kv_cache_quant_algo"]:
        disagree("kv_cache_quant_algo", qc["kv_cache_quant_algo"], hq["kv_cache_quant_algo"])
    lists = {key: qc[key] for key in ("ignore", "exclude_modules") if isinstance(qc.get(key), list)}
    hq_list = hq.get("exclude_modules")
    if isinstance(hq_list, list):
        for key, value in lists.items():
            if sorted(map(str, value)) != sorted(map(str, hq_list)):
                only_a = sorted(set(map(str, value)) - set(map(str, hq_list)))
                only_b = sorted(set(map(str, hq_list)) - set(map(str, value)))
                disagree(f"exclusions ({key} vs exclude_modules)", f"{len(value)} entries, {only_a[:3]} not in "
                         f"the other", f"{len(hq_list)} entries, {only_b[:3]} not in the other")
                break
