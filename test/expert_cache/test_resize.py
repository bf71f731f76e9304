"""Resizing the expert-slot pool between layer calls (``ExpertSlotCache.resize_slots``, module
``expert_cache/resize.py``; FreeToken §3.3 "Runtime cache reconfiguration").

On the CPU device the outputs of a cache resized between calls are bit-identical to an
all-resident cache's (the host pool is the source of truth); the tables stay consistent and
the tail past the live slots empty after every call; a shrink keeps the most recently used
entries and returns the tail's memory to the OS (resident set measured); bad targets are
refused with the cache unchanged. The table update itself is compared with the reference model
in test_control.py.
"""

from __future__ import annotations

import random

import pytest
import torch
from test_slot_cache import E, K, L, make_cache, routing


def test_outputs_identical_while_the_pool_shrinks_and_grows():
    calls = routing(steps=16, seed=3)
    base = make_cache("100%", "fill")
    cache = make_cache("50%", "qstar")
    assert cache.slot_capacity == L * E
    rng = random.Random(0)
    sizes = [0, K, K + 3, L * E // 4, L * E // 2, L * E]
    resized = 0
    for i, (layer, x, w, ids) in enumerate(calls):
        if i % 5 == 4:
            before = {int(g) for g in cache.tables.id_of_slot.tolist() if g >= 0}
            n = rng.choice(sizes)
            cache.resize_slots(n)
            after = {int(g) for g in cache.tables.id_of_slot.tolist() if g >= 0}
            assert after <= before and len(after) == min(len(before), n)
            cache.check_invariants()
            resized += 1
        want = base.forward(layer, x, w, ids)
        got = cache.forward(layer, x, w, ids)
        assert torch.equal(got, want), f"call {i} after {resized} resizes"
        cache.check_invariants()
    assert resized >= 3


def test_shrink_keeps_the_most_recent_entries_and_their_rows():
    cache = make_cache("100%", "fill")
    calls = routing(steps=4, seed=5)
    for layer, x, w, ids in calls:
        cache.forward(layer, x, w, ids)
    lu = cache.tables.slot_last_use.tolist()
    ids = cache.tables.id_of_slot.tolist()
    ranked = sorted(range(len(ids)), key=lambda s: (-lu[s], s))
    want = {ids[s] for s in ranked[:K]}
    cache.resize_slots(K)
    cache.check_invariants()
    kept = cache.tables.id_of_slot[:K].tolist()
    assert set(kept) == want
    for s, g in enumerate(kept):  # each kept entry's rows moved with it
        for name, bank in cache.slots.tensors.items():
            assert torch.equal(bank[s], cache.host[name][g]), (name, s, g)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_shrink_returns_the_tail_memory():
    cache = make_cache("100%", "fill")  # every row of the reserved slot banks written
    pool_bytes = cache.slot_capacity * cache.host.expert_bytes
    before = _rss_bytes()
    released = cache.resize_slots(K)
    dropped = before - _rss_bytes()
    assert released >= 0.95 * (cache.slot_capacity - K) * cache.host.expert_bytes
    assert dropped >= 0.8 * released, (dropped, released, pool_bytes)
    cache.resize_slots(cache.slot_capacity)  # grows back: new slots fill on later misses
    layer, x, w, ids = routing(steps=1, seed=2)[0]
    assert torch.equal(
        cache.forward(layer, x, w, ids), make_cache("100%", "fill").forward(layer, x, w, ids)
    )


@pytest.mark.parametrize("n", [1, K - 1, L * E + 1, -1])
def test_bad_targets_are_refused_and_change_nothing(n):
    cache = make_cache("25%", "qstar")
    before = (cache.num_slots, cache.tables.id_of_slot.clone(), cache.tables.slot_last_use.clone())
    with pytest.raises(ValueError, match="top-k"):
        cache.resize_slots(n)
    assert cache.num_slots == before[0]
    assert torch.equal(cache.tables.id_of_slot, before[1])
    assert torch.equal(cache.tables.slot_last_use, before[2])
    cache.check_invariants()


def test_grow_from_no_slots_measures_the_split_once():
    cache = make_cache("auto", "qstar")  # CPU device: 0 slots, nothing measured
    assert cache.num_slots == 0 and cache.fill_ratio == 0.0
    cache.resize_slots(2 * K)
    assert cache.num_slots == 2 * K and cache.fill_ratio == pytest.approx(0.5)  # flags 1 / 2 GB/s
    calls = routing(steps=3, seed=8)
    base = make_cache("100%", "fill")
    for layer, x, w, ids in calls:
        assert torch.equal(cache.forward(layer, x, w, ids), base.forward(layer, x, w, ids))
    assert cache.snapshot()["fills"] > 0
