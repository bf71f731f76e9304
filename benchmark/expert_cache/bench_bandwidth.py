"""How long the expert cache's startup measurement of B_P and B_H takes, on deployed shapes.

    .venv/bin/python benchmark/expert_cache/bench_bandwidth.py [--layers 2] [--experts 128] [--device cpu]

Builds an ``ExpertSlotCache`` with Qwen3-30B-A3B expert shapes (hidden 2048, expert
intermediate 768, bf16, 9.4 MB per expert, top-8) over ``--layers`` x ``--experts`` experts in
the host pool, 25% of them in slots, and times ``finalize()``'s bandwidth step as the server runs
it at startup (FreeToken §3.2, Eq. 4: B_P = host -> slot fill bandwidth, B_H = CPU expert-kernel
bandwidth), with the per-machine profile cache pointed at a fresh file so that both figures are
really measured. The host pool only needs to be larger than the last-level cache; the
measurement reads ``top_k`` experts per timed call and walks the whole pool.

Last line: ``expert_cache_bandwidth measure_ms=... fill_gbps=... cpu_gbps=... fill_ratio=...``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

from sglang.srt.layers.moe.expert_cache.cache import ExpertSlotCache
from sglang.srt.layers.moe.expert_cache.config import CacheSize, ExpertCacheConfig, MissPolicy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        os.environ["SGLANG_EXPERT_CACHE_PROFILE_PATH"] = os.path.join(tmp, "bw.json")
        cfg = ExpertCacheConfig(size=CacheSize.parse("25%"), policy=MissPolicy.parse("qstar"))
        cache = ExpertSlotCache(
            cfg,
            num_layers=args.layers,
            num_experts=args.experts,
            top_k=args.top_k,
            hidden_size=args.hidden,
            intermediate_size=args.inter,
            dtype=torch.bfloat16,
            device=args.device,
        )
        for layer in range(args.layers):
            cache.register_layer(layer)
            for name in ("w13", "w2"):
                rows = cache.host_rows(name, layer)
                rows.copy_(torch.randn(rows.shape, dtype=torch.float32).mul_(0.02).to(rows.dtype))
        cache.finalize()  # sizes the slots and measures once (the startup path)
        # Time the bandwidth step again as startup runs it, with the profile cache emptied.
        os.remove(os.environ["SGLANG_EXPERT_CACHE_PROFILE_PATH"])
        threads = torch.ops.sgl_kernel.expert_pool_set_threads(cfg.cpu_threads)
        t0 = time.perf_counter()
        bw = cache.measure_bandwidths(threads)
        ms = 1e3 * (time.perf_counter() - t0)
    pool_gb = args.layers * args.experts * cache.host.expert_bytes / 1e9
    print(
        f"# {args.layers} x {args.experts} experts ({pool_gb:.1f} GB host pool), {threads} CPU "
        f"threads, device {args.device}, source {bw.source}"
    )
    print(
        f"expert_cache_bandwidth measure_ms={ms:.0f} fill_gbps={bw.fill_gbps:.2f} "
        f"cpu_gbps={bw.cpu_gbps:.2f} fill_ratio={bw.fill_ratio:.3f}"
    )


if __name__ == "__main__":
    main()
