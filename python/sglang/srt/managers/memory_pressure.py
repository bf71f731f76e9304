"""``--expert-cache-rebalance-reserve``: give memory back when another process takes it
(issue 15, "External pressure"; FreeToken §2.3: the GPU is shared with the desktop, a browser,
a game).

At the safe point where ``--expert-cache-rebalance auto`` runs (the end of
``process_input_requests``, patch 0036), at its cadence (every
:data:`memory_rebalance_auto.CHECK_EVERY` iterations, every iteration while idle), the server
reads the device's free memory through a :class:`FreeMemoryProbe` and compares it with the
reserve. When another process took memory (free below the reserve) it shrinks expert slots
first (they change speed, never results: the host pool is the source of truth), then KV pages
where they resize (the CPU server: ``mem_cache/elastic_kv``), down to the same floors as the
automatic mode; when memory is free again it grows back what it took, with hysteresis
(:class:`PressurePolicy`). Each move goes through
:func:`memory_rebalance.handle_rebalance_memory` (the explicit endpoint's dry run,
shrink-before-grow order, rollback and KV accounting check), is logged (one line: why,
before -> after) and counted (``ExpertSlotCache.pressure_rebalances``, exported as
``sglang:expert_cache_pressure_rebalances_total``).

The probes (:func:`default_probe`):

- CUDA: ``torch.cuda.mem_get_info`` (the driver's free and total bytes: what another process
  can still allocate). A shrink's memory returns to the driver only once it leaves PyTorch's
  caching allocator, so a CUDA shrink is followed by ``torch.cuda.empty_cache()``.
- CPU-only: the host's ``MemAvailable`` (``/proc/meminfo``) and ``MemTotal``. On the CPU
  server the "device" is the host: the expert slots and the KV pages are host memory, a shrink
  releases their tails with ``madvise`` (so ``MemAvailable`` rises by the bytes released), and
  what another process can take before the kernel swaps or kills is ``MemAvailable``, not
  ``MemFree`` (which leaves out the page cache the kernel reclaims).
- Tests: :class:`CapacityFileProbe`, selected by :data:`CAPACITY_FILE_ENV` (test only).

Where a shrink cannot return memory (CUDA slots, which are one allocation of the startup size
until the VMM reservation exists, with KV pages that do not resize: :func:`shrink_frees_memory`)
pressure mode stays off, with one warning: shrinking would only slow the server down; a
shrink whose answer says it released nothing is undone and turns pressure mode off. A refused
or failed move is retried after a cooldown that doubles with each failure in a row. The
bytes a move logs are the pools' sizes, except on the CPU: a slot row never filled since the
last shrink was never committed. There a shrink is sized by the resident pages it returns
(``ExpertSlotCache.slot_release_bytes``, ``mincore``): taking empty slots does not count as
memory given back, and the bytes it logs are the resident bytes released.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import Callable, Optional, Protocol, Tuple

from sglang.srt.layers.moe.expert_cache.config import _SIZE_RE, _UNIT_BYTES

logger = logging.getLogger(__name__)

# The reserve when --expert-cache-rebalance-reserve is not given: 5% of the device's total
# memory (CUDA: about 4 GB of an 80 GB H100, 1.2 GB of a 24 GB desktop card; CPU: 5% of
# MemTotal, where the kernel starts reclaiming hard anyway).
DEFAULT_RESERVE = "5%"

# Test only (named in upstream's SGLANG_TEST_* style, environ.py; read with os.environ like
# the fork's other elastic-memory variables): a file holding one integer, the bytes of a
# simulated device that this server's expert slots and KV pages share with free memory. The
# probe reports free = that - the server's slot and KV bytes now, so writing a smaller number
# is "another process took memory", and a shrink raises the free memory by what it released,
# as on a real device. Unset (always, outside tests): the real probe.
CAPACITY_FILE_ENV = "SGLANG_TEST_REBALANCE_CAPACITY_FILE"

# The size grammar of --expert-cache-size (expert_cache/config.py): a number with an optional
# decimal or binary unit, or a percentage; a bare number here is bytes.
_RESERVE_RE = _SIZE_RE


@dataclass(frozen=True)
class Reserve:
    """A parsed ``--expert-cache-rebalance-reserve``: ``nbytes`` (a size) or ``fraction`` (of
    the device's total memory, in [0, 1)); both None or zero means off."""

    nbytes: Optional[int] = None
    fraction: Optional[float] = None

    @classmethod
    def parse(cls, spec: Optional[str]) -> "Reserve":
        """``None`` (the default, :data:`DEFAULT_RESERVE`) | ``0`` (off) | a byte count |
        a size (``1GB``, ``512MiB``: decimal and binary units) | ``P%`` (of the total memory).

        Raises:
            ValueError: none of these, or a percentage of 100 or more; the message names the
                flag.
        """
        if spec is None or str(spec).strip() == "":
            spec = DEFAULT_RESERVE
        m = _RESERVE_RE.match(str(spec))
        if not m:
            raise ValueError(
                "--expert-cache-rebalance-reserve must be a size (e.g. 1GB, 512MiB, a byte "
                f"count), a share of the device's total memory (e.g. 5%) or 0 (off); got {spec!r}"
            )
        num, unit = float(m.group("num")), (m.group("unit") or "").lower()
        if unit == "%":
            if not 0 <= num < 100:
                raise ValueError(
                    f"--expert-cache-rebalance-reserve percentage must be in [0, 100); got {spec!r}"
                )
            return cls(fraction=num / 100.0)
        return cls(nbytes=int(num * (_UNIT_BYTES[unit] if unit else 1)))

    def resolve(self, total_bytes: int) -> int:
        """The reserve in bytes on a device of ``total_bytes``."""
        if self.fraction is not None:
            return int(self.fraction * max(0, total_bytes))
        return int(self.nbytes or 0)


@dataclass(frozen=True)
class MemoryReading:
    """One probe reading: ``free_bytes`` (what another process could still allocate) and
    ``total_bytes`` (the device's memory, for a percentage reserve), both bytes."""

    free_bytes: int
    total_bytes: int


class FreeMemoryProbe(Protocol):
    """What the pressure check reads: ``read()`` is a :class:`MemoryReading`, or None when the
    source cannot be read now (the check is skipped); ``name`` says which source (logs, GET)."""

    name: str

    def read(self) -> Optional[MemoryReading]: ...


class CudaProbe:
    """``torch.cuda.mem_get_info(device)``: the driver's free and total bytes."""

    name = "cuda mem_get_info"

    def __init__(self, device) -> None:
        self.device = device

    def read(self) -> Optional[MemoryReading]:
        import torch

        try:
            free, total = torch.cuda.mem_get_info(self.device)
        except Exception as e:  # noqa: BLE001 - a driver error skips the check, logged once
            if not getattr(self, "_warned", False):
                self._warned = True
                logger.warning("expert-cache rebalance reserve: cannot read free memory: %s", e)
            return None
        return MemoryReading(int(free), int(total))


class HostMemAvailableProbe:
    """``MemAvailable`` and ``MemTotal`` of ``path`` (``/proc/meminfo``, kB), in bytes; None
    when the file or a field is missing."""

    name = "host MemAvailable"

    def __init__(self, path: str = "/proc/meminfo") -> None:
        self.path = path

    def read(self) -> Optional[MemoryReading]:
        fields = {}
        try:
            with open(self.path) as f:
                for line in f:
                    key, _, rest = line.partition(":")
                    if key in ("MemAvailable", "MemTotal"):
                        fields[key] = int(rest.split()[0]) * 1024
        except (OSError, ValueError, IndexError):
            return None
        if "MemAvailable" not in fields or "MemTotal" not in fields:
            return None
        return MemoryReading(fields["MemAvailable"], fields["MemTotal"])


class CapacityFileProbe:
    """Test only (:data:`CAPACITY_FILE_ENV`): a simulated device of ``capacity`` bytes (the
    integer in ``path``, re-read at every check) shared by the server's pools and free memory:
    free = capacity - ``footprint()`` (the slot and KV bytes now, clamped at 0), total =
    capacity. None while the file is missing or holds no integer."""

    name = "test capacity file"

    def __init__(self, path: str, footprint: Callable[[], int]) -> None:
        self.path = path
        self.footprint = footprint

    def read(self) -> Optional[MemoryReading]:
        try:
            with open(self.path) as f:
                capacity = int(f.read().strip())
        except (OSError, ValueError):
            return None
        return MemoryReading(max(0, capacity - int(self.footprint())), capacity)


@dataclass(frozen=True)
class PressureObservation:
    """What :class:`PressurePolicy` sees at one check.

    Attributes:
        free_bytes: the probe's free memory, bytes.
        reserve_bytes: the reserve, bytes (> 0).
        slots: expert slots now; slot_floor: the fewest allowed (``memory_rebalance_auto.
            slot_floor``); slot_ceiling: the most a grow can reach now (``max_feasible_slots``);
            slot_bytes: bytes of one slot.
        kv_tokens: KV pool size, tokens; kv_floor: the smallest pool a shrink can reach now
            (``ElasticKV.floor``); kv_ceiling: the largest (``ElasticKV.max_tokens``);
            token_bytes: bytes of one KV token over all layers; page_size: tokens per page.
            Where KV pages do not resize: kv_floor = kv_ceiling = kv_tokens.
        slot_release: ``n -> bytes`` a shrink to ``n`` slots would return to the OS now (CPU
            slots: the resident pages of rows ``[n, slots)``, ``ExpertSlotCache.
            slot_release_bytes``; a row never filled since the last shrink holds nothing), or
            None: ``(slots - n) * slot_bytes`` (the pools' sizes).
    """

    free_bytes: int
    reserve_bytes: int
    slots: int
    slot_floor: int
    slot_ceiling: int
    slot_bytes: int
    kv_tokens: int = 0
    kv_floor: int = 0
    kv_ceiling: int = 0
    token_bytes: int = 1
    page_size: int = 1
    slot_release: Optional[Callable[[int], int]] = None

    def slot_release_bytes(self, n: int) -> int:
        """Bytes a shrink from :attr:`slots` to ``n`` slots returns (see ``slot_release``)."""
        if self.slot_release is not None:
            return int(self.slot_release(n))
        return max(0, self.slots - n) * self.slot_bytes


@dataclass(frozen=True)
class PressureMove:
    """A target for both pools (``slots``; ``kv_tokens``, a page multiple), the bytes it should
    free (``bytes_delta`` > 0, a shrink) or take (< 0, a grow), and ``reason`` (the log line)."""

    slots: int
    kv_tokens: int
    bytes_delta: int
    reason: str

    @property
    def shrink(self) -> bool:
        return self.bytes_delta > 0


@dataclass
class PressurePolicy:
    """The external-pressure rule, with hysteresis. Let ``margin = max(margin_fraction *
    reserve, min(min_margin_bytes, reserve))`` (:meth:`margin`): the band ``[reserve, reserve + margin)`` of free memory is
    where the policy moves nothing.

    At each check (:meth:`step`):

    1. Cooldown: for ``cooldown`` checks after a move nothing moves and the grow streak stays
       at zero (a probe may see a release late).
    2. Free below the reserve (another process took memory): shrink at once (fast attack) by
       the deficit plus half the margin, so free lands mid-band: expert slots first (whole
       slots, rounded up), down to ``slot_floor``; what is still missing from KV pages
       (rounded up to pages), down to ``kv_floor``. What was taken is owed
       (``owed_slots``, ``owed_kv_tokens``). At both floors nothing moves (the caller warns).
    3. Free at or above ``reserve + margin`` with something owed: after ``grow_after``
       consecutive such checks, grow back what is owed, KV pages first (they admit requests),
       then slots, using at most ``free - reserve - margin / 2`` bytes (whole pages and
       slots, rounded down, capped at the ceilings), so free stays mid-band after the grow.
       Never more than is owed: pressure mode gives back, it never takes memory the server
       did not have before.
    4. Otherwise (in the band, or nothing owed) the grow streak resets.

    No oscillation: a shrink leaves free about ``reserve + margin / 2`` (no shrink, no grow),
    a grow leaves it at least that (no shrink), and a grow needs ``grow_after`` checks in a
    row above the band, so readings that alternate around the reserve shrink once and then
    wait. :meth:`forget` (an explicit ``/rebalance_memory``: the operator's split is the new
    baseline) clears what is owed.

    Raises:
        ValueError: (at construction) ``grow_after`` < 1, a negative ``cooldown``, a
            ``margin_fraction`` outside [0, 1] or a negative ``min_margin_bytes``.
    """

    grow_after: int = 3
    cooldown: int = 2
    margin_fraction: float = 0.25
    min_margin_bytes: int = 64 << 20
    owed_slots: int = 0
    owed_kv_tokens: int = 0
    grow_streak: int = 0
    cooldown_left: int = 0
    at_floors: bool = False  # the last check was short of the reserve with nothing to shrink

    def __post_init__(self) -> None:
        problems = []
        if self.grow_after < 1:
            problems.append(f"grow_after must be >= 1 ({self.grow_after})")
        if self.cooldown < 0:
            problems.append(f"cooldown must be >= 0 ({self.cooldown})")
        if not 0 <= self.margin_fraction <= 1:
            problems.append(f"margin_fraction must be in [0, 1] ({self.margin_fraction})")
        if self.min_margin_bytes < 0:
            problems.append(f"min_margin_bytes must be >= 0 ({self.min_margin_bytes})")
        if problems:
            raise ValueError("PressurePolicy: " + "; ".join(problems))

    def margin(self, reserve_bytes: int) -> int:
        """The hysteresis band's width, bytes: ``margin_fraction`` of the reserve, at least
        ``min_margin_bytes`` (probe noise: a page cache or an allocator moves by megabytes)
        but never more than the reserve itself."""
        floor = min(self.min_margin_bytes, max(0, reserve_bytes))
        return max(int(self.margin_fraction * reserve_bytes), floor)

    def forget(self) -> None:
        """Nothing owed, streak and cooldown cleared (after an explicit rebalance)."""
        self.owed_slots = self.owed_kv_tokens = self.grow_streak = self.cooldown_left = 0

    def step(self, obs: PressureObservation) -> Optional[PressureMove]:
        """One check: the :class:`PressureMove` to apply now, or None. Call :meth:`applied`
        once the move succeeded (what is owed changes only then)."""
        self.at_floors = False
        if self.cooldown_left > 0:
            self.cooldown_left -= 1
            self.grow_streak = 0
            return None
        margin = self.margin(obs.reserve_bytes)
        if obs.free_bytes < obs.reserve_bytes:
            self.grow_streak = 0
            return self._shrink(obs, obs.reserve_bytes - obs.free_bytes + margin // 2)
        if obs.free_bytes >= obs.reserve_bytes + margin and (
            self.owed_slots or self.owed_kv_tokens
        ):
            self.grow_streak += 1
            if self.grow_streak >= self.grow_after:
                return self._grow(obs, obs.free_bytes - obs.reserve_bytes - margin // 2)
            return None
        self.grow_streak = 0
        return None

    def applied(self, obs: PressureObservation, slots: int, kv_tokens: int) -> None:
        """Book a move that succeeded, landing at ``slots`` and ``kv_tokens``: what a shrink
        took is owed, a grow pays it back; starts the cooldown."""
        self.owed_slots = max(0, self.owed_slots + obs.slots - slots)
        self.owed_kv_tokens = max(0, self.owed_kv_tokens + obs.kv_tokens - kv_tokens)
        self.grow_streak = 0
        self.cooldown_left = self.cooldown

    @staticmethod
    def _slots_to_take(obs: PressureObservation, need: int) -> Tuple[int, int]:
        """``(take, bytes)``: the fewest slots whose shrink returns ``need`` bytes (by
        :meth:`PressureObservation.slot_release_bytes`, which does not rise with the number
        kept), or every slot above the floor when that returns less; 0 slots when even that
        returns nothing (rows never filled: shrinking them would only slow the server)."""
        room = max(0, obs.slots - obs.slot_floor)
        if room == 0 or obs.slot_bytes <= 0:
            return 0, 0
        most = obs.slot_release_bytes(obs.slot_floor)
        if most <= 0:
            return 0, 0
        if most < need:
            return room, most
        lo, hi = 1, room  # the smallest take with release(slots - take) >= need
        while lo < hi:
            mid = (lo + hi) // 2
            if obs.slot_release_bytes(obs.slots - mid) >= need:
                hi = mid
            else:
                lo = mid + 1
        return lo, obs.slot_release_bytes(obs.slots - lo)

    def _shrink(self, obs: PressureObservation, need: int) -> Optional[PressureMove]:
        ps = max(1, obs.page_size)
        take, slot_freed = self._slots_to_take(obs, need)
        rest = need - slot_freed
        tokens = 0
        if rest > 0 and obs.token_bytes > 0:
            room = max(0, obs.kv_tokens - obs.kv_floor) // ps * ps
            tokens = min(room, -(-math.ceil(rest / obs.token_bytes) // ps) * ps)
        freed = slot_freed + tokens * obs.token_bytes
        if freed <= 0:
            self.at_floors = True
            return None
        return PressureMove(
            obs.slots - take,
            obs.kv_tokens - tokens,
            freed,
            f"free memory {_gb(obs.free_bytes)} below the reserve {_gb(obs.reserve_bytes)}",
        )

    def _grow(self, obs: PressureObservation, budget: int) -> Optional[PressureMove]:
        ps = max(1, obs.page_size)
        tokens = 0
        if self.owed_kv_tokens and obs.token_bytes > 0:
            tokens = min(
                self.owed_kv_tokens,
                budget // obs.token_bytes,
                max(0, obs.kv_ceiling - obs.kv_tokens),
            )
            tokens = tokens // ps * ps
        budget -= tokens * obs.token_bytes
        give = 0
        if self.owed_slots and obs.slot_bytes > 0:
            give = min(
                self.owed_slots,
                max(0, budget) // obs.slot_bytes,
                max(0, obs.slot_ceiling - obs.slots),
            )
        taken = tokens * obs.token_bytes + give * obs.slot_bytes
        if taken <= 0:
            self.grow_streak = 0
            return None
        return PressureMove(
            obs.slots + give,
            obs.kv_tokens + tokens,
            -taken,
            f"free memory {_gb(obs.free_bytes)} above the reserve {_gb(obs.reserve_bytes)} "
            f"for {self.grow_streak} checks",
        )


def _gb(n: int) -> str:
    """Bytes for a log line: GiB from 1 GiB up, else MiB."""
    return f"{n / 2**30:.2f} GiB" if abs(n) >= 2**30 else f"{n / 2**20:.1f} MiB"


# ---- the scheduler's side ------------------------------------------------------------------


@dataclass
class _PressureState:
    """Per-scheduler state (``scheduler._pressure_rebalance``); ``inactive`` says why pressure
    mode does not run (logged once)."""

    policy: PressurePolicy
    probe: Optional[FreeMemoryProbe] = None
    reserve: Reserve = Reserve()
    iterations: int = 0
    inactive: Optional[str] = None
    moves: int = 0
    failures: int = 0
    failure_streak: int = 0  # consecutive failed moves (the backoff's exponent)
    short_warned: bool = False
    last: Optional[MemoryReading] = None


def footprint_bytes(cache, el) -> int:
    """Bytes the server's elastic pools hold now: the expert slots
    (``ExpertSlotCache.slot_footprint_bytes``: resident pages on the CPU, the pool's size on
    CUDA) plus, where KV pages resize, the KV pool with its padding page (``ElasticKV.split``'s
    ``kv_bytes``)."""
    total = int(cache.slot_footprint_bytes()) if cache is not None else 0
    if el is not None:
        total += (int(el.size) + int(el.page_size)) * int(el.token_bytes)
    return total


def default_probe(cache, footprint: Callable[[], int]) -> FreeMemoryProbe:
    """The probe for ``cache``'s device: :class:`CapacityFileProbe` when
    :data:`CAPACITY_FILE_ENV` is set (tests), :class:`CudaProbe` on CUDA, else
    :class:`HostMemAvailableProbe`."""
    path = os.environ.get(CAPACITY_FILE_ENV)
    if path:
        return CapacityFileProbe(path, footprint)
    if getattr(cache.device, "type", "cpu") == "cuda":
        return CudaProbe(cache.device)
    return HostMemAvailableProbe()


def shrink_frees_memory(cache, el) -> bool:
    """Whether a pressure shrink can return memory to other processes: KV pages resize (the
    CPU server: their tail is released with ``madvise``), or the slots are host memory (a CPU
    slot shrink releases its tail). A CUDA slot shrink frees nothing yet
    (``ExpertSlotCache.resize_slots`` returns 0 bytes there: the slots are one allocation of
    the startup size until the VMM reservation exists), so with CUDA slots and no resizable KV
    a shrink would only slow the server down."""
    return el is not None or getattr(cache.device, "type", "cpu") != "cuda"


def _reserve_flag() -> Tuple[Optional[str], bool]:
    """``(--expert-cache-rebalance-reserve, --expert-cache-rebalance is not off)``."""
    try:
        from sglang.srt.runtime_context import get_exec

        moe = get_exec().moe
        return (
            getattr(moe, "expert_cache_rebalance_reserve", None),
            getattr(moe, "expert_cache_rebalance", "auto") != "off",
        )
    except Exception:  # noqa: BLE001 - no server arguments (unit tests): the defaults
        return None, True


def _state(scheduler) -> Optional[_PressureState]:
    """The scheduler's :class:`_PressureState` once pressure mode can run, else None (made at
    the first call after the expert cache is finalized; why it is inactive is kept, and logged
    where an operator would expect it to run)."""
    st = getattr(scheduler, "_pressure_rebalance", None)
    if st is not None:
        return None if st.inactive else st
    from sglang.srt.layers.moe.expert_cache.method import get_expert_slot_cache
    from sglang.srt.mem_cache.elastic_kv.scheduler_glue import elastic_kv_of

    cache = get_expert_slot_cache()
    if cache is None:
        scheduler._pressure_rebalance = _PressureState(PressurePolicy(), inactive="no expert cache")
        return None
    if not cache.finalized:
        return None
    st = _PressureState(PressurePolicy())
    scheduler._pressure_rebalance = st
    spec, enabled = _reserve_flag()
    if not enabled:
        st.inactive = "--expert-cache-rebalance off"
        return None
    st.reserve = Reserve.parse(spec)  # validated at startup (ExpertCacheConfig)
    if not (st.reserve.nbytes or st.reserve.fraction):
        st.inactive = "--expert-cache-rebalance-reserve 0"
        return None
    el, why = elastic_kv_of(scheduler)
    if not shrink_frees_memory(cache, el):
        st.inactive = (
            "a shrink would return no device memory: on CUDA the slot pool is one allocation "
            f"of the startup size, and KV pages do not resize ({why})"
        )
        logger.warning("expert-cache rebalance reserve is inactive: %s", st.inactive)
        return None

    def footprint() -> int:
        return footprint_bytes(cache, elastic_kv_of(scheduler)[0])

    st.probe = default_probe(cache, footprint)
    logger.info(
        "expert-cache rebalance reserve: %s (%s) of free memory kept for other processes; "
        "shrinks expert slots%s when it is taken",
        spec or DEFAULT_RESERVE,
        st.probe.name,
        ", then KV pages" if el is not None else f" only (KV pages do not resize: {why})",
    )
    return st


def owed_slots(scheduler) -> int:
    """Slots pressure mode took and has not given back (0 when it does not run): the automatic
    mode leaves them alone (``memory_rebalance_auto`` caps its slot ceiling by them), so what
    pressure gives back is what it took."""
    st = getattr(scheduler, "_pressure_rebalance", None)
    if st is None or st.inactive:
        return 0
    return int(st.policy.owed_slots)


def note_explicit_rebalance(scheduler) -> None:
    """After an explicit ``/rebalance_memory``: its split is the new baseline (nothing owed)."""
    st = getattr(scheduler, "_pressure_rebalance", None)
    if st is not None and not st.inactive:
        st.policy.forget()


def observe(scheduler, st: _PressureState, cache, el) -> Optional[PressureObservation]:
    """The :class:`PressureObservation` now, or None when the probe cannot be read or the
    reserve is 0 bytes on this device."""
    from sglang.srt.layers.moe.expert_cache.rebalance import max_feasible_slots
    from sglang.srt.managers.memory_rebalance_auto import slot_floor
    from sglang.srt.mem_cache.elastic_kv.scheduler_glue import reserve_tokens

    reading = st.probe.read()
    st.last = reading
    if reading is None:
        return None
    reserve = st.reserve.resolve(reading.total_bytes)
    if reserve <= 0:
        return None
    kv = dict(kv_tokens=0, kv_floor=0, kv_ceiling=0, token_bytes=1, page_size=1)
    if el is not None:
        kv = dict(
            kv_tokens=el.size,
            kv_floor=el.floor(reserve_tokens(scheduler)),
            kv_ceiling=el.max_tokens,
            token_bytes=el.token_bytes,
            page_size=el.page_size,
        )
    return PressureObservation(
        free_bytes=reading.free_bytes,
        reserve_bytes=reserve,
        slots=int(cache.num_slots),
        slot_floor=slot_floor(cache),
        slot_ceiling=max_feasible_slots(cache),
        slot_bytes=int(cache.host.expert_bytes),
        slot_release=cache.slot_release_bytes if cache.device.type == "cpu" else None,
        **kv,
    )


def pressure_split(scheduler) -> Optional[dict]:
    """The GET ``/rebalance_memory`` view (``"memory_pressure"``): the probe, the last reading,
    the reserve, what is owed and the move counts; ``{"active": False, "why": ...}`` when
    pressure mode does not run, None before its first check."""
    st = getattr(scheduler, "_pressure_rebalance", None)
    if st is None:
        return None
    if st.inactive:
        return {"active": False, "why": st.inactive}
    last = st.last
    return {
        "active": True,
        "probe": st.probe.name if st.probe else None,
        "free_bytes": last.free_bytes if last else None,
        "reserve_bytes": st.reserve.resolve(last.total_bytes) if last else None,
        "owed_slots": st.policy.owed_slots,
        "owed_kv_tokens": st.policy.owed_kv_tokens,
        "moves": st.moves,
        "failures": st.failures,
    }


def maybe_pressure_rebalance(scheduler, idle: bool) -> bool:
    """The pressure check at the scheduler's safe point (``memory_rebalance_auto.
    maybe_auto_rebalance`` calls it first): every :data:`memory_rebalance_auto.CHECK_EVERY`
    calls, and every call while ``idle`` (nothing runs or waits: the idle loop wakes about
    once a second). Returns whether a move was applied (auto then skips this iteration and
    starts its cooldown). Never raises."""
    try:
        st = _state(scheduler)
        if st is None:
            return False
        from sglang.srt.managers.memory_rebalance_auto import CHECK_EVERY

        st.iterations += 1
        if st.iterations % CHECK_EVERY and not idle:
            return False
        from sglang.srt.layers.moe.expert_cache.method import get_expert_slot_cache
        from sglang.srt.mem_cache.elastic_kv.scheduler_glue import elastic_kv_of

        cache = get_expert_slot_cache()
        el, _ = elastic_kv_of(scheduler)
        obs = observe(scheduler, st, cache, el)
        if obs is None:
            return False
        move = st.policy.step(obs)
        if move is None:
            if st.policy.at_floors and not st.short_warned:
                st.short_warned = True
                logger.warning(
                    "expert-cache rebalance reserve: free memory %s below the reserve %s, and "
                    "the slots (%d, floor %d) and KV pages (%d tokens, floor %d) are at their "
                    "floors",
                    _gb(obs.free_bytes),
                    _gb(obs.reserve_bytes),
                    obs.slots,
                    obs.slot_floor,
                    obs.kv_tokens,
                    obs.kv_floor,
                )
            return False
        st.short_warned = False
        return _apply(scheduler, st, cache, el, obs, move)
    except Exception:  # noqa: BLE001 - a bug must not end the scheduler
        logger.exception("expert-cache rebalance reserve failed")
        return False


def _handle(scheduler, slots: int, kv_tokens: Optional[int]):
    from sglang.srt.managers.io_struct import RebalanceMemoryReqInput
    from sglang.srt.managers.memory_rebalance import handle_rebalance_memory

    return handle_rebalance_memory(
        scheduler,
        RebalanceMemoryReqInput(expert_cache_size=str(slots), kv_tokens=kv_tokens),
        auto=True,
    )


def _apply(scheduler, st: _PressureState, cache, el, obs, move: PressureMove) -> bool:
    out = _handle(scheduler, move.slots, move.kv_tokens if el is not None else None)
    after = (int(cache.num_slots), el.size if el is not None else 0)
    if not out.success:
        # Back off before the next try (a refusal recomputed at apply time, a KV resize that
        # cannot commit, would otherwise rerun the dry run at every check), doubling up to 64x
        # the cooldown; one warning per run of failures, the rest at debug level.
        st.failures += 1
        st.failure_streak += 1
        st.policy.cooldown_left = max(1, st.policy.cooldown) * 2 ** min(st.failure_streak - 1, 6)
        log = logger.warning if st.failure_streak == 1 else logger.debug
        log(
            "expert-cache rebalance reserve: %s; slots %d -> %d, KV tokens %d -> %d refused or "
            "failed (%d): %s; the split is slots %d, KV tokens %d; next try in %d checks",
            move.reason,
            obs.slots,
            move.slots,
            obs.kv_tokens,
            move.kv_tokens,
            out.status_code,
            out.message,
            *after,
            st.policy.cooldown_left,
        )
        return False
    st.failure_streak = 0
    released = int(out.split.get("released_bytes") or 0)
    if move.shrink and released <= 0:
        # The shrink returned no memory (the pools could not release their tails here):
        # shrinking would only slow the server down. Undo it and stop checking.
        undo = _handle(scheduler, obs.slots, obs.kv_tokens if el is not None else None)
        st.inactive = (
            "a shrink returned no memory (slots %d -> %d, KV tokens %d -> %d; undone: %s)"
            % (obs.slots, after[0], obs.kv_tokens, after[1], "yes" if undo.success else "no")
        )
        logger.warning("expert-cache rebalance reserve is inactive: %s", st.inactive)
        return True
    if move.shrink and getattr(cache.device, "type", "cpu") == "cuda":
        import torch

        torch.cuda.empty_cache()  # the freed blocks return to the driver, for the other process
    st.policy.applied(obs, *after)
    st.moves += 1
    cache.pressure_rebalances = getattr(cache, "pressure_rebalances", 0) + 1
    cache.publish_metrics()
    logger.info(
        "expert-cache rebalance reserve: %s; slots %d -> %d, KV tokens %d -> %d, %s %s "
        "(%.1f ms; owed: %d slots, %d KV tokens)",
        move.reason,
        obs.slots,
        after[0],
        obs.kv_tokens,
        after[1],
        "released" if move.shrink else "took",
        _gb(released if move.shrink else -move.bytes_delta),
        float(out.split.get("time_ms") or 0.0),
        st.policy.owed_slots,
        st.policy.owed_kv_tokens,
    )
    return True
