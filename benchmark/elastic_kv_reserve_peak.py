"""Peak resident memory of the first KV resize's move into reserved mappings (issue 15).

Each variant runs in a fresh process: it allocates a KV pool laid out as upstream's
``MHATokenToKVPool._create_buffers_normal`` does (one tensor per layer holding K and V as its
two halves, bf16), then moves it into :class:`HostKVBacking` and reads ``VmHWM`` (peak RSS,
``/proc/self/status``) before and after:

- ``layerwise``: the pool's own lists are handed over (what ``ElasticKV.reserve`` does): each
  layer's old allocation is freed before the next layer is copied;
- ``whole`` (the baseline: the move before 2026-12-05): the caller keeps the old tensors until
  every layer is copied, so the pool is held twice at the peak.

Last line: ``elastic_kv_reserve_peak pool_mb=... whole_extra_mb=... layerwise_extra_mb=...
layer_mb=... extra_ratio=...`` (extra = peak RSS during the move minus RSS before it).

    .venv/bin/python benchmark/elastic_kv_reserve_peak.py --layers 8 --tokens 65536
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys


def _kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _child(variant: str, layers: int, tokens: int, heads: int, dim: int) -> None:
    import torch

    from sglang.srt.mem_cache.elastic_kv.backing import HostKVBacking

    rows = tokens + 1
    fused = [torch.ones(2, rows, heads, dim, dtype=torch.bfloat16) for _ in range(layers)]
    k, v = [f[0] for f in fused], [f[1] for f in fused]
    del fused
    before = _kb("VmRSS")
    if variant == "layerwise":
        HostKVBacking(k, v, rows)
    else:
        HostKVBacking(list(k), list(v), rows)  # the caller's lists keep the old tensors
    print(f"{before} {_kb('VmHWM')}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    shape = (a.layers, a.tokens, a.heads, a.dim)
    if a.child:
        _child(a.child, *shape)
        return
    extra = {}
    for variant in ("whole", "layerwise"):
        out = subprocess.run(
            [sys.executable, __file__, "--child", variant]
            + [f"--{n}={x}" for n, x in zip(("layers", "tokens", "heads", "dim"), shape)],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.split()
        before, peak = int(out[-2]), int(out[-1])
        extra[variant] = (peak - before) / 1024
        print(f"{variant:9s} RSS before {before / 1024:8.1f} MB, peak {peak / 1024:8.1f} MB")
    layer_mb = 2 * (a.tokens + 1) * a.heads * a.dim * 2 / 2**20
    pool_mb = a.layers * layer_mb
    print(
        f"elastic_kv_reserve_peak pool_mb={pool_mb:.1f} whole_extra_mb={extra['whole']:.1f} "
        f"layerwise_extra_mb={extra['layerwise']:.1f} layer_mb={layer_mb:.1f} "
        f"extra_ratio={extra['layerwise'] / max(extra['whole'], 1e-9):.3f} "
        f"loadavg={os.getloadavg()[0]:.2f}"
    )


if __name__ == "__main__":
    main()
