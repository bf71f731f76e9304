"""Resizing the expert-slot pool at a scheduler safe point, with the host pool untouched.

FreeToken §3.3 ("Runtime cache reconfiguration": rebuild the expert cache for a revised memory
budget without restarting or reloading the host pool). Unlike FreeToken's ``rebuild_cache``,
which starts the cache cold, a resize keeps the most recently used entries, and the slot banks
and tables never move: they are sized for the largest pool once (:class:`ExpertBanks` with
``reserve=True``), the live slot count is device data (``ExpertCacheTables.live_slots``, read
by the control op), and a shrink releases the memory of the tail. A CUDA graph captured before
a resize therefore stays valid after it.

The table update is :func:`resize_tables` (torch ops on the tables' device; one host sync, which
a safe point allows); its exact semantics are ``ReferenceExpertCache.resize`` in
:mod:`reference`, which the tests compare it with. The host pool is the source of truth, so an
evicted entry changes speed, never results.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import torch

from sglang.srt.layers.moe.expert_cache.control import ExpertCacheTables

# The steps of ``ExpertSlotCache.resize_slots``, in order; before ``commit`` nothing of the cache
# has changed (the dry run), ``commit`` is the point of no return.
RESIZE_STEPS = ("bandwidths", "plan", "gather", "commit", "release")
# The tables a resize rewrites (the clock and the counters stay).
RESIZED_TABLES = ("slot_of_id", "id_of_slot", "slot_last_use", "live_slots")


def copy_tables(
    tables: ExpertCacheTables, into: Optional[ExpertCacheTables] = None
) -> ExpertCacheTables:
    """Copy the tables a resize rewrites (:data:`RESIZED_TABLES`).

    Args:
        tables: the source.
        into: tables of the same shapes to copy into, in place (``Tensor.copy_``: no
            allocation); None = new tensors (clones; the clock and counters are shared with
            ``tables``, a resize does not write them).

    Returns:
        ``into``, or the new copy.
    """
    if into is None:
        return dataclasses.replace(
            tables, **{n: getattr(tables, n).clone() for n in RESIZED_TABLES}
        )
    for n in RESIZED_TABLES:
        getattr(into, n).copy_(getattr(tables, n))
    return into


def resize_tables(tables: ExpertCacheTables, live_slots: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Resize the cache's tables to ``live_slots`` slots, in place.

    Shrink: the ``live_slots`` most recently used occupied slots stay (ties: lower slot), the
    other occupied slots are evicted, and each kept entry past the new end moves (id and last
    use) to the lowest free slot below it, in ascending slot order. Grow: the tail's slots join
    empty. ``ReferenceExpertCache.resize`` (:mod:`reference`) is the exact model.

    Args:
        tables: the cache state (any device); ``live_slots`` is updated too.
        live_slots: the new slot count, in ``[0, capacity]`` (capacity = ``id_of_slot`` entries).

    Returns:
        ``(src, dst)``: int64 [M] slot moves, on the tables' device; the caller copies every
        bank's row ``src[i]`` to row ``dst[i]`` (no two moves share a slot, so one gather and
        one scatter per bank do it).

    Raises:
        ValueError: ``live_slots`` outside ``[0, capacity]``.
    """
    capacity = tables.id_of_slot.numel()
    if not 0 <= live_slots <= capacity:
        raise ValueError(f"live_slots {live_slots} outside [0, {capacity}] (the reserved slots)")
    device = tables.id_of_slot.device
    live = int(tables.live_slots.item())
    none = torch.empty(0, dtype=torch.int64, device=device)
    if live_slots >= live:
        tables.live_slots.fill_(live_slots)  # the tail is empty: its slots join as they are
        return none, none
    ios, lu = tables.id_of_slot, tables.slot_last_use
    occupied = (ios[:live] >= 0).nonzero().squeeze(1)  # ascending slots
    # Most recent first; the stable sort keeps ascending slots among equal last uses.
    order = torch.sort(-lu[occupied], stable=True).indices
    ranked = occupied[order]
    kept, evicted = ranked[:live_slots], ranked[live_slots:]
    tables.slot_of_id[ios[evicted].long()] = -1
    ios[evicted] = -1
    lu[evicted] = -1
    is_kept = torch.zeros(live, dtype=torch.bool, device=device)
    is_kept[kept] = True
    src = torch.sort(kept[kept >= live_slots]).values
    dst = (~is_kept[:live_slots]).nonzero().squeeze(1)[: src.numel()]
    moved = ios[src]
    ios[dst] = moved
    lu[dst] = lu[src]
    tables.slot_of_id[moved.long()] = dst.to(torch.int32)
    ios[live_slots:] = -1
    lu[live_slots:] = -1
    tables.live_slots.fill_(live_slots)
    return src, dst
