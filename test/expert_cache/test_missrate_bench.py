"""benchmark/expert_cache/bench_missrate.py: the placement policies it simulates and its CLI.

* LRU (shared pool and per-layer pools) against a plain reference model (timestamps, victim =
  oldest slot not routed in the current call) on random traces;
* capacity 100%: LRU misses exactly the compulsory misses (first touch of each expert);
* a repeated set that fits misses only on its first call;
* a cyclic sweep larger than the capacity: LRU misses 100% (also across layers: one token's
  L*k working set beyond the shared pool), while the calibrated static placement does not;
* static calibrated on a stationary trace: near the best static placement, far below nothing
  cached and the routing-blind layer split;
* refresh_prefill serves each prefill with the previous placement, the decode after it with
  the new one; static_blind holds whole last layers;
* the JSONL parser names the line of each malformed record; the script runs end to end.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

SCRIPT = Path(__file__).resolve().parents[2] / "benchmark" / "expert_cache" / "bench_missrate.py"
_spec = importlib.util.spec_from_file_location("expert_cache_missrate", SCRIPT)
mr = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = mr  # dataclasses resolve annotations through sys.modules
_spec.loader.exec_module(mr)

TINY = [
    "--num-layers",
    "4",
    "--num-experts",
    "16",
    "--top-k",
    "2",
    "--requests",
    "3",
    "--prefill-tokens",
    "8",
    "--decode-tokens",
    "12",
    "--topic-experts",
    "2",
]


def trace_of(L: int, E: int, calls: list[tuple]) -> "mr.Trace":
    """calls: (step, layer, phase, experts[, counts]) with counts defaulting to 1 each."""
    out = []
    for c in calls:
        step, layer, phase, experts = c[:4]
        counts = c[4] if len(c) > 4 else (1,) * len(experts)
        out.append(
            mr.Call(step, layer, phase == "prefill", max(counts), tuple(experts), tuple(counts))
        )
    return mr.Trace(L, E, out)


def call_gids(trace) -> list[list[int]]:
    o = trace.offsets
    return [trace.gids[o[i] : o[i + 1]].tolist() for i in range(trace.num_calls)]


def reference_lru(trace, slots: int, per_layer: bool) -> list[int]:
    """Per-call misses of the fill policy, the slow obvious way."""
    L, E = trace.num_layers, trace.num_experts
    caps = [slots // L + (l < slots % L) for l in range(L)] if per_layer else None
    last: dict[int, int] = {}  # resident gid -> time of last touch
    t, misses = 0, []
    for layer, gids in zip(trace.layer.tolist(), call_gids(trace)):
        if per_layer:
            cap, mine = caps[layer], (lambda g, layer=layer: g // E == layer)
        else:
            cap, mine = slots, (lambda g: True)
        hits = [g for g in gids if g in last]
        miss = [g for g in gids if g not in last]
        for g in hits:
            t += 1
            last[g] = t
        for g in miss[: max(cap - len(hits), 0)]:
            pool = [v for v in last if mine(v)]
            if len(pool) >= cap:
                victims = [v for v in pool if v not in gids]
                assert victims, "fill with no evictable slot"
                del last[min(victims, key=last.__getitem__)]
            t += 1
            last[g] = t
        assert sum(map(mine, last)) <= cap
        assert all(g in last for g in hits), "a hit of this call was evicted"
        misses.append(len(miss))
    return misses


@st.composite
def random_trace(draw):
    L = draw(st.integers(1, 3))
    E = draw(st.integers(1, 6))
    n_steps = draw(st.integers(1, 12))
    calls = []
    for s in range(n_steps):
        phase = draw(st.sampled_from(mr.PHASES))
        for l in range(L):
            ex = sorted(draw(st.sets(st.integers(0, E - 1), min_size=1, max_size=E)))
            counts = tuple(draw(st.integers(1, 3)) for _ in ex)
            calls.append((s, l, phase, ex, counts))
    return trace_of(L, E, calls), draw(st.integers(0, L * E))


@settings(max_examples=150, deadline=None)
@given(random_trace(), st.booleans())
def test_lru_matches_reference(ts, per_layer):
    trace, slots = ts
    miss, miss_tok = mr.simulate_lru(trace, slots, per_layer=per_layer)
    assert miss.tolist() == reference_lru(trace, slots, per_layer)
    assert (miss <= trace.sizes).all() and (miss_tok <= miss * trace.counts.max()).all()


def test_call_larger_than_capacity_fills_only_free_and_evictable_slots():
    # 3 slots, a call of 5 misses: the 3 with most tokens are filled, the rest run unfilled
    t = trace_of(
        1,
        10,
        [
            (0, 0, "decode", [0, 1, 2, 3, 4], (1, 5, 4, 3, 2)),
            (1, 0, "decode", [1, 2, 3]),
            (2, 0, "decode", [0, 1]),
            (3, 0, "decode", [1, 2, 3]),
        ],
    )
    miss, miss_tok = mr.simulate_lru(t, 3)
    # step 2: 1 hits, 0 fills evicting the LRU of {1,2,3} = 2 (1 and 3 were touched later)
    assert miss.tolist() == [5, 0, 1, 1]
    assert miss_tok.tolist() == [15, 0, 1, 1]


@pytest.mark.parametrize("per_layer", [False, True])
def test_full_capacity_lru_misses_only_first_touches(per_layer):
    trace = mr.generate_synthetic(
        mr.SynthParams(
            num_layers=3,
            num_experts=8,
            top_k=2,
            requests=3,
            prefill_tokens=5,
            decode_tokens=10,
            topic_experts=2,
            seed=3,
        )
    )
    miss, _ = mr.simulate_lru(trace, trace.pool, per_layer=per_layer)
    seen, compulsory = set(), []
    for gids in call_gids(trace):
        compulsory.append(len(set(gids) - seen))
        seen |= set(gids)
    assert miss.tolist() == compulsory
    assert sum(compulsory) == len(seen) < trace.pool * 1.01  # every miss a first touch
    # and a capacity short of the pool misses more than that on this trace
    assert mr.simulate_lru(trace, trace.pool // 4, per_layer=per_layer)[0].sum() > len(seen)
    sims = mr.simulate_all(trace, 100, trace.calib_end_step(0.0))
    assert sims["static"][0].sum() == sims["static_blind"][0].sum() == 0


@pytest.mark.parametrize("per_layer", [False, True])
def test_repeated_set_that_fits_misses_only_on_first_call(per_layer):
    L, E = 4, 16
    t = trace_of(L, E, [(s, l, "decode", [1, 5, 7]) for s in range(20) for l in range(L)])
    miss, _ = mr.simulate_lru(t, 3 * L, per_layer=per_layer)
    assert miss.reshape(20, L)[0].tolist() == [3] * L
    assert miss.reshape(20, L)[1:].sum() == 0
    # one slot short of a step's 3L experts: each call misses the one expert the previous
    # call's fill evicted (calls look up their whole set before filling)
    miss, _ = mr.simulate_lru(t, 3 * L - 1, per_layer=False)
    assert (miss.reshape(20, L)[1:] == 1).all()


def test_cyclic_sweep_larger_than_capacity_lru_misses_everything_static_does_not():
    E = 10
    t = trace_of(1, E, [(s, 0, "decode", [s % E]) for s in range(5 * E)])
    end = t.calib_end_step(0.2)  # the first sweep calibrates
    assert end == E
    sims = mr.simulate_all(t, 50, end)
    rates = {k: mr.miss_rates(t, *v, end) for k, v in sims.items()}
    assert rates["lru_shared"].decode == rates["lru_per_layer"].decode == 1.0
    assert rates["static"].decode == 0.5
    assert rates["static_blind"].decode == 0.5


def test_shared_pool_smaller_than_one_token_working_set_misses_everything():
    # L layers x k experts per token: a layer's experts come back after (L-1)*k other experts,
    # so a shared pool of at most (L-1)*k slots misses every access, even though every layer
    # routes the same k experts at each token (the pool sweeps cyclically across layers)
    L, k = 6, 4
    t = trace_of(L, 16, [(s, l, "decode", list(range(k))) for s in range(30) for l in range(L)])
    assert mr.simulate_lru(t, (L - 1) * k)[0].sum() == t.sizes.sum()
    assert mr.simulate_lru(t, L * k)[0].sum() == L * k
    # per-layer pools of k - 1 slots keep k - 1 of the k experts resident
    per = mr.simulate_lru(t, L * (k - 1), per_layer=True)[0]
    assert per.reshape(30, L)[1:].tolist() == [[1] * L] * 29


def test_static_calibrated_on_stationary_trace_is_near_best_static():
    p = mr.SynthParams(
        num_layers=4,
        num_experts=32,
        top_k=4,
        requests=6,
        prefill_tokens=32,
        decode_tokens=200,
        zipf=1.2,
        drift=0.0,
        topic_experts=0,
        persist=0.0,
        seed=1,
    )
    t = mr.generate_synthetic(p)
    end = t.calib_end_step(0.5)
    S = mr.capacity_slots(t, 25)
    sims = mr.simulate_all(t, 25, end)
    r = {k: mr.miss_rates(t, *v, end).decode for k, v in sims.items()}
    # best static placement in hindsight: the top S experts of the measured decode calls
    measured_dec = (t.step >= end) & ~t.prefill
    best = mr.top_slots(mr.token_counts(t, measured_dec), S)
    r_best = mr.miss_rates(
        t, *mr.simulate_placements(t, best[None], np.zeros(t.num_calls, dtype=int)), end
    ).decode
    assert r_best <= r["static"] <= r_best + 0.03
    assert r["static"] < 0.6  # nothing cached: 1.0
    assert r["static"] < r["static_blind"] - 0.15  # routing-blind split misses ~75%
    assert abs(r["static_blind"] - 0.75) < 0.05


def test_refresh_prefill_serves_prefill_with_previous_placement():
    t = trace_of(
        1,
        8,
        [
            (0, 0, "prefill", [1, 2, 3], (5, 4, 1)),
            (1, 0, "decode", [1, 2]),
            (2, 0, "decode", [3]),
            (3, 0, "prefill", [4, 5, 6], (1, 1, 9)),
            (4, 0, "decode", [6, 2]),
            (5, 0, "decode", [1]),
        ],
    )
    S = 2
    placements, version = mr.refresh_prefill_placements(t, S)
    assert version.tolist() == [0, 1, 1, 1, 2, 2]
    assert np.flatnonzero(placements[1]).tolist() == [1, 2]
    # second prefill: 6 has most tokens, then a tie at 1 token among 4 and 5 and count 0
    # among the rest: 4 wins by id (nothing of 4, 5 was resident)
    assert np.flatnonzero(placements[2]).tolist() == [4, 6]
    miss, _ = mr.simulate_placements(t, placements, version)
    assert miss.tolist() == [3, 0, 1, 3, 1, 1]


def test_refresh_tie_prefers_already_resident():
    t = trace_of(1, 8, [(0, 0, "prefill", [5, 6], (2, 1)), (1, 0, "prefill", [1], (3,))])
    placements, _ = mr.refresh_prefill_placements(t, 3)
    assert np.flatnonzero(placements[1]).tolist() == [0, 5, 6]  # 0 tokens: lowest id
    # prefill 2 routes only 1; the two slots left go to residents (0, 5), not to id order (0, 2)
    assert np.flatnonzero(placements[2]).tolist() == [0, 1, 5]


def test_static_sees_only_the_calibration_prefix():
    # calibration routes expert 0, the measured part expert 1 (twice as often): a static
    # placement fixed at load holds 0 and misses everything measured
    t = trace_of(1, 4, [(s, 0, "decode", [0 if s < 10 else 1]) for s in range(30)])
    end = t.calib_end_step(1 / 3)
    assert end == 10
    assert np.flatnonzero(mr.static_calibrated(t, 1, end)).tolist() == [0]
    sims = mr.simulate_all(t, 25, end)
    rates = {k: mr.miss_rates(t, *v, end).decode for k, v in sims.items()}
    assert rates["static"] == 1.0
    assert rates["lru_shared"] == 1 / 20  # one compulsory miss of expert 1


def test_static_blind_is_last_whole_layers():
    t = trace_of(4, 8, [(0, l, "decode", [0]) for l in range(4)])
    p = mr.static_blind(t, 12)
    assert np.flatnonzero(p).tolist() == [16, 17, 18, 19] + list(range(24, 32))


def test_parser_reads_valid_trace(tmp_path):
    f = tmp_path / "t.jsonl"

    def rec(step, layer, phase, ex, ct):
        return json.dumps(
            dict(
                step=step,
                layer=layer,
                phase=phase,
                tokens=max(ct),
                experts=ex,
                counts=ct,
                num_experts=8,
                num_layers=2,
            )
        )

    # out of order on purpose: calls replay in (step, layer) order
    f.write_text(
        "\n".join(
            [
                rec(1, 1, "decode", [0, 3], [1, 1]),
                rec(0, 0, "prefill", [1, 2, 5], [1, 4, 2]),
                "",
                rec(0, 1, "prefill", [7], [3]),
                rec(1, 0, "decode", [2, 6], [1, 1]),
            ]
        )
        + "\n"
    )
    t = mr.parse_trace_jsonl(f)
    assert (t.num_layers, t.num_experts, t.num_calls) == (2, 8, 4)
    assert call_gids(t) == [[2, 5, 1], [15], [2, 6], [8, 11]]  # priority: tokens desc
    assert t.prefill.tolist() == [True, True, False, False]


GOOD = dict(
    step=0,
    layer=0,
    phase="decode",
    tokens=1,
    experts=[1, 4],
    counts=[1, 1],
    num_experts=8,
    num_layers=2,
)


@pytest.mark.parametrize(
    "bad, message",
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "not a JSON object"),
        (dict(GOOD, experts=None), "must be lists"),
        ({k: v for k, v in GOOD.items() if k != "counts"}, "missing key 'counts'"),
        (dict(GOOD, step=-1), "'step' must be a non-negative int"),
        (dict(GOOD, layer="0"), "'layer' must be a non-negative int"),
        (dict(GOOD, layer=2), "layer 2 out of range"),
        (dict(GOOD, phase="extend"), "phase must be one of"),
        (dict(GOOD, experts=[4, 1]), "distinct and sorted"),
        (dict(GOOD, experts=[1, 1]), "distinct and sorted"),
        (dict(GOOD, experts=[1, 8]), r"ints in \[0, 8\)"),
        (dict(GOOD, experts=[], counts=[]), "'experts' is empty"),
        (dict(GOOD, counts=[1]), "'experts' has 2 ids but 'counts' 1"),
        (dict(GOOD, counts=[1, 0]), "'counts' must be ints >= 1"),
        (dict(GOOD, num_experts=16), "differ from earlier lines"),
        (dict(GOOD), r"duplicate \(step, layer\) = \(0, 0\), first on line 1"),
    ],
)
def test_parser_names_the_malformed_line(tmp_path, bad, message):
    lines = [
        json.dumps(GOOD),
        json.dumps(dict(GOOD, layer=1, step=5)),
        "",
        bad if isinstance(bad, str) else json.dumps(bad),
    ]
    f = tmp_path / "bad.jsonl"
    f.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=rf"bad\.jsonl: line 4: .*{message}"):
        mr.parse_trace_jsonl(f)


def test_parser_rejects_empty_file(tmp_path):
    f = tmp_path / "empty.jsonl"
    f.write_text("\n")
    with pytest.raises(ValueError, match="no trace lines"):
        mr.parse_trace_jsonl(f)


def last_line_pairs(text: str) -> dict[str, str]:
    last = text.strip().splitlines()[-1].split()
    assert last[0] == "expert_cache_missrate"
    pairs = dict(kv.split("=", 1) for kv in last[1:])
    assert len(pairs) == len(last) - 1
    return pairs


REQUIRED = ("lru_c25", "static_c25", "refresh_c25", "lru_c50", "static_c50", "refresh_c50")


def test_script_runs_end_to_end_on_tiny_synthetic_trace():
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--synthetic", *TINY, "--capacities", "10,100"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    pairs = last_line_pairs(r.stdout)
    assert pairs["source"] == "synthetic"
    for k in REQUIRED:
        assert 0.0 <= float(pairs[k]) <= 1.0, (k, pairs[k])
    # 25 and 50 are always simulated for the last line; rows in the table for each capacity
    rows = [
        l.split()[0]
        for l in r.stdout.splitlines()
        if l.strip() and l.split()[0].replace(".", "").isdigit()
    ]
    assert rows[:4] == ["10", "25", "50", "100"]
    assert "seed=0" in r.stdout.splitlines()[0]


def test_script_is_deterministic_and_reads_a_trace(tmp_path):
    outs = []
    for _ in range(2):
        lines: list[str] = []
        assert mr.main([*TINY, "--seed", "7"], out=lines.append) == 0
        outs.append([l for l in lines if not l.startswith("# wall")])
    assert outs[0] == outs[1]

    # the same routing written as a recorded trace gives the same rates
    t = mr.generate_synthetic(
        mr.SynthParams(
            num_layers=4,
            num_experts=16,
            top_k=2,
            requests=3,
            prefill_tokens=8,
            decode_tokens=12,
            topic_experts=2,
            seed=7,
        )
    )
    f = tmp_path / "routing.jsonl"
    with open(f, "w") as fh:
        for i, gids in enumerate(call_gids(t)):
            o = t.offsets
            ex_ct = sorted(zip((g % 16 for g in gids), t.counts[o[i] : o[i + 1]].tolist()))
            fh.write(
                json.dumps(
                    dict(
                        step=int(t.step[i]),
                        layer=int(t.layer[i]),
                        phase="prefill" if t.prefill[i] else "decode",
                        tokens=int(t.tokens[i]),
                        experts=[e for e, _ in ex_ct],
                        counts=[c for _, c in ex_ct],
                        num_experts=16,
                        num_layers=4,
                    )
                )
                + "\n"
            )
    lines = []
    assert mr.main(["--trace", str(f)], out=lines.append) == 0
    got, want = last_line_pairs("\n".join(lines)), last_line_pairs("\n".join(outs[0]))
    assert got.pop("source") == "trace" and want.pop("source") == "synthetic"
    assert got == want
