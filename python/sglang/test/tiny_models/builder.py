"""Build tiny random-weight Qwen3-Next / Qwen3-MoE / GLM-4.5-MoE / Qwen3.5-MoE checkpoints
(config, weights, tokenizer; Qwen3.5 also its image and video processor configs).

Everything is deterministic: the same ``seed`` gives byte-identical files on every run. Each
tensor is drawn from its own generator seeded by (seed, tensor name), so changing one shape
leaves every other tensor unchanged. Weights are drawn in float32 and rounded to bfloat16,
which is what is stored, so a float32 run of the model is an exact upcast.

The checkpoint uses the original Hugging Face layout of the released Qwen and GLM checkpoints (one
tensor per expert projection, ``mlp.experts.{j}.gate_proj.weight``...), which both transformers
(it fuses experts on load) and SGLang's model loaders read. Gemma 4 and gpt-oss ship their
experts fused, as their releases do.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple

from . import tokenizer as tok_mod
from .quantize import QUANT_ARCHS, QUANTS, quantize_state

DEFAULT_ARCH = "qwen3_next"
DEFAULT_SEED = 0
MAX_POSITION_EMBEDDINGS = 262144

# Shared sizes (small enough for 2 CPU cores, big enough to be a real MoE).
HIDDEN = 256
NUM_LAYERS = 4
NUM_HEADS = 4
NUM_KV_HEADS = 2
HEAD_DIM = 64
NUM_EXPERTS = 64
TOP_K = 8
MOE_INTERMEDIATE = 128
ROPE_THETA = 10_000_000
FULL_ATTENTION_INTERVAL = 4

# --- init scales -------------------------------------------------------------------------
# Sub-layer inputs are RMS-normalised, so a projection with std s and fan-in n gives outputs of
# rms ~ s * sqrt(n). Projections use PROJ_GAIN / sqrt(fan_in): every block adds a visible but
# not dominant update to the residual stream (rms stays ~1.0-1.1 through the 4 layers), so
# outputs depend on the context (changing the first of 400 tokens moves ~5-15% of later
# argmaxes) while the embedding (rms EMBED_STD) keeps the token identity.
# Router logits have std ROUTER_LOGIT_STD (all 64 experts used, top-8 load skewed ~4:1).
# The lm_head gives logits of std LOGIT_STD with log-normal per-token row norms (a heavier top
# tail): median top-1/top-2 gap ~2 logits, peaked softmax (entropy ~0.8 nats), so greedy
# decoding is rarely decided by a near-tie. Measured bf16-vs-fp32 argmax disagreement is
# ~1-2% of positions; a float32 run is exact (weights are bf16 values), so strict greedy
# parity checks should run in float32.
EMBED_STD = 1.0
PROJ_GAIN = 0.7
ROUTER_LOGIT_STD = 2.0  # std of router logits for a unit-rms input
LOGIT_STD = 4.0  # std of output logits for a unit-rms final hidden state
LM_HEAD_ROW_SCALE_SIGMA = 0.35  # log-normal spread of per-token output norms (wider top gaps)
NORM_WEIGHT_STD = 0.05  # RMSNorm weights are 1 (+ this much noise) so loading bugs show up
QK_NORM_SCALE = 1.5  # q/k RMSNorm gain: attention logits std ~QK_NORM_SCALE**2 (not too flat)
A_MIN, A_MAX = 0.02, 1.0  # gated DeltaNet decay rates
DT_BIAS = -2.0
ATTN_BIAS_STD = 0.1  # GLM's q/k/v projection biases (attention_bias=True in the releases)
# GLM's e_score_correction_bias: added to the sigmoid scores (in (0, 1), spread ~0.2 at
# ROUTER_LOGIT_STD) for the choice of experts only, so it moves some choices without deciding
# them; the weights are the unbiased scores.
SCORE_BIAS_STD = 0.05

# GLM-4.5 MoE features (zai-org/GLM-4.5 config.json: routed_scaling_factor 2.5, one shared
# expert, first layers dense, sigmoid routing with a correction bias). The releases route with
# n_group = topk_group = 1; here 8 groups of 8 experts, 4 groups kept (DeepSeek-V3's shape), so
# the grouped top-k is exercised too.
GLM_ROUTED_SCALING_FACTOR = 2.5
GLM_N_GROUP = 8
GLM_TOPK_GROUP = 4
GLM_FIRST_K_DENSE = 1
GLM_DENSE_INTERMEDIATE = 512


# Mixtral (mistralai/Mixtral-8x7B-v0.1's config.json and tensor names: block_sparse_moe, experts
# w1/w3/w2, 8 experts top-2, no q/k norm) and OLMoE (allenai/OLMoE-1B-7B-0924's: q/k RMSNorms
# over the whole projection, 64 experts top-8 without renormalizing the top-k weights).
MIXTRAL_EXPERTS = 8
MIXTRAL_TOP_K = 2
MIXTRAL_EXPERT_INTERMEDIATE = 256

# DeepSeek-V3 (deepseek-ai/DeepSeek-V3's config.json and tensor names, bf16 instead of its FP8):
# multi-head latent attention (q_a/q_b and kv_a_proj_with_mqa/kv_b_proj low-rank projections
# with their RMSNorms, decoupled RoPE dims with YaRN scaling), first layer dense, sigmoid
# grouped top-k with e_score_correction_bias (noaux_tc), routed_scaling_factor 2.5, one shared
# expert. Release shapes: kv_lora_rank 512, q_lora_rank 1536, rope/nope/v head dims 64/128/128.
# q_lora_rank is a multiple of 128 as in the release: upstream loads q_a_proj and
# kv_a_proj_with_mqa into one fused linear by concatenating rows and (block FP8) their
# weight_scale_inv rows, which is right only when q_a_proj ends on a 128-row block boundary.
DSV3_KV_LORA_RANK = 64
DSV3_Q_LORA_RANK = 128
DSV3_QK_ROPE_HEAD_DIM = 32
DSV3_QK_NOPE_HEAD_DIM = 64
DSV3_V_HEAD_DIM = 64

ARCHS = (
    "qwen3_next",
    "qwen3_moe",
    "glm4_moe",
    "qwen3_5_moe",
    "gpt_oss",
    "mixtral",
    "olmoe",
    "deepseek_v3",
    "gemma4",
    "llama4",
)

# Released models' layer shapes at the tiny model's depth (4 layers) and tokenizer, for
# benchmarks that need real bytes per token (benchmark/cpu_decode.py): {name: (arch, config
# keys replaced)}. qwen3-30b-a3b: Qwen3-30B-A3B's hidden 2048, 128 experts of 768 top-8,
# 32 query / 4 KV heads of 128 (2.6 B parameters, 5.3 GB in bf16 with the 32,768-token vocab).
SHAPES = {
    "qwen3-30b-a3b": (
        "qwen3_moe",
        {
            "hidden_size": 2048,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "moe_intermediate_size": 768,
            "intermediate_size": 6144,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
            "head_dim": 128,
        },
    ),
}


def _common_config() -> dict:
    ids = tok_mod.added_token_ids()
    return {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": ids[tok_mod.ENDOFTEXT],
        "decoder_sparse_step": 1,
        "eos_token_id": ids[tok_mod.IM_END],
        "pad_token_id": ids[tok_mod.ENDOFTEXT],
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "initializer_range": 0.02,
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "mlp_only_layers": [],
        "moe_intermediate_size": MOE_INTERMEDIATE,
        "norm_topk_prob": True,
        "num_attention_heads": NUM_HEADS,
        "num_experts": NUM_EXPERTS,
        "num_experts_per_tok": TOP_K,
        "num_hidden_layers": NUM_LAYERS,
        "num_key_value_heads": NUM_KV_HEADS,
        "output_router_logits": False,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": ROPE_THETA,
        "router_aux_loss_coef": 0.001,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": tok_mod.VOCAB_SIZE,
    }


def _glm4_moe_config() -> dict:
    """config.json of the GLM-4.5-style model: the keys of zai-org/GLM-4.5's config.json (read
    by transformers' ``Glm4MoeConfig`` and SGLang's ``Glm4MoeForCausalLM``), tiny sizes."""
    ids = tok_mod.added_token_ids()
    return {
        "architectures": ["Glm4MoeForCausalLM"],
        "attention_bias": True,
        "attention_dropout": 0.0,
        "bos_token_id": ids[tok_mod.ENDOFTEXT],
        "eos_token_id": ids[tok_mod.IM_END],
        "pad_token_id": ids[tok_mod.ENDOFTEXT],
        "first_k_dense_replace": GLM_FIRST_K_DENSE,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "initializer_range": 0.02,
        "intermediate_size": GLM_DENSE_INTERMEDIATE,  # the dense layers' MLP
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "model_type": "glm4_moe",
        "moe_intermediate_size": MOE_INTERMEDIATE,
        "n_group": GLM_N_GROUP,
        "n_routed_experts": NUM_EXPERTS,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "num_attention_heads": NUM_HEADS,
        "num_experts_per_tok": TOP_K,
        "num_hidden_layers": NUM_LAYERS,
        "num_key_value_heads": NUM_KV_HEADS,
        # The releases carry one multi-token-prediction layer (model.layers.{L}); the tiny model
        # has none, so both loaders build a plain decoder.
        "num_nextn_predict_layers": 0,
        "partial_rotary_factor": 0.5,
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "rope_theta": ROPE_THETA,
        "routed_scaling_factor": GLM_ROUTED_SCALING_FACTOR,
        "tie_word_embeddings": False,
        "topk_group": GLM_TOPK_GROUP,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_qk_norm": True,
        "vocab_size": tok_mod.VOCAB_SIZE,
    }


def _mixtral_config() -> dict:
    """config.json of the Mixtral-style model: mistralai/Mixtral-8x7B-v0.1's keys (transformers'
    ``MixtralConfig``, SGLang's ``MixtralForCausalLM``), tiny sizes."""
    ids = tok_mod.added_token_ids()
    return {
        "architectures": ["MixtralForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": ids[tok_mod.ENDOFTEXT],
        "eos_token_id": ids[tok_mod.IM_END],
        "pad_token_id": ids[tok_mod.ENDOFTEXT],
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "initializer_range": 0.02,
        "intermediate_size": MIXTRAL_EXPERT_INTERMEDIATE,  # each expert's FFN
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "model_type": "mixtral",
        "num_attention_heads": NUM_HEADS,
        "num_experts_per_tok": MIXTRAL_TOP_K,
        "num_hidden_layers": NUM_LAYERS,
        "num_key_value_heads": NUM_KV_HEADS,
        "num_local_experts": MIXTRAL_EXPERTS,
        "output_router_logits": False,
        "rms_norm_eps": 1e-05,
        "rope_theta": 1_000_000.0,
        "router_aux_loss_coef": 0.02,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": tok_mod.VOCAB_SIZE,
    }


def _deepseek_v3_config() -> dict:
    """config.json of the DeepSeek-V3-style model: deepseek-ai/DeepSeek-V3's keys (transformers'
    ``DeepseekV3Config``, SGLang's ``DeepseekV3ForCausalLM``), tiny sizes, bf16 weights (the
    release's FP8 ``quantization_config`` left out)."""
    ids = tok_mod.added_token_ids()
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "aux_loss_alpha": 0.001,
        "bos_token_id": ids[tok_mod.ENDOFTEXT],
        "eos_token_id": ids[tok_mod.IM_END],
        "pad_token_id": ids[tok_mod.ENDOFTEXT],
        "ep_size": 1,
        "first_k_dense_replace": GLM_FIRST_K_DENSE,
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "initializer_range": 0.02,
        "intermediate_size": GLM_DENSE_INTERMEDIATE,  # the dense layer's MLP
        "kv_lora_rank": DSV3_KV_LORA_RANK,
        "max_position_embeddings": 163840,
        "model_type": "deepseek_v3",
        "moe_intermediate_size": MOE_INTERMEDIATE,
        "moe_layer_freq": 1,
        "n_group": GLM_N_GROUP,
        "n_routed_experts": NUM_EXPERTS,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "num_attention_heads": NUM_HEADS,
        "num_experts_per_tok": TOP_K,
        "num_hidden_layers": NUM_LAYERS,
        "num_key_value_heads": NUM_HEADS,
        "num_nextn_predict_layers": 0,
        "q_lora_rank": DSV3_Q_LORA_RANK,
        "qk_nope_head_dim": DSV3_QK_NOPE_HEAD_DIM,
        "qk_rope_head_dim": DSV3_QK_ROPE_HEAD_DIM,
        "rms_norm_eps": 1e-06,
        "rope_scaling": {
            "beta_fast": 32,
            "beta_slow": 1,
            "factor": 40,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
            "type": "yarn",
        },
        "rope_theta": 10000,
        "routed_scaling_factor": GLM_ROUTED_SCALING_FACTOR,
        "scoring_func": "sigmoid",
        "seq_aux": True,
        "tie_word_embeddings": False,
        "topk_group": GLM_TOPK_GROUP,
        "topk_method": "noaux_tc",
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "v_head_dim": DSV3_V_HEAD_DIM,
        "vocab_size": tok_mod.VOCAB_SIZE,
    }


def _olmoe_config() -> dict:
    """config.json of the OLMoE-style model: allenai/OLMoE-1B-7B-0924's keys (transformers'
    ``OlmoeConfig``, SGLang's ``OlmoeForCausalLM``), tiny sizes."""
    ids = tok_mod.added_token_ids()
    return {
        "architectures": ["OlmoeForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": ids[tok_mod.ENDOFTEXT],
        "eos_token_id": ids[tok_mod.IM_END],
        "pad_token_id": ids[tok_mod.ENDOFTEXT],
        "clip_qkv": None,
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "initializer_range": 0.02,
        "intermediate_size": MOE_INTERMEDIATE,  # each expert's FFN
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "model_type": "olmoe",
        "norm_topk_prob": False,
        "num_attention_heads": NUM_HEADS,
        "num_experts": NUM_EXPERTS,
        "num_experts_per_tok": TOP_K,
        "num_hidden_layers": NUM_LAYERS,
        "num_key_value_heads": NUM_HEADS,  # no GQA, as released (SGLang's k_norm assumes it)
        "output_router_logits": False,
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "router_aux_loss_coef": 0.01,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": tok_mod.VOCAB_SIZE,
    }


# Qwen3.5 MoE (Qwen/Qwen3.5-35B-A3B's config.json: a vision-language wrapper around a
# Qwen3-Next-style text model with GemmaRMSNorms, an output-gated full attention every 4th layer,
# gated DeltaNet with separate in_proj_qkv / in_proj_z / in_proj_b / in_proj_a, one gated shared
# expert, interleaved M-RoPE on a quarter of the head). The vision tower is as small as its
# config allows; it is loaded but only text is served here.
QWEN3_5_MROPE_SECTION = [3, 3, 2]  # sums to the rotary half-dim: HEAD_DIM * 0.25 / 2
QWEN3_5_VISION = {
    "deepstack_visual_indexes": [],
    "depth": 1,
    "hidden_act": "gelu_pytorch_tanh",
    "hidden_size": 64,
    "in_channels": 3,
    "initializer_range": 0.02,
    "intermediate_size": 128,
    "model_type": "qwen3_5_moe",
    "num_heads": 2,
    "num_position_embeddings": 64,
    "out_hidden_size": HIDDEN,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
}


# preprocessor_config.json / video_preprocessor_config.json of the release (Qwen3-VL's
# processors): the server's tokenizer manager loads them for a vision-language model.
QWEN3_5_IMAGE_PROCESSOR = {
    "image_mean": [0.5, 0.5, 0.5],
    "image_processor_type": "Qwen2VLImageProcessorFast",
    "image_std": [0.5, 0.5, 0.5],
    "merge_size": 2,
    "patch_size": 16,
    "processor_class": "Qwen3VLProcessor",
    "size": {"longest_edge": 16777216, "shortest_edge": 65536},
    "temporal_patch_size": 2,
}
QWEN3_5_VIDEO_PROCESSOR = {
    **{k: v for k, v in QWEN3_5_IMAGE_PROCESSOR.items() if k != "image_processor_type"},
    "fps": 2,
    "size": {"longest_edge": 25165824, "shortest_edge": 4096},
    "video_processor_type": "Qwen3VLVideoProcessor",
}


def _qwen3_5_moe_config() -> dict:
    text = _common_config()
    for key in (
        "rope_theta",
        "rope_scaling",
        "torch_dtype",
        "mlp_only_layers",
        "use_sliding_window",
    ):
        text.pop(key)
    text.update(
        {
            "model_type": "qwen3_5_moe_text",
            "attn_output_gate": True,
            "dtype": "bfloat16",
            "full_attention_interval": FULL_ATTENTION_INTERVAL,
            "layer_types": [
                "full_attention" if (i + 1) % FULL_ATTENTION_INTERVAL == 0 else "linear_attention"
                for i in range(NUM_LAYERS)
            ],
            "linear_conv_kernel_dim": 4,
            "linear_key_head_dim": 64,
            "linear_value_head_dim": 64,
            "linear_num_key_heads": 4,
            "linear_num_value_heads": 8,
            "partial_rotary_factor": 0.25,
            "rope_parameters": {
                "mrope_interleaved": True,
                "mrope_section": QWEN3_5_MROPE_SECTION,
                "partial_rotary_factor": 0.25,
                "rope_theta": ROPE_THETA,
                "rope_type": "default",
            },
            "shared_expert_intermediate_size": MOE_INTERMEDIATE,
        }
    )
    ids = tok_mod.added_token_ids()
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "text_config": dict(sorted(text.items())),
        "vision_config": QWEN3_5_VISION,
        # the released ids of <|image_pad|> etc. lie beyond this vocabulary: these are ordinary
        # ids of it (the last BPE tokens), which text-only serving never reads
        "image_token_id": ids[tok_mod.ENDOFTEXT] - 4,
        "video_token_id": ids[tok_mod.ENDOFTEXT] - 3,
        "vision_start_token_id": ids[tok_mod.ENDOFTEXT] - 2,
        "vision_end_token_id": ids[tok_mod.ENDOFTEXT] - 1,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }


# gpt-oss (openai/gpt-oss-20b's config.json keys): 32 experts top-4 like the release, alternating
# sliding / full attention with a window short enough for the tests' prompts to cross it,
# attention sinks, biases on q/k/v/o, router and experts, clamped SwiGLU, MXFP4 experts.
GPT_OSS_EXPERTS = 32
GPT_OSS_TOP_K = 4
GPT_OSS_SLIDING_WINDOW = 16


def _gpt_oss_config() -> dict:
    from .quantize_mxfp4 import MODULES_NOT_CONVERTED

    ids = tok_mod.added_token_ids()
    return {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "attention_bias": True,
        "attention_dropout": 0.0,
        "bos_token_id": ids[tok_mod.ENDOFTEXT],
        "eos_token_id": ids[tok_mod.IM_END],
        "pad_token_id": ids[tok_mod.ENDOFTEXT],
        "experts_per_token": GPT_OSS_TOP_K,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "initial_context_length": 4096,
        "initializer_range": 0.02,
        "intermediate_size": MOE_INTERMEDIATE,
        "layer_types": [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(NUM_LAYERS)
        ],
        "max_position_embeddings": 131072,
        "num_attention_heads": NUM_HEADS,
        "num_experts_per_tok": GPT_OSS_TOP_K,
        "num_hidden_layers": NUM_LAYERS,
        "num_key_value_heads": NUM_KV_HEADS,
        "num_local_experts": GPT_OSS_EXPERTS,
        "output_router_logits": False,
        "quantization_config": {
            "modules_to_not_convert": MODULES_NOT_CONVERTED,
            "quant_method": "mxfp4",
        },
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "rope_type": "yarn",
            "truncate": False,
        },
        "rope_theta": 150000,
        "router_aux_loss_coef": 0.9,
        "sliding_window": GPT_OSS_SLIDING_WINDOW,
        "swiglu_limit": 7.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": tok_mod.VOCAB_SIZE,
    }


def _gpt_oss_specs(cfg: dict, prefix: str) -> List[Tuple[str, _Spec]]:
    """gpt-oss's tensors (transformers' ``GptOssForCausalLM`` names); the experts in float
    ([E, H, 2I] gate/up interleaved, [E, I, H] down), which :mod:`.quantize_mxfp4` packs."""
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    e, mi = cfg["num_local_experts"], cfg["intermediate_size"]
    specs: List[Tuple[str, _Spec]] = [(prefix + "embed_tokens.weight", _Spec((v, h), "embed"))]
    for i in range(cfg["num_hidden_layers"]):
        p = f"{prefix}layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        specs += [
            (p + "input_layernorm.weight", _Spec((h,), "norm1")),
            (p + "post_attention_layernorm.weight", _Spec((h,), "norm1")),
            (a + "q_proj.weight", _Spec((nh * hd, h), "proj", h)),
            (a + "q_proj.bias", _Spec((nh * hd,), "attn_bias")),
            (a + "k_proj.weight", _Spec((nkv * hd, h), "proj", h)),
            (a + "k_proj.bias", _Spec((nkv * hd,), "attn_bias")),
            (a + "v_proj.weight", _Spec((nkv * hd, h), "proj", h)),
            (a + "v_proj.bias", _Spec((nkv * hd,), "attn_bias")),
            (a + "o_proj.weight", _Spec((h, nh * hd), "proj", nh * hd)),
            (a + "o_proj.bias", _Spec((h,), "attn_bias")),
            (a + "sinks", _Spec((nh,), "sink")),
            (m + "router.weight", _Spec((e, h), "router", h)),
            (m + "router.bias", _Spec((e,), "attn_bias")),
            (m + "experts.gate_up_proj", _Spec((e, h, 2 * mi), "proj", h)),
            (m + "experts.gate_up_proj_bias", _Spec((e, 2 * mi), "attn_bias")),
            (m + "experts.down_proj", _Spec((e, mi, h), "proj", mi)),
            (m + "experts.down_proj_bias", _Spec((e, h), "attn_bias")),
        ]
    specs.append((prefix + "norm.weight", _Spec((h,), "norm1")))
    specs.append(("lm_head.weight", _Spec((v, h), "lm_head", h)))
    return specs


# Gemma 4 MoE (google/gemma-4-26B-A4B's layout, transformers' ``Gemma4Config``): a vision-language
# wrapper (``Gemma4ForConditionalGeneration``, the text model under ``model.language_model``)
# whose decoder layers run a dense GELU MLP and a routed MoE of GELU experts side by side
# (``enable_moe_block``: softmax router over a scaled RMS-normalized input with a per-expert
# output scale; experts fused as ``experts.gate_up_proj`` [E, 2I, H] / ``experts.down_proj``
# [E, H, I]), sliding-window layers with a last full-attention layer of wider heads
# (``global_head_dim``), q/k/v RMSNorms with attention scaling 1, tied embeddings, final logit
# softcapping, and a vision tower (one tiny layer: SGLang builds it even when serving text only).
GEMMA4_EXPERTS = 32
GEMMA4_TOP_K = 4
GEMMA4_SLIDING_WINDOW = 16
GEMMA4_GLOBAL_HEAD_DIM = 128
GEMMA4_DENSE_INTERMEDIATE = 256
GEMMA4_QK_NORM = 0.4  # q/k RMSNorm gain: with scaling 1, logits std ~0.16 sqrt(head_dim)
# Gain of the norms after attention and the MLP / MoE: the layers' outputs then weigh on the
# residual stream against the embedding (rms LOGIT_STD, scaled by sqrt(hidden) in the model),
# which with tied embeddings would otherwise make the model repeat its input token.
GEMMA4_POST_NORM = 4.0
GEMMA4_LAYER_SCALAR = 0.5  # each layer's output scale (the residual stream too): same purpose


def _gemma4_config() -> dict:
    """config.json of the Gemma-4-MoE-style model (keys of transformers' ``Gemma4Config`` /
    ``Gemma4TextConfig`` / ``Gemma4VisionConfig`` as the release writes them), tiny sizes."""
    ids = tok_mod.added_token_ids()
    v = tok_mod.VOCAB_SIZE
    text = {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attention_k_eq_v": False,
        "bos_token_id": ids[tok_mod.ENDOFTEXT],
        "eos_token_id": ids[tok_mod.IM_END],
        "pad_token_id": ids[tok_mod.ENDOFTEXT],
        "enable_moe_block": True,
        "final_logit_softcapping": 30.0,
        "global_head_dim": GEMMA4_GLOBAL_HEAD_DIM,
        "head_dim": HEAD_DIM,
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": HIDDEN,
        "hidden_size_per_layer_input": 0,
        "initializer_range": 0.02,
        "intermediate_size": GEMMA4_DENSE_INTERMEDIATE,
        "layer_types": ["sliding_attention"] * (NUM_LAYERS - 1) + ["full_attention"],
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "model_type": "gemma4_text",
        "moe_intermediate_size": MOE_INTERMEDIATE,
        "num_attention_heads": NUM_HEADS,
        "num_experts": GEMMA4_EXPERTS,
        "num_hidden_layers": NUM_LAYERS,
        "num_key_value_heads": NUM_KV_HEADS,
        "num_kv_shared_layers": 0,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {
            "full_attention": {
                "partial_rotary_factor": 0.25,
                "rope_theta": 1000000.0,
                "rope_type": "proportional",
            },
            "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
        },
        "sliding_window": GEMMA4_SLIDING_WINDOW,
        "tie_word_embeddings": True,
        "top_k_experts": GEMMA4_TOP_K,
        "use_cache": True,
        "use_double_wide_mlp": False,
        "vocab_size": v,
        "vocab_size_per_layer_input": v,
    }
    vision = {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "head_dim": 32,
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 64,
        "intermediate_size": 128,
        "model_type": "gemma4_vision",
        "num_attention_heads": 2,
        "num_hidden_layers": 1,
        "num_key_value_heads": 2,
        "patch_size": 16,
        "pooling_kernel_size": 3,
        "position_embedding_size": 256,
        "rms_norm_eps": 1e-06,
        "standardize": False,
        "use_clipped_linears": False,
    }
    # the multimodal token ids at the top of the vocabulary (the release's are above 255,000)
    return {
        "architectures": ["Gemma4ForConditionalGeneration"],
        "model_type": "gemma4",
        "audio_config": None,
        "audio_token_id": v - 7,
        "boa_token_id": v - 6,
        "boi_token_id": v - 5,
        "eoa_token_index": v - 4,
        "eoi_token_id": v - 3,
        "image_token_id": v - 2,
        "video_token_id": v - 1,
        "initializer_range": 0.02,
        "text_config": text,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "vision_config": vision,
    }


def _transformers_shapes(config_cls: str, model_cls: str, cfg: dict):
    """``(name, shape)`` of every tensor transformers' ``model_cls`` saves for ``cfg`` (the model
    built on the meta device: the checkpoint layout is transformers' own)."""
    import torch
    import transformers

    with torch.device("meta"):
        model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**cfg))
    return [(name, tuple(t.shape)) for name, t in model.state_dict().items()]


def _gemma4_specs(cfg: dict) -> List[Tuple[str, _Spec]]:
    """Gemma 4's tensors: names and shapes of transformers' ``Gemma4ForConditionalGeneration``
    for ``cfg``, without the tied ``lm_head.weight``; kinds by role."""
    specs: List[Tuple[str, _Spec]] = []
    shapes = _transformers_shapes("Gemma4Config", "Gemma4ForConditionalGeneration", cfg)
    for name, shape in shapes:
        if name == "lm_head.weight":  # tied to the embeddings
            continue
        if name.endswith("embed_tokens.weight"):  # also the lm_head: logits std ~LOGIT_STD
            spec = _Spec(shape, "tied_embed", shape[1])
        elif name.endswith("router.proj.weight"):  # its input is RMS-normalized to norm 1
            spec = _Spec(shape, "router", 1)
        elif name.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight")):
            spec = _Spec(shape, "gemma_qk_norm")
        elif re.search(r"\.post_(attention|feedforward)_layernorm(_[12])?\.weight$", name):
            spec = _Spec(shape, "gemma_post_norm")
        elif name.endswith(".layer_scalar"):
            spec = _Spec(shape, "gemma_layer_scalar")
        elif len(shape) == 1:  # RMSNorm weights, the router's scales, layer_scalar
            spec = _Spec(shape, "norm1")
        elif name.endswith("position_embedding_table"):
            spec = _Spec(shape, "attn_bias")
        else:  # projections; the fused experts [E, out, in] per expert
            fan_in = shape[-1] if len(shape) == 3 else math.prod(shape[1:])
            spec = _Spec(shape, "proj", fan_in)
        specs.append((name, spec))
    return specs


# Llama 4 (meta-llama/Llama-4-Scout-17B-16E's layout, transformers' ``Llama4Config``): a
# vision-language wrapper (``Llama4ForConditionalGeneration``, the text model under
# ``language_model.model``) whose MoE layers route each token to ONE of 16 experts with a sigmoid
# router weight applied to the expert's input (``apply_router_weight_on_input``), beside a shared
# expert; experts fused as ``feed_forward.experts.gate_up_proj`` [E, H, 2I] / ``down_proj``
# [E, I, H] (input-major, unlike Gemma 4's); every fourth layer without RoPE (NoPE, with
# attention temperature tuning), L2 q/k norms on the RoPE layers, chunked local attention
# (``attention_chunk_size``: 64 instead of the release's 8192, so that the tests' prompts cross
# chunks), and a vision tower (one tiny layer).
LLAMA4_EXPERTS = 16
LLAMA4_CHUNK = 64


def _llama4_config() -> dict:
    """config.json of the Llama-4-Scout-style model (keys of transformers' ``Llama4Config`` /
    ``Llama4TextConfig`` / ``Llama4VisionConfig``), tiny sizes."""
    ids = tok_mod.added_token_ids()
    v = tok_mod.VOCAB_SIZE
    text = {
        "attention_bias": False,
        "attention_chunk_size": LLAMA4_CHUNK,
        "attention_dropout": 0.0,
        "attn_scale": 0.1,
        "attn_temperature_tuning": True,
        "bos_token_id": ids[tok_mod.ENDOFTEXT],
        "eos_token_id": ids[tok_mod.IM_END],
        "pad_token_id": ids[tok_mod.ENDOFTEXT],
        "floor_scale": 8192,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "initializer_range": 0.02,
        "interleave_moe_layer_step": 1,
        "intermediate_size": MOE_INTERMEDIATE,  # each expert's and the shared expert's
        "intermediate_size_mlp": 512,  # dense layers' (none here: every layer is MoE)
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "model_type": "llama4_text",
        "no_rope_layers": [1, 1, 1, 0],  # 1 = RoPE; the release: every fourth layer NoPE
        "num_attention_heads": NUM_HEADS,
        "num_experts_per_tok": 1,
        "num_hidden_layers": NUM_LAYERS,
        "num_key_value_heads": NUM_KV_HEADS,
        "num_local_experts": LLAMA4_EXPERTS,
        "rms_norm_eps": 1e-05,
        "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
        "router_aux_loss_coef": 0.001,
        "router_jitter_noise": 0.0,
        "tie_word_embeddings": False,
        "use_qk_norm": True,
        "vocab_size": v,
    }
    vision = {
        "attention_dropout": 0.0,
        "hidden_act": "gelu",
        "hidden_size": 64,
        "image_size": 56,
        "intermediate_size": 128,
        "model_type": "llama4_vision_model",
        "multi_modal_projector_bias": False,
        "norm_eps": 1e-05,
        "num_attention_heads": 2,
        "num_channels": 3,
        "num_hidden_layers": 1,
        "patch_size": 14,
        "pixel_shuffle_ratio": 0.5,
        "projector_dropout": 0.0,
        "projector_input_dim": 64,
        "projector_output_dim": 64,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "vision_feature_select_strategy": "default",
        "vision_output_dim": 64,
    }
    return {
        "architectures": ["Llama4ForConditionalGeneration"],
        "model_type": "llama4",
        "boi_token_index": v - 3,
        "eoi_token_index": v - 2,
        "image_token_index": v - 1,
        "text_config": text,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "vision_config": vision,
    }


def _llama4_specs(cfg: dict) -> List[Tuple[str, _Spec]]:
    """Llama 4's tensors: names and shapes of transformers' ``Llama4ForConditionalGeneration``
    for ``cfg``; kinds by role (the fused experts are input-major: fan-in ``shape[1]``)."""
    specs: List[Tuple[str, _Spec]] = []
    shapes = _transformers_shapes("Llama4Config", "Llama4ForConditionalGeneration", cfg)
    for name, shape in shapes:
        if name.endswith("embed_tokens.weight"):
            spec = _Spec(shape, "embed")
        elif name == "language_model.lm_head.weight":
            spec = _Spec(shape, "lm_head", shape[1])
        elif name.endswith("feed_forward.router.weight"):
            spec = _Spec(shape, "router", shape[1])
        elif ".experts." in name:  # [E, in, out]
            spec = _Spec(shape, "proj", shape[1])
        elif len(shape) == 1:
            kind = "attn_bias" if name.endswith(".bias") else "norm1"
            spec = _Spec(shape, kind)
        elif "embedding" in name:  # the vision tower's class / positional embeddings
            spec = _Spec(shape, "attn_bias")
        else:
            spec = _Spec(shape, "proj", math.prod(shape[1:]))
        specs.append((name, spec))
    return specs


def text_config(cfg: dict) -> dict:
    """The language model's part of ``cfg`` (``text_config`` of a vision-language wrapper)."""
    return cfg.get("text_config", cfg)


def model_config(arch: str, shape: Optional[str] = None) -> dict:
    """config.json contents for ``arch`` (keys as in the released Qwen / GLM checkpoints);
    ``shape`` (a key of :data:`SHAPES`, whose arch it must be) replaces the layer sizes."""
    if shape is not None:
        if shape not in SHAPES:
            raise ValueError(f"unknown shape {shape!r}; choose from {tuple(SHAPES)}")
        shape_arch, sizes = SHAPES[shape]
        if arch != shape_arch:
            raise ValueError(f"shape {shape!r} is a {shape_arch} model, not {arch!r}")
        return dict(sorted({**model_config(arch), **sizes}.items()))
    if arch == "glm4_moe":
        return dict(sorted(_glm4_moe_config().items()))
    if arch == "qwen3_5_moe":
        return dict(sorted(_qwen3_5_moe_config().items()))
    if arch == "gpt_oss":
        return dict(sorted(_gpt_oss_config().items()))
    if arch == "mixtral":
        return dict(sorted(_mixtral_config().items()))
    if arch == "olmoe":
        return dict(sorted(_olmoe_config().items()))
    if arch == "deepseek_v3":
        return dict(sorted(_deepseek_v3_config().items()))
    if arch == "gemma4":
        return dict(sorted(_gemma4_config().items()))
    if arch == "llama4":
        return dict(sorted(_llama4_config().items()))
    cfg = _common_config()
    if arch == "qwen3_next":
        cfg.update(
            {
                "architectures": ["Qwen3NextForCausalLM"],
                "model_type": "qwen3_next",
                # layers 0,1,2 gated DeltaNet, layer 3 full (gated) attention. Like the released
                # checkpoints, no explicit "layer_types": transformers and SGLang both derive
                # the pattern from the interval.
                "full_attention_interval": FULL_ATTENTION_INTERVAL,
                "intermediate_size": 512,  # dense MLP size (unused: every layer is MoE)
                "shared_expert_intermediate_size": MOE_INTERMEDIATE,
                "partial_rotary_factor": 0.25,
                "linear_conv_kernel_dim": 4,
                "linear_key_head_dim": 64,
                "linear_value_head_dim": 64,
                "linear_num_key_heads": 4,
                "linear_num_value_heads": 8,
            }
        )
    elif arch == "qwen3_moe":
        cfg.update(
            {
                "architectures": ["Qwen3MoeForCausalLM"],
                "model_type": "qwen3_moe",
                "intermediate_size": 512,
                "max_window_layers": NUM_LAYERS,
                "sliding_window": None,
            }
        )
    else:
        raise ValueError(f"unknown arch {arch!r}; choose from {ARCHS}")
    return dict(sorted(cfg.items()))


def generation_config(cfg: dict) -> dict:
    cfg = text_config(cfg)
    return {
        "bos_token_id": cfg["bos_token_id"],
        "do_sample": False,
        "eos_token_id": [cfg["eos_token_id"], cfg["pad_token_id"]],
        "pad_token_id": cfg["pad_token_id"],
    }


# ---------------------------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Spec:
    shape: Tuple[int, ...]
    # "proj", "embed", "lm_head", "router", "conv", "A_log", "dt_bias", "gate_scalar",
    # "norm1" (RMSNorm computing x * w), "norm0" (Qwen3-Next's x * (1 + w)), "qk_norm1/0",
    # "attn_bias" (GLM's q/k/v biases), "score_bias" (GLM's e_score_correction_bias, float32),
    # "tied_embed" (Gemma's embeddings, also its lm_head), "gemma_qk_norm" / "gemma_post_norm"
    # (Gemma 4's q/k norms, its norms after attention and the MLP / MoE), "gemma_layer_scalar"
    kind: str
    fan_in: int = 1


# Tensors stored in float32, as the router keeps them (transformers' Glm4Moe
# ``_keep_in_fp32_modules_strict``, SGLang's ``Glm4MoeGate``); their values are bf16 values.
FLOAT32_KINDS = frozenset({"score_bias"})


def _mlp_specs(prefix: str, h: int, inter: int) -> List[Tuple[str, _Spec]]:
    """A gated MLP's three projections under ``prefix`` (a dense MLP, an expert, a shared
    expert): gate/up [inter, h], down [h, inter]."""
    return [
        (prefix + "gate_proj.weight", _Spec((inter, h), "proj", h)),
        (prefix + "up_proj.weight", _Spec((inter, h), "proj", h)),
        (prefix + "down_proj.weight", _Spec((h, inter), "proj", inter)),
    ]


def _weight_specs(arch: str, cfg: dict) -> List[Tuple[str, _Spec]]:
    if arch == "qwen3_5_moe":  # the text model under model.language_model, then the vision tower
        text = _text_weight_specs(arch, text_config(cfg), "model.language_model.")
        return text + _vision_weight_specs(cfg["vision_config"])
    if arch == "gpt_oss":
        return _gpt_oss_specs(cfg, "model.")
    if arch == "gemma4":
        return _gemma4_specs(cfg)
    if arch == "llama4":
        return _llama4_specs(cfg)
    return _text_weight_specs(arch, cfg, "model.")


def _vision_weight_specs(vc: dict) -> List[Tuple[str, _Spec]]:
    """Qwen3.5's vision tower (transformers' ``Qwen3_5MoeVisionModel`` names and shapes)."""
    d, inter, out = vc["hidden_size"], vc["intermediate_size"], vc["out_hidden_size"]
    patch = vc["in_channels"] * vc["temporal_patch_size"] * vc["patch_size"] ** 2
    merged = d * vc["spatial_merge_size"] ** 2
    p = "model.visual."
    specs = [
        (
            p + "patch_embed.proj.weight",
            _Spec(
                (
                    d,
                    vc["in_channels"],
                    vc["temporal_patch_size"],
                    vc["patch_size"],
                    vc["patch_size"],
                ),
                "proj",
                patch,
            ),
        ),
        (p + "patch_embed.proj.bias", _Spec((d,), "attn_bias")),
        (p + "pos_embed.weight", _Spec((vc["num_position_embeddings"], d), "attn_bias")),
    ]

    def linear(name, n_out, n_in):
        return [
            (name + ".weight", _Spec((n_out, n_in), "proj", n_in)),
            (name + ".bias", _Spec((n_out,), "attn_bias")),
        ]

    def layernorm(name, n):
        return [
            (name + ".weight", _Spec((n,), "norm1")),
            (name + ".bias", _Spec((n,), "attn_bias")),
        ]

    for i in range(vc["depth"]):
        b = f"{p}blocks.{i}."
        specs += layernorm(b + "norm1", d) + layernorm(b + "norm2", d)
        specs += linear(b + "attn.qkv", 3 * d, d) + linear(b + "attn.proj", d, d)
        specs += linear(b + "mlp.linear_fc1", inter, d) + linear(b + "mlp.linear_fc2", d, inter)
    specs += layernorm(p + "merger.norm", d)
    specs += linear(p + "merger.linear_fc1", merged, merged) + linear(
        p + "merger.linear_fc2", out, merged
    )
    return specs


def _text_weight_specs(arch: str, cfg: dict, prefix: str) -> List[Tuple[str, _Spec]]:
    h = cfg["hidden_size"]
    v = cfg["vocab_size"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or h // nh  # OLMoE and DeepSeek have no head_dim key
    # Qwen / OLMoE, Mixtral, GLM keys
    e = cfg.get("num_experts") or cfg.get("num_local_experts") or cfg["n_routed_experts"]
    mi = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    # Qwen3-Next and Qwen3.5 RMSNorms compute x * (1 + w); both gate their attention output
    gemma_norm = arch in ("qwen3_next", "qwen3_5_moe")
    norm_kind = "norm0" if gemma_norm else "norm1"
    specs: List[Tuple[str, _Spec]] = [(prefix + "embed_tokens.weight", _Spec((v, h), "embed"))]
    for i in range(cfg["num_hidden_layers"]):
        p = f"{prefix}layers.{i}."
        specs.append((p + "input_layernorm.weight", _Spec((h,), norm_kind)))
        specs.append((p + "post_attention_layernorm.weight", _Spec((h,), norm_kind)))
        interval = cfg.get("full_attention_interval")  # Qwen3-Next / Qwen3.5 only
        if interval and (i + 1) % interval != 0:  # gated DeltaNet layer
            nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
            dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
            kdim, vdim = nk * dk, nv * dv
            conv_dim = 2 * kdim + vdim
            a = p + "linear_attn."
            if arch == "qwen3_5_moe":  # four projections, [q | k | v] contiguous
                specs += [
                    (a + "in_proj_qkv.weight", _Spec((2 * kdim + vdim, h), "proj", h)),
                    (a + "in_proj_z.weight", _Spec((vdim, h), "proj", h)),
                    (a + "in_proj_b.weight", _Spec((nv, h), "proj", h)),
                    (a + "in_proj_a.weight", _Spec((nv, h), "proj", h)),
                ]
            else:  # Qwen3-Next: [q k v z] and [b a] interleaved per key-head group
                specs += [
                    (a + "in_proj_qkvz.weight", _Spec((2 * kdim + 2 * vdim, h), "proj", h)),
                    (a + "in_proj_ba.weight", _Spec((2 * nv, h), "proj", h)),
                ]
            specs += [
                (a + "conv1d.weight", _Spec((conv_dim, 1, cfg["linear_conv_kernel_dim"]), "conv")),
                (a + "dt_bias", _Spec((nv,), "dt_bias")),
                (a + "A_log", _Spec((nv,), "A_log")),
                (a + "norm.weight", _Spec((dv,), "norm1")),
                (a + "out_proj.weight", _Spec((h, vdim), "proj", vdim)),
            ]
        elif arch == "deepseek_v3":  # multi-head latent attention
            a = p + "self_attn."
            ql, kvl = cfg["q_lora_rank"], cfg["kv_lora_rank"]
            rope, nope, vd = cfg["qk_rope_head_dim"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
            specs += [
                (a + "q_a_proj.weight", _Spec((ql, h), "proj", h)),
                (a + "q_a_layernorm.weight", _Spec((ql,), "norm1")),
                (a + "q_b_proj.weight", _Spec((nh * (nope + rope), ql), "proj", ql)),
                (a + "kv_a_proj_with_mqa.weight", _Spec((kvl + rope, h), "proj", h)),
                (a + "kv_a_layernorm.weight", _Spec((kvl,), "norm1")),
                (a + "kv_b_proj.weight", _Spec((nh * (nope + vd), kvl), "proj", kvl)),
                (a + "o_proj.weight", _Spec((h, nh * vd), "proj", nh * vd)),
            ]
        else:
            a = p + "self_attn."
            q_out = nh * hd * (2 if gemma_norm else 1)  # Qwen3-Next / Qwen3.5: query + gate
            specs += [
                (a + "q_proj.weight", _Spec((q_out, h), "proj", h)),
                (a + "k_proj.weight", _Spec((nkv * hd, h), "proj", h)),
                (a + "v_proj.weight", _Spec((nkv * hd, h), "proj", h)),
                (a + "o_proj.weight", _Spec((h, nh * hd), "proj", nh * hd)),
            ]
            if cfg.get("attention_bias"):  # GLM: q/k/v biases, none on o_proj
                specs += [
                    (a + "q_proj.bias", _Spec((q_out,), "attn_bias")),
                    (a + "k_proj.bias", _Spec((nkv * hd,), "attn_bias")),
                    (a + "v_proj.bias", _Spec((nkv * hd,), "attn_bias")),
                ]
            if arch == "olmoe":  # RMSNorms over the whole q / k projection, not per head
                specs += [
                    (a + "q_norm.weight", _Spec((nh * hd,), "qk_norm1")),
                    (a + "k_norm.weight", _Spec((nkv * hd,), "qk_norm1")),
                ]
            elif arch != "mixtral" and cfg.get("use_qk_norm", True):  # Qwen3; GLM if use_qk_norm
                specs += [
                    (a + "q_norm.weight", _Spec((hd,), "qk_" + norm_kind)),
                    (a + "k_norm.weight", _Spec((hd,), "qk_" + norm_kind)),
                ]
        if arch == "mixtral":  # block_sparse_moe.gate, experts.{j}.w1 (gate) / w3 (up) / w2
            m = p + "block_sparse_moe."
            specs.append((m + "gate.weight", _Spec((e, h), "router", h)))
            for j in range(e):
                x = f"{m}experts.{j}."
                specs += [
                    (x + "w1.weight", _Spec((mi, h), "proj", h)),
                    (x + "w2.weight", _Spec((h, mi), "proj", mi)),
                    (x + "w3.weight", _Spec((mi, h), "proj", h)),
                ]
            continue
        m = p + "mlp."
        if i < cfg.get("first_k_dense_replace", 0):  # GLM: a dense MLP in the first layers
            specs += _mlp_specs(m, h, cfg["intermediate_size"])
            continue
        specs.append((m + "gate.weight", _Spec((e, h), "router", h)))
        if arch in ("glm4_moe", "deepseek_v3"):
            specs.append((m + "gate.e_score_correction_bias", _Spec((e,), "score_bias")))
        for j in range(e):
            specs += _mlp_specs(f"{m}experts.{j}.", h, mi)
        if arch in ("glm4_moe", "deepseek_v3"):
            specs += _mlp_specs(m + "shared_experts.", h, mi * cfg["n_shared_experts"])
        if arch in ("qwen3_next", "qwen3_5_moe"):
            si = cfg["shared_expert_intermediate_size"]
            specs += [
                (m + "shared_expert.gate_proj.weight", _Spec((si, h), "proj", h)),
                (m + "shared_expert.up_proj.weight", _Spec((si, h), "proj", h)),
                (m + "shared_expert.down_proj.weight", _Spec((h, si), "proj", si)),
                (m + "shared_expert_gate.weight", _Spec((1, h), "gate_scalar", h)),
            ]
    specs.append((prefix + "norm.weight", _Spec((h,), "norm0" if gemma_norm else "norm1")))
    specs.append(("lm_head.weight", _Spec((v, h), "lm_head", h)))
    return specs


def _generator(seed: int, name: str):
    import torch

    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    g = torch.Generator(device="cpu")
    g.manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    return g


def _make_tensor(seed: int, name: str, spec: _Spec):
    import torch

    g = _generator(seed, name)
    shape = spec.shape

    def normal(std: float):
        return torch.randn(shape, generator=g, dtype=torch.float32) * std

    k = spec.kind
    if k == "proj":
        t = normal(PROJ_GAIN / math.sqrt(spec.fan_in))
    elif k == "embed":
        t = normal(EMBED_STD)
    elif k == "gemma_qk_norm":
        t = GEMMA4_QK_NORM + normal(NORM_WEIGHT_STD)
    elif k == "gemma_post_norm":
        t = GEMMA4_POST_NORM * (1.0 + normal(NORM_WEIGHT_STD))
    elif k == "gemma_layer_scalar":
        t = GEMMA4_LAYER_SCALAR * (1.0 + normal(NORM_WEIGHT_STD))
    elif k == "router":
        t = normal(ROUTER_LOGIT_STD / math.sqrt(spec.fan_in))
    elif k in ("lm_head", "tied_embed"):  # tied_embed: Gemma's, input scaled by sqrt(hidden)
        t = torch.randn(shape, generator=g, dtype=torch.float32)
        row_scale = torch.exp(
            torch.randn((shape[0], 1), generator=g, dtype=torch.float32) * LM_HEAD_ROW_SCALE_SIGMA
        )
        row_scale = row_scale / row_scale.pow(2).mean().sqrt()
        t = t * row_scale * (LOGIT_STD / math.sqrt(spec.fan_in))
    elif k == "qk_norm1":
        t = QK_NORM_SCALE + normal(NORM_WEIGHT_STD)
    elif k == "qk_norm0":
        t = (QK_NORM_SCALE - 1.0) + normal(NORM_WEIGHT_STD)
    elif k == "norm1":
        t = 1.0 + normal(NORM_WEIGHT_STD)
    elif k == "norm0":
        t = normal(NORM_WEIGHT_STD)
    elif k == "conv":
        # depthwise causal conv: weight on the current token ~1, earlier taps small, so q/k/v
        # keep the scale of the projections and still mix a few previous tokens
        t = normal(0.3)
        t[..., -1] += 1.0
    elif k == "A_log":
        # A log-uniform in [A_MIN, A_MAX]: with softplus(a + dt_bias) ~ 0.13 the per-token
        # state decay exp(-A * dt) spans memories of a few to a few hundred tokens
        u = torch.rand(shape, generator=g, dtype=torch.float32)
        t = math.log(A_MIN) + u * (math.log(A_MAX) - math.log(A_MIN))
    elif k == "dt_bias":
        t = DT_BIAS + normal(0.25)
    elif k == "gate_scalar":
        t = normal(1.0 / math.sqrt(spec.fan_in))
    elif k == "attn_bias":
        t = normal(ATTN_BIAS_STD)
    elif k == "score_bias":
        t = normal(SCORE_BIAS_STD)
    elif k == "sink":  # gpt-oss's per-head attention sink logits
        t = normal(1.0)
    else:  # pragma: no cover
        raise AssertionError(k)
    t = t.to(torch.bfloat16)
    return (t.float() if k in FLOAT32_KINDS else t).contiguous()


def make_state_dict(arch: str, seed: int = DEFAULT_SEED, cfg: Optional[dict] = None):
    """{name: tensor} for ``arch`` (deterministic): bfloat16, except the kinds in
    :data:`FLOAT32_KINDS` (float32 holding bfloat16 values)."""
    cfg = cfg or model_config(arch)
    return {name: _make_tensor(seed, name, spec) for name, spec in _weight_specs(arch, cfg)}


def _json_text(obj) -> str:
    return json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def build(
    arch: str = DEFAULT_ARCH,
    out_dir: os.PathLike | str = "tiny-model",
    seed: int = DEFAULT_SEED,
    force: bool = False,
    use_tokenizer_cache: bool = True,
    quant: Optional[str] = None,
    shape: Optional[str] = None,
) -> Path:
    """Write the tiny model for ``arch`` into ``out_dir``; returns the directory.

    ``quant`` (None = bf16) writes the checkpoint in a released quantized layout instead
    (:mod:`.quantize`: ``"fp8"``, block FP8 as in Qwen's ``-FP8`` releases; ``"nvfp4"``,
    ModelOpt NVFP4 as in NVIDIA's ``-FP4`` releases, for ``qwen3_5_moe`` ModelOpt
    ``MIXED_PRECISION`` as in nvidia/Qwen3.6-35B-A3B-NVFP4; ``fp8`` also for ``deepseek_v3``, in
    deepseek-ai/DeepSeek-V3's layout; the archs of :data:`.quantize.QUANT_ARCHS`). ``shape`` (a key of
    :data:`SHAPES`) builds a released model's layer sizes instead of the tiny ones. Raises
    ValueError for an unknown arch, quant or shape, or a quant or shape the arch does not have.

    The directory is written next to its final place and renamed into it, so a reader never
    sees half a model. An existing non-empty ``out_dir`` is an error unless ``force``.
    """
    from safetensors.torch import save_file

    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose from {ARCHS}")
    if quant is not None and quant not in QUANTS:
        raise ValueError(f"unknown quantization {quant!r}; choose from {QUANTS}")
    if quant is not None and arch not in QUANT_ARCHS[quant]:
        raise ValueError(f"--quant {quant} is written for {QUANT_ARCHS[quant]} only, not {arch!r}")
    out = Path(out_dir).resolve()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        if not force:
            raise FileExistsError(f"{out} exists and is not empty (use force=True / --force)")
    out.parent.mkdir(parents=True, exist_ok=True)

    cfg = model_config(arch, shape)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        (tmp / "config.json").write_text(_json_text(cfg), encoding="utf-8")
        (tmp / "generation_config.json").write_text(
            _json_text(generation_config(cfg)), encoding="utf-8"
        )
        tok_mod.write_tokenizer(tmp, MAX_POSITION_EMBEDDINGS, use_cache=use_tokenizer_cache)
        if arch == "qwen3_5_moe":
            (tmp / "preprocessor_config.json").write_text(_json_text(QWEN3_5_IMAGE_PROCESSOR))
            (tmp / "video_preprocessor_config.json").write_text(_json_text(QWEN3_5_VIDEO_PROCESSOR))
        state = make_state_dict(arch, seed, cfg)
        if arch == "gpt_oss":  # the release ships its experts in MXFP4 only
            from .quantize_mxfp4 import quantize_experts

            state = quantize_experts(state)
        if quant is not None:
            state, cfg, files = quantize_state(state, cfg, quant)
            (tmp / "config.json").write_text(_json_text(cfg), encoding="utf-8")
            for fname, obj in files.items():
                (tmp / fname).write_text(_json_text(obj), encoding="utf-8")
        save_file(
            state,
            str(tmp / "model.safetensors"),
            # a single key: safetensors writes metadata from a hash map, so with several keys
            # their order (and the file bytes) would vary from run to run
            metadata={"format": "pt"},
        )
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def param_count(arch: str, shape: Optional[str] = None) -> int:
    cfg = model_config(arch, shape)
    return sum(math.prod(s.shape) for _, s in _weight_specs(arch, cfg))
