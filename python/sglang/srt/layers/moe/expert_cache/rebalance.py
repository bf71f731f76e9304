"""Rebalancing the expert-slot pool on request (``POST /rebalance_memory``; issue 15, the expert
cache's slice of elastic memory; FreeToken §3.3 "Runtime cache reconfiguration").

A target in the units of ``--expert-cache-size`` (slots, a share of the routed pool, or a size)
is checked against the floor (one layer's top-k: fewer slots cannot hold one call's experts)
and the largest feasible pool (the reserved capacity and, on the CPU, the memory the host can
still commit), then applied with :meth:`ExpertSlotCache.resize_slots`, which checks every step
that can fail before its point of no return and rolls back otherwise. The scheduler calls
:func:`rebalance` between two batches (``managers/memory_rebalance.py``); requests in flight
keep running, since the host pool is the source of truth and a slot's content changes speed,
never results.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Dict, Optional

import torch

from sglang.srt.layers.moe.expert_cache.config import CacheSize

if TYPE_CHECKING:
    from sglang.srt.layers.moe.expert_cache.cache import ExpertSlotCache

# Host memory a CPU grow leaves uncommitted (the slots are committed as misses fill them).
HOST_RESERVE_BYTES = 1 << 30


class RebalanceRefused(ValueError):
    """A target the cache cannot take (HTTP 400); the message names the floor or the largest
    feasible target. Nothing was changed."""


class RebalanceFailed(RuntimeError):
    """The resize failed while running (HTTP 500); the cache rolled back to its previous slot
    count and keeps serving (:meth:`ExpertSlotCache.resize_slots`)."""


def host_available_bytes() -> Optional[int]:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes (None where there is no such file)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def max_feasible_slots(cache: ExpertSlotCache) -> int:
    """The largest slot count a rebalance can give now.

    CUDA: the slots allocated at startup (:attr:`ExpertSlotCache.slot_capacity`; growing past
    them needs the VMM reservation that is not built yet). CPU: the reserved capacity (the
    whole routed pool), capped at the current slots plus what ``MemAvailable`` allows after
    keeping :data:`HOST_RESERVE_BYTES` free, in whole experts (a grow commits its new slots'
    memory as later misses fill them).
    """
    capacity = cache.slot_capacity
    if cache.device.type != "cpu":
        return capacity
    avail = host_available_bytes()
    if avail is None:
        return capacity
    headroom = max(0, avail - HOST_RESERVE_BYTES) // cache.host.expert_bytes
    return max(cache.num_slots, min(capacity, cache.num_slots + headroom))


def _describe(cache: ExpertSlotCache, slots: int) -> str:
    pool = max(1, cache.pool_experts)
    return f"{slots} slots ({slots * cache.host.expert_bytes / 1e6:.1f} MB, {100 * slots / pool:.1f}% of the routed pool)"


def target_slots(cache: ExpertSlotCache, spec: Any) -> int:
    """The slot count that ``spec`` asks for.

    Args:
        spec: as ``--expert-cache-size``: an int or a string of slots (``"64"``), a share of
            the routed pool (``"25%"``, of :attr:`ExpertSlotCache.pool_experts`) or a size
            (``"4GB"``, ``"512MiB"``: whole experts of ``expert_bytes`` that fit).

    Raises:
        RebalanceRefused: not one of these (``auto`` included: it is a startup choice), below
            the floor (one layer's top-k), or above :func:`max_feasible_slots`; the message
            names the floor or the largest feasible target.
    """
    try:
        size = CacheSize.parse(str(spec))
    except ValueError as e:
        raise RebalanceRefused(str(e).replace("--expert-cache-size", "expert_cache_size")) from None
    if size.is_auto:
        raise RebalanceRefused(
            "expert_cache_size: give a slot count (e.g. 64), a share of the routed-expert pool "
            "(e.g. 25%) or a size (e.g. 4GB); auto is chosen at startup only"
        )
    if size.slots is not None:
        slots = size.slots
    elif size.fraction is not None:
        slots = int(round(size.fraction * cache.pool_experts))
    else:
        slots = size.bytes // cache.host.expert_bytes
    if slots < cache.top_k:
        raise RebalanceRefused(
            f"expert_cache_size {spec!r} gives {slots} slots, below the floor of one layer's "
            f"top-k: {_describe(cache, cache.top_k)}"
        )
    largest = max_feasible_slots(cache)
    if slots > largest:
        why = (
            "the slots reserved at startup"
            if largest == cache.slot_capacity
            else "the host memory available now"
        )
        raise RebalanceRefused(
            f"expert_cache_size {spec!r} gives {slots} slots; the largest feasible target is "
            f"{_describe(cache, largest)} ({why})"
        )
    return slots


def expert_cache_split(cache: ExpertSlotCache) -> Dict[str, Any]:
    """The slot pool as ``GET /rebalance_memory`` reports it: ``slots``, ``slot_bytes``,
    ``occupied_slots``, ``expert_bytes`` (one expert, all banks), ``pool_experts`` (routed
    experts), ``floor_slots`` (top-k), ``max_feasible_slots``, ``slot_capacity`` (reserved),
    ``rebalances``, ``rebalance_failures``, ``last_rebalance_ms``."""
    eb = cache.host.expert_bytes
    return dict(
        slots=cache.num_slots,
        slot_bytes=cache.num_slots * eb,
        occupied_slots=int((cache.tables.id_of_slot >= 0).sum()),
        expert_bytes=eb,
        pool_experts=cache.pool_experts,
        floor_slots=cache.top_k,
        max_feasible_slots=max_feasible_slots(cache),
        slot_capacity=cache.slot_capacity,
        rebalances=cache.rebalances,
        rebalance_failures=cache.rebalance_failures,
        last_rebalance_ms=cache.last_rebalance_ms,
    )


def rebalance(
    cache: ExpertSlotCache, spec: Any, *, dry_run: bool = False, on_step=None
) -> Dict[str, Any]:
    """Resize ``cache`` to the target ``spec`` now; call only at a safe point (no layer call
    running: the scheduler between two batches). On CUDA the device is synchronized first, so
    an overlapped batch still on the GPU finishes before the tables change.

    Args:
        spec: the target (:func:`target_slots`).
        dry_run: check the target only; nothing changes.
        on_step: passed to :meth:`ExpertSlotCache.resize_slots` (failure injection in tests).

    Returns:
        ``{"expert_cache": expert_cache_split(cache), "previous_slots": int,
        "released_bytes": int, "time_ms": float, "dry_run": bool}``; ``time_ms`` is wall time of
        the whole resize (synchronization included).

    Raises:
        RebalanceRefused: a target :func:`target_slots` refuses; nothing changed.
        RebalanceFailed: the resize failed and rolled back; the message says to how many slots.
    """
    t0 = time.perf_counter()
    slots = target_slots(cache, spec)
    previous = cache.num_slots
    released = 0
    if not dry_run:
        if cache.device.type == "cuda":
            torch.cuda.synchronize(cache.device)
        try:
            released = cache.resize_slots(slots, on_step=on_step)
        except Exception as e:
            cache.rebalance_failures += 1
            cache.publish_metrics()
            raise RebalanceFailed(
                f"resizing the expert cache to {slots} slots failed ({type(e).__name__}: {e}); "
                f"it is back at {cache.num_slots} slots and keeps serving"
            ) from e
        cache.rebalances += 1
        cache.last_rebalance_ms = (time.perf_counter() - t0) * 1e3
        cache.publish_metrics()
    return dict(
        expert_cache=expert_cache_split(cache),
        previous_slots=previous,
        released_bytes=released,
        time_ms=(time.perf_counter() - t0) * 1e3,
        dry_run=dry_run,
    )
