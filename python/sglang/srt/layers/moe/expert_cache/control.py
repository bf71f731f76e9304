"""Typed wrappers of the expert-cache ops: the only way Python calls them.

FreeToken (paper §3.2, §4.1 "Device-side cache control") keeps one LRU pool of ``S`` device
expert slots shared by all MoE layers. Per MoE layer, one op call (:func:`expert_cache_control`)
deduplicates the routed experts, classifies them against the residency tables, sizes the fill
set ``q`` from Eq. 4 (``q* = m * B_P / B_H``), picks LRU victims in one pass, updates the tables
and rewrites the routed ids into slot ids or CPU ids; one fused launch
(:func:`expert_bank_copy`) then copies the filled experts' rows of every weight bank. Everything
stays on the device: outputs have fixed shapes, the valid counts are device tensors, nothing
synchronizes with the host, so both ops can be captured in a CUDA graph (the CUDA kernels'
design; not yet run on a GPU, see ``scripts/gpu_checks.sh``).

The exact semantics (steps 1-9) are the docstring of :mod:`reference` beside this module. The
ops run on CPU tensors (C++, ``sgl-kernel/csrc/cpu/expert_cache.cpp``) and on CUDA tensors
(``sgl-kernel/csrc/cuda/expert_cache.cu``, when ``sgl_kernel_fork`` was built with CUDA). The
enumerations :class:`MissPolicy` and :class:`Stat` are defined once, in
``sgl-kernel/csrc/shared/expert_cache.h``, and read from the op library at import.

This module imports only torch and ``sgl_kernel_fork`` (which registers the ops).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

import sgl_kernel_fork  # noqa: F401  (registers torch.ops.sgl_kernel.expert_cache_*)


class _OpEnum(enum.IntEnum):
    """An enumeration of ``csrc/shared/expert_cache.h``: members in value order, named as the
    header names them (upper case here)."""

    @classmethod
    def _from_op(cls, name: str, kind: str, what: str, doc: str):
        names = torch.ops.sgl_kernel.expert_cache_enum(kind)
        made = cls(name, [(n.upper(), i) for i, n in enumerate(names)], module=__name__)
        made.__doc__ = doc
        made._what = what  # how parse() errors name the value
        return made

    @classmethod
    def parse(cls, value: Union[int, str, "_OpEnum"]):
        """A member from itself, its value or its (case-insensitive) name.

        Raises:
            ValueError: no member has that name or value; the message lists the names.
        """
        if isinstance(value, str):
            try:
                return cls[value.upper()]
            except KeyError:
                pass
        elif isinstance(value, int) and not isinstance(value, bool):
            try:
                return cls(value)
            except ValueError:
                pass
        names = ", ".join(m.name.lower() for m in cls)
        raise ValueError(f"{cls._what} must be one of {names}; got {value!r}")


MissPolicy = _OpEnum._from_op(
    "MissPolicy",
    "miss_policy",
    "--expert-cache-policy",
    """What the per-layer control step does with the ``m`` misses of a layer call
    (``--expert-cache-policy``; the value is the op's ``policy`` argument).

    QSTAR: ``q = clamp(round(m * B_P / B_H), 1, m)`` fills (paper Eq. 4), the rest on the CPU.
    FILL: every miss filled (an on-demand LRU cache, as upstream's paged experts).
    CPU: no fill ever; the load-time placement stays and every miss runs on the CPU.
    """,
)

Stat = _OpEnum._from_op(
    "Stat",
    "stat",
    "an expert-cache counter",
    """Index of each counter in a call's ``counts`` (int32) and in the cumulative ``stats``
    (int64): FILLS (``q``), CPU_EXPERTS (``m - q``), HITS and MISSES (``m``), each counting
    distinct experts of one layer call. ``counts[FILLS]`` is also the fill list's valid length.
    """,
)

# Limits of the CUDA control kernel (``csrc/shared/expert_cache.h``): experts per layer (E) and
# the fill-list capacity per call (F), checked on the host at startup. The CPU op has none beyond
# int32 ids.
CUDA_MAX_EXPERTS, CUDA_MAX_FILL = torch.ops.sgl_kernel.expert_cache_cuda_limits()


@dataclass(frozen=True)
class ExpertCacheTables:
    """The state of one expert cache (all layers share the slot pool), updated in place by
    :func:`expert_cache_control`.

    ``slot_of_id[L*E]`` int32 (slot or -1), ``id_of_slot[S]`` int32 (global id ``layer*E +
    expert`` or -1), ``slot_last_use[S]`` int64 (clock value of the last use, -1 = never),
    ``clock[1]`` int64 (layer calls so far), ``stats[len(Stat)]`` int64 (running sums of the
    calls' counters, indexed by :class:`Stat`), ``live_slots[1]`` int32 (the slots in the
    cache, ``<= S``; the rest is the released tail of a shrunk pool: device data, so a captured
    graph stays valid across a resize; :mod:`reference` steps and ``resize``).
    """

    slot_of_id: torch.Tensor
    id_of_slot: torch.Tensor
    slot_last_use: torch.Tensor
    clock: torch.Tensor
    stats: torch.Tensor
    live_slots: torch.Tensor

    @staticmethod
    def allocate(
        num_layers: int, num_experts: int, num_slots: int, device: Union[str, torch.device] = "cpu"
    ) -> "ExpertCacheTables":
        """An empty cache: every slot empty and never used, clock and counters 0.

        Raises:
            ValueError: ``num_layers * num_experts`` does not fit in int32.
        """
        if num_layers * num_experts >= 2**31:
            raise ValueError("L * E must fit in int32")
        i32 = dict(dtype=torch.int32, device=device)
        i64 = dict(dtype=torch.int64, device=device)
        return ExpertCacheTables(
            slot_of_id=torch.full((num_layers * num_experts,), -1, **i32),
            id_of_slot=torch.full((num_slots,), -1, **i32),
            slot_last_use=torch.full((num_slots,), -1, **i64),
            clock=torch.zeros(1, **i64),
            stats=torch.zeros(len(Stat), **i64),
            live_slots=torch.full((1,), num_slots, **i32),
        )


@dataclass(frozen=True)
class FillList:
    """The fill work list of one control call: ``fill_src[F]`` / ``fill_dst[F]`` int32 (global id
    to copy from the host pool, slot to copy it into; -1 past the valid entries) and
    ``counts[len(Stat)]`` int32, the call's counters; ``counts[Stat.FILLS]`` valid entries.

    Fixed shapes on the device, so a CUDA graph can capture the calls that write and read it.
    """

    fill_src: torch.Tensor
    fill_dst: torch.Tensor
    counts: torch.Tensor

    @staticmethod
    def allocate(num_fill: int, device: Union[str, torch.device] = "cpu") -> "FillList":
        """Room for ``num_fill`` (``F``) fills, all entries -1 and counts 0.

        Raises:
            ValueError: ``num_fill < 0``.
        """
        if num_fill < 0:
            raise ValueError(f"num_fill must be >= 0, got {num_fill}")
        i32 = dict(dtype=torch.int32, device=device)
        return FillList(
            fill_src=torch.full((num_fill,), -1, **i32),
            fill_dst=torch.full((num_fill,), -1, **i32),
            counts=torch.zeros(len(Stat), **i32),
        )


@dataclass(frozen=True)
class Routing:
    """The result of one control call.

    ``slot_ids[T, K]`` int32: the slot of an entry executed on the device (a hit or a fill),
    else -1. ``cpu_ids[T, K]`` int32: the global id (a host-pool row) of an entry executed on the
    CPU, else -1. Padding is -1 in both; every routed entry is in exactly one. ``fills``: the
    call's work list, for :func:`expert_bank_copy`.
    """

    slot_ids: torch.Tensor
    cpu_ids: torch.Tensor
    fills: FillList


def expert_cache_control(
    topk_ids: torch.Tensor,
    layer: int,
    num_experts: int,
    tables: ExpertCacheTables,
    fills: FillList,
    fill_ratio: float,
    policy: Union[int, str] = 0,
    live_fill_ratio: Optional[torch.Tensor] = None,
) -> Routing:
    """One MoE layer's cache step: ``torch.ops.sgl_kernel.expert_cache_control``.

    Args:
        topk_ids: ``[T, K]`` int32, contiguous: layer-local routed expert ids in ``[0, E)``,
            -1 = padding.
        layer: MoE layer index; global ids are ``layer * num_experts + expert``.
        num_experts: ``E``, routed experts per layer.
        tables: the cache state, updated in place (same device as ``topk_ids``); its ``stats``
            gain this call's counters.
        fills: the work list to write (overwritten: ``fill_src[:q]`` / ``fill_dst[:q]`` = global
            ids to copy into slots, the rest -1; ``counts`` = this call's counters by
            :class:`Stat`). Returned in the result.
        fill_ratio: ``B_P / B_H`` (pinned transfer bandwidth over host expert-processing
            bandwidth, both in the same unit, e.g. GB/s), >= 0 and finite. Used by ``qstar``:
            ``q = clamp(floor(m * fill_ratio + 0.5), 1, m)`` for ``m > 0`` (paper Eq. 4).
        policy: a :class:`MissPolicy`, its value or its name. In all policies ``q <= F`` and
            ``q <=`` the slots not hit in this call (so ``q == 0`` with no slots).
        live_fill_ratio: optional ``[1]`` float64 on the tables' device holding ``B_P / B_H``
            as device data; when given it replaces ``fill_ratio``, so a captured CUDA graph
            follows a ratio re-derived while serving (:mod:`bandwidth_drift`). The CPU op
            checks its value like ``fill_ratio``; the CUDA kernel reads a negative or
            non-finite value as 0 (it cannot raise without a host sync).

    Returns:
        :class:`Routing` with new ``[T, K]`` int32 ``slot_ids`` / ``cpu_ids`` and ``fills``.

    Raises:
        ValueError: an unknown policy name or value.
        RuntimeError: (the op, before any state changes) wrong dtype, device, shape or
            contiguity; ``layer``/``num_experts`` outside ``slot_of_id``; bad ratio; on CPU a
            routed id outside ``[-1, E)``. On CUDA such ids count as padding (the kernel cannot
            raise without a host sync), and ``E > CUDA_MAX_EXPERTS`` or ``F > CUDA_MAX_FILL``
            are errors. On CPU a corrupt table entry (slot or id out of range) raises with the
            state unspecified; the CUDA kernel does not detect it (an out-of-range slot counts as
            a miss, writes through an out-of-range id are skipped).

    Cost: linear in ``T * K`` and in ``S`` (one pass over ``slot_last_use``, skipped when
    ``q == 0``); the CUDA kernel is one block of 512 threads, sized for decode batches rather
    than large prefill batches.
    """
    slot_ids = torch.empty_like(topk_ids)
    cpu_ids = torch.empty_like(topk_ids)
    torch.ops.sgl_kernel.expert_cache_control(
        topk_ids,
        layer,
        num_experts,
        tables.slot_of_id,
        tables.id_of_slot,
        tables.slot_last_use,
        tables.clock,
        slot_ids,
        cpu_ids,
        fills.fill_src,
        fills.fill_dst,
        fills.counts,
        tables.stats,
        float(fill_ratio),
        int(MissPolicy.parse(policy)),
        tables.live_slots,
        live_fill_ratio,
    )
    return Routing(slot_ids, cpu_ids, fills)


def expert_bank_copy(
    src_banks: Sequence[torch.Tensor], dst_banks: Sequence[torch.Tensor], fills: FillList
) -> None:
    """Copy the filled experts into their slots: ``torch.ops.sgl_kernel.expert_bank_copy``.

    For ``i < fills.counts[Stat.FILLS]`` and every bank ``b``: ``dst_banks[b][fill_dst[i]] =
    src_banks[b][fill_src[i]]`` (rows along the leading dimension; paper §4.1/§4.2: every bank
    shares the expert-to-slot mapping, so one index list drives all banks).

    Args:
        src_banks: host expert pool, one tensor per bank, ``[L*E, ...]``, contiguous. On CUDA
            they must be pinned CPU tensors (read by the kernel through their mapped device
            pointers) or CUDA tensors.
        dst_banks: slot banks, ``[S, ...]``, contiguous, same dtype and row shape as the
            matching source bank (banks may differ from one another in both).
        fills: the work list of :func:`expert_cache_control` (or one built by hand).

    Raises:
        RuntimeError: mismatched banks or work list. The CPU op copies with memcpy in parallel
            over (fill, bank) and raises on indices out of range; the CUDA op is one launch,
            masked on the device by the fill count (no host sync), and skips such indices.
    """
    torch.ops.sgl_kernel.expert_bank_copy(
        list(src_banks), list(dst_banks), fills.fill_src, fills.fill_dst, fills.counts
    )
