"""The cost model of the prefill double buffer (``expert_cache/prefill_plan.py``; FreeToken
§3.1 "Full-layer double buffering", §5.3 "Pipelined prefill"): the times of the three paths,
the threshold in routed entries, and the choice under a slot pool that may not spare two
layers."""

from __future__ import annotations

import math

import pytest

from sglang.srt.layers.moe.expert_cache.prefill_plan import (
    PathTimes,
    PrefillPath,
    choose_prefill_path,
    expected_distinct,
    parse_mode,
    path_times,
    stream_threshold,
)

# The paper's 5090 (§5.3: 52.7 GB/s link) with a Qwen3.6-35B-like layer: 256 experts of
# 3 x 2048 x 512 bf16 weights, top-8, F = 16; B_H of a many-channel host.
PAPER = dict(num_experts=256, expert_bytes=3 * 2048 * 512 * 2, fill_gbps=52.7, cpu_gbps=80.0)


def test_expected_distinct_experts():
    assert expected_distinct(0, 8) == 0.0
    assert expected_distinct(1, 8) == pytest.approx(1.0)
    assert expected_distinct(2, 2) == pytest.approx(1.5)  # 2 * (1 - 1/4)
    assert expected_distinct(10**6, 256) == pytest.approx(256.0)
    # never more than the routed entries or the experts
    for r in (3, 40, 300, 5000):
        assert expected_distinct(r, 128) <= min(r, 128)


def test_path_times_by_hand():
    S, E = 1_000_000, 4
    t = path_times(
        routed=1000, num_experts=E, expert_bytes=S, fill_gbps=1.0, cpu_gbps=2.0, max_fills=1
    )
    x = E * S / 1e9  # the whole layer over the link: 4 ms
    assert t.two_buffers == pytest.approx(x) and t.one_buffer == pytest.approx(x)
    d = expected_distinct(1000, E)  # ~4: every expert routed
    m, q = d, 1.0  # Eq. 4 wants m * 1/2 = 2 fills, F caps it at 1
    cpu_entries = 1000 * (m - q) / d
    assert t.split == pytest.approx(max(q * S / 1e9, m * S / 2e9, cpu_entries * S / 2e9))
    assert t.split > t.two_buffers  # 375 CPU entries at S / B_H each: streaming wins


def test_compute_is_hidden_by_two_buffers_and_serialized_by_one():
    kw = dict(PAPER, routed=8192 * 8, max_fills=16)
    x = path_times(**kw).two_buffers
    small, large = path_times(**kw, compute_s=x / 2), path_times(**kw, compute_s=2 * x)
    assert small.two_buffers == pytest.approx(x) and small.one_buffer == pytest.approx(1.5 * x)
    assert large.two_buffers == pytest.approx(2 * x) and large.one_buffer == pytest.approx(3 * x)
    # §5.3: without the second buffer a chunk pays transfer + compute
    assert small.one_buffer > small.two_buffers


def test_resident_experts_are_not_streamed_over_the_link():
    kw = dict(PAPER, routed=8192 * 8, max_fills=16)
    cold, warm = path_times(**kw), path_times(**kw, resident=64)
    assert warm.two_buffers == pytest.approx(cold.two_buffers * (256 - 64) / 256)


def test_threshold_is_where_streaming_starts_to_win():
    r = stream_threshold(**PAPER, max_fills=16)
    assert r is not None and 400 < r < 2000  # tens of tokens at top-8, not thousands
    below = path_times(**PAPER, max_fills=16, routed=r - 1)
    at = path_times(**PAPER, max_fills=16, routed=r)
    assert below.two_buffers >= below.split and at.two_buffers < at.split
    # A faster link streams earlier, a faster CPU later; more fills per call help the split.
    assert stream_threshold(**dict(PAPER, fill_gbps=100.0), max_fills=16) < r
    assert stream_threshold(**dict(PAPER, cpu_gbps=160.0), max_fills=16) > r
    assert stream_threshold(**PAPER, max_fills=64) > r


def test_threshold_none_when_streaming_never_wins():
    # Without a usable profile (no slots: B_P / B_H never measured) streaming is not modelled.
    nan = dict(PAPER, fill_gbps=float("nan"))
    assert stream_threshold(**nan, max_fills=16) is None
    t = path_times(**nan, max_fills=16, routed=10**6)
    assert math.isinf(t.two_buffers) and math.isinf(t.one_buffer)
    # A tiny limit the threshold is above.
    assert stream_threshold(**PAPER, max_fills=16, limit=100) is None


def test_choice_follows_the_times_and_the_spare_slots():
    E = 8
    fast = PathTimes(two_buffers=1.0, one_buffer=2.0, split=3.0)
    assert choose_prefill_path(fast, spare_slots=2 * E, num_experts=E) is PrefillPath.TWO_BUFFERS
    assert choose_prefill_path(fast, spare_slots=2 * E - 1, num_experts=E) is (
        PrefillPath.ONE_BUFFER
    )
    assert choose_prefill_path(fast, spare_slots=E - 1, num_experts=E) is PrefillPath.SPLIT
    # the pool spares one layer but one buffer (stream, then compute) is slower than the split
    serial = PathTimes(two_buffers=1.0, one_buffer=4.0, split=3.0)
    assert choose_prefill_path(serial, spare_slots=E, num_experts=E) is PrefillPath.SPLIT
    assert choose_prefill_path(serial, spare_slots=2 * E, num_experts=E) is (
        PrefillPath.TWO_BUFFERS
    )
    # ties go to the split
    tie = PathTimes(two_buffers=3.0, one_buffer=3.0, split=3.0)
    assert choose_prefill_path(tie, spare_slots=2 * E, num_experts=E) is PrefillPath.SPLIT
    # then to two buffers: with the compute time not yet measured (C = 0) T_2 = T_1 = X, and
    # the real C > 0 makes two buffers the faster (one buffer when only one layer fits)
    kw = dict(PAPER, max_fills=16, routed=8192 * 8)
    unmeasured = path_times(**kw)
    assert unmeasured.two_buffers == unmeasured.one_buffer < unmeasured.split
    assert choose_prefill_path(unmeasured, spare_slots=2 * 256, num_experts=256) is (
        PrefillPath.TWO_BUFFERS
    )
    assert choose_prefill_path(unmeasured, spare_slots=2 * 256 - 1, num_experts=256) is (
        PrefillPath.ONE_BUFFER
    )
    # force: the most buffers the pool allows, whatever the times
    slow = PathTimes(two_buffers=9.0, one_buffer=9.0, split=1.0)
    pick = dict(num_experts=E, force=True)
    assert choose_prefill_path(slow, spare_slots=2 * E, **pick) is PrefillPath.TWO_BUFFERS
    assert choose_prefill_path(slow, spare_slots=E, **pick) is PrefillPath.ONE_BUFFER
    assert choose_prefill_path(slow, spare_slots=0, **pick) is PrefillPath.SPLIT


def test_mode_parsing():
    assert parse_mode(None) == "auto"
    assert parse_mode(" Force ") == "force"
    with pytest.raises(ValueError, match="--expert-cache-prefill-stream must be one of"):
        parse_mode("on")
