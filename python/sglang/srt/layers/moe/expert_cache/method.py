"""The fused-MoE method that serves a ``FusedMoE`` layer through the shared expert-slot cache.

Wired in by patch ``0031-fused-moe-expert-cache-hook`` when ``--enable-expert-cache`` is set:
``FusedMoE.__init__`` replaces its quant method with :func:`make_for_layer`'s result. The
layer's ``w13_weight`` / ``w2_weight`` parameters become views of the layer's rows of the
host pool, so upstream's weight loader writes every expert straight into the pool.

Routing stays upstream's ``TopK`` (softmax or sigmoid, grouped top-k, correction bias): the
method receives the routed ids and weights. Shared experts run unfused beside the cache, as the
model's own MLP (patch ``0034-expert-cache-unfused-shared-experts`` turns fusion off before the
model is built). ``routed_scaling_factor`` is applied where upstream's stock path applies it for
the same device (:func:`output_scale`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional, Tuple

import torch

from sglang.srt.layers.quantization.base_config import FusedMoEMethodBase

if TYPE_CHECKING:  # imported where used: patch 0033 imports this module on every metrics server
    from sglang.srt.layers.moe.expert_cache.cache import ExpertSlotCache
    from sglang.srt.layers.moe.expert_cache.config import ExpertCacheConfig

logger = logging.getLogger(__name__)

_CACHE: Optional[ExpertSlotCache] = None


def get_expert_slot_cache() -> Optional[ExpertSlotCache]:
    """The process's expert-slot cache (None before the first MoE layer is built)."""
    return _CACHE


def publish_expert_cache_metrics() -> None:
    """Export the cache's counters to Prometheus now, if there is a finalized cache (patch 0033
    calls this at the scheduler's decode log interval: graph-replayed decode steps run no
    Python, so :meth:`ExpertSlotCache.forward` cannot publish them). One device sync."""
    if _CACHE is not None and _CACHE.finalized:
        _CACHE.publish_metrics()


def reset_expert_slot_cache() -> None:
    """Forget the process's cache (a new model is about to be built; tests)."""
    global _CACHE
    _CACHE = None


class ExpertCacheMoEMethod(FusedMoEMethodBase, torch.nn.Module):
    """Runs one MoE layer's routed experts through the shared :class:`ExpertSlotCache`."""

    def __init__(
        self,
        base_method,
        config: ExpertCacheConfig,
        layer_id: int,
        top_k: int,
        num_layers: int,
        device,
        activation: Tuple[str, Optional[float], Optional[float]] = ("silu", None, None),
        gate_up_interleaved: bool = False,
        layer: Optional[torch.nn.Module] = None,
    ):
        torch.nn.Module.__init__(self)
        self.base_method = base_method
        self.config = config
        self.layer_id = layer_id
        self.top_k = top_k
        self.num_layers = num_layers
        self.device = device
        self.activation = activation  # (name, alpha, limit) of the executor (expert_activation)
        self.gate_up_interleaved = gate_up_interleaved  # the checkpoint's w13 rows (gpt-oss)
        self.cache: Optional[ExpertSlotCache] = None
        self.moe_runner_config = None
        # the layer carries compressed-tensors' scheme (upstream's format_for reads it there)
        self.label, self.weight_block_size = expert_format_of(base_method, layer)

    def create_weights(
        self,
        layer: torch.nn.Module,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
        with_bias: bool = False,
        **extra_weight_attrs,
    ):
        """The base method's ``create_weights``, run on the meta device, says which per-expert
        tensors (and their loaders and attributes) the layer has; each becomes a view of the
        layer's rows of a host-pool bank of the same shape and dtype, so the checkpoint loads
        straight into the pool in the base method's own layout (FP8 bytes and their scales
        included, and gpt-oss's bias banks). A checkpoint whose gate/up rows are interleaved
        (gpt-oss) is de-interleaved by the loaders on its way into the pool
        (:func:`loading.deinterleaving_loader`).

        Raises:
            ValueError: biases on a format without bias banks, experts of another shape or
                format than the first MoE layer's, or per-expert tensors the banks do not hold.
        """
        from sglang.srt.layers.moe.expert_cache.banks import (
            format_for_dtype,
            format_from_layer,
        )
        from sglang.srt.layers.moe.expert_cache.loading import (
            checked_loader,
            deinterleaving_loader,
            fill_unloaded,
            per_tensor_scale_loader,
        )

        global _CACHE
        fmt = quant_format_of_label(self.label)
        if with_bias and not (fmt is not None and fmt.biases):
            raise ValueError(
                f"--enable-expert-cache holds no bias banks for {self.label} experts (only for "
                "MXFP4 ones, gpt-oss): serve this model without --enable-expert-cache"
            )
        with torch.device("meta"):
            self.base_method.create_weights(
                layer,
                num_experts,
                hidden_size,
                intermediate_size_per_partition,
                params_dtype,
                with_bias=with_bias,
                **extra_weight_attrs,
            )
        if fmt is not None:  # described by formats.py (nvfp4, mxfp4, ct-fp8)
            fmt.check_layer(layer, num_experts, hidden_size, intermediate_size_per_partition)
            # FusedMoE.weight_loader follows the base method's layout (as for paged experts):
            # ModelOpt's per-tensor scales load by column (gate, up), not as blocks.
            layer.weight_load_method = self.base_method
            _materialize_other_params(layer, fmt, hidden_size, intermediate_size_per_partition)
        else:
            found = format_from_layer(layer, num_experts, self.label, self.weight_block_size)
            fmt = found if found.quantized else format_for_dtype(found.dtype)
        if _CACHE is None:
            from sglang.srt.layers.moe.expert_cache.cache import ExpertSlotCache

            _CACHE = ExpertSlotCache(
                self.config,
                num_layers=self.num_layers,
                num_experts=num_experts,
                top_k=self.top_k,
                hidden_size=hidden_size,
                intermediate_size=intermediate_size_per_partition,
                dtype=params_dtype,
                device=self.device,
                fmt=fmt,
                activation=self.activation,
            )
        else:
            _CACHE.check_shape(
                num_experts,
                self.top_k,
                hidden_size,
                intermediate_size_per_partition,
                params_dtype,
                fmt,
                activation=self.activation,
            )
        self.cache = _CACHE
        self.cache.register_layer(self.layer_id)
        for spec in self.cache.host.specs:
            meta = getattr(layer, spec.layer_param)
            rows = self.cache.host_rows(spec.name, self.layer_id)
            fill_unloaded(rows, spec)  # scales: "missing" (loading.missing_scales); biases: 0
            param = torch.nn.Parameter(rows, requires_grad=False)
            param.__dict__.update(meta.__dict__)  # weight_loader and the method's attributes
            # (ModelOpt's parameters keep their loader behind a property: copied as an attribute)
            loader = getattr(meta, "weight_loader", None)
            if loader is not None:
                if fmt.quantized:
                    loader = checked_loader(loader, spec, self.layer_id, fmt.label)
                if getattr(fmt, "per_tensor", False) and spec.name.endswith("_scale"):
                    from sglang.srt.layers.moe.fused_moe_triton import (
                        FusedMoeWeightScaleSupported,
                    )

                    # one scale per projection, written on each of its rows
                    param.quant_method = FusedMoeWeightScaleSupported.CHANNEL.value
                    loader = per_tensor_scale_loader(loader, spec, self.layer_id)
                if self.gate_up_interleaved:
                    loader = deinterleaving_loader(loader, spec, self.layer_id, num_experts)
                param.weight_loader = loader
            layer.register_parameter(spec.layer_param, param)

    def create_moe_runner(self, layer: torch.nn.Module, moe_runner_config):
        self.moe_runner_config = moe_runner_config

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Every weight of the model is loaded once the first layer gets here: check this
        layer's scales, then build the cache (once).

        Raises:
            ValueError: scales of this layer that the checkpoint did not have, by name.
        """
        from sglang.srt.layers.moe.expert_cache.loading import missing_scales

        missing = []
        for spec in self.cache.host.specs:
            if "_scale" in spec.name:
                rows = self.cache.host_rows(spec.name, self.layer_id)
                missing += missing_scales(rows, spec, self.layer_id, fused=self.gate_up_interleaved)
        if missing:
            more = f" and {len(missing) - 4} more" if len(missing) > 4 else ""
            scales = {
                "nvfp4": "weight_scale and weight_scale_2",
                "mxfp4": "e8m0 scales (gate_up_proj_scales, down_proj_scales)",
                "ct-fp8-channel": "weight_scale (float32 [N, 1], one per output channel)",
                "ct-fp8-block": "weight_scale (float32, one per 128 x 128 block)",
                "ct-fp8-tensor": "weight_scale (float32 [1], one per projection)",
            }.get(self.label, "weight_scale_inv")
            raise ValueError(
                f"{self.label} checkpoint without {', '.join(missing[:4])}{more}: every "
                f"{self.label} expert weight needs its {scales} (re-export the checkpoint)"
            )
        self.cache.finalize()

    def apply(self, layer: torch.nn.Module, dispatch_output):
        from sglang.srt.layers.moe.token_dispatcher import StandardCombineInput
        from sglang.srt.layers.moe.topk import apply_topk_weights_cpu

        topk_weights, topk_ids, _ = dispatch_output.topk_output
        x = dispatch_output.hidden_states
        if self.moe_runner_config.apply_router_weight_on_input:  # Llama 4, top-1 (make_for_layer)
            # the expert runs on w * x with weight 1, as upstream's CPU and XPU paths do
            # (topk.apply_topk_weights_cpu); elementwise, so no host sync on CUDA
            x, topk_weights = apply_topk_weights_cpu(True, topk_weights, x)
        out = self.cache.forward(
            self.layer_id,
            x,
            topk_weights,
            topk_ids,
            self.moe_runner_config,
            scale=output_scale(layer, self.moe_runner_config, self.device),
        )
        return StandardCombineInput(hidden_states=out)


def output_scale(layer, moe_runner_config, device: torch.device) -> Optional[float]:
    """The factor the cache multiplies its routed sum by: ``routed_scaling_factor`` exactly
    where upstream 0.5.23's stock bf16 path for ``device`` puts it inside the MoE layer, else
    None (the model applies it, or the router weights already carry it).

    * CPU: none of ``UnquantizedFusedMoEMethod.forward_cpu``'s kernels (``fused_experts_cpu``,
      ``moe_forward_native``, our executor of patch 0032) scales; the models multiply the
      layer's bf16 output afterwards (``models/glm4_moe.py:619-620``
      ``if not _is_cuda and not _use_aiter: final_hidden_states *= self.routed_scaling_factor``,
      likewise ``models/deepseek_v2.py:1239``). So: None.
    * CUDA: the Triton runner scales in its combine, ``out = bf16(factor * sum_k w_k * y_k)``
      (``moe_combine_topk``, ``moe_runner/triton_utils/fused_moe.py:973``), and the model
      does not; unless the router already folded the factor into the weights
      (``FusedMoE.should_fuse_routed_scaling_factor_in_topk`` from
      ``_fuses_routed_scaling_factor_in_topk``, ``fused_moe_triton/layer.py:109``; the model
      passes it to ``TopK`` as ``apply_routed_scaling_factor_on_output``). So: the
      factor, or None when fused in top-k.

    Args:
        layer: the ``FusedMoE`` layer (reads ``should_fuse_routed_scaling_factor_in_topk``).
        moe_runner_config: its ``MoeRunnerConfig`` (``routed_scaling_factor``, None or float).
        device: the cache's device.
    """
    factor = getattr(moe_runner_config, "routed_scaling_factor", None)
    if factor is None or factor == 1.0 or device.type != "cuda":
        return None
    if getattr(layer, "should_fuse_routed_scaling_factor_in_topk", False):
        return None
    return float(factor)


def shared_experts_fusion_disable_reason() -> Optional[str]:
    """Why the model must not fuse its shared experts into the routed ``FusedMoE``, or None.

    Called by patch ``0034-expert-cache-unfused-shared-experts`` from upstream's
    ``resolve_shared_experts_config`` (``layers/moe/utils.py``) before the model is built,
    ahead of the model's own reason; upstream logs it with "Shared experts fusion optimization
    is disabled." A fused shared expert would be one more routed expert of every token, kept in
    the host pool and competing for slots; unfused it stays a resident dense MLP beside the
    cache (it runs for every token, so it gains nothing from a cache).
    """
    from sglang.srt.runtime_context import get_exec

    moe = get_exec().moe
    if not getattr(moe, "enable_expert_cache", False):
        return None
    if getattr(moe, "enforce_shared_experts_fusion", False):
        return None  # make_for_layer then names the conflict
    return (
        "--enable-expert-cache runs shared experts unfused, as a resident MLP beside the "
        "expert-slot cache."
    )


# upstream paged_experts.formats label -> ours, for the formats the host pool holds.
SUPPORTED_FORMATS = {
    "unquantized (bf16/fp16)": "bf16",
    "block-quantized FP8": "fp8-block",
    "ModelOpt NVFP4": "nvfp4",
    "MXFP4": "mxfp4",
    # per-channel or block by the scheme's weight strategy (expert_format_of)
    "compressed-tensors FP8 (per-channel or block, dynamic activations)": "ct-fp8",
}
# ours beyond upstream's paged formats (which refuse per-tensor compressed-tensors FP8: its
# scales are requantized after loading); found by expert_format_of
EXTRA_FORMATS = ("ct-fp8-tensor",)


def quant_format_of_label(label: str):
    """The ``formats.py`` format whose banks experts of our ``label`` have, for the formats
    whose banks follow from H and I rather than from the layer's parameters: ``nvfp4``
    (``formats.NVFP4``), ``mxfp4`` (``formats.MXFP4_BIASED``: gpt-oss's experts with their
    biases), ``ct-fp8-channel`` / ``ct-fp8-block`` (``formats.CT_FP8_CHANNEL`` /
    ``CT_FP8_BLOCK``, ``ct-fp8-tensor``: ``CT_FP8_TENSOR``: compressed-tensors FP8, scales
    ``w*_weight_scale``); None for the others
    (bf16, fp8-block: :func:`banks.format_from_layer`)."""
    from sglang.srt.layers.moe.expert_cache import formats

    return {
        "nvfp4": formats.NVFP4,
        "mxfp4": formats.MXFP4_BIASED,
        "ct-fp8-channel": formats.CT_FP8_CHANNEL,
        "ct-fp8-block": formats.CT_FP8_BLOCK,
        "ct-fp8-tensor": formats.CT_FP8_TENSOR,
    }.get(label)


def _materialize_other_params(layer, fmt, hidden_size: int, intermediate_size: int) -> None:
    """Give the layer's parameters that are not banks (ModelOpt's ``w13_input_scale`` [E, 2]
    and ``w2_input_scale`` [E], sized for all experts) real host storage in place of the meta
    tensors ``create_weights`` made, filled with 1.0 (upstream's default for an input scale the
    checkpoint lacks). The cache never reads them: its experts run weight-only on bf16
    activations."""
    banks = {s.layer_param for s in fmt.banks(hidden_size, intermediate_size)}
    for name, meta in list(layer.named_parameters(recurse=False)):
        if name in banks or meta.device.type != "meta":
            continue
        param = torch.nn.Parameter(
            torch.ones(meta.shape, dtype=meta.dtype, device="cpu"), requires_grad=False
        )
        param.__dict__.update(meta.__dict__)
        if getattr(meta, "weight_loader", None) is not None:  # behind a property on ModelOpt's
            param.weight_loader = meta.weight_loader
        layer.register_parameter(name, param)


def expert_format_of(base_method, layer=None):
    """``(label, weight_block_size)`` of the experts ``base_method`` creates, as upstream's
    paged experts classifies methods (``paged_experts.formats.format_for``): ``("bf16",
    None)``, ``("fp8-block", (128, 128))`` (the checkpoint's ``weight_block_size``) or
    ``("nvfp4", None)`` (ModelOpt NVFP4, groups of 16 along K) or ``("mxfp4", None)``
    (``Mxfp4MoEMethod``, e8m0 scales per 32 along K), ``("ct-fp8-channel", None)`` or
    ``("ct-fp8-block", (128, 128))`` (``CompressedTensorsW8A8Fp8MoE``, the scheme on
    ``layer``, with dynamic activations: per output channel or per 128 x 128 block) or
    ``("ct-fp8-tensor", None)`` (the scheme per tensor, static or dynamic activations:
    llm-compressor's "FP8"; upstream's paged experts refuses it).

    Raises:
        ValueError: a format the host pool does not hold; names it and the supported list.
    """
    from sglang.srt.layers.moe.paged_experts.formats import format_for

    fmt = format_for(layer, base_method)
    if fmt is None and _ct_fp8_per_tensor(layer):
        return "ct-fp8-tensor", None
    upstream = fmt.label if fmt is not None else "these"
    label = SUPPORTED_FORMATS.get(upstream)
    if label is None:
        raise ValueError(
            f"{upstream} ({type(base_method).__name__}) experts are not supported yet: serve "
            "the bf16 checkpoint or drop --enable-expert-cache (the host pool holds "
            f"{', '.join((*SUPPORTED_FORMATS.values(), *EXTRA_FORMATS))} experts)"
        )
    if label in ("bf16", "nvfp4", "mxfp4"):
        return label, None
    if label == "ct-fp8":
        return _ct_fp8_label(layer.scheme)
    return label, tuple(base_method.quant_config.weight_block_size)


def _ct_fp8_per_tensor(layer) -> bool:
    """``layer`` carries a per-tensor ``CompressedTensorsW8A8Fp8MoE`` (weights and activations
    ``strategy: tensor``), which upstream's ``format_for`` does not describe."""
    from compressed_tensors.quantization import QuantizationStrategy

    from sglang.srt.layers.quantization.compressed_tensors.schemes.compressed_tensors_w8a8_fp8_moe import (
        CompressedTensorsW8A8Fp8MoE,
    )

    scheme = getattr(layer, "scheme", None)
    return (
        type(scheme) is CompressedTensorsW8A8Fp8MoE
        and scheme.weight_quant.strategy == QuantizationStrategy.TENSOR
    )


def _ct_fp8_label(scheme):
    """``(label, weight_block_size)`` of a ``CompressedTensorsW8A8Fp8MoE`` scheme (upstream's
    format_for has already checked its strategy is channel or block and its activations
    dynamic).

    Raises:
        ValueError: a block other than 128 x 128 (the executor's fp8 block).
    """
    from compressed_tensors.quantization import QuantizationStrategy

    if scheme.weight_quant.strategy == QuantizationStrategy.CHANNEL:
        return "ct-fp8-channel", None
    block = tuple(scheme.weight_block_size)
    if block != (128, 128):
        raise ValueError(
            f"compressed-tensors FP8 experts with block_structure {list(block)} are not "
            "supported yet (the host pool holds per-channel and 128 x 128 block scales)"
        )
    return "ct-fp8-block", block


def make_for_layer(layer, base_method) -> ExpertCacheMoEMethod:
    """The expert-cache method for ``layer`` (a ``FusedMoE``), replacing ``base_method``.

    Raises:
        RuntimeError: the server or layer configuration is outside what the cache supports;
            the message lists every problem and what to change.
    """
    from sglang.srt.layers.moe.expert_cache.config import ExpertCacheConfig
    from sglang.srt.runtime_context import (
        get_device,
        get_exec,
        get_parallel,
        process_model_config,
    )

    moe = get_exec().moe
    problems = []
    parallel = get_parallel()
    for name in ("tp_size", "ep_size", "pp_size", "dp_size"):
        if getattr(parallel, name, 1) > 1:
            problems.append(f"--{name.replace('_', '-')} must be 1 (one device only)")
    if getattr(moe, "enable_paged_experts", False):
        problems.append(
            "--enable-paged-experts and --enable-expert-cache exclude each other (drop one)"
        )
    try:
        label, _ = expert_format_of(base_method, layer)
    except (ValueError, RuntimeError) as e:
        problems.append(str(e))
        label = None
    if label in ("nvfp4", "mxfp4", "ct-fp8-channel", "ct-fp8-block", "ct-fp8-tensor") and (
        get_device().device != "cpu"
    ):
        shown = label.upper() if label in ("nvfp4", "mxfp4") else label
        problems.append(
            f"{shown} experts in GPU slots are not supported yet (no slot-indexed "
            f"{shown} kernel): serve them on the CPU (--device cpu) or drop "
            "--enable-expert-cache"
        )
    cfg = layer.moe_runner_config
    quantized = ("fp8-block", "nvfp4", "mxfp4", "ct-fp8-channel", "ct-fp8-block", "ct-fp8-tensor")
    if label in quantized and cfg.params_dtype not in (None, torch.bfloat16):
        problems.append(
            f"{label} experts run on bf16 activations, but the model runs in "
            f"{str(cfg.params_dtype).removeprefix('torch.')}: serve it with --dtype bfloat16 "
            "(or drop --enable-expert-cache)"
        )
    try:
        activation = expert_activation(cfg)
    except ValueError as e:
        problems.append(str(e))
        activation = None
    if activation not in (None, ("silu", None, None)) and get_device().device != "cpu":
        problems.append(
            f"{activation[0]} experts in GPU slots are not supported yet (the slot-table fused "
            "MoE runs plain SiLU): serve them on the CPU (--device cpu) or drop "
            "--enable-expert-cache"
        )
    # Upstream's MXFP4 layers read w13 with gate / up interleaved unless the config says
    # otherwise (``gate_up_interleaved``, default True: gpt-oss); other methods in halves.
    interleaved = label == "mxfp4" and bool(getattr(cfg, "gate_up_interleaved", True))
    top_k = getattr(layer, "top_k", None)
    if top_k is None:  # FusedMoE built without it (Llama 4): the model's
        top_k = process_model_config().hf_text_config.num_experts_per_tok
    if cfg.apply_router_weight_on_input and top_k != 1:
        problems.append(
            "router weights applied on the input are supported with top-1 routing only (Llama "
            f"4's; got top-k {top_k}); serve this model without --enable-expert-cache"
        )
    if getattr(layer, "num_fused_shared_experts", 0):
        problems.append(
            "fused shared experts are not supported: drop --enforce-shared-experts-fusion "
            "(the cache runs shared experts unfused)"
        )
    try:
        config = ExpertCacheConfig.from_server_args(moe)
    except ValueError as e:
        problems.append(str(e))
        config = None
    if problems:
        raise RuntimeError("--enable-expert-cache: " + "; ".join(problems))
    text_config = process_model_config().hf_text_config
    return ExpertCacheMoEMethod(
        base_method=base_method,
        config=config,
        layer_id=layer.layer_id,
        top_k=top_k,
        num_layers=text_config.num_hidden_layers,
        device=torch.device(get_device().device),
        activation=activation,
        gate_up_interleaved=interleaved,
        layer=layer,
    )


def expert_activation(cfg) -> Tuple[str, Optional[float], Optional[float]]:
    """The CPU executor's ``(activation, alpha, limit)`` for a layer's ``MoeRunnerConfig``:
    ``silu`` gated with ``gemm1_alpha`` and ``gemm1_clamp_limit`` is gpt-oss's clamped SwiGLU,
    as upstream's CPU path reads it (``moe_forward_native`` -> ``swiglu_gpt_oss_sigmoid_alpha``;
    the executor's ``swiglu_oai``: ``(clamp(u, -limit, limit) + 1) * g' * sigmoid(alpha * g')``,
    ``g' = min(g, limit)``); ``silu`` with ``swiglu_limit`` the clamped SiLU of upstream's
    fused MoE (``swiglu_limit_func``; the executor's ``swiglu_limit``; ``moe_forward_native``
    ignores it); plain gated ``silu`` the default; gated ``gelu`` (Gemma 4's experts,
    ``gelu_pytorch_tanh``) the executor's ``gelu_tanh``, as upstream's CPU and torch paths
    compute it (``moe_forward_native`` -> ``GeluAndMul()``, whose default is ``tanh``).

    Raises:
        ValueError: an activation the executor does not compute (another activation, not
            gated, ``gemm1_beta``, an alpha without a clamp limit); says what to do.
    """
    what = "serve this model without --enable-expert-cache"
    if cfg.activation not in ("silu", "gelu") or not cfg.is_gated:
        raise ValueError(
            f"only gated SiLU and GELU experts are supported (got {cfg.activation}, gated="
            f"{cfg.is_gated}; plain SiLU, gpt-oss's clamped SwiGLU, the clamped SiLU or the tanh "
            f"GELU); {what}"
        )
    if cfg.activation == "gelu":
        extras = [
            f
            for f in ("gemm1_alpha", "gemm1_clamp_limit", "swiglu_limit", "gemm1_beta")
            if getattr(cfg, f, None) is not None
        ]
        if extras:
            raise ValueError(f"GELU experts with {', '.join(extras)} are not supported; {what}")
        return "gelu_tanh", None, None
    alpha = getattr(cfg, "gemm1_alpha", None)
    clamp = getattr(cfg, "gemm1_clamp_limit", None)
    limit = getattr(cfg, "swiglu_limit", None)
    if getattr(cfg, "gemm1_beta", None) is not None:
        raise ValueError(f"experts with gemm1_beta are not supported; {what}")
    if alpha is not None:
        if clamp is None or limit is not None:
            raise ValueError(
                f"gemm1_alpha {alpha} needs gemm1_clamp_limit (gpt-oss's clamped SwiGLU) and no "
                f"swiglu_limit (got clamp {clamp}, swiglu_limit {limit}); {what}"
            )
        return "swiglu_oai", float(alpha), float(clamp)
    if clamp is not None:
        raise ValueError(f"gemm1_clamp_limit {clamp} without gemm1_alpha is not supported; {what}")
    if limit is not None:
        return "swiglu_limit", None, float(limit)
    return "silu", None, None
