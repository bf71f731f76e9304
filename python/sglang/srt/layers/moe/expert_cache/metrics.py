"""Prometheus export of the expert cache's counters (``--enable-metrics``).

Counters ``sglang:expert_cache_{hits,misses,fills,cpu_experts,calls,rebalances,
rebalance_failures,auto_rebalances,pressure_rebalances,bandwidth_updates}_total`` and gauges ``sglang:expert_cache_{slots,
occupied_slots,fill_ratio,slot_bytes,last_rebalance_ms,live_fill_gbps,live_cpu_gbps,
fills_per_layer_call}``, from
:meth:`ExpertSlotCache.snapshot`. Layer calls replayed from a CUDA graph run no Python, so the
scheduler's decode log also publishes them (patch ``0033-expert-cache-metrics-at-decode-log``).
"""

from __future__ import annotations

import math
from typing import Callable, Dict, Optional

import torch

_COUNTERS = {
    "hits": "Routed experts found in a slot (distinct per layer call)",
    "misses": "Routed experts not in a slot (distinct per layer call)",
    "fills": "Experts copied host -> slot",
    "cpu_experts": "Experts executed on the CPU from the host pool",
    "calls": "MoE layer calls through the expert cache",
    "rebalances": "Slot-pool resizes done by /rebalance_memory",
    "rebalance_failures": "Slot-pool resizes that failed and rolled back",
    "auto_rebalances": "Moves of --expert-cache-rebalance auto (KV pages <-> expert slots)",
    "pressure_rebalances": "Moves of --expert-cache-rebalance-reserve (shrinks when another "
    "process took memory, grows when it is free again)",
    "bandwidth_updates": "Re-derivations of B_P / B_H from the served layer calls",
}
_GAUGES = {
    "slots": ("sglang:expert_cache_slots", "Expert slots"),
    "occupied_slots": ("sglang:expert_cache_occupied_slots", "Slots holding an expert"),
    "fill_ratio": (
        "sglang:expert_cache_fill_ratio",
        "B_P / B_H, the share of misses filled under the qstar policy",
    ),
    "slot_bytes": ("sglang:expert_cache_slot_bytes", "Bytes of the expert slots"),
    "last_rebalance_ms": (
        "sglang:expert_cache_last_rebalance_ms",
        "Wall time of the last slot-pool resize, ms",
    ),
    "live_fill_gbps": (
        "sglang:expert_cache_live_fill_gbps",
        "B_P measured over the last decode layer calls, GB/s",
    ),
    "live_cpu_gbps": (
        "sglang:expert_cache_live_cpu_gbps",
        "B_H measured over the last decode layer calls, GB/s",
    ),
    "fills_per_call": (
        "sglang:expert_cache_fills_per_layer_call",
        "Mean q (fills) per MoE layer call since start",
    ),
}


def _metrics_enabled() -> bool:
    try:
        from sglang.srt.runtime_context import get_observability

        return bool(get_observability().enable_metrics)
    except Exception:  # no server (unit tests, benchmarks)
        return False


class ExpertCacheMetrics:
    """Publishes one cache's counters; does nothing unless the server runs with metrics.

    Args:
        snapshot: returns the cache's cumulative counters (:meth:`ExpertSlotCache.snapshot`:
            a device sync on a GPU).
        device: the cache's device (nothing is published inside a CUDA graph capture).
    """

    def __init__(self, snapshot: Callable[[], Dict[str, float]], device: torch.device):
        self._snapshot = snapshot
        self._device = device
        self._counters = None  # made on the first publish, when metrics are on
        self._gauges = None
        self._enabled: Optional[bool] = None
        self._last: Dict[str, float] = {}

    def publish(self) -> None:
        """Add the counters' growth since the last call and set the gauges."""
        if self._device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return
        if self._enabled is None:
            self._enabled = _metrics_enabled()
            if self._enabled:
                from prometheus_client import Counter, Gauge

                self._counters = {
                    k: Counter(f"sglang:expert_cache_{k}_total", doc)
                    for k, doc in _COUNTERS.items()
                }
                self._gauges = {
                    k: Gauge(name, doc, multiprocess_mode="mostrecent")
                    for k, (name, doc) in _GAUGES.items()
                }
        if not self._enabled:
            return
        snap = self._snapshot()
        for k, c in self._counters.items():
            delta = snap[k] - self._last.get(k, 0)
            if delta > 0:
                c.inc(delta)
        for k in ("slots", "occupied_slots", "fill_ratio", "slot_bytes", "last_rebalance_ms"):
            self._gauges[k].set(snap[k])
        for k in ("live_fill_gbps", "live_cpu_gbps"):
            if math.isfinite(snap[k]):
                self._gauges[k].set(snap[k])
        self._gauges["fills_per_call"].set(snap["fills"] / max(1, snap["calls"]))
        self._last = dict(snap)
