"""``--expert-cache-rebalance auto``: move device memory between KV pages and expert slots
where demand is (issue 15, "Automatic mode"; FreeToken §3.3 "Runtime cache reconfiguration").

Two parts:

- :class:`AutoRebalancePolicy`, pure (no tensors, no scheduler): one
  :class:`Observation` per check in, a :class:`Move` or None out. Its docstring states the
  rule.
- :func:`maybe_auto_rebalance`, called by the scheduler at the safe point where explicit
  ``/rebalance_memory`` requests run (the end of ``process_input_requests``, patch 0036): every
  :data:`CHECK_EVERY` iterations it reads the observation off the scheduler (cheap: the head
  of the waiting queue, the running requests' remaining tokens, two allocator counters) and
  applies a move through :func:`memory_rebalance.handle_rebalance_memory`, the explicit
  endpoint's code path (same dry run, shrink-before-grow order, rollback, KV accounting
  check). Each move is logged (one line: why, before -> after) and counted
  (``ExpertSlotCache.auto_rebalances``, exported as ``sglang:expert_cache_auto_rebalances_total``).

Active only where both pools resize: the expert cache is on and finalized, and KV pages are
resizable (``mem_cache/elastic_kv``: the CPU server without the overlap scheduler). Elsewhere
(CUDA KV pools are not resizable yet) it logs one info line saying why, and never runs again.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Optional

logger = logging.getLogger(__name__)

# Scheduler iterations between two checks (a check walks the running batch once).
CHECK_EVERY = 4
# Upstream's cap on the decode tokens a new request reserves (PrefillAdder,
# ``SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION``); used when the constant cannot be imported.
_DEFAULT_CLIP_MAX_NEW_TOKENS = 4096


@dataclass(frozen=True)
class Observation:
    """What the policy sees at one check.

    Attributes:
        kv_blocked: waiting requests that could not be admitted for lack of KV pages (the
            waiting queue's length when its head does not fit the free KV tokens, else 0).
        retracted: requests waiting after a retraction for lack of KV pages.
        kv_free_fraction: free KV tokens (free + evictable prefix-cache tokens) / pool size,
            in [0, 1].
        kv_tokens: KV pool size, tokens (a page multiple).
        kv_floor: smallest pool a shrink can reach now, tokens (``ElasticKV.floor``).
        kv_ceiling: largest pool a grow can reach, tokens (``ElasticKV.max_tokens``).
        page_size: tokens per KV page.
        slots: expert slots now.
        slot_floor: fewest slots allowed: one layer's top-k, or two full layers (2 E) while
            prefill streaming is enabled.
        slot_ceiling: most slots auto gives back to (the startup slot count, or the target of
            the last explicit rebalance).
        tokens_per_slot: bytes of one expert slot / bytes of one KV token (over all layers):
            how many KV tokens one slot's memory holds.
        kv_shortfall: KV tokens the blocked waiting requests need beyond the free tokens (0
            when none is blocked): what would admit the whole queue.
        waiting: requests in the waiting queue (blocked or not).
        running: requests in the running batch (0 with ``waiting`` 0: the server is idle).
    """

    kv_blocked: int
    retracted: int
    kv_free_fraction: float
    kv_tokens: int
    kv_floor: int
    kv_ceiling: int
    page_size: int
    slots: int
    slot_floor: int
    slot_ceiling: int
    tokens_per_slot: float
    kv_shortfall: int = 0
    waiting: int = 0
    running: int = 0


@dataclass(frozen=True)
class Move:
    """A target for both pools: ``slots`` (expert slots) and ``kv_tokens`` (a page multiple);
    ``reason`` says why (for the log line)."""

    slots: int
    kv_tokens: int
    reason: str


@dataclass
class AutoRebalancePolicy:
    """The automatic rebalance rule, with hysteresis.

    At each check (:meth:`step`):

    1. Cooldown: for ``cooldown`` checks after a move the policy moves nothing and its
       streaks stay at zero.
    2. KV pressure (``kv_blocked > 0`` or ``retracted > 0``): the pressure streak grows and the
       calm streak resets. After ``grow_after`` consecutive pressure checks, KV grows by taking
       ``step_slots`` slots, or the slots the queue's ``kv_shortfall`` needs when more, but at
       most ``max_grow_share`` of the slots above the floor (fast attack, slow release: a burst
       is admitted in a few moves, slots come back ``step_slots`` at a time; fewer near the
       floor): the slots' bytes become KV tokens, rounded
       down to pages and capped at ``kv_ceiling``; only the slots those pages need are taken
       (``ceil(tokens / tokens_per_slot)``), so the move never adds bytes. Never below
       ``slot_floor``.
    3. KV calm (no pressure, an empty waiting queue and ``kv_free_fraction >= high_water``; the
       free tokens count the prefix cache's evictable ones, which finished requests leave
       behind during a burst, hence the empty queue): the calm streak grows and the pressure
       streak resets. After ``shrink_after`` consecutive calm checks, slots grow
       back by up to ``step_slots`` (all the way to ``slot_ceiling`` when the server is
       idle: nothing runs or waits; never above it), taking the KV pages their
       bytes need, rounded up to pages, as long as the pool stays at or above ``kv_floor`` and
       keeps a free fraction of at least ``low_water`` after the shrink (so a give-back cannot
       cause the pressure that would undo it).
    4. Otherwise (no pressure, and requests waiting or the free fraction below
       ``high_water``) both streaks reset.

    A move resets both streaks and starts the cooldown. Alternating demand (pressure, calm,
    pressure, ...) never completes a streak of ``grow_after >= 2`` or ``shrink_after >= 2``
    checks, so it moves nothing; sustained demand in one direction moves at most once per
    ``cooldown + grow_after`` (or ``+ shrink_after``) checks.

    Raises:
        ValueError: (at construction) a streak below 1, a negative cooldown, ``step_slots`` < 1,
            or water marks outside ``0 <= low_water < high_water <= 1``.
    """

    grow_after: int = 2
    shrink_after: int = 8
    cooldown: int = 4
    high_water: float = 0.5
    low_water: float = 0.25
    step_slots: int = 8
    max_grow_share: float = 0.5
    pressure_streak: int = 0
    calm_streak: int = 0
    cooldown_left: int = 0

    def __post_init__(self) -> None:
        problems = []
        if self.grow_after < 1 or self.shrink_after < 1:
            problems.append(
                f"grow_after and shrink_after must be >= 1 ({self.grow_after}, {self.shrink_after})"
            )
        if self.cooldown < 0:
            problems.append(f"cooldown must be >= 0 ({self.cooldown})")
        if self.step_slots < 1:
            problems.append(f"step_slots must be >= 1 ({self.step_slots})")
        if not 0 < self.max_grow_share <= 1:
            problems.append(f"max_grow_share must be in (0, 1] ({self.max_grow_share})")
        if not 0 <= self.low_water < self.high_water <= 1:
            problems.append(
                f"need 0 <= low_water < high_water <= 1 ({self.low_water}, {self.high_water})"
            )
        if problems:
            raise ValueError("AutoRebalancePolicy: " + "; ".join(problems))

    def _moved(self, move: Move) -> Move:
        self.pressure_streak = self.calm_streak = 0
        self.cooldown_left = self.cooldown
        return move

    def step(self, obs: Observation) -> Optional[Move]:
        """One check: the :class:`Move` to apply now, or None."""
        if self.cooldown_left > 0:
            self.cooldown_left -= 1
            self.pressure_streak = self.calm_streak = 0
            return None
        pressure = obs.kv_blocked > 0 or obs.retracted > 0
        if pressure:
            self.pressure_streak += 1
            self.calm_streak = 0
            if self.pressure_streak >= self.grow_after:
                move = self._grow_kv(obs)
                return self._moved(move) if move is not None else None
            return None
        if obs.waiting == 0 and obs.kv_free_fraction >= self.high_water:
            self.calm_streak += 1
            self.pressure_streak = 0
            if self.calm_streak >= self.shrink_after:
                move = self._grow_slots(obs)
                return self._moved(move) if move is not None else None
            return None
        self.pressure_streak = self.calm_streak = 0
        return None

    def _grow_kv(self, obs: Observation) -> Optional[Move]:
        ps = max(1, obs.page_size)
        spare = obs.slots - obs.slot_floor
        if spare <= 0 or obs.tokens_per_slot <= 0:
            return None
        wanted = math.ceil(max(0, obs.kv_shortfall) / obs.tokens_per_slot)
        take = max(self.step_slots, min(wanted, math.ceil(self.max_grow_share * spare)))
        take = min(take, spare)
        tokens = int(take * obs.tokens_per_slot) // ps * ps
        tokens = min(tokens, (obs.kv_ceiling - obs.kv_tokens) // ps * ps)
        if tokens <= 0:
            return None
        take = min(take, max(1, math.ceil(tokens / obs.tokens_per_slot)))
        why = (
            f"{obs.kv_blocked} request(s) waiting for KV pages"
            if obs.kv_blocked
            else f"{obs.retracted} request(s) retracted for KV pages"
        )
        return Move(obs.slots - take, obs.kv_tokens + tokens, f"KV grows: {why}")

    def _grow_slots(self, obs: Observation) -> Optional[Move]:
        ps = max(1, obs.page_size)
        idle = obs.waiting == 0 and obs.running == 0
        give = obs.slot_ceiling - obs.slots
        if not idle:
            give = min(self.step_slots, give)
        if give <= 0 or obs.tokens_per_slot <= 0:
            return None
        free = obs.kv_free_fraction * obs.kv_tokens
        # the most tokens a give-back may take: above the floor, and (free - t) >= low (kv - t)
        t_max = min(
            obs.kv_tokens - max(obs.kv_floor, ps),
            (free - self.low_water * obs.kv_tokens) / (1.0 - self.low_water),
        )
        give = min(give, max(0, int(t_max // obs.tokens_per_slot)))
        while give > 0:  # a step or two: the page rounding
            tokens = -(-math.ceil(give * obs.tokens_per_slot) // ps) * ps
            new_kv = obs.kv_tokens - tokens
            if new_kv >= max(obs.kv_floor, ps) and (free - tokens) >= self.low_water * new_kv:
                return Move(
                    obs.slots + give,
                    new_kv,
                    f"slots grow back: KV {100 * obs.kv_free_fraction:.0f}% free for "
                    f"{self.calm_streak} checks",
                )
            give -= 1
        return None


# ---- the scheduler's side ------------------------------------------------------------------


def slot_floor(cache) -> int:
    """Fewest slots auto leaves: one layer's top-k (fewer cannot hold one call's experts), or
    two full layers (``2 E``) while prefill streaming is enabled (the double buffer borrows
    them, ``prefill_plan.choose_prefill_path``)."""
    stream = getattr(cache, "prefill_stream", None)
    if stream is not None and getattr(stream, "enabled", False):
        return max(int(cache.top_k), 2 * int(cache.num_experts))
    return int(cache.top_k)


def _clip_max_new_tokens() -> int:
    try:
        from sglang.srt.managers.schedule_policy import CLIP_MAX_NEW_TOKENS

        return int(CLIP_MAX_NEW_TOKENS)
    except (ImportError, TypeError, ValueError):
        return _DEFAULT_CLIP_MAX_NEW_TOKENS


def _decode_need(req, clip: int) -> int:
    max_new = int(getattr(req.sampling_params, "max_new_tokens", None) or 0)
    return max(0, min(max_new - len(req.output_ids), clip))


def observe(scheduler, el, cache, slot_ceiling: int) -> Observation:
    """The :class:`Observation` of a scheduler at its safe point.

    ``kv_blocked`` follows upstream's admission test (``PrefillAdder``): the waiting queue's
    head needs its prompt plus ``min(max_new_tokens, CLIP_MAX_NEW_TOKENS)`` tokens, and the
    free tokens are the allocator's free plus the prefix cache's evictable tokens less the
    running requests' remaining decode tokens times ``new_token_ratio``; when the head does
    not fit, every waiting request counts, and ``kv_shortfall`` is what the whole queue needs
    beyond the free tokens (each request's need as the head's). ``retracted``: waiting requests whose
    ``is_retracted`` is set (upstream sets it when ``retract_decode`` put them back for lack
    of KV pages, and clears it when they are admitted again)."""
    from sglang.srt.mem_cache.elastic_kv.scheduler_glue import reserve_tokens

    waiting = list(getattr(scheduler, "waiting_queue", None) or [])
    size = el.size
    free = int(el.allocator.available_size()) + el.evictable_tokens()
    blocked = shortfall = 0
    if waiting:
        clip = _clip_max_new_tokens()
        ratio = float(getattr(scheduler, "new_token_ratio", 1.0) or 0.0)
        running = getattr(scheduler.running_batch, "reqs", None) or []
        reserved = sum(_decode_need(r, clip) for r in running if not r.finished()) * ratio
        head = waiting[0]
        need = len(head.origin_input_ids) + len(head.output_ids) + _decode_need(head, clip)
        if need > free - reserved:
            blocked = len(waiting)
            total = sum(
                len(r.origin_input_ids) + len(r.output_ids) + _decode_need(r, clip) for r in waiting
            )
            shortfall = int(max(0, total - (free - reserved)))
    retracted = sum(1 for r in waiting if getattr(r, "is_retracted", False))
    return Observation(
        kv_blocked=blocked,
        retracted=retracted,
        kv_free_fraction=min(1.0, max(0.0, free / size)) if size else 0.0,
        kv_tokens=size,
        kv_floor=el.floor(reserve_tokens(scheduler)),
        kv_ceiling=el.max_tokens,
        page_size=el.page_size,
        slots=int(cache.num_slots),
        slot_floor=slot_floor(cache),
        slot_ceiling=slot_ceiling,
        tokens_per_slot=cache.host.expert_bytes / el.token_bytes,
        kv_shortfall=shortfall,
        waiting=len(waiting),
        running=len(getattr(scheduler.running_batch, "reqs", None) or []),
    )


@dataclass
class _AutoState:
    """Per-scheduler state (``scheduler._auto_rebalance``): the policy, the iteration count,
    the slot count auto restores to; ``inactive`` says why auto does not run (logged once)."""

    policy: AutoRebalancePolicy
    slot_ceiling: int = 0
    iterations: int = 0
    inactive: Optional[str] = None
    moves: int = 0
    failures: int = 0


def _enabled(scheduler) -> bool:
    try:
        from sglang.srt.runtime_context import get_exec

        return getattr(get_exec().moe, "expert_cache_rebalance", "auto") == "auto"
    except Exception:  # noqa: BLE001 - no server arguments (unit tests): the default
        return True


def _state(scheduler) -> Optional[_AutoState]:
    """The scheduler's :class:`_AutoState` once auto can run, else None (made at the first
    call after the expert cache is finalized; the reason it is inactive is logged once)."""
    st = getattr(scheduler, "_auto_rebalance", None)
    if st is not None:
        return None if st.inactive else st
    from sglang.srt.layers.moe.expert_cache.method import get_expert_slot_cache
    from sglang.srt.mem_cache.elastic_kv.scheduler_glue import MAX_TOKENS_ENV, elastic_kv_of

    cache = get_expert_slot_cache()
    if cache is None:  # the model is loaded before the event loop: no cache now, none ever
        scheduler._auto_rebalance = _AutoState(
            policy=AutoRebalancePolicy(), inactive="no expert cache"
        )
        return None
    if not cache.finalized:
        return None
    st = _AutoState(policy=AutoRebalancePolicy(step_slots=max(1, int(cache.top_k))))
    scheduler._auto_rebalance = st
    if not _enabled(scheduler):
        st.inactive = "--expert-cache-rebalance off"
        return None
    el, why = elastic_kv_of(scheduler)
    if el is None:
        st.inactive = f"KV pages do not resize on this server ({why})"
        logger.info(
            "expert-cache rebalance auto is inactive: %s; /rebalance_memory still resizes the "
            "expert slots",
            st.inactive,
        )
        return None
    st.slot_ceiling = int(cache.num_slots)
    import os

    if el.backing is None and not os.environ.get(MAX_TOKENS_ENV):
        # room for the KV pool to take every slot above the floor (address space only: a
        # grow commits what it uses; ElasticKV.reserve maps max_tokens at the first resize)
        spare = max(0, st.slot_ceiling - slot_floor(cache)) * cache.host.expert_bytes
        extra = spare // el.token_bytes // el.page_size * el.page_size
        el.max_tokens = max(el.max_tokens, el.size + extra)
    logger.info(
        "expert-cache rebalance auto: KV %d tokens (up to %d), %d slots (floor %d); checks "
        "every %d iterations",
        el.size,
        el.max_tokens,
        cache.num_slots,
        slot_floor(cache),
        CHECK_EVERY,
    )
    return st


def note_explicit_rebalance(scheduler) -> None:
    """After an explicit ``/rebalance_memory``: its slot count becomes the one auto restores
    to, and the policy starts a cooldown (an operator's split is not undone at once); the
    pressure mode owes nothing any more (``memory_pressure.note_explicit_rebalance``)."""
    from sglang.srt.managers.memory_pressure import note_explicit_rebalance as pressure_note

    pressure_note(scheduler)
    st = getattr(scheduler, "_auto_rebalance", None)
    if st is None or st.inactive:
        return
    from sglang.srt.layers.moe.expert_cache.method import get_expert_slot_cache

    cache = get_expert_slot_cache()
    if cache is not None:
        st.slot_ceiling = int(cache.num_slots)
    st.policy.pressure_streak = st.policy.calm_streak = 0
    st.policy.cooldown_left = st.policy.cooldown


def maybe_auto_rebalance(scheduler) -> None:
    """The automatic rebalance at the scheduler's safe point (patch 0036 calls it at the end
    of ``process_input_requests``). Every :data:`CHECK_EVERY` calls (every call while idle:
    the idle loop wakes about once a second, ``IdleSleeper``): observe, ask the policy,
    and apply its move through :func:`memory_rebalance.handle_rebalance_memory` (the explicit
    endpoint's path: dry run, shrink first, rollback on failure, KV accounting check). Never
    raises (a failure is logged and counted; the split stays where the handler left it)."""
    try:
        idle = not getattr(scheduler, "waiting_queue", None) and not getattr(
            scheduler.running_batch, "reqs", None
        )
        from sglang.srt.managers.memory_pressure import maybe_pressure_rebalance

        if maybe_pressure_rebalance(scheduler, idle):  # the reserve first; then auto waits
            st = getattr(scheduler, "_auto_rebalance", None)
            if st is not None and not st.inactive:
                st.policy.pressure_streak = st.policy.calm_streak = 0
                st.policy.cooldown_left = st.policy.cooldown
            return
        st = _state(scheduler)
        if st is None:
            return
        st.iterations += 1
        if st.iterations % CHECK_EVERY and not idle:  # idle iterations are ~1 s apart
            return
        from sglang.srt.layers.moe.expert_cache.method import get_expert_slot_cache
        from sglang.srt.mem_cache.elastic_kv.scheduler_glue import elastic_kv_of

        cache = get_expert_slot_cache()
        el, _ = elastic_kv_of(scheduler)
        from sglang.srt.managers.memory_pressure import owed_slots

        # slots the reserve took are not auto's to give back (pressure returns them)
        ceiling = max(slot_floor(cache), st.slot_ceiling - owed_slots(scheduler))
        move = st.policy.step(observe(scheduler, el, cache, ceiling))
        if move is None:
            return
        _apply(scheduler, st, cache, el, move)
    except Exception:  # noqa: BLE001 - a bug must not end the scheduler
        logger.exception("expert-cache rebalance auto failed")


def _apply(scheduler, st: _AutoState, cache, el, move: Move) -> None:
    from sglang.srt.managers.io_struct import RebalanceMemoryReqInput
    from sglang.srt.managers.memory_rebalance import handle_rebalance_memory

    before = (int(cache.num_slots), el.size)
    out = handle_rebalance_memory(
        scheduler,
        RebalanceMemoryReqInput(expert_cache_size=str(move.slots), kv_tokens=move.kv_tokens),
        auto=True,
    )
    after = (int(cache.num_slots), el.size)
    if out.success:
        st.moves += 1
        cache.auto_rebalances = getattr(cache, "auto_rebalances", 0) + 1
        logger.info(
            "expert-cache rebalance auto: %s; slots %d -> %d, KV tokens %d -> %d (%.1f ms)",
            move.reason,
            before[0],
            after[0],
            before[1],
            after[1],
            float(out.split.get("time_ms") or 0.0),
        )
    else:
        st.failures += 1
        logger.warning(
            "expert-cache rebalance auto: %s; slots %d -> %d, KV tokens %d -> %d refused or "
            "failed (%d): %s; the split is slots %d, KV tokens %d",
            move.reason,
            before[0],
            move.slots,
            before[1],
            move.kv_tokens,
            out.status_code,
            out.message,
            after[0],
            after[1],
        )
