"""Splitting a device memory budget between KV pages and expert slots
(``POST /rebalance_memory {"device_memory_budget": ...}``, issue 15).

Pure arithmetic, no pools: :func:`split_budget` takes each side's unit size, floor, ceiling
and current size and returns the KV tokens and slots that fit the budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple


@dataclass(frozen=True)
class Side:
    """One side of the split, in its own units (KV: tokens; slots: experts).

    ``unit_bytes``: bytes of one unit; ``fixed_bytes``: bytes the side holds whatever its
    size (the KV pool's padding page); ``floor`` / ``ceiling``: the smallest and largest sizes
    it can take now; ``current``: its size now; ``step``: sizes are multiples of it (a page).
    """

    unit_bytes: int
    floor: int
    ceiling: int
    current: int
    fixed_bytes: int = 0
    step: int = 1

    def bytes_of(self, n: int) -> int:
        return self.fixed_bytes + n * self.unit_bytes

    def units_in(self, nbytes: int) -> int:
        """The largest size (a multiple of ``step``) whose bytes fit in ``nbytes``."""
        n = max(0, (nbytes - self.fixed_bytes) // self.unit_bytes)
        return n - n % self.step


class BudgetRefused(ValueError):
    """A budget outside what the two sides can take now; the message names the smallest or
    the largest feasible budget."""


def split_budget(
    budget: int, kv: Side, slots: Optional[Side], kv_share: Optional[float] = None
) -> Tuple[int, int]:
    """The KV tokens and slots for ``budget`` bytes.

    The KV side gets ``kv_share`` of the budget (default: its share of the current split,
    by bytes), the slots the rest; a side pushed below its floor or above its ceiling is
    clamped there and the other side gets the difference (within its own limits).

    Args:
        budget: bytes for both sides together.
        kv: the KV side (tokens).
        slots: the slot side (experts), or None for a server without the expert cache (the
            whole budget goes to KV).
        kv_share: in (0, 1], or None.

    Returns:
        ``(kv_tokens, slots)`` (``slots`` 0 when ``slots`` is None); their bytes fit the budget.

    Raises:
        BudgetRefused: ``budget`` is below the floors' bytes (the message names the smallest
            feasible budget) or above the ceilings' (the largest).
    """
    lo = kv.bytes_of(kv.floor) + (slots.bytes_of(slots.floor) if slots else 0)
    hi = kv.bytes_of(kv.ceiling) + (slots.bytes_of(slots.ceiling) if slots else 0)
    if budget < lo:
        raise BudgetRefused(
            f"device_memory_budget {budget} bytes is below the floor: the smallest feasible "
            f"budget is {lo} bytes ({kv.floor} KV tokens"
            + (f" + {slots.floor} expert slots" if slots else "")
            + ")"
        )
    if budget > hi:
        raise BudgetRefused(
            f"device_memory_budget {budget} bytes is above the largest feasible budget, {hi} "
            f"bytes ({kv.ceiling} KV tokens"
            + (f" + {slots.ceiling} expert slots" if slots else "")
            + ")"
        )
    if slots is None:
        return min(kv.ceiling, kv.units_in(budget)), 0
    if kv_share is None:
        cur_kv, cur_slots = kv.bytes_of(kv.current), slots.bytes_of(slots.current)
        kv_share = cur_kv / max(1, cur_kv + cur_slots)
    kv_tokens = min(kv.ceiling, max(kv.floor, kv.units_in(int(budget * kv_share))))
    n_slots = min(slots.ceiling, max(slots.floor, slots.units_in(budget - kv.bytes_of(kv_tokens))))
    if kv.bytes_of(kv_tokens) + slots.bytes_of(n_slots) > budget:  # slots at their floor
        kv_tokens = max(kv.floor, kv.units_in(budget - slots.bytes_of(n_slots)))
    else:  # what the slots could not take goes back to KV
        kv_tokens = min(kv.ceiling, kv.units_in(budget - slots.bytes_of(n_slots)))
    return kv_tokens, n_slots
