#!/usr/bin/env python
"""Fixed cost of one pool op after a Python gap (issue 18: a decode step's ~20 ops each pay it).

Calls ``dense_linear_cpu`` on one bf16 row from Python: a router-sized weight (128 x 2048,
0.5 MB, cached: the op's fixed cost) and qkv-sized weights (5120 x 2048, 21 MB each, 24 of them
rotated: a cold read), with a busy-wait of ``gap`` us before each call (the Python between a
decode step's ops, long enough for idle workers to fall asleep). Prints the median call time of
the last three quarters of the calls per (gap, weight), then last::

    op_latency threads=N spin_us=S router_us_gap0=... router_us_gap30=... qkv_gbps_gap30=...

Compare builds or ``SGLANG_CPU_EXPERT_SPIN_US`` values in back-to-back runs (noisy machine).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--threads", type=int, default=0, help="pool workers (0: the default)")
    p.add_argument("--gaps", default="0,30,100", help="us of busy Python before each call")
    args = p.parse_args(argv)
    import sgl_kernel_fork  # noqa: F401  (registers torch.ops.sgl_kernel)

    ops = torch.ops.sgl_kernel
    threads = ops.expert_pool_set_threads(args.threads)  # 0: the default count
    info = ops.expert_pool_info()
    print(info)
    x = torch.randn(1, 2048, dtype=torch.bfloat16)
    router = [torch.randn(128, 2048, dtype=torch.bfloat16) for _ in range(4)]
    qkv = [torch.randn(5120, 2048, dtype=torch.bfloat16) for _ in range(24)]

    def busy(us: float) -> None:
        end = time.perf_counter() + us * 1e-6
        while time.perf_counter() < end:
            pass

    fields = [f"threads={threads}"]
    fields.append("spin_us=" + info.split("spin_us=")[1].split()[0])
    for gap in (int(g) for g in args.gaps.split(",")):
        for name, ws, n in (("router", router, 400), ("qkv", qkv, 96)):
            ts = []
            for i in range(n):
                busy(gap)
                t0 = time.perf_counter()
                ops.dense_linear_cpu(x, ws[i % len(ws)], None)
                ts.append(time.perf_counter() - t0)
            ts = sorted(ts[n // 4 :])
            med = ts[len(ts) // 2]
            gbps = ws[0].numel() * 2 / med / 1e9
            print(f"gap {gap:4d} us  {name:6s}  {med * 1e6:8.1f} us  {gbps:6.1f} GB/s")
            fields.append(
                f"{name}_us_gap{gap}={med * 1e6:.1f}"
                if name == "router"
                else f"{name}_gbps_gap{gap}={gbps:.1f}"
            )
    print("op_latency " + " ".join(fields))
    return 0


if __name__ == "__main__":
    sys.exit(main())
