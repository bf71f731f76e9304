"""Plain-Python reference model of the per-layer expert-cache control op.

The FreeToken expert slot cache (paper §3.2, §4.1 "Device-side cache control") is ONE pool of
``S`` GPU expert slots shared by all ``L`` MoE layers, managed LRU. An expert is named by its
global id ``g = layer * E + expert``. The state is four tables, device tensors updated in place
by ``torch.ops.sgl_kernel.expert_cache_control`` (C++ on CPU, CUDA on GPU):

* ``slot_of_id[L*E]`` int32: slot holding global id ``g``, or -1;
* ``id_of_slot[S]`` int32: global id held by a slot, or -1 (empty);
* ``slot_last_use[S]`` int64: clock value of the slot's last use, -1 = never (empty slots);
* ``clock[1]`` int64: advanced by one per call;
* ``live_slots[1]`` int32: the slots in the cache, ``S_live <= S``. Slots ``[S_live, S)`` are
  the released tail of a shrunk pool: always empty (id -1, last use -1), never a hit or a
  victim. Everything below reads ``S`` as ``S_live``; :meth:`ReferenceExpertCache.resize`
  changes it (FreeToken §3.3 "Runtime cache reconfiguration").

One call, for one layer's routing ``topk_ids[T, K]`` (layer-local ids in ``[0, E)``, -1 =
padding), with ``F`` = capacity of the fill lists, does exactly:

1. ``clock += 1; now = clock``.
2. Deduplicate the routed ids, ignoring -1. An id outside ``[-1, E)`` is an error on CPU (the
   op raises before changing anything); the CUDA kernel treats it as padding and counts it
   nowhere. ``tokens[e]`` = number of ``(t, k)`` entries routed to ``e``.
3. Hits: distinct ids with ``slot_of_id[g] >= 0``; each sets ``slot_last_use[slot] = now``.
   Misses: the ``m`` distinct non-resident ids.
4. Fill count ``q``: policy ``qstar``: ``0 if m == 0 else clamp(floor(m * fill_ratio +
   0.5), 1, m)`` (paper Eq. 4, ``q* = m * B_P / B_H`` rounded, at least one fill so the cache
   keeps warming; ``fill_ratio = B_P / B_H``, computed in float64); ``fill``: ``m``; ``cpu``:
   0 (static cache, every miss on the CPU). Then ``q = min(q, F, candidates)``, where the
   candidates are the slots with ``slot_last_use != now`` (every slot but this call's hits).
5. Fill order among the misses: most routed tokens first, ties by lower expert id. The first
   ``q`` misses in that order are filled (the set F of the paper); the other ``m - q`` run on
   the CPU (the set C) and leave residency unchanged.
6. Victims: the ``q`` candidate slots with the smallest ``(slot_last_use, slot)``; empty slots
   (``slot_last_use == -1``) therefore go first. The kernels find the ``min(F, candidates)``
   smallest in one pass over the slot table, whatever ``m`` is, and consume the first ``q``.
   Fill ``i`` is paired with victim ``i`` in ascending ``(slot_last_use, slot)`` order.
7. For each pair ``(g, v)`` in order: ``old = id_of_slot[v]``; if ``old >= 0``:
   ``slot_of_id[old] = -1``; then ``id_of_slot[v] = g; slot_of_id[g] = v;
   slot_last_use[v] = now; fill_src[i] = g; fill_dst[i] = v``.
8. Rewrite: ``slot_ids[t, k]`` = ``slot_of_id[g]`` if ``g`` is resident after step 7 (a hit or
   a fill: executed on the GPU), else -1; ``cpu_ids[t, k]`` = ``g`` for CPU-executed entries,
   else -1. Padding is -1 in both. Every routed entry is in exactly one of the two.
9. ``counts`` = this call's counters, indexed by ``Stat``: ``counts[FILLS] = q``,
   ``counts[CPU_EXPERTS] = m - q``, ``counts[HITS] = hits``, ``counts[MISSES] = m`` (``hits``
   and ``m`` count distinct experts); ``stats += counts`` (int64, cumulative). ``fill_src[i]``
   and ``fill_dst[i]`` for ``i >= q`` are -1.

The model keeps the tables in Python lists and computes with no torch operation (it takes only
the enumerations from :mod:`control`), so tests can compare the compiled ops against it table by
table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Sequence, Tuple

from sglang.srt.layers.moe.expert_cache.control import MissPolicy, Stat


def fill_count(policy: int, misses: int, fill_ratio: float) -> int:
    """Step 4 before the capacity limits: how many of ``misses`` distinct misses to fill.

    Raises:
        ValueError: an unknown policy.
    """
    policy = MissPolicy.parse(policy)
    if policy == MissPolicy.QSTAR:
        if misses == 0:
            return 0
        return min(max(int(math.floor(misses * fill_ratio + 0.5)), 1), misses)
    if policy == MissPolicy.FILL:
        return misses
    return 0  # MissPolicy.CPU


@dataclass(frozen=True)
class ControlResult:
    """Outputs of one control call (lists, shaped like the op's output tensors)."""

    slot_ids: List[List[int]]  # [T][K]
    cpu_ids: List[List[int]]  # [T][K]
    fill_src: List[int]  # [F]
    fill_dst: List[int]  # [F]
    counts: List[int]  # [len(Stat)], indexed by Stat


class ReferenceExpertCache:
    """The slot tables of one expert cache and the control step, in plain Python."""

    def __init__(self, num_layers: int, num_experts: int, num_slots: int):
        assert num_layers >= 1 and num_experts >= 1 and num_slots >= 0
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.num_slots = num_slots
        self.slot_of_id: List[int] = [-1] * (num_layers * num_experts)
        self.id_of_slot: List[int] = [-1] * num_slots
        self.slot_last_use: List[int] = [-1] * num_slots
        self.clock: int = 0
        self.stats: List[int] = [0] * len(Stat)  # running sums of the calls' counts
        self.live_slots = num_slots

    def control(
        self,
        topk_ids: Sequence[Sequence[int]],
        layer: int,
        num_fill: int,
        fill_ratio: float,
        policy: int,
    ) -> ControlResult:
        """One call of the op for ``layer`` (steps 1-9 of the module docstring).

        ``num_fill`` is ``F``, the length of the fill lists. Raises ValueError for a routed id
        outside ``[-1, E)`` before changing any state (like the CPU op).
        """
        E = self.num_experts
        assert 0 <= layer < self.num_layers and num_fill >= 0
        base = layer * E
        # 2. deduplicate, count tokens per expert
        tokens = {}
        for row in topk_ids:
            for e in row:
                if e == -1:
                    continue
                if not 0 <= e < E:
                    raise ValueError(f"routed expert id {e} outside [-1, {E})")
                tokens[e] = tokens.get(e, 0) + 1
        # 1. advance the clock
        self.clock += 1
        now = self.clock
        # 3. classify
        hits, misses = [], []
        for e in sorted(tokens):
            s = self.slot_of_id[base + e]
            if s >= 0:
                hits.append(e)
                self.slot_last_use[s] = now
            else:
                misses.append(e)
        m = len(misses)
        # 4. fill count
        candidates = [s for s in range(self.live_slots) if self.slot_last_use[s] != now]
        q = min(fill_count(policy, m, fill_ratio), num_fill, len(candidates))
        # 5. fill order: most tokens first, then lower id
        misses.sort(key=lambda e: (-tokens[e], e))
        fills = misses[:q]
        # 6. victims: smallest (last_use, slot) among the candidates
        victims = sorted(candidates, key=lambda s: (self.slot_last_use[s], s))[:q]
        # 7. install
        fill_src = [-1] * num_fill
        fill_dst = [-1] * num_fill
        for i, (e, v) in enumerate(zip(fills, victims)):
            g = base + e
            old = self.id_of_slot[v]
            if old >= 0:
                self.slot_of_id[old] = -1
            self.id_of_slot[v] = g
            self.slot_of_id[g] = v
            self.slot_last_use[v] = now
            fill_src[i] = g
            fill_dst[i] = v
        # 8. rewrite
        slot_ids, cpu_ids = [], []
        for row in topk_ids:
            srow, crow = [], []
            for e in row:
                if e == -1:
                    srow.append(-1)
                    crow.append(-1)
                    continue
                s = self.slot_of_id[base + e]
                srow.append(s if s >= 0 else -1)
                crow.append(-1 if s >= 0 else base + e)
            slot_ids.append(srow)
            cpu_ids.append(crow)
        # 9. counts and stats
        counts = [0] * len(Stat)
        counts[Stat.FILLS] = q
        counts[Stat.CPU_EXPERTS] = m - q
        counts[Stat.HITS] = len(hits)
        counts[Stat.MISSES] = m
        self.stats = [a + b for a, b in zip(self.stats, counts)]
        return ControlResult(slot_ids, cpu_ids, fill_src, fill_dst, counts)

    def resize(self, live_slots: int) -> List[Tuple[int, int]]:
        """Resize the cache to ``live_slots`` slots; return the slot moves ``(src, dst)``.

        Shrink (``live_slots < S_live``): the ``live_slots`` occupied slots with the largest
        ``(slot_last_use, -slot)`` stay (the most recently used entries; ties: lower slot), the
        other occupied slots are evicted (``slot_of_id[g] = -1``). Each kept entry at a slot
        ``>= live_slots`` moves, in ascending slot order, to the lowest free slot below
        ``live_slots`` (its id and last use go with it; the caller copies the expert's rows
        from ``src`` to ``dst`` in every bank). The tail ``[live_slots, S)`` is left empty.
        Grow: the slots ``[S_live, live_slots)`` join the cache empty (the tail always is), so
        the next fills take them first. The clock and the counters do not change.

        Raises:
            ValueError: ``live_slots`` outside ``[0, S]``.
        """
        if not 0 <= live_slots <= self.num_slots:
            raise ValueError(f"live_slots {live_slots} outside [0, {self.num_slots}]")
        moves: List[Tuple[int, int]] = []
        if live_slots < self.live_slots:
            occupied = [s for s in range(self.live_slots) if self.id_of_slot[s] >= 0]
            occupied.sort(key=lambda s: (-self.slot_last_use[s], s))
            kept = set(occupied[:live_slots])
            for s in occupied[live_slots:]:
                self.slot_of_id[self.id_of_slot[s]] = -1
                self.id_of_slot[s], self.slot_last_use[s] = -1, -1
            free = [s for s in range(live_slots) if s not in kept]
            for src, dst in zip(sorted(s for s in kept if s >= live_slots), free):
                g = self.id_of_slot[src]
                self.id_of_slot[dst], self.slot_last_use[dst] = g, self.slot_last_use[src]
                self.slot_of_id[g] = dst
                self.id_of_slot[src], self.slot_last_use[src] = -1, -1
                moves.append((src, dst))
        self.live_slots = live_slots
        return moves

    def check_invariants(self) -> None:
        """Assert the table invariants: the two maps are inverse, no slot holds two ids, the
        tail past ``live_slots`` is empty."""
        for s in range(self.live_slots, self.num_slots):
            assert self.id_of_slot[s] == -1 and self.slot_last_use[s] == -1, f"tail slot {s}"
        seen = set()
        for s, g in enumerate(self.id_of_slot):
            if g >= 0:
                assert g not in seen, f"id {g} in two slots"
                seen.add(g)
                assert self.slot_of_id[g] == s, f"slot_of_id[{g}] != {s}"
        for g, s in enumerate(self.slot_of_id):
            if s >= 0:
                assert self.id_of_slot[s] == g, f"id_of_slot[{s}] != {g}"
