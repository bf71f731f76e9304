#!/usr/bin/env python
"""``--expert-cache-rebalance auto`` vs ``off`` on a workload whose KV demand rises then falls
(issue 15, the second benchmark bullet).

One server per mode, started one after the other in the same run with the same flags (the
tiny Qwen3-MoE, ``--enable-expert-cache --expert-cache-size 50%`` (128 slots of 256),
``--max-total-tokens`` ``--kv-tokens``: a KV pool the long phase cannot fit), and the same
workload:

1. **long agent prompts**: ``--long`` requests of ``--long-len`` random tokens, sent at once
   as separate streaming requests (``--long-new`` greedy tokens each): their KV demand is
   several times the pool, so requests wait for KV pages;
2. **short chats**: ``--short`` requests of ``--short-len`` tokens in waves of ``--wave``.

Per request: TTFT (client side, request sent -> first streamed chunk). A request "waited"
when its TTFT is above ``--waited-x`` times the TTFT of a prompt of the same length sent
alone to the same server before the phases (``--max-running-requests`` is above the
concurrency, so a request waits for KV pages or for the prefills ahead of it: hence a
factor, the same for both modes). From the server log: the sum and the largest value of
``#queue-req`` over its prefill batches (requests left waiting after each admission). Also
printed: the auto server's moves (the ``expert-cache rebalance auto`` log lines) and its
split after each phase. (``meta_info["queue_time"]`` read 0 on this server, so it is not
used.)

Last line::

    waited_auto=... waited_off=... ttft_p50_ratio=... ttft_p90_ratio=... moves=...

(``ttft_*_ratio``: auto / off over all requests; below 1 is better.)
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "test" / "e2e"))


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--kv-tokens", type=int, default=2048)
    p.add_argument("--long", type=int, default=16)
    p.add_argument("--long-len", type=int, default=700)
    p.add_argument("--long-new", type=int, default=64)
    p.add_argument("--short", type=int, default=32)
    p.add_argument("--short-len", type=int, default=24)
    p.add_argument("--short-new", type=int, default=16)
    p.add_argument("--wave", type=int, default=4)
    p.add_argument("--waited-x", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=5)
    return p.parse_args(argv)


def _one(url: str, ids, new_tokens: int, out: list, i: int) -> None:
    t0 = time.perf_counter()
    ttft = None
    r = requests.post(
        url + "/generate",
        json={
            "input_ids": ids,
            "stream": True,
            "sampling_params": {
                "temperature": 0,
                "max_new_tokens": new_tokens,
                "ignore_eos": True,
            },
        },
        stream=True,
        timeout=900,
    )
    assert r.status_code == 200, r.text
    tokens = []
    for line in r.iter_lines(decode_unicode=True):
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if ttft is None:
            ttft = time.perf_counter() - t0
        tokens = chunk["output_ids"]
    out[i] = dict(ttft=ttft, tokens=tokens)


def _phase(url: str, prompts, new_tokens: int, wave: int) -> list:
    out: list = [None] * len(prompts)
    for start in range(0, len(prompts), wave):
        threads = [
            threading.Thread(target=_one, args=(url, prompts[i], new_tokens, out, i))
            for i in range(start, min(len(prompts), start + wave))
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert all(o is not None for o in out), "a request failed"
    return out


def run_mode(model, mode: str, args, long_prompts, short_prompts, alone):
    import server  # test/e2e/server.py

    srv = server.start_server(
        model,
        ["--max-total-tokens", str(args.kv_tokens), "--max-running-requests", "32"]
        + ["--enable-expert-cache", "--expert-cache-size", "50%"]
        + ["--expert-cache-fill-gbps", "10", "--expert-cache-cpu-gbps", "20"]
        + ["--expert-cache-rebalance", mode],
    )
    try:
        _phase(srv.url, [alone[0][:32]], 4, 1)  # warm
        alone_ttft = [_phase(srv.url, [a], 4, 1)[0]["ttft"] for a in alone]
        t0 = time.perf_counter()
        res = _phase(srv.url, long_prompts, args.long_new, len(long_prompts))
        t_long = time.perf_counter() - t0
        split_mid = requests.get(srv.url + "/rebalance_memory", timeout=60).json()
        t0 = time.perf_counter()
        res += _phase(srv.url, short_prompts, args.short_new, args.wave)
        t_short = time.perf_counter() - t0
        time.sleep(3.0)  # idle checks: give-backs after the chats
        split_end = requests.get(srv.url + "/rebalance_memory", timeout=60).json()
        log = srv.log.read_text(errors="replace")
    finally:
        srv.stop()
    moves = [
        line.split("expert-cache rebalance auto: ", 1)[1]
        for line in log.splitlines()
        if "expert-cache rebalance auto: " in line and "->" in line
    ]
    inactive = [line for line in log.splitlines() if "rebalance auto is inactive" in line]
    queued = [
        int(line.rsplit("#queue-req: ", 1)[1].split(",")[0])
        for line in log.splitlines()
        if "Prefill batch" in line and "#queue-req: " in line
    ]
    return dict(
        res=res,
        alone=alone_ttft,
        queued=queued,
        t_long=t_long,
        t_short=t_short,
        moves=moves,
        inactive=inactive,
        mid=(split_mid["expert_cache"]["slots"], split_mid["kv"]["kv_tokens"]),
        end=(split_end["expert_cache"]["slots"], split_end["kv"]["kv_tokens"]),
    )


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main(argv=None) -> int:
    import random

    import server

    args = parse_args(argv)
    rng = random.Random(args.seed)
    long_prompts = [[rng.randint(10, 2000) for _ in range(args.long_len)] for _ in range(args.long)]
    short_prompts = [
        [rng.randint(10, 2000) for _ in range(args.short_len)] for _ in range(args.short)
    ]
    alone = [[rng.randint(10, 2000) for _ in range(n)] for n in (args.long_len, args.short_len)]
    model = server.ensure_model("qwen3_moe")
    runs = {
        m: run_mode(model, m, args, long_prompts, short_prompts, alone) for m in ("off", "auto")
    }
    waited = {}
    for mode, r in runs.items():
        res = r["res"]
        ttft = [x["ttft"] * 1e3 for x in res]
        n_long = len(long_prompts)
        limit = [args.waited_x * r["alone"][0] * 1e3] * n_long + [
            args.waited_x * r["alone"][1] * 1e3
        ] * (len(res) - n_long)
        w = [t > lim for t, lim in zip(ttft, limit)]
        waited[mode] = sum(w)
        print(
            f"{mode}: {waited[mode]}/{len(res)} requests waited (TTFT > {args.waited_x:g} x "
            f"alone: {r['alone'][0] * 1e3:.0f} ms long, {r['alone'][1] * 1e3:.0f} ms short; "
            f"long {sum(w[:n_long])}/{n_long}, short {sum(w[n_long:])}/{len(res) - n_long}); "
            f"#queue-req over prefill batches: sum {sum(r['queued'])}, max "
            f"{max(r['queued'], default=0)}; TTFT ms p50 {_pct(ttft, 0.5):.0f} p90 "
            f"{_pct(ttft, 0.9):.0f} (long p50 {_pct(ttft[:n_long], 0.5):.0f}, short p50 "
            f"{_pct(ttft[n_long:], 0.5):.0f}); long phase {r['t_long']:.1f} s, short phase "
            f"{r['t_short']:.1f} s; split (slots, KV tokens) after long {r['mid']}, at end "
            f"{r['end']}; {len(r['moves'])} auto moves",
            flush=True,
        )
        for line in r["moves"] + r["inactive"]:
            print(f"  {mode}: {line}")
    same = all(a["tokens"] == b["tokens"] for a, b in zip(runs["off"]["res"], runs["auto"]["res"]))
    print(f"greedy tokens identical auto vs off: {same} (batches differ between the modes)")
    t_auto = [x["ttft"] for x in runs["auto"]["res"]]
    t_off = [x["ttft"] for x in runs["off"]["res"]]
    print(
        f"waited_auto={waited['auto']} waited_off={waited['off']} "
        f"ttft_p50_ratio={_pct(t_auto, 0.5) / _pct(t_off, 0.5):.3f} "
        f"ttft_p90_ratio={_pct(t_auto, 0.9) / _pct(t_off, 0.9):.3f} "
        f"moves={len(runs['auto']['moves'])}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
