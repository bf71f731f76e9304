"""compressed-tensors FP8 checkpoints on the CPU (patch ``0083-compressed-tensors-fp8-cpu``).

The "FP8-Dynamic" releases of llm-compressor (RedHatAI/Qwen3-30B-A3B-FP8-dynamic, GLM-4.5/4.6
FP8-Dynamic; ``quant_method: compressed-tensors``, ``format: float-quantized``, weights
``strategy: channel`` or ``block`` with dynamic per-token activations) and its static
per-tensor "FP8" releases (weights and activations ``strategy: tensor``, a calibrated
``input_scale`` beside each weight: RedHatAI/Mixtral-8x7B-Instruct-v0.1-FP8) load through upstream
0.5.23's ``CompressedTensorsW8A8Fp8`` (linears) and ``CompressedTensorsW8A8Fp8MoE`` (experts),
whose kernels are CUDA / ROCm only (``apply_fp8_linear``, the Triton fused MoE): on the CPU
upstream does not even pick the scheme (its compute-capability check calls
``torch.cuda.get_device_capability``, an AssertionError without CUDA). With the patch, on the
CPU (with or without AMX: upstream has no AMX path for this format either):

* **dense linears** (attention projections, dense and shared-expert MLPs) are dequantized to
  the model dtype once at load (:func:`dequantize_linear`) and run as upstream's
  ``UnquantizedLinearMethod``, as ``fp8_cpu.py`` does for block FP8: they are a small part of
  a MoE model's bytes. Logged once.
* **routed experts** stay FP8 with their ``w13_weight_scale`` ``[E, 2I, 1]`` /
  ``w2_weight_scale`` ``[E, H, 1]`` (per output channel) or ``[E, ceil(2I/128),
  ceil(H/128)]`` / ``[E, ceil(H/128), ceil(I/128)]`` (128 x 128 blocks), exactly as loaded;
  the CPU executor runs them with in-kernel dequantization (:func:`moe_forward`), weight-only
  (the activations stay bf16; upstream would quantize them per token to FP8). Per-tensor
  scales (``[E, 2]``: gate, up; ``[E]``: down) are written out per output channel at load
  (:func:`per_tensor_to_channel`: the same value on each row of its projection, 4 bytes a
  row), which the executor's fp8 format reads; upstream instead requantizes each expert's
  gate and up to their larger scale (a second rounding this path does not make).
* **static input scales** (per-tensor scheme) are loaded and not applied: the activations
  stay bf16, so the CPU computes ``x @ w`` where upstream's kernels compute
  ``fp8(x / input_scale) * input_scale @ w``. Logged once.

Dequantization: ``w[n, k] = fp8[n, k] * weight_scale[n, 0]`` (channel),
``* weight_scale[n // 128, k // 128]`` (block) or ``* weight_scale[shard(n)]`` (tensor: one
scale per fused shard, e.g. q, k, v of ``qkv_proj``), in float32, rounded once to the model
dtype.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

_logged = False
_logged_static = False


def _log_static_input_scales() -> None:
    global _logged_static
    if not _logged_static:
        _logged_static = True
        logger.info(
            "compressed-tensors FP8 on the CPU: the checkpoint's static input scales are "
            "loaded and not applied (the activations stay bf16; the weights are FP8 x scale)"
        )


def per_tensor_to_channel(scale: torch.Tensor, widths, name: str) -> torch.Tensor:
    """One scale per output channel from per-tensor scales, one per fused shard.

    Args:
        scale: ``[..., S]`` float32, a per-tensor scale for each of S shards (a linear's
            ``weight_scale`` [S]; a MoE layer's ``w13_weight_scale`` [E, 2]; ``[E, 1]`` for
            ``w2``). ``float32`` min or NaN marks a scale the checkpoint did not have.
        widths: the S shards' output rows (``logical_widths``; ``(I, I)`` for w13).
        name: the checkpoint name of the tensor, for errors.

    Returns:
        ``[..., sum(widths), 1]`` float32: row n of shard s holds ``scale[..., s]``.

    Raises:
        ValueError: S differs from ``len(widths)``, or a scale is missing (names the shard).
    """
    widths = [int(w) for w in widths]
    if scale.shape[-1] != len(widths):
        raise ValueError(
            f"{name}.weight_scale: {scale.shape[-1]} per-tensor scales for {len(widths)} "
            f"fused shards {widths}"
        )
    unset = torch.isnan(scale) | (scale == torch.finfo(torch.float32).min)
    if unset.any():
        shards = sorted(set(torch.nonzero(unset)[:, -1].tolist()))
        raise ValueError(
            f"{name}.weight_scale was not in the checkpoint (shards {shards} of {widths} "
            "have no scale): every FP8 weight needs its weight_scale"
        )
    rows = torch.repeat_interleave(scale.float(), torch.tensor(widths, device=scale.device), dim=-1)
    return rows.unsqueeze(-1).contiguous()


def dequantize_weight(w: torch.Tensor, s: torch.Tensor, name: str, block=None) -> torch.Tensor:
    """float32 ``[N, K]`` dequantization of one compressed-tensors FP8 weight.

    Args:
        w: ``[N, K]`` float8_e4m3fn.
        s: its ``weight_scale``: ``[N, 1]`` float32 (per channel) or, with ``block`` (bn, bk),
            ``[ceil(N/bn), ceil(K/bk)]``. Rows upstream left at float32's min were never
            loaded.
        name: the layer's checkpoint name, for errors.

    Raises:
        ValueError: a scale of another shape, or scales the checkpoint did not have; names
            ``{name}.weight_scale``.
    """
    n, k = w.shape
    want = (n, 1) if block is None else (-(-n // block[0]), -(-k // block[1]))
    if tuple(s.shape) != want:
        raise ValueError(
            f"{name}.weight_scale: shape {tuple(s.shape)}, but weight {(n, k)} "
            f"{'per channel' if block is None else f'with block_structure {list(block)}'} "
            f"needs {want}"
        )
    unset = s == torch.finfo(torch.float32).min
    if unset.any():
        rows = torch.nonzero(unset)[:, 0].tolist()
        if block is not None:
            rows = [r * block[0] for r in rows]
        raise ValueError(
            f"{name}.weight_scale was not in the checkpoint (weight rows {sorted(set(rows))[:8]} "
            "have no scale): every FP8 weight needs its weight_scale"
        )
    s = s.float()
    if block is not None:
        s = s.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:n, :k]
    return w.float() * s


def dequantize_linear(layer: torch.nn.Module, scheme) -> None:
    """Replace a ``CompressedTensorsW8A8Fp8`` linear's weight by its dequantization to the model
    dtype and make the layer an unquantized linear (patch 0083, on the CPU, in place of the
    scheme's ``process_weights_after_loading``).

    Args:
        layer: a ``LinearBase`` after loading: ``weight`` [N, K] float8_e4m3fn,
            ``weight_scale`` (per channel [N, 1] or per block), ``orig_dtype`` the model dtype;
            ``prefix`` its checkpoint name (when upstream recorded it).
        scheme: the layer's ``CompressedTensorsW8A8Fp8`` (``strategy``, ``weight_block_size``);
            a per-tensor one has ``weight_scale`` [S], one per fused shard of
            ``logical_widths``, and its static ``input_scale`` is dropped unapplied (logged).

    Raises:
        ValueError: a strategy other than tensor, channel or block, or a scale
            :func:`dequantize_weight` / :func:`per_tensor_to_channel` rejects.
    """
    global _logged
    from compressed_tensors.quantization import QuantizationStrategy

    from sglang.srt.layers.quantization.nvfp4_cpu import _as_unquantized

    name = getattr(layer, "prefix", "") or "a compressed-tensors FP8 linear layer"
    strategies = (QuantizationStrategy.TENSOR, QuantizationStrategy.CHANNEL)
    if scheme.strategy not in (*strategies, QuantizationStrategy.BLOCK):
        raise ValueError(
            f"{name}: compressed-tensors FP8 with strategy {scheme.strategy} on the CPU is not "
            "supported (tensor, channel and block are)"
        )
    block = None
    if scheme.strategy == QuantizationStrategy.BLOCK:
        block = tuple(scheme.weight_block_size)
    scale = layer.weight_scale.data
    if scheme.strategy == QuantizationStrategy.TENSOR:
        scale = per_tensor_to_channel(scale, layer.logical_widths, name)
    if getattr(layer, "input_scale", None) is not None:
        _log_static_input_scales()
    dtype = getattr(layer, "orig_dtype", torch.bfloat16)
    deq = dequantize_weight(layer.weight.data, scale, name, block)
    _as_unquantized(layer, deq.to(dtype), ("weight_scale", "input_scale"))
    if not _logged:
        _logged = True
        logger.info(
            "compressed-tensors FP8 on the CPU: dense FP8 linears are dequantized to %s at "
            "load (routed experts stay FP8 for the CPU executor)",
            dtype,
        )


def check_moe_layer(layer: torch.nn.Module) -> None:
    """At load (patch 0083, ``CompressedTensorsW8A8Fp8MoE.process_weights_after_loading`` on
    the CPU): raise unless :func:`moe_forward` can run this layer with every scale loaded
    (the patch makes ``create_weights`` start the scales as NaN instead of 1). Per-tensor
    scales (``w13_weight_scale`` [E, 2], ``w2_weight_scale`` [E]) are then replaced by the
    same values per output channel ([E, 2I, 1] / [E, H, 1], :func:`per_tensor_to_channel`),
    the layout the executor reads; static input scales are kept, unused (logged).

    Raises:
        ValueError: scales the checkpoint did not have, by checkpoint name
            (``model.layers.{L}.mlp.experts.{e}.gate_proj.weight_scale``).
        RuntimeError: a layer feature the executor lacks (activation, biases, ...); the
            message says what to do.
    """
    from sglang.srt.layers.moe.cpu_executor import _config_reason
    from sglang.srt.layers.moe.expert_cache.banks import BankSpec
    from sglang.srt.layers.moe.expert_cache.loading import missing_scales

    missing = []
    for bank in ("w13_scale", "w2_scale"):
        rows = getattr(layer, bank.replace("_scale", "_weight_scale")).data
        spec = BankSpec(bank, bank.replace("_scale", "_weight_scale"), rows.shape[1:], rows.dtype)
        missing += missing_scales(rows, spec, layer.layer_id)
    if missing:
        more = f" and {len(missing) - 4} more" if len(missing) > 4 else ""
        raise ValueError(
            f"compressed-tensors FP8 checkpoint without {', '.join(missing[:4])}{more}: every "
            "FP8 expert weight needs its weight_scale (re-export the checkpoint)"
        )
    reason = _config_reason(layer, layer.moe_runner_config)
    if reason is not None:
        raise RuntimeError(
            "compressed-tensors FP8 MoE on the CPU runs on the CPU executor, which cannot run "
            f"this layer ({reason}); serve the bf16 checkpoint"
        )
    if layer.w2_weight_scale.dim() == 1:  # per tensor: [E, 2] / [E]
        i = layer.w2_weight.shape[2]
        h = layer.w2_weight.shape[1]
        name = f"model.layers.{layer.layer_id}.mlp.experts"
        for param, scale, widths in (
            ("w13_weight_scale", layer.w13_weight_scale.data, (i, i)),
            ("w2_weight_scale", layer.w2_weight_scale.data[:, None], (h,)),
        ):
            rows = per_tensor_to_channel(scale, widths, name)
            setattr(layer, param, torch.nn.Parameter(rows, requires_grad=False))
    if getattr(layer, "w13_input_scale", None) is not None:
        _log_static_input_scales()


def moe_forward(layer: torch.nn.Module, x: torch.Tensor, topk_output, moe_runner_config):
    """The routed-expert output of one ``CompressedTensorsW8A8Fp8MoE`` layer call on the CPU
    executor (patch 0083: its ``apply_weights`` on the CPU).

    Args:
        layer: the ``FusedMoE`` as loaded: ``w13_weight`` ``[E, 2I, H]`` / ``w2_weight``
            ``[E, H, I]`` float8_e4m3fn, ``w13_weight_scale`` / ``w2_weight_scale`` float32
            per channel ``[E, 2I, 1]`` / ``[E, H, 1]`` or per 128 x 128 block.
        x: ``[T, H]`` bf16 hidden states.
        topk_output: ``(topk_weights [T, K], topk_ids [T, K], ...)``.
        moe_runner_config: the layer's ``MoeRunnerConfig``.

    Returns:
        ``[T, H]`` bf16, each weight ``fp8 * scale`` in the kernel.

    Raises:
        RuntimeError: activations other than bf16.
    """
    from sglang.srt.layers.moe.cpu_executor import _layer_quant_forward

    banks = {
        "w13": layer.w13_weight,
        "w2": layer.w2_weight,
        "w13_scale": layer.w13_weight_scale,
        "w2_scale": layer.w2_weight_scale,
    }
    return _layer_quant_forward(
        "compressed-tensors FP8", layer, banks, x, topk_output, moe_runner_config
    )
