"""Bookkeeping of anchor checkpoints: which tree-held state slots sit at an anchor, and the
counters SGLang exports with ``--enable-metrics`` (scheduler process, Prometheus).

A checkpoint is identified by its state slot (an index into the mamba state pool) while the
radix tree holds it: tagged when a prefill chunk or decode step that ended at an anchor is
inserted, untagged when the tree frees the slot (eviction) or the tree is flushed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req

_TOKEN_BUCKETS = [0, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576]


@dataclass
class AnchorCounters:
    """Cumulative counts since start (tokens are prompt tokens)."""

    saved: int = 0
    saved_decode: int = 0  # of ``saved``: states at anchors in generated text
    skipped_decode: int = 0  # decode anchors not saved: no state slot free or evictable
    restored: int = 0
    evicted: int = 0
    reused_tokens: int = 0
    recomputed_tokens: int = 0
    anchor_reused_tokens: int = 0
    prefill_passes: int = 0  # prefill forward passes (batches) the scheduler ran
    skipped_emit: int = 0  # emit mode: states not emitted, no state slot free or evictable


class AnchorStats:
    """Slot tags and counters; Prometheus series when ``labels`` is given (metrics enabled)."""

    def __init__(self, labels: Optional[dict[str, str]] = None) -> None:
        self.slots: dict[int, int] = {}  # state slot -> anchor position (prefix length)
        self.counters = AnchorCounters()
        self._prom = _prom_series(labels) if labels is not None else None

    @property
    def held(self) -> int:
        """Anchor checkpoints the tree holds now."""
        return len(self.slots)

    def on_saved(self, slot: int, position: int, *, decode: bool = False) -> None:
        """The state at anchor ``position`` was inserted (a prefill chunk ended there, or with
        ``decode`` a decode step did); the tree's state there is ``slot``."""
        if self.slots.get(slot) == position:
            return
        self.slots[slot] = position
        self.counters.saved += 1
        if decode:
            self.counters.saved_decode += 1
        if self._prom is not None:
            self._prom.saved.inc()
            if decode:
                self._prom.saved_decode.inc()
            self._prom.held.set(self.held)

    def on_skipped(self) -> None:
        """A decode anchor was not saved: no state slot free or evictable."""
        self.counters.skipped_decode += 1
        if self._prom is not None:
            self._prom.skipped_decode.inc()

    def on_prefill_pass(self) -> None:
        """A prefill (extend) batch is about to run."""
        self.counters.prefill_passes += 1
        if self._prom is not None:
            self._prom.prefill_passes.inc()

    def on_emit_skipped(self) -> None:
        """Emit mode: a planned state was not emitted, no state slot free or evictable."""
        self.counters.skipped_emit += 1
        if self._prom is not None:
            self._prom.skipped_emit.inc()

    def on_freed(self, slot: int) -> None:
        """The tree freed state ``slot`` (eviction)."""
        if self.slots.pop(slot, None) is not None:
            self.counters.evicted += 1
            if self._prom is not None:
                self._prom.evicted.inc()
                self._prom.held.set(self.held)

    def on_reset(self) -> None:
        """The tree was flushed: its slots are gone without eviction."""
        self.slots.clear()
        if self._prom is not None:
            self._prom.held.set(0)

    def on_admission(self, req: Req, prefix_len: int) -> tuple[int, int, bool]:
        """A request is being admitted with ``prefix_len`` tokens from the cache: returns
        ``(reused, recomputed, restored_from_anchor)`` for :meth:`count_admission`, which the
        cache calls once the request's prefill has run (an admission can be retried), and sets
        ``req.anchor_restored``. Must run before the forward pass consumes the matched state."""
        total = len(req.full_untruncated_fill_ids)
        src = req.kv.mamba_cow_src_index
        # Reading the slot index is a host sync when the state pool is on a GPU: only when
        # some anchor checkpoint is held.
        restored = bool(
            self.slots
            and prefix_len > 0
            and src is not None
            and self.slots.get(int(src.view(-1)[0])) == prefix_len
        )
        req.anchor_restored = restored
        return prefix_len, total - prefix_len, restored

    def count_admission(self, reused: int, recomputed: int, restored: bool) -> None:
        """Count one admitted request whose prefill ran (tokens are prompt tokens)."""
        c = self.counters
        c.reused_tokens += reused
        c.recomputed_tokens += recomputed
        if restored:
            c.restored += 1
            c.anchor_reused_tokens += reused
        if self._prom is not None:
            self._prom.reused.observe(reused)
            self._prom.recomputed.observe(recomputed)
            if restored:
                self._prom.restored.inc()


_SERIES: dict[tuple, "_PromSeries"] = {}


def _prom_series(labels: dict[str, str]) -> "_PromSeries":
    # Prometheus refuses a second registration of a name: one set of series per process.
    key = tuple(sorted(labels.items()))
    if key not in _SERIES:
        _SERIES[key] = _PromSeries(labels)
    return _SERIES[key]


class _PromSeries:
    def __init__(self, labels: dict[str, str]) -> None:
        # prometheus_client must be imported after PROMETHEUS_MULTIPROC_DIR is set (it is,
        # in the scheduler process).
        from prometheus_client import Counter, Gauge, Histogram

        names = list(labels)

        def counter(name, doc):
            return Counter(name=name, documentation=doc, labelnames=names).labels(**labels)

        self.saved = counter(
            "sglang:anchor_checkpoints_saved_total",
            "Recurrent-state checkpoints stored at semantic anchors (prefill chunk ends and decode steps at an anchor).",
        )
        self.saved_decode = counter(
            "sglang:anchor_checkpoints_saved_decode_total",
            "Of the saved anchor checkpoints, those at anchors in generated text (decode).",
        )
        self.skipped_decode = counter(
            "sglang:anchor_checkpoints_skipped_decode_total",
            "Anchors in generated text not saved because no state slot was free or evictable.",
        )
        self.prefill_passes = counter(
            "sglang:anchor_prefill_passes_total",
            "Prefill forward passes (extend batches) run by the scheduler of a cache with anchor checkpoints.",
        )
        self.skipped_emit = counter(
            "sglang:anchor_checkpoints_skipped_emit_total",
            "Anchor states not emitted inside a prefill pass because no state slot was free or evictable.",
        )
        self.restored = counter(
            "sglang:anchor_checkpoints_restored_total",
            "Requests whose cached prefix ended on an anchor checkpoint.",
        )
        self.evicted = counter(
            "sglang:anchor_checkpoints_evicted_total",
            "Anchor checkpoints freed by the radix tree's state eviction (LRU).",
        )
        self.held = Gauge(
            name="sglang:anchor_checkpoints_held",
            documentation="Anchor checkpoints held by the radix tree now.",
            labelnames=names,
            multiprocess_mode="mostrecent",
        ).labels(**labels)
        self.reused = Histogram(
            name="sglang:prefill_reused_tokens",
            documentation="Prompt tokens served from the prefix cache, per admitted request.",
            labelnames=names,
            buckets=_TOKEN_BUCKETS,
        ).labels(**labels)
        self.recomputed = Histogram(
            name="sglang:prefill_recomputed_tokens",
            documentation="Prompt tokens prefilled (not served from the prefix cache), per admitted request.",
            labelnames=names,
            buckets=_TOKEN_BUCKETS,
        ).labels(**labels)
