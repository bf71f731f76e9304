"""Qwen3-MoE decode layers on the CPU as one flat sequence of the fork's ops (patch
``0007-qwen3-moe-cpu-decode-layers``, issue 18).

A CPU decode step of the Qwen3-30B-A3B slice spends about a third of its time in Python between
ops (``benchmark/RESULTS.md``, "cpu_decode"): each layer goes through upstream's stage
boundaries (``layers/layer_boundary``: residual stream, readouts), ``nn.Module`` calls, the
linear / MoE / top-k dispatch layers and the attention backend, about a hundred Python frames
around ten ops. :func:`decode_layers` runs the same ops in the same order with the same
arguments, straight from a per-model plan built once:

    norm (fused add + RMSNorm) -> qkv (dense_linear_cpu) -> q/k norm + rotary
    (fused_qk_norm_rope_cpu) -> KV write (the pool's set_kv_buffer) -> attention
    (extend_attention_cpu, one query row per request, KV read in place) -> o_proj
    -> add + RMSNorm -> router (dense_linear_cpu) -> top-k (upstream's
    fused_topk_torch_native) -> experts (moe_experts_cpu) -> ... -> the model's final add +
    RMSNorm.

So its outputs are bit-identical to the module path's (test/e2e/test_cpu_decode_layers.py
compares greedy tokens and logprobs with ``SGLANG_CPU_DECODE_LAYERS=0``, one request and
several in one decode batch). Where the KV pool is upstream's plain bf16 MHA pool, the whole
sequence is one call of ``decode_layers_cpu`` (``sgl-kernel/csrc/cpu/decode_layers.cpp``: the
same ops from C++, the GIL released, from a plan of the weights built once per model);
``SGLANG_CPU_DECODE_LAYERS=python`` keeps the calls in Python (the test compares the two).

It takes a forward pass only where every op above is what the module path would run;
otherwise it returns None and upstream's layer loop runs. The plan's checks (once per model;
the reason it does not apply is logged once): a CPU without AMX (with AMX upstream's
intel_amx kernels run), every layer a ``Qwen3MoeDecoderLayer`` with a sparse MoE block, no tensor / pipeline / expert parallelism, bf16 weights without a quantization method
(an expert cache's method included: its layers keep the module path), the fork's norm, q/k
norm + rotary, dense-linear and executor ops present (``SGLANG_CPU_FUSED_NORM=0`` and
``SGLANG_CPU_MOE_BACKEND=native`` leave the module path), softmax top-k without grouping,
correction bias, shared-expert slots or routed scaling, attention without a sliding window,
cross attention or logit cap. Per pass: a decode batch of 1 to ``max_rows()`` rows
(``SGLANG_CPU_DENSE_LINEAR_MAX_ROWS``), the torch_native backend, no expert distribution
recording or routed-expert capture, no two-batch overlap or LoRA, a bf16 KV cache. The
attention is the one the module path's ``forward_decode`` would pick (patch 0005): the fork's
flash kernel reading each request's KV slots in place at a kernel level of avx2 or better,
else upstream's ``forward_decode`` itself.
"""

from __future__ import annotations

import logging
import os
from typing import List, Optional

import torch

logger = logging.getLogger(__name__)

OFF_ENV = "SGLANG_CPU_DECODE_LAYERS"
_PLAN_ATTR = "_cpu_decode_layers_plan"
_NATIVE_ATTR = "_cpu_decode_layers_native"
_logged: set = set()


class _Layer:
    """What one decoder layer's decode step reads, resolved once (tensors by reference: a
    weight reloaded in place is seen; a replaced parameter is not, see :func:`reset_plan`)."""

    __slots__ = (
        "layer_id",
        "in_w",
        "in_eps",
        "post_w",
        "post_eps",
        "qkv_w",
        "qkv_b",
        "q_size",
        "kv_size",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "q_norm_w",
        "k_norm_w",
        "qk_eps",
        "rotary",
        "neox",
        "rotary_dim",
        "o_w",
        "o_b",
        "radix",
        "scaling",
        "gate_w",
        "top_k",
        "renormalize",
        "w13",
        "w2",
    )


def _log_once(key: str, msg: str, *args) -> None:
    if key not in _logged:
        _logged.add(key)
        logger.info(msg, *args)


def enabled() -> bool:
    """False when ``SGLANG_CPU_DECODE_LAYERS=0`` (the module path for every pass)."""
    return os.environ.get(OFF_ENV, "1").strip() not in ("0", "false", "False", "")


def reset_plan(model: torch.nn.Module) -> None:
    """Drop ``model``'s cached plan (after weights are replaced, not updated in place)."""
    for attr in (_PLAN_ATTR, _NATIVE_ATTR):
        if hasattr(model, attr):
            delattr(model, attr)


def _norm_ok(norm) -> bool:
    return (
        norm.weight.dtype == torch.bfloat16
        and getattr(norm, "variance_size_override", None) is None
        and getattr(norm, "override_orig_dtype", None) is None
        and not getattr(norm, "fp32_residual", False)
        and not getattr(norm, "cast_x_before_out_mul", False)
    )


def _linear_ok(linear) -> bool:
    from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod

    w = linear.weight
    return (
        type(linear.quant_method) is UnquantizedLinearMethod
        and w.dtype == torch.bfloat16
        and w.dim() == 2
        and w.stride(1) == 1
        and not getattr(linear, "use_intel_amx_backend", False)
    )


def _plan_reason(model) -> Optional[str]:
    """Why the flat path cannot run ``model``'s layers (None when it can)."""
    from sglang.srt.layers.moe.cpu_executor import unsupported_reason
    from sglang.srt.layers.quantization.unquant import UnquantizedFusedMoEMethod
    from sglang.srt.models.qwen3_moe import Qwen3MoeDecoderLayer, Qwen3MoeSparseMoeBlock

    ops = torch.ops.sgl_kernel
    for name in (
        "fused_add_rmsnorm_cpu",
        "rmsnorm_cpu",
        "fused_qk_norm_rope_cpu",
        "dense_linear_cpu",
        "moe_experts_cpu",
        "extend_attention_cpu",
    ):
        if not hasattr(ops, name):
            return f"sgl_kernel has no {name}"
    from sglang.srt.utils import cpu_has_amx_support

    if cpu_has_amx_support():
        return "an AMX CPU (upstream's intel_amx kernels)"
    if getattr(model, "pp_group", None) is not None and model.pp_group.world_size != 1:
        return "pipeline parallel"
    if model.start_layer != 0 or model.end_layer != len(model.layers):
        return "a pipeline stage's layer range"
    if not _norm_ok(model.norm):
        return "the final norm is not a plain bf16 RMSNorm"
    for i, layer in enumerate(model.layers):
        if type(layer) is not Qwen3MoeDecoderLayer:
            return f"layer {i} is {type(layer).__name__}"
        if getattr(layer, "_is_layer_to_capture", False):
            return "auxiliary hidden states are captured (speculative decoding)"
        mlp, attn = layer.mlp, layer.self_attn
        if type(mlp) is not Qwen3MoeSparseMoeBlock:
            return f"layer {i}'s MLP is {type(mlp).__name__}"
        if mlp.tp_size != 1 or mlp.ep_size != 1 or getattr(mlp, "_use_mega_moe", False):
            return "tensor or expert parallel MoE"
        if not (_norm_ok(layer.input_layernorm) and _norm_ok(layer.post_attention_layernorm)):
            return f"layer {i}'s norms are not plain bf16 RMSNorms"
        if not (_linear_ok(attn.qkv_proj) and _linear_ok(attn.o_proj) and _linear_ok(mlp.gate)):
            return f"layer {i}'s linears are quantized or not bf16"
        if attn.num_heads != attn.total_num_heads or attn.num_kv_heads != attn.total_num_kv_heads:
            return "tensor parallel attention"
        if not attn.use_fused_qk_norm_rope_cpu:
            return f"layer {i}'s rotary is not on fused_qk_norm_rope_cpu"
        radix = attn.attn
        if (
            radix.is_cross_attention
            or (radix.sliding_window_size is not None and radix.sliding_window_size > -1)
            or radix.qk_head_dim != radix.v_head_dim
            or getattr(radix, "logit_cap", 0.0) not in (0.0, None)
        ):
            return f"layer {i}'s attention has a window, cross attention or a logit cap"
        experts = mlp.experts
        if type(experts.quant_method) is not UnquantizedFusedMoEMethod:
            return f"layer {i}'s experts run {type(experts.quant_method).__name__}"
        if experts.w13_weight.dtype != torch.bfloat16:
            return "experts are not bf16"
        if getattr(experts, "w13_weight_bias", None) is not None:
            return "experts have biases"
        cfg = experts.moe_runner_config
        if unsupported_reason(experts, experts.w13_weight[:1, 0, :1], cfg) is not None:
            return f"layer {i}'s experts do not run on the CPU executor"
        act = getattr(cfg, "activation", "silu")
        if (
            str(getattr(act, "value", act)).lower() != "silu"
            or cfg.apply_router_weight_on_input
            or getattr(cfg, "gemm1_alpha", None) is not None
            or getattr(cfg, "gemm1_clamp_limit", None) is not None
            or getattr(cfg, "routed_scaling_factor", None) not in (None, 1.0)
        ):
            return f"layer {i}'s experts are not plain SiLU-gated"
        tc = mlp.topk.topk_config
        if (
            tc.use_grouped_topk
            or tc.correction_bias is not None
            or tc.custom_routing_function is not None
            or tc.num_shared_topk_slots != 0
            or tc.scoring_func != "softmax"
            or tc.routed_scaling_factor not in (None, 1.0)
        ):
            return f"layer {i}'s routing is not plain softmax top-k"
    return None


def _build(model) -> Optional[List[_Layer]]:
    reason = _plan_reason(model)
    if reason is not None:
        _log_once("plan", "CPU decode layers: upstream's module path (%s)", reason)
        return None
    plan = []
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        p = _Layer()
        p.layer_id = attn.attn.layer_id
        p.in_w, p.in_eps = layer.input_layernorm.weight.data, layer.input_layernorm.variance_epsilon
        p.post_w = layer.post_attention_layernorm.weight.data
        p.post_eps = layer.post_attention_layernorm.variance_epsilon
        p.qkv_w, p.qkv_b = attn.qkv_proj.weight, attn.qkv_proj.bias
        p.q_size, p.kv_size = attn.q_size, attn.kv_size
        p.num_heads, p.num_kv_heads, p.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        p.q_norm_w, p.k_norm_w = attn.q_norm.weight, attn.k_norm.weight
        p.qk_eps = attn.q_norm.variance_epsilon
        p.rotary = attn.rotary_emb
        p.neox, p.rotary_dim = attn.rotary_emb.is_neox_style, attn.rotary_emb.rotary_dim
        p.o_w = attn.o_proj.weight
        p.o_b = None if attn.o_proj.skip_bias_add else attn.o_proj.bias
        p.radix, p.scaling = attn.attn, attn.attn.scaling
        p.gate_w, p.top_k = mlp.gate.weight, mlp.topk.topk_config.top_k
        p.renormalize = mlp.topk.topk_config.renormalize
        p.w13, p.w2 = mlp.experts.w13_weight, mlp.experts.w2_weight
        plan.append(p)
    _log_once(
        "used",
        "CPU decode layers: %d Qwen3-MoE layers as one flat op sequence at decode "
        "(%s=0 for upstream's module path)",
        len(plan),
        OFF_ENV,
    )
    return plan


def _pass_ok(forward_batch, rows: int) -> bool:
    from sglang.srt.eplb.expert_distribution import get_global_expert_distribution_recorder
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.layers.quantization.unquant_cpu import max_rows
    from sglang.srt.model_executor.forward_context import get_attn_backend
    from sglang.srt.state_capturer.routed_experts import get_global_experts_capturer

    return (
        forward_batch.forward_mode.is_decode()
        and 1 <= rows <= max_rows()
        and type(get_attn_backend()) is TorchNativeAttnBackend
        and forward_batch.encoder_lens is None
        and not getattr(forward_batch, "can_run_tbo", False)
        and not any(i is not None for i in (getattr(forward_batch, "lora_ids", None) or ()))
        and not get_global_expert_distribution_recorder().recording
        and get_global_experts_capturer() is None
    )


def _native_mode() -> bool:
    """True unless ``SGLANG_CPU_DECODE_LAYERS=python`` (the flat sequence run from Python)."""
    return os.environ.get(OFF_ENV, "1").strip().lower() != "python"


def _native_ok(pool) -> bool:
    """Whether ``decode_layers_cpu``'s KV write (one bf16 row per token at ``out_cache_loc``)
    is what ``pool.set_kv_buffer`` does: upstream's plain MHA pool, unquantized, token-major
    (NHD), all layers local, no layer-wise loading."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    return (
        type(pool) is MHATokenToKVPool
        and not getattr(pool, "is_quantized_kv_cache", False)
        and pool.dtype == torch.bfloat16
        and pool.store_dtype == torch.bfloat16
        and not pool.use_hnd
        and pool.kv_cache_layout == "nhd"
        and pool.layer_transfer_counter is None
        and pool.start_layer == 0
    )


class _NativePlan:
    """``decode_layers_plan_cpu``'s id for a model, freed with it (or by :func:`reset_plan`)."""

    def __init__(self, plan_id: int):
        self.id = plan_id

    def __del__(self):
        try:
            torch.ops.sgl_kernel.decode_layers_plan_free_cpu(self.id)
        except Exception:  # interpreter shutdown: the registry goes with the process
            pass


def _native_plan(model, plan: List[_Layer]) -> Optional[int]:
    """The C++ plan of ``plan`` (built once per model), or None where the op is missing or
    ``SGLANG_CPU_DECODE_LAYERS=python``."""
    native = getattr(model, _NATIVE_ATTR, False)
    if native is False:
        native = None
        if _native_mode() and hasattr(torch.ops.sgl_kernel, "decode_layers_cpu"):
            empty = torch.empty(0, dtype=torch.bfloat16)
            tensors, ints, floats = [], [], []
            for p in plan:
                tensors += (
                    p.in_w,
                    p.post_w,
                    p.qkv_w,
                    empty if p.qkv_b is None else p.qkv_b,
                    p.q_norm_w,
                    p.k_norm_w,
                    p.o_w,
                    empty if p.o_b is None else p.o_b,
                    p.gate_w,
                    p.w13,
                    p.w2,
                )
                ints += (
                    p.q_size,
                    p.kv_size,
                    p.num_heads,
                    p.num_kv_heads,
                    p.head_dim,
                    p.rotary_dim,
                    int(p.neox),
                    p.top_k,
                    int(p.renormalize),
                )
                floats += (p.in_eps, p.post_eps, p.qk_eps, p.scaling)
            tensors.append(model.norm.weight.data)
            floats.append(model.norm.variance_epsilon)
            native = _NativePlan(torch.ops.sgl_kernel.decode_layers_plan_cpu(tensors, ints, floats))
            _log_once("native", "CPU decode layers: one decode_layers_cpu call per decode pass")
        setattr(model, _NATIVE_ATTR, native)
    return None if native is None else native.id


def decode_layers(
    model: torch.nn.Module,
    positions: torch.Tensor,
    hidden_states: torch.Tensor,
    forward_batch,
) -> Optional[torch.Tensor]:
    """Every decoder layer of a Qwen3-MoE ``model`` and its final norm, for one decode pass.

    Args:
        model: upstream's ``Qwen3MoeModel`` (``layers``, ``norm``).
        positions: [B] int64, the position of each request's new token.
        hidden_states: [B, hidden] bf16, the token embeddings (written: it becomes the
            residual stream, as in the module path).
        forward_batch: the pass's ``ForwardBatch`` (decode mode, ``out_cache_loc`` [B],
            ``req_pool_indices`` [B], ``seq_lens`` [B] including the new token).

    Returns:
        [B, hidden] bf16: the final norm's output, what the module path returns; or None when
        the flat path does not apply to this model or pass (nothing was computed or written).
    """
    plan = getattr(model, _PLAN_ATTR, False)
    if plan is False:
        plan = _build(model) if enabled() else None
        setattr(model, _PLAN_ATTR, plan)
    rows = hidden_states.shape[0]
    if plan is None or hidden_states.dtype != torch.bfloat16 or not _pass_ok(forward_batch, rows):
        return None
    from sglang.srt.model_executor.forward_context import get_attn_backend

    backend = get_attn_backend()
    pool = backend.token_to_kv_pool
    k0 = pool.get_key_buffer(plan[0].layer_id)
    if k0.dtype != hidden_states.dtype:
        _log_once("kv", "CPU decode layers: upstream's module path (KV cache %s)", k0.dtype)
        return None
    from sglang.srt.layers.attention.torch_native_extend import extend_kernel_supported

    # The attention the module path's forward_decode would pick (patch 0005): the fork's flash
    # kernel reading each request's KV slots in place where the CPU has it, else upstream's
    # forward_decode itself (KV write + per-request SDPA).
    probe = hidden_states.new_empty(1, plan[0].head_dim)
    fast_attn = extend_kernel_supported(probe, k0, pool.get_value_buffer(plan[0].layer_id))
    _log_once(f"rows{rows}", "CPU decode layers: first flat decode pass of %d row(s)", rows)

    from sglang.srt.layers.moe.topk import fused_topk_torch_native
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    ops = torch.ops.sgl_kernel
    add_norm, norm, qk_rope = ops.fused_add_rmsnorm_cpu, ops.rmsnorm_cpu, ops.fused_qk_norm_rope_cpu
    linear, experts, attend = ops.dense_linear_cpu, ops.moe_experts_cpu, ops.extend_attention_cpu
    write_loc = KVWriteLoc(forward_batch.out_cache_loc, backend.swa_out_cache_loc)
    req_to_token = backend.req_to_token_pool.req_to_token
    # Each request's KV slots, once per pass for every layer (the module path slices them per
    # layer): request r reads req_to_token[pool index, :seq_len].
    kv_index = (
        [
            req_to_token[i, :n]
            for i, n in zip(
                forward_batch.req_pool_indices.tolist(), forward_batch.seq_lens.tolist()
            )
        ]
        if fast_attn
        else None
    )
    pos = positions.view(-1)
    if fast_attn and _native_ok(pool):
        native = _native_plan(model, plan)
        if native is not None:
            caches = []
            for p in plan:
                p.rotary._match_cos_sin_cache_dtype(hidden_states)
                caches += (
                    pool.get_key_buffer(p.layer_id),
                    pool.get_value_buffer(p.layer_id),
                    p.rotary.cos_sin_cache,
                )
            return ops.decode_layers_cpu(
                native, hidden_states, pos, forward_batch.out_cache_loc, caches, kv_index
            )
    residual = None
    h = hidden_states
    for p in plan:
        if residual is None:
            residual = h
            h = norm(h, p.in_w, p.in_eps)
        else:
            add_norm(h, residual, p.in_w, p.in_eps)
        qkv = linear(h, p.qkv_w, p.qkv_b)
        q, k, v = qkv.split([p.q_size, p.kv_size, p.kv_size], dim=-1)
        p.rotary._match_cos_sin_cache_dtype(q)
        qk_rope(
            q,
            k,
            p.q_norm_w,
            p.k_norm_w,
            p.qk_eps,
            p.neox,
            pos,
            p.rotary.cos_sin_cache,
            p.rotary_dim,
        )
        q = q.reshape(rows, p.num_heads * p.head_dim)
        k = k.view(rows, p.num_kv_heads, p.head_dim)
        v = v.view(rows, p.num_kv_heads, p.head_dim)
        if fast_attn:
            pool.set_kv_buffer(p.radix, write_loc, k, v)
            o = torch.empty_like(q)
            q3 = q.view(rows, p.num_heads, p.head_dim)
            o3 = o.view(rows, p.num_heads, p.head_dim)
            k_cache, v_cache = pool.get_key_buffer(p.layer_id), pool.get_value_buffer(p.layer_id)
            for r in range(rows):
                attend(
                    q3[r : r + 1], k_cache, v_cache, o3[r : r + 1], 0, p.scaling, False, kv_index[r]
                )
        else:
            o = backend.forward_decode(q, k, v, p.radix, forward_batch)
        h = linear(o, p.o_w, p.o_b)
        add_norm(h, residual, p.post_w, p.post_eps)
        logits = linear(h, p.gate_w, None)
        weights, ids = fused_topk_torch_native(h, logits, p.top_k, p.renormalize)
        out = torch.empty(rows, p.w2.shape[1], dtype=torch.float32)
        experts(
            h,
            weights.to(torch.float32).contiguous(),
            [ids.to(torch.int32).contiguous()],
            [p.w13],
            [p.w2],
            out,
            False,
        )
        h = out.to(torch.bfloat16)
    add_norm(h, residual, model.norm.weight.data, model.norm.variance_epsilon)
    return h
