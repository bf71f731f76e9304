"""Expert-cache control: thin wrappers over the ``torch.ops.sgl_kernel`` ops, and their
fixed-shape buffers.

FreeToken (paper §3.2, §4.1 "Device-side cache control") keeps one LRU pool of ``S`` GPU expert
slots shared by all MoE layers. Per MoE layer, one op call
(:func:`expert_cache_control`) deduplicates the routed experts, classifies them against the
residency tables, sizes the fill set ``q`` from Eq. 4 (``q* = m * B_P / B_H``), picks LRU
victims in one pass, updates the tables and rewrites the routed ids into GPU slot ids or CPU
ids; one fused launch (:func:`expert_bank_copy`) then copies the filled experts' rows of every
weight bank. Everything stays on the device: outputs have fixed shapes, the valid counts are
device tensors, nothing synchronizes with the host, so both ops can be captured in a CUDA
graph.

The exact semantics (steps 1-9) are the docstring of :mod:`reference` beside this module
(``ReferenceExpertCache``). The ops run on CPU tensors (C++) and on CUDA tensors (CUDA kernel,
when ``sgl_kernel_fork`` was built with CUDA); both implement the same steps.

This module imports only torch and ``sgl_kernel_fork`` (which registers the ops).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

import torch

import sgl_kernel_fork  # noqa: F401  (registers torch.ops.sgl_kernel.expert_cache_*)

POLICY_QSTAR = 0  # fill q* = clamp(round(m * fill_ratio), 1, m) of the m misses (Eq. 4)
POLICY_FILL = 1  # fill every miss (up to F and the free capacity): on-demand LRU cache
POLICY_CPU = 2  # never fill: static cache, every miss runs on the CPU
POLICIES = {"qstar": POLICY_QSTAR, "fill": POLICY_FILL, "cpu": POLICY_CPU}

# Limits of the CUDA kernel (checked on the host, without a device sync). The CPU op has none
# beyond int32 ids.
CUDA_MAX_EXPERTS = 4096  # experts per layer (E)
CUDA_MAX_FILL = 32  # F, the fill-list capacity per call


def _policy(policy: Union[int, str]) -> int:
    if isinstance(policy, str):
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; expected one of {sorted(POLICIES)}")
        return POLICIES[policy]
    return int(policy)


@dataclass(frozen=True)
class ExpertCacheTables:
    """The four slot tables of one expert cache (all layers share the slot pool).

    ``slot_of_id[L*E]`` int32 (slot or -1), ``id_of_slot[S]`` int32 (global id ``layer*E +
    expert`` or -1), ``slot_last_use[S]`` int64 (clock value of the last use, -1 = never),
    ``clock[1]`` int64. Updated in place by :func:`expert_cache_control`.
    """

    slot_of_id: torch.Tensor
    id_of_slot: torch.Tensor
    slot_last_use: torch.Tensor
    clock: torch.Tensor

    @staticmethod
    def allocate(
        num_layers: int, num_experts: int, num_slots: int, device: Union[str, torch.device] = "cpu"
    ) -> "ExpertCacheTables":
        """Empty cache: every slot empty and never used, clock 0."""
        if num_layers * num_experts >= 2**31:
            raise ValueError("L * E must fit in int32")
        i32 = dict(dtype=torch.int32, device=device)
        i64 = dict(dtype=torch.int64, device=device)
        return ExpertCacheTables(
            slot_of_id=torch.full((num_layers * num_experts,), -1, **i32),
            id_of_slot=torch.full((num_slots,), -1, **i32),
            slot_last_use=torch.full((num_slots,), -1, **i64),
            clock=torch.zeros(1, **i64),
        )


@dataclass(frozen=True)
class ControlBuffers:
    """Fixed-shape outputs of :func:`expert_cache_control` for batches of up to ``max_tokens``.

    ``slot_ids``/``cpu_ids``: ``[max_tokens, top_k]`` int32 (a batch of ``T`` tokens uses the
    contiguous prefix ``[:T]``, see :meth:`rows`); ``fill_src``/``fill_dst``: ``[num_fill]``
    int32 (``F``, the most fills per call); ``counts``: ``[4]`` int32 of the last call;
    ``stats``: ``[4]`` int64, cumulative over the calls that used these buffers.
    """

    slot_ids: torch.Tensor
    cpu_ids: torch.Tensor
    fill_src: torch.Tensor
    fill_dst: torch.Tensor
    counts: torch.Tensor
    stats: torch.Tensor

    @staticmethod
    def allocate(
        max_tokens: int, top_k: int, num_fill: int, device: Union[str, torch.device] = "cpu"
    ) -> "ControlBuffers":
        if max_tokens < 0 or top_k < 0 or num_fill < 0:
            raise ValueError("max_tokens, top_k and num_fill must be >= 0")
        i32 = dict(dtype=torch.int32, device=device)
        return ControlBuffers(
            slot_ids=torch.full((max_tokens, top_k), -1, **i32),
            cpu_ids=torch.full((max_tokens, top_k), -1, **i32),
            fill_src=torch.full((num_fill,), -1, **i32),
            fill_dst=torch.full((num_fill,), -1, **i32),
            counts=torch.zeros(4, **i32),
            stats=torch.zeros(4, dtype=torch.int64, device=device),
        )

    @property
    def num_fill(self) -> int:
        return self.fill_src.numel()

    def rows(self, num_tokens: int) -> "ControlBuffers":
        """Views for a batch of ``num_tokens`` tokens (same storage; stats shared)."""
        if not 0 <= num_tokens <= self.slot_ids.shape[0]:
            raise ValueError(f"num_tokens {num_tokens} outside [0, {self.slot_ids.shape[0]}]")
        return ControlBuffers(
            self.slot_ids[:num_tokens],
            self.cpu_ids[:num_tokens],
            self.fill_src,
            self.fill_dst,
            self.counts,
            self.stats,
        )


def expert_cache_control(
    topk_ids: torch.Tensor,
    layer: int,
    num_experts: int,
    tables: ExpertCacheTables,
    out: ControlBuffers,
    fill_ratio: float,
    policy: Union[int, str] = POLICY_QSTAR,
) -> None:
    """One MoE layer's cache step: ``torch.ops.sgl_kernel.expert_cache_control``.

    Args:
        topk_ids: ``[T, K]`` int32, contiguous: layer-local routed expert ids in ``[0, E)``,
            -1 = padding.
        layer: MoE layer index; global ids are ``layer * num_experts + expert``.
        num_experts: ``E``, routed experts per layer.
        tables: the cache tables (updated in place; same device as ``topk_ids``).
        out: buffers with ``out.slot_ids``/``out.cpu_ids`` of ``topk_ids``' shape (use
            ``ControlBuffers.rows(T)``). Written: ``slot_ids[t, k]`` = GPU slot of a
            device-executed entry else -1; ``cpu_ids[t, k]`` = global id of a CPU-executed entry
            else -1; ``fill_src[:q]``/``fill_dst[:q]`` = global ids to copy from the host pool
            into slots (the rest -1); ``counts`` = ``[q, m - q, hits, m]`` (fills, CPU-executed
            distinct experts, distinct hits, distinct misses); ``stats += [hits, m, q, m - q]``.
        fill_ratio: ``B_P / B_H`` (pinned transfer bandwidth over host expert-processing
            bandwidth, both in the same unit, e.g. GB/s), >= 0 and finite. Used by ``qstar``:
            ``q = clamp(floor(m * fill_ratio + 0.5), 1, m)`` for ``m > 0`` (paper Eq. 4).
        policy: ``"qstar"``/0, ``"fill"``/1 (every miss filled) or ``"cpu"``/2 (none filled).
            In all policies ``q <= F`` and ``q <=`` the slots not hit in this call.

    Errors (RuntimeError, raised before any state changes): wrong dtype, device, shape or
    contiguity; ``layer``/``num_experts`` outside ``slot_of_id``; bad policy or ratio; on CPU a
    routed id outside ``[-1, E)``. On CUDA such ids count as padding (the kernel cannot raise
    without a host sync), and ``E > CUDA_MAX_EXPERTS`` or ``F > CUDA_MAX_FILL`` are errors. On
    CPU a corrupt table entry (slot or id out of range) raises with the state unspecified; the
    CUDA kernel does not detect it (an out-of-range slot counts as a miss, writes through an
    out-of-range id are skipped).

    Cost: linear in ``T * K`` and in ``S`` (one pass over ``slot_last_use``, skipped when
    ``q == 0``); the CUDA kernel is one block of 512 threads, so it is sized for decode batches
    rather than large prefill batches.
    """
    torch.ops.sgl_kernel.expert_cache_control(
        topk_ids,
        layer,
        num_experts,
        tables.slot_of_id,
        tables.id_of_slot,
        tables.slot_last_use,
        tables.clock,
        out.slot_ids,
        out.cpu_ids,
        out.fill_src,
        out.fill_dst,
        out.counts,
        out.stats,
        float(fill_ratio),
        _policy(policy),
    )


def expert_bank_copy(
    src_banks: Sequence[torch.Tensor],
    dst_banks: Sequence[torch.Tensor],
    fill_src: torch.Tensor,
    fill_dst: torch.Tensor,
    counts: torch.Tensor,
) -> None:
    """Copy the filled experts into their slots: ``torch.ops.sgl_kernel.expert_bank_copy``.

    For ``i < counts[0]`` and every bank ``b``: ``dst_banks[b][fill_dst[i]] =
    src_banks[b][fill_src[i]]`` (rows along the leading dimension; paper §4.1/§4.2: every bank
    shares the expert-to-slot mapping, so one index list drives all banks).

    Args:
        src_banks: host expert pool, one tensor per bank, ``[L*E, ...]``, contiguous. On CUDA
            they must be pinned CPU tensors (read by the kernel through their mapped device
            pointers) or CUDA tensors.
        dst_banks: slot banks, ``[S, ...]``, contiguous, same dtype and row shape as the
            matching source bank (banks may differ from one another in both).
        fill_src, fill_dst: ``[F]`` int32 (from :func:`expert_cache_control`).
        counts: int32, ``counts[0]`` = number of valid entries (the control op's ``counts``).

    The CPU op copies with memcpy in parallel over (fill, bank) and raises on indices out of
    range. The CUDA op is one launch, masked on the device by ``counts[0]`` (no host sync);
    out-of-range indices there are skipped.
    """
    torch.ops.sgl_kernel.expert_bank_copy(list(src_banks), list(dst_banks), fill_src, fill_dst, counts)
