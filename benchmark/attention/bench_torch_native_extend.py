"""Time one torch_native extend (one layer) on top of a long cached prefix:
upstream's full-sequence loop vs the new-rows path (patch 0010), the latter mask-free on ATen
(prefix and causal square as two flash calls merged through their log-sum-exps), with masked
query blocks (``mask_free=False``), and in our flash kernel (``sgl_kernel_fork.extend_attention``,
the default at a kernel level of avx2 or better and bf16 inputs; ``SGLANG_CPU_KERNEL_ISA=avx2``
times its AVX2 path on an AVX-512 BF16 CPU, ``ATEN_CPU_CAPABILITY=avx2`` ATen's).

    python benchmark/attention/bench_torch_native_extend.py [--prefix 8192] [--extend 128] [--reps 5]

Each path gets one warm-up and ``--reps`` timed runs, interleaved; the last line gives the
medians, ``speedup`` (median of the per-round upstream / mask-free ratios),
``mask_free_speedup`` (masked / mask-free) and, where the kernel runs, ``kernel_speedup``
(ATen mask-free / kernel) as ``name=value``. ``--skip-upstream`` leaves out
upstream's loop (quadratic in the prefix: minutes at 64K).
"""

import argparse
import os
import statistics
import time

import torch

from sglang.srt.layers.attention import torch_native_backend as tnb
from sglang.srt.layers.attention.torch_native_extend import (
    extend_kernel_supported,
    sdpa_extend_new_rows,
)

p = argparse.ArgumentParser()
p.add_argument("--prefix", type=int, default=8192)
p.add_argument("--extend", type=int, default=128)
p.add_argument("--heads", type=int, default=16)
p.add_argument("--kv-heads", type=int, default=4)
p.add_argument("--head-dim", type=int, default=64)
p.add_argument("--dtype", default="bfloat16")
p.add_argument("--reps", type=int, default=5, help="timed runs of each path (interleaved)")
p.add_argument("--skip-upstream", action="store_true", help="time only the two new-rows paths")
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
    return sdpa_extend_new_rows(output=torch.empty_like(q), use_kernel=False, **args)


def run_masked():
    return sdpa_extend_new_rows(
        output=torch.empty_like(q), mask_free=False, use_kernel=False, **args
    )


def run_kernel():
    return sdpa_extend_new_rows(output=torch.empty_like(q), use_kernel=True, **args)


backend = tnb.TorchNativeAttnBackend.__new__(tnb.TorchNativeAttnBackend)
paths = {"masked": run_masked, "new": run_new}
if extend_kernel_supported(q, k, v):
    paths["kernel"] = run_kernel
if not a.skip_upstream:
    paths = {"old": run_old, **paths}
outs = {name: fn() for name, fn in paths.items()}  # warm-up, and the outputs compared below
# All paths alike: --reps timed runs each, interleaved (old, masked, new, old, ...) so that load
# from other work on the machine falls on all; the median of each, and the median of the
# same-round ratios.
times = {name: [] for name in paths}
for _ in range(a.reps):
    for name, fn in paths.items():
        t0 = time.perf_counter()
        fn()
        times[name].append(time.perf_counter() - t0)
med = {name: statistics.median(ts) for name, ts in times.items()}


def ratio(slow: str, fast: str = "new") -> float:
    return statistics.median(s / n for s, n in zip(times[slow], times[fast]))


def diff(name: str, other: str = "new") -> float:
    return (outs[name].float() - outs[other].float()).abs().max().item()


fields = [
    f"attention_extend prefix={a.prefix} extend={a.extend} heads={a.heads} "
    f"kv_heads={a.kv_heads} head_dim={a.head_dim} dtype={a.dtype} "
    f"threads={torch.get_num_threads()} reps={a.reps} load1={os.getloadavg()[0]:.2f}"
]
if "old" in paths:
    fields.append(f"upstream_ms={med['old'] * 1e3:.1f}")
fields.append(f"masked_ms={med['masked'] * 1e3:.1f} mask_free_ms={med['new'] * 1e3:.1f}")
if "old" in paths:
    fields.append(f"speedup={ratio('old'):.2f} max_abs_diff={diff('old'):.2e}")
fields.append(f"mask_free_speedup={ratio('masked'):.2f} masked_max_abs_diff={diff('masked'):.2e}")
if "kernel" in paths:
    fields.append(
        f"kernel_ms={med['kernel'] * 1e3:.1f} kernel_speedup={ratio('new', 'kernel'):.2f} "
        f"kernel_max_abs_diff={diff('kernel'):.2e}"
    )
print(" ".join(fields))
