#!/usr/bin/env python
"""One decode step of N MoE layers through the expert-slot cache at real shapes, on a GPU (eager
and captured in one CUDA graph) or on the CPU (eager).

    python benchmark/expert_cache/bench_gpu_step.py                  # Qwen3.6-35B-A3B, GPU if any
    python benchmark/expert_cache/bench_gpu_step.py --device cpu --layers 2 --experts 32 \\
        --hidden 256 --intermediate 128 --steps 3 --warmup 2          # a small CPU run

Model (defaults: the MoE layers of Qwen3.6-35B-A3B): ``--layers`` 40, ``--experts`` 256,
``--top-k`` 8, ``--hidden`` 2048, ``--intermediate`` 512 (expert intermediate), bf16: 6.3 MB per
expert, a 64 GB host pool. A step adds each layer's routed-expert output
(``ExpertSlotCache.forward`` of the RMS-normalized stream) to the residual stream, layer after
layer, for ``--batch`` decode
tokens; attention, router and shared experts are not run. Expert weights are random (layers
repeat above 2 GB of distinct weights: values do not change the timing).

Routing: the decode calls of ``--trace`` (a routing trace, ``expert_cache/README.md``; one
sequence, batch 1), else the synthetic trace of ``bench_missrate.py`` (``SynthParams``: Zipf
popularity per layer with drift, per-request topic experts, each of the previous token's
experts kept with probability ``--persist``), ``--batch`` requests decoding side by side. The
locality is printed: the trace's parameters and the measured reuse (the share of a layer's
routed experts that the same sequence also routed one step earlier).

Cache: ``--sizes`` (% of the pool; 37 first, the last line's figures) x ``--policies``, every
configuration over one shared host pool (pinned on a GPU). B_P (fills host -> slots; on a GPU the
bank-copy kernel reading pinned host memory over this machine's host link) and B_H (the CPU
executor at batch 1) are measured once, as the server measures them at startup, and given to
every configuration; B_D (device memory: a large device-to-device copy, bytes read plus written;
on the CPU host memory) is measured in the same run.

Per configuration: ``--warmup`` eager steps (Triton compiles, the cache warms), ``--steps`` timed
eager steps, then on CUDA one whole step captured in a CUDA graph and ``--steps`` timed replays
(trace steps continue; the cache state carries on). A step's time is its wall time up to a
device sync, as a server's decode step ends. Per configuration: median step ms (eager, graph),
hit rate (distinct hits / routed distinct experts), q (fills) and m (misses) per layer call, q
per layer, the roofline, its ratio, and the step output's difference from the first
configuration's (the same inputs: 0 on the CPU, where every configuration computes the same);
past ``OUT_TOL`` of the output's scale (or NaN) the run says which and exits 1.

Roofline of a layer call with h hits, q fills, c = m - q CPU experts, b bytes per expert:

* CUDA: ``max(c*b / B_H, q*b / B_P + (h+q)*b / B_D)`` (the CPU branch runs beside the fills and
  the slot experts, which follow the fills);
* CPU: ``q*b / B_P + (h+m)*b / B_H`` (one executor call reads both sides after the copies);

summed over the timed steps' calls and divided by the steps. ``roofline_ratio`` = roofline ms /
measured ms (1 = at the bound).

Last line::

    expert_cache_gpu_step step_ms_c37=... roofline_ratio_c37=... qstar_vs_fill=... \\
        qstar_vs_cpu=... graph_vs_eager=... device=... hit_c37=... b_p_gbps=... b_h_gbps=... \\
        b_d_gbps=...

qstar at 37% (graph replays on CUDA, eager on the CPU); ``qstar_vs_X`` = step ms of qstar / of
policy X at 37% (below 1: qstar faster); ``graph_vs_eager`` = graph / eager ms of qstar at 37%
(nan on the CPU). On a GPU without upstream's CUDA kernels, decode batches above 32 tokens
take the align stand-in's sort path (``sglang/test/bare_fused_moe.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_missrate import SynthParams, Trace, generate_synthetic, parse_trace_jsonl  # noqa: E402

from sglang.srt.layers.moe.expert_cache.banks import BF16, ExpertBanks  # noqa: E402
from sglang.srt.layers.moe.expert_cache.cache import ExpertSlotCache  # noqa: E402
from sglang.srt.layers.moe.expert_cache.config import (  # noqa: E402
    CacheSize,
    ExpertCacheConfig,
    MissPolicy,
)
from sglang.srt.layers.moe.expert_cache.control import Stat  # noqa: E402

DISTINCT_WEIGHT_BYTES = 2 << 30  # layers with their own random weights; the rest repeat them


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--layers", type=int, default=40, help="MoE layers (N)")
    p.add_argument("--experts", type=int, default=256, help="routed experts per layer (E)")
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=512, help="expert intermediate size")
    p.add_argument("--batch", type=int, default=1, help="decode tokens per step")
    p.add_argument("--sizes", default="37,11,100", help="cache sizes, %% of the pool")
    p.add_argument("--policies", default="qstar,fill,cpu")
    p.add_argument("--warmup", type=int, default=8, help="eager steps before timing")
    p.add_argument("--steps", type=int, default=24, help="timed steps per mode")
    p.add_argument("--cpu-threads", type=int, default=0, help="0 = one per physical core")
    p.add_argument("--trace", type=Path, help="routing trace JSONL (batch-1 decode calls)")
    p.add_argument("--persist", type=float, default=SynthParams.persist)
    p.add_argument("--zipf", type=float, default=SynthParams.zipf)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    try:
        a.sizes = [float(s) for s in a.sizes.split(",") if s.strip()]
    except ValueError:
        p.error(f"--sizes: not a comma-separated list of percentages: {a.sizes!r}")
    if not a.sizes or not all(0 < s <= 100 for s in a.sizes):
        p.error("--sizes must be percentages in (0, 100]")
    try:
        a.policies = [MissPolicy.parse(s.strip()) for s in a.policies.split(",") if s.strip()]
    except ValueError as e:
        p.error(f"--policies: {e}")
    if min(a.layers, a.experts, a.top_k, a.batch, a.steps) < 1 or a.warmup < 0:
        p.error("--layers, --experts, --top-k, --batch and --steps must be >= 1")
    if a.top_k > a.experts:
        p.error("--top-k must be at most --experts")
    if a.device == "auto":
        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    elif a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no GPU here (run with --device cpu)")
    return a


# ------------------------------------------------------------------------------------ routing
def decode_routing(a: argparse.Namespace, steps: int) -> tuple[torch.Tensor, str]:
    """[steps, L, T, K] int32 routed ids (the decode calls of the trace, T sequences side by
    side) and a line stating the trace's locality."""
    L, E, K, T = a.layers, a.experts, a.top_k, a.batch
    if a.trace is not None:
        trace = parse_trace_jsonl(a.trace)
        if (trace.num_layers, trace.num_experts) != (L, E):
            raise SystemExit(
                f"{a.trace}: a trace of {trace.num_layers} layers x {trace.num_experts} experts; "
                f"give --layers {trace.num_layers} --experts {trace.num_experts}"
            )
        if T != 1:
            raise SystemExit("--trace replays one decoding sequence: give --batch 1")
        seqs = [_decode_calls(trace, K)]
        desc = f"trace={a.trace}"
    else:
        sp = SynthParams(
            num_layers=L,
            num_experts=E,
            top_k=K,
            requests=T,
            prefill_tokens=1,
            decode_tokens=steps,
            zipf=a.zipf,
            persist=a.persist,
            topic_experts=min(SynthParams.topic_experts, E),
            seed=a.seed,
        )
        trace = generate_synthetic(sp)
        seqs = [s[:steps] for s in _decode_calls_per_request(trace, K, T)]
        desc = "synthetic " + sp.describe()
    if min(len(s) for s in seqs) < steps:
        raise SystemExit(
            f"the routing has {min(len(s) for s in seqs)} decode steps of {K} experts in every "
            f"layer; this run needs {steps} (--warmup + 2 x --steps + 1)"
        )
    ids = torch.tensor(np.stack([np.stack(s[:steps]) for s in seqs], axis=2), dtype=torch.int32)
    reuse = _reuse(ids)
    return ids, f"{desc} | measured reuse (experts also routed one step earlier): {reuse:.3f}"


def _decode_calls(trace: Trace, K: int) -> List[np.ndarray]:
    """The decode steps of a batch-1 trace whose every layer routed K experts: [L, K] each."""
    out: Dict[int, Dict[int, np.ndarray]] = {}
    for i in range(trace.num_calls):
        if trace.prefill[i] or trace.tokens[i] != 1 or trace.sizes[i] != K:
            continue
        g = trace.gids[trace.offsets[i] : trace.offsets[i + 1]] % trace.num_experts
        out.setdefault(int(trace.step[i]), {})[int(trace.layer[i])] = np.sort(g)
    L = trace.num_layers
    return [
        np.stack([layers[l] for l in range(L)])
        for _, layers in sorted(out.items())
        if len(layers) == L
    ]


def _decode_calls_per_request(trace: Trace, K: int, requests: int) -> List[List[np.ndarray]]:
    """The synthetic trace's requests run one after another: split its decode steps back into
    one sequence per request (each starts after its one-token prefill step)."""
    steps = _decode_calls(trace, K)
    per = len(steps) // requests
    return [steps[r * per : (r + 1) * per] for r in range(requests)]


def _reuse(ids: torch.Tensor) -> float:
    if ids.shape[0] < 2:
        return float("nan")
    a, b = ids[1:].unsqueeze(-1), ids[:-1].unsqueeze(-2)  # [S-1, L, T, K, 1] vs [.., 1, K]
    return float((a == b).any(-1).float().mean())


# ----------------------------------------------------------------------------- bandwidths
def device_bandwidth(device: str) -> float:
    """B_D in GB/s: the best of several copies of a buffer well beyond the caches (1 GiB on a
    GPU, 256 MiB on the CPU), counting bytes read and written."""
    n = (1 << 30) if device == "cuda" else (256 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    src.fill_(1)
    dst = torch.empty_like(src)
    best = 0.0
    for _ in range(6):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = max(best, 2 * n / (time.perf_counter() - t0) / 1e9)
    del src, dst
    return best


@contextlib.contextmanager
def fresh_profile(tmp: str):
    """Point the bandwidth profile cache at an empty file: B_P and B_H are measured here."""
    key = "SGLANG_EXPERT_CACHE_PROFILE_PATH"
    old = os.environ.get(key)
    os.environ[key] = os.path.join(tmp, "bw.json")
    try:
        yield
    finally:
        if old is None:
            del os.environ[key]
        else:
            os.environ[key] = old


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------------ model
def fill_host_pool(a: argparse.Namespace) -> ExpertBanks:
    """The routed experts of every layer, w13 ~ N(0, 1/H), w2 ~ N(0, 1/I), in bf16."""
    rows = a.layers * a.experts
    host = ExpertBanks(BF16, a.hidden, a.intermediate, rows, "cpu")
    layer_bytes = a.experts * host.expert_bytes
    distinct = max(1, min(a.layers, DISTINCT_WEIGHT_BYTES // layer_bytes))
    g = torch.Generator().manual_seed(a.seed)
    E = a.experts
    for name, fan_in in (("w13", a.hidden), ("w2", a.intermediate)):
        bank = host[name]
        for layer in range(a.layers):
            rows_l = bank[layer * E : (layer + 1) * E]
            if layer < distinct:
                rows_l.normal_(0.0, fan_in**-0.5, generator=g)
            else:
                src = layer % distinct
                rows_l.copy_(bank[src * E : (src + 1) * E])
    return host


def runner_config(a: argparse.Namespace):
    """The ``MoeRunnerConfig`` FusedMoE gives a layer of this shape (the device side's)."""
    from sglang.srt.layers.moe.moe_runner.base import MoeRunnerConfig

    return MoeRunnerConfig(
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


@dataclass
class Result:
    size: float
    policy: str
    slots: int
    eager_ms: float
    graph_ms: float
    counts: Dict[str, np.ndarray]  # per mode: [L, len(Stat)] counters summed over timed steps
    roofline_ms: Dict[str, float]
    out_err: float

    def stat(self, mode: str, s) -> np.ndarray:
        return self.counts[mode][:, int(s)]

    def hit_rate(self, mode: str) -> float:
        h, m = self.stat(mode, Stat.HITS).sum(), self.stat(mode, Stat.MISSES).sum()
        return float(h / max(1, h + m))

    def best_ms(self) -> float:
        return self.graph_ms if not math.isnan(self.graph_ms) else self.eager_ms

    def best_mode(self) -> str:
        return "graph" if not math.isnan(self.graph_ms) else "eager"


# Outputs of every configuration against the first one's, as a share of its scale: the slot path
# (Triton, bf16 intermediate) and the CPU executor differ by rounding only; test_cuda_cache.TOL.
OUT_TOL = 2e-2


class StepRunner:
    """One cache configuration driven step by step: eager steps and one captured step."""

    def __init__(self, cache: ExpertSlotCache, a, ids, weights, x0, rc):
        self.cache, self.a, self.ids, self.w, self.x0, self.rc = cache, a, ids, weights, x0, rc
        self.acc = torch.zeros(a.layers, len(Stat), dtype=torch.int64, device=a.device)

    def step(self, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """One decode step: ``ids`` [L, T, K], ``w`` [L, T, K]; returns the residual stream.

        Each layer reads the RMS-normalized stream, as a decoder layer's post-attention norm
        feeds its MoE: without it the random-weight stream grows each layer and overflows bf16
        past ~30 layers (the output check read NaN)."""
        x = self.x0.clone()
        for layer in range(self.a.layers):
            h = x.float()
            h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
            x = x + self.cache.forward(layer, h, w[layer], ids[layer], self.rc)
            self.acc[layer].add_(self.cache.fills.counts)  # this call's counters
        return x

    def timed(self, run, steps: Sequence[int]) -> tuple[float, np.ndarray, torch.Tensor]:
        """Median ms of ``run(step)`` over ``steps`` (each ended by a device sync), the
        counters of those steps, and the first step's output."""
        self.acc.zero_()
        times, first = [], None
        for s in steps:
            sync(self.a.device)
            t0 = time.perf_counter()
            out = run(s)
            sync(self.a.device)
            times.append(1e3 * (time.perf_counter() - t0))
            if first is None:
                first = out.float().cpu()
        return statistics.median(times), self.acc.cpu().numpy().copy(), first

    def eager(self, steps: Sequence[int]):
        return self.timed(lambda s: self.step(self.ids[s], self.w[s]), steps)

    def graph(self, warm_step: int, steps: Sequence[int]):
        """Capture one whole step (after a warm-up run of ``warm_step`` on a side stream) and
        time its replays on ``steps``, the routing copied into the graph's inputs."""
        ids_s, w_s = self.ids[warm_step].clone(), self.w[warm_step].clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.step(ids_s, w_s)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self.step(ids_s, w_s)

        def replay(s: int) -> torch.Tensor:
            ids_s.copy_(self.ids[s])
            w_s.copy_(self.w[s])
            graph.replay()
            return out

        return self.timed(replay, steps)


def roofline_ms(counts: np.ndarray, steps: int, expert_bytes: int, bw: Dict[str, float], dev):
    """The bound of the docstring for counters ``counts`` [L, len(Stat)] summed over ``steps``
    steps; per layer from its mean counts per step (ms per step)."""
    b = expert_bytes / 1e9  # GB
    c = counts / steps
    h, q, m = c[:, int(Stat.HITS)], c[:, int(Stat.FILLS)], c[:, int(Stat.MISSES)]
    cpu = c[:, int(Stat.CPU_EXPERTS)]
    if dev == "cuda":
        t = np.maximum(cpu * b / bw["h"], q * b / bw["p"] + (h + q) * b / bw["d"])
    else:
        t = q * b / bw["p"] + (h + m) * b / bw["h"]
    return 1e3 * float(t.sum())


def run_config(a, host, size, policy, ids, w, x0, bw_flags, rc):
    """Build one cache over ``host``, run its warm-up, eager and (CUDA) graph steps.

    Returns:
        (its :class:`Result` without the roofline and output error, the cache, the first
        timed eager step's output [T, H] float32 on the CPU).
    """
    fill_gbps, cpu_gbps = bw_flags if bw_flags else (None, None)
    cfg = ExpertCacheConfig(
        size=CacheSize.parse(f"{size:g}%"),
        policy=policy,
        cpu_threads=a.cpu_threads,
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
    r = StepRunner(cache, a, ids, w, x0, rc)
    W, N = a.warmup, a.steps
    for s in range(W):
        r.step(ids[s], w[s])
    eager_ms, eager_counts, out = r.eager(range(W, W + N))
    counts = {"eager": eager_counts}
    graph_ms = float("nan")
    if a.device == "cuda":
        graph_ms, counts["graph"], _ = r.graph(W + N, range(W + N + 1, W + 2 * N + 1))
    res = Result(size, policy.name.lower(), cache.num_slots, eager_ms, graph_ms, counts, {}, 0.0)
    return res, cache, out


def main(argv: Optional[Sequence[str]] = None) -> int:
    a = parse_args(argv)
    t_start = time.perf_counter()
    ctx = contextlib.ExitStack()
    rc = None
    standins: List[str] = []
    if a.device == "cuda":
        from sglang.test.bare_fused_moe import install_cuda_standins, server_state

        standins = install_cuda_standins()
        ctx.enter_context(server_state("cuda"))
        rc = runner_config(a)
    W, N = a.warmup, a.steps
    total_steps = W + 2 * N + 1
    ids_cpu, locality = decode_routing(a, total_steps)
    g = torch.Generator().manual_seed(a.seed + 1)
    w_cpu = torch.rand(ids_cpu.shape, generator=g)
    w_cpu = w_cpu / w_cpu.sum(-1, keepdim=True)
    x0 = torch.randn(a.batch, a.hidden, generator=g).to(torch.bfloat16).to(a.device)
    ids, w = ids_cpu.to(a.device), w_cpu.to(a.device)

    t0 = time.perf_counter()
    host = fill_host_pool(a)
    expert_bytes = host.expert_bytes
    pool_gb = host.rows * expert_bytes / 1e9
    name = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
    print(
        f"# device {name}; {a.layers} layers x {a.experts} experts, top-{a.top_k}, H {a.hidden}, "
        f"I {a.intermediate}, bf16: {expert_bytes / 1e6:.2f} MB per expert, {pool_gb:.1f} GB "
        f"pool (filled in {time.perf_counter() - t0:.1f} s); batch {a.batch}; "
        f"{W} warm-up + {N} timed steps per mode",
        flush=True,
    )
    print(f"# routing: {locality}", flush=True)
    if standins:
        print("# stand-ins for upstream's CUDA kernel wheel: " + "; ".join(standins), flush=True)
    b_d = device_bandwidth(a.device)

    results: List[Result] = []
    bw = None
    ref_out = None
    with ctx, tempfile.TemporaryDirectory() as tmp, fresh_profile(tmp):
        for size in a.sizes:
            for policy in a.policies:
                t0 = time.perf_counter()
                res, cache, out = run_config(
                    a, host, size, policy, ids, w, x0, bw and (bw["p"], bw["h"]), rc
                )
                if bw is None and cache.num_slots:
                    bw = {"p": cache.bandwidths.fill_gbps, "h": cache.bandwidths.cpu_gbps}
                    bw["d"] = b_d
                    print(
                        f"# B_P {bw['p']:.2f} GB/s ("
                        + (
                            "pinned host -> device over this machine's host link"
                            if a.device == "cuda"
                            else "host copy"
                        )
                        + f"), B_H {bw['h']:.2f} GB/s (CPU executor, batch 1, "
                        f"{torch.ops.sgl_kernel.expert_pool_set_threads(a.cpu_threads)} "
                        f"threads), B_D {b_d:.1f} GB/s ({'HBM' if a.device == 'cuda' else 'host'}"
                        f" copy); q*/m = {bw['p'] / bw['h']:.2f}",
                        flush=True,
                    )
                if ref_out is None:
                    ref_out = out
                scale = max(1.0, float(ref_out.abs().max()))
                res.out_err = float((out - ref_out).abs().max()) / scale
                if bw is not None:
                    for mode, c in res.counts.items():
                        res.roofline_ms[mode] = roofline_ms(c, N, expert_bytes, bw, a.device)
                results.append(res)
                report(res, N, time.perf_counter() - t0)
                del cache
                gc.collect()
                if a.device == "cuda":
                    torch.cuda.empty_cache()
    print(f"# wall {time.perf_counter() - t_start:.1f} s", flush=True)
    print(last_line(a, results, bw), flush=True)
    bad = [r for r in results if not r.out_err <= OUT_TOL]
    for r in bad:
        print(
            f"# FAIL c{r.size:g} {r.policy}: output off the first configuration's by "
            f"{r.out_err:.2e} of its scale (> {OUT_TOL})",
            flush=True,
        )
    return 1 if bad else 0


def report(r: Result, steps: int, seconds: float) -> None:
    mode = r.best_mode()
    calls = r.counts[mode].shape[0] * steps
    q = r.stat(mode, Stat.FILLS)
    m = r.stat(mode, Stat.MISSES)
    cpu = r.stat(mode, Stat.CPU_EXPERTS)
    roof = r.roofline_ms.get(mode, float("nan"))
    ratio = {k: v / (r.graph_ms if k == "graph" else r.eager_ms) for k, v in r.roofline_ms.items()}
    print(
        f"c{r.size:g} {r.policy:5s} slots={r.slots} eager_ms={r.eager_ms:.3f} "
        f"graph_ms={r.graph_ms:.3f} hit={r.hit_rate(mode):.3f} q_per_call={q.sum() / calls:.2f} "
        f"m_per_call={m.sum() / calls:.2f} cpu_per_call={cpu.sum() / calls:.2f} "
        f"roofline_ms={roof:.3f} "
        + " ".join(f"roofline_ratio_{k}={v:.3f}" for k, v in ratio.items())
        + f" out_err={r.out_err:.2e} ({seconds:.1f} s)",
        flush=True,
    )
    print("  q per layer (" + mode + "): " + " ".join(f"{v / steps:.2f}" for v in q), flush=True)


def last_line(a, results: List[Result], bw) -> str:
    def find(size, policy) -> Optional[Result]:
        return next((r for r in results if r.size == size and r.policy == policy), None)

    nan = float("nan")
    key = 37.0 if 37.0 in a.sizes else a.sizes[0]
    tag = f"c{key:g}"
    q = find(key, "qstar")
    step = q.best_ms() if q else nan
    roof = q.roofline_ms.get(q.best_mode(), nan) if q else nan

    def vs(policy: str) -> float:
        other = find(key, policy)
        return step / other.best_ms() if other and q else nan

    fields = [
        f"step_ms_{tag}={step:.3f}",
        f"roofline_ratio_{tag}={roof / step if q else nan:.3f}",
        f"qstar_vs_fill={vs('fill'):.3f}",
        f"qstar_vs_cpu={vs('cpu'):.3f}",
        f"graph_vs_eager={q.graph_ms / q.eager_ms if q else nan:.3f}",
        f"device={a.device}",
        f"hit_{tag}={q.hit_rate(q.best_mode()) if q else nan:.3f}",
    ]
    if bw:
        fields += [f"b_p_gbps={bw['p']:.2f}", f"b_h_gbps={bw['h']:.2f}", f"b_d_gbps={bw['d']:.1f}"]
    return "expert_cache_gpu_step " + " ".join(fields)


if __name__ == "__main__":
    sys.exit(main())
