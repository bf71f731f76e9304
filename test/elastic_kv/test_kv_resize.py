"""Elastic KV pages without a server (issue 15): the KV pool shrinks and grows between steps of
upstream's own pools and radix cache (``kv_sim.KVSim``) with requests holding KV.

After every step: no page leaked or owned twice (``kv_accounting_problems``), every running
request and every cached prefix reads its own KV (the moved pages hold the same bytes and
every index was rewritten), no running request lost a token. A resize evicts only the
evictable prefixes it must; a target below the floor is refused and changes nothing; a failure
injected at any step before the point of no return leaves the pool as it was; a shrink returns
the tail's memory to the OS.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from kv_sim import DIM, LAYERS, KVSim
from kv_sim import busy_sim as _busy_sim
from kv_sim import random_prompt as _prompt

from sglang.srt.mem_cache.elastic_kv.backing import HostKVBacking
from sglang.srt.mem_cache.elastic_kv.resize import KVResizeFailed, KVResizeRefused


class ElasticKVMachine(RuleBasedStateMachine):
    """admit / decode / finish / evict / resize in any order, on either tree core and page
    size; the invariants hold after each."""

    @initialize(
        page_size=st.sampled_from([1, 4]),
        core=st.sampled_from(["rust", "python"]),
        seed=st.integers(0, 1 << 16),
    )
    def setup(self, page_size, core, seed):
        self.sim = KVSim(kv_tokens=96, max_tokens=160, page_size=page_size, tree_core=core)
        self.rng = random.Random(seed)
        self.resizes = 0

    @rule()
    def admit(self):
        self.sim.admit(_prompt(self.rng))

    @precondition(lambda self: self.sim.running)
    @rule(data=st.data())
    def decode(self, data):
        req = data.draw(st.sampled_from(self.sim.running))
        self.sim.decode(req, self.rng.randint(20, 60))

    @precondition(lambda self: self.sim.running)
    @rule(data=st.data())
    def finish(self, data):
        self.sim.finish(data.draw(st.sampled_from(self.sim.running)))

    @rule(n=st.integers(1, 24))
    def evict(self, n):
        self.sim.evict(n)

    @rule(frac=st.floats(0.0, 1.0))
    def resize(self, frac):
        el = self.sim.elastic
        floor, top = el.floor(), el.max_tokens
        target = el.target(int(floor + frac * (top - floor)))
        target = max(target, floor)
        lens = {r.rid: r.kv.kv_committed_len for r in self.sim.running}
        tree_before, evictable = self.sim.tree_tokens(), el.evictable_tokens()
        out = el.resize(target)
        assert el.size == out["kv_tokens"] == target
        assert {r.rid: r.kv.kv_committed_len for r in self.sim.running} == lens
        # only what had to go: the tree lost at most the shortfall, and only evictable tokens
        assert tree_before - self.sim.tree_tokens() == out["evicted_tokens"] <= evictable
        self.resizes += 1

    @rule()
    def below_floor(self):
        el = self.sim.elastic
        floor = el.floor()
        if floor <= el.page_size:
            return
        before = (el.size, el.allocator.available_size(), self.sim.tree_tokens())
        with pytest.raises(KVResizeRefused, match=f"below the floor of {floor} tokens"):
            el.resize(floor - el.page_size)
        assert (el.size, el.allocator.available_size(), self.sim.tree_tokens()) == before

    @invariant()
    def accounting(self):
        assert self.sim.accounting() == []

    @invariant()
    def kv_intact(self):
        assert self.sim.kv_problems() == []


TestElasticKVMachine = ElasticKVMachine.TestCase
TestElasticKVMachine.settings = settings(
    max_examples=40,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def _state(sim: KVSim):
    el = sim.elastic
    free = torch.sort(torch.cat([el.allocator.free_pages.to(torch.int64)])).values
    return (
        el.size,
        free.tolist(),
        sim.rtp.req_to_token.clone(),
        sim.cache.tree_core.all_values_flatten().tolist(),
        [b.clone() for b in sim.kv.k_buffer],
    )


@pytest.mark.parametrize("core", ["rust", "python"])
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("pool", ["mha", "mla"])
def test_shrink_moves_live_pages(core, page_size, pool):
    sim = _busy_sim(page_size, core, mla=pool == "mla")
    el = sim.elastic
    target = el.floor()
    high = set(range(target // page_size + 1, el.size // page_size + 1))
    free_high = set(el.allocator.free_pages.tolist()) & high
    out = el.resize(target)
    assert out["moved_pages"] > 0 and len(high - free_high) >= out["moved_pages"]
    assert sim.accounting() == [] and sim.kv_problems() == []
    for r in sim.running:  # nothing a request holds points past the new boundary
        held = sim.rtp.req_to_token[r.kv.req_pool_idx, : r.kv.kv_allocated_len]
        assert int(held.max()) < target + page_size
    free_before = el.allocator.available_size()
    grown = el.resize(128)
    assert grown["kv_tokens"] == 128
    assert el.allocator.available_size() == free_before + 128 - target
    assert sim.accounting() == [] and sim.kv_problems() == []
    for _ in range(20):  # the grown pool serves: requests fill the new pages
        sim.admit(_prompt(random.Random(_)))
    assert sim.accounting() == [] and sim.kv_problems() == []


@pytest.mark.parametrize("step", ["evict", "find", "copy", "rewrite"])
def test_shrink_failure_rolls_back(step):
    sim = _busy_sim(1, "rust", seed=3)
    el = sim.elastic
    el.resize(el.size)  # no-op
    before = _state(sim)

    def inject(name):
        if name == step:
            raise MemoryError(f"injected at {name}")

    target = el.floor()
    if step == "evict":  # make the shrink need an eviction
        assert el.plan(target).evict_tokens > 0
    with pytest.raises(KVResizeFailed, match="keeps serving"):
        el.resize(target, on_step=inject)
    after = _state(sim)
    if step == "evict":  # nothing was evicted yet
        assert after[0] == before[0] and after[1] == before[1] and after[3] == before[3]
    else:  # evictions are allowed (they were evictable); nothing else changed
        assert after[0] == before[0]
        assert torch.equal(after[2], before[2])
    assert sim.accounting() == [] and sim.kv_problems() == []
    assert el.resize_failures == 1
    assert el.resize(target)["kv_tokens"] == target  # and a retry works
    assert sim.accounting() == [] and sim.kv_problems() == []


@pytest.mark.parametrize("step", ["commit", "extend"])
def test_grow_failure_rolls_back(step):
    sim = _busy_sim(1, "rust", seed=5)
    el = sim.elastic
    el.resize(el.floor())
    before = _state(sim)

    def inject(name):
        if name == step:
            raise MemoryError(f"injected at {name}")

    with pytest.raises(KVResizeFailed, match="keeps serving"):
        el.resize(128, on_step=inject)
    after = _state(sim)
    assert after[0] == before[0] and after[1] == before[1] and after[3] == before[3]
    assert sim.accounting() == [] and sim.kv_problems() == []
    assert el.resize(128)["kv_tokens"] == 128


def test_refusals_name_the_limits():
    sim = _busy_sim(1, "rust", seed=1)
    el = sim.elastic
    with pytest.raises(KVResizeRefused, match="largest feasible target, 128 tokens"):
        el.resize(129)
    floor = el.floor(reserve_tokens=10)
    assert floor == el.floor() + 10
    with pytest.raises(KVResizeRefused, match=f"below the floor of {floor} tokens"):
        el.resize(floor - 1, reserve_tokens=10)
    dry = el.resize(floor, reserve_tokens=10, dry_run=True)
    assert dry["dry_run"] and dry["kv_tokens"] == el.size == 96


def test_shrink_releases_memory():
    """Rows of 64 KiB: a shrink from 64 to 8 tokens drops the tail's pages (mincore says they
    are gone), a grow commits them again."""
    k = [torch.ones(65, 128, 256) for _ in range(2)]  # 65 rows (64 tokens + padding) x 128 KiB
    v = [torch.ones(65, 128, 256) for _ in range(2)]
    backing = HostKVBacking(k, v, max_rows=65)
    row = backing.k[0].row_bytes
    assert backing.resident_bytes() == 4 * 65 * row
    released = backing.release(9)
    assert released == 4 * 56 * row
    assert backing.resident_bytes() == 4 * 9 * row
    kv, vv = backing.views(9)
    assert all(bool((t == 1).all()) for t in kv + vv)  # the kept rows keep their data
    backing.commit(9, 65)
    assert backing.resident_bytes() == 4 * 65 * row
    assert float(backing.k[0].full[64].abs().sum()) == 0  # released rows come back as zeros


@pytest.mark.parametrize("where", ["remap", "release"])
def test_failure_past_the_point_of_no_return_is_reported_not_raised(where, monkeypatch):
    """A failure after the rewrite (another copy's remap, releasing the tail's memory) cannot
    be rolled back: the resize does not raise (nor claim the pool is back at its old size),
    the pool is at the new size, the failure is in ``errors``."""
    sim = _busy_sim(1, "rust", seed=2)
    el = sim.elastic
    el.reserve()
    target = el.floor()

    def broken(*args):
        raise OSError(f"injected at {where}")

    if where == "remap":
        el.extra_remaps.append(broken)
    else:
        monkeypatch.setattr(el.backing, "release", broken)
    out = el.resize(target)
    assert el.size == out["kv_tokens"] == target
    assert len(out["errors"]) == 1 and f"injected at {where}" in out["errors"][0]
    assert el.resize_failures == 1
    if where == "release":
        assert out["released_bytes"] == 0
    assert sim.accounting() == [] and sim.kv_problems() == []


def _owner(t: torch.Tensor) -> torch.Tensor:
    """The tensor that owns ``t``'s allocation (upstream's fused K/V tensor of a layer)."""
    return t._base if t._base is not None else t


def test_first_reserve_moves_one_layer_at_a_time(monkeypatch):
    """The move into reserved mappings frees each layer's old allocation before the next layer
    is copied: when layer ``l``'s reservation is made, the old allocations of layers below
    ``l`` are gone (the process never holds the pool twice). The KV reads the same after."""
    import weakref

    from sglang.srt.mem_cache.elastic_kv import backing as backing_mod

    sim = _busy_sim(1, "rust", seed=3)
    kv = sim.kv
    owners = [weakref.ref(_owner(t)) for t in kv.k_buffer]
    assert all(weakref.ref(_owner(v))() is o() for v, o in zip(kv.v_buffer, owners))
    alive_at_reservation = []
    real = backing_mod.ReservedBuffer

    def recording(*args, **kwargs):
        alive_at_reservation.append(sum(o() is not None for o in owners))
        return real(*args, **kwargs)

    monkeypatch.setattr(backing_mod, "ReservedBuffer", recording)
    sim.elastic.reserve()
    layers = len(owners)
    # K and V of layer l are reserved while layers l.. are still held: layers - l of them.
    assert alive_at_reservation == [layers - i // 2 for i in range(2 * layers)]
    assert all(o() is None for o in owners)
    assert sim.kv_problems() == []


def test_reserve_failure_leaves_the_pool_readable(monkeypatch):
    """A reservation refused halfway (the second layer's): the first layer has moved, the
    pool's pointers follow it, every request and prefix reads its own KV, and the next
    resize moves every layer and succeeds."""
    from sglang.srt.mem_cache.elastic_kv import backing as backing_mod

    sim = _busy_sim(1, "rust", seed=4)
    el, kv = sim.elastic, sim.kv
    real, calls = backing_mod.ReservedBuffer, []

    def refusing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise OSError(12, "injected: cannot reserve")
        return real(*args, **kwargs)

    monkeypatch.setattr(backing_mod, "ReservedBuffer", refusing)
    before = kv.k_buffer[0].data_ptr()
    with pytest.raises(KVResizeFailed, match="injected: cannot reserve"):
        el.resize(el.floor())
    assert el.backing is None and el.size == 96
    # layer 0 moved; the pool's pointer table follows it (the attention reads through it)
    assert kv.k_buffer[0].data_ptr() != before
    assert int(kv.k_data_ptrs[0]) == kv.k_buffer[0].data_ptr()
    assert sim.kv_problems() == []
    monkeypatch.setattr(backing_mod, "ReservedBuffer", real)
    out = el.resize(el.floor())
    assert el.size == out["kv_tokens"] and el.backing is not None
    assert sim.kv_problems() == [] and sim.accounting() == []


def test_mla_pool_moves_into_its_reservation_and_returns_memory():
    """An MLA pool (one latent buffer per layer) resizes like an MHA one: the first resize
    moves its buffers into reserved mappings (its ``data_ptrs`` follow), a shrink moves live
    pages below the boundary, a grow commits the rows again, and every request and cached
    prefix reads its own rows."""
    from sglang.srt.mem_cache.elastic_kv.resize import kv_buffers

    sim = _busy_sim(1, "rust", seed=5, mla=True)
    el = sim.elastic
    first, second = kv_buffers(sim.kv)
    assert first is sim.kv.kv_buffer and second == []
    assert el.token_bytes == LAYERS * (DIM + 2) * 4  # kv_lora_rank + rope dims, float32
    out = el.resize(el.floor())
    # moved into the reserved mappings (the tail's release is whole OS pages: none this small)
    assert el.backing is not None and out["moved_pages"] > 0
    assert sim.kv.size == el.size == out["kv_tokens"]
    assert [b.data_ptr() for b in sim.kv.kv_buffer] == [b.base for b in el.backing.k]
    assert sim.kv.data_ptrs.tolist() == [b.data_ptr() for b in sim.kv.kv_buffer]
    assert [b.shape[0] for b in sim.kv.kv_buffer] == [el.size + 1] * LAYERS
    assert sim.accounting() == [] and sim.kv_problems() == []
    out = el.resize(128)
    assert out["committed_bytes"] == (128 - out["previous_tokens"]) * el.token_bytes
    assert sim.kv.data_ptrs.tolist() == [b.data_ptr() for b in sim.kv.kv_buffer]
    assert sim.accounting() == [] and sim.kv_problems() == []
