"""The scheduler's side of elastic KV (issue 15): which pools and requests a KV resize touches,
what the running requests still need, and the copies of the pool size the scheduler's
components keep.

Called by ``managers/memory_rebalance.py`` at the safe point (the top of an event-loop
iteration, no batch in flight: the CPU server runs without the overlap scheduler).
"""

from __future__ import annotations

import logging
import os
from typing import List, Optional, Tuple

from sglang.srt.mem_cache.elastic_kv.accounting import kv_accounting_problems
from sglang.srt.mem_cache.elastic_kv.resize import ElasticKV, KVResizeRefused

logger = logging.getLogger(__name__)

# The largest KV pool a grow may reach, in tokens (default: the size the server started with).
MAX_TOKENS_ENV = "SGLANG_ELASTIC_KV_MAX_TOKENS"


def elastic_kv_of(scheduler) -> Tuple[Optional[ElasticKV], str]:
    """The scheduler's :class:`ElasticKV` (made at the first call), or ``(None, why not)``."""
    el = getattr(scheduler, "_elastic_kv", None)
    if el is not None:
        return el, ""
    if getattr(scheduler, "enable_overlap", False):
        return (
            None,
            "KV pages resize only without the overlap scheduler (--disable-overlap-schedule)",
        )
    alloc = scheduler.token_to_kv_pool_allocator
    try:
        raw = os.environ.get(MAX_TOKENS_ENV)
        el = ElasticKV(
            alloc.get_kvcache(),
            alloc,
            scheduler.req_to_token_pool,
            scheduler.tree_cache,
            max_tokens=int(raw) if raw else None,
        )
    except (KVResizeRefused, AttributeError, TypeError, ValueError) as e:
        return None, str(e)
    scheduler._elastic_kv = el
    return el, ""


def kv_holders(scheduler) -> List:
    """Requests that hold KV outside the tree at a safe point (each once): the running batch,
    the last prefill batch and the chunked prefill.

    The safe point is ``ingest_requests``, before ``get_next_batch_to_run`` merges the last
    batch into the running one (upstream ``scheduler.py``, ``event_loop_normal``): when that
    batch was a prefill (``forward_mode.is_extend()``), its requests are in neither
    ``running_batch.reqs`` nor ``chunked_req`` yet. Requests without a ``req_to_token`` row
    (finished and released, or retracted) hold no KV and are left out."""
    reqs: List = []
    seen = set()

    def add(req) -> None:
        if req is None or id(req) in seen:
            return
        seen.add(id(req))
        kv = getattr(req, "kv", None)
        if kv is not None and kv.req_pool_idx is not None:
            reqs.append(req)

    for req in getattr(scheduler.running_batch, "reqs", None) or []:
        add(req)
    last = getattr(scheduler, "last_batch", None)
    mode = getattr(last, "forward_mode", None)
    if last is not None and mode is not None and mode.is_extend():
        for req in getattr(last, "reqs", None) or []:
            add(req)
    add(getattr(scheduler, "chunked_req", None))
    return reqs


def remaining_tokens(req) -> int:
    """KV tokens ``req`` may still write: up to ``len(origin_input_ids) + max_new_tokens - 1``
    positions in all (the prefill writes the prompt and samples the first token; each decode
    writes the previous token's KV and samples the next; the last token's KV is never written),
    and at least its ``fill_ids`` (``origin_input_ids + output_ids``: what a retracted
    request's re-prefill writes), less the ``kv_allocated_len`` it holds."""
    max_new = int(getattr(req.sampling_params, "max_new_tokens", None) or 0)
    fill = len(req.origin_input_ids) + len(req.output_ids)
    total = max(fill, len(req.origin_input_ids) + max_new - 1)
    return max(0, total - int(req.kv.kv_allocated_len))


def reserve_tokens(scheduler) -> int:
    """KV tokens the running requests may still need (:func:`remaining_tokens` of each),
    rounded to pages per request: a request allocates whole pages past the ones it holds,
    ``ceil((allocated + remaining) / page_size) - ceil(allocated / page_size)``. A shrink keeps
    them, so no running request is retracted for lack of KV pages because of it. Finished
    requests (their KV is released at the end of the step that finished them, or goes to the
    tree) need none."""
    ps = int(getattr(scheduler.token_to_kv_pool_allocator, "page_size", 1) or 1)
    pages = 0
    for req in kv_holders(scheduler):
        if req.finished():
            continue
        alloc = int(req.kv.kv_allocated_len)
        rem = remaining_tokens(req)
        pages += -(-(alloc + rem) // ps) - -(-alloc // ps)
    return pages * ps


def request_limits(scheduler, tokens: int) -> Tuple[int, int]:
    """``(max_req_len, max_req_input_len)`` for a pool of ``tokens``: upstream's formula
    (``TpModelWorker.get_worker_info``: ``min(context_len - 1, kv_capacity - 1)``, the input
    limit 5 less, or whatever the startup gap was, e.g. a dLLM block more), where
    ``kv_capacity`` is ``tokens`` times the KV shard widening. The startup values are kept on
    the scheduler at the first call (``_elastic_kv_limits``); without a ``model_config`` the
    limits never rise above them."""
    start = getattr(scheduler, "_elastic_kv_limits", None)
    if start is None:
        start = (int(scheduler.max_req_len), int(scheduler.max_req_input_len))
        scheduler._elastic_kv_limits = start
    widen = int(getattr(scheduler, "kv_shard_widening", 1) or 1)
    context = getattr(getattr(scheduler, "model_config", None), "context_len", None)
    top = int(context) - 1 if context else start[0]
    max_req_len = max(1, min(top, tokens * widen - 1))
    return max_req_len, max(1, max_req_len - (start[0] - start[1]))


def _write(obj, name: str, value) -> None:
    """``obj.name = value``; a frozen dataclass through ``object.__setattr__`` (the documented
    way around ``frozen``), which a ``msgspec.Struct`` (upstream's ``BeamCoordinator``)
    refuses while taking a plain ``setattr``.

    Raises:
        AttributeError, TypeError: neither way could write it."""
    try:
        setattr(obj, name, value)
    except AttributeError:  # dataclasses.FrozenInstanceError
        object.__setattr__(obj, name, value)


def publish_size(scheduler, tokens: int) -> None:
    """Tell the scheduler and its components the pool's new size (tokens): the idle invariant
    check, the pool statistics and the load reports read their own copies; and the request
    limits that follow from it (:func:`request_limits`: ``max_req_len``, which caps a new
    request's ``max_new_tokens``, and ``max_req_input_len``, above which a new request is
    refused with upstream's "Input length ... exceeds the maximum allowed length" or, with
    ``--allow-auto-truncate``, truncated), so that after a shrink a new request that cannot
    fit the pool is refused at arrival instead of waiting for KV pages forever.

    Upstream's components take the size as a constructor constant, some of them frozen
    dataclasses (``SchedulerPoolStatsObserver``, ``SchedulerLoadInquirer``); a resize changes
    it, so it is written by :func:`_write` at the safe point, where none of them runs. Never
    raises (the pool has already resized)."""
    scheduler.max_total_num_tokens = tokens
    if hasattr(scheduler, "max_req_len") and hasattr(scheduler, "max_req_input_len"):
        try:
            scheduler.max_req_len, scheduler.max_req_input_len = request_limits(scheduler, tokens)
        except (AttributeError, TypeError, ValueError) as e:
            logger.error("elastic KV: the request limits keep their old values (%s)", e)
        beams = getattr(scheduler, "beam_coordinator", None)
        if beams is not None and hasattr(beams, "max_req_len"):
            try:
                _write(beams, "max_req_len", scheduler.max_req_len)
            except (AttributeError, TypeError) as e:
                logger.error("elastic KV: the beam coordinator keeps its old max_req_len (%s)", e)
    widen = int(getattr(scheduler, "kv_shard_widening", 1) or 1)
    for name, value in (
        ("pool_stats_observer", tokens * widen),
        ("invariant_checker", tokens * widen),
        ("load_inquirer", tokens * widen),
        ("kv_events_publisher", tokens),
    ):
        comp = getattr(scheduler, name, None)
        if comp is not None and hasattr(comp, "max_total_num_tokens"):
            try:
                _write(comp, "max_total_num_tokens", value)
            except (AttributeError, TypeError) as e:
                logger.error("elastic KV: %s keeps the old pool size (%s)", name, e)


def check_accounting(scheduler, el: ElasticKV) -> List[str]:
    """:func:`kv_accounting_problems` for the scheduler's requests; logs what it finds."""
    problems = kv_accounting_problems(el, kv_holders(scheduler))
    for p in problems:
        logger.error("elastic KV accounting: %s", p)
    return problems


def audit_snapshot(scheduler, el: ElasticKV):
    """:func:`.audit.snapshot` of the scheduler's KV holders when ``SGLANG_ELASTIC_KV_AUDIT``
    asks for it, else None. Never raises (a failed snapshot is logged; the resize goes on
    unaudited and :func:`audit_check` says so)."""
    from sglang.srt.mem_cache.elastic_kv import audit

    if not audit.enabled():
        return None
    try:
        return audit.snapshot(el, kv_holders(scheduler))
    except Exception as e:  # noqa: BLE001 - an audit must not fail the resize
        logger.exception("elastic KV audit: the snapshot failed")
        return f"the audit snapshot failed ({type(e).__name__}: {e})"


def audit_check(scheduler, el: ElasticKV, snap) -> List[str]:
    """:func:`.audit.check` after the resize (empty without a snapshot). Never raises."""
    from sglang.srt.mem_cache.elastic_kv import audit

    if snap is None:
        return []
    if isinstance(snap, str):
        return [snap]
    try:
        return audit.check(el, snap, kv_holders(scheduler))
    except Exception as e:  # noqa: BLE001 - the handler must never raise
        logger.exception("elastic KV audit: the check failed")
        return [f"the audit check failed ({type(e).__name__}: {e})"]
