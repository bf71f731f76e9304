"""``--expert-cache-rebalance auto`` (``managers/memory_rebalance_auto.py``; issue 15).

* The policy alone: sustained KV pressure grows KV by taking slots after ``grow_after``
  checks, in whole pages and never below the slot floor; a calm pool gives slots back after
  ``shrink_after`` checks without dropping below the KV floor or the low-water mark; a
  cooldown follows each move; alternating demand moves nothing.
* The scheduler glue over a real KV pool and radix cache (``KVSim``) and a real expert-slot
  cache: a waiting request that does not fit the free KV tokens makes auto take slots for KV
  pages through the explicit handler's path (the split, the counters, the KV accounting and
  every request's KV stamps check out), and a pool left mostly free gives them back.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "expert_cache"))

from kv_sim import KVSim  # noqa: E402
from kv_sim import random_prompt as _prompt  # noqa: E402

from sglang.srt.managers import memory_rebalance_auto as auto  # noqa: E402
from sglang.srt.managers.memory_rebalance_auto import (  # noqa: E402
    AutoRebalancePolicy,
    Move,
    Observation,
)


def _obs(**kw) -> Observation:
    base = dict(
        kv_blocked=0,
        retracted=0,
        kv_free_fraction=0.3,
        kv_tokens=1024,
        kv_floor=64,
        kv_ceiling=8192,
        page_size=16,
        slots=40,
        slot_floor=8,
        slot_ceiling=40,
        tokens_per_slot=100.0,
        running=1,  # a busy server unless a test says otherwise
    )
    base.update(kw)
    return Observation(**base)


def _apply(obs: Observation, move: Move) -> Observation:
    d = dict(obs.__dict__)
    d.update(slots=move.slots, kv_tokens=move.kv_tokens)
    return Observation(**d)


# ------------------------------------------------------------------------------ the policy
def test_pressure_grows_kv_in_pages_after_the_streak_then_cools_down():
    p = AutoRebalancePolicy(grow_after=2, cooldown=3, step_slots=4)
    obs = _obs(kv_blocked=3)
    assert p.step(obs) is None  # one check of pressure is not a streak
    move = p.step(obs)
    assert move is not None and "waiting for KV pages" in move.reason
    assert move.slots == 36 and move.kv_tokens == 1024 + 400 // 16 * 16
    assert (move.kv_tokens - obs.kv_tokens) % obs.page_size == 0
    # never more bytes than before: the tokens gained fit in the slots given up
    assert (move.kv_tokens - obs.kv_tokens) <= (obs.slots - move.slots) * obs.tokens_per_slot
    obs = _apply(obs, move)
    assert [p.step(obs) for _ in range(3)] == [None] * 3  # cooldown
    assert p.step(obs) is None  # the streak starts again after it
    assert p.step(obs) is not None


def test_a_burst_grows_by_its_shortfall_capped_at_a_share_of_the_spare_slots():
    p = AutoRebalancePolicy(grow_after=1, step_slots=4, max_grow_share=0.5)
    # 1000 tokens short: 10 slots (above step_slots, below half of the 32 spare)
    move = p.step(_obs(kv_blocked=5, kv_shortfall=1000))
    assert move.slots == 30 and move.kv_tokens == 1024 + 992  # 1000 tokens, down to pages
    # 10000 short: capped at half the 32 slots above the floor
    p = AutoRebalancePolicy(grow_after=1, step_slots=4, max_grow_share=0.5)
    move = p.step(_obs(kv_blocked=5, kv_shortfall=10000))
    assert move.slots == 40 - 16
    # a small shortfall still moves step_slots
    p = AutoRebalancePolicy(grow_after=1, step_slots=4)
    assert p.step(_obs(kv_blocked=1, kv_shortfall=10)).slots == 36


def test_retractions_count_as_pressure():
    p = AutoRebalancePolicy(grow_after=1, step_slots=2)
    move = p.step(_obs(retracted=2))
    assert move is not None and "retracted" in move.reason and move.slots == 38


def test_slot_floor_is_never_crossed():
    p = AutoRebalancePolicy(grow_after=1, cooldown=0, step_slots=16)
    obs = _obs(kv_blocked=1, slots=12, slot_floor=8)
    seen = []
    for _ in range(10):
        move = p.step(obs)
        if move is not None:
            seen.append(move.slots)
            obs = _apply(obs, move)
    assert seen == [8]  # one move of the 4 slots above the floor, then nothing to take
    assert p.step(_obs(kv_blocked=1, slots=8, slot_floor=8)) is None


def test_kv_ceiling_caps_the_grow_and_takes_only_the_slots_it_needs():
    p = AutoRebalancePolicy(grow_after=1, step_slots=8)
    move = p.step(_obs(kv_blocked=1, kv_tokens=1024, kv_ceiling=1024 + 160))
    assert move.kv_tokens == 1024 + 160 and move.slots == 40 - 2  # ceil(160 / 100)
    p = AutoRebalancePolicy(grow_after=1)
    assert p.step(_obs(kv_blocked=1, kv_ceiling=1024)) is None  # no room: no move


def test_calm_gives_slots_back_up_to_the_ceiling_keeping_free_kv():
    p = AutoRebalancePolicy(shrink_after=3, cooldown=0, step_slots=4, low_water=0.25)
    obs = _obs(kv_free_fraction=0.9, slots=30, slot_ceiling=40, kv_tokens=4000)
    assert p.step(obs) is None and p.step(obs) is None
    move = p.step(obs)
    assert move is not None and "grow back" in move.reason
    assert move.slots == 34 and move.kv_tokens == 4000 - 400
    assert (obs.kv_tokens - move.kv_tokens) >= (move.slots - obs.slots) * obs.tokens_per_slot
    # a small pool: the give-back shrinks to keep a quarter of it free
    p = AutoRebalancePolicy(shrink_after=1, step_slots=4, low_water=0.25)
    move = p.step(_obs(kv_free_fraction=0.5, slots=30, kv_tokens=800, kv_floor=16))
    assert move is not None and move.slots == 32  # 200 tokens: 400 - 208 >= 0.25 * 592
    # at the ceiling, or with the pool at its floor: nothing
    p = AutoRebalancePolicy(shrink_after=1)
    assert p.step(_obs(kv_free_fraction=0.9, slots=40)) is None
    assert p.step(_obs(kv_free_fraction=0.9, slots=30, kv_floor=1024)) is None


def test_no_give_back_while_requests_wait():
    """During a burst, finished requests leave evictable prefixes (counted free), so the pool
    can look mostly free with requests still queued: no slots come back until the queue is
    empty."""
    p = AutoRebalancePolicy(shrink_after=2, step_slots=4)
    busy = _obs(kv_free_fraction=0.9, slots=30, kv_tokens=4000, waiting=3)
    assert all(p.step(busy) is None for _ in range(20))
    idle = _obs(kv_free_fraction=0.9, slots=30, kv_tokens=4000, waiting=0)
    assert p.step(idle) is None and p.step(idle) is not None


def test_an_idle_server_gets_every_slot_back_in_one_move():
    p = AutoRebalancePolicy(shrink_after=1, step_slots=4)
    move = p.step(_obs(kv_free_fraction=1.0, slots=10, kv_tokens=6000, waiting=0, running=0))
    assert move.slots == 40 and move.kv_tokens == 6000 - 3008  # 3000 tokens, up to pages
    p = AutoRebalancePolicy(shrink_after=1, step_slots=4)
    busy = _obs(kv_free_fraction=1.0, slots=10, kv_tokens=6000, waiting=0, running=2)
    assert p.step(busy).slots == 14


def test_alternating_demand_never_moves():
    p = AutoRebalancePolicy(grow_after=2, shrink_after=2, cooldown=1)
    hot = _obs(kv_blocked=4, slots=30)
    cold = _obs(kv_free_fraction=0.95, slots=30)
    mid = _obs(kv_free_fraction=0.3, slots=30)
    for i in range(200):
        assert p.step((hot, cold, hot, mid)[i % 4]) is None


def test_rising_then_falling_demand_moves_each_way_without_flapping():
    p = AutoRebalancePolicy(grow_after=2, shrink_after=4, cooldown=2, step_slots=4)
    obs = _obs(slots=40, kv_tokens=1024)
    moves = []
    for i in range(60):
        hot = i < 20
        cur = _obs(
            kv_blocked=2 if hot else 0,
            kv_free_fraction=0.05 if hot else 0.95,
            slots=obs.slots,
            kv_tokens=obs.kv_tokens,
        )
        move = p.step(cur)
        if move is not None:
            moves.append("grow_kv" if move.slots < obs.slots else "grow_slots")
            obs = _apply(cur, move)
    assert moves[0] == "grow_kv" and "grow_slots" in moves
    first_back = moves.index("grow_slots")
    assert set(moves[:first_back]) == {"grow_kv"}
    assert set(moves[first_back:]) == {"grow_slots"}  # one direction change, no flapping
    assert obs.slots == 40  # every slot came back


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="high_water"):
        AutoRebalancePolicy(low_water=0.6, high_water=0.5)
    with pytest.raises(ValueError, match="grow_after"):
        AutoRebalancePolicy(grow_after=0)
    with pytest.raises(ValueError, match="max_grow_share"):
        AutoRebalancePolicy(max_grow_share=0)


# -------------------------------------------------------------- the scheduler glue (KVSim)
@pytest.fixture
def served(monkeypatch):
    from test_slot_cache import E, make_cache, routing

    from sglang.srt.layers.moe.expert_cache import method

    cache = make_cache("50%", "fill")
    for layer, x, w, ids in routing(steps=6, seed=11):
        cache.forward(layer, x, w, ids)
    monkeypatch.setattr(method, "_CACHE", cache)
    monkeypatch.setattr(auto, "CHECK_EVERY", 1)
    # auto alone: no reserve (the host's free memory must not move the split here)
    from sglang.srt.managers import memory_pressure

    monkeypatch.setattr(memory_pressure, "_reserve_flag", lambda: ("0", True))
    sim = KVSim(kv_tokens=96, rows=12, context=64)
    rng = random.Random(3)
    for _ in range(6):
        sim.admit(_prompt(rng))
    sim.merge_last_batch()
    sched = sim.scheduler(waiting_queue=[], new_token_ratio=0.4)
    return sim, sched, cache, E


def _waiting_req(sim, n_tokens: int):
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    return Req("waiting", "", list(range(20, 20 + n_tokens)), SamplingParams(max_new_tokens=8))


def test_a_kv_starved_queue_takes_slots_and_calm_gives_them_back(served, caplog):
    sim, sched, cache, _ = served
    slots0, kv0 = cache.num_slots, sim.elastic.size
    # the head of the queue needs more tokens than the pool has free
    free = int(sim.alloc.available_size()) + sim.elastic.evictable_tokens()
    sched.waiting_queue = [_waiting_req(sim, free + 8)]
    with caplog.at_level("INFO", logger=auto.logger.name):
        for _ in range(3):
            auto.maybe_auto_rebalance(sched)
    assert cache.num_slots < slots0 and sim.elastic.size > kv0
    assert cache.num_slots >= cache.top_k
    assert cache.auto_rebalances == 1 and cache.snapshot()["auto_rebalances"] == 1
    assert sched.max_total_num_tokens == sim.elastic.size  # the scheduler's copy followed
    taken = (slots0 - cache.num_slots) * cache.host.expert_bytes
    assert (sim.elastic.size - kv0) * sim.elastic.token_bytes <= taken
    assert any(
        "KV grows" in r.message and f"{slots0} -> {cache.num_slots}" in r.message
        for r in caplog.records
    )
    assert sim.accounting() == [] and sim.kv_problems() == []
    # the queue drains; the pool stays mostly free: the slots come back
    sched.waiting_queue = []
    st = sched._auto_rebalance
    for _ in range(st.policy.cooldown + st.policy.shrink_after * 20):
        auto.maybe_auto_rebalance(sched)
        if cache.num_slots == slots0:
            break
    assert cache.num_slots == slots0 and sim.elastic.size >= sim.elastic.floor()
    assert sim.accounting() == [] and sim.kv_problems() == []
    assert st.failures == 0


def test_off_flag_and_unresizable_kv_keep_auto_inactive(served, monkeypatch, caplog):
    sim, sched, cache, _ = served
    monkeypatch.setattr(auto, "_enabled", lambda s: False)
    sched.waiting_queue = [_waiting_req(sim, 500)]
    for _ in range(5):
        auto.maybe_auto_rebalance(sched)
    assert sched._auto_rebalance.inactive == "--expert-cache-rebalance off"
    slots = cache.num_slots
    assert cache.num_slots == slots and getattr(cache, "auto_rebalances", 0) == 0

    from sglang.srt.mem_cache.elastic_kv import scheduler_glue

    monkeypatch.setattr(auto, "_enabled", lambda s: True)
    monkeypatch.setattr(scheduler_glue, "elastic_kv_of", lambda s: (None, "a CUDA pool"))
    sched2 = sim.scheduler(waiting_queue=[_waiting_req(sim, 500)], new_token_ratio=0.4)
    with caplog.at_level("INFO", logger=auto.logger.name):
        for _ in range(5):
            auto.maybe_auto_rebalance(sched2)
    lines = [r.message for r in caplog.records if "inactive" in r.message]
    assert len(lines) == 1 and "a CUDA pool" in lines[0]
    assert cache.num_slots == slots


def test_without_an_expert_cache_auto_stops_looking(monkeypatch):
    """A server without the cache: the first call records auto (and the reserve's pressure
    mode, which runs first) as inactive, and later calls return at once (no lookup of the cache
    at every scheduler iteration)."""
    from types import SimpleNamespace

    from sglang.srt.layers.moe.expert_cache import method

    calls = []
    monkeypatch.setattr(method, "get_expert_slot_cache", lambda: calls.append(1))
    sched = SimpleNamespace(waiting_queue=[], running_batch=SimpleNamespace(reqs=[]))
    for _ in range(5):
        auto.maybe_auto_rebalance(sched)
    assert sched._auto_rebalance.inactive == "no expert cache"
    assert sched._pressure_rebalance.inactive == "no expert cache"
    assert len(calls) == 2  # one lookup each


def test_slot_floor_counts_two_layers_with_prefill_streaming(served):
    _, _, cache, E = served
    assert auto.slot_floor(cache) == (2 * E if cache.prefill_stream.enabled else cache.top_k)
    cache.prefill_stream.mode = "force"
    assert auto.slot_floor(cache) == 2 * E
