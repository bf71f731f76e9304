"""Shrinking and growing the KV token pool at a safe point (elastic KV pages, issue 15;
FreeToken §3.3 "Runtime cache reconfiguration", extended from expert slots to KV pages).

:class:`ElasticKV` owns the resize of one MHA KV pool, its token-to-KV allocator, the request
rows (``req_to_token``) and the radix tree's KV values. A hybrid model's pool
(``HybridLinearKVPool``: Qwen3-Next, Qwen3.5) holds its full-attention layers' KV in such an MHA
pool (``full_kv_pool``), indexed by the same token rows; that inner pool is what resizes, and
the wrapper's size follows. Its recurrent states live in the request-indexed state pool,
which a token resize does not touch (neither do the tree's state values or anchor checkpoints:
slot ids, not token rows). An MLA pool (``MLATokenToKVPool``: DeepSeek-V2/V3 and models of
their architecture, e.g. Kimi-K2) holds one latent row per token and layer (``kv_buffer``)
instead of a K and a V row: the same resize over one buffer list (:func:`kv_buffers`).

Pages are the allocator's units (page
``p`` holds token rows ``[p * page_size, (p + 1) * page_size)``; page 0 is the padding page
and never moves); a pool of ``size`` tokens owns pages ``1 .. size // page_size``.

Shrink to ``new_size`` tokens (a page multiple), in this order:

1. plan (dry run stops here, nothing changed): the floor is the tokens nothing can free (held
   by requests or locked in the tree) plus ``reserve_tokens`` (what the running requests may
   still need, the caller's figure), rounded up to a page; a target below it is refused
   (:class:`KVResizeRefused`, naming the floor). The live pages past the new last page must
   move to free pages below it; when there are fewer free pages below than live pages
   above, evictable prefixes are evicted (the tree's own LRU order), exactly the shortfall;
2. find the tree nodes whose values hold moving pages (:mod:`.tree_values`);
3. copy the moving pages' K and V rows of every layer to their new pages;
4. rewrite: ``req_to_token`` (every row: running requests and their tree-owned prefixes), the
   tree nodes' values, and whatever else the caller registered (``extra_remaps``) through one
   remap table; point of no return;
5. the allocator's free list keeps the free pages below the boundary, minus the destinations;
   sizes change; the buffers become views of the leading rows and the tail's memory is
   released (:class:`.backing.HostKVBacking`).

Nothing after the point of no return raises: each of steps 4 and 5 runs whatever the ones
before it did, and what failed is logged and returned in ``errors`` (the pool is at the new
size; the caller's accounting check says whether the indices are consistent).

Grow to ``new_size``: commit the new rows' memory first (a failure there releases them and
raises :class:`KVResizeFailed`, the pool unchanged), then append the new pages to the free list.

Requests keep their KV: their pages move, their indices are rewritten, no request is aborted
or retracted; prefix lookups give the same prefixes (every node keeps its key, and the moved
pages hold the same bytes).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch

from sglang.srt.mem_cache.elastic_kv import tree_values
from sglang.srt.mem_cache.elastic_kv.backing import CommitFailed, HostKVBacking

logger = logging.getLogger(__name__)


class KVResizeRefused(ValueError):
    """A KV target the pool cannot take (HTTP 400); nothing changed. The message names the
    floor or the largest feasible target."""


class KVResizeFailed(RuntimeError):
    """A resize failed while running and rolled back (HTTP 500); the pool keeps serving at its
    previous size."""


@dataclass
class KVPlan:
    """What a resize will do (:meth:`ElasticKV.plan`)."""

    old_size: int
    new_size: int
    floor: int
    evict_tokens: int = 0  # tokens of evictable prefixes that must go first (an upper bound)
    src_pages: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    dst_pages: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))


def token_pool(kvcache):
    """``(pool, wrapper)``: the pool whose buffers hold the token rows, and the hybrid pool
    around it (``HybridLinearKVPool``, whose ``size`` follows the inner pool's) or None."""
    from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool

    if type(kvcache) is HybridLinearKVPool:
        return kvcache.full_kv_pool, kvcache
    return kvcache, None


def _is_mla(kv) -> bool:
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    return type(kv) is MLATokenToKVPool


def kv_buffers(kv) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """The per-layer buffers that hold token rows, as two lists (the pool's own): an MHA
    pool's ``(k_buffer, v_buffer)``, ``(rows, head_num, head_dim)`` each; an MLA pool's
    ``(kv_buffer, [])``, ``(rows, 1, kv_lora_rank + qk_rope_head_dim)`` each."""
    if _is_mla(kv):
        return kv.kv_buffer, []
    return kv.k_buffer, kv.v_buffer


def _set_buffers(kv, first: List[torch.Tensor], second: List[torch.Tensor]) -> None:
    """Install new buffer lists (:func:`kv_buffers`' layout) and :func:`_refresh`."""
    if _is_mla(kv):
        kv.kv_buffer = first
    else:
        kv.k_buffer, kv.v_buffer = first, second
    _refresh(kv)


def _refresh(kv) -> None:
    """Recompute what the pool derived from its buffers' pointers."""
    if _is_mla(kv):
        kv.data_ptrs = torch.tensor(
            [x.data_ptr() for x in kv.kv_buffer], dtype=torch.uint64, device=kv.device
        )
    else:
        kv._kv_buffer_descs = kv._build_kv_buffer_descs()
        kv._init_data_ptrs_and_strides()


def _supported(kvcache) -> Optional[str]:
    """Why ``kvcache`` cannot be resized here (None: it can)."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    pool, wrapper = token_pool(kvcache)
    if type(pool) is not MHATokenToKVPool and not _is_mla(pool):
        what = type(pool).__name__
        if wrapper is not None:
            what = f"{type(wrapper).__name__} over {what}"
        return (
            f"{what} (MHATokenToKVPool and MLATokenToKVPool resize, alone or as a hybrid "
            "model's full-attention pool)"
        )
    kvcache = pool
    if str(kvcache.device) != "cpu":
        return f"a KV pool on {kvcache.device} (only the CPU backing is built)"
    if (
        getattr(kvcache, "k_scale_buffer", None) is not None
        or getattr(kvcache, "kv_scale_buffer", None) is not None
        or getattr(kvcache, "is_quantized_kv_cache", False)
    ):
        return "a quantized KV cache"
    if getattr(kvcache, "kv_cache_layout", "nhd") != "nhd":
        return f"the {kvcache.kv_cache_layout} KV layout"
    if _is_mla(kvcache) and (kvcache.use_dsa or kvcache.dcp_replicated):
        return "an MLA pool with a sparse-attention indexer or decode context parallelism"
    return None


class ElasticKV:
    """The resizable KV side of one scheduler.

    Args:
        kvcache: ``MHATokenToKVPool`` (NHD layout) or ``MLATokenToKVPool`` (no indexer) on
            the CPU, not quantized, or a ``HybridLinearKVPool`` whose full-attention pool is
            one of them.
        allocator: its ``TokenToKVPoolAllocator`` or ``PagedTokenToKVPoolAllocator``.
        req_to_token_pool: the ``ReqToTokenPool`` whose ``req_to_token`` rows hold KV indices.
        tree_cache: the prefix cache (``UnifiedRadixCache``) or None.
        max_tokens: the largest pool a grow may reach (default: the current size); address
            space for it is reserved at the first resize.

    Raises:
        KVResizeRefused: a pool this module cannot resize (the message says which).
    """

    def __init__(self, kvcache, allocator, req_to_token_pool, tree_cache=None, max_tokens=None):
        why = _supported(kvcache)
        core = getattr(tree_cache, "tree_core", None)
        if why is None and core is not None and getattr(core, "enable_hicache", False):
            why = "a hierarchical cache (host copies of the tree's pages are not remapped)"
        if why is not None:
            raise KVResizeRefused(f"KV pages cannot resize on {why}")
        # the pool whose buffers hold the token rows, and the hybrid wrapper around it
        self.kvcache, self.wrapper = token_pool(kvcache)
        self.allocator = allocator
        self.req_to_token_pool = req_to_token_pool
        self.tree_cache = tree_cache
        self.page_size = int(allocator.page_size)
        size = int(allocator.size)
        self.max_tokens = int(max_tokens if max_tokens is not None else size)
        self.max_tokens -= self.max_tokens % self.page_size
        if self.max_tokens < size:
            raise KVResizeRefused(f"max_tokens {self.max_tokens} is below the pool's {size}")
        self.backing: Optional[HostKVBacking] = None
        # Callables taking the remap table (int64, old rows) that rewrite other copies of KV
        # indices (the scheduler's batch tensors); run in step 4.
        self.extra_remaps: List[Callable[[torch.Tensor], None]] = []
        self.resizes = 0
        self.resize_failures = 0
        self.last_resize_ms: Optional[float] = None

    # ---- sizes --------------------------------------------------------------------------

    @property
    def size(self) -> int:
        """Pool size in tokens (excluding the padding page)."""
        return int(self.allocator.size)

    @property
    def token_bytes(self) -> int:
        """Bytes of one token over every layer's buffers (K and V, or MLA's latent row)."""
        first, second = kv_buffers(self.kvcache)
        return sum(b[0].numel() * b.element_size() for b in list(first) + list(second))

    def held_tokens(self) -> int:
        return self.size - int(self.allocator.available_size())

    def evictable_tokens(self) -> int:
        if self.tree_cache is None:
            return 0
        return int(self.tree_cache.evictable_size())

    def floor(self, reserve_tokens: int = 0) -> int:
        """The smallest pool (tokens, a page multiple) a shrink can reach now: tokens held and
        not evictable, plus ``reserve_tokens``, plus one page."""
        need = self.held_tokens() - self.evictable_tokens() + max(0, int(reserve_tokens))
        ps = self.page_size
        return max(ps, -(-need // ps) * ps)

    # ---- the allocator's free pages -------------------------------------------------------

    def _free_pages(self) -> torch.Tensor:
        """Every free page id (int64, sorted), after merging the allocator's staged frees."""
        alloc = self.allocator
        if getattr(alloc, "free_group", None) is not None:
            raise KVResizeRefused("the allocator is inside a free group; resize at a safe point")
        alloc.merge_and_sort_free()
        free = alloc.free_pages.to(torch.int64)
        return torch.sort(free).values

    def _set_free_pages(self, pages: torch.Tensor) -> None:
        alloc = self.allocator
        alloc.free_pages = pages.to(alloc.free_pages.dtype)
        if hasattr(alloc, "release_pages") and alloc.release_pages is not None:
            alloc.release_pages = alloc.release_pages[:0]
        if hasattr(alloc, "staged_pages"):
            alloc.staged_pages = []
            alloc.num_staged_pages = 0

    # ---- plan -----------------------------------------------------------------------------

    def target(self, new_size: int) -> int:
        """``new_size`` rounded down to a page (the pool's unit)."""
        return int(new_size) - int(new_size) % self.page_size

    def plan(self, new_size: int, reserve_tokens: int = 0) -> KVPlan:
        """Check a target and say what the resize would do; changes nothing.

        Raises:
            KVResizeRefused: below :meth:`floor` or above :attr:`max_tokens`.
        """
        new_size = self.target(new_size)
        old = self.size
        floor = self.floor(reserve_tokens)
        if new_size > self.max_tokens:
            raise KVResizeRefused(
                f"{new_size} KV tokens is above the largest feasible target, {self.max_tokens} "
                f"tokens ({self.max_tokens * self.token_bytes} bytes, the address space "
                "reserved for the KV pool)"
            )
        if new_size < floor:
            raise KVResizeRefused(
                f"{new_size} KV tokens is below the floor of {floor} tokens "
                f"({floor * self.token_bytes} bytes): {self.held_tokens() - self.evictable_tokens()} "
                f"tokens are held by requests or locked prefixes and {max(0, int(reserve_tokens))} "
                "are reserved for the running requests' remaining output"
            )
        plan = KVPlan(old_size=old, new_size=new_size, floor=floor)
        if new_size >= old:
            return plan
        new_pages = new_size // self.page_size
        free = self._free_pages()
        free_low = int((free <= new_pages).sum())
        free_high = int((free > new_pages).sum())
        live_high = (old // self.page_size - new_pages) - free_high
        plan.evict_tokens = max(0, live_high - free_low) * self.page_size
        return plan

    def _moves(self, new_pages: int):
        """``(src_pages, dst_pages)``: live pages past ``new_pages`` and the free pages below
        it they move to (int64, sorted)."""
        old_pages = self.size // self.page_size
        free = self._free_pages()
        is_free = torch.zeros(old_pages + 1, dtype=torch.bool)
        is_free[free] = True
        high = torch.arange(new_pages + 1, old_pages + 1, dtype=torch.int64)
        src = high[~is_free[high]]
        low_free = free[free <= new_pages]
        if len(low_free) < len(src):
            raise KVResizeFailed(
                f"{len(src)} live pages past page {new_pages} but only {len(low_free)} free "
                "pages below it after eviction"
            )
        return src, low_free[: len(src)], low_free[len(src) :]

    def _tokens(self, pages: torch.Tensor) -> torch.Tensor:
        ps = self.page_size
        return (pages[:, None] * ps + torch.arange(ps, dtype=torch.int64)).reshape(-1)

    # ---- backing --------------------------------------------------------------------------

    def reserve(self) -> None:
        """Move the pool's buffers into mappings reserved for :attr:`max_tokens` (once; the
        first resize does it if nobody did: that call then also copies the pool, one layer at
        a time, so the process holds the pool plus one layer at the peak).

        Raises:
            OSError: a reservation was refused; the layers moved so far stay moved (the pool
                reads the same KV through its refreshed pointers) and the next call moves
                every layer again.
        """
        if self.backing is not None:
            return
        kv = self.kvcache
        rows = self.size + self.page_size
        try:
            backing = HostKVBacking(*kv_buffers(kv), self.max_tokens + self.page_size)
        finally:  # layers that moved have new pointers, also when a later one failed
            _refresh(kv)
        self.backing = backing
        self._install_views(rows)

    def _install_views(self, rows: int) -> None:
        _set_buffers(self.kvcache, *self.backing.views(rows))

    def _set_size(self, new_size: int) -> None:
        alloc, kv = self.allocator, self.kvcache
        alloc.size = new_size
        if hasattr(alloc, "num_pages"):
            alloc.num_pages = new_size // self.page_size
        kv.size = new_size
        self._install_views(new_size + self.page_size)
        kv.mem_usage = (new_size + self.page_size) * self.token_bytes / (1 << 30)
        if self.wrapper is not None:
            self.wrapper.size = new_size
            self.wrapper.mem_usage = kv.mem_usage

    # ---- resize ---------------------------------------------------------------------------

    def resize(
        self,
        new_size: int,
        *,
        reserve_tokens: int = 0,
        dry_run: bool = False,
        on_step: Optional[Callable[[str], None]] = None,
    ) -> Dict[str, object]:
        """Resize the pool to ``new_size`` tokens (rounded down to a page) now; call only at a
        safe point (no forward pass running, no free group open).

        Args:
            reserve_tokens: tokens the floor keeps for the running requests' remaining output.
            dry_run: plan only.
            on_step: called with each step's name before it runs (``"evict"``, ``"find"``,
                ``"copy"``, ``"rewrite"``, ``"release"``; grow: ``"commit"``, ``"extend"``);
                an exception it raises is a failure injected at that step (tests).

        Returns:
            ``{"previous_tokens", "kv_tokens", "moved_pages", "evicted_tokens",
            "released_bytes", "committed_bytes", "time_ms", "dry_run", "errors"}``;
            ``errors``: what failed after the point of no return (logged; the pool is at
            ``kv_tokens`` all the same), empty when nothing did.

        Raises:
            KVResizeRefused: the target is refused (:meth:`plan`); nothing changed.
            KVResizeFailed: a step before the point of no return failed; the pool is as it
                was (evicted prefixes stay evicted: they were evictable).
        """
        t0 = time.perf_counter()
        step = on_step or (lambda name: None)
        plan = self.plan(new_size, reserve_tokens)
        out = dict(
            previous_tokens=plan.old_size,
            kv_tokens=plan.new_size if not dry_run else plan.old_size,
            target_tokens=plan.new_size,
            floor_tokens=plan.floor,
            moved_pages=0,
            evicted_tokens=0,
            released_bytes=0,
            committed_bytes=0,
            dry_run=dry_run,
            errors=[],
        )
        if dry_run or plan.new_size == plan.old_size:
            out["time_ms"] = (time.perf_counter() - t0) * 1e3
            return out
        try:
            self.reserve()
            if plan.new_size > plan.old_size:
                out["committed_bytes"] = self._grow(plan.new_size, step, out["errors"])
            else:
                moved, evicted, released = self._shrink(plan, step, out["errors"])
                out.update(moved_pages=moved, evicted_tokens=evicted, released_bytes=released)
        except (KVResizeRefused, KVResizeFailed):
            self.resize_failures += 1
            raise
        except Exception as e:
            self.resize_failures += 1
            raise KVResizeFailed(
                f"resizing the KV pool to {plan.new_size} tokens failed "
                f"({type(e).__name__}: {e}); it is back at {self.size} tokens and keeps serving"
            ) from e
        self.resizes += 1
        if out["errors"]:
            self.resize_failures += 1
        self.last_resize_ms = out["time_ms"] = (time.perf_counter() - t0) * 1e3
        return out

    def _past_no_return(self, errors: List[str], what: str, fn: Callable[[], object]):
        """``fn()``, past the point of no return: an exception is logged and appended to
        ``errors``, never raised (None is returned)."""
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - the pool has changed: go on, report it
            logger.exception("elastic KV: %s failed after the point of no return", what)
            errors.append(f"{what}: {type(e).__name__}: {e}")
            return None

    def _grow(self, new_size: int, step, errors: List[str]) -> int:
        old = self.size
        ps = self.page_size
        step("commit")
        try:
            self.backing.commit(old + ps, new_size + ps)
        except CommitFailed as e:
            raise KVResizeFailed(
                f"growing the KV pool to {new_size} tokens could not commit its memory ({e}); "
                f"it is back at {old} tokens and keeps serving"
            ) from e
        try:
            step("extend")
            free = self._free_pages()
            new = torch.arange(old // ps + 1, new_size // ps + 1, dtype=torch.int64)
            free = torch.cat([free, new])
        except Exception:
            self.backing.release(old + ps)
            raise
        # -- point of no return --
        self._past_no_return(errors, "the free list", lambda: self._set_free_pages(free))
        self._past_no_return(errors, "the pool size", lambda: self._set_size(new_size))
        return (new_size - old) * self.token_bytes

    def _shrink(self, plan: KVPlan, step, errors: List[str]):
        new_pages = plan.new_size // self.page_size
        evicted = 0
        if plan.evict_tokens:
            step("evict")
            from sglang.srt.mem_cache.base_prefix_cache import EvictParams

            before = self.allocator.available_size()
            for _ in range(64):  # each round evicts the remaining shortfall (LRU first)
                short = self.plan(plan.new_size).evict_tokens
                if short == 0:
                    break
                freed = self.tree_cache.evict(EvictParams(num_tokens=short))
                if not getattr(freed, "num_tokens_evicted", 1):
                    break
            evicted = int(self.allocator.available_size() - before)
        src, dst, rest = self._moves(new_pages)
        src_tok, dst_tok = self._tokens(src), self._tokens(dst)
        rows = plan.old_size + self.page_size
        moving = torch.zeros(rows, dtype=torch.bool)
        moving[src_tok] = True
        step("find")
        nodes = tree_values.nodes_holding(self.tree_cache, moving)
        step("copy")
        first, second = kv_buffers(self.kvcache)
        for buf in list(first) + list(second):
            buf[dst_tok] = buf[src_tok]
        remap = torch.arange(rows, dtype=torch.int64)
        remap[src_tok] = dst_tok
        step("rewrite")  # the last step that may fail: nothing observable changed yet
        # -- point of no return: nothing below raises (_past_no_return) --
        ok = self._past_no_return
        ok(errors, "rewriting req_to_token", lambda: self._rewrite_rows(remap))
        ok(errors, "rewriting the tree's values", lambda: tree_values.rewrite(nodes, remap))
        for fn in self.extra_remaps:
            ok(errors, f"the remap {getattr(fn, '__name__', fn)!r}", lambda fn=fn: fn(remap))
        ok(errors, "the free list", lambda: self._set_free_pages(rest))
        ok(errors, "the pool size", lambda: self._set_size(plan.new_size))
        released = ok(
            errors,
            "releasing the tail's memory",
            lambda: self.backing.release(plan.new_size + self.page_size),
        )
        return len(src), evicted, released or 0

    def _rewrite_rows(self, remap: torch.Tensor) -> None:
        """``req_to_token[r] = remap[req_to_token[r]]`` for every row, a row at a time: a row
        is ``context length`` int32 entries (1 MiB at 262144), the whole table can be tens of
        MB, and temporaries that large would stay in the allocator's heap after the shrink
        instead of going back to the OS."""
        rt = self.req_to_token_pool.req_to_token
        top = len(remap) - 1
        for r in range(rt.shape[0]):
            row = rt[r]
            row.copy_(remap[row.to(torch.int64).clamp_(0, top)].to(rt.dtype))

    # ---- accounting -----------------------------------------------------------------------

    def split(self) -> Dict[str, object]:
        """The KV side as ``GET /rebalance_memory`` reports it."""
        tb = self.token_bytes
        return dict(
            kv_tokens=self.size,
            kv_tokens_free=int(self.allocator.available_size()),
            kv_bytes=(self.size + self.page_size) * tb,
            kv_token_bytes=tb,
            kv_max_tokens=self.max_tokens,
            kv_floor_tokens=self.floor(),
            kv_resident_bytes=self.backing.resident_bytes() if self.backing else None,
            kv_resizes=self.resizes,
            kv_resize_failures=self.resize_failures,
            kv_last_resize_ms=self.last_resize_ms,
        )
