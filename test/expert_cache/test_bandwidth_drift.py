"""B_P / B_H re-derived while serving (``expert_cache/bandwidth_drift.py``; issue 15's
"bandwidth drift"): the window rule on synthetic samples, the control op reading the ratio as
device data (``live_fill_ratio``), and a CPU cache whose CPU branch slows down mid-run: the
ratio follows, later calls fill by the new q*, the outputs stay bit-identical, a figure set
by flag never moves.
"""

from __future__ import annotations

import math

import pytest
import torch
from ec_util import OpCache
from test_slot_cache import make_cache, routing

from sglang.srt.layers.moe.expert_cache import control, reference
from sglang.srt.layers.moe.expert_cache.bandwidth import Bandwidths
from sglang.srt.layers.moe.expert_cache.bandwidth_drift import BandwidthDrift

MB = 10**6


def _feed(drift, calls, fill_gbps, cpu_gbps, nbytes=4 * MB):
    """``calls`` layer calls moving ``nbytes`` per branch at the given rates; the updates."""
    out = []
    for _ in range(calls):
        u = drift.observe(nbytes, nbytes / fill_gbps / 1e9, nbytes, nbytes / cpu_gbps / 1e9)
        if u is not None:
            out.append(u)
    return out


def test_steady_rates_change_nothing():
    drift = BandwidthDrift(Bandwidths(10.0, 20.0, "measured"), check_every=8, min_samples=4)
    assert _feed(drift, 200, 10.0, 20.0) == []
    assert _feed(drift, 300, 12.0, 17.0) == []  # within the 30% tolerance; fills the window
    assert drift.updates == 0 and drift.bandwidths.fill_ratio == 0.5
    assert drift.live_cpu_gbps == pytest.approx(17.0)


def test_a_slower_cpu_branch_is_rederived_once():
    drift = BandwidthDrift(
        Bandwidths(10.0, 20.0, "measured"), window=64, check_every=8, min_samples=4
    )
    updates = _feed(drift, 200, 10.0, 5.0)
    assert len(updates) == 1, [u.describe() for u in updates]
    u = updates[0]
    assert u.before.cpu_gbps == 20.0 and u.after.fill_gbps == 10.0  # B_P within tolerance
    assert u.after.cpu_gbps == pytest.approx(5.0) and u.after.fill_ratio == pytest.approx(2.0)
    assert "B_H 20.00 -> 5.00 GB/s" in u.describe() and "q*/m 0.500 -> 2.000" in u.describe()
    # back to the startup rate: the window refills and the figure returns
    back = _feed(drift, 200, 10.0, 20.0)
    assert len(back) == 1 and back[0].after.cpu_gbps == pytest.approx(20.0)
    assert drift.updates == 2


def test_the_rate_is_bytes_weighted_and_a_pinned_figure_never_moves():
    drift = BandwidthDrift(
        Bandwidths(10.0, 20.0, "flags+measured"),
        adapt_cpu=False,
        window=16,
        check_every=4,
        min_samples=4,
    )
    for i in range(16):  # big slow fills and small fast ones: 1.6 GB/s overall, not the mean
        n = 8 * MB if i % 2 else MB
        drift.observe(n, n / (1e9 if i % 2 else 10e9), MB, MB / 2e9)
    assert drift.live_fill_gbps == pytest.approx(9 * MB / (8e-3 + 1e-4) / 1e9)
    assert drift.bandwidths.fill_gbps == pytest.approx(drift.live_fill_gbps)
    assert drift.bandwidths.cpu_gbps == 20.0 and drift.live_cpu_gbps == pytest.approx(2.0)


def test_too_few_samples_and_no_time_are_not_compared():
    drift = BandwidthDrift(Bandwidths(10.0, 20.0, "measured"), check_every=1, min_samples=8)
    assert _feed(drift, 7, 1.0, 1.0) == []  # 7 samples < 8
    assert drift.observe(0, 0.0, 0, 0.0) is None  # a call with no fill and no CPU expert
    assert math.isnan(BandwidthDrift(Bandwidths(1.0, 1.0, "m")).live_fill_gbps)


@pytest.mark.parametrize(
    "bw, kw",
    [
        (Bandwidths(float("nan"), 1.0, "m"), {}),
        (Bandwidths(1.0, 0.0, "m"), {}),
        (Bandwidths(1.0, 1.0, "m"), {"tolerance": 0.0}),
        (Bandwidths(1.0, 1.0, "m"), {"window": 4, "min_samples": 5}),
    ],
)
def test_bad_arguments_are_refused(bw, kw):
    with pytest.raises(ValueError):
        BandwidthDrift(bw, **kw)


# ---------------------------------------------------------------- the op's device-data ratio
def _misses_call(live):
    """One qstar call of 6 distinct misses on an empty 16-slot cache; returns the fill count."""
    op = OpCache(num_layers=2, num_experts=16, num_slots=16, num_fill=8, top_k=6)
    ids = torch.tensor([[0, 1, 2, 3, 4, 5]], dtype=torch.int32)
    r = control.expert_cache_control(
        ids, 0, 16, op.tables, op.fills, 0.0, "qstar", live_fill_ratio=live
    )
    return int(r.fills.counts[control.Stat.FILLS])


def test_live_fill_ratio_replaces_the_float_argument():
    assert _misses_call(None) == reference.fill_count(0, 6, 0.0) == 1
    for ratio in (0.25, 0.5, 1.0, 3.0):
        live = torch.tensor([ratio], dtype=torch.float64)
        want = reference.fill_count(int(control.MissPolicy.QSTAR), 6, ratio)
        assert _misses_call(live) == want, ratio


@pytest.mark.parametrize(
    "live, message",
    [
        (torch.tensor([float("nan")], dtype=torch.float64), "finite"),
        (torch.tensor([-1.0], dtype=torch.float64), "finite"),
        (torch.tensor([1.0], dtype=torch.float32), "live_fill_ratio"),
        (torch.tensor([1.0, 2.0], dtype=torch.float64), "one entry"),
    ],
)
def test_a_bad_live_fill_ratio_is_refused_before_any_change(live, message):
    op = OpCache(num_layers=1, num_experts=8, num_slots=4, num_fill=4, top_k=2)
    before = op.state()
    with pytest.raises(RuntimeError, match=message):
        ids = torch.tensor([[0, 1]], dtype=torch.int32)
        control.expert_cache_control(
            ids, 0, 8, op.tables, op.fills, 0.5, "qstar", live_fill_ratio=live
        )
    assert op.state() == before


# ---------------------------------------------------------------- a cache whose CPU slows down
class _ScriptedTimer:
    """The cache's drift clock, read three times a layer call (before the fill, after it,
    after the CPU executor): the fill takes its bytes at ``fill_gbps``, the executor the
    bytes of the experts it ran at ``cpu_gbps`` (from the call's counters, which the control
    step set before the first read)."""

    def __init__(self, cache, fill_gbps, cpu_gbps):
        self.cache, self.fill_gbps, self.cpu_gbps = cache, fill_gbps, cpu_gbps
        self.now, self.reads = 0.0, 0

    def __call__(self):
        counts = self.cache.fills.counts.tolist()
        eb = self.cache.host.expert_bytes
        phase, self.reads = self.reads % 3, self.reads + 1
        if phase == 1:
            self.now += counts[control.Stat.FILLS] * eb / self.fill_gbps / 1e9
        elif phase == 2:
            executed = counts[control.Stat.HITS] + counts[control.Stat.MISSES]
            self.now += executed * eb / self.cpu_gbps / 1e9
        return self.now


def test_the_cache_follows_a_slower_cpu_branch_and_results_do_not_change():
    base = make_cache("100%", "fill")
    cache = make_cache("50%", "qstar")  # flags: B_P 1.0, B_H 2.0 GB/s, q*/m 0.5
    assert cache.drift is not None and not (cache.drift.adapt_fill or cache.drift.adapt_cpu)
    cache.drift = BandwidthDrift(cache.bandwidths, window=64, check_every=8, min_samples=4)
    timer = _ScriptedTimer(cache, fill_gbps=1.0, cpu_gbps=0.25)  # B_H dropped 8x
    cache._timer = timer
    updated_at = None
    for i, (layer, x, w, ids) in enumerate(routing(steps=40, seed=7)):
        got = cache.forward(layer, x, w, ids)
        assert torch.equal(got, base.forward(layer, x, w, ids)), f"call {i}"
        counts = cache.fills.counts.tolist()
        if updated_at is None and cache.drift.updates:
            updated_at = i
        elif updated_at is not None:  # after the update every miss is filled (q*/m 4 -> q = m)
            m = counts[control.Stat.MISSES]
            assert counts[control.Stat.FILLS] == min(m, cache.fills.fill_src.numel()), i
    assert updated_at is not None and updated_at < 60
    assert cache.drift.updates == 1
    assert cache.bandwidths.fill_gbps == 1.0
    assert cache.bandwidths.cpu_gbps == pytest.approx(0.25, rel=1e-6)
    assert cache.fill_ratio == pytest.approx(4.0, rel=1e-6)
    assert float(cache._live_fill_ratio.item()) == cache.fill_ratio
    snap = cache.snapshot()
    assert snap["bandwidth_updates"] == 1 and snap["fill_ratio"] == pytest.approx(4.0)
    assert snap["live_cpu_gbps"] == pytest.approx(0.25, rel=1e-6)
    cache.check_invariants()


def test_flag_figures_stay_while_the_live_rates_are_exported():
    cache = make_cache("50%", "qstar")
    cache.drift = BandwidthDrift(
        cache.bandwidths, adapt_fill=False, adapt_cpu=False, check_every=4, min_samples=2
    )
    timer = _ScriptedTimer(cache, fill_gbps=1.0, cpu_gbps=0.25)
    cache._timer = timer
    for layer, x, w, ids in routing(steps=20, seed=8):
        cache.forward(layer, x, w, ids)
    assert cache.fill_ratio == 0.5 and cache.drift.updates == 0
    assert cache.snapshot()["live_cpu_gbps"] == pytest.approx(0.25, rel=1e-6)


def test_the_fill_ratio_setter_refuses_bad_values():
    cache = make_cache("50%", "qstar")
    for bad in (float("nan"), -0.5, float("inf")):
        with pytest.raises(ValueError, match="finite"):
            cache.fill_ratio = bad
    assert cache.fill_ratio == 0.5 and float(cache._live_fill_ratio.item()) == 0.5
