"""The expert cache's layer call on CUDA: slot experts on the device, CPU experts beside them.

After the control step (:mod:`control`) a layer call's routed entries are split into slot
entries, computed on the device by upstream's Triton fused MoE over the slot table
(:func:`slot_experts`), and CPU entries, computed by the CPU executor from the host pool.
:class:`CudaForward` runs the two in parallel and adds the partial sums (FreeToken §3.2, §4
"Graph-resident CPU execution"); the fills are copied after the CPU branch has started, so that
the copy overlaps the CPU work, the premise of the q* split.

* Batches of at most :func:`stream_branch_tokens` tokens (decode): the CPU branch is stream work
  on a side stream, copy + host function + copy (``moe_experts_cpu_enqueue``), forked before and
  joined after the slot experts. Designed without a host sync, so that a CUDA graph captures it
  (not yet run on a GPU: ``scripts/gpu_checks.sh`` runs ``test_cuda_cache.py``, which captures it).
* Larger batches (prefill chunks): the CPU ids are handed over with one sync, the executor is
  submitted, the device computes meanwhile, then the sum.

The check that the CUDA kernels exist and fit the model, :func:`check_cuda_support`, runs when
the cache is sized, not at the first forward.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from typing import Callable, Mapping, Optional, Sequence

import torch

from sglang.srt.layers.moe.expert_cache.banks import ExpertBanks
from sglang.srt.layers.moe.expert_cache.control import (
    CUDA_MAX_EXPERTS,
    CUDA_MAX_FILL,
    FillList,
    Routing,
)
from sglang.srt.layers.moe.expert_cache.executor_args import submit_experts_cpu

logger = logging.getLogger(__name__)

# Batches up to this many tokens run their CPU branch as stream work (copy + host function +
# copy, capturable in a CUDA graph); page-locked staging costs tokens * (6 * H + 8 * K) bytes.
STREAM_BRANCH_MIN_TOKENS = 512
STREAM_TOKENS_ENV = "SGLANG_EXPERT_CACHE_STREAM_TOKENS"


def stream_branch_tokens() -> int:
    """Rows of the CPU branch's staging: ``$SGLANG_EXPERT_CACHE_STREAM_TOKENS`` if set, else the
    largest of 512 and the decode CUDA-graph batch size times the speculative draft tokens
    (every batch a graph may capture)."""
    env = os.environ.get(STREAM_TOKENS_ENV)
    if env:
        return max(1, int(env))
    n = STREAM_BRANCH_MIN_TOKENS
    try:
        from sglang.srt.runtime_context import get_server_args

        args = get_server_args()
        bs = max(
            getattr(args, f, None) or 0 for f in ("cuda_graph_max_bs", "cuda_graph_max_bs_decode")
        )
        n = max(n, bs * max(1, getattr(args, "speculative_num_draft_tokens", None) or 1))
    except Exception:  # no server (tests, benchmarks)
        pass
    return n


def check_cuda_support(num_experts: int, max_fills: int, explicit_max_fills: Optional[int]) -> int:
    """The CUDA control kernel's presence and limits (``csrc/shared/expert_cache.h``), checked at
    startup. Returns the fill-list capacity to use: ``max_fills`` capped at the kernel's.

    Args:
        num_experts: routed experts per MoE layer (E).
        max_fills: the wanted fill-list capacity (F).
        explicit_max_fills: ``--expert-cache-max-fills`` when given (then a cap is an error).

    Raises:
        RuntimeError: the CUDA kernels were not built.
        ValueError: more routed experts per layer than the kernel handles, or an explicit
            ``--expert-cache-max-fills`` above its fill-list capacity.
    """
    if not torch._C._dispatch_has_kernel_for_dispatch_key(
        "sgl_kernel::expert_cache_control", "CUDA"
    ):
        raise RuntimeError(
            "--enable-expert-cache on CUDA needs sgl_kernel_fork built with its CUDA kernels "
            "(sgl_kernel_fork._C_cuda); rerun `make setup` on this machine with the CUDA "
            "toolkit (nvcc) installed"
        )
    if num_experts > CUDA_MAX_EXPERTS:
        raise ValueError(
            f"--enable-expert-cache on CUDA handles at most {CUDA_MAX_EXPERTS} routed experts "
            f"per layer; this model has {num_experts}. Serve it without the expert cache"
        )
    if max_fills <= CUDA_MAX_FILL:
        return max_fills
    if explicit_max_fills:
        raise ValueError(
            f"--expert-cache-max-fills {explicit_max_fills} is above the CUDA kernel's "
            f"fill-list capacity; give at most {CUDA_MAX_FILL}"
        )
    logger.info(
        "Expert cache: at most %d fills per layer call on CUDA (2 x top-k would be %d)",
        CUDA_MAX_FILL,
        max_fills,
    )
    return CUDA_MAX_FILL


def slot_experts(
    slots: Mapping[str, torch.Tensor],
    x: torch.Tensor,
    weights: torch.Tensor,
    slot_ids: torch.Tensor,
    moe_runner_config,
    block_shape: Optional[Sequence[int]] = None,
) -> torch.Tensor:
    """The device partial sum of the entries served from slots (hits and fills).

    Args:
        slots: the slot banks ``w13`` [S, 2I, H] and ``w2`` [S, H, I]; block FP8 adds
            ``w13_scale`` [S, ceil(2I/bn), ceil(H/bk)] and ``w2_scale`` [S, ceil(H/bn),
            ceil(I/bk)] float32, and the experts run as upstream's ``Fp8MoEMethod`` runs them
            on Triton (``get_triton_quant_info``: ``use_fp8_w8a8``, per-token-group dynamic
            activation scales, ``block_shape``).
        x: [T, H] activations (bf16).
        weights: [T, K] float32 router weights.
        slot_ids: [T, K] int32 slot of each entry, -1 for CPU entries and padding.
        moe_runner_config: the layer's ``MoeRunnerConfig``.
        block_shape: [bn, bk] of one scale of a block-FP8 format (required with scale banks).

    Returns:
        [T, H] in ``x.dtype``: ``sum_k weights[t, k] * expert_{slot_ids[t, k]}(x[t])`` over the
        slot entries; ``x`` is not written (upstream's ``inplace=True`` is overridden), and the
        runner's ``routed_scaling_factor`` is not applied (the caller scales the whole sum,
        slot and CPU parts, once: :meth:`CudaForward.forward`).
    """
    from sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe import fused_experts
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    num_slots = slots["w13"].shape[0]
    if num_slots == 0:
        return torch.zeros_like(x)
    quant = {}
    if "w13_scale" in slots:
        if block_shape is None:
            raise ValueError("slot_experts: scale banks without a block_shape")
        quant = dict(
            use_fp8_w8a8=True,
            w1_scale=slots["w13_scale"],
            w2_scale=slots["w2_scale"],
            block_shape=list(block_shape),
        )
    return fused_experts(
        x,
        slots["w13"],
        slots["w2"],
        StandardTopKOutput(
            topk_weights=weights.masked_fill(slot_ids < 0, 0.0),
            topk_ids=slot_ids,
            router_logits=None,
        ),
        replace(
            moe_runner_config,
            num_experts=None,  # makes the runner skip -1 (CPU / padding) entries
            num_local_experts=num_slots,
            inplace=False,
            no_combine=False,
            routed_scaling_factor=None,  # a partial sum: scaled with the CPU part by the caller
        ),
        **quant,
    )


class CudaForward:
    """The CUDA layer call of one cache: its CPU branch's plan (page-locked staging made at
    startup, before any graph capture) and side stream.

    Args:
        host: the (pinned) host pool; its ``w13`` / ``w2`` banks are the CPU executor's.
        top_k: experts per token (K).
        device: the CUDA device.
    """

    def __init__(self, host: ExpertBanks, top_k: int, device: torch.device):
        from sgl_kernel_fork.cpu_executor import CpuBranchPlan

        self.host = host
        self.block_shape = host.format.weight_block_size
        scales = {}
        if "w13_scale" in host.tensors:  # block FP8 (executor_args.executor_kwargs' rule)
            scales = dict(format="fp8", w13_scale=host["w13_scale"], w2_scale=host["w2_scale"])
        self.plan = CpuBranchPlan(stream_branch_tokens(), top_k, host["w13"], host["w2"], **scales)
        self.side = torch.cuda.Stream(device=device)
        self.device = device

    def forward(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        routing: Routing,
        fill: Callable[[FillList], None],
        slots: Mapping[str, torch.Tensor],
        moe_runner_config,
        scale: Optional[float] = None,
    ) -> torch.Tensor:
        """One layer call after its control step.

        Args:
            x: [T, H] bf16 on the device; weights: [T, K] float32.
            routing: the control step's result; its fills are copied by ``fill`` here.
            fill: copies a work list host pool -> slots (``ExpertSlotCache.fill``).
            slots: the slot banks.
            scale: the routed scaling factor, applied to the fp32 sum of both partials before
                the one rounding to ``x.dtype``, as upstream's Triton combine scales its fp32
                sum (``moe_combine_topk``); None = 1.

        Returns:
            [T, H] in ``x.dtype``: scale * (slot partial + CPU partial).

        Raises:
            RuntimeError: a CUDA graph captures more tokens than the staging holds.
        """
        T, H = x.shape
        plan = self.plan
        if T > plan.max_tokens and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"expert cache: a CUDA graph captures a batch of {T} tokens, more than the "
                f"{plan.max_tokens} rows of the CPU branch's staging; set "
                f"{STREAM_TOKENS_ENV}={T} (or lower the captured batch sizes)"
            )
        if T <= plan.max_tokens:
            main = torch.cuda.current_stream(self.device)
            cpu_part = torch.empty(T, H, dtype=torch.float32, device=x.device)
            cpu_ids = routing.cpu_ids.contiguous()
            self.side.wait_stream(main)
            with torch.cuda.stream(self.side):
                plan.enqueue(x, weights, cpu_ids, cpu_part)
            # No record_stream: the join below orders every later use of these blocks on main
            # after the side stream's work (and record_stream would pin them for a whole capture).
            fill(routing.fills)
            device_part = slot_experts(
                slots, x, weights, routing.slot_ids, moe_runner_config, self.block_shape
            )
            main.wait_stream(self.side)
            return _combine(device_part, cpu_part, scale, x.dtype)

        ops = torch.ops.sgl_kernel
        x_host = x.to("cpu", non_blocking=True)
        w_host = weights.to("cpu", non_blocking=True)
        cpu_host = routing.cpu_ids.to("cpu", non_blocking=True)
        torch.cuda.current_stream().synchronize()
        out_host = torch.empty(T, H, dtype=torch.float32)
        handle = submit_experts_cpu(x_host, w_host, [cpu_host], [self.host], out_host)
        fill(routing.fills)
        device_part = slot_experts(
            slots, x, weights, routing.slot_ids, moe_runner_config, self.block_shape
        )
        ops.moe_experts_cpu_wait(handle)
        return _combine(device_part, out_host.to(x.device, non_blocking=True), scale, x.dtype)


def _combine(
    device_part: torch.Tensor, cpu_part: torch.Tensor, scale: Optional[float], dtype: torch.dtype
) -> torch.Tensor:
    """``dtype(scale * (device_part + cpu_part))``, summed and scaled in fp32 ([T, H] each)."""
    out = device_part.float() + cpu_part
    if scale is not None:
        out.mul_(scale)
    return out.to(dtype)
