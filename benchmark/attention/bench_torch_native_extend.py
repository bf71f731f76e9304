"""Time one torch_native extend (one layer) on top of a long cached prefix:
upstream's full-sequence loop vs the new-rows path (patch 0010).

    python benchmark/attention/bench_torch_native_extend.py [--prefix 8192] [--extend 128] [--reps 5]

Both paths get one warm-up and ``--reps`` timed runs, interleaved; the last line gives the
medians and ``speedup`` (median of the per-round upstream / new-rows ratios) as ``name=value``.
"""

import argparse
import statistics
import time

import torch

from sglang.srt.layers.attention import torch_native_backend as tnb
from sglang.srt.layers.attention.torch_native_extend import sdpa_extend_new_rows

p = argparse.ArgumentParser()
p.add_argument("--prefix", type=int, default=8192)
p.add_argument("--extend", type=int, default=128)
p.add_argument("--heads", type=int, default=16)
p.add_argument("--kv-heads", type=int, default=4)
p.add_argument("--head-dim", type=int, default=64)
p.add_argument("--dtype", default="bfloat16")
p.add_argument("--reps", type=int, default=5, help="timed runs of each path (interleaved)")
a = p.parse_args()
dt = getattr(torch, a.dtype)
s = a.prefix + a.extend
k = torch.randn(s, a.kv_heads, a.head_dim, dtype=dt)
v = torch.randn_like(k)
q = torch.randn(a.extend, a.heads, a.head_dim, dtype=dt)


def t(x):
    return torch.tensor([x])


args = dict(
    query=q,
    k_cache=k,
    v_cache=v,
    req_to_token=torch.arange(s).unsqueeze(0),
    req_pool_indices=t(0),
    seq_lens=t(s),
    extend_prefix_lens=t(a.prefix),
    extend_seq_lens=t(a.extend),
    scaling=a.head_dim**-0.5,
    enable_gqa=a.heads != a.kv_heads,
    causal=True,
)


def run_old():
    return tnb.TorchNativeAttnBackend._run_sdpa_forward_extend(
        backend, output=torch.empty_like(q), **args
    )


def run_new():
    return sdpa_extend_new_rows(output=torch.empty_like(q), **args)


backend = tnb.TorchNativeAttnBackend.__new__(tnb.TorchNativeAttnBackend)
o_old, o_new = run_old(), run_new()  # warm-up, and the outputs compared below
# Both paths alike: --reps timed runs each, interleaved (old, new, old, new, ...) so that load
# from other work on the machine falls on both; the median of each, and the median of the
# same-round ratios.
times = {"old": [], "new": []}
for _ in range(a.reps):
    for name, fn in (("old", run_old), ("new", run_new)):
        t0 = time.perf_counter()
        fn()
        times[name].append(time.perf_counter() - t0)
t_old, t_new = statistics.median(times["old"]), statistics.median(times["new"])
speedup = statistics.median(o / n for o, n in zip(times["old"], times["new"]))
print(
    f"attention_extend prefix={a.prefix} extend={a.extend} heads={a.heads} kv_heads={a.kv_heads} "
    f"head_dim={a.head_dim} dtype={a.dtype} threads={torch.get_num_threads()} reps={a.reps} "
    f"upstream_ms={t_old * 1e3:.1f} new_rows_ms={t_new * 1e3:.1f} speedup={speedup:.2f} "
    f"max_abs_diff={(o_old.float() - o_new.float()).abs().max():.2e}"
)
