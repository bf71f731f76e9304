"""When a prefill pass streams whole layers instead of taking the decode path's q* split.

FreeToken §3.1 ("Full-layer double buffering"): prefill routes so many tokens that the union of
a layer's routed experts is nearly the whole layer (§2.1), so the layer's experts are streamed
whole into a full-layer buffer borrowed from the slot pool, ahead of the routing, while the
previous layer computes; §5.3 ("Pipelined prefill") measures each chunk at the time to stream
the pool once. This module is the cost model that picks, per prefill pass, one of

* ``TWO_BUFFERS``: two full-layer buffers, the copy of layer l+1 behind the compute of layer l;
* ``ONE_BUFFER``: one buffer, so each layer's copy waits for the previous layer's compute
  (stream, then compute);
* ``SPLIT``: the decode path (hits, ``q`` fills, the CPU executor for the other misses).

It is pure arithmetic on the bandwidth profile (no tensors); :mod:`prefill_stream` runs the
chosen path.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Optional

MODES = ("auto", "off", "force")


def parse_mode(value: Optional[str]) -> str:
    """``--expert-cache-prefill-stream``: auto (the cost model decides; on a CPU-only machine
    off), off, force (stream every prefill pass the pool can hold a layer for).

    Raises:
        ValueError: another value; the message lists the choices.
    """
    mode = "auto" if value is None else str(value).strip().lower()
    if mode not in MODES:
        raise ValueError(
            f"--expert-cache-prefill-stream must be one of {', '.join(MODES)}; got {value!r}"
        )
    return mode


class PrefillPath(enum.Enum):
    TWO_BUFFERS = "two_buffers"
    ONE_BUFFER = "one_buffer"
    SPLIT = "split"


@dataclass(frozen=True)
class PathTimes:
    """Modelled seconds per MoE layer of each path (:func:`path_times`); ``inf`` = impossible."""

    two_buffers: float
    one_buffer: float
    split: float

    def of(self, path: PrefillPath) -> float:
        return getattr(self, path.value)


def expected_distinct(routed: int, num_experts: int) -> float:
    """Expected distinct experts among ``routed`` (token, expert) entries of one layer when the
    router spreads them uniformly over ``num_experts``: ``E * (1 - (1 - 1/E)^r)``. Prefill's
    routing is close to this (§2.1: the working set turns dense); skewed routing gives fewer."""
    if routed <= 0 or num_experts <= 0:
        return 0.0
    return (
        num_experts * -math.expm1(routed * math.log1p(-1.0 / num_experts))
        if num_experts > 1
        else 1.0
    )


def path_times(
    *,
    routed: int,
    num_experts: int,
    expert_bytes: int,
    fill_gbps: float,
    cpu_gbps: float,
    max_fills: int,
    resident: int = 0,
    compute_s: float = 0.0,
) -> PathTimes:
    """Modelled time per MoE layer of a prefill batch for each path.

    With ``S`` = ``expert_bytes``, ``E`` = ``num_experts``, ``h`` = ``resident`` (experts of the
    layer already in slots), ``r`` = ``routed`` (the batch's routed entries, tokens x top-k),
    ``B_P`` / ``B_H`` in bytes/s and ``C`` = ``compute_s`` (the device's time for the layer's
    routed entries, common to every path; 0 = unknown):

    * streaming moves the layer's ``E - h`` non-resident experts over the link (the resident
      ones are copied device to device, counted free):  ``X = (E - h) S / B_P``;
      two buffers overlap it with the previous layer's compute: ``T_2 = max(X, C)``;
      one buffer serializes them: ``T_1 = X + C``.
    * the decode path's split (§3.2, Eq. 1-4): ``d = E (1 - (1 - 1/E)^r)`` distinct experts
      (:func:`expected_distinct`), ``m = d (1 - h / E)`` misses, ``q = min(F, m B_P / B_H)``
      fills (Eq. 4, capped by ``--expert-cache-max-fills`` F); the CPU executes the other
      ``m - q`` experts and their ``r (m - q) / d`` routed entries. Fills and CPU read the same
      host memory, which gives at most ``B_H`` (Eq. 2-3: the CPU gets ``B_H - B_P`` while the
      link is busy, all of ``B_H`` after), so the host side takes ``max(q S / B_P, m S / B_H)``;
      and B_H is measured at one token per expert read, so each CPU entry costs at least
      ``S / B_H`` in that model:  ``T_s = max(q S / B_P, m S / B_H, r (m - q) / d * S / B_H, C)``.

    The last term makes the split grow with the routed count while streaming does not: streaming
    wins once ``r (m - q) / d * S / B_H > (E - h) S / B_P``, i.e. (``h = 0``, ``m = d``) when
    ``r (1 - q / d) > E B_H / B_P`` routed entries (:func:`stream_threshold`): on the paper's
    5090 (E = 256, F = 16, B_P = 52.7 GB/s, B_H ~ 80 GB/s) 422 entries, 53 tokens at top-8
    (27 tokens at B_H = 40, 104 at B_H = 160).
    (The executor's prefill tiles share weight rows across a few tokens, so the real CPU time
    per entry is below ``S / B_H``; the formula then streams a little earlier than optimal.)

    Args:
        routed: routed (token, expert) entries of the batch in one layer (tokens x top-k).
        num_experts: routed experts per layer (E).
        expert_bytes: bytes of one complete expert, every bank (S).
        fill_gbps, cpu_gbps: B_P and B_H in GB/s (the bandwidth profile); not finite or <= 0:
            streaming is not modelled (every stream time is ``inf``).
        max_fills: F, the most fills of one decode-path layer call.
        resident: experts of the layer already in slots (0..E).
        compute_s: device seconds for the layer's routed entries (0 = left out).

    Returns:
        The three times in seconds.
    """
    E, S = num_experts, float(expert_bytes)
    h = min(max(resident, 0), E)
    bp, bh = fill_gbps * 1e9, cpu_gbps * 1e9
    if not (math.isfinite(bp) and bp > 0 and math.isfinite(bh) and bh > 0):
        return PathTimes(math.inf, math.inf, compute_s)
    x = (E - h) * S / bp
    d = expected_distinct(routed, E)
    m = d * (1.0 - h / E)
    q = min(float(max_fills), m * bp / bh, m)
    cpu_entries = routed * (m - q) / d if d > 0 else 0.0
    split = max(q * S / bp, m * S / bh, cpu_entries * S / bh, compute_s)
    return PathTimes(max(x, compute_s), x + compute_s, split)


def choose_prefill_path(
    times: PathTimes, *, spare_slots: int, num_experts: int, force: bool = False
) -> PrefillPath:
    """The fastest path the slot pool allows: two buffers need ``2 E`` spare slots, one buffer
    ``E``; the split always runs. ``force`` (``--expert-cache-prefill-stream force``) takes the
    most buffers the pool allows whatever the times say (the split only when not even one layer
    fits).

    Ties go to the split (it evicts nothing), then to two buffers: ``T_2 = max(X, C) <= X + C =
    T_1`` always, and they tie only when ``X = 0`` (every expert resident: the split ties too)
    or ``C = 0``, i.e. before any compute time was measured (:func:`path_times`), where the
    real ``C > 0`` makes two buffers the faster."""
    if force:
        if spare_slots >= 2 * num_experts:
            return PrefillPath.TWO_BUFFERS
        return PrefillPath.ONE_BUFFER if spare_slots >= num_experts else PrefillPath.SPLIT
    allowed = [PrefillPath.SPLIT]
    if spare_slots >= 2 * num_experts:
        allowed.append(PrefillPath.TWO_BUFFERS)
    if spare_slots >= num_experts:
        allowed.append(PrefillPath.ONE_BUFFER)
    return min(allowed, key=times.of)  # the first of equal times: the order above


def stream_threshold(
    *,
    num_experts: int,
    expert_bytes: int,
    fill_gbps: float,
    cpu_gbps: float,
    max_fills: int,
    resident: int = 0,
    limit: int = 1 << 24,
) -> Optional[int]:
    """The fewest routed entries for which streaming the layer (two buffers, ``compute_s`` 0)
    is modelled faster than the split (:func:`path_times`), found by bisection (the split's time
    grows with the routed count, streaming's does not); None if not below ``limit``."""
    kw = dict(
        num_experts=num_experts,
        expert_bytes=expert_bytes,
        fill_gbps=fill_gbps,
        cpu_gbps=cpu_gbps,
        max_fills=max_fills,
        resident=resident,
    )

    def wins(r: int) -> bool:
        t = path_times(routed=r, **kw)
        return t.two_buffers < t.split

    if not wins(limit):
        return None
    lo, hi = 0, limit  # wins(hi), not wins(lo)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if wins(mid):
            hi = mid
        else:
            lo = mid
    return hi
