"""A small scheduler stand-in over upstream's KV pools and radix cache, for elastic KV tests.

Builds an ``MHATokenToKVPool`` (float32, CPU; ``mla=True``: an ``MLATokenToKVPool``, one
latent buffer per layer), its token-to-KV allocator (page size 1 or a
paged one), a ``ReqToTokenPool`` and upstream's ``UnifiedRadixCache`` (the Rust tree core as the
server runs it, or the Python one), with :class:`ElasticKV` over them, and drives requests
through admission (prefix match, lock, request row, KV for the rest of the prompt, evicting
when the pool is full), decode steps, finish (``release_kv_cache``) and eviction.

KV contents are stamps, not a model: the K row written for position ``p`` of a token
sequence is ``stamp(seq[: p + 1])`` in every element of every layer (V: its negative; MLA:
the latent row holds it), so a
prefix's KV depends only on its tokens, as real KV does, and :meth:`KVSim.kv_problems` can say
whether every running request and every cached prefix still reads its own KV after pages
moved.
"""

from __future__ import annotations

import itertools
import zlib
from array import array
from typing import List, Optional

import torch

from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.common import checkpoint_kv_cache, release_kv_cache
from sglang.srt.mem_cache.elastic_kv.accounting import kv_accounting_problems
from sglang.srt.mem_cache.elastic_kv.resize import ElasticKV
from sglang.srt.mem_cache.memory_pool import (
    MHATokenToKVPool,
    MLATokenToKVPool,
    ReqToTokenPool,
)
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

LAYERS, HEADS, DIM = 2, 1, 4


PREFIXES = ([1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16, 17, 18])


def random_prompt(rng) -> list:
    """A prompt that shares a prefix of one of :data:`PREFIXES` (possibly empty) with others."""
    base = list(rng.choice(PREFIXES))[: rng.randint(0, 8)]
    return base + [rng.randint(20, 60) for _ in range(rng.randint(1, 10))]


def stamp(tokens) -> float:
    """The KV value of the last position of ``tokens`` (exact in float32: < 2**20)."""
    return float(zlib.crc32(array("q", tokens).tobytes()) % (1 << 20))


class KVSim:
    def __init__(
        self,
        *,
        kv_tokens: int = 96,
        max_tokens: Optional[int] = None,
        page_size: int = 1,
        rows: int = 6,
        context: int = 64,
        tree_core: str = "rust",
        mla: bool = False,
    ) -> None:
        set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", page_size=page_size))
        self.page_size = page_size
        self.rtp = ReqToTokenPool(
            size=rows, max_context_len=context, device="cpu", enable_memory_saver=False
        )
        self.mla = mla
        if mla:
            self.kv = MLATokenToKVPool(
                size=kv_tokens,
                page_size=page_size,
                dtype=torch.float32,
                kv_lora_rank=DIM,
                qk_rope_head_dim=2,
                layer_num=LAYERS,
                device="cpu",
                enable_memory_saver=False,
            )
        else:
            self.kv = MHATokenToKVPool(
                size=kv_tokens,
                page_size=page_size,
                dtype=torch.float32,
                head_num=HEADS,
                head_dim=DIM,
                layer_num=LAYERS,
                device="cpu",
                enable_memory_saver=False,
            )
        if page_size == 1:
            self.alloc = TokenToKVPoolAllocator(
                size=kv_tokens, dtype=torch.float32, device="cpu", kvcache=self.kv, need_sort=False
            )
        else:
            self.alloc = PagedTokenToKVPoolAllocator(
                size=kv_tokens,
                page_size=page_size,
                dtype=torch.float32,
                device="cpu",
                kvcache=self.kv,
                need_sort=False,
            )
        params = CacheInitParams(
            req_to_token_pool=self.rtp,
            token_to_kv_pool_allocator=self.alloc,
            page_size=page_size,
            disable=False,
            tree_components=(ComponentType.FULL,),
            tree_core_backend=tree_core,
        )
        self.cache = UnifiedRadixCache(params)
        self.elastic = ElasticKV(self.kv, self.alloc, self.rtp, self.cache, max_tokens=max_tokens)
        self.rows = rows
        self.context = context
        self.running: List[Req] = []  # every request holding KV (the sim's own checks)
        # The scheduler's view at a safe point (upstream's event loop): the requests admitted
        # since the last merge are the last prefill batch, in neither ``running_batch`` nor
        # ``chunked_req``; requests finished since then are still in ``running_batch``.
        self.last_prefill: List[Req] = []
        self.just_finished: List[Req] = []
        self.seqs: dict = {}  # rid -> the token sequence whose KV the request holds
        self.seen: List[list] = []  # sequences the tree was given (prompt + output)
        self._rid = itertools.count()

    # ---- KV writes ------------------------------------------------------------------------

    def _write(self, seq, start: int, locs: torch.Tensor) -> None:
        vals = torch.tensor([stamp(seq[: p + 1]) for p in range(start, start + len(locs))])
        for buf, sign in self._buffers():
            buf[locs] = sign * vals[:, None, None].expand(-1, *buf.shape[1:])

    def _alloc_positions(self, req: Req, start: int, n: int) -> Optional[torch.Tensor]:
        """KV locations for positions ``[start, start + n)`` of ``req`` (the rest of its last
        page first, then whole new pages), evicting when the pool is full; None: no KV."""
        ps = self.page_size
        row = req.kv.req_pool_idx
        room = (-start) % ps if start % ps else 0
        first = min(room, n)
        locs = []
        if first:
            last = int(self.rtp.req_to_token[row, start - 1])
            locs.append(torch.arange(last + 1, last + 1 + first, dtype=torch.int64))
        rest = n - first
        if rest:
            need = -(-rest // ps) * ps
            got = self.alloc.alloc(need)
            if got is None:
                self.cache.evict(EvictParams(num_tokens=need - self.alloc.available_size()))
                got = self.alloc.alloc(need)
            if got is None:
                return None
            got = got.to(torch.int64)
            if need > rest:  # the unused tail of the last page stays the request's own
                pass
            locs.append(got[:rest])
            req.sim_spare = got[rest:]
        return torch.cat(locs) if locs else torch.empty(0, dtype=torch.int64)

    # ---- scheduler steps ------------------------------------------------------------------

    def admit(self, prompt: list) -> Optional[Req]:
        if len(self.running) >= self.rows - 1 or len(prompt) >= self.context - 8:
            return None
        req = Req(
            rid=f"r{next(self._rid)}",
            origin_input_text="",
            origin_input_ids=array("q", prompt),
            sampling_params=SamplingParams(temperature=0, max_new_tokens=8),
        )
        req.init_next_round_input(self.cache)
        req.lock = self.cache.lock(req.last_node)
        assert self.rtp.alloc([req]) is not None
        row, pre = req.kv.req_pool_idx, req.prefix_len
        if pre:
            self.rtp.write(
                (row, slice(0, pre)), self.cache.prefix_device_indices(req).to(torch.int32)
            )
        req.kv.kv_committed_len = req.kv.kv_allocated_len = pre
        locs = self._alloc_positions(req, pre, len(prompt) - pre)
        if locs is None:
            self.cache.unlock(req.lock)
            self.rtp.free(req)
            return None
        self.rtp.write((row, slice(pre, len(prompt))), locs.to(torch.int32))
        self._write(prompt, pre, locs)
        req.kv.kv_committed_len = req.kv.kv_allocated_len = len(prompt)
        req.extend_end = len(prompt)
        req.output_ids.append(5)
        checkpoint_kv_cache(req, self.cache)
        self.running.append(req)
        self.last_prefill.append(req)
        self.seqs[req.rid] = list(prompt)
        return req

    def decode(self, req: Req, token: int) -> bool:
        pos = req.kv.kv_committed_len
        if pos + 1 >= self.context:
            return False
        seq = self.seqs[req.rid] + [req.output_ids[-1]]
        locs = self._alloc_positions(req, pos, 1)
        if locs is None:
            return False
        self.rtp.write((req.kv.req_pool_idx, slice(pos, pos + 1)), locs.to(torch.int32))
        self._write(seq, pos, locs)
        req.kv.kv_committed_len = req.kv.kv_allocated_len = pos + 1
        self.seqs[req.rid] = seq
        req.output_ids.append(token)
        return True

    def finish(self, req: Req) -> None:
        req.finished_reason = FINISH_LENGTH(length=len(req.output_ids))
        self.seen.append(list(self.seqs[req.rid]))
        release_kv_cache(req, self.cache, checkpoint=True)
        self.running.remove(req)
        if req in self.last_prefill:
            self.last_prefill.remove(req)
        self.just_finished.append(req)

    def merge_last_batch(self) -> None:
        """``get_next_batch_to_run``: the last prefill batch joins the running batch and the
        finished requests leave it."""
        self.last_prefill.clear()
        self.just_finished.clear()

    def scheduler(self, **fields) -> "SchedulerStandIn":
        return SchedulerStandIn(self, **fields)

    def evict(self, n: int) -> None:
        self.cache.evict(EvictParams(num_tokens=n))

    # ---- checks ---------------------------------------------------------------------------

    def owned_reqs(self):
        return list(self.running)

    def accounting(self) -> List[str]:
        return kv_accounting_problems(self.elastic, self.owned_reqs())

    def _stamps_ok(self, seq, locs: torch.Tensor) -> bool:
        want = torch.tensor([stamp(seq[: p + 1]) for p in range(len(locs))])
        for buf, sign in self._buffers():
            if not torch.equal(buf[locs][:, 0, 0], sign * want):
                return False
        return True

    def _buffers(self):
        """``(buffer, sign)`` of every per-layer buffer: K (+) and V (-), or MLA's latent (+)."""
        if self.mla:
            return [(b, 1.0) for b in self.kv.kv_buffer]
        return [(b, 1.0) for b in self.kv.k_buffer] + [(b, -1.0) for b in self.kv.v_buffer]

    def kv_problems(self) -> List[str]:
        """Requests and cached prefixes whose KV locations do not hold their own stamps."""
        out = []
        for req in self.running:
            seq = self.seqs[req.rid]
            locs = self.rtp.req_to_token[req.kv.req_pool_idx, : len(seq)].to(torch.int64)
            if int(locs.max()) >= self.elastic.size + self.page_size:
                out.append(f"{req.rid}: a KV index past the pool")
            elif not self._stamps_ok(seq, locs):
                out.append(f"{req.rid}: its KV rows do not hold its stamps")
        for seq in self.seen:
            m = self.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", seq))))
            n = m.device_prefix_len
            if n:
                locs = self.cache.path_device_indices(m.last_device_node)[:n].to(torch.int64)
                if not self._stamps_ok(seq[:n], locs):
                    out.append(f"cached prefix of length {n}: its KV rows do not hold its stamps")
        return out

    def tree_tokens(self) -> int:
        return int(self.cache.tree_core.all_values_flatten().numel())


class SchedulerStandIn:
    """The scheduler's attributes the ``/rebalance_memory`` handler reads, over a
    :class:`KVSim`, as ``ingest_requests`` sees them: ``running_batch.reqs`` (the merged
    requests and those finished in the last step), ``last_batch`` (the last prefill batch,
    ``ForwardMode.EXTEND``, not merged yet; None when nothing was admitted since the last
    merge) and ``chunked_req``."""

    def __init__(self, sim: KVSim, **fields) -> None:
        from types import SimpleNamespace

        self.sim = sim
        self.token_to_kv_pool_allocator = sim.alloc
        self.req_to_token_pool = sim.rtp
        self.tree_cache = sim.cache
        self.chunked_req = None
        self.enable_overlap = False
        self.max_total_num_tokens = sim.elastic.size
        self.invariant_checker = SimpleNamespace(max_total_num_tokens=sim.elastic.size)
        self._elastic_kv = sim.elastic  # the server: SGLANG_ELASTIC_KV_MAX_TOKENS
        for k, v in fields.items():
            setattr(self, k, v)

    @property
    def running_batch(self):
        from types import SimpleNamespace

        merged = [r for r in self.sim.running if r not in self.sim.last_prefill]
        return SimpleNamespace(reqs=merged + list(self.sim.just_finished))

    @property
    def last_batch(self):
        from types import SimpleNamespace

        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        if not self.sim.last_prefill:
            return None
        return SimpleNamespace(reqs=list(self.sim.last_prefill), forward_mode=ForwardMode.EXTEND)


def busy_sim(page_size: int, core: str, seed: int = 0, mla: bool = False) -> "KVSim":
    """A pool with running requests and cached prefixes spread over all its pages: 30 seeded
    admit / decode / finish steps on a 96-token pool (largest 128)."""
    import random

    sim = KVSim(kv_tokens=96, max_tokens=128, page_size=page_size, tree_core=core, mla=mla)
    rng = random.Random(seed)
    for _ in range(30):
        op = rng.random()
        if op < 0.45 or not sim.running:
            sim.admit(random_prompt(rng))
        elif op < 0.8:
            sim.decode(rng.choice(sim.running), rng.randint(20, 60))
        else:
            sim.finish(rng.choice(sim.running))
    assert sim.running and sim.tree_tokens()
    return sim
