"""``/rebalance_memory``'s scheduler handler over a real KV pool and radix cache (``KVSim``),
and the budget split (``managers/memory_budget.py``), without a server: ``kv_tokens`` and
``device_memory_budget`` shrink and grow KV pages with requests holding KV, the split reports
tokens and bytes, refusals name the floor or the largest feasible budget, and the scheduler's
copies of the pool size follow."""

from __future__ import annotations

import random

import pytest
from kv_sim import KVSim
from kv_sim import random_prompt as _prompt

from sglang.srt.managers.memory_budget import BudgetRefused, Side, split_budget


@pytest.fixture
def handled(monkeypatch):
    from sglang.srt.layers.moe.expert_cache import method
    from sglang.srt.managers.io_struct import RebalanceMemoryReqInput
    from sglang.srt.managers.memory_rebalance import handle_rebalance_memory

    monkeypatch.setattr(method, "_CACHE", None)  # a server without the expert cache
    sim = KVSim(kv_tokens=96, max_tokens=128)
    rng = random.Random(2)
    for _ in range(12):
        sim.admit(_prompt(rng))
    for r in list(sim.running)[::2]:
        sim.finish(r)
    sched = sim.scheduler()  # the 12 admitted requests are the last prefill batch

    def handle(**fields):
        return handle_rebalance_memory(sched, RebalanceMemoryReqInput(**fields))

    handle.sim, handle.sched = sim, sched
    return handle


def _handler(sim):
    from sglang.srt.managers.io_struct import RebalanceMemoryReqInput
    from sglang.srt.managers.memory_rebalance import handle_rebalance_memory

    sched = sim.scheduler()
    return sched, lambda **f: handle_rebalance_memory(sched, RebalanceMemoryReqInput(**f))


def _run_to_completion(sim, rng) -> None:
    """Every running request decodes to its ``max_new_tokens`` (8); a decode without KV pages
    is what upstream answers with a retraction."""
    sim.merge_last_batch()
    for req in list(sim.running):
        while len(req.output_ids) < req.sampling_params.max_new_tokens:
            assert sim.decode(req, rng.randint(20, 60)), f"{req.rid} would be retracted"
        sim.finish(req)


@pytest.mark.parametrize("page_size", [1, 4])
def test_floor_counts_the_last_prefill_batch(monkeypatch, page_size):
    """Requests prefilled in the previous iteration (``last_batch``, not merged into the running
    batch yet) and requests finished in it (still in ``running_batch``): the floor reserves the
    former's remaining output and nothing for the latter; a shrink to the floor retracts
    nobody and leaks no page (with pages of 4, a request's partly filled last page is its own,
    not the tree's)."""
    from sglang.srt.layers.moe.expert_cache import method

    monkeypatch.setattr(method, "_CACHE", None)
    sim = KVSim(kv_tokens=256, max_tokens=256, page_size=page_size, rows=12)
    rng = random.Random(7)
    for _ in range(4):
        sim.admit(_prompt(rng))
    sim.merge_last_batch()
    for req in list(sim.running)[:2]:
        sim.decode(req, 30)
    sim.finish(sim.running[0])  # finished in the last step: still in running_batch
    for _ in range(5):
        assert sim.admit(_prompt(rng)) is not None  # the last prefill batch
    sched, handle = _handler(sim)
    assert sched.last_batch is not None and len(sched.last_batch.reqs) == 5
    floor = handle().split["kv"]["kv_floor_tokens"]
    if page_size == 1:
        assert floor == sim.elastic.floor() + sum(8 - len(r.output_ids) for r in sim.running)
    got = handle(kv_tokens=floor)
    assert got.status_code == 200, got.message
    assert sim.elastic.size == floor and sim.accounting() == []
    _run_to_completion(sim, rng)
    assert sim.accounting() == [] and sim.kv_problems() == []


def test_kv_tokens_shrink_and_grow(handled):
    sim, sched = handled.sim, handled.sched
    got = handled()
    kv = got.split["kv"]
    assert got.status_code == 200 and kv["kv_resizable"] and kv["kv_tokens"] == 96
    tb = kv["kv_token_bytes"]
    assert tb == 2 * 1 * (4 + 4) * 4 and kv["kv_bytes"] == 97 * tb
    reserve = sum(8 - len(r.output_ids) for r in sim.running)
    assert kv["kv_floor_tokens"] == sim.elastic.floor() + reserve
    floor = kv["kv_floor_tokens"]
    got = handled(kv_tokens=floor)
    assert got.status_code == 200, got.message
    assert got.split["kv"]["kv_tokens"] == floor == sched.max_total_num_tokens
    assert sched.invariant_checker.max_total_num_tokens == floor
    assert got.split["previous_kv_tokens"] == 96 and got.split["kv_resize"]["moved_pages"] >= 0
    assert sim.accounting() == [] and sim.kv_problems() == []
    got = handled(kv_tokens=floor - 1)
    assert got.status_code == 400 and f"below the floor of {floor} tokens" in got.message
    got = handled(kv_tokens=129)
    assert got.status_code == 400 and "largest feasible target, 128 tokens" in got.message
    got = handled(kv_tokens=128)
    assert got.status_code == 200 and sched.max_total_num_tokens == 128
    assert sim.accounting() == [] and sim.kv_problems() == []
    got = handled(kv_tokens=64, dry_run=True)
    assert got.status_code == 200 and got.split["dry_run"] and sim.elastic.size == 128


def test_budget_goes_to_kv_without_the_cache(handled):
    sim = handled.sim
    tb = sim.elastic.token_bytes
    got = handled(device_memory_budget=(64 + 1) * tb + tb // 2)  # 64 tokens + the padding row
    assert got.status_code == 200, got.message
    assert got.split["kv"]["kv_tokens"] == 64 and got.split["kv"]["kv_bytes"] == 65 * tb
    assert sim.accounting() == [] and sim.kv_problems() == []
    got = handled(device_memory_budget=10)
    assert got.status_code == 400 and "the smallest feasible budget is" in got.message
    got = handled(expert_cache_size="8")
    assert got.status_code == 400 and "--enable-expert-cache" in got.message


def test_split_budget_proportion_floors_and_ceilings():
    kv = Side(unit_bytes=100, fixed_bytes=100, floor=10, ceiling=1000, current=300)
    slots = Side(unit_bytes=1000, floor=8, ceiling=64, current=30)  # now: 30100 KV, 30000 slots
    k, s = split_budget(30100, kv, slots)  # half the bytes: the same proportion
    assert (k, s) == (150, 15) and kv.bytes_of(k) + slots.bytes_of(s) <= 30100
    k, s = split_budget(30100, kv, slots, kv_share=0.9)
    assert s == 8 and k == (30100 - 8000 - 100) // 100  # slots at their floor, KV the rest
    k, s = split_budget(150000, kv, slots, kv_share=0.01)
    assert s == 64 and k == (150000 - 64000 - 100) // 100  # slots full, KV the rest
    with pytest.raises(BudgetRefused, match="smallest feasible budget is 9100 bytes"):
        split_budget(9099, kv, slots)
    with pytest.raises(BudgetRefused, match="largest feasible budget, 164100 bytes"):
        split_budget(164101, kv, slots)
    paged = Side(unit_bytes=10, fixed_bytes=40, floor=8, ceiling=400, current=100, step=4)
    assert split_budget(40 + 10 * 103, paged, None) == (100, 0)  # whole pages only


@pytest.fixture
def handled_with_cache(handled, monkeypatch):
    """``handled`` with an expert-slot cache at 50% (``test/expert_cache``'s tiny one)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "expert_cache"))
    from test_slot_cache import E, L, make_cache

    from sglang.srt.layers.moe.expert_cache import method

    cache = make_cache("50%", "fill")
    monkeypatch.setattr(method, "_CACHE", cache)
    handled.cache, handled.pool = cache, L * E
    return handled


def test_budget_splits_kv_and_slots(handled_with_cache):
    h, sim, cache = handled_with_cache, handled_with_cache.sim, handled_with_cache.cache
    split = h().split
    kv_b, slot_b = split["kv"]["kv_bytes"], split["expert_cache"]["slot_bytes"]
    eb, tb = cache.host.expert_bytes, split["kv"]["kv_token_bytes"]
    got = h(device_memory_budget=kv_b + slot_b - 8 * eb)  # 8 slots' worth less, same proportion
    assert got.status_code == 200, got.message
    kv, slots = got.split["kv"], got.split["expert_cache"]
    assert kv["kv_bytes"] + slots["slot_bytes"] <= kv_b + slot_b - 8 * eb
    # the KV side's share is ~1.4% (the tiny cache's experts are big next to its KV): the slots
    # get their proportional whole slots, KV its share plus the part of a slot left over
    budget = kv_b + slot_b - 8 * eb
    assert slots["slots"] == int(budget * (1 - kv_b / (kv_b + slot_b)) - tb) // eb
    assert kv["kv_tokens"] == min(128, (budget - slots["slot_bytes"]) // tb - 1)
    assert sim.accounting() == [] and sim.kv_problems() == []
    got = h(device_memory_budget=h.pool * eb + 100 * tb, kv_share=0.001)  # slots at the ceiling
    assert got.status_code == 200 and got.split["expert_cache"]["slots"] == h.pool
    assert got.split["kv"]["kv_tokens"] == 99  # KV the rest (its floor is below that)


def test_second_part_fails_first_undone(handled_with_cache, monkeypatch):
    """A KV shrink then a slot grow that fails: the KV shrink is undone, the answer a 500."""
    h, sim, cache = handled_with_cache, handled_with_cache.sim, handled_with_cache.cache
    slots_before = cache.num_slots

    def broken(n, on_step=None):
        raise MemoryError("injected: no memory for the slots")

    monkeypatch.setattr(cache, "resize_slots", broken)
    floor = h().split["kv"]["kv_floor_tokens"]
    got = h(kv_tokens=floor, expert_cache_size="100%")
    assert got.status_code == 500 and "undone: kv back at 96" in got.message, got.message
    assert (
        sim.elastic.size == 96 == h.sched.max_total_num_tokens and cache.num_slots == slots_before
    )
    assert got.split["kv"]["kv_resizes"] == 2  # the shrink and its undo
    assert sim.accounting() == [] and sim.kv_problems() == []
    for _ in range(10):  # and the pools serve on
        sim.admit(_prompt(random.Random(_)))
    assert sim.accounting() == [] and sim.kv_problems() == []


def test_reserve_rounds_pages_per_request(monkeypatch):
    """Pages of 4, three requests whose last page is full and that need one more token each:
    three new pages (12 tokens), not 3 tokens rounded to one page; a shrink to the floor then
    lets all three finish."""
    from sglang.srt.layers.moe.expert_cache import method
    from sglang.srt.mem_cache.elastic_kv.scheduler_glue import reserve_tokens

    monkeypatch.setattr(method, "_CACHE", None)
    sim = KVSim(kv_tokens=128, max_tokens=128, page_size=4)
    rng = random.Random(3)
    for prompt in ([21, 22], [23, 24], [25, 26]):
        sim.admit(prompt)
    sim.merge_last_batch()
    for req in sim.running:  # 7 of 8 tokens out: KV at positions 0..7, two full pages
        while len(req.output_ids) < 7:
            assert sim.decode(req, rng.randint(20, 60))
        assert req.kv.kv_allocated_len == 8
    sched, handle = _handler(sim)
    assert reserve_tokens(sched) == 3 * 4
    floor = handle().split["kv"]["kv_floor_tokens"]
    assert floor == sim.elastic.floor() + 12
    assert handle(kv_tokens=floor).status_code == 200
    _run_to_completion(sim, rng)
    assert sim.accounting() == [] and sim.kv_problems() == []


def test_reserve_counts_a_resumed_request_from_its_fill_ids():
    """A chunked prefill of a retracted request re-prefills ``origin_input_ids + output_ids``
    and then decodes to ``max_new_tokens``; a fresh one the prompt alone."""
    from types import SimpleNamespace

    from sglang.srt.mem_cache.elastic_kv.scheduler_glue import remaining_tokens, reserve_tokens

    def req(outputs, allocated):
        return SimpleNamespace(
            origin_input_ids=[1] * 10,
            output_ids=[2] * outputs,
            sampling_params=SimpleNamespace(max_new_tokens=8),
            kv=SimpleNamespace(req_pool_idx=0, kv_allocated_len=allocated),
            finished=lambda: False,
        )

    resumed, fresh = req(5, 8), req(0, 8)
    # both end at 10 + 8 - 1 = 17 positions: the resumed one has 9 to go, 5 + 2 before
    assert remaining_tokens(resumed) == 9 and remaining_tokens(fresh) == 9
    assert remaining_tokens(req(1, 10)) == 7  # just prefilled: 7 decodes to go
    assert remaining_tokens(req(7, 16)) == 1
    sched = SimpleNamespace(
        token_to_kv_pool_allocator=SimpleNamespace(page_size=1),
        running_batch=SimpleNamespace(reqs=[]),
        last_batch=None,
        chunked_req=resumed,
    )
    assert reserve_tokens(sched) == 9


def test_failure_past_the_point_of_no_return_answers_500_and_publishes(handled, monkeypatch):
    """The tail's memory cannot be released after the pages moved: a 500 that says the pool
    is at its new size (not "back at" the old one), and the scheduler's copies follow it."""
    sim, sched = handled.sim, handled.sched
    sim.elastic.reserve()

    def broken(rows):
        raise OSError("injected: madvise failed")

    monkeypatch.setattr(sim.elastic.backing, "release", broken)
    floor = handled().split["kv"]["kv_floor_tokens"]
    got = handled(kv_tokens=floor)
    assert got.status_code == 500, got.message
    assert "past the point of no return" in got.message and "back at" not in got.message
    assert f"the pool is at {floor} tokens" in got.message and "madvise failed" in got.message
    assert sim.elastic.size == floor == sched.max_total_num_tokens
    assert sched.invariant_checker.max_total_num_tokens == floor
    assert sim.accounting() == [] and sim.kv_problems() == []


def test_unexpected_slot_failure_undoes_the_kv_step(handled_with_cache, monkeypatch):
    """A KV shrink, then a slot rebalance raising something unforeseen (a bug): a 500 naming
    it, and the KV shrink undone."""
    from sglang.srt.layers.moe.expert_cache import rebalance as slot_rebalance

    h, sim, cache = handled_with_cache, handled_with_cache.sim, handled_with_cache.cache
    slots_before = cache.num_slots

    def buggy(cache, spec, **kw):
        raise ZeroDivisionError("injected bug")

    monkeypatch.setattr(slot_rebalance, "rebalance", buggy)
    floor = h().split["kv"]["kv_floor_tokens"]
    got = h(kv_tokens=floor, expert_cache_size="100%")
    assert got.status_code == 500 and "ZeroDivisionError: injected bug" in got.message
    assert "undone: kv back at 96" in got.message, got.message
    assert sim.elastic.size == 96 == h.sched.max_total_num_tokens
    assert cache.num_slots == slots_before
    assert sim.accounting() == [] and sim.kv_problems() == []


def test_accounting_check_failing_answers_500(handled, monkeypatch):
    """The check after a resize raising (a bug) is a 500 with the reason, not an exception
    out of the handler (which would end the scheduler)."""
    from sglang.srt.mem_cache.elastic_kv import scheduler_glue

    def buggy(el, reqs):
        raise IndexError("injected bug in the check")

    monkeypatch.setattr(scheduler_glue, "kv_accounting_problems", buggy)
    floor = handled().split["kv"]["kv_floor_tokens"]
    got = handled(kv_tokens=floor)
    assert got.status_code == 500 and "IndexError: injected bug in the check" in got.message
    assert handled.sim.elastic.size == floor == handled.sched.max_total_num_tokens


def test_request_limits_follow_the_pool(monkeypatch):
    """``max_req_len`` / ``max_req_input_len`` are republished on each resize (upstream's
    ``min(context_len - 1, pool - 1)`` and 5 less), so after a shrink upstream's own check
    refuses a new prompt that no longer fits the pool, and a grow lifts the limit again (up to
    the context length)."""
    from array import array
    from types import SimpleNamespace

    from sglang.srt.layers.moe.expert_cache import method
    from sglang.srt.managers.io_struct import RebalanceMemoryReqInput
    from sglang.srt.managers.memory_rebalance import handle_rebalance_memory
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.managers.utils import validate_input_length
    from sglang.srt.sampling.sampling_params import SamplingParams

    monkeypatch.setattr(method, "_CACHE", None)
    sim = KVSim(kv_tokens=96, max_tokens=256, page_size=4)
    rng = random.Random(5)
    for _ in range(3):
        sim.admit(_prompt(rng))
    sched = sim.scheduler(
        max_req_len=95, max_req_input_len=90, model_config=SimpleNamespace(context_len=200)
    )

    def handle(**f):
        return handle_rebalance_memory(sched, RebalanceMemoryReqInput(**f))

    def refused(n_tokens):
        req = Req(
            rid="long",
            origin_input_text="",
            origin_input_ids=array("q", [7] * n_tokens),
            sampling_params=SamplingParams(max_new_tokens=8),
        )
        return validate_input_length(req, sched.max_req_input_len, False)

    assert refused(80) is None
    floor = handle().split["kv"]["kv_floor_tokens"]
    assert floor < 80
    assert handle(kv_tokens=floor).status_code == 200
    assert (sched.max_req_len, sched.max_req_input_len) == (floor - 1, floor - 6)
    assert "exceeds the maximum allowed length" in refused(80)
    assert handle(kv_tokens=256).status_code == 200
    assert (sched.max_req_len, sched.max_req_input_len) == (199, 194)  # the context length
    assert refused(190) is None


def test_publish_size_writes_frozen_and_msgspec_components():
    """The pool size and request limits reach components of every kind upstream uses: a
    frozen dataclass (the pool statistics observer) and a ``msgspec.Struct`` (the beam
    coordinator, which ``object.__setattr__`` refuses: "can't apply this __setattr__")."""
    import dataclasses
    from types import SimpleNamespace

    import msgspec

    from sglang.srt.mem_cache.elastic_kv.scheduler_glue import publish_size

    @dataclasses.dataclass(frozen=True)
    class Observer:
        max_total_num_tokens: int

    class Beams(msgspec.Struct, kw_only=True):
        max_req_len: int

    sched = SimpleNamespace(
        max_total_num_tokens=512,
        max_req_len=511,
        max_req_input_len=506,
        model_config=SimpleNamespace(context_len=4096),
        pool_stats_observer=Observer(max_total_num_tokens=512),
        beam_coordinator=Beams(max_req_len=511),
    )
    publish_size(sched, 256)
    assert sched.max_total_num_tokens == 256
    assert (sched.max_req_len, sched.max_req_input_len) == (255, 250)
    assert sched.pool_stats_observer.max_total_num_tokens == 256
    assert sched.beam_coordinator.max_req_len == 255
