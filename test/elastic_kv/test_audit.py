"""The default-off byte-level audit of a KV resize (``elastic_kv/audit.py``,
``SGLANG_ELASTIC_KV_AUDIT=1``): clean after a correct shrink that moved pages, and it names the
request or tree node when a resize leaves an index that reads the wrong KV (a broken rewrite
injected after the real one), also through the ``/rebalance_memory`` handler (a 500)."""

from __future__ import annotations

import logging

import pytest
from kv_sim import KVSim
from kv_sim import busy_sim as _busy_sim

from sglang.srt.mem_cache.elastic_kv import audit, tree_values


def _holders(sim: KVSim):
    return list(sim.running)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("core", ["rust", "python"])
def test_clean_after_a_shrink_that_moved_pages(page_size, core, caplog):
    sim = _busy_sim(page_size, core, seed=3)
    el = sim.elastic
    snap = audit.snapshot(el, _holders(sim))
    assert snap.reqs and snap.tree
    with caplog.at_level(logging.INFO, logger=audit.__name__):
        out = el.resize(el.floor())
        assert out["moved_pages"] > 0
        assert audit.check(el, snap, _holders(sim)) == []
    assert "positions moved" in caplog.text  # the moves are logged, old -> new
    assert sim.kv_problems() == []


def test_names_a_request_that_reads_the_wrong_kv():
    sim = _busy_sim(1, "rust", seed=3)
    el = sim.elastic
    victim = max(sim.running, key=lambda r: r.kv.kv_committed_len)
    row = victim.kv.req_pool_idx

    def swap_two_positions(remap):  # after the real rewrite: the row reads two tokens swapped
        rt = el.req_to_token_pool.req_to_token
        rt[row, [0, 1]] = rt[row, [1, 0]]

    el.extra_remaps.append(swap_two_positions)
    snap = audit.snapshot(el, _holders(sim))
    el.resize(el.floor())
    problems = audit.check(el, snap, _holders(sim))
    assert any(p.startswith(f"request {victim.rid}: the KV at 2 of") for p in problems), problems


def test_names_a_tree_node_left_pointing_past_the_pool(monkeypatch):
    sim = _busy_sim(1, "rust", seed=3)
    el = sim.elastic
    monkeypatch.setattr(tree_values, "rewrite", lambda nodes, remap: None)  # a stale tree
    snap = audit.snapshot(el, _holders(sim))
    el.resize(el.floor())
    problems = audit.check(el, snap, _holders(sim))
    assert any(p.startswith("tree node") and "outside the pool" in p for p in problems), problems


def test_handler_answers_500_when_the_audit_finds_a_problem(monkeypatch):
    from sglang.srt.layers.moe.expert_cache import method
    from sglang.srt.managers.io_struct import RebalanceMemoryReqInput
    from sglang.srt.managers.memory_rebalance import handle_rebalance_memory
    from sglang.srt.mem_cache.elastic_kv.scheduler_glue import reserve_tokens

    monkeypatch.setattr(method, "_CACHE", None)  # a server without the expert cache
    monkeypatch.setenv(audit.AUDIT_ENV, "1")
    sim = _busy_sim(1, "rust", seed=4)
    sched = sim.scheduler()
    el = sim.elastic
    ok = handle_rebalance_memory(
        sched, RebalanceMemoryReqInput(kv_tokens=el.floor(reserve_tokens(sched)))
    )
    assert ok.status_code == 200, ok.message
    assert ok.split["kv_resize"]["moved_pages"] > 0
    ok = handle_rebalance_memory(sched, RebalanceMemoryReqInput(kv_tokens=128))
    assert ok.status_code == 200, ok.message

    victim = max(sim.running, key=lambda r: r.kv.kv_committed_len)

    def corrupt(remap):
        rt = el.req_to_token_pool.req_to_token
        rt[victim.kv.req_pool_idx, [0, 1]] = rt[victim.kv.req_pool_idx, [1, 0]]

    el.extra_remaps.append(corrupt)
    bad = handle_rebalance_memory(
        sched, RebalanceMemoryReqInput(kv_tokens=el.floor(reserve_tokens(sched)))
    )
    assert bad.status_code == 500, bad.message
    assert f"request {victim.rid}: the KV at 2 of" in bad.message


def test_off_by_default(monkeypatch):
    monkeypatch.delenv(audit.AUDIT_ENV, raising=False)
    assert not audit.enabled()
    monkeypatch.setenv(audit.AUDIT_ENV, "1")
    assert audit.enabled()
