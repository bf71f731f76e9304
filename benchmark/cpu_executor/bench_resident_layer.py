#!/usr/bin/env python
"""One resident bf16 MoE layer call on the CPU: the executor path of patch 0032
(``sglang.srt.layers.moe.cpu_executor``) against upstream's ``moe_forward_native``, same layer,
same routing, same run.

Shapes default to the embedded tiny models (64 experts, top-8, hidden 256, expert intermediate
128); ``--hidden 2048 --inter 768 --experts 128`` gives Qwen3-30B-A3B's. For each token count it
times both paths (median of ``--reps`` calls after one warm-up) and prints one line, and last:

    cpu_moe_layer t1_ratio=.. t16_ratio=.. t150_ratio=.. t1024_ratio=..

where ratio = native time / executor time (above 1: the executor is faster).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from sglang.srt.layers.moe.cpu_executor import cpu_executor_forward
from sglang.srt.layers.moe.fused_moe_native import moe_forward_native
from sglang.srt.layers.moe.moe_runner import MoeRunnerConfig


def timed(fn, reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--inter", type=int, default=128)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 150, 1024])
    p.add_argument("--reps", type=int, default=5)
    a = p.parse_args()

    g = torch.Generator().manual_seed(0)
    layer = torch.nn.Module()
    layer.num_experts = a.experts
    layer.w13_weight = (
        torch.randn(a.experts, 2 * a.inter, a.hidden, generator=g) / a.hidden**0.5
    ).bfloat16()
    layer.w2_weight = (
        torch.randn(a.experts, a.hidden, a.inter, generator=g) / a.inter**0.5
    ).bfloat16()
    cfg = MoeRunnerConfig()
    ratios = {}
    for t in a.tokens:
        x = torch.randn(t, a.hidden, generator=g).bfloat16()
        w, ids = torch.topk(
            torch.softmax(torch.randn(t, a.experts, generator=g), -1), a.top_k, dim=-1
        )
        topk = (w.float(), ids.int(), None)
        assert cpu_executor_forward(layer, x, topk, cfg) is not None, "executor path unavailable"
        t_exec = timed(lambda x=x, topk=topk: cpu_executor_forward(layer, x, topk, cfg), a.reps)
        t_native = timed(lambda x=x, topk=topk: moe_forward_native(layer, x, topk, cfg), a.reps)
        ratios[t] = t_native / t_exec
        print(
            f"tokens={t} executor_ms={t_exec * 1e3:.2f} native_ms={t_native * 1e3:.2f} ratio={ratios[t]:.1f}",
            flush=True,
        )
    print("cpu_moe_layer " + " ".join(f"t{t}_ratio={r:.1f}" for t, r in ratios.items()))


if __name__ == "__main__":
    main()
