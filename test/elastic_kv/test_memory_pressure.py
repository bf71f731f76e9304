"""``--expert-cache-rebalance-reserve`` (``managers/memory_pressure.py``; issue 15, "External
pressure").

* The reserve spec: sizes, percentages, 0 (off), the default, and the errors.
* The probes: ``MemAvailable`` / ``MemTotal`` of a meminfo file, the test capacity file.
* The policy alone: free memory below the reserve shrinks slots first, then KV pages (whole
  pages), never below either floor; what it took is owed and grows back, KV first, only after
  ``grow_after`` checks above the band and never beyond what is owed; a simulated device whose
  other process alternates around the reserve moves once per episode, not at every check.
* The scheduler glue over a real KV pool and radix cache (``KVSim``) with requests holding KV,
  and a real expert-slot cache: the test capacity file (``SGLANG_TEST_REBALANCE_CAPACITY_FILE``)
  lowered below the reserve shrinks through the explicit handler (the split, the counter, the
  log line, the KV accounting and every request's KV stamps check out); raised again, the
  split returns exactly to where it was.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "expert_cache"))

from kv_sim import KVSim  # noqa: E402
from kv_sim import random_prompt as _prompt  # noqa: E402

from sglang.srt.managers import memory_pressure as mp  # noqa: E402
from sglang.srt.managers import memory_rebalance_auto as auto  # noqa: E402
from sglang.srt.managers.memory_pressure import (  # noqa: E402
    CapacityFileProbe,
    HostMemAvailableProbe,
    PressureObservation,
    PressurePolicy,
    Reserve,
)

MB = 10**6


# ------------------------------------------------------------------------- the reserve spec
@pytest.mark.parametrize(
    "spec,total,want",
    [
        (None, 1000 * MB, 50 * MB),  # the default: 5% of the total
        ("", 1000 * MB, 50 * MB),
        ("1GB", 1, 10**9),
        ("512MiB", 1, 512 << 20),
        ("12345", 1, 12345),
        ("10%", 2000 * MB, 200 * MB),
        ("0", 1000 * MB, 0),
        ("0%", 1000 * MB, 0),
    ],
)
def test_reserve_parses_sizes_percentages_and_off(spec, total, want):
    assert Reserve.parse(spec).resolve(total) == want


@pytest.mark.parametrize("spec,match", [("lots", "must be a size"), ("100%", r"\[0, 100\)")])
def test_reserve_errors_name_the_flag(spec, match):
    with pytest.raises(ValueError, match=match) as e:
        Reserve.parse(spec)
    assert "--expert-cache-rebalance-reserve" in str(e.value)


def test_a_bad_reserve_fails_at_startup():
    from types import SimpleNamespace

    from sglang.srt.layers.moe.expert_cache.config import ExpertCacheConfig

    with pytest.raises(ValueError, match="--expert-cache-rebalance-reserve"):
        ExpertCacheConfig.from_server_args(SimpleNamespace(expert_cache_rebalance_reserve="x%"))


# ------------------------------------------------------------------------------ the probes
def test_meminfo_probe_reads_available_not_free(tmp_path):
    f = tmp_path / "meminfo"
    f.write_text("MemTotal:  1000 kB\nMemFree:  100 kB\nMemAvailable:  600 kB\n")
    r = HostMemAvailableProbe(str(f)).read()
    assert (r.free_bytes, r.total_bytes) == (600 * 1024, 1000 * 1024)
    f.write_text("MemTotal:  1000 kB\n")  # a kernel without MemAvailable
    assert HostMemAvailableProbe(str(f)).read() is None
    assert HostMemAvailableProbe(str(tmp_path / "missing")).read() is None


def test_capacity_file_probe_subtracts_the_footprint(tmp_path):
    f = tmp_path / "capacity"
    used = [300]
    probe = CapacityFileProbe(str(f), lambda: used[0])
    assert probe.read() is None  # no file yet
    f.write_text("1000\n")
    assert (probe.read().free_bytes, probe.read().total_bytes) == (700, 1000)
    used[0] = 1200
    assert probe.read().free_bytes == 0  # clamped
    f.write_text("many")
    assert probe.read() is None


# ------------------------------------------------------------------------------ the policy
SLOT = 10 * MB
TOKEN = 10_000  # bytes of one KV token over all layers
PAGE = 16


def _obs(**kw) -> PressureObservation:
    base = dict(
        free_bytes=1000 * MB,
        reserve_bytes=400 * MB,
        slots=40,
        slot_floor=8,
        slot_ceiling=64,
        slot_bytes=SLOT,
        kv_tokens=32768,
        kv_floor=1024,
        kv_ceiling=32768,
        token_bytes=TOKEN,
        page_size=PAGE,
    )
    base.update(kw)
    return PressureObservation(**base)


def _policy(**kw) -> PressurePolicy:
    return PressurePolicy(**{"grow_after": 3, "cooldown": 2, "min_margin_bytes": 0, **kw})


def test_a_deficit_shrinks_slots_first_at_once():
    p = _policy()
    obs = _obs(free_bytes=350 * MB)  # 50 MB below the reserve; margin 100 MB
    move = p.step(obs)
    assert move is not None and move.shrink and "below the reserve" in move.reason
    # the deficit plus half the margin: 100 MB = 10 slots; KV untouched
    assert (move.slots, move.kv_tokens) == (30, obs.kv_tokens)
    assert move.bytes_delta == 10 * SLOT
    p.applied(obs, move.slots, move.kv_tokens)
    assert (p.owed_slots, p.owed_kv_tokens) == (10, 0)


def test_past_the_slot_floor_kv_pages_go_in_whole_pages_never_below_their_floor():
    p = _policy()
    obs = _obs(free_bytes=0)  # 400 MB short + 50 MB: 32 slots (320 MB) then 130 MB of KV
    move = p.step(obs)
    assert move.slots == obs.slot_floor
    taken = obs.kv_tokens - move.kv_tokens
    assert taken % PAGE == 0 and taken * TOKEN >= 130 * MB and (taken - PAGE) * TOKEN < 130 * MB
    # an enormous deficit stops at both floors
    p = _policy()
    move = p.step(_obs(free_bytes=0, reserve_bytes=10**12))
    assert (move.slots, move.kv_tokens) == (8, 1024)
    # already at both floors: nothing to move
    assert _policy().step(_obs(free_bytes=0, slots=8, kv_tokens=1024)) is None


def test_cpu_slots_that_hold_nothing_do_not_count_as_memory_given_back():
    """On the CPU a slot row is committed when first filled: with slots 30..39 grown and never
    filled, a 100 MB deficit takes those 10 and 10 filled ones (by the resident bytes each
    shrink returns), not 10 slots of nominal size that would return nothing."""
    resident = lambda n: max(0, 30 - n) * SLOT  # noqa: E731 - rows [n, 30) are resident
    obs = _obs(free_bytes=350 * MB, slot_release=resident)
    move = _policy().step(obs)
    assert (move.slots, move.kv_tokens) == (20, obs.kv_tokens)
    assert move.bytes_delta == 10 * SLOT
    # a deficit past what the resident slots hold: every slot above the floor, then KV pages
    move = _policy().step(_obs(free_bytes=0, slot_release=resident))
    taken = 32768 - move.kv_tokens
    assert move.slots == 8 and (taken - PAGE) * TOKEN < 450 * MB - 22 * SLOT <= taken * TOKEN
    # every slot above the floor empty: the slots stay, KV pages carry the shrink
    move = _policy().step(_obs(free_bytes=350 * MB, slot_release=lambda n: 0))
    assert move.slots == 40 and move.bytes_delta >= 100 * MB
    assert move.bytes_delta == (32768 - move.kv_tokens) * TOKEN


def test_kv_that_does_not_resize_leaves_the_slots_alone_to_carry_it():
    obs = _obs(free_bytes=0, kv_tokens=0, kv_floor=0, kv_ceiling=0)
    move = _policy().step(obs)
    assert (move.slots, move.kv_tokens) == (8, 0)


def test_growth_waits_for_the_streak_pays_back_kv_first_and_never_more_than_owed():
    p = _policy(grow_after=3, cooldown=2)
    obs = _obs(free_bytes=0)
    move = p.step(obs)
    p.applied(obs, move.slots, move.kv_tokens)
    owed_slots, owed_kv = p.owed_slots, p.owed_kv_tokens
    assert owed_slots == 32 and owed_kv > 0
    shrunk = _obs(free_bytes=10**12, slots=move.slots, kv_tokens=move.kv_tokens)
    assert p.step(shrunk) is None and p.step(shrunk) is None  # the cooldown
    assert p.step(shrunk) is None and p.step(shrunk) is None  # the streak: 1, 2
    grow = p.step(shrunk)  # 3
    assert grow is not None and not grow.shrink
    assert (grow.slots, grow.kv_tokens) == (40, 32768)  # exactly what was taken, no more
    p.applied(shrunk, grow.slots, grow.kv_tokens)
    assert (p.owed_slots, p.owed_kv_tokens) == (0, 0)
    calm = _obs(free_bytes=10**12)
    assert all(p.step(calm) is None for _ in range(20))  # nothing owed: never takes more


def test_a_grow_spends_only_the_free_memory_above_the_band():
    p = _policy(cooldown=0, grow_after=1)
    obs = _obs(free_bytes=0)
    move = p.step(obs)
    p.applied(obs, move.slots, move.kv_tokens)
    # 520 MB free: reserve 400, margin 100, so 520 - 400 - 50 = 70 MB to spend: KV first
    obs = _obs(free_bytes=520 * MB, slots=move.slots, kv_tokens=move.kv_tokens)
    grow = p.step(obs)
    taken = -grow.bytes_delta
    assert 0 < taken <= 70 * MB and grow.slots == obs.slots  # all of it went to KV pages
    assert (grow.kv_tokens - obs.kv_tokens) % PAGE == 0
    assert obs.free_bytes - taken >= obs.reserve_bytes + p.margin(obs.reserve_bytes) // 2


def test_inside_the_band_nothing_moves_and_the_streak_resets():
    p = _policy(cooldown=0, grow_after=2)
    obs = _obs(free_bytes=0)
    move = p.step(obs)
    p.applied(obs, move.slots, move.kv_tokens)
    high = _obs(free_bytes=10**12, slots=move.slots, kv_tokens=move.kv_tokens)
    band = _obs(free_bytes=450 * MB, slots=move.slots, kv_tokens=move.kv_tokens)
    for _ in range(10):  # above, in the band, above, ...: never two in a row
        assert p.step(high) is None
        assert p.step(band) is None
    assert p.step(high) is None and p.step(high) is not None


class _Device:
    """A simulated device: ``capacity`` bytes shared by another process (``other``) and the
    server's pools (slots x SLOT + KV tokens x TOKEN); free = the rest."""

    def __init__(self, capacity: int, slots: int, kv: int) -> None:
        self.capacity, self.slots, self.kv, self.other = capacity, slots, kv, 0

    def free(self) -> int:
        return max(0, self.capacity - self.other - self.slots * SLOT - self.kv * TOKEN)

    def check(self, p: PressurePolicy, **kw):
        obs = _obs(free_bytes=self.free(), slots=self.slots, kv_tokens=self.kv, **kw)
        move = p.step(obs)
        if move is not None:
            self.slots, self.kv = move.slots, move.kv_tokens
            p.applied(obs, move.slots, move.kv_tokens)
        return move


def test_no_oscillation_on_a_simulated_device():
    """Another process takes memory, hovers around the line (its usage jitters by +-30 MB at
    every check), then leaves: one shrink when it arrives, none while it jitters, the split
    comes back exactly once it leaves, and nothing moves afterwards."""
    slots0, kv0 = 40, 32768
    dev = _Device(capacity=slots0 * SLOT + kv0 * TOKEN + 1000 * MB, slots=slots0, kv=kv0)
    p = _policy()
    moves = []
    dev.other = 900 * MB  # free: 100 MB against a 400 MB reserve
    rng = random.Random(5)
    for _ in range(40):
        m = dev.check(p)
        if m is not None:
            moves.append(m)
        dev.other = 900 * MB + rng.randint(-30, 30) * MB
    assert len(moves) == 1 and moves[0].shrink, moves
    assert dev.free() >= 400 * MB - 30 * MB  # it gave back the deficit (plus half the band)
    assert dev.slots >= 8 and dev.kv >= 1024
    dev.other = 0
    for _ in range(40):
        m = dev.check(p)
        if m is not None:
            moves.append(m)
    assert (dev.slots, dev.kv) == (slots0, kv0) and (p.owed_slots, p.owed_kv_tokens) == (0, 0)
    assert sum(not m.shrink for m in moves) >= 1 and len(moves) <= 3, moves
    assert all(dev.check(p) is None for _ in range(40))


def test_readings_alternating_across_the_reserve_shrink_once_then_wait():
    """Free below, then above the band, alternately, at every check (a bursty other process):
    the first low reading shrinks; the grow streak never completes, so it never grows back
    while the bursts go on, and after the shrink the low readings sit in the band."""
    slots0, kv0 = 40, 32768
    dev = _Device(capacity=slots0 * SLOT + kv0 * TOKEN + 1000 * MB, slots=slots0, kv=kv0)
    p = _policy(grow_after=2, cooldown=0)
    moves = []
    for i in range(40):
        dev.other = 700 * MB if i % 2 == 0 else 0  # free: 300 MB, then 1000 MB (+ released)
        m = dev.check(p)
        if m is not None:
            moves.append(m)
    assert len(moves) == 1 and moves[0].shrink, moves


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(grow_after=0), "grow_after"),
        (dict(cooldown=-1), "cooldown"),
        (dict(margin_fraction=2.0), "margin_fraction"),
        (dict(min_margin_bytes=-1), "min_margin_bytes"),
    ],
)
def test_policy_rejects_bad_settings(kw, match):
    with pytest.raises(ValueError, match=match):
        PressurePolicy(**kw)


# -------------------------------------------------------------- the scheduler glue (KVSim)
@pytest.fixture
def served(monkeypatch, tmp_path):
    from test_slot_cache import make_cache, routing

    from sglang.srt.layers.moe.expert_cache import method

    cache = make_cache("50%", "fill")
    for layer, x, w, ids in routing(steps=6, seed=11):
        cache.forward(layer, x, w, ids)
    monkeypatch.setattr(method, "_CACHE", cache)
    monkeypatch.setattr(auto, "CHECK_EVERY", 1)
    monkeypatch.setattr(auto, "_enabled", lambda s: False)  # pressure alone
    capacity = tmp_path / "capacity"
    monkeypatch.setenv(mp.CAPACITY_FILE_ENV, str(capacity))
    sim = KVSim(kv_tokens=96, rows=12, context=64)
    rng = random.Random(3)
    for _ in range(6):
        sim.admit(_prompt(rng))
    sim.merge_last_batch()
    sched = sim.scheduler(waiting_queue=[], new_token_ratio=0.4)
    return sim, sched, cache, capacity


def test_the_capacity_file_shrinks_the_server_and_it_grows_back(served, monkeypatch, caplog):
    sim, sched, cache, capacity = served
    el = sim.elastic
    slots0, kv0 = cache.num_slots, el.size
    fp0 = mp.footprint_bytes(cache, el)
    # another process will take every slot above the floor and two KV pages
    room = (slots0 - cache.top_k) * cache.host.expert_bytes + 2 * el.page_size * el.token_bytes
    reserve = 2 * room
    monkeypatch.setattr(mp, "_reserve_flag", lambda: (str(reserve), True))
    capacity.write_text(str(fp0 + 2 * reserve))  # calm: free = 2 x the reserve
    auto.maybe_auto_rebalance(sched)
    st = sched._pressure_rebalance
    assert st.inactive is None and st.probe.name == "test capacity file"
    st.policy = PressurePolicy(grow_after=2, cooldown=1, min_margin_bytes=0)
    for _ in range(5):
        auto.maybe_auto_rebalance(sched)
    assert (cache.num_slots, el.size) == (slots0, kv0)
    capacity.write_text(str(fp0 + reserve - room))
    with caplog.at_level("INFO", logger=mp.logger.name):
        auto.maybe_auto_rebalance(sched)
    assert cache.num_slots == cache.top_k and el.size < kv0, (cache.num_slots, el.size)
    assert el.size >= el.floor()
    assert cache.pressure_rebalances == 1 and cache.snapshot()["pressure_rebalances"] == 1
    assert sched.max_total_num_tokens == el.size  # through the handler: the copies followed
    assert sim.accounting() == [] and sim.kv_problems() == []
    line = next(r.message for r in caplog.records if "rebalance reserve:" in r.message)
    assert "below the reserve" in line and f"slots {slots0} -> {cache.top_k}" in line, line
    assert f"KV tokens {kv0} -> {el.size}" in line, line
    assert mp.pressure_split(sched)["owed_slots"] == slots0 - cache.top_k
    for _ in range(10):  # still under pressure, at the new split: no more moves
        auto.maybe_auto_rebalance(sched)
    assert cache.pressure_rebalances == 1
    # the other process leaves: back exactly to the split it started with
    capacity.write_text(str(fp0 + 2 * reserve))
    for _ in range(10):
        auto.maybe_auto_rebalance(sched)
    assert (cache.num_slots, el.size) == (slots0, kv0)
    assert sim.accounting() == [] and sim.kv_problems() == []
    assert st.failures == 0 and cache.pressure_rebalances >= 2
    moves = cache.pressure_rebalances
    for _ in range(10):
        auto.maybe_auto_rebalance(sched)
    assert cache.pressure_rebalances == moves


def test_an_explicit_rebalance_clears_what_is_owed(served, monkeypatch):
    from sglang.srt.managers.io_struct import RebalanceMemoryReqInput
    from sglang.srt.managers.memory_rebalance import handle_rebalance_memory

    sim, sched, cache, capacity = served
    fp0 = mp.footprint_bytes(cache, sim.elastic)
    monkeypatch.setattr(mp, "_reserve_flag", lambda: ("1000", True))
    capacity.write_text(str(fp0 + 500))  # 500 bytes free: below the reserve
    auto.maybe_auto_rebalance(sched)
    assert sched._pressure_rebalance.policy.owed_slots > 0
    out = handle_rebalance_memory(sched, RebalanceMemoryReqInput(expert_cache_size="16"))
    assert out.success, out.message
    assert sched._pressure_rebalance.policy.owed_slots == 0
    assert out.split["memory_pressure"]["active"] is True


def test_reserve_zero_or_rebalance_off_keeps_pressure_inactive(served, monkeypatch):
    sim, sched, cache, capacity = served
    capacity.write_text("0")  # no memory free at all
    slots = cache.num_slots
    monkeypatch.setattr(mp, "_reserve_flag", lambda: ("0", True))
    for _ in range(3):
        auto.maybe_auto_rebalance(sched)
    assert sched._pressure_rebalance.inactive == "--expert-cache-rebalance-reserve 0"
    del sched._pressure_rebalance
    monkeypatch.setattr(mp, "_reserve_flag", lambda: ("1GB", False))
    for _ in range(3):
        auto.maybe_auto_rebalance(sched)
    assert sched._pressure_rebalance.inactive == "--expert-cache-rebalance off"
    assert cache.num_slots == slots and cache.pressure_rebalances == 0


def test_where_a_shrink_frees_nothing_pressure_stays_off(served, monkeypatch, caplog):
    """CUDA slots (one allocation of the startup size) without resizable KV pages: a shrink
    would free nothing and only slow the server down, so pressure mode stays off, with one
    warning, however little memory is free."""
    import torch

    from sglang.srt.mem_cache.elastic_kv import scheduler_glue

    sim, sched, cache, capacity = served
    capacity.write_text("0")
    slots = cache.num_slots
    monkeypatch.setattr(mp, "_reserve_flag", lambda: ("1000", True))
    monkeypatch.setattr(scheduler_glue, "elastic_kv_of", lambda s: (None, "a CUDA pool"))
    monkeypatch.setattr(cache, "device", torch.device("cuda"))
    with caplog.at_level("WARNING", logger=mp.logger.name):
        for _ in range(5):
            mp.maybe_pressure_rebalance(sched, idle=True)
    assert "return no device memory" in sched._pressure_rebalance.inactive
    assert "a CUDA pool" in sched._pressure_rebalance.inactive
    assert sum("reserve is inactive" in r.message for r in caplog.records) == 1
    assert cache.num_slots == slots and cache.pressure_rebalances == 0
    assert mp.shrink_frees_memory(cache, sim.elastic)  # resizable KV pages would do


def _under_pressure(served, monkeypatch):
    """The served scheduler with free memory well below a reserve (a shrink is due)."""
    sim, sched, cache, capacity = served
    fp0 = mp.footprint_bytes(cache, sim.elastic)
    reserve = 4 * cache.host.expert_bytes
    monkeypatch.setattr(mp, "_reserve_flag", lambda: (str(reserve), True))
    capacity.write_text(str(fp0 + reserve // 2))
    return sim, sched, cache


def test_a_shrink_that_returns_no_memory_is_undone_and_pressure_stops(served, monkeypatch, caplog):
    """A shrink whose answer says 0 bytes were released (the pools could not give their tails
    back) only slowed the server down: it is undone through the handler at once and pressure
    mode turns itself off, with one warning."""
    sim, sched, cache = _under_pressure(served, monkeypatch)
    slots0, kv0 = cache.num_slots, sim.elastic.size
    real = mp._handle
    calls = []

    def no_release(scheduler, slots, kv_tokens):
        out = real(scheduler, slots, kv_tokens)
        calls.append((slots, kv_tokens))
        if out.success and out.split is not None:
            out.split["released_bytes"] = 0
        return out

    monkeypatch.setattr(mp, "_handle", no_release)
    with caplog.at_level("WARNING", logger=mp.logger.name):
        for _ in range(6):
            mp.maybe_pressure_rebalance(sched, idle=True)
    assert len(calls) == 2 and calls[0][0] < slots0, calls  # the shrink, then its undo
    assert calls[1] == (slots0, kv0)
    assert (cache.num_slots, sim.elastic.size) == (slots0, kv0)
    st = sched._pressure_rebalance
    assert "returned no memory" in st.inactive and "undone: yes" in st.inactive
    assert sum("reserve is inactive" in r.message for r in caplog.records) == 1
    assert mp.pressure_split(sched) == {"active": False, "why": st.inactive}
    assert sim.accounting() == [] and sim.kv_problems() == []


def test_a_refused_move_backs_off_and_warns_once(served, monkeypatch, caplog):
    """A move the handler refuses is not retried at every check: the cooldown doubles after
    each failure (up to 64x), and one warning covers the run of failures."""
    from sglang.srt.managers.io_struct import RebalanceMemoryReqOutput

    sim, sched, cache = _under_pressure(served, monkeypatch)
    slots0 = cache.num_slots
    tries = []

    def refuse(scheduler, slots, kv_tokens):
        tries.append(slots)
        return RebalanceMemoryReqOutput(success=False, status_code=400, message="refused")

    monkeypatch.setattr(mp, "_handle", refuse)
    mp.maybe_pressure_rebalance(sched, idle=True)  # builds the state with the default policy
    sched._pressure_rebalance.policy = PressurePolicy(cooldown=1, min_margin_bytes=0)
    with caplog.at_level("WARNING", logger=mp.logger.name):
        for _ in range(60):
            mp.maybe_pressure_rebalance(sched, idle=True)
    # cooldowns 1, 2, 4, 8, 16, 32 checks between tries: 6 tries in 60 checks, not 30+
    assert 4 <= len(tries) <= 7, len(tries)
    st = sched._pressure_rebalance
    assert st.failures == len(tries)
    assert sum("refused or failed" in r.message for r in caplog.records) == 1
    assert cache.num_slots == slots0 and st.inactive is None
