"""A small scheduler stand-in that drives upstream's hybrid radix cache with anchor checkpoints.

Builds ``AnchorRadixCache`` (upstream ``UnifiedRadixCache`` with the Rust tree core, as the server
runs it) over tiny CPU pools: a hybrid request-to-token pool with a few recurrent-state slots and
a small KV pool, without a model or a server. Requests go through the steps the scheduler takes
for a hybrid model on the no-buffer strategy, with upstream's own functions where they exist:

- admission: ``Req.init_next_round_input`` (prefix match, copy-on-write state slot, evicting a
  state if the pool is full), a request row, the matched prefix's KV indices, a tree lock;
- a prefill chunk: ``AnchorPlanner.admit`` / ``cut`` choose its length, KV slots are allocated
  (evicting KV if the pool is full), and ``checkpoint_kv_cache`` publishes it (a state copy);
- decode steps (each followed by ``checkpoint_decode_anchors``, as the scheduler does), then
  ``release_kv_cache(checkpoint=True)`` (finish) or ``checkpoint=False``
  (abort); flush resets the tree and the pools as ``/flush_cache`` does.

State contents are not computed (no model): these tests are about which slots are held.
"""

from __future__ import annotations

import itertools
from array import array
from types import SimpleNamespace
from typing import Optional

import torch

from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
from sglang.srt.environ import envs
from sglang.srt.managers.schedule_batch import FINISH_ABORT, FINISH_LENGTH, Req
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
from sglang.srt.mem_cache.anchor_checkpoints import emit as emission
from sglang.srt.mem_cache.anchor_checkpoints.cache import AnchorRadixCache
from sglang.srt.mem_cache.anchor_checkpoints.markers import AnchorScanner
from sglang.srt.mem_cache.base_prefix_cache import EvictParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.common import checkpoint_kv_cache, release_kv_cache
from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, HybridReqToTokenPool
from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

# A toy vocabulary: 1 and 2 are one-token markers, "<B>" is the two-token marker 3, 4.
VOCAB = 24
OPEN, CLOSE, B_LT, B_GT = 1, 2, 3, 4
MARKERS = ("<A>", "</A>", "<B>")


def toy_scanner() -> AnchorScanner:
    table = [f"t{i} ".encode() for i in range(VOCAB)]
    table[OPEN], table[CLOSE], table[B_LT], table[B_GT] = b"<A>", b"</A>", b"<", b"B>"
    return AnchorScanner(MARKERS, table)


class CacheSim:
    """Tiny pools + ``AnchorRadixCache`` + the scheduler steps of module doc."""

    def __init__(
        self,
        *,
        state_slots: int = 10,
        kv_slots: int = 160,
        rows: int = 4,
        min_gap: int = 3,
        max_states: int = -1,
        context: int = 128,
        emit: bool = False,
    ) -> None:
        sa = ServerArgs(model_path="dummy", page_size=1)
        sa._mamba_cache_chunk_size = 64  # no HF config to read it from
        set_global_server_args_for_scheduler(sa)
        layers = [0, 1, 2]
        with envs.SGLANG_MAMBA_SSM_DTYPE.override("float32"):
            shape = Mamba2StateShape.create(
                tp_world_size=1,
                intermediate_size=32,
                n_groups=1,
                num_heads=2,
                head_dim=16,
                state_size=8,
                conv_kernel=4,
            )
            cache_params = Mamba2CacheParams(shape=shape, layers=layers)
        self.pool = HybridReqToTokenPool(
            size=rows,
            mamba_size=state_slots,
            mamba_spec_state_size=rows,
            max_context_len=context,
            device="cpu",
            enable_memory_saver=False,
            cache_params=cache_params,
            mamba_layer_ids=layers,
            enable_mamba_extra_buffer=False,
            speculative_num_draft_tokens=3,
        )
        kv = HybridLinearKVPool(
            size=kv_slots,
            dtype=torch.bfloat16,
            page_size=1,
            head_num=1,
            head_dim=8,
            full_attention_layer_ids=[3],
            device="cpu",
            enable_memory_saver=False,
            mamba_pool=self.pool.mamba_pool,
        )
        self.allocator = TokenToKVPoolAllocator(
            size=kv_slots,
            dtype=torch.bfloat16,
            device="cpu",
            kvcache=kv,
            need_sort=False,
        )
        params = CacheInitParams(
            req_to_token_pool=self.pool,
            token_to_kv_pool_allocator=self.allocator,
            page_size=1,
            disable=False,
            tree_components=(ComponentType.FULL, ComponentType.MAMBA),
            enable_mamba_extra_buffer=False,
        )
        self.state_slots, self.kv_slots, self.rows = state_slots, kv_slots, rows
        self.cache = AnchorRadixCache(
            params, toy_scanner(), min_gap=min_gap, max_states=max_states, emit=emit
        )
        self.pass_takes_plan = True  # False: a pass whose layers never take the emission plan
        self.planner = self.cache.anchor_planner
        self.running: list[Req] = []
        self._rid = itertools.count()
        self.evicted_any = False
        self.evictions = 0  # evictions that freed something, ever (evicted_any is reset by tests)
        inner = self.cache._evict

        def spy(*a, **kw):  # remember whether any eviction happened (the reference gets lossy)
            result = inner(*a, **kw)
            if result.num_tokens_evicted or result.mamba_num_evicted:
                self.evicted_any = True
                self.evictions += 1
            return result

        self.cache._evict = spy

    # ---- scheduler steps ----------------------------------------------------------------

    def admit(self, prompt: list[int], budget: int) -> Optional[Req]:
        """Match a request and run its first prefill chunk (of at most ``budget`` tokens), as
        one scheduling step does; None (nothing held) when no request row or KV is free."""
        # The scheduler caps running requests at a third of the state slots (own state, the
        # locked state of its last chunk end, the next chunk end's copy).
        if len(self.running) >= min(self.rows - 1, self.state_slots // 3):
            return None
        req = Req(
            rid=f"r{next(self._rid)}",
            origin_input_text="",
            origin_input_ids=array("q", prompt),
            sampling_params=SamplingParams(temperature=0, max_new_tokens=8),
        )
        req.init_next_round_input(self.cache)  # match + copy-on-write state slot
        req.lock = self.cache.lock(req.last_node)
        if not req.kv.holds_mamba and self.pool.mamba_allocator.available_size() < 1:
            self.cache.evict_for_alloc(EvictParams(num_tokens=0, mamba_num=1))
        if not req.kv.holds_mamba and self.pool.mamba_allocator.available_size() < 1:
            self.cache.unlock(req.lock)
            return None
        rows = self.pool.alloc([req])
        assert rows is not None
        req.anchor_admitted_prefix = req.prefix_len
        if req.prefix_len:
            self.pool.write(
                (req.kv.req_pool_idx, slice(0, req.prefix_len)),
                self.cache.prefix_device_indices(req).to(torch.int32),
            )
        req.kv.kv_committed_len = req.kv.kv_allocated_len = req.prefix_len
        req.anchor_first_chunk = True
        self.running.append(req)
        if self.prefill_chunk(req, budget) is None:  # no KV: the scheduler would not admit it
            self.running.remove(req)
            self.cache.unlock(req.lock)
            req.lock = None
            self.pool.mamba_allocator.free(req.kv.mamba_pool_idx.unsqueeze(-1))
            req.kv.mamba_pool_idx = None
            self.pool.free(req)
            return None
        return req

    def _alloc_kv(self, n: int) -> Optional[torch.Tensor]:
        out = self.allocator.alloc(n)
        if out is None:
            self.cache.evict(EvictParams(num_tokens=n - self.allocator.available_size()))
            out = self.allocator.alloc(n)
        return out

    def prefilling(self, req: Req) -> bool:
        return req.kv.kv_committed_len < len(req.origin_input_ids)

    def prefill_chunk(self, req: Req, budget: int) -> Optional[tuple[int, int]]:
        """Run one prefill chunk of at most ``budget`` tokens: (start, end), or None (no KV)."""
        start = req.prefix_len
        n = min(budget, len(req.origin_input_ids) - start)
        if req.anchor_first_chunk:
            n = self.planner.admit(req, start, n)
        else:
            n = self.planner.cut(req, start, n)
        kv = self._alloc_kv(n)
        if kv is None:
            return None
        req.anchor_first_chunk = False
        # The forward pass copies the matched state into the request's slot.
        req.kv.mamba_cow_src_index = None
        req.kv.mamba_needs_clear = False
        req.extend_end = start + n
        self.pool.write((req.kv.req_pool_idx, slice(start, start + n)), kv.to(torch.int32))
        req.kv.kv_committed_len = req.kv.kv_allocated_len = start + n
        if self.cache.anchor_planner.emit:
            self._forward_emitting(req, start, n)
        if req.extend_end == len(req.origin_input_ids):
            req.output_ids.append(5)  # the first token, sampled from the last chunk
        checkpoint_kv_cache(req, self.cache)
        return start, start + n

    def _forward_emitting(self, req: Req, start: int, n: int) -> None:
        """Emit mode around the pass (patches 0045-0046): plan after prepare_for_extend, the
        layers take the plan and stamp each emitted slot with its position (no model), the tree
        takes the emitted states before the results are processed."""
        batch = SimpleNamespace(reqs=[req])
        self.cache.plan_state_emission(batch)
        if self.pass_takes_plan:
            forward_batch = SimpleNamespace(
                forward_mode=ForwardMode.EXTEND,
                extend_seq_lens_cpu=[n],
                req_pool_indices=torch.tensor([req.kv.req_pool_idx]),
            )
            plan = emission.take(forward_batch)
            for row in plan.rows if plan is not None else ():
                for pos, slot in zip(row.positions, row.slots):
                    self.stamp(slot, pos)
        self.cache.insert_emitted_states(batch)

    def stamp(self, slot: int, value: float) -> None:
        for layer in (0, 1, 2):
            self.pool.mamba2_layer_cache(layer).temporal[slot] = value

    def stamp_of(self, slot: int) -> float:
        return float(self.pool.mamba2_layer_cache(0).temporal[slot].view(-1)[0])

    def decode(self, req: Req, token: int) -> bool:
        kv = self._alloc_kv(1)
        if kv is None:
            return False
        pos = req.kv.kv_committed_len
        self.pool.write((req.kv.req_pool_idx, slice(pos, pos + 1)), kv.to(torch.int32))
        req.kv.kv_committed_len = req.kv.kv_allocated_len = pos + 1
        req.output_ids.append(token)
        # The scheduler's hook after a decode step (patch 0043): save the state at an anchor.
        self.cache.checkpoint_decode_anchors(
            SimpleNamespace(reqs=[req], spec_algorithm=SpeculativeAlgorithm.NONE)
        )
        return True

    def finish(self, req: Req) -> int:
        """Finish ``req``; returns the length of the key the tree got (prompt + output)."""
        req.finished_reason = FINISH_LENGTH(length=len(req.output_ids))
        up_to = req.owned_kv_len()
        release_kv_cache(req, self.cache, checkpoint=True)
        self.running.remove(req)
        return up_to

    def abort(self, req: Req) -> None:
        req.finished_reason = FINISH_ABORT()
        release_kv_cache(req, self.cache, checkpoint=False)
        self.running.remove(req)

    def flush(self) -> None:
        """``/flush_cache`` on an idle server."""
        assert not self.running
        self.cache.reset()
        self.pool.clear()
        self.allocator.clear()

    # ---- accounting -----------------------------------------------------------------------

    def tree_states(self) -> set[int]:
        vals = self.cache.tree_core.all_mamba_values_flatten()
        return set(vals.view(-1).tolist())

    def state_slots_in_use(self) -> int:
        return self.state_slots - self.pool.mamba_allocator.available_size()

    def kv_slots_in_use(self) -> int:
        return self.kv_slots - self.allocator.available_size()
