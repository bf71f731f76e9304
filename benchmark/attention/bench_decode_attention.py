"""Time one decode attention call (one layer, one request, one query row) at several context
lengths: our kernel's decode path (``extend_attention`` with ``kv_index``: the request's KV
slots read in place from the pool) against upstream's torch_native decode (the request's K / V
gathered from the pool, then ATen's ``scaled_dot_product_attention`` with GQA), same run.

    python benchmark/attention/bench_decode_attention.py [--contexts 128,1024,4096,16384] [--reps 20]

Shapes default to the Qwen3-30B-A3B slice of ``benchmark/cpu_decode.py`` (32 query heads, 4 KV
heads, head dim 128, bf16). Per context one line with the medians, the KV bytes read per call
over the kernel's time (GB/s) and the ratio; the last line gives them all as ``name=value``.
``SGLANG_CPU_KERNEL_ISA=avx2`` times the kernel's AVX2 path, ``ATEN_CPU_CAPABILITY=avx2`` ATen's.
"""

import argparse
import math
import statistics
import time

import torch
import torch.nn.functional as F

import sgl_kernel_fork

p = argparse.ArgumentParser()
p.add_argument("--contexts", default="128,1024,4096,16384")
p.add_argument("--heads", type=int, default=32)
p.add_argument("--kv-heads", type=int, default=4)
p.add_argument("--head-dim", type=int, default=128)
p.add_argument("--reps", type=int, default=20, help="timed calls of each path (interleaved)")
a = p.parse_args()


def loadavg() -> str:
    return open("/proc/loadavg").read().split()[0]


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


print(f"isa={sgl_kernel_fork.cpu_isa()} threads={torch.get_num_threads()} [load {loadavg()}]")
fields = []
g = torch.Generator().manual_seed(0)
scale = 1.0 / math.sqrt(a.head_dim)
for ctx in (int(c) for c in a.contexts.split(",")):
    slots = ctx + 4096  # the request's slots are a scattered subset of a larger pool
    pool_k = torch.randn(slots, a.kv_heads, a.head_dim, generator=g).bfloat16()
    pool_v = torch.randn(slots, a.kv_heads, a.head_dim, generator=g).bfloat16()
    idx = torch.randperm(slots, generator=g)[:ctx].sort().values
    q = torch.randn(1, a.heads, a.head_dim, generator=g).bfloat16()
    out = torch.empty_like(q)

    def kernel(q=q, pool_k=pool_k, pool_v=pool_v, out=out, idx=idx):
        sgl_kernel_fork.extend_attention(q, pool_k, pool_v, out, 0, scale, False, kv_index=idx)

    def aten(q=q, pool_k=pool_k, pool_v=pool_v, idx=idx):
        # torch_native_backend._run_sdpa_forward_decode for one request
        k = pool_k[idx].movedim(0, 1).unsqueeze(0)
        v = pool_v[idx].movedim(0, 1).unsqueeze(0)
        F.scaled_dot_product_attention(
            q.movedim(0, 1).unsqueeze(0), k, v, scale=scale, enable_gqa=True
        )

    kernel(), aten()
    tk, ta = [], []
    for _ in range(a.reps):
        tk.append(timed(kernel))
        ta.append(timed(aten))
    mk, ma = statistics.median(tk), statistics.median(ta)
    gbps = 2 * ctx * a.kv_heads * a.head_dim * 2 / mk / 1e9
    print(
        f"ctx {ctx:6d}: kernel {mk * 1e6:9.1f} us ({gbps:5.1f} GB/s of KV)  aten {ma * 1e6:10.1f} us"
        f"  speedup {ma / mk:5.1f}x  [load {loadavg()}]",
        flush=True,
    )
    fields += [f"kernel_us_{ctx}={mk * 1e6:.1f}", f"aten_us_{ctx}={ma * 1e6:.1f}"]
    fields += [f"speedup_{ctx}={ma / mk:.2f}", f"kv_gbps_{ctx}={gbps:.1f}"]
fields.append(f"loadavg={loadavg()}")
print(f"decode_attention isa={sgl_kernel_fork.cpu_isa()} " + " ".join(fields))
