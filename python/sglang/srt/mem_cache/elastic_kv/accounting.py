"""The KV page accounting check run after every resize (elastic KV, issue 15): every page of
the pool is either free or owned, never both and never twice, and nothing points past the
pool."""

from __future__ import annotations

from typing import Iterable, List

import torch


def free_pages(alloc) -> torch.Tensor:
    """Every page the allocator ``alloc`` holds as free, int64 [n]: its free list, the pages
    it staged and those it has yet to release (upstream's paged allocator keeps all three)."""
    return torch.cat(
        [alloc.free_pages.to(torch.int64)]
        + [p.to(torch.int64) for p in getattr(alloc, "staged_pages", [])]
        + (
            [alloc.release_pages.to(torch.int64)]
            if getattr(alloc, "release_pages", None) is not None
            else []
        )
    )


def kv_accounting_problems(elastic, reqs: Iterable) -> List[str]:
    """What is wrong with the allocator's counts against the tree and the requests.

    Args:
        elastic: a :class:`.resize.ElasticKV`.
        reqs: the requests that hold KV outside the tree (running, and a chunked prefill);
            each owns ``req_to_token[req_pool_idx, cache_protected_len:kv_allocated_len]``.

    Returns:
        Problems as sentences (empty: consistent): a page free and owned, a page neither
        (leaked), a token owned twice, an index past the pool, free-list duplicates.
    """
    ps = elastic.page_size
    pages = elastic.size // ps
    free = free_pages(elastic.allocator)
    problems: List[str] = []
    if len(torch.unique(free)) != len(free):
        problems.append(f"the free list has {len(free) - len(torch.unique(free))} duplicate pages")
    if free.numel() and (int(free.min()) < 1 or int(free.max()) > pages):
        problems.append(
            f"free pages outside 1..{pages}: {sorted(set(free.tolist()) - set(range(1, pages + 1)))[:8]}"
        )
    owned = []
    core = getattr(elastic.tree_cache, "tree_core", None)
    if core is not None:
        owned.append(core.all_values_flatten().to(torch.int64))
    rt = elastic.req_to_token_pool.req_to_token
    for r in reqs:
        kv = r.kv
        if kv.req_pool_idx is None:
            continue
        owned.append(
            rt[kv.req_pool_idx, kv.cache_protected_len : kv.kv_allocated_len].to(torch.int64)
        )
    owned_tok = torch.cat(owned) if owned else torch.empty(0, dtype=torch.int64)
    if len(torch.unique(owned_tok)) != len(owned_tok):
        problems.append(
            f"{len(owned_tok) - len(torch.unique(owned_tok))} KV tokens are owned twice"
        )
    if owned_tok.numel() and (
        int(owned_tok.min()) < ps or int(owned_tok.max()) >= (pages + 1) * ps
    ):
        problems.append(f"owned KV tokens outside the pool's rows {ps}..{(pages + 1) * ps - 1}")
        return problems
    owned_pages = torch.unique(owned_tok // ps)
    both = set(owned_pages.tolist()) & set(free.tolist())
    if both:
        problems.append(f"{len(both)} pages are free and owned: {sorted(both)[:8]}")
    leaked = set(range(1, pages + 1)) - set(owned_pages.tolist()) - set(free.tolist())
    if leaked:
        problems.append(
            f"{len(leaked)} pages are neither free nor owned (leaked): {sorted(leaked)[:8]}"
        )
    return problems
