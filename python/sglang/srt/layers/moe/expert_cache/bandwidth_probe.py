"""The startup measurement of B_P and B_H on the deployed expert shapes (FreeToken §3.2, Eq. 4).

:func:`probe_bandwidths` times the two operations the q* split trades against each other, with
the deployed shapes, format and CPU thread count: an expert fill (``expert_bank_copy`` from the
host pool into device rows: B_P) and an expert executed on the CPU from the host pool at decode
batch 1 (``moe_experts_cpu``: B_H). :mod:`bandwidth` caches the figures per machine and model,
and the flags override them.
"""

from __future__ import annotations

import logging
import time
from typing import Optional, Sequence

import torch

from sglang.srt.layers.moe.expert_cache.bandwidth import (
    Bandwidths,
    profile_key,
    resolve_bandwidths,
    time_gbps,
)
from sglang.srt.layers.moe.expert_cache.banks import ExpertBanks
from sglang.srt.layers.moe.expert_cache.control import FillList, Stat, expert_bank_copy
from sglang.srt.layers.moe.expert_cache.executor_args import run_experts_cpu

logger = logging.getLogger(__name__)


def probe_bandwidths(
    host: ExpertBanks,
    *,
    device: torch.device,
    layer_ids: Sequence[int],
    num_experts: int,
    top_k: int,
    threads: int,
    fill_override: Optional[float] = None,
    cpu_override: Optional[float] = None,
) -> Bandwidths:
    """B_P and B_H in GB/s (10^9 bytes/s of expert weights): flags, else cached, else measured.

    Args:
        host: the filled host pool (pinned on CUDA, so fills run at full PCIe bandwidth).
        device: where the slots live.
        layer_ids: the MoE layers (rows ``layer * num_experts + e`` of the pool hold experts).
        num_experts: routed experts per layer (E).
        top_k: experts per token (K); each timed call moves ``min(K, pool)`` experts.
        threads: the CPU executor's thread count (part of the cache key).
        fill_override, cpu_override: ``--expert-cache-fill-gbps`` / ``--expert-cache-cpu-gbps``.

    Every timed call reads experts not read by the previous calls (a deterministic walk over
    the whole pool, layers interleaved), so the figures are memory, not last-level-cache,
    bandwidths on any pool larger than the LLC.
    """
    layers = sorted(layer_ids) or [0]
    pool = torch.tensor(
        [layer * num_experts + e for e in range(num_experts) for layer in layers],
        dtype=torch.int32,
    )
    n = min(top_k, pool.numel()) or 1
    walk = {"pos": 0}

    def next_probe() -> torch.Tensor:
        p = walk["pos"]
        walk["pos"] = (p + n) % max(1, pool.numel() - n + 1)
        return pool[p : p + n]

    nbytes = n * host.expert_bytes
    hidden_size = host.hidden_size

    def measure_fill() -> float:
        # Into scratch rows, so the load-time placement in the slots stays intact.
        scratch = ExpertBanks(host.format, host.hidden_size, host.intermediate_size, n, device)
        fills = FillList.allocate(n, device)
        fills.fill_dst.copy_(torch.arange(n, dtype=torch.int32))
        fills.counts[Stat.FILLS] = n

        def run() -> int:
            fills.fill_src.copy_(next_probe())
            expert_bank_copy(host.bank_list(), scratch.bank_list(), fills)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            return nbytes

        return time_gbps(run)

    def measure_cpu() -> float:
        x = torch.randn(1, hidden_size, dtype=torch.float32).to(host.format.act_dtype)
        # Explicit dtypes: model loading runs under torch.set_default_dtype(model dtype).
        w = torch.full((1, n), 1.0 / n, dtype=torch.float32)
        out = torch.empty(1, hidden_size, dtype=torch.float32)

        def run() -> int:
            rows = next_probe().view(1, n)
            run_experts_cpu(x, w, [rows], [host], out)
            return nbytes

        return time_gbps(run)

    key = profile_key(
        device, host.format.label, f"H{host.hidden_size}xI{host.intermediate_size}", threads
    )
    t0 = time.perf_counter()
    bw = resolve_bandwidths(
        key=key,
        fill_override=fill_override,
        cpu_override=cpu_override,
        measure_fill=measure_fill,
        measure_cpu=measure_cpu,
    )
    logger.info(
        "Expert cache: bandwidths %s in %.0f ms", bw.source, 1e3 * (time.perf_counter() - t0)
    )
    return bw
