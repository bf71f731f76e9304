"""Time one torch_native extend (one layer) on top of a long cached prefix:
upstream's full-sequence loop vs the new-rows path (patch 0010).

    python benchmark/attention/bench_torch_native_extend.py [--prefix 8192] [--extend 128]
"""

import argparse
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
a = p.parse_args()
dt = getattr(torch, a.dtype)
s = a.prefix + a.extend
k = torch.randn(s, a.kv_heads, a.head_dim, dtype=dt)
v = torch.randn_like(k)
q = torch.randn(a.extend, a.heads, a.head_dim, dtype=dt)
t = lambda x: torch.tensor([x])
args = dict(query=q, k_cache=k, v_cache=v, req_to_token=torch.arange(s).unsqueeze(0),
            req_pool_indices=t(0), seq_lens=t(s), extend_prefix_lens=t(a.prefix),
            extend_seq_lens=t(a.extend), scaling=a.head_dim**-0.5,
            enable_gqa=a.heads != a.kv_heads, causal=True)


def bench(fn, reps):
    out = fn()  # warm-up
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


backend = tnb.TorchNativeAttnBackend.__new__(tnb.TorchNativeAttnBackend)
t_old, o_old = bench(lambda: tnb.TorchNativeAttnBackend._run_sdpa_forward_extend(
    backend, output=torch.empty_like(q), **args), 1)
t_new, o_new = bench(lambda: sdpa_extend_new_rows(output=torch.empty_like(q), **args), 5)
print(f"prefix={a.prefix} extend={a.extend} H={a.heads}/{a.kv_heads} d={a.head_dim} {a.dtype} "
      f"threads={torch.get_num_threads()}: upstream {t_old*1e3:.1f} ms, new-rows {t_new*1e3:.1f} ms, "
      f"speedup x{t_old/t_new:.1f}, max|diff| {(o_old.float()-o_new.float()).abs().max():.2e}")
