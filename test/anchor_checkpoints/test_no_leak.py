"""The recurrent-state pool never leaks with anchor checkpoints, and the tree only returns states
it was given: a hypothesis state machine against a plain reference model.

Level: unit, on upstream's cache classes (``cache_sim.CacheSim``: ``AnchorRadixCache`` over the
Rust tree core, tiny CPU pools, no model, no server). Rules admit requests whose prompts share
prefixes with earlier ones (cut anywhere, inside a two-token marker too), run prefill chunks
(ended at anchors by the planner), decode (markers too: the state at an anchor in generated
text is saved), finish, abort, flush, and evict under pressure (the pools are small, so
allocations evict as well). One rule admits a request that extends a state saved during decode
(the next turn of a harness resending the generated text): with nothing evicted since that save,
it must restore that decode anchor checkpoint (or a longer saved prefix) and count it as an
anchor restore. ``test_anchor_cache`` runs the machine and then asserts that the run covered
chunk cuts, decode saves, anchor restores and restores of decode-saved states (``COVERAGE``;
hypothesis's own ``event()`` statistics cannot fail a test).

The reference model is the set of token prefixes whose recurrent state the scheduler handed to
the tree (every chunk end, every decode anchor saved, every finished request's key). Invariants after every step:

- state slots in use == states the tree holds + one per running request (no leak, no double
  free), and KV slots in use == tree KV + running requests' private KV;
- every anchor tag names a state the tree holds; the admission counters (tokens reused and
  recomputed) count each admitted request once, failed admissions not at all;
- a prefix match ends at 0 or on a saved prefix; with no eviction so far, on the longest saved
  prefix of the probe (the tree loses nothing it was given);
- a restore counted as "from an anchor checkpoint" restores a prefix that was saved at an anchor
  (a chunk cut or a decode step); every cut is an anchor at least ``min_gap`` tokens after the
  chunk start, every decode save an anchor at least ``min_gap`` tokens after the last save.
"""

from __future__ import annotations

from array import array
from collections import Counter

import hypothesis.strategies as st
from cache_sim import B_GT, B_LT, CLOSE, OPEN, VOCAB, CacheSim, toy_scanner
from hypothesis import HealthCheck, event, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from sglang.srt.mem_cache.anchor_checkpoints.planner import TAIL_TOKENS
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey

MIN_GAP = 3
CONTEXT = 100  # longest prompt (CacheSim rows hold 128 tokens; decode adds some)
TEXT = st.integers(5, VOCAB - 1)
# Events of every example of one run of the machine, asserted after it (test_anchor_cache):
# hypothesis reports event() only as statistics, which cannot fail.
COVERAGE: Counter[str] = Counter()


def _event(name: str) -> None:
    event(name)
    COVERAGE[name] += 1


@st.composite
def blocks(draw) -> list[int]:
    out: list[int] = []
    for _ in range(draw(st.integers(1, 4))):
        body = draw(st.lists(TEXT, min_size=0, max_size=6))
        kind = draw(st.sampled_from(["a", "b", "text"]))
        if kind == "a":
            out += [OPEN, *body, CLOSE]
        elif kind == "b":
            out += [B_LT, B_GT, *body]
        else:
            out += body or [5]
    return out


class AnchorCacheMachine(RuleBasedStateMachine):
    @initialize(
        state_slots=st.integers(6, 12),
        kv_slots=st.integers(80, 200),
        max_states=st.sampled_from([-1, 3]),
    )
    def setup(self, state_slots, kv_slots, max_states):
        self.sim = CacheSim(
            state_slots=state_slots,
            kv_slots=kv_slots,
            rows=4,
            min_gap=MIN_GAP,
            max_states=max_states,
        )
        self.prompts: list[list[int]] = []
        self.saved: set[tuple[int, ...]] = set()
        self.saved_at_anchors: set[tuple[int, ...]] = set()
        self.saved_in_decode: dict[tuple[int, ...], int] = {}  # prefix -> sim.evictions then
        self.admitted_tokens = [0, 0]  # reused, recomputed over admitted requests

    # ---- rules ----------------------------------------------------------------------------

    @rule(data=st.data(), budget=st.integers(1, 24))
    def admit(self, data, budget):
        if self.prompts and data.draw(st.booleans(), label="extends an earlier prompt"):
            base = data.draw(st.sampled_from(self.prompts), label="base")
            # Edit right at a block boundary (as harnesses do), or anywhere.
            at_anchor = toy_scanner().scan(base).tolist()
            keep = data.draw(
                st.sampled_from(at_anchor)
                if at_anchor and data.draw(st.booleans(), label="at anchor")
                else st.integers(0, len(base)),
                label="keep",
            )
            prompt = base[:keep] + data.draw(blocks(), label="new blocks")
        else:
            prompt = data.draw(blocks(), label="prompt")
        self._admit(prompt[:60], budget)

    @precondition(lambda self: any(len(p) < CONTEXT for p in self.saved_in_decode))
    @rule(data=st.data(), budget=st.integers(1, 24))
    def extend_decode_anchor(self, data, budget):
        """A request that extends a state saved during decode (the next turn of a harness that
        resends the generated text): the admission must restore that decode anchor checkpoint
        (or a longer saved prefix) unless something was evicted since it was saved."""
        prefix = data.draw(
            st.sampled_from(sorted(p for p in self.saved_in_decode if len(p) < CONTEXT)),
            label="decode-saved prefix",
        )
        prompt = [*prefix, *data.draw(blocks(), label="new blocks")][:CONTEXT]
        lossless = self.saved_in_decode[prefix] == self.sim.evictions
        req = self._admit(prompt, budget)  # may evict, but not the prefix it matched and locked
        if req is None or not lossless:
            return
        COVERAGE["decode-saved prefix admitted without eviction"] += 1
        assert req.anchor_admitted_prefix >= len(prefix), (req.anchor_admitted_prefix, len(prefix))
        if req.anchor_admitted_prefix == len(prefix):
            assert req.anchor_restored, "the decode anchor checkpoint was matched but not counted"

    def _admit(self, prompt, budget):
        req = self.sim.admit(prompt, budget)
        if req is None:
            return None
        self.prompts.append(prompt)
        restored = req.anchor_admitted_prefix
        self.admitted_tokens[0] += restored  # counted once, when its first chunk ran
        self.admitted_tokens[1] += len(prompt) - restored
        assert restored == 0 or tuple(prompt[:restored]) in self.saved
        if req.anchor_restored:  # the state came from a chunk cut at an anchor, of this prefix
            _event("restored from an anchor checkpoint")
            assert tuple(prompt[:restored]) in self.saved_at_anchors
            if tuple(prompt[:restored]) in self.saved_in_decode:
                _event("restored from a decode anchor checkpoint")
        self._chunk_done(req, restored, budget)
        return req

    @precondition(lambda self: any(self.sim.prefilling(r) for r in self.sim.running))
    @rule(data=st.data(), budget=st.integers(1, 24))
    def prefill_chunk(self, data, budget):
        req = data.draw(st.sampled_from([r for r in self.sim.running if self.sim.prefilling(r)]))
        start = req.prefix_len
        if self.sim.prefill_chunk(req, budget) is not None:
            self._chunk_done(req, start, budget)

    def _chunk_done(self, req, start, budget):
        end, total = req.extend_end, len(req.origin_input_ids)
        if end < min(start + budget, total):  # cut short: at an anchor, spaced by min_gap
            _event("chunk cut at an anchor")
            assert self.sim.planner.is_cut(req, end)
            assert end - start >= MIN_GAP and end <= total - TAIL_TOKENS
            assert end in self.sim.planner.positions(req, 0).tolist()
            self.saved_at_anchors.add(tuple(req.origin_input_ids[:end]))
            cap = self.sim.cache.anchor_max_states
            if cap > 0:  # enforced after each anchor checkpoint, down to locked states
                core = self.sim.cache.tree_core
                assert len(self.sim.tree_states()) <= cap or core.mamba_evictable_size() == 0
        self.saved.add(tuple(req.origin_input_ids[:end]))

    @precondition(lambda self: any(not self.sim.prefilling(r) for r in self.sim.running))
    @rule(
        data=st.data(),
        tokens=st.lists(
            st.one_of(TEXT, st.sampled_from([OPEN, CLOSE, B_LT, B_GT])), min_size=1, max_size=8
        ),
    )
    def decode(self, data, tokens):
        req = data.draw(
            st.sampled_from([r for r in self.sim.running if not self.sim.prefilling(r)])
        )
        for token in tokens:
            before = req.kv.cache_protected_len
            if not self.sim.decode(req, token):
                return
            fed = req.kv.kv_committed_len
            ids = list(req.origin_input_ids) + list(req.output_ids)
            if req.kv.cache_protected_len != before:  # a decode anchor was saved
                _event("decode anchor saved")
                assert req.kv.cache_protected_len == fed and fed - before >= MIN_GAP
                assert self.sim.planner.is_cut(req, fed)
                assert fed in toy_scanner().scan(ids).tolist()
                self.saved.add(tuple(ids[:fed]))
                self.saved_at_anchors.add(tuple(ids[:fed]))
                self.saved_in_decode[tuple(ids[:fed])] = self.sim.evictions
                self.prompts.append(ids)  # later prompts edit the generated text too
            elif fed - before >= MIN_GAP and fed in toy_scanner().scan(ids[: fed + 1]).tolist():
                # Only a full state pool (nothing free, nothing evictable) skips a due save.
                assert self.sim.cache.anchor_stats.counters.skipped_decode > 0

    @precondition(lambda self: any(not self.sim.prefilling(r) for r in self.sim.running))
    @rule(data=st.data())
    def finish(self, data):
        req = data.draw(
            st.sampled_from([r for r in self.sim.running if not self.sim.prefilling(r)])
        )
        ids = list(req.origin_input_ids) + list(req.output_ids)
        up_to = self.sim.finish(req)
        self.saved.add(tuple(ids[:up_to]))

    @precondition(lambda self: self.sim.running)
    @rule(data=st.data())
    def abort(self, data):
        self.sim.abort(data.draw(st.sampled_from(self.sim.running)))

    @precondition(lambda self: not self.sim.running)
    @rule()
    def flush(self):
        self.sim.flush()
        self.saved.clear()
        self.saved_at_anchors.clear()
        self.saved_in_decode.clear()
        self.sim.evicted_any = False

    @rule(tokens=st.integers(0, 40), states=st.integers(0, 3))
    def evict(self, tokens, states):
        self.sim.cache.evict(EvictParams(num_tokens=tokens, mamba_num=states))

    @precondition(lambda self: self.prompts)
    @rule(data=st.data())
    def probe(self, data):
        base = data.draw(st.sampled_from(self.prompts))
        keep = data.draw(st.integers(0, len(base)))
        probe = base[:keep] + data.draw(st.lists(TEXT, max_size=3))
        got = self.sim.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", probe))))
        p = got.device_prefix_len
        assert p == 0 or tuple(probe[:p]) in self.saved, (p, probe)
        if not self.sim.evicted_any:
            best = max(
                (q for q in range(1, len(probe) + 1) if tuple(probe[:q]) in self.saved), default=0
            )
            assert p == best, (p, best, probe)

    # ---- invariants -----------------------------------------------------------------------

    @invariant()
    def no_state_slot_leak(self):
        if not hasattr(self, "sim"):
            return
        held_by_reqs = sum(1 for r in self.sim.running if r.kv.holds_mamba)
        assert held_by_reqs == len(self.sim.running)
        tree = self.sim.tree_states()
        assert self.sim.state_slots_in_use() == len(tree) + held_by_reqs, (
            self.sim.state_slots_in_use(),
            len(tree),
            held_by_reqs,
        )
        req_slots = {int(r.kv.mamba_pool_idx) for r in self.sim.running}
        assert not (req_slots & tree), "a running request shares a slot with the tree"

    @invariant()
    def no_kv_leak(self):
        if not hasattr(self, "sim"):
            return
        core = self.sim.cache.tree_core
        tree_kv = core.full_evictable_size() + core.full_protected_size()
        private = sum(r.kv.kv_committed_len - r.kv.cache_protected_len for r in self.sim.running)
        assert self.sim.kv_slots_in_use() == tree_kv + private

    @invariant()
    def tags_name_tree_states(self):
        if not hasattr(self, "sim"):
            return
        stats = self.sim.cache.anchor_stats
        assert set(stats.slots) <= self.sim.tree_states()
        if stats.counters.evicted:
            event("anchor checkpoint evicted")
        if self.sim.evicted_any:
            event("eviction")
        c = stats.counters
        assert c.saved - c.evicted >= stats.held  # flushes drop tags without counting
        # Admission figures count each admitted request once (failed admissions not at all).
        assert [c.reused_tokens, c.recomputed_tokens] == self.admitted_tokens


# derandomize: the same seed on every run; database=None: no replay of examples saved
# elsewhere. The runs still differ (measured: "decode-saved prefix admitted without eviction"
# counted 37, 18 and 10 times in three local runs, and 0 in one CI run), so that rare case is
# not a coverage requirement here: test_next_turn_restores_the_decode_anchor_checkpoint runs
# it deterministically, and the rule still asserts it whenever the machine reaches it.
SETTINGS = settings(
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def test_anchor_cache():
    """The state machine, then what it covered: a run that never restored a state saved during
    decode (or never cut a chunk, or never saved in decode) checked nothing about it."""
    COVERAGE.clear()
    run_state_machine_as_test(AnchorCacheMachine, settings=SETTINGS)
    print(f"coverage over {SETTINGS.max_examples} examples: {dict(COVERAGE)}")
    for name in (
        "chunk cut at an anchor",
        "decode anchor saved",
        "restored from an anchor checkpoint",
        "restored from a decode anchor checkpoint",
    ):
        assert COVERAGE[name] >= 1, f"never happened: {name} ({dict(COVERAGE)})"


def test_next_turn_restores_the_decode_anchor_checkpoint():
    """The harness case the state machine reaches only by chance, run deterministically: a
    request decodes past anchors (each saves the recurrent state), and while it still runs a
    next turn resends the prompt and the generated text up to the last decode anchor, then new
    blocks: its admission restores exactly that decode anchor checkpoint, counts it as an
    anchor restore, and evicts nothing."""
    sim = CacheSim(state_slots=12, kv_slots=200, rows=4, min_gap=MIN_GAP)
    req = sim.admit([OPEN, 5, 6, 7, CLOSE, 8, 9, 10], 24)
    assert req is not None
    while sim.prefilling(req):
        assert sim.prefill_chunk(req, 24) is not None
    saved = []
    for token in [11, 12, OPEN, 13, 14, CLOSE, 15, 16, OPEN, 17, 18, CLOSE, 19, 20]:
        before = req.kv.cache_protected_len
        assert sim.decode(req, token)
        if req.kv.cache_protected_len != before:
            ids = list(req.origin_input_ids) + list(req.output_ids)
            saved.append(ids[: req.kv.kv_committed_len])
    assert saved, "no decode anchor was saved"
    evictions = sim.evictions
    prefix = saved[-1]
    nxt = sim.admit([*prefix, B_LT, B_GT, 21, 22, OPEN, 23, CLOSE, 5], 24)
    assert nxt is not None
    assert nxt.anchor_admitted_prefix == len(prefix), (nxt.anchor_admitted_prefix, len(prefix))
    assert nxt.anchor_restored, "the decode anchor checkpoint was matched but not counted"
    assert sim.evictions == evictions
