"""The hybrid radix cache with semantic-anchor checkpoints.

``AnchorRadixCache`` is upstream's ``UnifiedRadixCache`` (FULL + MAMBA components, no-buffer
strategy) plus the bookkeeping of anchor checkpoints. Storage is upstream's own: a checkpoint is
the recurrent state (every linear layer's SSM/delta state and conv state) that the mamba
component copies into a fresh slot of the mamba state pool (``--max-mamba-cache-size`` slots,
shared with running requests) when a chunk ends at an anchor; the tree node ending at the anchor
holds it, and upstream's mamba LRU recycles it, apart from the KV pool's eviction. This class
only tags those slots, observes their eviction, optionally caps the states the tree holds, and
owns the :class:`AnchorPlanner` that ``PrefillAdder`` asks where chunks end.

Anchors in generated text: after each decode step the scheduler calls
:meth:`AnchorRadixCache.checkpoint_decode_anchors` (patch 0043). Where the tokens a request has
fed end at an anchor, the request's path is inserted up to there with upstream's own checkpoint
(the same insert a prefill chunk end makes): the live state is copied into a fresh slot of the
state pool, the KV written so far joins the tree, and the request's lock moves onto that node.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from sglang.srt.mem_cache.anchor_checkpoints.markers import AnchorScanner
from sglang.srt.mem_cache.anchor_checkpoints.planner import AnchorPlanner
from sglang.srt.mem_cache.anchor_checkpoints.stats import AnchorStats
from sglang.srt.mem_cache.base_prefix_cache import EvictParams
from sglang.srt.mem_cache.unified_cache.cache_action import FreeComponentDeviceSlot
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams

logger = logging.getLogger(__name__)


class AnchorRadixCache(UnifiedRadixCache):
    """``UnifiedRadixCache`` whose chunk ends at anchors are tagged as anchor checkpoints.

    Invariants: every tagged slot is a mamba state value of a tree node (tags are dropped when
    the tree frees the slot or is reset); a tag's position is the depth of that node.
    """

    def __init__(
        self, params: CacheInitParams, scanner: AnchorScanner, *, min_gap: int, max_states: int = -1
    ) -> None:
        super().__init__(params)
        assert self.is_mamba_enabled and not self.enable_mamba_extra_buffer, (
            "anchor checkpoints need the no-buffer hybrid (mamba) radix cache"
        )
        labels = self.metrics_collector.labels if getattr(self, "metrics_collector", None) else None
        self.anchor_stats = AnchorStats(labels)
        self.anchor_planner = AnchorPlanner(scanner, min_gap, self.anchor_stats)
        self.anchor_max_states = max_states
        from sglang.srt.runtime_context import get_serving

        # --strip-thinking-cache frees the generated KV a decode anchor would keep; ReplaySSM
        # lets a decoding slot's SSM state lag the live one (flushed at prefill and finish only).
        replay = getattr(self.req_to_token_pool.mamba_pool, "replayssm_write_pos", None) is not None
        self._decode_anchors = not (get_serving().strip_thinking_cache or replay)
        if not self._decode_anchors:
            logger.info(
                "Anchor checkpoints in generated text are off with %s.",
                "ReplaySSM" if replay else "--strip-thinking-cache",
            )
        self._in_decode_save = False
        logger.info(
            "Anchor checkpoints on: %d markers %s, min gap %d tokens, tree state cap %s",
            len(scanner.markers),
            list(scanner.markers),
            min_gap,
            max_states if max_states > 0 else "none (the mamba state pool)",
        )

    # ---- tagging ------------------------------------------------------------------------

    def checkpoint(self, req: Req, *, up_to: int, **kwargs) -> None:
        # The first checkpoint after an admission is its prefill having run: count it once.
        admission = getattr(req, "_anchor_admission", None)
        if admission is not None:
            req._anchor_admission = None
            self.anchor_stats.count_admission(*admission)
        super().checkpoint(req, up_to=up_to, **kwargs)

    def checkpoint_into_tree(self, req: Req, *, up_to: int, **kwargs) -> None:
        super().checkpoint_into_tree(req, up_to=up_to, **kwargs)
        if req.finished() or not self.anchor_planner.is_cut(req, up_to):
            return
        # The insert ends on the node of depth up_to (page 1), unless it was skipped.
        if req.kv.cache_protected_len != up_to:
            return
        value = self.tree_core.get_component_device_value(req.last_node, ComponentType.MAMBA)
        if value is None:
            return
        self.anchor_stats.on_saved(int(value.view(-1)[0]), up_to, decode=self._in_decode_save)
        if self.anchor_max_states > 0:
            self._enforce_state_cap()

    def checkpoint_decode_anchors(self, batch) -> None:
        """Save the recurrent state of each decoding request of ``batch`` whose fed tokens end at
        an anchor (:meth:`AnchorPlanner.decode_anchor`). Called by the scheduler after a decode
        step's output tokens are appended and finish states set, before the next step runs
        (no-buffer hybrid caches run without the overlap scheduler, so the live state is
        exactly the state after ``req.kv.kv_committed_len`` tokens).

        Skipped: speculative decoding (a verify step commits several tokens), finished,
        retracted, beam or multimodal requests, requests barred from the tree,
        ``--strip-thinking-cache`` (it frees the generated KV a decode anchor would keep),
        ReplaySSM (a decoding slot's state lags the live one), and decode requests of mixed
        prefill+decode batches (``--enable-mixed-chunk``: the hook runs on decode batches). A
        save is skipped, not forced, when no state slot is free even after evicting one.

        Cost per saved anchor: one state copy (every linear layer's SSM and conv state), one
        tree insert, and one host read of the slot index (a sync on GPU).
        """
        if not self._decode_anchors or not batch.spec_algorithm.is_none():
            return
        planner = self.anchor_planner
        for req in batch.reqs:
            # decode_anchor first: its min_gap test ends almost every step for a request.
            fed = req.kv.kv_committed_len
            if not planner.decode_anchor(req, fed) or (
                req.finished()
                or req.is_retracted
                or req.skip_radix_cache_insert
                or req.beam_group is not None
                or req.multimodal_inputs is not None
                or not req.kv.holds_kv
            ):
                continue
            if not self._state_slot_obtainable():
                self.anchor_stats.on_skipped()
                continue
            planner.mark(req, fed)
            req.refresh_fill_ids()  # the insert reads fill ids; they lag output_ids in decode
            self._in_decode_save = True
            try:
                self.checkpoint(req, up_to=fed)
            finally:
                self._in_decode_save = False

    def _state_slot_obtainable(self) -> bool:
        """Whether the checkpoint's state-slot allocation will succeed (upstream asserts on
        failure): a slot is free, or is after evicting the least recently used tree state."""
        ckpt_pool = getattr(self.req_to_token_pool, "mamba_ckpt_pool", None)
        if ckpt_pool is not None:
            free = ckpt_pool.available_size
        else:  # byte-coordinated allocators (unified memory) report what alloc can give
            free = self.req_to_token_pool.mamba_allocator.schedulable_available_size
        if free() > 0:
            return True
        if self.mamba_evictable_size() > 0:
            self.evict(EvictParams(num_tokens=0, mamba_num=1))
        return free() > 0

    def _enforce_state_cap(self) -> None:
        held = self.tree_core.mamba_evictable_size() + self.tree_core.mamba_protected_size()
        excess = held - self.anchor_max_states
        if excess > 0:
            self.evict(EvictParams(num_tokens=0, mamba_num=excess))

    # ---- observing frees -----------------------------------------------------------------

    def _apply_cache_action(self, action) -> None:
        if (
            isinstance(action, FreeComponentDeviceSlot)
            and action.component_type == ComponentType.MAMBA
            and self.anchor_stats.slots
        ):
            for indices in action.indices:
                for slot in indices.view(-1).tolist():
                    self.anchor_stats.on_freed(int(slot))
        super()._apply_cache_action(action)

    def reset(self) -> None:
        super().reset()
        # __init__ runs reset() before the stats exist.
        stats = getattr(self, "anchor_stats", None)
        if stats is not None:
            stats.on_reset()
