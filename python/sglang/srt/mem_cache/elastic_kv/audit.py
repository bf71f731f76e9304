"""A byte-level audit of one KV resize (elastic KV, issue 15), off by default.

With ``SGLANG_ELASTIC_KV_AUDIT=1`` in the scheduler's environment every ``kv_tokens`` step of
``/rebalance_memory`` takes a :func:`snapshot` before the resize and runs :func:`check` after
it; what the check finds is answered as a 500 with the accounting problems
(``managers/memory_rebalance.py``), and which requests' positions moved (old -> new index) is
logged. It reads what a live request reads next:

* every request that holds KV (``scheduler_glue.kv_holders``: the running batch, the last
  prefill batch, the chunked prefill): its ``req_to_token`` row up to ``kv_committed_len``
  (the positions whose KV is written: the tree-owned prefix and its own tokens);
* every radix-tree node's KV value (``tree_values.nodes_holding`` over every index), by node id.

After the resize each of those indices must lie in the pool (rows ``page_size ..
size + page_size - 1``: page 0 is the padding page), must not be on the allocator's free list,
and the K and V rows of every layer it points at must hold the bytes its old index held. The
cost is a copy of every audited token's KV (tests and debugging, not production).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Tuple

import torch

from sglang.srt.mem_cache.elastic_kv import tree_values
from sglang.srt.mem_cache.elastic_kv.accounting import free_pages

logger = logging.getLogger(__name__)

AUDIT_ENV = "SGLANG_ELASTIC_KV_AUDIT"


def enabled() -> bool:
    """Whether ``SGLANG_ELASTIC_KV_AUDIT`` asks for the audit (read at each resize)."""
    return os.environ.get(AUDIT_ENV, "").strip().lower() in ("1", "true", "yes", "on")


@dataclass
class Snapshot:
    """What :func:`snapshot` read before a resize.

    ``reqs``: ``rid -> (req_pool_idx, indices, kv)``; ``tree``: ``node_id -> (indices, kv)``;
    ``indices`` int64, shape ``(n,)``; ``kv`` the K then V rows of every layer at them, one
    tensor per buffer of shape ``(n, head_num, head_dim)`` in the pool's dtype.
    """

    reqs: Dict[str, Tuple[int, torch.Tensor, List[torch.Tensor]]] = field(default_factory=dict)
    tree: Dict[int, Tuple[torch.Tensor, List[torch.Tensor]]] = field(default_factory=dict)


def _buffers(el) -> List[torch.Tensor]:
    from sglang.srt.mem_cache.elastic_kv.resize import kv_buffers

    first, second = kv_buffers(el.kvcache)
    return list(first) + list(second)


def _read(el, idx: torch.Tensor) -> List[torch.Tensor]:
    return [buf[idx].clone() for buf in _buffers(el)]


def _tree_nodes(el) -> List[Tuple[int, torch.Tensor]]:
    if tree_values.tree_core_of(el.tree_cache) is None:
        return []
    every = tree_values.tree_core_of(el.tree_cache).all_values_flatten()
    rows = max(el.size + el.page_size, int(every.max()) + 1 if every.numel() else 0)
    # every index, also one past the pool (a value the resize left stale): check says so
    return tree_values.nodes_holding(el.tree_cache, torch.ones(rows, dtype=torch.bool))


def _row(el, req) -> Tuple[int, torch.Tensor]:
    kv = req.kv
    rt = el.req_to_token_pool.req_to_token
    return kv.req_pool_idx, rt[kv.req_pool_idx, : kv.kv_committed_len].to(torch.int64).clone()


def snapshot(el, reqs: Iterable) -> Snapshot:
    """Read the indices and KV bytes of every live request and tree node (before a resize).

    Args:
        el: the scheduler's :class:`.resize.ElasticKV`.
        reqs: the requests that hold KV (``scheduler_glue.kv_holders``).
    """
    snap = Snapshot()
    for req in reqs:
        row, idx = _row(el, req)
        snap.reqs[str(req.rid)] = (row, idx, _read(el, idx))
    for node_id, value in _tree_nodes(el):
        idx = value.to(torch.int64).clone()
        snap.tree[int(node_id)] = (idx, _read(el, idx))
    return snap


def _where_wrong(el, what: str, idx: torch.Tensor, kv, free: torch.Tensor) -> List[str]:
    ps, top = el.page_size, el.size + el.page_size
    if idx.numel() == 0:
        return []
    out = []
    outside = (idx < ps) | (idx >= top)
    if bool(outside.any()):
        pos = torch.nonzero(outside).flatten()[:4].tolist()
        out.append(
            f"{what}: {int(outside.sum())} indices outside the pool's rows {ps}..{top - 1} "
            f"(positions {pos}: {idx[pos].tolist()})"
        )
        return out
    on_free = torch.isin(idx // ps, free)
    if bool(on_free.any()):
        pos = torch.nonzero(on_free).flatten()[:4].tolist()
        out.append(
            f"{what}: {int(on_free.sum())} indices on free pages (positions {pos}: "
            f"{idx[pos].tolist()})"
        )
    bad = torch.zeros(idx.numel(), dtype=torch.bool)
    for before, buf in zip(kv, _buffers(el)):
        bad |= (buf[idx] != before).flatten(1).any(dim=1)
    if bool(bad.any()):
        pos = torch.nonzero(bad).flatten()[:4].tolist()
        out.append(
            f"{what}: the KV at {int(bad.sum())} of {idx.numel()} positions differs from "
            f"before the resize (positions {pos}, now at {idx[pos].tolist()})"
        )
    return out


def check(el, snap: Optional[Snapshot], reqs: Iterable) -> List[str]:
    """What a live request or tree node would read wrong after the resize (empty: nothing);
    logs, per request, how many of its positions moved and the first few old -> new indices.

    Args:
        el: the :class:`.resize.ElasticKV` that resized.
        snap: :func:`snapshot` from before the resize (None: no audit, nothing checked).
        reqs: the requests that hold KV now (the same as at the snapshot: a resize neither
            finishes nor retracts a request).
    """
    if snap is None:
        return []
    problems: List[str] = []
    free = free_pages(el.allocator)
    now = {str(r.rid): r for r in reqs}
    for rid, (row, old, kv) in snap.reqs.items():
        req = now.get(rid)
        if req is None or req.kv.req_pool_idx is None:
            problems.append(f"request {rid}: held KV before the resize and none after it")
            continue
        new_row, idx = _row(el, req)
        if new_row != row or idx.numel() != old.numel():
            problems.append(
                f"request {rid}: row {row} of {old.numel()} positions became row {new_row} "
                f"of {idx.numel()}"
            )
            continue
        moved = old != idx
        if bool(moved.any()):
            pos = torch.nonzero(moved).flatten()[:3].tolist()
            logger.info(
                "elastic KV audit: request %s: %d of %d positions moved (%s)",
                rid,
                int(moved.sum()),
                idx.numel(),
                ", ".join(f"{p}: {int(old[p])} -> {int(idx[p])}" for p in pos),
            )
        problems += _where_wrong(el, f"request {rid}", idx, kv, free)
    after = dict(_tree_nodes(el))
    for node_id, (old, kv) in snap.tree.items():
        value = after.get(node_id)
        if value is None:  # evicted by the resize (an evictable prefix: no request reads it)
            continue
        idx = value.to(torch.int64)
        if idx.numel() != old.numel():
            problems.append(f"tree node {node_id}: {old.numel()} indices became {idx.numel()}")
            continue
        problems += _where_wrong(el, f"tree node {node_id}", idx, kv, free)
    for p in problems:
        logger.error("elastic KV audit: %s", p)
    return problems
