"""Server configuration of the expert-slot cache: the flags, the cache size spec and its sizing.

The flags live in ``ExecMoe`` (patch ``0030-expert-cache-server-args``); this module turns
them into an :class:`ExpertCacheConfig` and resolves ``--expert-cache-size`` into a slot
count once the expert shape is known.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Optional


class MissPolicy(enum.IntEnum):
    """What the per-layer control step does with the ``m`` misses of a layer call.

    The values are the ``policy`` argument of ``sgl_kernel.expert_cache_control``.
    """

    QSTAR = 0  # q = round(m * B_P / B_H) fills, at least 1 (FreeToken Eq. 4); the rest on CPU
    FILL = 1  # every miss filled, like upstream's paged experts
    CPU = 2  # no fill ever: the cache keeps its load-time placement, misses run on CPU

    @classmethod
    def parse(cls, name: str) -> "MissPolicy":
        try:
            return cls[name.upper()]
        except KeyError:
            raise ValueError(
                f"--expert-cache-policy must be one of qstar, fill, cpu; got {name!r}"
            ) from None


_SIZE_RE = re.compile(
    r"^\s*(?P<num>\d+(\.\d*)?|\.\d+)\s*(?P<unit>%|[kKmMgGtT]i?[bB]|[bB])?\s*$"
)
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
            raise ValueError(
                f"--expert-cache-size slot count must be an integer; got {spec!r}"
            )
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
        cpu_threads: CPU expert-executor threads (0 = one per physical core).
        fill_gbps: B_P override in GB/s (None = profile at startup).
        cpu_gbps: B_H override in GB/s (None = profile at startup).
        max_fills: F, the most experts one layer call may fill (the victim candidates the
            single-pass selection finds, paper §4.1); None = the router's top-k x 2.
        record_routing: JSONL path to append every layer call's routing to (None = off).
    """

    size: CacheSize = CacheSize()
    policy: MissPolicy = MissPolicy.QSTAR
    cpu_threads: int = 0
    fill_gbps: Optional[float] = None
    cpu_gbps: Optional[float] = None
    max_fills: Optional[int] = None
    record_routing: Optional[str] = None

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
        return cls(
            size=CacheSize.parse(getattr(moe, "expert_cache_size", None)),
            policy=MissPolicy.parse(getattr(moe, "expert_cache_policy", "qstar")),
            cpu_threads=threads,
            fill_gbps=getattr(moe, "expert_cache_fill_gbps", None),
            cpu_gbps=getattr(moe, "expert_cache_cpu_gbps", None),
            max_fills=max_fills,
            record_routing=getattr(moe, "expert_cache_record_routing", None),
        )
