"""Where the planner ends prefill chunks: at anchors only, spaced by
``gap = max(min_gap, distance to the prompt end // SPACING_DIVISOR)``, never in the last
``TAIL_TOKENS`` tokens, never an empty chunk; every anchor of a prefilled prompt keeps a saved
state fewer than ``gap`` tokens before it (the bound on tokens a restore loses); and a long
prompt full of anchors costs logarithmically many cuts, not ``n / min_gap``."""

from __future__ import annotations

import types

import hypothesis.strategies as st
from cache_sim import B_GT, B_LT, CLOSE, OPEN, VOCAB, toy_scanner
from hypothesis import given, settings

from sglang.srt.mem_cache.anchor_checkpoints.markers import AnchorScanner
from sglang.srt.mem_cache.anchor_checkpoints.planner import (
    SPACING_DIVISOR,
    TAIL_TOKENS,
    AnchorPlanner,
)

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


def test_admission_retry_keeps_the_latest_figures():
    """An admission can be retried (no memory, a changed match): the figures of the latest
    attempt wait on the request; the cache counts them once its prefill runs."""
    stats = types.SimpleNamespace(on_admission=lambda r, n: ("figures", n))
    p = AnchorPlanner(SCANNER, min_gap=4, stats=stats)
    r = req(text(30))
    p.admit(r, 3, 27)
    p.admit(r, 5, 25, may_cut=False)  # retried with a longer match
    assert r._anchor_admission == ("figures", 5)


PROMPTS = st.lists(
    st.one_of(
        st.just([OPEN]),
        st.just([CLOSE]),
        st.just([B_LT, B_GT]),
        st.lists(st.integers(5, VOCAB - 1), min_size=1, max_size=12),
    ),
    max_size=40,
).map(lambda parts: [t for part in parts for t in part])


@settings(max_examples=300, deadline=None)
@given(
    ids=PROMPTS,
    gap=st.integers(1, 16),
    budgets=st.lists(st.integers(1, 50), min_size=1, max_size=8),
    start=st.integers(0, 20),
)
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


# ---- anchors in generated text (decode) ----------------------------------------------------


def decoding(prompt, out, saved_at):
    """A decoding request as the scheduler sees it after a step: ``out`` appended, the state of
    ``prompt + out[:-1]`` live, the last state saved at ``saved_at``."""
    return types.SimpleNamespace(
        origin_input_ids=list(prompt),
        output_ids=list(out),
        kv=types.SimpleNamespace(cache_protected_len=saved_at),
    )


def run_decode(p, prompt, out):
    """Feed ``out`` one token per step as the scheduler does; returns the saved positions."""
    saved, last = [], len(prompt)
    for k in range(2, len(out) + 1):  # the prefill sampled out[0]; each step feeds one more
        fed = len(prompt) + k - 1
        if p.decode_anchor(decoding(prompt, out[:k], last), fed):
            saved.append(fed)
            last = fed
    return saved


def test_decode_saves_before_and_after_generated_markers():
    prompt = text(30)
    out = text(20) + [OPEN] + text(25) + [CLOSE] + [B_LT, B_GT] + text(30)
    p = AnchorPlanner(SCANNER, min_gap=10)
    # before <A> (50); after <A> is too close; before </A> (76); the anchor between </A> and
    # the two-token <B> is too close; after <B> (79) too; nothing in the trailing text.
    assert run_decode(p, prompt, out) == [50, 76]
    assert run_decode(AnchorPlanner(SCANNER, min_gap=1), prompt, out) == [50, 51, 76, 77, 79]
    # The state must be the one after exactly ``fed`` tokens: any other length is refused.
    r = decoding(prompt, out[:21], len(prompt))
    assert p.decode_anchor(r, 50) and not p.decode_anchor(r, 49) and not p.decode_anchor(r, 51)


@settings(max_examples=300, deadline=None)
@given(prompt=PROMPTS.filter(bool), out=PROMPTS, gap=st.integers(1, 12))
def test_decode_saves_keep_a_state_within_min_gap_of_every_found_anchor(prompt, out, gap):
    """Every decode save is an anchor of the whole sequence, at least ``min_gap`` after the last
    save; every anchor a decode step can see (its marker ends at or before the newest token)
    keeps a saved state (or the prompt end) fewer than ``min_gap`` tokens before it."""
    out = [5] + out  # the token the prefill sampled
    p = AnchorPlanner(SCANNER, min_gap=gap)
    ids = prompt + out
    saved = run_decode(p, prompt, out)
    anchors = set(SCANNER.scan(ids).tolist())
    states = [len(prompt)] + saved
    assert all(b - a >= gap for a, b in zip(states, states[1:]))
    assert set(saved) <= anchors
    for fed in range(len(prompt) + 1, len(ids)):
        visible = fed in SCANNER.scan(ids[: fed + 1]).tolist()
        if visible:
            assert SCANNER.may_anchor_between(ids[fed - 1], ids[fed])  # the O(1) filter is sound
            assert fed - max(s for s in states if s <= fed) < gap, (fed, states)


def test_decode_anchors_of_the_embedded_tokenizer(tok):
    """The Qwen3 markers a model generates are single special tokens: decode finds the
    before- and after-anchors of each, where a prompt scan finds them."""
    scanner = AnchorScanner.from_tokenizer(tok)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Read a.txt"}],
        tokenize=True,
        add_generation_prompt=True,
        return_dict=False,
    )
    gen = tok.encode(
        "<think>\nI should read the file first.\n</think>\n\nReading it.\n<tool_call>\n"
        '{"name": "read", "arguments": {"path": "a.txt"}}\n</tool_call>',
        add_special_tokens=False,
    )
    ids = prompt + gen
    expected = [a for a in scanner.scan(ids).tolist() if len(prompt) < a < len(ids)]
    saved = run_decode(AnchorPlanner(scanner, min_gap=1), prompt, gen)
    assert saved == expected and len(saved) >= 6, (saved, expected)
