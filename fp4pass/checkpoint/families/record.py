"""The :class:`Family` record (one architecture as fp4pass and the serving engines see it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

__all__ = ["Family", "ALL_ENGINES"]


def _same(module: str) -> str:
    return module


ALL_ENGINES = ("vllm", "sglang", "trtllm")


@dataclass(frozen=True)
class Family:
    """One architecture (config.json ``architectures[0]``) as the engines see it.

    - ``vllm_fused``: vLLM's ``packed_modules_mapping`` (fused module -> its checkpoint shards);
    - ``vllm_name``: a checkpoint module's name in vLLM (the model class's ``hf_to_vllm_mapper``);
    - ``sglang_name``: a checkpoint module's name in SGLang's model at run time, which its exclusion lookups
      use (written beside the checkpoint's name in an exclusion list where the two differ);
    - ``engines``: the engines whose loader code for this family was read; the others' verdicts say "not
      claimed";
    - ``text_config``: the key of the nested text-model config that holds ``quantization_config`` (or None);
    - ``transformers``: whether transformers' own modeling code builds the model (calibration, diff);
    - ``sources``: where each fact comes from.
    """

    name: str
    architectures: tuple[str, ...]
    vllm_fused: dict[str, tuple[str, ...]] = field(default_factory=dict)
    vllm_name: Callable[[str], str] = _same
    sglang_name: Callable[[str], str] = _same
    engines: tuple[str, ...] = ALL_ENGINES
    text_config: str | None = None
    transformers: bool = True
    sources: tuple[str, ...] = ()
