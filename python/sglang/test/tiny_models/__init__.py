"""Tiny random-weight models with real architectures, built locally (no downloads).

``python -m sglang.test.tiny_models --arch {qwen3_next,qwen3_moe,glm4_moe} --out DIR [--seed N]
[--force]``
writes a deterministic checkpoint (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json with a Qwen3-style chat template, generation_config.json) that
``transformers.AutoModelForCausalLM`` and SGLang load. The default architecture is Qwen3-Next
(gated DeltaNet + gated attention, 64-expert top-8 MoE with a shared expert).
"""

from .builder import (
    ARCHS,
    DEFAULT_ARCH,
    DEFAULT_SEED,
    MAX_POSITION_EMBEDDINGS,
    build,
    make_state_dict,
    model_config,
    param_count,
)
from .tokenizer import ADDED_TOKENS, VOCAB_SIZE, added_token_ids, chat_template, tokenizer_json

__all__ = [
    "ADDED_TOKENS",
    "ARCHS",
    "DEFAULT_ARCH",
    "DEFAULT_SEED",
    "MAX_POSITION_EMBEDDINGS",
    "VOCAB_SIZE",
    "added_token_ids",
    "build",
    "chat_template",
    "make_state_dict",
    "model_config",
    "param_count",
    "tokenizer_json",
]
