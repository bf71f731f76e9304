"""Elastic memory under load on the real CPU server (issue 15, "Correctness and load" and
"External pressure").

* 32 concurrent streaming requests (32 separate HTTP streams) while 20 explicit rebalances
  alternate shrink and grow of the expert slots and the KV pages: every stream completes with
  200 and exactly the greedy tokens of the same 32 streams run without rebalances; every
  rebalance answers 200, which with ``SGLANG_ELASTIC_KV_AUDIT=1`` means that after each KV step
  every live request and radix-tree node read back their own KV bytes and the allocator's
  counts matched the tree and the running requests (the handler answers 500 otherwise); once
  the streams are done and the cache flushed, every KV page is free again (none leaked) and
  the slot pool holds at most its slots.
* ``--expert-cache-rebalance-reserve``: the test capacity file
  (``SGLANG_TEST_REBALANCE_CAPACITY_FILE``, ``managers/memory_pressure.py``) simulates another
  process taking memory while streams run: the server shrinks slots first, then KV pages, logs
  and counts the move, and grows back to its split once the memory is free again; every stream
  completes with its tokens.

Batch invariance: separate requests reach the scheduler at times that vary from run to run, so
the two runs batch them differently (prefill groups, decode batch sizes). The server runs with
``SGLANG_CPU_DENSE_LINEAR_MAX_ROWS=0``: every dense linear is upstream's ``F.linear`` (oneDNN),
whose rows do not depend on how many rows the call has, where the fork's decode kernel for
<= 4 rows and ``F.linear`` above round differently (patch 0004; ``test_expert_cache.
_concurrent_streams`` explains the divergence that made ``test_elastic_kv.py`` batch its
streams into one request). The MoE is the fork's executor, per (token, expert), and
attention is per request, so a stream's tokens do not depend on its neighbours. The cache is
flushed before each run, so every prompt is a whole prefill in both.

One server (the 8-slot qstar configuration of ``test_expert_cache.py`` with that environment)
serves both tests.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
from e2e_util import metric, random_prompts
from test_expert_cache import METRICS_CONFIG, _cache_args

N_STREAMS = 32
TOKENS = 80
RESERVE = 32 << 20  # --expert-cache-rebalance-reserve, bytes (above what the test takes: free >= 0)
CAPACITY_FILE = Path(tempfile.gettempdir()) / f"sglang-e2e-capacity-{os.getpid()}"
ENV = {
    "SGLANG_CPU_DENSE_LINEAR_MAX_ROWS": "0",
    "SGLANG_ELASTIC_KV_AUDIT": "1",
    "SGLANG_TEST_REBALANCE_CAPACITY_FILE": str(CAPACITY_FILE),
}
# 32 running requests (the pool's TEST_SERVER_ARGS allow 16; a later flag wins), and a chunk
# larger than all 32 prompts together (3396 tokens), so no prompt is ever split across two
# prefill passes (a split prompt's second part attends to its first from the KV cache, which
# rounds differently from one pass; the CPU default, 2048 or 4096 by host memory, could split
# one when the arrivals group differently)
ARGS = [
    *_cache_args(*METRICS_CONFIG),
    "--expert-cache-rebalance-reserve",
    str(RESERVE),
    "--max-running-requests",
    str(N_STREAMS),
    "--chunked-prefill-size",
    "8192",
]
_BASELINE: dict = {}


@pytest.fixture
def srv(server_pool):
    CAPACITY_FILE.unlink(missing_ok=True)  # no file: the probe reads nothing, no pressure
    yield server_pool.get(METRICS_CONFIG[0], ARGS, env=ENV)
    CAPACITY_FILE.unlink(missing_ok=True)


def _post(url: str, body: dict) -> requests.Response:
    return requests.post(url + "/rebalance_memory", json=body, timeout=300)


def _split(url: str) -> dict:
    r = requests.get(url + "/rebalance_memory", timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _flush(url: str) -> None:
    assert requests.post(url + "/flush_cache", timeout=60).status_code == 200


def _prompts() -> list[list[int]]:
    """32 prompts of 5 to 300 random tokens (3396 in all)."""
    lengths = (5, 12, 31, 64, 97, 140, 200, 300)
    return [p for seed in range(4) for p in random_prompts(lengths=lengths, seed=30 + seed)]


def _streams(url: str, prompts, during=None) -> list[list[int]]:
    """Each prompt as its own streaming ``/generate`` (greedy, ``TOKENS`` tokens, EOS ignored),
    all at once; the output ids of each stream's last chunk. Each must answer 200, end with
    [DONE] and have its tokens. ``during(done)`` (``done[i]``: stream i has finished) runs once
    every stream has its first chunk (all are decoding)."""
    started = [threading.Event() for _ in prompts]
    finished = [threading.Event() for _ in prompts]

    def one(i: int) -> list[int]:
        last, end = None, None
        try:
            r = requests.post(
                url + "/generate",
                json={
                    "input_ids": prompts[i],
                    "stream": True,
                    "sampling_params": {
                        "temperature": 0,
                        "max_new_tokens": TOKENS,
                        "ignore_eos": True,
                    },
                },
                stream=True,
                timeout=600,
            )
            assert r.status_code == 200, r.text
            for line in r.iter_lines(decode_unicode=True):
                if not line.startswith("data: "):
                    continue
                end = line[6:]
                if end == "[DONE]":
                    break
                chunk = json.loads(end)
                assert "error" not in chunk, chunk
                last = chunk["output_ids"]
                started[i].set()
        finally:  # a failed stream must not leave during() waiting
            started[i].set()
            finished[i].set()
        assert end == "[DONE]", (i, end)
        assert last is not None and len(last) == TOKENS, (i, last)
        return last

    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(one, i) for i in range(len(prompts))]
        if during is not None:
            for s in started:
                assert s.wait(timeout=300), "a stream never produced its first chunk"
            during([f.is_set for f in finished])
        return [f.result() for f in futures]


def _baseline(url: str) -> list[list[int]]:
    """The 32 streams without rebalances, on a flushed cache (once per module run)."""
    if "want" not in _BASELINE:
        _flush(url)
        _BASELINE["want"] = _streams(url, _prompts())
    return _BASELINE["want"]


def _differ(want, got) -> list:
    return [
        (i, next(j for j, (x, y) in enumerate(zip(a, b)) if x != y))
        for i, (a, b) in enumerate(zip(want, got))
        if a != b
    ]


def test_32_streams_through_20_rebalances_keep_their_tokens_and_leak_nothing(srv):
    split0 = _split(srv.url)
    full = split0["kv"]["kv_tokens"]
    slots0 = split0["expert_cache"]["slots"]
    assert split0["kv"]["kv_resizable"], split0["kv"]
    want = _baseline(srv.url)
    _flush(srv.url)
    done = []

    def storm(finished):
        floor = _split(srv.url)["kv"]["kv_floor_tokens"]  # what the running requests hold/need
        for i in range(20):  # shrink, grow, shrink, ...: both pools each time, back to back
            if i % 2 == 0:
                body = {"kv_tokens": floor + 256 * (1 + i % 3), "expert_cache_size": str(8 + i)}
            else:
                body = {"kv_tokens": full, "expert_cache_size": str(64 + 8 * (i % 4))}
            r = _post(srv.url, body)
            assert r.status_code == 200, (i, body, r.text)
            got = r.json()
            floor = got["kv"]["kv_floor_tokens"]
            in_flight = sum(not f() for f in finished)
            done.append((body, got["kv"]["kv_tokens"], got["expert_cache"]["slots"], in_flight))

    try:
        got = _streams(srv.url, _prompts(), storm)
    finally:  # the next test expects the server as it started
        assert _post(srv.url, {"kv_tokens": full, "expert_cache_size": str(slots0)}).ok
    assert len(done) == 20, done
    shrinks, grows = done[0::2], done[1::2]
    assert all(d[1] < full for d in shrinks) and all(d[1] == full for d in grows), done
    assert all(d[2] < g[2] for d, g in zip(shrinks, grows)), done
    assert sum(d[3] > 0 for d in done) >= 10, done  # while streams ran
    assert not _differ(want, got), (
        f"greedy tokens differ (stream, first token): {_differ(want, got)}"
    )
    # nothing leaked: with no request left and the cache flushed, every page is free
    _flush(srv.url)
    split = _split(srv.url)
    kv, cache = split["kv"], split["expert_cache"]
    assert kv["kv_tokens"] == full and kv["kv_tokens_free"] == full, kv
    assert kv["kv_resizes"] >= 20 and kv["kv_resize_failures"] == 0, kv
    assert cache["occupied_slots"] <= cache["slots"] == slots0, cache
    assert cache["rebalance_failures"] == 0, cache
    log = srv.log.read_text(errors="replace").splitlines()
    problems = [
        ln
        for ln in log
        if "elastic KV accounting" in ln
        or ("elastic KV audit: " in ln and "positions moved" not in ln)
    ]
    assert not problems, problems[:10]


def _footprint(split: dict) -> int:
    """The probe's view of the server's pools (``memory_pressure.footprint_bytes``)."""
    return int(split["expert_cache"]["slot_bytes"]) + int(split["kv"]["kv_bytes"])


def _wait(url: str, pred, what: str, timeout_s: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        split = _split(url)
        if pred(split):
            return split
        assert time.monotonic() < deadline, f"{what}: {split}"
        time.sleep(0.2)


def test_simulated_pressure_shrinks_with_streams_in_flight_and_grows_back(srv):
    from sglang.srt.managers.memory_pressure import PressurePolicy

    # a larger slot pool first: the explicit split is the one pressure gives back to
    assert _post(srv.url, {"expert_cache_size": "64"}).status_code == 200
    split0 = _split(srv.url)
    slots0, kv0 = split0["expert_cache"]["slots"], split0["kv"]["kv_tokens"]
    eb, tb = split0["expert_cache"]["expert_bytes"], split0["kv"]["kv_token_bytes"]
    floor_slots = split0["expert_cache"]["floor_slots"]
    want = _baseline(srv.url)
    _flush(srv.url)
    margin = PressurePolicy().margin(RESERVE)
    # another process takes the slots above the floor and x KV tokens' worth, less the half
    # band the policy adds: the shrink must take every slot above the floor, then x KV tokens
    x = max(512, -(-margin // tb))
    taken = (slots0 - floor_slots) * eb + x * tb - margin // 2
    assert taken > (slots0 - floor_slots) * eb, (taken, eb, tb, margin)
    seen = {}

    def pressure(finished):
        CAPACITY_FILE.write_text(str(_footprint(_split(srv.url)) + RESERVE - taken))
        split = _wait(
            srv.url,
            lambda s: (s.get("memory_pressure") or {}).get("moves", 0) >= 1,
            "no shrink under pressure",
        )
        seen["shrunk"] = split
        seen["in_flight"] = sum(not f() for f in finished)

    got = _streams(srv.url, _prompts(), pressure)
    shrunk = seen["shrunk"]
    assert shrunk["expert_cache"]["slots"] == floor_slots, shrunk["expert_cache"]
    assert kv0 - x - 64 <= shrunk["kv"]["kv_tokens"] <= kv0 - x, (kv0, x, shrunk["kv"])
    assert seen["in_flight"] > 0, seen
    assert not _differ(want, got), f"greedy tokens differ under pressure: {_differ(want, got)}"
    log = srv.log.read_text(errors="replace")
    lines = [ln for ln in log.splitlines() if "rebalance reserve:" in ln]
    assert any(
        "below the reserve" in ln and f"slots {slots0} -> {floor_slots}" in ln for ln in lines
    ), lines or srv.log_tail(60)
    # the other process leaves: the split comes back exactly
    CAPACITY_FILE.write_text(str(_footprint(split0) + 10 * RESERVE))
    back = _wait(
        srv.url,
        lambda s: s["expert_cache"]["slots"] == slots0 and s["kv"]["kv_tokens"] == kv0,
        "the split did not grow back",
    )
    assert back["memory_pressure"]["owed_slots"] == 0, back["memory_pressure"]
    assert back["memory_pressure"]["failures"] == 0, back["memory_pressure"]
    text = requests.get(srv.url + "/metrics", timeout=60).text
    assert metric(text, "sglang:expert_cache_pressure_rebalances_total") >= 2
    CAPACITY_FILE.unlink()
    assert _post(srv.url, {"expert_cache_size": "8"}).status_code == 200
