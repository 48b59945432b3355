"""Exclusion rules under hostile patterns: bounded matching, indexed lists, the engines' rules kept exact.

Oracles: :func:`fnmatch.fnmatchcase` and :mod:`re` (what the engines call), and a plain restatement of each
engine's rule in this file (one loop over the list, as the engines' sources read), against which the indexed
:class:`fp4pass.checkpoint.engines.Exclusions` must agree on every name.
"""

from __future__ import annotations

import fnmatch
import re
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fp4pass.checkpoint import engines
from fp4pass.checkpoint.engines import Exclusions, MixedShards, is_excluded
from fp4pass.checkpoint.output_forms import exclude_list
from fp4pass.safetensors.patterns import BadPattern, Glob, GlobIndex, dotted_runs

ROOT = Path(__file__).resolve().parents[2]

# ------------------------------------------------------------------------------------ the plain restatements


def _sglang_path_match(ignored: str, prefix: str) -> bool:
    """SGLang 0.5.23 layers/quantization/utils.py ``_module_path_match``, as written there."""
    ignored, prefix = ignored.rstrip("."), prefix.rstrip(".")
    return ignored == prefix or prefix.startswith(ignored + ".") or f".{ignored}." in f".{prefix}."


def _shards(module, shards, match):
    if not shards:
        return match(module)
    hits = [match(s) for s in shards]
    if any(hits) and not all(hits):
        raise MixedShards(module)
    return all(hits)


def _plain(engine: str, module: str, exclude: list[str], shards=None, form: str = "modelopt") -> bool:
    """Each engine's rule as one loop over the list (see fp4pass.checkpoint.engines for the sources)."""
    if engine == "trtllm":
        return any(fnmatch.fnmatchcase(module, p) for p in exclude if not p.startswith("re:"))
    if form == "compressed-tensors":
        def match(name):
            return any(re.match(p[3:], name) if p.startswith("re:") else p == name for p in exclude)
        return match(module) or (bool(shards) and _shards(module, shards, match))
    if engine == "vllm":
        patterns = []
        for p in exclude:
            patterns += [p[:-1], p[:-1] + ".*"] if len(p) >= 2 and p[-1] == "*" and p[-2] != "." else [p]
        if module in patterns or (shards and _shards(module, shards, lambda s: s in patterns)):
            return True
        return any(p in module for p in patterns) or any(fnmatch.fnmatchcase(module, p) for p in patterns)
    if _shards(module, shards, lambda s: any(_sglang_path_match(p, s) for p in exclude)):
        return True
    parts = module.split(".")
    for p in exclude:
        rx = re.compile(p.replace(".", r"\.").replace("*", ".*"))
        if rx.fullmatch(module) or any(rx.fullmatch(part) for part in parts):
            return True
        tail = p.rsplit(".", 1)[-1]
        if tail in {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"} and tail in parts[-1]:
            return True
    return False


# --------------------------------------------------------------------------------------------- the globs

GLOB_ALPHABET = "ab.1*?[]!-"
NAME_ALPHABET = "ab.1-]![*"


@settings(max_examples=400, deadline=None)
@given(st.text(GLOB_ALPHABET, max_size=9), st.text(NAME_ALPHABET, max_size=9))
def test_glob_agrees_with_fnmatchcase(pattern, name):
    assert Glob(pattern).match(name) == fnmatch.fnmatchcase(name, pattern)


@settings(max_examples=300, deadline=None)
@given(st.text("ab.*", max_size=8), st.text("ab.", max_size=8))
def test_star_only_glob_agrees_with_sglangs_regex(pattern, name):
    regex = pattern.replace(".", r"\.").replace("*", ".*")
    assert Glob(pattern, classes=False).match(name) == bool(re.fullmatch(regex, name))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(GLOB_ALPHABET, max_size=6), max_size=8), st.text(NAME_ALPHABET, max_size=7))
def test_glob_index_finds_what_a_scan_finds(patterns, name):
    assert GlobIndex(patterns).match(name) == any(fnmatch.fnmatchcase(name, p) for p in patterns)


def test_glob_classes_read_as_fnmatch_reads_them():
    cases = {"layer[0-2].w": ["layer1.w", "layer3.w"], "x[!ab]": ["xc", "xa"], "[]a]z": ["]z", "bz"],
             "a[b": ["a[b", "ab"], "[z-a]q": ["zq", "aq"], "w?": ["w1", "w"]}
    for pattern, names in cases.items():
        for name in names:
            assert Glob(pattern).match(name) == fnmatch.fnmatchcase(name, pattern), (pattern, name)


def test_dotted_runs_are_the_whole_component_runs():
    assert sorted(dotted_runs("a.b.c")) == sorted(["a", "b", "c", "a.b", "b.c", "a.b.c"])
    assert sorted(dotted_runs("a.b.c", {1})) == ["a.b", "b.c"]
    assert "" in set(dotted_runs("a..b"))  # an empty component is a run too (".." in the name)


# ------------------------------------------------------------------------------------ bounded in time

HOSTILE_GLOB = "*a*a*a*a*a*a*a*a*a*a*ab"


@pytest.mark.parametrize("engine", engines.ENGINES)
def test_a_backtracking_glob_is_decided_at_once(engine):
    """SGLang turns ``*`` into ``.*``: that glob against a run of a's backtracks in ``re`` for seconds at 32
    a's (for hours at 60); the segment matcher answers (no match: the name has no b) at once."""
    module = "model.layers.0." + "a" * 32
    start = time.process_time()
    assert not is_excluded(engine, module, [HOSTILE_GLOB])
    assert not Glob(HOSTILE_GLOB).match("a" * 32)
    assert time.process_time() - start < 1.0
    assert not Glob("*a*a*a*a*a*a*a*a*a*a*a[b]").match("a" * 5000)  # classes: the same segment search
    assert time.process_time() - start < 2.0


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_a_catastrophic_regex_is_answered_or_a_bad_pattern_never_a_hang(engine):
    """``(a+)+$`` against ``aaa...a!`` backtracks in ``re`` (seconds at 26 a's, hours at 40): it is answered
    (no match) at once; ``(a|aa)+$`` backtracks in every engine (seconds at 36 a's): it is stopped at its time
    limit, a BadPattern naming it."""
    start = time.process_time()
    assert not is_excluded(engine, "a" * 26 + "!", ["lm_head", "re:(a+)+$"], form="compressed-tensors")
    assert is_excluded(engine, "a" * 26, ["re:(a+)+$"], form="compressed-tensors")
    with pytest.raises(BadPattern, match=r"re:\(a\|aa\)\+\$.*ran past"):
        is_excluded(engine, "a" * 36 + "!", ["lm_head", "re:(a|aa)+$"], form="compressed-tensors")
    assert time.process_time() - start < 2.0


def test_a_regex_list_stops_at_its_budget():
    """Many regexes each under the per-call limit still stop at the list's budget."""
    rules = Exclusions("vllm", ["re:(a|aa)+$"], form="compressed-tensors")
    start = time.process_time()
    with pytest.raises(BadPattern, match="together"):
        for _ in range(200):  # ~0.07 s each, under the per-call limit
            rules.excluded("a" * 26 + "!")
    assert time.process_time() - start < 4.0


@pytest.mark.parametrize("entry, engines_refusing", [
    ("re:(", {"vllm", "sglang"}),  # compressed-tensors regex: not a regex
    ("model.layers.[", {"sglang"}),  # a glob SGLang turns into an invalid regex; fnmatch reads "[" literally
    ("model.layers.(0", {"sglang"}),
])
def test_an_invalid_pattern_is_a_bad_pattern(entry, engines_refusing):
    form = "compressed-tensors" if entry.startswith("re:") else "modelopt"
    for engine in engines.ENGINES:
        if engine in engines_refusing:
            with pytest.raises(BadPattern, match=re.escape(entry)):
                Exclusions(engine, ["lm_head", entry], form)
        else:
            assert not Exclusions(engine, ["lm_head", entry], form).excluded("model.layers.0.mlp")


@pytest.mark.parametrize("value, where", [(["lm_head", 7], r"\[1\] is int 7"), ("lm_head", "is str"),
                                          ({"lm_head": 1}, "is dict"), ([None], r"\[0\] is NoneType")])
def test_entries_that_are_not_strings_are_bad_patterns(value, where):
    for engine in engines.ENGINES:
        with pytest.raises(BadPattern, match=where):
            Exclusions(engine, value, where="config.json quantization_config.ignore")


def test_regex_size_caps_are_bad_patterns():
    with pytest.raises(BadPattern, match="characters long"):
        Exclusions("vllm", ["re:" + "a" * 20_000], "compressed-tensors")
    with pytest.raises(BadPattern, match="regular expressions; fp4pass matches at most"):
        Exclusions("sglang", [f"re:x{i}" for i in range(10_001)], "compressed-tensors")


# ------------------------------------------------------------------------------- indexed = plain, exactly

NAMES = ["model.layers.1.self_attn.q_proj", "model.layers.10.self_attn.q_proj", "model.layers.1",
         "model.layers.11.mlp.gate", "model.layers.1.mlp.gate_up_proj", "lm_head", "model.norm", "x.lm_head.y",
         "model.layers.0.self_attn.fused_qkv_a_proj_with_mqa", "layers.1.attn.wq_a", "model.layers.101.mlp.experts"]
LISTS = [
    ["model.layers.1"], ["model.layers.1*"], ["model.layers.1.*"], ["layers.1"], ["lm_head"], ["*lm_head"],
    ["model.layers.1?.*"], ["model.layers.[01].self_attn*"], ["*.mlp.gate"], ["model.layers.1."], ["mlp"],
    ["model.layers.0.self_attn.kv_a_proj_with_mqa"], ["*"], ["model.*.q_proj", "model.layers.1*.mlp*"],
    ["re:^model\\.layers\\.1\\.", "lm_head"], ["re:.*gate$"], ["model.layers.1.self_attn.q_proj"],
    ["model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj"], ["model.layers.1.mlp.gate_proj"],
]


@pytest.mark.parametrize("exclude", LISTS, ids=lambda x: "|".join(x))
@pytest.mark.parametrize("form", ["modelopt", "compressed-tensors"])
def test_indexed_rules_agree_with_the_plain_loops(exclude, form):
    cases = [(n, None) for n in NAMES] + [
        ("model.layers.1.mlp.gate_up_proj", ["model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj"]),
        ("model.layers.10.self_attn.qkv_proj", [f"model.layers.10.self_attn.{p}_proj" for p in "qkv"])]
    for engine in engines.ENGINES:
        rules = Exclusions(engine, exclude, form)
        for name, shards in cases:
            try:
                want = _plain(engine, name, exclude, shards, form)
            except MixedShards:
                with pytest.raises(MixedShards):
                    rules.excluded(name, shards)
                continue
            assert rules.excluded(name, shards) == want, (engine, name, shards)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text("ab.1*", min_size=1, max_size=6), max_size=6), st.text("ab.1", max_size=8))
def test_indexed_rules_agree_with_the_plain_loops_on_random_lists(exclude, name):
    for engine in engines.ENGINES:
        assert Exclusions(engine, exclude).excluded(name) == _plain(engine, name, exclude), engine


# ------------------------------------------------------------------------------- the kinds of rule bug

def test_sglang_ancestor_is_a_whole_component_prefix():
    """``model.layers.1`` is an ancestor of ``model.layers.1.mlp`` but not of ``model.layers.10.mlp``."""
    for name in ("model.layers.10.self_attn.o_proj", "model.layers.11.mlp.down_proj", "model.layers.100.x"):
        assert not is_excluded("sglang", name, ["model.layers.1"])
        assert not is_excluded("sglang", name, ["layers.1"])
    assert is_excluded("sglang", "model.layers.1.self_attn.o_proj", ["model.layers.1"])
    assert is_excluded("sglang", "model.layers.1.self_attn.o_proj", ["layers.1.self_attn"])
    assert not is_excluded("sglang", "model.layers.1.self_attn_x.o_proj", ["layers.1.self_attn"])
    assert is_excluded("sglang", "model.layers.1", ["model.layers.1."])  # trailing dots are stripped
    # shards of a fused module: each shard's ancestors; layer 10's shards are not under model.layers.1
    shards10 = [f"model.layers.10.self_attn.{p}_proj" for p in "qkv"]
    assert not is_excluded("sglang", "model.layers.10.self_attn.qkv_proj", ["model.layers.1"], shards10)


def _linear_leaves_of(architecture: str) -> set[str]:
    """The Linear names a model of ``architecture`` has in its checkpoints: from transformers' modeling code
    (``self.NAME =``), or for DeepSeek-V4 (original naming) and Kimi-K3 (no transformers model) from the bundled
    checkpoint's tensor names."""
    bundled = {engines.ARCH_DEEPSEEK_V4: "deepseek", "KimiK3ForConditionalGeneration": "kimi_k3"}
    if architecture in bundled:
        from safetensors import safe_open

        leaves = set()
        for path in (ROOT / "models" / "checkpoints" / bundled[architecture]).glob("*.safetensors"):
            with safe_open(path, "pt") as f:
                leaves |= {k.split(".")[-2] for k in f.keys() if k.endswith(".weight")}
        return leaves
    transformers = pytest.importorskip("transformers")
    folder = {"GptOssForCausalLM": "gpt_oss", "DeepseekV3ForCausalLM": "deepseek_v3",
              "DeepseekV2ForCausalLM": "deepseek_v2", "KimiLinearForCausalLM": "kimi_linear",
              "Qwen3MoeForCausalLM": "qwen3_moe"}[architecture]
    source = Path(transformers.__file__).parent / "models" / folder / f"modeling_{folder}.py"
    return set(re.findall(r"self\.(\w+)\s*=", source.read_text()))


@pytest.mark.parametrize("architecture", sorted(engines.FUSED_SHARDS))
def test_every_fused_shard_is_a_module_the_model_has(architecture):
    """A misspelt shard (``v_porj``) makes the fused module never form: its exclusions are then judged shard
    by shard, which no engine does."""
    leaves = _linear_leaves_of(architecture)
    for fused, shards in engines.FUSED_SHARDS[architecture].items():
        assert set(shards) <= leaves, (architecture, fused, set(shards) - leaves)
    for fused, shards in engines.engine_record("sglang").fused.items():  # SGLang's fallback fused modules
        assert set(shards) <= _linear_leaves_of("Qwen3MoeForCausalLM"), fused


def test_a_kept_dense_layer_is_never_excluded_by_a_wildcard_that_covers_later_layers():
    """A model whose layer 1 is kept dense and whose layers 10, 11 and 100 are NVFP4: the ModelOpt list must
    not cover any converted module, in any engine's reading (fnmatch, vLLM's substring rule, SGLang's)."""
    kept = ["model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj", "model.layers.1.mlp.down_proj",
            "model.layers.1.self_attn.q_proj", "lm_head"]
    converted = [f"model.layers.{i}.mlp.experts.{e}.{w}" for i in (10, 11, 100) for e in (0, 12, 101)
                 for w in ("gate_proj", "up_proj", "down_proj")]
    exclude = exclude_list(kept, converted)
    for module in converted:
        assert not any(fnmatch.fnmatchcase(module, p) for p in exclude), module
        for engine in engines.ENGINES:
            assert not _plain(engine, module, exclude), (engine, module)
    for module in kept:
        assert all(_plain(engine, module, exclude) for engine in engines.ENGINES), module


def test_a_wildcard_over_nvfp4_layers_fails_the_verdicts():
    """``model.layers.1*`` written for a dense layer 1 also covers the NVFP4 experts of layers 10 and 11: every
    engine would load them as bf16."""
    names = []
    for layer in (1, 10, 11):
        names += [f"model.layers.{layer}.self_attn.{p}_proj.weight" for p in "qkvo"]
    for layer in (10, 11):
        for e in range(12):
            for w in ("gate_proj", "up_proj", "down_proj"):
                m = f"model.layers.{layer}.mlp.experts.{e}.{w}"
                names += [f"{m}.weight", f"{m}.weight_scale", f"{m}.weight_scale_2"]
    names += ["model.layers.1.mlp.down_proj.weight", "lm_head.weight"]
    config = {"architectures": ["Qwen3MoeForCausalLM"]}

    def quant(exclude):
        return {"producer": {"name": "modelopt"}, "quantization": {
            "quant_algo": "W4A16_NVFP4", "kv_cache_quant_algo": None, "group_size": 16, "exclude_modules": exclude}}

    attn = [f"model.layers.{i}.self_attn*" for i in (10, 11)]
    good = engines.engine_verdicts(config, quant(["model.layers.1.*", "lm_head"] + attn), names)
    assert all(v["loads"] for v in good.values()), good
    bad = engines.engine_verdicts(config, quant(["model.layers.1*", "lm_head"] + attn), names)
    for engine in ("vllm", "sglang"):
        assert not bad[engine]["loads"] and "model.layers.10.mlp.experts" in bad[engine]["why"], bad[engine]


def test_trtllm_reads_hf_quant_config_exclusions_and_the_others_config_json():
    names = ["model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.experts.0.w1.weight",
             "model.layers.0.mlp.experts.0.w1.weight_scale", "model.layers.0.mlp.experts.0.w1.weight_scale_2"]
    fields = {"quant_algo": "W4A16_NVFP4", "kv_cache_quant_algo": None, "group_size": 16}
    config = {"architectures": ["Qwen3MoeForCausalLM"], "quantization_config": {
        "quant_method": "modelopt", **fields, "ignore": ["model.layers.0.self_attn.o_proj"]}}
    hf_quant = {"producer": {"name": "modelopt"}, "quantization": {**fields, "exclude_modules": ["lm_head"]}}
    verdicts = engines.engine_verdicts(config, hf_quant, names)
    assert verdicts["vllm"]["loads"] and verdicts["sglang"]["loads"]
    assert not verdicts["trtllm"]["loads"] and "o_proj" in verdicts["trtllm"]["why"]
    hf_quant["quantization"]["exclude_modules"] = ["model.layers.0.self_attn.o_proj"]
    config["quantization_config"]["ignore"] = ["lm_head"]
    verdicts = engines.engine_verdicts(config, hf_quant, names)
    assert verdicts["trtllm"]["loads"] and not verdicts["vllm"]["loads"] and not verdicts["sglang"]["loads"]


@pytest.mark.parametrize("exclude, said", [(["model.layers.0.self_attn.o_proj", 3], "exclude_modules[1] is int 3"),
                                           ("model.layers.0.self_attn.o_proj", "exclude_modules is str")])
def test_bad_entries_make_the_verdict_say_so(exclude, said):
    names = ["model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.experts.0.w1.weight",
             "model.layers.0.mlp.experts.0.w1.weight_scale", "model.layers.0.mlp.experts.0.w1.weight_scale_2"]
    hf_quant = {"producer": {"name": "modelopt"}, "quantization": {
        "quant_algo": "W4A16_NVFP4", "kv_cache_quant_algo": None, "group_size": 16, "exclude_modules": exclude}}
    verdicts = engines.engine_verdicts({"architectures": ["Qwen3MoeForCausalLM"]}, hf_quant, names)
    for v in verdicts.values():
        assert not v["loads"] and said in v["why"], v
