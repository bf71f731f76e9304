"""Server configuration of the expert-slot cache: the flags, the cache size spec and its sizing.

The flags live in ``ExecMoe`` (patch ``0030-expert-cache-server-args``); this module turns
them into an :class:`ExpertCacheConfig` and resolves ``--expert-cache-size`` into a slot
count once the expert shape is known (:func:`resolve_slots`).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Optional

import torch

from sglang.srt.layers.moe.expert_cache.control import MissPolicy
from sglang.srt.layers.moe.expert_cache.prefill_plan import parse_mode

logger = logging.getLogger(__name__)


_SIZE_RE = re.compile(r"^\s*(?P<num>\d+(\.\d*)?|\.\d+)\s*(?P<unit>%|[kKmMgGtT]i?[bB]|[bB])?\s*$")
_UNIT_BYTES = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


@dataclass(frozen=True)
class CacheSize:
    """A parsed ``--expert-cache-size``: exactly one of the fields is set (none = auto)."""

    slots: Optional[int] = None
    fraction: Optional[float] = None  # of the routed-expert pool, in (0, 1]
    bytes: Optional[int] = None

    @property
    def is_auto(self) -> bool:
        return self.slots is None and self.fraction is None and self.bytes is None

    @classmethod
    def parse(cls, spec: Optional[str]) -> "CacheSize":
        """Parse ``auto`` | ``N`` (slots) | ``P%`` (of the routed pool) | ``X GB/GiB/MB...``.

        Raises:
            ValueError: the spec is none of these, or a percentage is outside (0, 100].
        """
        if spec is None or str(spec).strip().lower() in ("", "auto"):
            return cls()
        m = _SIZE_RE.match(str(spec))
        if not m:
            raise ValueError(
                f"--expert-cache-size must be auto, a slot count (e.g. 256), a share of "
                f"the routed-expert pool (e.g. 25%) or a size (e.g. 4GB, 512MiB); got {spec!r}"
            )
        num, unit = float(m.group("num")), (m.group("unit") or "").lower()
        if unit == "%":
            if not 0 < num <= 100:
                raise ValueError(
                    f"--expert-cache-size percentage must be in (0, 100]; got {spec!r}"
                )
            return cls(fraction=num / 100.0)
        if unit:
            return cls(bytes=int(num * _UNIT_BYTES[unit]))
        if num != int(num):
            raise ValueError(f"--expert-cache-size slot count must be an integer; got {spec!r}")
        return cls(slots=int(num))

    def resolve(self, pool_experts: int, expert_bytes: int, auto_slots: int) -> int:
        """The slot count, capped at the pool size.

        Args:
            pool_experts: routed experts in the whole model (MoE layers x experts per layer).
            expert_bytes: bytes of one complete expert across all banks.
            auto_slots: the count ``auto`` stands for (device-dependent, computed by the caller).
        """
        if self.slots is not None:
            slots = self.slots
        elif self.fraction is not None:
            slots = int(round(self.fraction * pool_experts))
        elif self.bytes is not None:
            slots = self.bytes // expert_bytes
        else:
            slots = auto_slots
        return max(0, min(slots, pool_experts))


@dataclass(frozen=True)
class ExpertCacheConfig:
    """Everything the expert cache reads from the server arguments.

    Attributes:
        size: the requested cache size.
        policy: the miss policy.
        cpu_threads: CPU executor worker threads (0 = one per physical core but one; the
            thread waiting on a job works too).
        fill_gbps: B_P override in GB/s (None = profile at startup).
        cpu_gbps: B_H override in GB/s (None = profile at startup).
        max_fills: F, the most experts one layer call may fill (the victim candidates the
            single-pass selection finds, paper §4.1); None = the router's top-k x 2.
        record_routing: JSONL path to append every layer call's routing to (None = off).
        prefill_stream: ``auto``, ``off`` or ``force``: the prefill double buffer
            (:mod:`prefill_stream`; auto = the cost model of :mod:`prefill_plan` on CUDA, off
            on a CPU-only machine).
    """

    size: CacheSize = CacheSize()
    policy: MissPolicy = MissPolicy.QSTAR
    cpu_threads: int = 0
    fill_gbps: Optional[float] = None
    cpu_gbps: Optional[float] = None
    max_fills: Optional[int] = None
    record_routing: Optional[str] = None
    prefill_stream: str = "auto"

    @classmethod
    def from_server_args(cls, moe) -> "ExpertCacheConfig":
        """Build from the ``exec.moe`` namespace (``get_exec().moe``).

        Raises:
            ValueError: a flag value is invalid; the message names the flag.
        """
        for name in ("expert_cache_fill_gbps", "expert_cache_cpu_gbps"):
            value = getattr(moe, name, None)
            if value is not None and not value > 0:
                raise ValueError(
                    f"--{name.replace('_', '-')} must be a positive bandwidth in GB/s; got {value}"
                )
        threads = getattr(moe, "expert_cache_cpu_threads", 0) or 0
        if threads < 0:
            raise ValueError(
                f"--expert-cache-cpu-threads must be >= 0 (0 = one per core); got {threads}"
            )
        max_fills = getattr(moe, "expert_cache_max_fills", None)
        if max_fills is not None and max_fills < 1:
            raise ValueError(f"--expert-cache-max-fills must be >= 1; got {max_fills}")
        from sglang.srt.managers.memory_pressure import Reserve

        Reserve.parse(getattr(moe, "expert_cache_rebalance_reserve", None))  # fail at startup
        return cls(
            size=CacheSize.parse(getattr(moe, "expert_cache_size", None)),
            policy=MissPolicy.parse(getattr(moe, "expert_cache_policy", "qstar")),
            cpu_threads=threads,
            fill_gbps=getattr(moe, "expert_cache_fill_gbps", None),
            cpu_gbps=getattr(moe, "expert_cache_cpu_gbps", None),
            max_fills=max_fills,
            record_routing=getattr(moe, "expert_cache_record_routing", None),
            prefill_stream=parse_mode(getattr(moe, "expert_cache_prefill_stream", None)),
        )


def auto_slots(device: torch.device, expert_bytes: int) -> int:
    """What ``--expert-cache-size auto`` means on ``device``, in slots of ``expert_bytes``.

    CPU: 0 slots. The "device" is the host, so a copy of an expert is never faster to execute
    than the pool row itself; every expert runs from the pool.
    CUDA: half of the free device memory after the weights (the other half is left to KV pages
    and activations), in whole experts.
    """
    if device.type != "cuda":
        return 0
    free, _ = torch.cuda.mem_get_info(device)
    return int(free * 0.5) // expert_bytes


def resolve_slots(
    size: CacheSize, *, pool_experts: int, expert_bytes: int, top_k: int, device: torch.device
) -> int:
    """The slot count for ``size``: at least ``top_k`` slots, or 0 (every expert on the CPU).

    Args:
        size: the parsed ``--expert-cache-size``.
        pool_experts: routed experts in the model (MoE layers x experts per layer).
        expert_bytes: bytes of one complete expert across all banks.
        top_k: experts routed per token; fewer slots than one layer call's top-k are useless.
        device: where the slots live (for ``auto``).

    Raises:
        ValueError: an explicit size that gives fewer than ``top_k`` slots; the message says
            how many bytes ``top_k`` slots take.
    """
    slots = size.resolve(pool_experts, expert_bytes, auto_slots(device, expert_bytes))
    if slots >= top_k:
        return slots
    if not size.is_auto:
        raise ValueError(
            f"--expert-cache-size gives {slots} expert slots, fewer than one layer's "
            f"top-k ({top_k}); give at least {top_k} slots "
            f"({top_k * expert_bytes / 1e6:.1f} MB) or leave it at auto"
        )
    if slots > 0:
        logger.warning(
            "Expert cache: only %d slots fit (top-k is %d); every expert runs on the CPU",
            slots,
            top_k,
        )
    return 0
