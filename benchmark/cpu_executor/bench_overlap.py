#!/usr/bin/env python
"""Does the host's per-step Python hide behind a GIL-free CPU decode pass? (issue 18)

A CPU decode step is a memory-bound pass on the pool's threads (the GIL released) plus ~2 ms of
scheduler, sampler and logits-processor Python. An overlapped scheduler would run step i's
Python while a forward thread runs pass i + 1. This measures that trade on this machine with
the fork's ``dense_linear_cpu``: a "pass" reads ``--mb`` MB of bf16 weights (one matrix, or
``--ops`` matrices one call each), the "Python" is a busy loop of ``--python-ms`` holding the
GIL. Per round, ms per step of:

* ``pass``: the pass alone (back to back);
* ``serial``: pass, then Python (today's loop);
* ``overlapped``: a forward thread runs pass i + 1 while the main thread runs step i's Python.

``overlapped`` < ``serial`` means overlap pays; on a machine whose cores are all the pool's, the
Python thread takes a core from the pass. Last line::

    overlap threads=N python_ms=P ops=K pass_ms=... serial_ms=... overlapped_ms=...
    overlap_gain=<serial / overlapped>
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time

import torch


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--mb", type=int, default=587, help="weight MB one pass reads (the slice: 589)")
    p.add_argument("--ops", type=int, default=1, help="dense_linear_cpu calls per pass")
    p.add_argument("--python-ms", type=float, default=2.0, help="busy Python per step")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args(argv)
    import sgl_kernel_fork  # noqa: F401  (registers torch.ops.sgl_kernel)

    ops = torch.ops.sgl_kernel
    threads = ops.expert_pool_set_threads(0)
    x = torch.randn(1, 2048, dtype=torch.bfloat16)
    rows = args.mb * (1 << 20) // (2 * 2048) // args.ops
    ws = [torch.randn(rows, 2048, dtype=torch.bfloat16) for _ in range(args.ops)]

    def one_pass() -> None:
        for w in ws:
            ops.dense_linear_cpu(x, w, None)

    def python(ms: float) -> None:
        end = time.perf_counter() + ms * 1e-3
        while time.perf_counter() < end:
            pass

    def alone(n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            one_pass()
        return (time.perf_counter() - t0) / n * 1e3

    def serial(n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            one_pass()
            python(args.python_ms)
        return (time.perf_counter() - t0) / n * 1e3

    def overlapped(n: int) -> float:
        go = [threading.Event() for _ in range(n)]
        done = [threading.Event() for _ in range(n)]

        def forward() -> None:
            for i in range(n):
                go[i].wait()
                one_pass()
                done[i].set()

        th = threading.Thread(target=forward)
        th.start()
        t0 = time.perf_counter()
        go[0].set()
        for i in range(n):
            done[i].wait()
            if i + 1 < n:
                go[i + 1].set()  # pass i + 1 runs while step i's Python does
            python(args.python_ms)
        th.join()
        return (time.perf_counter() - t0) / n * 1e3

    one_pass()
    res = {"pass": [], "serial": [], "overlapped": []}
    for r in range(args.rounds):
        for name, fn in (("pass", alone), ("serial", serial), ("overlapped", overlapped)):
            res[name].append(fn(args.steps))
        print(
            f"round {r}: " + "  ".join(f"{k} {v[-1]:.2f}" for k, v in res.items()) + " ms/step",
            flush=True,
        )
    med = {k: statistics.median(v) for k, v in res.items()}
    print(
        f"overlap threads={threads} python_ms={args.python_ms} ops={args.ops} "
        f"pass_ms={med['pass']:.2f} serial_ms={med['serial']:.2f} "
        f"overlapped_ms={med['overlapped']:.2f} overlap_gain={med['serial'] / med['overlapped']:.3f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
