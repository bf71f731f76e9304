"""Where the planner ends prefill chunks: at anchors only, spaced by
``gap = max(min_gap, distance to the prompt end // SPACING_DIVISOR)``, never in the last
``TAIL_TOKENS`` tokens, never an empty chunk; every anchor of a prefilled prompt keeps a saved
state fewer than ``gap`` tokens before it (the bound on tokens a restore loses); and a long
prompt full of anchors costs logarithmically many cuts, not ``n / min_gap``."""
from __future__ import annotations

import types

import hypothesis.strategies as st
from hypothesis import given, settings

from cache_sim import B_GT, B_LT, CLOSE, OPEN, VOCAB, toy_scanner
from sglang.srt.mem_cache.anchor_checkpoints.planner import SPACING_DIVISOR, TAIL_TOKENS, AnchorPlanner

SCANNER = toy_scanner()


def req(ids):
    return types.SimpleNamespace(full_untruncated_fill_ids=list(ids), multimodal_inputs=None)


def text(n):
    return [5 + i % (VOCAB - 5) for i in range(n)]


def test_cut_at_first_anchor_after_the_gap():
    ids = text(10) + [OPEN] + text(30) + [CLOSE] + text(40)  # anchors 10, 11, 41, 42
    p = AnchorPlanner(SCANNER, min_gap=20)
    r = req(ids)
    assert p.cut(r, 0, len(ids)) == 41  # 10 and 11 are closer than 20 to the start
    assert p.is_cut(r, 41) and not p.is_cut(r, 10)
    assert p.cut(r, 41, len(ids) - 41) == len(ids) - 41  # 42 is too close; then none
    assert p.cut(r, 0, 41) == 41  # the chunk already ends there: nothing to cut
    assert p.cut(r, 0, 30) == 30  # no anchor inside the chunk


def test_no_cut_in_the_tail_or_on_short_chunks():
    ids = text(40) + [OPEN] + text(TAIL_TOKENS - 2)  # anchors at 40, 41: inside the tail
    p = AnchorPlanner(SCANNER, min_gap=8)
    assert p.cut(req(ids), 0, len(ids)) == len(ids)
    ids = text(40) + [OPEN] + text(TAIL_TOKENS + 1)
    assert p.cut(req(ids), 0, len(ids)) == 40
    assert p.cut(req(ids), 35, 8) == 8  # a chunk no longer than the gap is never cut


def test_prompt_ending_exactly_at_an_anchor():
    ids = text(50) + [OPEN]  # its last anchor is the prompt end
    p = AnchorPlanner(SCANNER, min_gap=4)
    r = req(ids)
    assert p.cut(r, 0, len(ids)) == len(ids)


def test_multimodal_requests_are_not_cut():
    ids = text(40) + [OPEN] + text(40)
    r = types.SimpleNamespace(full_untruncated_fill_ids=ids, multimodal_inputs=object())
    assert AnchorPlanner(SCANNER, min_gap=4).cut(r, 0, len(ids)) == len(ids)


def test_admission_is_accounted_once():
    seen = []
    stats = types.SimpleNamespace(on_admission=lambda r, n: seen.append(n))
    p = AnchorPlanner(SCANNER, min_gap=4, stats=stats)
    r = req(text(30))
    p.admit(r, 3, 27)
    p.admit(r, 3, 27, may_cut=False)  # a retry of the same admission
    assert seen == [3]


PROMPTS = st.lists(
    st.one_of(st.just([OPEN]), st.just([CLOSE]), st.just([B_LT, B_GT]),
              st.lists(st.integers(5, VOCAB - 1), min_size=1, max_size=12)),
    max_size=40,
).map(lambda parts: [t for part in parts for t in part])


@settings(max_examples=300, deadline=None)
@given(ids=PROMPTS, gap=st.integers(1, 16), budgets=st.lists(st.integers(1, 50), min_size=1, max_size=8),
       start=st.integers(0, 20))
def test_chunking_keeps_a_state_within_gap_of_every_anchor(ids, gap, budgets, start):
    start = min(start, len(ids))
    p = AnchorPlanner(SCANNER, min_gap=gap)
    r = req(ids)
    ends, pos, i = [start], start, 0
    while pos < len(ids):
        n = min(budgets[i % len(budgets)], len(ids) - pos)
        i += 1
        m = p.cut(r, pos, n)
        assert 0 < m <= n
        if m < n:
            assert m >= p.gap(len(ids), pos) and pos + m <= len(ids) - TAIL_TOKENS
            assert pos + m in SCANNER.scan(ids).tolist()
        pos += m
        ends.append(pos)
    for a in SCANNER.scan(ids, start).tolist():
        if a <= len(ids) - TAIL_TOKENS:
            s = max(e for e in ends if e <= a)  # the start of the chunk that covers a
            assert a - s < p.gap(len(ids), s), (a, ends)


def test_spacing_grows_with_the_distance_to_the_prompt_end():
    """A 100K-token prompt with an anchor every 10 tokens: cuts are dense only near its end, and
    the number of cuts is logarithmic in its length."""
    ids = []
    while len(ids) < 100_000:
        ids += [OPEN] + text(9)
    ids = ids[:100_000]
    p = AnchorPlanner(SCANNER, min_gap=64)
    r = req(ids)
    pos, cuts = 0, []
    while pos < len(ids):
        m = p.cut(r, pos, min(4096, len(ids) - pos))
        if pos + m < len(ids) and m < min(4096, len(ids) - pos):
            cuts.append(pos + m)
        pos += m
    assert 20 <= len(cuts) <= SPACING_DIVISOR * 8, len(cuts)
    # near the end: spacing of about min_gap; deep in: thousands of tokens
    tail = [c for c in cuts if c > len(ids) - 1000]
    assert len(tail) >= 10
    assert max(b - a for a, b in zip(cuts, cuts[1:])) > 1000
