"""Elastic KV on a hybrid model's pools (issue 15): ``HybridLinearKVPool`` (Qwen3-Next,
Qwen3.5) keeps its full-attention layers' KV in an ``MHATokenToKVPool`` indexed by token rows,
and its recurrent states in the request-indexed state pool. :class:`ElasticKV` resizes the inner
pool; the wrapper's size follows, and states, the tree's state values and anchor checkpoints
stay as they were.

Driven through ``test/anchor_checkpoints/cache_sim.py`` (upstream's ``AnchorRadixCache`` with
the Rust tree core over real hybrid pools, no model): finished requests leave cached prefixes
low in the pool, running ones hold pages above a shrink's boundary, every K/V row is stamped
with its own index, and after each resize the byte-level audit (``elastic_kv/audit.py``: each
running request's row and each tree node reads the bytes its old indices held) and the
allocator accounting must find nothing.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "anchor_checkpoints"))

from cache_sim import VOCAB, CacheSim  # noqa: E402

from sglang.srt.mem_cache.elastic_kv import audit  # noqa: E402
from sglang.srt.mem_cache.elastic_kv.accounting import kv_accounting_problems  # noqa: E402
from sglang.srt.mem_cache.elastic_kv.resize import (  # noqa: E402
    ElasticKV,
    KVResizeRefused,
    token_pool,
)

KV_SLOTS = 192


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(5, VOCAB) for _ in range(n)]


def _stamp_rows(pool) -> None:
    """K and V row ``i`` of every layer hold ``i`` (and ``-i``): moved bytes stay checkable."""
    rows = torch.arange(pool.k_buffer[0].shape[0], dtype=torch.float32)
    for k, v in zip(pool.k_buffer, pool.v_buffer):
        k.copy_(rows.view(-1, 1, 1).expand_as(k).to(k.dtype))
        v.copy_((-rows).view(-1, 1, 1).expand_as(v).to(v.dtype))


@pytest.fixture
def hybrid():
    """A CacheSim whose pool holds cached prefixes low and running requests above them."""
    sim = CacheSim(state_slots=12, kv_slots=KV_SLOTS, rows=4, context=256)
    rng = random.Random(3)
    for n in (40, 36):  # cached prefixes, on the low rows
        req = sim.admit(_prompt(rng, n), budget=64)
        assert req is not None
        for _ in range(3):
            assert sim.decode(req, rng.randrange(5, VOCAB))
        sim.finish(req)
    running = []
    for n in (30, 25):  # held by running requests, above them
        req = sim.admit(_prompt(rng, n), budget=64)
        assert req is not None
        for _ in range(4):
            assert sim.decode(req, rng.randrange(5, VOCAB))
        running.append(req)
    return sim, running


def test_hybrid_pool_resizes_its_full_attention_pool(hybrid):
    sim, running = hybrid
    wrapper = sim.allocator.get_kvcache()
    inner, outer = token_pool(wrapper)
    assert outer is wrapper and inner is wrapper.full_kv_pool
    el = ElasticKV(wrapper, sim.allocator, sim.pool, sim.cache)
    assert el.kvcache is inner and el.wrapper is wrapper
    _stamp_rows(inner)
    states_before = sim.tree_states()
    slots_in_use = sim.state_slots_in_use()
    stamps = {s: sim.stamp_of(s) for s in states_before}

    held = el.held_tokens() - el.evictable_tokens()
    new_size = 96
    assert held < new_size
    snap = audit.snapshot(el, sim.running)
    assert snap.reqs and snap.tree  # the audit reads running rows and cached prefixes
    out = el.resize(new_size)
    assert out["errors"] == [] and out["kv_tokens"] == new_size
    assert out["moved_pages"] > 0, out  # the running requests' pages lay above the boundary
    assert wrapper.size == inner.size == sim.allocator.size == new_size
    assert audit.check(el, snap, sim.running) == []
    assert kv_accounting_problems(el, sim.running) == []
    # the recurrent states are request-indexed: none moved, none was freed
    assert sim.tree_states() <= states_before
    assert sim.state_slots_in_use() <= slots_in_use
    for s in sim.tree_states():
        assert sim.stamp_of(s) == stamps[s]
    # the running requests go on in the shrunk pool, then finish into the tree
    for req in list(running):
        for _ in range(2):
            assert sim.decode(req, 7)
        rt = sim.pool.req_to_token[req.kv.req_pool_idx, : req.kv.kv_committed_len]
        assert int(rt.max()) <= new_size
        sim.finish(req)
    assert kv_accounting_problems(el, sim.running) == []

    out = el.resize(KV_SLOTS)  # grow back: the new pages are allocatable
    assert out["errors"] == [] and wrapper.size == inner.size == KV_SLOTS
    assert sim.allocator.available_size() + el.held_tokens() == KV_SLOTS
    req = sim.admit(_prompt(random.Random(9), 60), budget=64)
    assert req is not None and kv_accounting_problems(el, sim.running) == []


def test_hybrid_shrink_below_the_floor_is_refused(hybrid):
    sim, running = hybrid
    wrapper = sim.allocator.get_kvcache()
    el = ElasticKV(wrapper, sim.allocator, sim.pool, sim.cache)
    floor = el.floor()
    with pytest.raises(KVResizeRefused, match="below the floor"):
        el.resize(floor - el.page_size)
    assert wrapper.size == KV_SLOTS and el.kvcache.size == KV_SLOTS
