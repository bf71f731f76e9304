"""Rebalancing the slot pool on request (``expert_cache/rebalance.py``, the cache side of
``POST /rebalance_memory``; issue 15) and the failure path of ``ExpertSlotCache.resize_slots``.

* A failure injected at each step of a resize (``resize.RESIZE_STEPS``): before the point of no
  return (``bandwidths``, ``plan``, ``gather``) the cache is exactly as it was (tables and the
  rows of every occupied slot); at ``commit`` (also a failure after the rows moved and before
  the tables did) it is back at its previous slot count, consistent, with its slots empty; at
  ``release`` the resize stands. After each, the outputs are bit-identical to an all-resident
  cache's and the next resize works.
* Targets in the units of ``--expert-cache-size`` resolve to slots; below the floor (top-k) or
  above the largest feasible pool they are refused with a message naming that bound, and
  nothing changes; the counters and the metrics' snapshot follow.

Server-free, with the scheduler handler (``managers/memory_rebalance.py``) on a stand-in
scheduler; the route is tested in test/entrypoints/test_rebalance_memory.py.
"""

from __future__ import annotations

import pytest
import torch
from test_slot_cache import E, K, L, make_cache, routing

from sglang.srt.layers.moe.expert_cache import rebalance as rb
from sglang.srt.layers.moe.expert_cache import resize
from sglang.srt.layers.moe.expert_cache.rebalance import (
    RebalanceFailed,
    RebalanceRefused,
    rebalance,
    target_slots,
)


class Injected(MemoryError):
    pass


def _fail_at(name):
    def step(s):
        if s == name:
            raise Injected(f"injected at {s}")

    return step


def _warm(size="50%"):
    cache = make_cache(size, "fill")
    for layer, x, w, ids in routing(steps=6, seed=11):
        cache.forward(layer, x, w, ids)
    return cache


def _state(cache):
    t = cache.tables
    return [getattr(t, n).clone() for n in resize.RESIZED_TABLES] + [cache.num_slots]


def _same_state(cache, state):
    now = _state(cache)
    return all(
        torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b for a, b in zip(now, state)
    )


def _rows_hold_their_experts(cache):
    for s, g in enumerate(cache.tables.id_of_slot.tolist()):
        if g >= 0:
            for name, bank in cache.slots.tensors.items():
                assert torch.equal(bank[s], cache.host[name][g]), (name, s, g)


def _outputs_match_resident(cache, seed):
    base = make_cache("100%", "fill")
    for i, (layer, x, w, ids) in enumerate(routing(steps=4, seed=seed)):
        assert torch.equal(cache.forward(layer, x, w, ids), base.forward(layer, x, w, ids)), i
    cache.check_invariants()


# (step, start size, target): each step where it runs (bandwidths: a grow from 0 slots;
# release: a shrink).
CASES = [
    ("bandwidths", "auto", 2 * K),
    ("plan", "50%", K),
    ("plan", "50%", L * E),
    ("gather", "50%", K + 1),
    ("commit", "50%", K + 1),
    ("commit", "25%", L * E),
    ("release", "50%", K),
]


@pytest.mark.parametrize("step,size,target", CASES, ids=[f"{c[0]}-{c[2]}" for c in CASES])
def test_failure_at_each_step_rolls_back_and_keeps_serving(step, size, target):
    assert step in resize.RESIZE_STEPS
    cache = _warm(size)
    before = _state(cache)
    old = cache.num_slots
    if step == "release":
        assert cache.resize_slots(target, on_step=_fail_at(step)) == 0  # logged, not raised
        assert cache.num_slots == target
    else:
        with pytest.raises(Injected):
            cache.resize_slots(target, on_step=_fail_at(step))
        assert cache.num_slots == old
        if step == "commit":
            assert int(cache.tables.live_slots.item()) == old
            assert (cache.tables.id_of_slot < 0).all()  # cold, never wrong
        else:
            assert _same_state(cache, before), "a failure before commit changed the cache"
            assert cache.fill_ratio == (0.0 if size == "auto" else cache.fill_ratio)
    cache.check_invariants()
    _rows_hold_their_experts(cache)
    _outputs_match_resident(cache, seed=21)
    cache.resize_slots(K)  # the next resize works
    cache.check_invariants()
    _outputs_match_resident(cache, seed=22)


def test_failure_after_the_rows_moved_leaves_a_correct_cache(monkeypatch):
    """The rows are scattered, then the table copy fails: the old tables would point at
    overwritten rows, so the cache must come back empty rather than as it was."""
    cache = _warm("100%")
    real = resize.copy_tables

    def failing(tables, into=None):
        if into is not None:
            raise Injected("table copy")
        return real(tables, into)

    monkeypatch.setattr(resize, "copy_tables", failing)
    moves = []
    with pytest.raises(Injected):
        cache.resize_slots(K, on_step=lambda s: moves.append(s))
    assert moves == ["plan", "gather", "commit"]
    monkeypatch.undo()
    assert cache.num_slots == L * E and (cache.tables.id_of_slot < 0).all()
    cache.check_invariants()
    _outputs_match_resident(cache, seed=23)


def test_targets_resolve_in_the_flag_units():
    cache = make_cache("25%", "qstar")
    eb = cache.host.expert_bytes
    assert target_slots(cache, "20") == 20
    assert target_slots(cache, 20) == 20
    assert target_slots(cache, "50%") == round(0.5 * L * E)
    assert target_slots(cache, f"{10 * eb + eb // 2}B") == 10  # whole experts that fit
    assert target_slots(cache, "100%") == L * E


@pytest.mark.parametrize(
    "spec,match",
    [
        (K - 1, f"below the floor of one layer's top-k: {K} slots"),
        ("1%", f"below the floor of one layer's top-k: {K} slots"),
        (L * E + 1, f"largest feasible target is {L * E} slots"),
        ("auto", "auto is chosen at startup only"),
        ("lots", "expert_cache_size must be auto, a slot count"),
        ("0", "below the floor"),
    ],
)
def test_bad_targets_name_the_bound_and_change_nothing(spec, match):
    cache = _warm("25%")
    before = _state(cache)
    with pytest.raises(RebalanceRefused, match=match):
        rebalance(cache, spec)
    assert _same_state(cache, before)
    assert cache.rebalances == 0 and cache.rebalance_failures == 0


def test_largest_feasible_follows_host_memory(monkeypatch):
    cache = make_cache(str(K), "qstar")
    eb = cache.host.expert_bytes
    monkeypatch.setattr(rb, "host_available_bytes", lambda: rb.HOST_RESERVE_BYTES + 5 * eb)
    assert rb.max_feasible_slots(cache) == K + 5
    with pytest.raises(RebalanceRefused, match=f"largest feasible target is {K + 5} slots.*host"):
        rebalance(cache, K + 6)
    assert rebalance(cache, K + 5)["expert_cache"]["slots"] == K + 5
    monkeypatch.setattr(rb, "host_available_bytes", lambda: 0)  # no room: shrinks still work
    assert rb.max_feasible_slots(cache) == K + 5
    assert rebalance(cache, K)["expert_cache"]["slots"] == K


def test_a_shrink_reports_the_resident_bytes_it_returns():
    """CPU slot rows are committed when first filled: rows added by a grow and never filled
    hold no memory, so shrinking them back returns (and reports) 0 bytes, while a shrink of
    filled rows returns their pages; ``slot_release_bytes`` says so before the shrink."""
    cache = _warm("50%")
    n, eb = cache.num_slots, cache.host.expert_bytes
    filled = cache.slot_footprint_bytes()
    assert 0 < filled <= n * eb + len(cache.slots.specs) * 4096
    rebalance(cache, L * E)  # a grow: rows [n, L * E) are empty
    assert cache.slot_release_bytes(n) == 0 < (L * E - n) * eb
    assert cache.slot_footprint_bytes() == cache.slot_release_bytes(0) == filled
    assert rebalance(cache, n)["released_bytes"] == 0
    expect = cache.slot_release_bytes(K)
    assert 0 < expect <= (n - K) * eb
    out = rebalance(cache, K)
    assert out["released_bytes"] == expect
    assert cache.slot_release_bytes(0) == cache.slot_footprint_bytes() <= filled - expect + 4096 * 4
    with pytest.raises(ValueError, match="outside"):
        cache.slot_release_bytes(K + 1)


def test_rebalance_counts_times_and_reports():
    cache = _warm("50%")
    dry = rebalance(cache, K, dry_run=True)
    assert dry["dry_run"] and cache.num_slots == L * E // 2 and cache.rebalances == 0
    out = rebalance(cache, K)
    split = out["expert_cache"]
    assert out["previous_slots"] == L * E // 2 and split["slots"] == K
    assert split["slot_bytes"] == K * cache.host.expert_bytes
    assert split["floor_slots"] == K and split["slot_capacity"] == L * E
    assert 0 < split["occupied_slots"] <= K
    assert out["released_bytes"] > 0 and out["time_ms"] > 0
    assert cache.rebalances == 1 and cache.last_rebalance_ms > 0
    snap = cache.snapshot()
    assert snap["rebalances"] == 1 and snap["slot_bytes"] == split["slot_bytes"]
    with pytest.raises(RebalanceFailed, match=f"back at {K} slots and keeps serving"):
        rebalance(cache, L * E, on_step=_fail_at("plan"))
    assert cache.rebalance_failures == 1 and cache.num_slots == K
    assert rebalance(cache, L * E)["expert_cache"]["slots"] == L * E
    assert cache.snapshot()["rebalances"] == 2


# ------------------------------------------------- the scheduler's handler (managers module)
class _Alloc:
    def available_size(self):
        return 900

    def get_kvcache(self):
        return type("KV", (), {"mem_usage": 0.5})()


class _Scheduler:
    max_total_num_tokens = 1024
    token_to_kv_pool_allocator = _Alloc()


@pytest.fixture
def served(monkeypatch):
    """``handle(**request fields)``: the scheduler handler's reply for a cache at 50%."""
    from sglang.srt.layers.moe.expert_cache import method
    from sglang.srt.managers.io_struct import RebalanceMemoryReqInput
    from sglang.srt.managers.memory_rebalance import handle_rebalance_memory

    cache = _warm("50%")
    monkeypatch.setattr(method, "_CACHE", cache)

    def handle(**fields):
        return handle_rebalance_memory(_Scheduler(), RebalanceMemoryReqInput(**fields))

    handle.cache = cache
    return handle


def test_handler_reports_resizes_and_refuses(served):
    cache = served.cache
    got = served()  # GET: the current split
    assert got.success and got.status_code == 200
    assert got.split["expert_cache"]["slots"] == L * E // 2
    kv = dict(got.split["kv"])
    assert not kv.pop("kv_resizable") and kv.pop("kv_not_resizable")  # a stand-in pool
    assert kv == {"kv_tokens": 1024, "kv_tokens_free": 900, "kv_bytes": 1 << 29}
    got = served(expert_cache_size=str(K))
    assert got.status_code == 200 and got.split["expert_cache"]["slots"] == K == cache.num_slots
    assert got.split["previous_slots"] == L * E // 2 and got.split["time_ms"] > 0
    got = served(expert_cache_size=str(K - 1))
    assert got.status_code == 400 and not got.success and f"top-k: {K} slots" in got.message
    assert got.split["expert_cache"]["slots"] == K  # the split as it stays
    got = served(expert_cache_size="100%", dry_run=True)
    assert got.status_code == 200 and got.split["dry_run"] and cache.num_slots == K


def test_handler_answers_500_after_a_rollback_and_never_raises(served, monkeypatch):
    cache = served.cache
    real = cache.resize_slots
    monkeypatch.setattr(
        cache, "resize_slots", lambda n, on_step=None: real(n, on_step=_fail_at("gather"))
    )
    got = served(expert_cache_size=str(K))
    assert got.status_code == 500 and f"back at {L * E // 2} slots" in got.message
    assert got.split["expert_cache"]["rebalance_failures"] == 1
    monkeypatch.setattr(cache, "resize_slots", lambda n, on_step=None: 1 / 0)  # a bug
    got = served(expert_cache_size=str(K))
    assert got.status_code == 500 and "ZeroDivisionError" in got.message
    monkeypatch.setattr(cache, "resize_slots", real)
    _outputs_match_resident(cache, seed=24)  # still serving, correctly
    assert served(expert_cache_size=str(K)).status_code == 200


def test_handler_without_the_cache(monkeypatch):
    from sglang.srt.layers.moe.expert_cache import method
    from sglang.srt.managers.io_struct import RebalanceMemoryReqInput
    from sglang.srt.managers.memory_rebalance import handle_rebalance_memory

    monkeypatch.setattr(method, "_CACHE", None)
    got = handle_rebalance_memory(_Scheduler(), RebalanceMemoryReqInput(expert_cache_size="8"))
    assert got.status_code == 400 and "--enable-expert-cache" in got.message
    assert got.split["kv"]["kv_tokens"] == 1024
