"""Time one call of the per-layer expert-cache control op (FreeToken §4.1) on a realistic cache.

    .venv/bin/python benchmark/expert_cache/bench_control.py [--steps 40] [--device cpu]

Setup: L = 48 MoE layers, E = 64 and 256 experts per layer, top-8, one slot pool of
S = 25% of L*E shared by all layers, F = 8 and 16, policy qstar with fill_ratio 0.8. Routing has
locality: each layer has its own Zipf-like expert popularity, each token draws 8 distinct
experts from it. A decode step calls the op once per layer (layer 0..47); the cache is warmed
for several steps first.

Figures (microseconds per call, median over all calls):

* ``call``: one ``torch.ops.sgl_kernel.expert_cache_control`` call from Python, as the model
  code pays it (includes the Python -> dispatcher overhead);
* ``floor``: the same op called the same way with an empty batch (T = 0: argument checks,
  clock and counters only): the cost of calling an op with these 15 arguments from Python;
* ``op``: ``call - floor``, the op's own work (dedup, classification, victim pass, rewrite).
  This is the figure comparable to a kernel launched from C++ or a CUDA graph.

On CUDA (when available) it also times eager calls (launch-bound) and replay of a CUDA graph
holding one decode step's 48 calls (per call = replay time / 48).

Last line: ``expert_cache_control control_us_b1=... control_us_b8=... control_us_b64=...`` (the
``call`` figure, worst over E and F for each batch size), then ``op_us_b*`` (the ``op``
figure) and ``floor_us``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import sgl_kernel_fork  # noqa: F401
from sglang.srt.layers.moe.expert_cache import control as ec

L, K, RATIO, POLICY = 48, 8, 0.8, int(ec.MissPolicy.QSTAR)
Stat = ec.Stat


def routing(E: int, T: int, steps: int, seed: int, device: str):
    """[steps][L] tensors [T, K] int32: per-layer Zipf popularity, distinct experts per token."""
    g = torch.Generator().manual_seed(seed)
    out = [[None] * L for _ in range(steps)]
    for layer in range(L):
        w = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** 1.0
        w = w[torch.randperm(E, generator=g)]
        for s in range(steps):
            ids = torch.multinomial(w.expand(T, E), K, replacement=False, generator=g)
            out[s][layer] = ids.to(torch.int32).to(device).contiguous()
    return out


class Outputs:
    """Preallocated outputs of the raw op for batches of T tokens (the op is timed alone)."""

    def __init__(self, T: int, F: int, device: str):
        self.slot_ids = torch.full((T, K), -1, dtype=torch.int32, device=device)
        self.cpu_ids = torch.full((T, K), -1, dtype=torch.int32, device=device)
        self.fills = ec.FillList.allocate(F, device)


def setup(E: int, F: int, T: int, device: str):
    S = L * E // 4
    tables = ec.ExpertCacheTables.allocate(L, E, S, device)
    return S, tables, Outputs(T, F, device)


def args_for(ids, layer, E, tables, out):
    f = out.fills
    return (
        ids,
        layer,
        E,
        tables.slot_of_id,
        tables.id_of_slot,
        tables.slot_last_use,
        tables.clock,
        out.slot_ids,
        out.cpu_ids,
        f.fill_src,
        f.fill_dst,
        f.counts,
        tables.stats,
        RATIO,
        POLICY,
    )


def time_cpu(E: int, F: int, T: int, steps: int, warm: int):
    S, tables, out = setup(E, F, T, "cpu")
    routes = routing(E, T, steps, seed=E * 131 + T, device="cpu")
    op = torch.ops.sgl_kernel.expert_cache_control
    calls = [
        args_for(routes[s][layer], layer, E, tables, out)
        for s in range(steps)
        for layer in range(L)
    ]
    for a in calls[: warm * L]:  # warm the cache
        op(*a)
    st0 = tables.stats.clone()
    clk = time.perf_counter_ns
    times = []
    for a in calls:
        t0 = clk()
        op(*a)
        times.append(clk() - t0)
    st = (tables.stats - st0).tolist()  # the counters over the timed calls, by Stat
    times.sort()
    med = times[len(times) // 2] / 1e3
    p90 = times[int(len(times) * 0.9)] / 1e3
    hits, misses = st[Stat.HITS], st[Stat.MISSES]
    return dict(
        S=S,
        med=med,
        p90=p90,
        hit=hits / max(1, hits + misses),
        fills=st[Stat.FILLS] / len(calls),
        cpu=st[Stat.CPU_EXPERTS] / len(calls),
    )


def time_floor(E: int, F: int, n: int = 4000):
    """Same op, same arguments, empty batch: the Python -> op call cost."""
    _, tables, out = setup(E, F, 0, "cpu")
    a = args_for(torch.empty(0, K, dtype=torch.int32), 0, E, tables, out)
    op = torch.ops.sgl_kernel.expert_cache_control
    clk = time.perf_counter_ns
    for _ in range(200):
        op(*a)
    times = []
    for _ in range(n):
        t0 = clk()
        op(*a)
        times.append(clk() - t0)
    return statistics.median(times) / 1e3


def time_cuda(E: int, F: int, T: int, steps: int, warm: int):
    S, tables, out = setup(E, F, T, "cuda")
    routes = routing(E, T, steps, seed=E * 131 + T, device="cuda")
    op = torch.ops.sgl_kernel.expert_cache_control
    for s in range(warm):
        for layer in range(L):
            op(*args_for(routes[s][layer], layer, E, tables, out))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for s in range(steps):
        for layer in range(L):
            op(*args_for(routes[s][layer], layer, E, tables, out))
    torch.cuda.synchronize()
    eager = (time.perf_counter() - t0) / (steps * L) * 1e6
    static = torch.empty_like(routes[0][0])
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for layer in range(L):
            op(*args_for(static, layer, E, tables, out))
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        for layer in range(L):
            op(*args_for(static, layer, E, tables, out))
    static.copy_(routes[0][0])
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    reps = 200
    t0 = time.perf_counter()
    for _ in range(reps):
        graph.replay()
    torch.cuda.synchronize()
    graph_us = (time.perf_counter() - t0) / (reps * L) * 1e6
    return dict(S=S, eager=eager, graph=graph_us)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40, help="timed decode steps (x48 calls)")
    p.add_argument("--warm", type=int, default=10, help="warm-up decode steps")
    p.add_argument("--device", choices=["cpu", "cuda", "both"], default="both")
    a = p.parse_args()
    torch.set_num_threads(1)
    batches, experts, fills = (1, 8, 64), (64, 256), (8, 16)
    floor = statistics.median(time_floor(E, 16) for E in experts for _ in range(3))
    print(
        f"# expert_cache_control, L={L}, top-{K}, S=L*E/4, qstar fill_ratio={RATIO}; "
        f"Python->op floor (same op, T=0) = {floor:.2f} us"
    )
    print(
        f"{'dev':4} {'E':>4} {'S':>5} {'F':>3} {'T':>3} {'call_us':>8} {'p90_us':>7} {'op_us':>6} "
        f"{'hit':>5} {'fills/call':>10} {'cpu/call':>8}"
    )
    worst_call = {T: 0.0 for T in batches}
    worst_op = {T: 0.0 for T in batches}
    if a.device in ("cpu", "both"):
        for E in experts:
            for F in fills:
                for T in batches:
                    r = time_cpu(E, F, T, a.steps, a.warm)
                    op_us = max(0.0, r["med"] - floor)
                    worst_call[T] = max(worst_call[T], r["med"])
                    worst_op[T] = max(worst_op[T], op_us)
                    print(
                        f"{'cpu':4} {E:4d} {r['S']:5d} {F:3d} {T:3d} {r['med']:8.2f} {r['p90']:7.2f} "
                        f"{op_us:6.2f} {r['hit']:5.2f} {r['fills']:10.2f} {r['cpu']:8.2f}",
                        flush=True,
                    )
    cuda_line = ""
    if a.device in ("cuda", "both") and torch.cuda.is_available():
        if torch._C._dispatch_has_kernel_for_dispatch_key(
            "sgl_kernel::expert_cache_control", "CUDA"
        ):
            worst_graph = {T: 0.0 for T in batches}
            for E in experts:
                for T in batches:
                    r = time_cuda(E, 16, T, a.steps, a.warm)
                    worst_graph[T] = max(worst_graph[T], r["graph"])
                    print(
                        f"cuda {E:4d} {r['S']:5d} {16:3d} {T:3d} eager {r['eager']:.2f} us/call, "
                        f"graph {r['graph']:.2f} us/call",
                        flush=True,
                    )
            cuda_line = " " + " ".join(f"cuda_graph_us_b{T}={worst_graph[T]:.2f}" for T in batches)
        else:
            print(
                "# CUDA available but sgl_kernel_fork has no CUDA kernel for the op: CUDA rows skipped"
            )
    if a.device in ("cpu", "both"):
        print(
            "expert_cache_control "
            + " ".join(f"control_us_b{T}={worst_call[T]:.2f}" for T in batches)
            + " "
            + " ".join(f"op_us_b{T}={worst_op[T]:.2f}" for T in batches)
            + f" floor_us={floor:.2f}"
            + cuda_line
        )
    else:
        print("expert_cache_control" + cuda_line)


if __name__ == "__main__":
    sys.exit(main())
