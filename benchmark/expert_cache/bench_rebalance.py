#!/usr/bin/env python
"""Rebalancing the expert-slot pool (issue 15): resize latency, and decode during a storm.

1. **Latency at the layer level** (no server): an ``ExpertSlotCache`` of ``--layers`` x
   ``--experts`` bf16 experts of shape H x I, warmed with random routing, is shrunk from S to
   S / 4 slots and grown back, for each S in ``--pool-sizes``; ``--resizes`` of each, timed
   with ``rebalance.rebalance`` (the whole call: target check, dry run, row moves, release).
2. **Decode during a rebalance storm** (one server, the tiny Qwen3-MoE with
   ``--enable-expert-cache``): ``--streams`` concurrent greedy streams of ``--new-tokens``
   tokens, alternately without rebalances and with ``POST /rebalance_memory`` alternating
   shrink and grow every ``--storm-interval`` s while they run; ``--rounds`` of each, same
   run. Decode tok/s = tokens after the first / time from the first streamed chunk to the last,
   summed over the streams; a stall is the largest gap between two chunks of one stream.

3. **KV pages, latency at the pool level** (no server): an ``MHATokenToKVPool`` of
   ``--kv-layers`` x ``--kv-heads`` x ``--kv-head-dim`` bf16 (the CPU pool a server uses) of N
   tokens for each N in ``--kv-sizes``, 1/8 of it held by request rows on random pages, is shrunk
   to N / 4 (the live pages above the boundary move below it, ``req_to_token`` is rewritten,
   the tail is released) and grown back (``elastic_kv.resize.ElasticKV.resize``, whole call);
   ``--resizes`` of each.
4. **Decode during a KV storm** (the same server): as 2, with ``POST /rebalance_memory``
   alternating ``{"kv_tokens": 8192}`` and ``{"kv_tokens": 65536}`` (the whole pool).

Printed: a line per pool size and mode, then last

    rebalance_ms_p50=... stall_ms_max=... tps_ratio=... kv_shrink_ms_p50=... kv_grow_ms_p50=...
    kv_rebalance_ms_p50=... kv_stall_ms_max=... kv_tps_ratio=...

``rebalance_ms_p50``: median server-side ``time_ms`` of the storm's rebalances;
``stall_ms_max``: the largest inter-chunk gap of any stream during storms (the baseline's is
printed beside it); ``tps_ratio``: decode tok/s with the storm / without; ``kv_shrink_ms_p50``
/ ``kv_grow_ms_p50``: the pool-level medians over all ``--kv-sizes``; ``kv_*``: the same as
the first three for the KV storm.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import statistics
import sys
import threading
from pathlib import Path

import requests
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "test" / "e2e"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import stream_decode  # noqa: E402  (the same streamed decode measurement)

SERVER_ARGS = ["--max-total-tokens", "65536", "--max-running-requests", "16"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=256)
    p.add_argument("--pool-sizes", default="64,256,1024", help="slot counts S, comma-separated")
    p.add_argument("--resizes", type=int, default=5, help="shrink + grow pairs per size")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--storm-interval", type=float, default=0.1, help="s between rebalances")
    p.add_argument("--skip-server", action="store_true", help="layer-level latency only")
    p.add_argument("--kv-layers", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--kv-head-dim", type=int, default=128)
    p.add_argument("--kv-sizes", default="16384,65536", help="KV pool sizes N in tokens")
    return p.parse_args(argv)


def _warm(cache, g, x, w, calls: int) -> None:
    """``calls`` layer calls of random routing (the tables get recent uses to keep)."""
    for i in range(calls):
        ids = torch.randint(0, cache.num_experts, tuple(w.shape), generator=g, dtype=torch.int32)
        cache.forward(i % cache.num_layers, x, w, ids)


def layer_latency(args) -> dict:
    """ms of shrink S -> S/4 and grow S/4 -> S per pool size: {S: (shrink_ms, grow_ms)}."""
    from sglang.srt.layers.moe.expert_cache.cache import ExpertSlotCache
    from sglang.srt.layers.moe.expert_cache.config import CacheSize, ExpertCacheConfig
    from sglang.srt.layers.moe.expert_cache.control import MissPolicy
    from sglang.srt.layers.moe.expert_cache.rebalance import rebalance

    L, E, H, I = args.layers, args.experts, args.hidden, args.intermediate
    K = 8
    out = {}
    for size in [int(s) for s in args.pool_sizes.split(",")]:
        if size > L * E:
            print(f"skip S={size}: above the pool ({L * E} experts)")
            continue
        cfg = ExpertCacheConfig(
            size=CacheSize.parse(str(size)),
            policy=MissPolicy.parse("fill"),
            fill_gbps=1.0,
            cpu_gbps=2.0,
        )
        cache = ExpertSlotCache(
            cfg,
            num_layers=L,
            num_experts=E,
            top_k=K,
            hidden_size=H,
            intermediate_size=I,
            dtype=torch.bfloat16,
            device="cpu",
        )
        g = torch.Generator().manual_seed(0)
        for layer in range(L):
            cache.register_layer(layer)
            for name in ("w13", "w2"):
                rows = cache.host_rows(name, layer)
                rows.copy_((torch.randn(rows.shape, generator=g) * 0.05).to(rows.dtype))
        cache.finalize()
        x = torch.randn(4, H, generator=g).to(torch.bfloat16)
        w = torch.full((4, K), 1.0 / K)

        shrink, grow = [], []
        for _ in range(args.resizes):
            _warm(cache, g, x, w, 4 * L)
            shrink.append(rebalance(cache, size // 4 if size // 4 >= K else K)["time_ms"])
            _warm(cache, g, x, w, 4 * L)
            grow.append(rebalance(cache, size)["time_ms"])
        out[size] = (statistics.median(shrink), statistics.median(grow))
        mb = size * cache.host.expert_bytes / 1e6
        print(
            f"layer S={size:5d} ({mb:7.1f} MB of slots): shrink to S/4 "
            f"{out[size][0]:7.2f} ms, grow back {out[size][1]:7.2f} ms (median of "
            f"{args.resizes})",
            flush=True,
        )
    return out


def kv_latency(args) -> dict:
    """ms of a KV shrink N -> N/4 and grow N/4 -> N per pool size: {N: (shrink_ms, grow_ms,
    moved_pages)} (medians)."""
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.elastic_kv.resize import ElasticKV
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

    out = {}
    for n in [int(x) for x in args.kv_sizes.split(",")]:
        kv = MHATokenToKVPool(
            size=n,
            page_size=1,
            dtype=torch.bfloat16,
            head_num=args.kv_heads,
            head_dim=args.kv_head_dim,
            layer_num=args.kv_layers,
            device="cpu",
            enable_memory_saver=False,
        )
        alloc = TokenToKVPoolAllocator(
            size=n, dtype=torch.bfloat16, device="cpu", kvcache=kv, need_sort=False
        )
        rows, ctx = 16, n // 8 // 16
        rtp = ReqToTokenPool(
            size=rows, max_context_len=ctx, device="cpu", enable_memory_saver=False
        )
        el = ElasticKV(kv, alloc, rtp, None)
        el.reserve()  # the one-time copy into the reserved mappings, not timed
        g = torch.Generator().manual_seed(n)
        shrink, grow, moved = [], [], []
        for _ in range(args.resizes):
            alloc.clear()  # 1/8 of the pool live, on random pages
            perm = torch.randperm(n, generator=g) + 1
            live = perm[: rows * ctx]
            alloc.free_pages = torch.sort(perm[rows * ctx :]).values
            rtp.req_to_token[:rows, :ctx] = live.view(rows, ctx).to(torch.int32)
            r = el.resize(n // 4)
            shrink.append(r["time_ms"])
            moved.append(r["moved_pages"])
            grow.append(el.resize(n)["time_ms"])
        out[n] = (statistics.median(shrink), statistics.median(grow), statistics.median(moved))
        mb = (n + 1) * el.token_bytes / 1e6
        print(
            f"kv N={n:6d} ({mb:7.1f} MB of KV): shrink to N/4 {out[n][0]:8.2f} ms "
            f"({out[n][2]:.0f} pages moved), grow back {out[n][1]:7.2f} ms (median of "
            f"{args.resizes})",
            flush=True,
        )
    return out


def _round(url, args, g, storm: bool, bodies=None):
    """One round of ``args.streams`` streams: (tok/s, largest gap s, rebalance ms list)."""
    prompts = [
        torch.randint(10, 30000, (args.prompt_len,), generator=g).tolist()
        for _ in range(args.streams)
    ]
    stop = threading.Event()
    times = []

    bodies = bodies or [{"expert_cache_size": s} for s in ("64", "8", "100%", "16")]

    def storm_loop():
        i = 0
        while not stop.is_set():
            r = requests.post(url + "/rebalance_memory", json=bodies[i % len(bodies)], timeout=120)
            r.raise_for_status()
            times.append(r.json()["time_ms"])
            i += 1
            stop.wait(args.storm_interval)

    th = threading.Thread(target=storm_loop) if storm else None
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(stream_decode, url, ids, args.new_tokens + 1) for ids in prompts]
        if th:
            th.start()
        runs = [f.result() for f in futures]
    stop.set()
    if th:
        th.join()
    tokens = sum(n for n, _, _ in runs)
    seconds = max(t for _, t, _ in runs)
    return tokens / max(seconds, 1e-9), max(gap for _, _, gap in runs), times


def server_storm(args):
    import server  # test/e2e/server.py

    model = server.ensure_model("qwen3_moe")
    srv = server.start_server(
        model,
        SERVER_ARGS
        + ["--enable-expert-cache", "--expert-cache-size", "8"]
        + ["--expert-cache-fill-gbps", "10", "--expert-cache-cpu-gbps", "20"],
    )
    try:
        g = torch.Generator().manual_seed(7)
        _round(srv.url, argparse.Namespace(**{**vars(args), "streams": 2}), g, False)  # warm
        kv_storm = [{"kv_tokens": 8192}, {"kv_tokens": 65536}]
        base, storm, kv = [], [], []
        for _ in range(args.rounds):
            base.append(_round(srv.url, args, g, False))
            storm.append(_round(srv.url, args, g, True))
            kv.append(_round(srv.url, args, g, True, kv_storm))
        requests.post(
            srv.url + "/rebalance_memory",
            json={"expert_cache_size": "8", "kv_tokens": 65536},
            timeout=60,
        )
    finally:
        srv.stop()
    tps_base = statistics.median(b[0] for b in base)
    base_stall = max(b[1] for b in base) * 1e3
    figures = []
    for name, runs in (("slot", storm), ("KV", kv)):
        tps = statistics.median(s[0] for s in runs)
        times = [t for s in runs for t in s[2]]
        stall = max(s[1] for s in runs) * 1e3
        print(
            f"server {args.streams} streams: {tps_base:.1f} tok/s without rebalances, "
            f"{tps:.1f} tok/s during {name} storms ({len(times)} rebalances, median "
            f"{statistics.median(times):.2f} ms, max {max(times):.2f} ms); largest inter-chunk "
            f"gap {stall:.0f} ms during storms, {base_stall:.0f} ms without",
            flush=True,
        )
        figures += [statistics.median(times), stall, tps / tps_base]
    return figures


def main(argv=None) -> int:
    args = parse_args(argv)
    lat = layer_latency(args)
    kv = kv_latency(args)
    kv_line = (
        f"kv_shrink_ms_p50={statistics.median(v[0] for v in kv.values()):.2f} "
        f"kv_grow_ms_p50={statistics.median(v[1] for v in kv.values()):.2f}"
    )
    if args.skip_server:
        allm = [v for pair in lat.values() for v in pair]
        print(f"rebalance_ms_p50={statistics.median(allm):.2f} {kv_line}")
        return 0
    p50, stall, ratio, kv_p50, kv_stall, kv_ratio = server_storm(args)
    print(
        f"rebalance_ms_p50={p50:.2f} stall_ms_max={stall:.0f} tps_ratio={ratio:.3f} {kv_line} "
        f"kv_rebalance_ms_p50={kv_p50:.2f} kv_stall_ms_max={kv_stall:.0f} "
        f"kv_tps_ratio={kv_ratio:.3f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
