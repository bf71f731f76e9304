"""Helpers of the expert-cache tests: this checkout's modules, op calls, table checks."""

from __future__ import annotations

from typing import List, Sequence

import torch

from sglang.srt.layers.moe.expert_cache import control, reference, resize


class OpCache:
    """The op's tables and fill list on one device, with results read back as lists."""

    def __init__(self, num_layers, num_experts, num_slots, num_fill, top_k=8, device="cpu"):
        self.E = num_experts
        self.F = num_fill
        self.K = top_k
        self.tables = control.ExpertCacheTables.allocate(num_layers, num_experts, num_slots, device)
        self.fills = control.FillList.allocate(num_fill, device)
        self.device = device

    def load(self, ref: "reference.ReferenceExpertCache") -> None:
        """Copy a reference model's state into the op's tables."""
        t = self.tables
        t.slot_of_id.copy_(torch.tensor(ref.slot_of_id, dtype=torch.int32))
        t.id_of_slot.copy_(torch.tensor(ref.id_of_slot, dtype=torch.int32))
        t.slot_last_use.copy_(torch.tensor(ref.slot_last_use, dtype=torch.int64))
        t.clock.fill_(ref.clock)
        t.stats.copy_(torch.tensor(ref.stats, dtype=torch.int64))
        t.live_slots.fill_(ref.live_slots)

    def resize(self, live_slots: int):
        """:func:`resize.resize_tables` on the op's tables; the moves as (src, dst) lists."""
        src, dst = resize.resize_tables(self.tables, live_slots)
        return list(zip(src.tolist(), dst.tolist()))

    def control(self, topk: Sequence[Sequence[int]], layer: int, ratio: float, policy: int):
        """One op call on a batch of ``len(topk)`` tokens; outputs as lists."""
        ids = torch.tensor(topk, dtype=torch.int32, device=self.device).reshape(len(topk), self.K)
        r = control.expert_cache_control(ids, layer, self.E, self.tables, self.fills, ratio, policy)
        return as_lists(r)

    def state(self):
        t = self.tables
        return (
            t.slot_of_id.tolist(),
            t.id_of_slot.tolist(),
            t.slot_last_use.tolist(),
            int(t.clock.item()),
            t.stats.tolist(),
            int(t.live_slots.item()),
        )


def as_lists(r: "control.Routing") -> "reference.ControlResult":
    """A :class:`control.Routing` read back as the reference model's result."""
    return reference.ControlResult(
        slot_ids=r.slot_ids.tolist(),
        cpu_ids=r.cpu_ids.tolist(),
        fill_src=r.fills.fill_src.tolist(),
        fill_dst=r.fills.fill_dst.tolist(),
        counts=r.fills.counts.tolist(),
    )


def ref_state(ref):
    return (
        ref.slot_of_id,
        ref.id_of_slot,
        ref.slot_last_use,
        ref.clock,
        ref.stats,
        ref.live_slots,
    )


def check_call(
    topk: Sequence[Sequence[int]],
    layer: int,
    E: int,
    before: tuple,
    after: tuple,
    res: "reference.ControlResult",
) -> None:
    """Invariants of one call, from the tables before/after and the outputs (any backend)."""
    slot_of_id, id_of_slot, last_use, clock, _, live = after
    assert all(g == -1 for g in id_of_slot[live:]), "a slot past live_slots holds an expert"
    # the maps are inverse and no slot holds two ids
    held = [g for g in id_of_slot if g >= 0]
    assert len(held) == len(set(held)), "a global id sits in two slots"
    for s, g in enumerate(id_of_slot):
        if g >= 0:
            assert slot_of_id[g] == s
    for g, s in enumerate(slot_of_id):
        if s >= 0:
            assert id_of_slot[s] == g
    # hit slots keep their expert
    b_slot_of_id = before[0]
    routed = {e for row in topk for e in row if e != -1}
    hit_slots = set()
    for e in routed:
        s = b_slot_of_id[layer * E + e]
        if s >= 0:
            hit_slots.add(s)
            assert slot_of_id[layer * E + e] == s, "a hit expert was evicted in its own call"
            assert last_use[s] == clock
    assert not hit_slots & set(d for d in res.fill_dst if d >= 0), "a hit slot was a fill victim"
    # every routed entry is in exactly one of slot_ids / cpu_ids
    for t, row in enumerate(topk):
        for k, e in enumerate(row):
            s, c = res.slot_ids[t][k], res.cpu_ids[t][k]
            if e == -1:
                assert s == -1 and c == -1
            else:
                g = layer * E + e
                assert (s >= 0) != (c >= 0)
                if s >= 0:
                    assert id_of_slot[s] == g
                else:
                    assert c == g and slot_of_id[g] == -1
    Stat = control.Stat
    q, cpu, hits, m = (
        res.counts[i] for i in (Stat.FILLS, Stat.CPU_EXPERTS, Stat.HITS, Stat.MISSES)
    )
    assert q + cpu == m and hits + m == len(routed) and 0 <= q <= len(res.fill_src)
    assert all(x == -1 for x in res.fill_src[q:]) and all(x == -1 for x in res.fill_dst[q:])
    assert len(set(res.fill_dst[:q])) == q
    assert clock == before[3] + 1


def random_routing(rng, T: int, K: int, E: int, hot: List[int], pad_p: float = 0.1):
    """[T][K] routing with locality: mostly from `hot`, distinct per token, some padding."""
    rows = []
    for _ in range(T):
        pool = hot if rng.random() < 0.7 and len(hot) >= K else list(range(E))
        row = rng.sample(pool, min(K, len(pool)))
        row += [-1] * (K - len(row))
        row = [-1 if rng.random() < pad_p else e for e in row]
        rows.append(row)
    return rows
