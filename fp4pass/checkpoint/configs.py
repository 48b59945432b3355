"""Where a checkpoint's config.json describes its quantization: at the top, or inside a nested text-model config.

A multimodal wrapper (Kimi-K3's ``KimiK3ForConditionalGeneration``, and the ``*ForConditionalGeneration``
models that hold a language model) nests the text model's config under ``text_config``, and the release may
put the text model's ``quantization_config`` there alone: Kimi-K3 ships its MXFP4 description in
``text_config`` (vLLM's ``KimiK3Config`` copies it up, vllm/transformers_utils/configs/kimi_k3.py). A reader
takes the top-level description first and a nested one where the top has none; a writer replaces it at the top
*and* wherever the source had one, so that no config of the output still describes the source's MXFP4 weights.
"""

from __future__ import annotations

__all__ = ["NESTED_CONFIGS", "QUANT_KEY", "quantization_config", "quantization_config_place", "text_config",
           "with_quantization_config"]

QUANT_KEY = "quantization_config"
#: the keys of nested text-model configs, in the order they are searched
NESTED_CONFIGS = ("text_config", "language_config", "llm_config")


def quantization_config_place(config: dict | None) -> str | None:
    """Where ``config`` holds its quantization description: "quantization_config" at the top, or
    "text_config.quantization_config" (a nested config's key, :data:`NESTED_CONFIGS`); None when nowhere."""
    config = config if isinstance(config, dict) else {}
    if isinstance(config.get(QUANT_KEY), dict):
        return QUANT_KEY
    for key in NESTED_CONFIGS:
        nested = config.get(key)
        if isinstance(nested, dict) and isinstance(nested.get(QUANT_KEY), dict):
            return f"{key}.{QUANT_KEY}"
    return None


def quantization_config(config: dict | None) -> dict | None:
    """The quantization description of ``config``: the top-level ``quantization_config``, else the first nested
    text-model config's (:func:`quantization_config_place`); None when there is none."""
    place = quantization_config_place(config)
    if place is None:
        return None
    if place == QUANT_KEY:
        return config[QUANT_KEY]
    return config[place.partition(".")[0]][QUANT_KEY]


def text_config(config: dict | None) -> dict:
    """The text model's config: the first nested one that is an object (:data:`NESTED_CONFIGS`), else ``config``."""
    config = config if isinstance(config, dict) else {}
    for key in NESTED_CONFIGS:
        if isinstance(config.get(key), dict):
            return config[key]
    return config


def with_quantization_config(config: dict, description: dict) -> dict:
    """A copy of ``config`` whose quantization description is ``description``: at the top, and in every nested
    text-model config that had one (the output's nested config then describes the output, not the source)."""
    out = dict(config)
    out[QUANT_KEY] = description
    for key in NESTED_CONFIGS:
        nested = out.get(key)
        if isinstance(nested, dict) and QUANT_KEY in nested:
            out[key] = {**nested, QUANT_KEY: description}
    return out
