"""Routed experts of a resident bf16 MoE layer on the CPU, through the persistent CPU executor.

Upstream 0.5.23 runs an unquantized ``FusedMoE`` layer on the CPU with
``torch.ops.sgl_kernel.fused_experts_cpu`` only when the CPU has AMX
(``UnquantizedFusedMoEMethod.forward_cpu`` in ``layers/quantization/unquant.py``); everywhere
else it falls back to ``moe_forward_native``, a Python loop over the experts with one bf16
``torch.mm`` pair per expert that holds a token, where each small matmul pays a fixed cost
(``benchmark/cpu_executor/bench_resident_layer.py`` compares the two; figures in
``benchmark/RESULTS.md``). Patch ``0032-cpu-executor-for-resident-moe`` sends such
layers here instead: one ``sgl_kernel.moe_experts_cpu`` call over the layer's own
``w13_weight`` / ``w2_weight``, the same kernel (AVX-512 BF16 / AVX-512 / AVX2 / scalar, chosen
at load) and worker pool that the expert-slot cache uses for its CPU misses
(``layers/moe/expert_cache/``).

Numerics: per (token, expert) the gate and up projections accumulate in fp32 (plus the layer's
``w13_weight_bias`` in fp32 when it has one), ``silu(g) * u`` (``gelu_tanh(g) * u`` for gated
GELU experts: Gemma 4) is rounded to bf16 once, the down projection accumulates in fp32 (plus ``w2_weight_bias``) and the top-k sum is taken in k
order in fp32, then rounded to bf16 (``moe_forward_native`` rounds every intermediate to bf16).
Like ``moe_forward_native``, the layer call leaves ``routed_scaling_factor`` to the model.

``SGLANG_CPU_MOE_BACKEND=native`` (read at a layer's first call) keeps upstream's loop.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Optional

import torch

logger = logging.getLogger(__name__)

ENV_BACKEND = "SGLANG_CPU_MOE_BACKEND"


@functools.lru_cache(maxsize=1)
def _executor_op():
    """``torch.ops.sgl_kernel.moe_experts_cpu`` when this build of sgl_kernel has it, else None."""
    try:
        import sgl_kernel_fork  # noqa: F401  (registers the ops)
    except ImportError:
        return None
    ops = torch.ops.sgl_kernel
    return ops.moe_experts_cpu if hasattr(ops, "moe_experts_cpu") else None


_UNSET = object()
_REASON_ATTR = "_cpu_executor_unsupported"  # the layer's cached verdict (None: supported)


def _layer_reason(layer: torch.nn.Module, moe_runner_config) -> Optional[str]:
    """The per-layer part of :func:`unsupported_reason` (weights, config, environment)."""
    if os.environ.get(ENV_BACKEND, "auto").lower() == "native":
        return f"{ENV_BACKEND}=native"
    if _executor_op() is None:
        return "sgl_kernel_fork has no moe_experts_cpu op"
    w13 = getattr(layer, "w13_weight", None)
    w2 = getattr(layer, "w2_weight", None)
    if not isinstance(w13, torch.Tensor) or not isinstance(w2, torch.Tensor):
        return "no resident w13_weight / w2_weight"
    if w13.dtype != torch.bfloat16 or w2.dtype != torch.bfloat16:
        return f"weights are {w13.dtype} (bf16 only)"
    if w13.device.type != "cpu":
        return "weights not on the CPU"
    if not (w13.is_contiguous() and w2.is_contiguous()):
        return "non-contiguous expert weights"
    return _config_reason(layer, moe_runner_config)


def _config_reason(layer: torch.nn.Module, moe_runner_config) -> Optional[str]:
    """The runner-config and layer features the executor lacks (any weight format)."""
    if moe_runner_config.activation not in ("silu", "gelu") or not getattr(
        moe_runner_config, "is_gated", True
    ):
        return f"activation {moe_runner_config.activation} (gated SiLU and GELU only)"
    if any(getattr(moe_runner_config, f, None) is not None for f in ("gemm1_beta", "swiglu_limit")):
        return "gemm1 beta / swiglu limit"
    if moe_runner_config.gemm1_alpha is not None or moe_runner_config.gemm1_clamp_limit is not None:
        # upstream's loop runs gpt-oss's clamped SwiGLU on interleaved gate/up rows
        # (swiglu_gpt_oss_sigmoid_alpha); only the expert cache's pool de-interleaves them
        return "gemm1 alpha / clamp (gpt-oss's SwiGLU on interleaved rows)"
    if getattr(getattr(layer, "quant_method", None), "w13_swiglu_interleaved", False):
        return "interleaved gate/up rows"
    return None


def _activation(moe_runner_config) -> str:
    """The executor's activation for a layer :func:`_config_reason` accepts: ``silu``, or
    ``gelu_tanh`` for gated ``gelu`` (Gemma 4), as the expert cache maps it
    (``expert_cache.method.expert_activation``)."""
    from sglang.srt.layers.moe.expert_cache.method import expert_activation

    return expert_activation(moe_runner_config)[0]


def unsupported_reason(layer: torch.nn.Module, x: torch.Tensor, moe_runner_config) -> Optional[str]:
    """Why the executor cannot run this layer call (None when it can).

    The per-layer verdict (weights, runner config, ``SGLANG_CPU_MOE_BACKEND``) is computed on the
    layer's first call and cached on the layer; each call then checks only ``x``.

    Args:
        layer: a ``FusedMoE`` layer with resident ``w13_weight`` ``[E, 2*I, H]`` and
            ``w2_weight`` ``[E, H, I]``.
        x: ``[T, H]`` hidden states.
        moe_runner_config: the layer's ``MoeRunnerConfig``.

    Returns:
        A short reason (e.g. ``"weights are torch.float32 (bf16 only)"``) or None.
    """
    if x.dtype != torch.bfloat16 or x.device.type != "cpu":
        reason = f"activations {x.dtype} on {x.device.type} (bf16 on the CPU only)"
        if not _fallback_logged:
            _log_fallback(layer, reason)
        return reason
    reason = getattr(layer, _REASON_ATTR, _UNSET)
    if reason is _UNSET:
        reason = _layer_reason(layer, moe_runner_config)
        setattr(layer, _REASON_ATTR, reason)
        if reason is not None and not _fallback_logged:
            _log_fallback(layer, reason)
    return reason


_fallback_logged = False


def _log_fallback(layer: torch.nn.Module, reason: str) -> None:
    """Say once per process that a layer runs upstream's torch MoE loop, and why."""
    global _fallback_logged
    _fallback_logged = True
    logger.info(
        "CPU MoE: layer %s runs upstream's torch loop (moe_forward_native), not the CPU "
        "executor: %s",
        getattr(layer, "layer_id", "?"),
        reason,
    )


def cpu_executor_forward(
    layer: torch.nn.Module, x: torch.Tensor, topk_output, moe_runner_config
) -> Optional[torch.Tensor]:
    """The routed-expert output of one resident MoE layer call on the CPU executor.

    Args:
        layer: the ``FusedMoE`` layer (``w13_weight`` ``[E, 2*I, H]`` bf16, rows ``0..I-1`` the
            gate projection; ``w2_weight`` ``[E, H, I]`` bf16).
        x: ``[T, H]`` bf16 hidden states.
        topk_output: ``(topk_weights [T, K] float, topk_ids [T, K] int, ...)``; an id of -1 is
            a padding entry that contributes nothing.
        moe_runner_config: the layer's ``MoeRunnerConfig``.

    Returns:
        ``[T, H]`` bf16: ``sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t])``, or None
        when :func:`unsupported_reason` names a reason (the caller keeps upstream's path).

    Raises:
        RuntimeError: from the op, for an expert id outside ``[0, E)``; router weights applied
            on the input with top-k other than 1.
    """
    if unsupported_reason(layer, x, moe_runner_config) is not None:
        return None
    topk_weights, topk_ids = topk_output[0], topk_output[1]
    if moe_runner_config.apply_router_weight_on_input:  # top-1 (Llama 4): expert(w * x), weight 1
        x, topk_weights = _weight_on_input(x, topk_weights)
        topk_output = (topk_weights, topk_ids)
    banks = _bias_banks(layer, {"w13": layer.w13_weight, "w2": layer.w2_weight})
    activation = _activation(moe_runner_config)
    if len(banks) == 2 and activation == "silu":
        out = torch.empty(x.shape[0], layer.w2_weight.shape[1], dtype=torch.float32)
        _executor_op()(
            x.contiguous(),
            topk_weights.to(torch.float32).contiguous(),
            [topk_ids.to(torch.int32).contiguous()],
            [banks["w13"]],
            [banks["w2"]],
            out,
            False,
        )
        return out.to(x.dtype)
    return _quant_forward("bf16", banks, x, topk_output, activation)


def _weight_on_input(x: torch.Tensor, topk_weights: torch.Tensor):
    """``(x * w, ones)`` for a top-1 layer that applies its router weight on the input: upstream's
    ``topk.apply_topk_weights_cpu``, as its AMX path runs it (x [T, H] bf16, w [T, 1]).

    Raises:
        RuntimeError: top-k other than 1 (the layer's experts would each need their own input;
            upstream's CPU loop refuses these layers too).
    """
    from sglang.srt.layers.moe.topk import apply_topk_weights_cpu

    if topk_weights.dim() != 2 or topk_weights.shape[1] != 1:
        raise RuntimeError(
            "an MoE layer that applies its router weight on the input runs with top-1 routing "
            f"only (Llama 4's), got top-k weights of shape {tuple(topk_weights.shape)}"
        )
    return apply_topk_weights_cpu(True, topk_weights, x)


def _bias_banks(layer: torch.nn.Module, banks: dict) -> dict:
    """``banks`` plus the layer's ``w13_weight_bias`` [E, 2I] / ``w2_weight_bias`` [E, H]
    (float32 or bf16; added in fp32 by the executor) as ``w13_bias`` / ``w2_bias``, where the
    layer has them."""
    for name in ("w13", "w2"):
        bias = getattr(layer, f"{name}_weight_bias", None)
        if bias is not None:
            banks[f"{name}_bias"] = bias.data.contiguous()
    return banks


def fp8_cpu_executor_forward(
    layer: torch.nn.Module, x: torch.Tensor, topk_output, moe_runner_config
) -> torch.Tensor:
    """The routed-expert output of one resident block-FP8 MoE layer call on the CPU executor
    (patch ``0003-fp8-cpu-without-amx``: ``Fp8MoEMethod.apply`` on a CPU without AMX, where
    upstream has no FP8 MoE kernel).

    Args:
        layer: a ``FusedMoE`` layer of ``Fp8MoEMethod`` as loaded: ``w13_weight``
            ``[E, 2*I, H]`` and ``w2_weight`` ``[E, H, I]`` float8_e4m3fn,
            ``w13_weight_scale_inv`` ``[E, ceil(2I/128), ceil(H/128)]`` and
            ``w2_weight_scale_inv`` ``[E, ceil(H/128), ceil(I/128)]`` float32.
        x: ``[T, H]`` bf16 hidden states.
        topk_output: ``(topk_weights [T, K], topk_ids [T, K], ...)``; -1 ids are padding.
        moe_runner_config: the layer's ``MoeRunnerConfig``.

    Returns:
        ``[T, H]`` bf16: ``sum_k w[t, k] * expert_k(x[t])`` with each expert's weights
        dequantized in the kernel (``fp8 * scale_inv`` per 128 x 128 block).

    Raises:
        RuntimeError: activations other than bf16 (the layer itself was checked at load by
            :func:`check_fp8_layer`).
    """
    banks = {
        "w13": layer.w13_weight,
        "w2": layer.w2_weight,
        "w13_scale": layer.w13_weight_scale_inv,
        "w2_scale": layer.w2_weight_scale_inv,
    }
    return _layer_quant_forward("block-FP8", layer, banks, x, topk_output, moe_runner_config)


def nvfp4_cpu_executor_forward(
    layer: torch.nn.Module, x: torch.Tensor, topk_output, moe_runner_config
) -> torch.Tensor:
    """The routed-expert output of one resident ModelOpt NVFP4 MoE layer call on the CPU
    executor (patch ``0009-modelopt-nvfp4-cpu``: ``ModelOptNvFp4FusedMoEMethod.apply`` on the
    CPU, where upstream has no NVFP4 kernel). Weight-only: activations stay bf16, the layer's
    ``w13_input_scale`` / ``w2_input_scale`` are not read.

    Args:
        layer: a ``FusedMoE`` layer of ``ModelOptNvFp4FusedMoEMethod`` as loaded:
            ``w13_weight`` ``[E, 2*I, H/2]`` / ``w2_weight`` ``[E, H, I/2]`` uint8 (two e2m1
            codes per byte), ``w13_weight_scale`` ``[E, 2*I, H/16]`` / ``w2_weight_scale``
            ``[E, H, I/16]`` float8_e4m3fn, ``w13_weight_scale_2`` ``[E, 2]`` (gate, up) /
            ``w2_weight_scale_2`` ``[E]`` float32.
        x, topk_output, moe_runner_config: as :func:`fp8_cpu_executor_forward`.

    Returns:
        ``[T, H]`` bf16, each weight ``e2m1 * fp8(scale) * global`` in the kernel.

    Raises:
        RuntimeError: activations other than bf16.
    """
    banks = {
        "w13": layer.w13_weight,
        "w2": layer.w2_weight,
        "w13_scale": layer.w13_weight_scale,
        "w2_scale": layer.w2_weight_scale,
        "w13_scale_2": layer.w13_weight_scale_2,
        "w2_scale_2": layer.w2_weight_scale_2,
    }
    return _layer_quant_forward("NVFP4", layer, banks, x, topk_output, moe_runner_config)


def _layer_quant_forward(
    label: str, layer, banks: dict, x: torch.Tensor, topk_output, moe_runner_config
) -> torch.Tensor:
    """:func:`_quant_forward` of a quantized resident layer: its bias banks, its activation,
    and a top-1 router weight applied on the input (Llama 4: the expert runs on ``w * x``)."""
    if moe_runner_config.apply_router_weight_on_input:
        x, weights = _weight_on_input(x, topk_output[0])
        topk_output = (weights, topk_output[1])
    banks = _bias_banks(layer, banks)
    return _quant_forward(label, banks, x, topk_output, _activation(moe_runner_config))


def _quant_forward(
    label: str, banks: dict, x: torch.Tensor, topk_output, activation: str = "silu"
) -> torch.Tensor:
    """One ``moe_experts_cpu`` call over a resident layer's ``banks`` (quantized, or with
    biases, or with ``activation`` other than ``silu``)."""
    from sglang.srt.layers.moe.expert_cache.executor_args import run_experts_cpu

    if x.dtype != torch.bfloat16:
        raise RuntimeError(f"{label} MoE on the CPU executor takes bf16 activations, got {x.dtype}")
    out = torch.empty(x.shape[0], banks["w2"].shape[1], dtype=torch.float32)
    run_experts_cpu(
        x.contiguous(),
        topk_output[0].to(torch.float32).contiguous(),
        [topk_output[1].to(torch.int32).contiguous()],
        [banks],
        out,
        activation,
    )
    return out.to(x.dtype)


def check_fp8_layer(layer: torch.nn.Module) -> None:
    """At load (patch 0003, ``Fp8MoEMethod.process_weights_after_loading`` on a CPU without
    AMX): raise unless :func:`fp8_cpu_executor_forward` can run this layer, so that the server
    refuses to start instead of failing its first request.

    Raises:
        RuntimeError: a layer feature the executor lacks (activation, biases, ...); the
            message says what to do.
    """
    reason = _config_reason(layer, layer.moe_runner_config)
    if reason is not None:
        raise RuntimeError(
            f"block-FP8 MoE on a CPU without AMX runs on the CPU executor, which cannot run "
            f"this layer ({reason}); serve the bf16 checkpoint"
        )


def check_nvfp4_layer(layer: torch.nn.Module) -> None:
    """At load (patch 0009, ``ModelOptNvFp4FusedMoEMethod.process_weights_after_loading`` on
    the CPU): raise unless :func:`nvfp4_cpu_executor_forward` can run this layer with every
    scale loaded, so that the server refuses to start instead of failing a request.

    Raises:
        ValueError: scales the checkpoint did not have (NaN since ``nvfp4_cpu.prepare_moe``),
            by checkpoint name.
        RuntimeError: a layer feature the executor lacks (activation, biases, ...).
    """
    from sglang.srt.layers.moe.expert_cache.formats import NVFP4
    from sglang.srt.layers.moe.expert_cache.loading import missing_scales

    reason = _config_reason(layer, layer.moe_runner_config)
    if reason is not None:
        raise RuntimeError(
            f"NVFP4 MoE on the CPU runs on the CPU executor, which cannot run this layer "
            f"({reason}); serve the bf16 checkpoint"
        )
    h, i = layer.w2_weight.shape[1], layer.w13_weight.shape[1] // 2
    missing = []
    for spec in NVFP4.banks(h, i):
        if "_scale" in spec.name:
            missing += missing_scales(getattr(layer, spec.layer_param).data, spec, layer.layer_id)
    if missing:
        more = f" and {len(missing) - 4} more" if len(missing) > 4 else ""
        raise ValueError(
            f"NVFP4 checkpoint without {', '.join(missing[:4])}{more}: every NVFP4 expert "
            "weight needs its weight_scale and weight_scale_2 (re-export the checkpoint)"
        )
