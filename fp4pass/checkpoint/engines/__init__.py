"""What the serving engines' loaders do with an NVFP4 checkpoint: exclusion rules, fused modules, verdicts.

Each rule restates one engine function, named in its docstring (vLLM 0.33.0 and SGLang 0.5.23 wheels,
TensorRT-LLM's ``tensorrt_llm`` sources), so that a checkpoint can be judged without the engine installed.
The vLLM rules are also checked against vLLM's own code in the test suite.

- :mod:`.records`: one record per engine (vLLM, SGLang, TensorRT-LLM): which config it reads first, its
  exclusion rule per form, W4A4 or W4A16, its fused modules, its outcomes, its fixes;
- :mod:`.rules`: the exclusion rules themselves, one class per engine and form;
- :mod:`.exclusions`: an engine's reading of one list, indexed once; the engine's layers over the modules;
- :mod:`.verdicts`: each engine's verdict on a folder's configs and tensor names.
"""

from fp4pass.checkpoint.engines.exclusions import FUSED_SHARDS, Exclusions, engine_modules, exclusions, is_excluded
from fp4pass.checkpoint.engines.records import ENGINE_RECORDS, ENGINES, Engine, engine_record
from fp4pass.checkpoint.engines.rules import NVFP4_ALGOS, MixedShards, QuantizedLayers, SchemeTargets, vllm_module_name
from fp4pass.checkpoint.engines.verdicts import ARCH_DEEPSEEK_V4, ct_targets, engine_verdicts, verdict_line
from fp4pass.checkpoint.families import gpt_oss
from fp4pass.safetensors.patterns import BadPattern

ARCH_GPT_OSS = gpt_oss.FAMILY.architectures[0]

__all__ = ["ENGINES", "ENGINE_RECORDS", "Engine", "engine_record", "FUSED_SHARDS", "MixedShards", "BadPattern",
           "Exclusions", "exclusions", "is_excluded", "engine_modules", "vllm_module_name", "engine_verdicts",
           "verdict_line", "ct_targets", "ARCH_GPT_OSS", "ARCH_DEEPSEEK_V4", "QuantizedLayers", "SchemeTargets",
           "NVFP4_ALGOS"]
