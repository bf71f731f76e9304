"""torch.ops.sgl_kernel.expert_cache_control (CPU) against the plain-Python reference model,
and the pool resize (``resize.resize_tables``) against the model's ``resize``.

Every call is compared output by output and table by table with ``ReferenceExpertCache``
(python/sglang/srt/layers/moe/expert_cache/reference.py), and the table invariants are checked
after every call: the maps are inverse, no slot holds two ids, no hit slot is evicted in its own
call, every routed entry is in exactly one of slot_ids / cpu_ids.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from ec_util import OpCache, check_call, control, random_routing, ref_state, reference
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

QSTAR, FILL, CPU = control.MissPolicy.QSTAR, control.MissPolicy.FILL, control.MissPolicy.CPU


def step(op: OpCache, ref: reference.ReferenceExpertCache, topk, layer, ratio, policy):
    """One call on both; asserts identical outputs and tables, and the invariants."""
    before = op.state()
    assert before == ref_state(ref)
    got = op.control(topk, layer, ratio, policy)
    want = ref.control(topk, layer, op.F, ratio, policy)
    assert got == want
    after = op.state()
    assert after == ref_state(ref)
    check_call(topk, layer, op.E, before, after, got)
    ref.check_invariants()
    return got


# ---------------------------------------------------------------- randomized sequences


@pytest.mark.parametrize("seed", range(12))
def test_random_sequences(seed, victim_scan_isa):
    rng = random.Random(seed)
    L = rng.randint(1, 4)
    E = rng.choice([4, 8, 16, 33, 64])
    S = rng.randint(1, L * E)
    F = rng.randint(1, 16)
    K = rng.randint(1, min(8, E))
    op = OpCache(L, E, S, F, top_k=K)
    ref = reference.ReferenceExpertCache(L, E, S)
    hot = {layer: rng.sample(range(E), max(K, E // 4)) for layer in range(L)}
    for _ in range(60):
        layer = rng.randrange(L)
        if rng.random() < 0.1:  # the working set drifts
            hot[layer] = rng.sample(range(E), max(K, E // 4))
        T = rng.choice([1, 1, 2, 4, 8, 16, 64])
        topk = random_routing(rng, T, K, E, hot[layer])
        policy = rng.choice([QSTAR, QSTAR, FILL, CPU])
        ratio = rng.choice([0.0, 0.1, 0.5, 0.8, 1.0, 1.5, 3.0, rng.uniform(0, 3)])
        step(op, ref, topk, layer, ratio, policy)
    assert op.tables.stats.tolist() == ref.stats


# ---------------------------------------------------------------- hypothesis state machine


class ControlMachine(RuleBasedStateMachine):
    """Random configurations and call sequences; op and reference compared after every call."""

    @initialize(
        L=st.integers(1, 4),
        E=st.integers(4, 64),
        s_frac=st.floats(0.0, 1.0),
        F=st.integers(1, 16),
        K=st.integers(1, 8),
    )
    def setup(self, L, E, s_frac, F, K):
        S = max(1, min(L * E, round(s_frac * L * E)))
        self.L, self.E, self.K = L, E, min(K, E)
        self.op = OpCache(L, E, S, F, top_k=self.K)
        self.ref = reference.ReferenceExpertCache(L, E, S)

    @rule(
        data=st.data(),
        T=st.integers(0, 64),
        ratio=st.one_of(st.sampled_from([0.0, 0.1, 0.5, 1.0, 3.0]), st.floats(0.0, 3.0)),
        policy=st.sampled_from([QSTAR, FILL, CPU]),
    )
    def call(self, data, T, ratio, policy):
        layer = data.draw(st.integers(0, self.L - 1), label="layer")
        # a small expert alphabet per call makes hits, ties and repeats likely
        alphabet = data.draw(
            st.lists(st.integers(0, self.E - 1), min_size=1, max_size=self.E, unique=True),
            label="alphabet",
        )
        ids = st.one_of(st.sampled_from(alphabet), st.just(-1))
        topk = data.draw(
            st.lists(st.lists(ids, min_size=self.K, max_size=self.K), min_size=T, max_size=T)
        )
        step(self.op, self.ref, topk, layer, ratio, policy)

    @rule(data=st.data())
    def resize(self, data):
        """A shrink or grow at a safe point: the same moves and tables as the reference."""
        live = data.draw(st.integers(0, self.ref.num_slots), label="live_slots")
        assert self.op.resize(live) == self.ref.resize(live)
        self.ref.check_invariants()

    @invariant()
    def same_state(self):
        if hasattr(self, "op"):
            assert self.op.state() == ref_state(self.ref)


TestControlMachine = ControlMachine.TestCase
TestControlMachine.settings = settings(
    max_examples=40,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# ---------------------------------------------------------------- targeted cases


def fresh(L=2, E=8, S=4, F=4, K=2):
    return OpCache(L, E, S, F, top_k=K), reference.ReferenceExpertCache(L, E, S)


def test_no_miss_and_empty_batch():
    op, ref = fresh(S=8)
    step(op, ref, [[1, 2], [3, -1]], 0, 1.0, FILL)  # fills 1, 2, 3
    r = step(op, ref, [[2, 1], [-1, 3]], 0, 0.5, QSTAR)  # m = 0
    assert r.counts == [0, 0, 3, 0]
    assert r.fill_src == [-1] * 4 and r.fill_dst == [-1] * 4
    r = step(op, ref, [], 1, 0.5, QSTAR)  # T = 0
    assert r.counts == [0, 0, 0, 0]
    r = step(op, ref, [[-1, -1]], 1, 0.5, QSTAR)  # padding only
    assert r.counts == [0, 0, 0, 0] and r.slot_ids == [[-1, -1]] and r.cpu_ids == [[-1, -1]]
    assert op.tables.clock.item() == 4


@pytest.mark.parametrize(
    "m, ratio, q",
    [
        (3, 0.5, 2),
        (3, 0.1, 1),
        (3, 0.0, 1),
        (3, 3.0, 3),
        (1, 0.5, 1),
        (5, 0.5, 3),
        (4, 0.5, 2),
        (6, 0.25, 2),
        (7, 0.8, 6),
        (10, 0.05, 1),
        (10, 0.15, 2),
    ],
)
def test_qstar_rounding(m, ratio, q):
    assert reference.fill_count(QSTAR, m, ratio) == q == min(max(math.floor(m * ratio + 0.5), 1), m)
    op, ref = fresh(L=1, E=16, S=16, F=16, K=1)
    r = step(op, ref, [[e] for e in range(m)], 0, ratio, QSTAR)
    assert r.counts == [q, m - q, 0, m]


def test_policies_and_fill_capacity():
    op, ref = fresh(L=1, E=16, S=16, F=3, K=1)
    r = step(op, ref, [[e] for e in range(6)], 0, 0.0, FILL)
    assert r.counts == [3, 3, 0, 6]  # capped by F
    r = step(op, ref, [[e] for e in range(6, 10)], 0, 3.0, CPU)
    assert r.counts == [0, 4, 0, 4] and r.fill_src == [-1, -1, -1]


def test_fill_order_most_tokens_then_lower_id():
    op, ref = fresh(L=1, E=8, S=8, F=8, K=2)
    # tokens: 5 -> 3, 2 -> 2, 6 -> 2, 1 -> 1, 7 -> 1
    topk = [[5, 6], [5, 2], [5, 1], [2, 6], [7, -1]]
    r = step(op, ref, topk, 0, 0.6, QSTAR)  # m = 5, q = 3
    assert r.counts == [3, 2, 0, 5]
    assert r.fill_src[:3] == [5, 2, 6]
    assert r.cpu_ids[2] == [-1, 1] and r.cpu_ids[4] == [7, -1]


def test_fewer_slots_than_distinct_ids_lru_victims():
    op, ref = fresh(L=2, E=8, S=3, F=8, K=1)
    r = step(op, ref, [[e] for e in range(5)], 0, 1.0, FILL)  # 5 misses, 3 slots
    assert r.counts == [3, 2, 0, 5] and r.fill_dst[:3] == [0, 1, 2]
    step(op, ref, [[1]], 0, 1.0, FILL)  # hit: slot of 1 is now most recent
    r = step(op, ref, [[3], [4]], 1, 1.0, FILL)  # layer 1: evicts LRU slots 0 then 2, in order
    assert r.fill_dst[:2] == [0, 2] and r.fill_src[:2] == [8 + 3, 8 + 4]
    assert op.tables.slot_of_id.tolist()[:3] == [-1, 1, -1]


def test_all_slots_hit_no_candidates():
    op, ref = fresh(L=1, E=8, S=2, F=4, K=1)
    step(op, ref, [[0], [1]], 0, 1.0, FILL)
    r = step(op, ref, [[0], [1], [2], [3]], 0, 1.0, FILL)  # both slots are hits
    assert r.counts == [0, 2, 2, 2] and r.cpu_ids == [[-1], [-1], [2], [3]]


def test_empty_slots_before_lru_and_ties_by_slot():
    op, ref = fresh(L=1, E=8, S=4, F=4, K=1)
    step(op, ref, [[0]], 0, 1.0, FILL)  # slot 0
    step(op, ref, [[1]], 0, 1.0, FILL)  # slot 1
    r = step(op, ref, [[2], [3], [4]], 0, 1.0, FILL)  # empty 2, 3 first, then LRU slot 0
    assert r.fill_dst[:3] == [2, 3, 0]


@pytest.mark.parametrize("max_time", [5, 30])
def test_prefilled_random_state(victim_scan_isa, max_time):
    """Start from a random consistent state with tied and stale last-use values; with
    max_time 30 some slots even carry times after the clock (not produced by the op itself)."""
    rng = random.Random(7 + max_time)
    L, E, S, F, K = 3, 16, 80, 6, 4
    ref = reference.ReferenceExpertCache(L, E, S)
    ids = rng.sample(range(L * E), 45)
    for s, g in zip(rng.sample(range(S), 45), ids):
        ref.id_of_slot[s] = g
        ref.slot_of_id[g] = s
        ref.slot_last_use[s] = rng.randint(0, max_time)
    ref.clock = 9
    op = OpCache(L, E, S, F, top_k=K)
    op.load(ref)
    for _ in range(40):
        layer = rng.randrange(L)
        topk = random_routing(rng, rng.randint(1, 12), K, E, list(range(6)))
        step(op, ref, topk, layer, rng.uniform(0, 2), rng.choice([QSTAR, FILL, CPU]))


@pytest.mark.parametrize("F", [1, 5, 16])
def test_large_table_random_ages(victim_scan_isa, F):
    """Slot order unrelated to age (as in a warm cache): the victim pass keeps cutting its
    buffer of below-threshold keys, on the scalar and the SIMD path."""
    rng = random.Random(F)
    L, E, S, K = 8, 256, 1500, 8
    ref = reference.ReferenceExpertCache(L, E, S)
    ages = list(range(1000)) * 2  # ties too
    rng.shuffle(ages)
    for s, g in enumerate(rng.sample(range(L * E), 1400)):  # 100 slots stay empty
        ref.id_of_slot[s] = g
        ref.slot_of_id[g] = s
        ref.slot_last_use[s] = ages[s]
    ref.clock = 1000
    op = OpCache(L, E, S, F, top_k=K)
    op.load(ref)
    for _ in range(25):
        topk = random_routing(rng, rng.choice([8, 64]), K, E, rng.sample(range(E), 40), pad_p=0.0)
        step(op, ref, topk, rng.randrange(L), 1.0, FILL)


def test_bad_ids_raise_before_any_change():
    op, ref = fresh()
    step(op, ref, [[1, 2]], 0, 1.0, FILL)
    before = op.state()
    for bad in (8, -2, 100):
        with pytest.raises(RuntimeError, match="outside"):
            op.control([[1, bad]], 0, 1.0, FILL)
        with pytest.raises(ValueError):
            ref.control([[1, bad]], 0, op.F, 1.0, FILL)
        assert op.state() == before == ref_state(ref)
    step(op, ref, [[3, 1]], 1, 1.0, FILL)  # still usable afterwards


def _args(op, topk, **over):
    T = len(topk)
    out = torch.full((T, op.K), -1, dtype=torch.int32)
    a = dict(
        topk_ids=torch.tensor(topk, dtype=torch.int32),
        layer=0,
        num_experts=op.E,
        slot_of_id=op.tables.slot_of_id,
        id_of_slot=op.tables.id_of_slot,
        slot_last_use=op.tables.slot_last_use,
        clock=op.tables.clock,
        slot_ids=out,
        cpu_ids=out.clone(),
        fill_src=op.fills.fill_src,
        fill_dst=op.fills.fill_dst,
        counts=op.fills.counts,
        stats=op.tables.stats,
        fill_ratio=0.5,
        policy=0,
    )
    a.update(over)
    return a


@pytest.mark.parametrize(
    "over, match",
    [
        (dict(topk_ids=torch.tensor([[1, 2]], dtype=torch.int64)), "int32"),
        (dict(topk_ids=torch.tensor([1, 2], dtype=torch.int32)), r"\[T, K\]"),
        (dict(slot_ids=torch.zeros(2, 2, dtype=torch.int32)), "shape"),
        (dict(layer=2), "slot_of_id"),
        (dict(layer=-1), "layer"),
        (dict(num_experts=0), "num_experts"),
        (dict(slot_last_use=torch.zeros(3, dtype=torch.int64)), "slot_last_use"),
        (dict(slot_last_use=torch.zeros(4, dtype=torch.int32)), "int64"),
        (dict(fill_dst=torch.zeros(3, dtype=torch.int32)), "fill_dst"),
        (dict(counts=torch.zeros(3, dtype=torch.int32)), "counts"),
        (dict(stats=torch.zeros(4, dtype=torch.int32)), "int64"),
        (dict(policy=3), "policy"),
        (dict(fill_ratio=-0.5), "fill_ratio"),
        (dict(fill_ratio=float("nan")), "fill_ratio"),
        (dict(topk_ids=torch.tensor([[1, 2, 3, 4]], dtype=torch.int32)[:, ::2]), "contiguous"),
    ],
)
def test_argument_errors(over, match):
    op, _ = fresh()
    before = op.state()
    with pytest.raises(RuntimeError, match=match):
        torch.ops.sgl_kernel.expert_cache_control(**_args(op, [[1, 2]], **over))
    assert op.state() == before


def test_resize_keeps_the_most_recent_entries_and_leaves_the_tail_empty():
    op, ref = fresh(L=1, E=16, S=6, F=8, K=1)
    step(op, ref, [[e] for e in range(6)], 0, 1.0, FILL)  # experts 0..5 in slots 0..5
    step(op, ref, [[5]], 0, 1.0, FILL)  # 5 is now the most recent, then 0..4 (tied, by slot)
    step(op, ref, [[4]], 0, 1.0, FILL)
    moves = op.resize(3)
    assert moves == ref.resize(3) == [(4, 1), (5, 2)]  # kept: 4, 5 and slot 0 (lowest tied)
    assert op.state() == ref_state(ref)
    assert op.tables.id_of_slot.tolist() == [0, 4, 5, -1, -1, -1]
    # tail slots are never victims: 3 misses fill at most the 3 live slots minus this call's hits
    r = step(op, ref, [[7], [8], [9], [4]], 0, 1.0, FILL)
    assert r.counts == [2, 1, 1, 3] and set(r.fill_dst[:2]) <= {0, 1, 2}
    assert op.resize(6) == ref.resize(6) == []  # a grow moves nothing; new slots fill first
    r = step(op, ref, [[10], [11]], 0, 1.0, FILL)
    assert r.fill_dst[:2] == [3, 4]
    assert op.resize(0) == ref.resize(0) == [] and op.state() == ref_state(ref)
    r = step(op, ref, [[1], [2]], 0, 1.0, FILL)  # no slots: every miss on the CPU
    assert r.counts == [0, 2, 0, 2]
    with pytest.raises(ValueError, match="outside"):
        op.resize(7)


@pytest.mark.parametrize(
    "live, match",
    [
        (torch.tensor([5], dtype=torch.int32), "outside"),
        (torch.tensor([-1], dtype=torch.int32), "outside"),
        (torch.tensor([2], dtype=torch.int64), "int32"),
        (torch.tensor([2, 2], dtype=torch.int32), "one entry"),
    ],
)
def test_live_slots_argument_errors(live, match):
    op, _ = fresh()
    before = op.state()
    with pytest.raises(RuntimeError, match=match):
        torch.ops.sgl_kernel.expert_cache_control(**_args(op, [[1, 2]], live_slots=live))
    assert op.state() == before


def test_corrupt_table_raises():
    op, _ = fresh()
    op.tables.slot_of_id[3] = 99
    with pytest.raises(RuntimeError, match="slot_of_id"):
        op.control([[3, 1]], 0, 1.0, FILL)


def test_wrapper_accepts_policy_names():
    op, ref = fresh()
    ids = torch.tensor([[1, 2]], dtype=torch.int32)
    r = control.expert_cache_control(ids, 0, 8, op.tables, op.fills, 0.5, "fill")
    assert r.fills is op.fills and r.fills.counts.tolist() == [2, 0, 0, 2]
    with pytest.raises(ValueError, match="policy must be one of qstar, fill, cpu"):
        control.expert_cache_control(ids, 0, 8, op.tables, op.fills, 0.5, "lru")


def test_enumerations_come_from_the_op_library():
    """MissPolicy and Stat are the header's lists (csrc/shared/expert_cache.h), in value order,
    and the counters the op writes are in that order."""
    assert [m.name for m in control.MissPolicy] == ["QSTAR", "FILL", "CPU"]
    assert [m.name for m in control.Stat] == ["FILLS", "CPU_EXPERTS", "HITS", "MISSES"]
    assert control.MissPolicy.parse("Qstar") is control.MissPolicy.QSTAR
    assert control.MissPolicy.parse(2) is control.MissPolicy.CPU
    for bad in (None, 1.7, True, 3, "lru"):
        with pytest.raises(
            ValueError, match="--expert-cache-policy must be one of qstar, fill, cpu"
        ):
            control.MissPolicy.parse(bad)
    with pytest.raises(RuntimeError, match="miss_policy, stat, expert_format or expert_activation"):
        torch.ops.sgl_kernel.expert_cache_enum("colour")
    op, _ = fresh()
    # 3 distinct misses, 1 fill (qstar at ratio 0.2 rounds 0.6 up to 1), then a hit.
    r = op.control([[1, 2], [3, -1]], 0, 0.2, QSTAR)
    S = control.Stat
    assert (r.counts[S.FILLS], r.counts[S.CPU_EXPERTS], r.counts[S.HITS], r.counts[S.MISSES]) == (
        1,
        2,
        0,
        3,
    )
    filled = r.fill_src[0]
    r = op.control([[filled, -1]], 0, 0.2, QSTAR)
    assert r.counts[S.HITS] == 1 and r.counts[S.MISSES] == 0
    assert op.tables.stats.tolist()[S.HITS] == 1 and op.tables.stats.tolist()[S.CPU_EXPERTS] == 2


def test_no_slots_sends_every_miss_to_the_cpu():
    """With S = 0 the op fills nothing under every policy and counts each distinct routed expert
    as a miss run on the CPU (what the cache does at 0 slots), as the reference model does."""
    for policy in (QSTAR, FILL, CPU):
        op = OpCache(2, 8, 0, 1, top_k=2)
        ref = reference.ReferenceExpertCache(2, 8, 0)
        got = step(op, ref, [[3, 5], [5, -1]], 1, 0.0, policy)
        assert got.slot_ids == [[-1, -1], [-1, -1]] and got.cpu_ids == [[11, 13], [13, -1]]
        assert got.counts == [0, 2, 0, 2]
