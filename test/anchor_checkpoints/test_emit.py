"""Emit mode (``--anchor-checkpoint-mode emit``): the states at anchors are written inside the
ordinary prefill pass and the radix tree owns them (planner, cache plumbing, slot accounting).

Driven through ``cache_sim.CacheSim`` (upstream's hybrid radix cache over tiny pools, no
model): the pass "writes" each emitted slot by stamping it with its position, so a test can see
which slot a tree node owns. That the written states are the exact recurrent states is the
kernel's test (``test/sgl_kernel/test_gdn_emit.py``); token identity end to end is
``test/e2e/test_anchor_checkpoints.py``.
"""

from __future__ import annotations

from array import array

from cache_sim import OPEN, CacheSim

from sglang.srt.mem_cache.anchor_checkpoints.emit import EMIT_GRID, grid_position
from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

_MAMBA = ComponentType.MAMBA


def prompt_with_anchor(n: int, at: int, filler: int = 7) -> list[int]:
    ids = [5 + (i * filler) % 19 for i in range(n)]
    ids[at] = OPEN  # anchors at `at` (before the marker) and `at + 1` (after it)
    return ids


def sim(**kw) -> CacheSim:
    kw = {"state_slots": 12, "kv_slots": 2048, "context": 1024, "min_gap": 64, **kw}
    return CacheSim(emit=True, **kw)


def node_stamp(s: CacheSim, prompt: list[int], depth: int) -> float:
    """The stamp of the state a prompt sharing ``prompt[:depth + 1]`` restores from; asserts
    that it restores at ``depth``."""
    probe = list(prompt[: depth + 1]) + [9] * 3
    got = s.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", probe))))
    assert got.device_prefix_len == depth, (got.device_prefix_len, depth)
    value = s.cache.tree_core.get_component_device_value(got.last_device_node, _MAMBA)
    return s.stamp_of(int(value.view(-1)[0]))


def test_grid_position():
    assert grid_position(100, 250, 64) == 228
    assert grid_position(100, 163, 64) is None  # the pass start itself
    assert grid_position(0, 127, 64) == 64
    assert grid_position(0, 127, 32) is None  # 63 tokens before the anchor > min_gap


def test_one_pass_states_at_anchor_and_before_the_prompt_end():
    s = sim()
    p = prompt_with_anchor(300, 200)
    req = s.admit(p, budget=4096)
    # the chunk was not cut: the whole prompt in one pass (cut mode ends it at 200)
    assert req.kv.kv_committed_len == 300
    assert s.tree_states() and s.cache.anchor_stats.slots  # tagged anchor checkpoint(s)
    s.finish(req)
    # the anchor at 200 -> its kernel-chunk boundary 192; the last boundary before 300: 256
    assert node_stamp(s, p, 192) == 192
    assert node_stamp(s, p, 256) == 256
    # an identical prompt reuses all but 300 - 256 < 64 tokens
    again = s.admit(list(p), budget=4096)
    assert again.anchor_admitted_prefix == 256 >= len(p) - EMIT_GRID
    s.finish(again)
    assert s.state_slots_in_use() == len(s.tree_states())


def test_cut_mode_cuts_where_emit_mode_does_not():
    cut = CacheSim(state_slots=12, kv_slots=2048, context=1024, min_gap=64)
    p = prompt_with_anchor(300, 200)
    req = cut.admit(p, budget=4096)
    assert req.kv.kv_committed_len == 200  # the pass ended at the anchor


def test_chunked_prompt_emits_per_pass():
    """Each pass of a chunked prompt counts its grid from its own start."""
    s = sim(state_slots=16)
    p = prompt_with_anchor(700, 450)
    req = s.admit(p, budget=300)  # pass [0, 300)
    assert req.kv.kv_committed_len == 300
    assert s.prefill_chunk(req, 300) == (300, 600)
    assert s.prefill_chunk(req, 300) == (600, 700)
    s.finish(req)
    # anchor 450 lies in the pass from 300: boundary 300 + 128 = 428
    assert node_stamp(s, p, 428) == 428
    # the last pass [600, 700) ends the prompt: boundary 664 before it
    assert node_stamp(s, p, 664) == 664
    assert s.state_slots_in_use() == len(s.tree_states())


def test_a_pass_that_does_not_take_the_plan_frees_its_slots_and_falls_back_to_cuts():
    s = sim()
    s.pass_takes_plan = False
    p = prompt_with_anchor(300, 200)
    req = s.admit(p, budget=4096)
    assert req.kv.kv_committed_len == 300
    held = s.state_slots_in_use()
    s.finish(req)
    assert s.state_slots_in_use() == len(s.tree_states()) <= held
    assert not s.cache.anchor_stats.slots  # nothing tagged: no state was inserted
    assert not s.cache.anchor_planner.emit  # the cache cuts chunks from now on
    req = s.admit(prompt_with_anchor(300, 200, filler=5), budget=4096)
    assert req.kv.kv_committed_len == 200


def test_no_free_state_slot_skips_emission():
    # 3 slots: the request's own, and at most one emitted state besides the chunk-end copy
    s = sim(state_slots=3)
    p = prompt_with_anchor(300, 200)
    req = s.admit(p, budget=4096)
    assert req is not None and req.kv.kv_committed_len == 300
    s.finish(req)
    assert s.state_slots_in_use() == len(s.tree_states())


def _mode_machine(monkeypatch, *, cpu: bool, cuda: bool, base="triton", prefill=None):
    """``_why_no_emit`` on a faked machine and ``exec.mamba`` (the two kernel flags only)."""
    from types import SimpleNamespace

    import sglang.srt.runtime_context as rc
    import sglang.srt.utils as su

    monkeypatch.setattr(su, "is_cpu", lambda: cpu)
    monkeypatch.setattr(su, "is_cuda", lambda: cuda)
    mamba = SimpleNamespace(linear_attn_backend=base, linear_attn_prefill_backend=prefill)
    monkeypatch.setattr(rc, "get_exec", lambda: SimpleNamespace(mamba=mamba))
    from sglang.srt.mem_cache.anchor_checkpoints import _why_no_emit

    return _why_no_emit()


def test_auto_mode_emits_on_the_cpu_and_on_cuda_with_the_triton_prefill_kernel(monkeypatch):
    assert _mode_machine(monkeypatch, cpu=True, cuda=False) is None
    assert _mode_machine(monkeypatch, cpu=False, cuda=True) is None
    assert (
        _mode_machine(monkeypatch, cpu=False, cuda=True, base="cutedsl", prefill="triton") is None
    )
    why = _mode_machine(monkeypatch, cpu=False, cuda=True, prefill="flashinfer")
    assert why is not None and "flashinfer" in why
    why = _mode_machine(monkeypatch, cpu=False, cuda=True, base="cutedsl")
    assert why is not None and "cutedsl" in why
    assert _mode_machine(monkeypatch, cpu=False, cuda=False) is not None  # ROCm, XPU, NPU
