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
from typing import TYPE_CHECKING, Optional

import torch

from sglang.srt.mem_cache.anchor_checkpoints.emit import RowEmission, StateEmission
from sglang.srt.mem_cache.anchor_checkpoints.emit import publish as emission_publish
from sglang.srt.mem_cache.anchor_checkpoints.markers import AnchorScanner
from sglang.srt.mem_cache.anchor_checkpoints.planner import AnchorPlanner
from sglang.srt.mem_cache.anchor_checkpoints.stats import AnchorStats
from sglang.srt.mem_cache.base_prefix_cache import EvictParams
from sglang.srt.mem_cache.unified_cache.cache_action import FreeComponentDeviceSlot
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
from sglang.srt.mem_cache.unified_cache.components.mamba import MambaComponent
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
        self,
        params: CacheInitParams,
        scanner: AnchorScanner,
        *,
        min_gap: int,
        max_states: int = -1,
        emit: bool = False,
        emit_explicit: bool = False,
    ) -> None:
        super().__init__(params)
        # --anchor-checkpoint-mode emit given (not picked by auto): a fallback to cutting is a
        # warning then, an info line under auto (the flags may not tell which kernel runs).
        self.anchor_emit_explicit = emit_explicit
        assert self.is_mamba_enabled and not self.enable_mamba_extra_buffer, (
            "anchor checkpoints need the no-buffer hybrid (mamba) radix cache"
        )
        labels = self.metrics_collector.labels if getattr(self, "metrics_collector", None) else None
        self.anchor_stats = AnchorStats(labels)
        self.anchor_planner = AnchorPlanner(scanner, min_gap, self.anchor_stats, emit=emit)
        self._emission: Optional[tuple] = None  # (StateEmission, allocator slots per row)
        if emit:
            # The mamba component donates an emitted state's slot to the node it belongs to
            # instead of copying the live state into a fresh one (_EmittedStateDonor).
            comp = self.components[ComponentType.MAMBA]
            assert type(comp) is MambaComponent, type(comp)
            comp.__class__ = _EmittedStateDonor
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
            "Anchor checkpoints on (%s): %d markers %s, min gap %d tokens, tree state cap %s",
            "states emitted inside the prefill pass" if emit else "prefill chunks cut at anchors",
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

    # ---- emit mode: states written inside the pass (emit.py) ------------------------------

    def plan_state_emission(self, batch) -> None:
        """Choose the states the prefill pass of ``batch`` emits and give each a free state slot
        (patch 0046, after ``prepare_for_extend``); publish the plan for the GDN backend. A slot
        the pool cannot give even after evicting the least recently used tree state ends that
        request's emissions (counted as skipped). Counts the pass in both modes. Emit mode only;
        requests barred from the tree, without a state slot, or with images emit nothing."""
        self.anchor_stats.on_prefill_pass()
        if not self.anchor_planner.emit:
            return
        self._release_emission()
        rows, held = [], []
        translate = self.req_to_token_pool.translate_mamba_indices
        for i, req in enumerate(batch.reqs):
            if req.skip_radix_cache_insert or not req.kv.holds_mamba:
                continue
            want = self.anchor_planner.emit_positions(
                req, req.prefix_len, req.extend_end - req.prefix_len
            )
            slots = []
            for _ in want:
                slot = self._alloc_state_slot()
                if slot is None:
                    self.anchor_stats.on_emit_skipped()
                    break
                slots.append(slot)
            if slots:
                # The kernels write physical slots; the tree keeps the allocator's ids.
                physical = translate(torch.cat(slots)).view(-1).tolist()
                rows.append(RowEmission(i, req.prefix_len, want[: len(slots)], physical))
                held.append(slots)
        if not rows:
            emission_publish(None)
            return
        plan = StateEmission(
            tuple(int(r.kv.req_pool_idx) for r in batch.reqs),
            tuple(int(r.extend_end - r.prefix_len) for r in batch.reqs),
            rows,
        )
        self._emission = (plan, held)
        emission_publish(plan)

    def insert_emitted_states(self, batch) -> None:
        """After the prefill pass of ``batch`` (patch 0046, before its results are processed):
        insert each request's path up to every state the pass emitted, the emitted slot becoming
        the state of the node ending there (the lock moves along, as at a chunk end). Slots of a
        plan the pass did not take, or of positions already in the tree, go back to the pool."""
        pending, self._emission = self._emission, None
        emission_publish(None)
        if pending is None:
            return
        plan, held = pending
        if not plan.written and self.anchor_planner.emit:
            # No linear layer took the plan: linear layers other than gated DeltaNet, a GDN
            # prefill kernel that cannot write them (supports_state_emit), a strided state pool
            # that upstream gathers into copies for the kernel, or a graph-replayed prefill.
            log = logger.warning if self.anchor_emit_explicit else logger.info
            log(
                "Anchor checkpoints: no linear layer wrote the planned states (linear layers "
                "other than gated DeltaNet, or a GDN prefill kernel or state pool that cannot "
                "write them); cutting prefill chunks at anchors instead."
            )
            self.anchor_planner.emit = False
        for r, slots in zip(plan.rows, held):
            req = batch.reqs[r.row] if r.row < len(batch.reqs) else None
            for pos, slot in zip(r.positions, slots):
                if (
                    not plan.written
                    or req is None
                    or req.finished()
                    or not req.kv.holds_kv
                    or pos <= req.kv.cache_protected_len
                ):
                    self.req_to_token_pool.mamba_allocator.free(slot)
                    continue
                req._anchor_emitted_slot = slot
                try:
                    self.checkpoint(req, up_to=pos)
                finally:
                    req._anchor_emitted_slot = None

    def _release_emission(self) -> None:
        pending, self._emission = self._emission, None
        if pending is not None:
            for slots in pending[1]:
                for slot in slots:
                    self.req_to_token_pool.mamba_allocator.free(slot)

    def _alloc_state_slot(self) -> Optional[torch.Tensor]:
        """One free slot of the state pool (``[1]`` int64), evicting the least recently used
        tree state if none is free; None if that does not free one either."""
        if not self._state_slot_obtainable():
            return None
        return self.req_to_token_pool.mamba_allocator.alloc(1)

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
        if getattr(self, "_emission", None) is not None:
            self._release_emission()
            emission_publish(None)
        super().reset()
        # __init__ runs reset() before the stats exist.
        stats = getattr(self, "anchor_stats", None)
        if stats is not None:
            stats.on_reset()


class _EmittedStateDonor(MambaComponent):
    """Upstream's mamba component, except that a checkpoint of a request carrying an emitted
    state (``req._anchor_emitted_slot``, set by :meth:`AnchorRadixCache.insert_emitted_states`)
    donates that slot to the inserted node instead of copying the live state into a fresh one.
    Upstream's cleanup frees the slot when the node already had a state."""

    def prepare_for_caching_req(self, req, insert_params, token_ids_len, is_finished):
        slot = getattr(req, "_anchor_emitted_slot", None)
        if slot is None or is_finished:
            return super().prepare_for_caching_req(req, insert_params, token_ids_len, is_finished)
        insert_params.mamba_value = slot
        return token_ids_len
