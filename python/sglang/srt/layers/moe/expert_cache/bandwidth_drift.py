"""B_P and B_H re-derived while serving, from the layer calls' measured fill and CPU times.

The startup profile (:mod:`bandwidth`) fixes q* = round(m * B_P / B_H) (FreeToken §3.2, Eq. 4)
for the life of the server. Bandwidths move while serving: another process takes cores or
memory bandwidth (the CPU branch slows), the GPU is shared with a game (the link slows), a
profile cached on another boot no longer holds. FreeToken's issues #151 and #436 are a stale
startup profile choosing a split 10-30x slower than the alternative.

:class:`BandwidthDrift` keeps a running window of the last ``window`` decode layer calls: per
call the bytes filled host -> slot and the seconds the fill took, and the bytes of expert
weights the CPU executor read and the seconds it took. Every ``check_every`` calls it compares
the window's measured time of each branch with the time the current B_P / B_H predict for the
same bytes (``bytes / B``); when they depart by more than ``tolerance`` (the measured rate is
``> (1 + tolerance)`` or ``< 1 / (1 + tolerance)`` of the current one), that bandwidth becomes
the rate of its last ``check_every`` samples (bytes-weighted: sum of bytes / sum of
seconds), the window keeps only those, and the cache rewrites its ``B_P / B_H``. Detecting on
the whole window keeps noise from moving the figures; taking the new figure from the recent
samples alone makes a step change one update to the new rate, not a staircase of updates
while the window refills. The ratio is device data read by the control op (``live_fill_ratio``), so a
captured CUDA graph follows it with no recapture. A figure given by a flag
(``--expert-cache-fill-gbps`` / ``--expert-cache-cpu-gbps``) is never changed.

Only decode-sized calls are sampled (at most :data:`DECODE_SAMPLE_MAX_TOKENS` tokens): Eq. 4
assumes bandwidth-bound expert calls, which large prefill batches are not.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Deque, Optional, Tuple

from sglang.srt.layers.moe.expert_cache.bandwidth import Bandwidths

DECODE_SAMPLE_MAX_TOKENS = 32


@dataclass(frozen=True)
class DriftUpdate:
    """One re-derivation: the bandwidths before and after (GB/s) and the window it used."""

    before: Bandwidths
    after: Bandwidths
    window_calls: int

    def describe(self) -> str:
        b, a = self.before, self.after
        return (
            f"B_P {b.fill_gbps:.2f} -> {a.fill_gbps:.2f} GB/s, B_H {b.cpu_gbps:.2f} -> "
            f"{a.cpu_gbps:.2f} GB/s, q*/m {b.fill_ratio:.3f} -> {a.fill_ratio:.3f} "
            f"(measured over the last {self.window_calls} decode layer calls)"
        )


class _Window:
    """The last ``n`` (bytes, seconds) samples of one branch, with running sums."""

    def __init__(self, n: int):
        self.samples: Deque[Tuple[int, float]] = deque()
        self.n = n
        self.bytes = 0
        self.seconds = 0.0

    def add(self, nbytes: int, seconds: float) -> None:
        self.samples.append((nbytes, seconds))
        self.bytes += nbytes
        self.seconds += seconds
        if len(self.samples) > self.n:
            b, s = self.samples.popleft()
            self.bytes -= b
            self.seconds -= s

    def gbps(self) -> float:
        """The window's rate in GB/s (10^9 bytes/s); nan when it holds no time."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else math.nan

    def keep_last(self, n: int) -> float:
        """Drop all but the last ``n`` samples; the rate of those (GB/s)."""
        while len(self.samples) > n:
            b, s = self.samples.popleft()
            self.bytes -= b
            self.seconds -= s
        return self.gbps()


class BandwidthDrift:
    """The running window and the re-derivation rule (module docstring).

    Args:
        bandwidths: the startup B_P / B_H (GB/s), finite and > 0.
        adapt_fill / adapt_cpu: whether B_P / B_H may change (False for a figure set by flag).
        window: layer calls per branch in the window.
        check_every: layer calls between two comparisons.
        min_samples: samples a branch needs in its window before it is compared.
        tolerance: the relative departure that triggers a re-derivation (0.3 = 30%).

    Raises:
        ValueError: a bandwidth not finite and > 0, or a window/tolerance out of range.
    """

    def __init__(
        self,
        bandwidths: Bandwidths,
        *,
        adapt_fill: bool = True,
        adapt_cpu: bool = True,
        window: int = 256,
        check_every: int = 64,
        min_samples: int = 32,
        tolerance: float = 0.3,
    ):
        for name, v in (("B_P", bandwidths.fill_gbps), ("B_H", bandwidths.cpu_gbps)):
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be finite and > 0 GB/s, got {v}")
        if window < 1 or check_every < 1 or not 1 <= min_samples <= window or tolerance <= 0:
            raise ValueError(
                f"window {window}, check_every {check_every}, min_samples {min_samples} "
                f"(1..window) and tolerance {tolerance} (> 0) must be positive"
            )
        self.bandwidths = bandwidths
        self.adapt_fill, self.adapt_cpu = adapt_fill, adapt_cpu
        self.check_every, self.min_samples, self.tolerance = check_every, min_samples, tolerance
        self._fill = _Window(window)
        self._cpu = _Window(window)
        self._since_check = 0
        self.updates = 0

    @property
    def live_fill_gbps(self) -> float:
        """B_P measured over the window (GB/s; nan before any fill)."""
        return self._fill.gbps()

    @property
    def live_cpu_gbps(self) -> float:
        """B_H measured over the window (GB/s; nan before any CPU expert)."""
        return self._cpu.gbps()

    def observe(
        self, fill_bytes: int, fill_s: float, cpu_bytes: int, cpu_s: float
    ) -> Optional[DriftUpdate]:
        """Record one decode layer call; every ``check_every`` calls compare and maybe
        re-derive.

        Args:
            fill_bytes / fill_s: bytes copied host pool -> slots by the call, and the seconds
                the copy took (a call with no fill adds no fill sample).
            cpu_bytes / cpu_s: bytes of expert weights the CPU executor read, and its seconds.

        Returns:
            The :class:`DriftUpdate` when this call changed B_P or B_H, else None.
        """
        if fill_bytes > 0 and fill_s > 0:
            self._fill.add(fill_bytes, fill_s)
        if cpu_bytes > 0 and cpu_s > 0:
            self._cpu.add(cpu_bytes, cpu_s)
        self._since_check += 1
        if self._since_check < self.check_every:
            return None
        self._since_check = 0
        return self._check()

    def _departed(self, window: _Window, current: float) -> Optional[float]:
        """The new figure (GB/s) when ``window`` departs from ``current``, else None."""
        if len(window.samples) < self.min_samples:
            return None
        live = window.gbps()
        if not math.isfinite(live) or live <= 0:
            return None
        # measured time / predicted time of the window's bytes = current / live
        ratio = current / live
        if 1 / (1 + self.tolerance) <= ratio <= 1 + self.tolerance:
            return None
        recent = window.keep_last(min(self.check_every, len(window.samples)))
        return recent if math.isfinite(recent) and recent > 0 else live

    def _check(self) -> Optional[DriftUpdate]:
        b = self.bandwidths
        fill = self._departed(self._fill, b.fill_gbps) if self.adapt_fill else None
        cpu = self._departed(self._cpu, b.cpu_gbps) if self.adapt_cpu else None
        if fill is None and cpu is None:
            return None
        after = Bandwidths(
            fill if fill is not None else b.fill_gbps,
            cpu if cpu is not None else b.cpu_gbps,
            "live",
        )
        window = max(len(self._fill.samples), len(self._cpu.samples))
        self.bandwidths = after
        self.updates += 1
        return DriftUpdate(b, after, window)
