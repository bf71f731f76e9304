"""Boot-time measurement of B_P and B_H, cached per machine and model.

* B_P: expert-fill bandwidth, host pool -> cache slots, in GB/s. Pinned host -> device copy
  on a GPU; on a CPU-only machine the slots are host memory too and B_P is that copy.
* B_H: CPU expert-kernel bandwidth, in GB/s of expert weights read while executing experts
  from the host pool at decode batch 1.

They set the fill share of the misses, q* = round(m * B_P / B_H) (FreeToken §3.2, Eq. 4).
Both are measured on the deployed expert shapes with the deployed thread count
(:mod:`bandwidth_probe`), logged, and cached in ``$XDG_CACHE_HOME/sglang/expert_cache_bandwidth.json``
(``~/.cache`` by default; ``SGLANG_EXPERT_CACHE_PROFILE_PATH`` names another file), keyed by
host, CPU model, device, expert format and shape, and thread count.
``--expert-cache-fill-gbps`` / ``--expert-cache-cpu-gbps`` override either figure.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Bandwidths:
    fill_gbps: float  # B_P
    cpu_gbps: float  # B_H
    source: str  # "measured", "cached", "flags" or a mix such as "flags+measured"

    @property
    def fill_ratio(self) -> float:
        """B_P / B_H: the share of misses filled (paper Eq. 4)."""
        return self.fill_gbps / self.cpu_gbps


def profile_path() -> Path:
    env = os.environ.get("SGLANG_EXPERT_CACHE_PROFILE_PATH")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "sglang" / "expert_cache_bandwidth.json"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def profile_key(device: torch.device, fmt_label: str, shape: str, threads: int) -> str:
    dev = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return "|".join([platform.node(), _cpu_model(), dev, fmt_label, shape, f"threads={threads}"])


def time_gbps(fn: Callable[[], int], budget_s: float = 0.1, min_reps: int = 3) -> float:
    """Run ``fn`` (which returns the bytes it moved) repeatedly for about ``budget_s``
    seconds after one warm-up call; return the best observed GB/s (10^9 bytes/s)."""
    fn()
    best = 0.0
    deadline = time.perf_counter() + budget_s
    reps = 0
    while reps < min_reps or time.perf_counter() < deadline:
        t0 = time.perf_counter()
        nbytes = fn()
        dt = time.perf_counter() - t0
        if dt > 0:
            best = max(best, nbytes / dt / 1e9)
        reps += 1
    return best


def resolve_bandwidths(
    *,
    key: str,
    fill_override: Optional[float],
    cpu_override: Optional[float],
    measure_fill: Callable[[], float],
    measure_cpu: Callable[[], float],
) -> Bandwidths:
    """B_P and B_H from the flags, else the per-machine cache, else a measurement (which is
    then cached). A cache file that cannot be read or written is ignored with a warning."""
    if fill_override is not None and cpu_override is not None:
        return Bandwidths(fill_override, cpu_override, "flags")
    path = profile_path()
    table = {}
    try:
        table = json.loads(path.read_text())
    except FileNotFoundError:
        pass
    except (OSError, ValueError) as e:
        logger.warning("Expert cache: ignoring unreadable %s (%s)", path, e)
    cached = table.get(key)
    if cached:
        fill, cpu, source = cached["fill_gbps"], cached["cpu_gbps"], "cached"
    else:
        fill, cpu, source = measure_fill(), measure_cpu(), "measured"
        table[key] = {"fill_gbps": fill, "cpu_gbps": cpu, "time": time.time()}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(table, indent=1, sort_keys=True))
            tmp.replace(path)
        except OSError as e:
            logger.warning("Expert cache: could not cache bandwidths in %s (%s)", path, e)
    if fill_override is not None:
        fill, source = fill_override, "flags+" + source
    if cpu_override is not None:
        cpu, source = cpu_override, "flags+" + source
    return Bandwidths(float(fill), float(cpu), source)
