#!/usr/bin/env python
"""Prefill through the expert-slot cache: two full-layer buffers, one, and the decode path's split.

    python benchmark/expert_cache/bench_prefill_stream.py                     # CPU, simulated link
    python benchmark/expert_cache/bench_prefill_stream.py --device cuda       # GPU, the real link

FreeToken §3.1 ("Full-layer double buffering") and §5.3 ("Pipelined prefill": with two buffers
each chunk takes the time to stream the pool once; without the second, 19-26% slower). A pass
runs every MoE layer of ``--layers`` once (``ExpertSlotCache.forward``) on a prompt chunk of T
tokens (random bf16 activations, uniform top-k routing; attention, router and shared experts are
not run), through :class:`PrefillStream` forced to each path (``two_buffers``, ``one_buffer``)
and through the ordinary layer call (``split``: hits, q* fills, CPU experts). Per prompt length:
the median pass time and tokens/s of each path.

**CPU (a simulation).** On a CPU-only machine the slots are host memory and streaming would
only copy, so the link is simulated: every copy host pool -> slot (the buffers' loads and the
split's fills) takes at least its bytes / ``--link-gbps`` (the copy thread sleeps out the rest;
the output says SIMULATED). Per path, the transfer of a pass is ``X`` = the host-pool bytes it
loaded / link, and its compute ``C`` the pass time of the ordinary path with no slots (every
expert computed from the host pool, the same kernel, no copy); two buffers should take ~``max(X, C)`` and one buffer ~``X + C``.
``overlap`` = (X + C - two) / min(X, C) of the two-buffer path: the share of the shorter of
the two that the second buffer hides (1 = all of it, 0 = none). The default pool is two
layers' experts (``--size``), so a two-buffer pass streams the whole pool. Last line::

    expert_cache_prefill_stream tok_s_two_T=... tok_s_one_T=... tok_s_split_T=... \\
        two_vs_max=... one_vs_sum=... simulated_link_gbps=... overlap_ratio=...

(``two_vs_max`` / ``one_vs_sum``: measured over modelled time, means over the lengths;
``overlap_ratio``: the mean overlap over the lengths where X and C are within 2x of each
other, which the output names; elsewhere the shorter term is small against the noise of the
longer.)

**CUDA.** The real link and B_P as the cache measures it at startup; the pool is sized to hold
two layers (``--size``), so that a two-buffer pass streams all of it. ``transfer_bound_ratio`` = time per chunk with two
buffers / (pool bytes / B_P): 1 = the chunk takes exactly one stream of the pool (§5.3's
result), above 1 = compute or stalls show. The outputs of every path are compared with the CPU
cache's ordinary path (tolerance of a change of MoE kernel: ``2e-2 * max(1, max|ref|)``), and
every pass must have been streamed as asked (no abandoned pass): anything else exits 1 with
the reason. Without upstream's CUDA kernel wheel (the GPU checks machine) the fused MoE's glue
ops are stood in for (``sglang/test/bare_fused_moe.py``; the output names them). Last line::

    expert_cache_prefill_stream_cuda chunk_ms_two=... pool_ms_at_b_p=... b_p_gbps=... \\
        two_vs_one=... two_vs_split=... transfer_bound_ratio=...
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence

import torch

from sglang.srt.layers.moe.expert_cache.banks import ExpertBanks, format_for_dtype
from sglang.srt.layers.moe.expert_cache.cache import ExpertSlotCache
from sglang.srt.layers.moe.expert_cache.config import CacheSize, ExpertCacheConfig, MissPolicy
from sglang.srt.layers.moe.expert_cache.control import Stat
from sglang.srt.layers.moe.expert_cache.prefill_plan import PrefillPath
from sglang.srt.layers.moe.expert_cache.prefill_stream import PrefillStream

PATHS = ("two_buffers", "one_buffer", "split")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=256)
    p.add_argument("--lengths", default="128,256,512,1024,2048", help="prompt chunk tokens")
    p.add_argument("--link-gbps", type=float, default=1.0, help="CPU: the simulated link")
    p.add_argument("--size", default=None, help="--expert-cache-size (default: 2 x experts)")
    p.add_argument("--threads", type=int, default=0, help="CPU executor threads (0 = cores)")
    p.add_argument("--reps", type=int, default=5, help="timed passes per length and path")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def fail(msg: str) -> None:
    print(f"bench_prefill_stream: FAILED: {msg}", file=sys.stderr, flush=True)
    sys.exit(1)


def host_pool(a) -> ExpertBanks:
    host = ExpertBanks(
        format_for_dtype(torch.bfloat16), a.hidden, a.intermediate, a.layers * a.experts, "cpu"
    )
    g = torch.Generator().manual_seed(a.seed)
    for name, fan_in in (("w13", a.hidden), ("w2", a.intermediate)):
        host[name].normal_(0.0, fan_in**-0.5, generator=g)
    return host


def make_cache(a, host, path: str, fill_gbps=None, cpu_gbps=None, size=None) -> ExpertSlotCache:
    cfg = ExpertCacheConfig(
        size=CacheSize.parse(size or slots(a)),
        policy=MissPolicy.QSTAR,
        cpu_threads=a.threads,
        fill_gbps=fill_gbps,
        cpu_gbps=cpu_gbps,
    )
    cache = ExpertSlotCache(
        cfg,
        num_layers=a.layers,
        num_experts=a.experts,
        top_k=a.top_k,
        hidden_size=a.hidden,
        intermediate_size=a.intermediate,
        dtype=torch.bfloat16,
        device=a.device,
        host=host,
    )
    for layer in range(a.layers):
        cache.register_layer(layer)
    cache.finalize()
    mode = "off" if path == "split" else "force"
    cache.prefill_stream = PrefillStream(cache, mode, path=PrefillPath(path))
    return cache


def throttle_fills(cache: ExpertSlotCache, gbps: float) -> None:
    """CPU simulation: the split's fills take at least their bytes / ``gbps`` too."""
    fill = cache.fill

    def slow(fills):
        start = time.perf_counter()
        fill(fills)
        q = int(fills.counts[Stat.FILLS])
        wait = q * cache.host.expert_bytes / (gbps * 1e9) - (time.perf_counter() - start)
        if wait > 0:
            time.sleep(wait)

    cache.fill = slow


def inputs(a, T: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, a.hidden, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(a.experts, generator=g)[: a.top_k] for _ in range(T)])
    w = torch.rand(T, a.top_k, generator=g)
    return x, w / w.sum(-1, keepdim=True), ids.to(torch.int32)


def run_pass(cache, a, x, w, ids, rc=None) -> tuple[float, List[torch.Tensor]]:
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    outs = [cache.forward(layer, x, w, ids, rc) for layer in range(a.layers)]
    sync()
    return time.perf_counter() - t0, outs


def timed(cache, a, x, w, ids, rc=None) -> tuple[float, List[torch.Tensor]]:
    run_pass(cache, a, x, w, ids, rc)  # warm-up (Triton compiles, the executor's scratch)
    times, outs = [], None
    for _ in range(a.reps):
        t, outs = run_pass(cache, a, x, w, ids, rc)
        times.append(t)
    return statistics.median(times), outs


def check_streamed(cache, path: str, passes: int) -> None:
    s = cache.prefill_stream
    if path == "split":
        return
    got = s.passes[PrefillPath(path)]
    if got != passes or s.abandoned:
        fail(
            f"{path}: {got} of {passes} passes streamed, {s.abandoned} abandoned "
            f"({cache.num_slots} slots for {cache.num_experts} experts per layer)"
        )


def main_cpu(a) -> int:
    lengths = [int(t) for t in a.lengths.split(",")]
    host = host_pool(a)
    pool_bytes = host.rows * host.expert_bytes
    print(
        f"# SIMULATED link: every host -> slot copy throttled to {a.link_gbps} GB/s (a CPU-only "
        f"machine has no link); {a.layers} layers x {a.experts} experts, top-{a.top_k}, "
        f"H {a.hidden}, I {a.intermediate}: {host.expert_bytes / 1e6:.2f} MB per expert, "
        f"{pool_bytes / 1e6:.0f} MB pool, {slots(a)} slots; "
        f"loadavg {open('/proc/loadavg').read().split()[:3]}",
        flush=True,
    )
    # B_P / B_H given (the split's q*): B_P the simulated link, B_H four times it.
    bw = dict(fill_gbps=a.link_gbps, cpu_gbps=4 * a.link_gbps)
    linked = {p: make_cache(a, host, p, **bw) for p in PATHS}
    # C: every expert computed from the host pool, no copy at all (0 slots: auto on a CPU).
    compute = make_cache(a, host, "split", size="auto")
    for p in PATHS:
        if p == "split":
            throttle_fills(linked[p], a.link_gbps)
        else:
            linked[p].prefill_stream.link_gbps = a.link_gbps
    print("#     T path         ms/pass   tok/s   X_ms   C_ms  model_ms", flush=True)
    rows: Dict[str, Dict[int, float]] = {p: {} for p in PATHS}
    ratios = {"two": [], "one": [], "overlap": []}
    for T in lengths:
        x, w, ids = inputs(a, T, a.seed + T)
        before = {p: linked[p].prefill_stream.link_bytes for p in PATHS}
        # Round robin over the configurations, so that a change of the machine's load
        # reaches all of them alike; medians of the reps.
        order = [("compute", compute)] + [(p, linked[p]) for p in PATHS]
        times, outs = {n: [] for n, _ in order}, {}
        for rep in range(a.reps + 1):  # the first: warm-up
            for name, cache in order:
                t, outs[name] = run_pass(cache, a, x, w, ids)
                if rep:
                    times[name].append(t)
        C = statistics.median(times["compute"])
        for p in PATHS:
            X = model = float("nan")
            t = statistics.median(times[p])
            if not all(torch.equal(o, r) for o, r in zip(outs[p], outs["compute"])):
                fail(f"{p} at T={T}: outputs differ from the ordinary path with no slots")
            if p != "split":
                moved = linked[p].prefill_stream.link_bytes - before[p]
                X = moved / (a.reps + 1) / (a.link_gbps * 1e9)
                model = max(X, C) if p == "two_buffers" else X + C
            rows[p][T] = t
            print(
                f"# {T:5d} {p:11s} {t * 1e3:8.1f} {T / t:7.0f} {X * 1e3:6.1f} {C * 1e3:6.1f} "
                f"{model * 1e3:8.1f}",
                flush=True,
            )
            if p == "two_buffers":
                ratios["two"].append(t / model)
                ratios["overlap"].append((T, (X + C - t) / min(X, C), min(X, C) / max(X, C)))
            elif p == "one_buffer":
                ratios["one"].append(t / model)
    for p in ("two_buffers", "one_buffer"):
        check_streamed(linked[p], p, (a.reps + 1) * len(lengths))
    mean = statistics.fmean
    fields = [f"tok_s_{p.split('_')[0]}_{T}={T / rows[p][T]:.0f}" for T in lengths for p in PATHS]
    # The overlap is read where transfer and compute are comparable (the shorter at least half
    # the longer): elsewhere min(X, C) is small against the noise of the longer.
    near = [o for o in ratios["overlap"] if o[2] >= 0.5] or ratios["overlap"]
    print(f"# overlap_ratio over T = {', '.join(str(o[0]) for o in near)}", flush=True)
    fields += [
        f"two_vs_max={mean(ratios['two']):.2f}",
        f"one_vs_sum={mean(ratios['one']):.2f}",
        f"simulated_link_gbps={a.link_gbps:g}",
        f"overlap_ratio={mean(o[1] for o in near):.2f}",
    ]
    print(f"# loadavg {open('/proc/loadavg').read().split()[:3]}", flush=True)
    print("expert_cache_prefill_stream " + " ".join(fields), flush=True)
    return 0


def slots(a) -> str:
    """``--size``, default two layers' experts: nothing else resident, so every pass streams
    the whole pool (one buffer leaves one layer's worth of decode entries)."""
    return a.size or str(2 * a.experts)


def main_cuda(a) -> int:
    if not torch.cuda.is_available():
        fail("--device cuda without a CUDA device (torch.cuda.is_available() is False)")
    from sglang.test.bare_fused_moe import install_cuda_standins, server_state

    standins = install_cuda_standins()
    lengths = [int(t) for t in a.lengths.split(",")]
    if standins:
        print(f"# stand-ins for upstream's CUDA kernel wheel: {'; '.join(standins)}", flush=True)
    host = host_pool(a)
    pool_bytes = host.rows * host.expert_bytes
    from sglang.srt.layers.moe.moe_runner.base import MoeRunnerConfig

    rc = MoeRunnerConfig(
        num_experts=a.experts,
        num_local_experts=a.experts,
        hidden_size=a.hidden,
        intermediate_size_per_partition=a.intermediate,
        top_k=a.top_k,
        params_dtype=torch.bfloat16,
        activation="silu",
        is_gated=True,
        inplace=True,
    )
    with server_state("cuda"):
        caches = {p: make_cache(a, host, p) for p in PATHS}
        bw = caches["two_buffers"].bandwidths
        if not (bw.fill_gbps > 0):
            fail(f"B_P not measured ({bw})")
        for p in PATHS:
            c = caches[p]
            need = {"two_buffers": 2, "one_buffer": 1, "split": 0}[p] * a.experts
            if c.num_slots < need:
                fail(f"{p}: {c.num_slots} slots, fewer than {need} (raise --size)")
        # The reference: the CPU cache with no slots (auto on a CPU), every expert from the pool.
        cpu_a = argparse.Namespace(**{**vars(a), "device": "cpu", "size": "auto"})
        ref_cache = make_cache(cpu_a, host, "split")
        X = pool_bytes / (bw.fill_gbps * 1e9)
        print(
            f"# device {torch.cuda.get_device_name()}; {a.layers} x {a.experts} experts, "
            f"{pool_bytes / 1e9:.2f} GB pool; B_P {bw.fill_gbps:.1f} GB/s ({bw.source}) -> "
            f"{X * 1e3:.1f} ms per pool stream",
            flush=True,
        )
        res: Dict[str, Dict[int, float]] = {p: {} for p in PATHS}
        for T in lengths:
            x, w, ids = inputs(a, T, a.seed + T)
            _, ref = run_pass(ref_cache, cpu_a, x, w, ids)
            xd, wd, idsd = x.cuda(), w.cuda(), ids.cuda()
            for p in PATHS:
                t, outs = timed(caches[p], a, xd, wd, idsd, rc)
                for layer, (o, r) in enumerate(zip(outs, ref)):
                    err = (o.float().cpu() - r.float()).abs().max().item()
                    tol = 2e-2 * max(1.0, r.float().abs().max().item())
                    if not err <= tol:
                        fail(f"{p} T={T} layer {layer}: max|err| {err:.3g} > {tol:.3g}")
                res[p][T] = t
                print(f"# {T:5d} {p:11s} {t * 1e3:8.2f} ms  {T / t:8.0f} tok/s", flush=True)
        for p in ("two_buffers", "one_buffer"):
            check_streamed(caches[p], p, (a.reps + 1) * len(lengths))
        streamed = caches["two_buffers"].prefill_stream.link_bytes
        want = pool_bytes * (a.reps + 1) * len(lengths)
        # With the default 2 E slots nothing survives a borrow: the whole pool streams.
        if a.size is None and streamed != want:
            fail(f"two_buffers streamed {streamed} bytes over the link, expected {want}")
    T = lengths[-1]
    two, one, split = (res[p][T] for p in PATHS)
    print(
        f"expert_cache_prefill_stream_cuda chunk_ms_two={two * 1e3:.2f} pool_ms_at_b_p={X * 1e3:.2f} "
        f"b_p_gbps={bw.fill_gbps:.1f} tokens={T} two_vs_one={two / one:.2f} "
        f"two_vs_split={two / split:.2f} transfer_bound_ratio={two / X:.2f}",
        flush=True,
    )
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    a = parse_args(argv)
    torch.manual_seed(a.seed)
    with tempfile.TemporaryDirectory() as tmp:  # B_P / B_H measured in this run, not cached
        os.environ["SGLANG_EXPERT_CACHE_PROFILE_PATH"] = os.path.join(tmp, "profile.json")
        return main_cuda(a) if a.device == "cuda" else main_cpu(a)


if __name__ == "__main__":
    sys.exit(main())
