"""``/rebalance_memory``: re-split memory while serving (issue 15; FreeToken §3.3).

The admin endpoint travels as upstream's control requests do (``/flush_cache``): the HTTP
route (patch 0038) parses the body with :func:`request_from_body` and awaits the tokenizer
manager's ``rebalance_memory`` (patch 0037), which sends a ``RebalanceMemoryReqInput``
(``io_struct``, patch 0035) to the scheduler and merges the ranks' replies
(:func:`merge_rank_replies`); the scheduler dispatches it to :func:`handle_rebalance_memory`
(patch 0036) inside ``process_input_requests``, at the top of an event-loop iteration: the
previous batch is done (on CUDA with the overlap scheduler it may still run on the device:
:func:`expert_cache.rebalance.rebalance` synchronizes first) and the next one is not built,
which is the safe point. Running and waiting requests stay where they are and continue with
the next batch; nothing is aborted, retracted or restarted.

With tensor parallelism every TP rank's scheduler receives the same broadcast request in the
same iteration (``recv_requests`` broadcasts the inputs before dispatch), so all ranks resize
at the same safe point, and the tokenizer manager reports the first failure of any rank (today
``--enable-expert-cache`` refuses TP > 1, ``expert_cache/method.make_for_layer``).

Targets: ``expert_cache_size`` (the units of ``--expert-cache-size``), ``kv_tokens`` (the KV
pool's size in tokens; with ``expert_cache_size`` or alone), or ``device_memory_budget`` (bytes
or a size such as ``"10GB"`` for KV pages and slots together, split by ``kv_share`` or in the
proportion of the current split: ``managers/memory_budget.py``). KV pages resize on the CPU
(``mem_cache/elastic_kv/``); shrinks run before grows, and when the second part fails the first
is undone, so the split is either the new one or the old one.
"""

from __future__ import annotations

import json
import logging
import time
from http import HTTPStatus
from typing import Any, Dict, List, Optional

logger = logging.getLogger(__name__)

# Body fields of POST /rebalance_memory: the targets and the options.
TARGETS = ("expert_cache_size", "kv_tokens", "device_memory_budget")
OPTIONS = ("kv_share", "dry_run")
# The largest integer a field may take: the request travels to the scheduler as msgspec,
# whose integers are 64-bit (a larger one raised OverflowError there, an HTTP 500).
MAX_INT = (1 << 63) - 1


def _parse_bytes(value: Any) -> int:
    from sglang.srt.layers.moe.expert_cache.config import CacheSize

    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ValueError(
            f'device_memory_budget must be a size such as "10GB" or a byte count; got '
            f"{type(value).__name__}"
        )
    if isinstance(value, int) or str(value).strip().isdigit():
        n = int(value)
    else:
        try:
            size = CacheSize.parse(str(value))
        except ValueError:
            size = None
        if size is None or size.bytes is None:
            raise ValueError(
                f'device_memory_budget must be a size such as "10GB", "512MiB" or a byte '
                f"count; got {value!r}"
            ) from None
        n = size.bytes
    if n <= 0:
        raise ValueError(f"device_memory_budget must be positive; got {value!r}")
    if n > MAX_INT:
        raise ValueError(
            f"device_memory_budget must be at most {MAX_INT} bytes (2^63 - 1); got {value!r}"
        )
    return n


def request_from_body(body: Any):
    """The scheduler request for a ``POST /rebalance_memory`` JSON body.

    Args:
        body: the decoded JSON: an object with ``expert_cache_size`` (string or integer, as
            ``--expert-cache-size``: ``"64"``, ``"25%"``, ``"4GB"``) and/or ``kv_tokens``
            (integer), or ``device_memory_budget`` alone (``"10GB"`` or bytes) with optionally
            ``kv_share`` (the KV side's share, in (0, 1]); optionally ``dry_run`` (bool: check
            the target, change nothing).

    Returns:
        ``io_struct.RebalanceMemoryReqInput`` (``device_memory_budget`` in bytes).

    Raises:
        ValueError: not an object, unknown fields, no target, a budget with another target,
            ``kv_share`` without a budget, a malformed size, an integer above 2^63 - 1 (msgspec
            carries 64-bit integers); the message says what to send.
    """
    from sglang.srt.layers.moe.expert_cache.config import CacheSize
    from sglang.srt.managers.io_struct import RebalanceMemoryReqInput

    if not isinstance(body, dict):
        raise ValueError(
            'the body must be a JSON object such as {"expert_cache_size": "25%"}; got '
            f"{type(body).__name__}"
        )
    unknown = sorted(set(body) - set(TARGETS) - set(OPTIONS))
    if unknown:
        raise ValueError(
            f"unknown field(s) {', '.join(unknown)}; accepted: {', '.join(TARGETS + OPTIONS)}"
        )
    targets = [t for t in TARGETS if body.get(t) is not None]
    if not targets:
        raise ValueError(f"give a target: {', '.join(TARGETS)}; got none")
    if "device_memory_budget" in targets and len(targets) > 1:
        raise ValueError(
            "device_memory_budget is the whole split: give it alone (with kv_share for the KV "
            f"side's share), not with {', '.join(t for t in targets if t != 'device_memory_budget')}"
        )
    fields: Dict[str, Any] = {}
    if "expert_cache_size" in targets:
        size = body["expert_cache_size"]
        if isinstance(size, bool) or not isinstance(size, (str, int)):
            raise ValueError(
                f"expert_cache_size must be a string or an integer; got {type(size).__name__}"
            )
        try:
            CacheSize.parse(str(size))
        except ValueError as e:
            raise ValueError(str(e).replace("--expert-cache-size", "expert_cache_size")) from None
        fields["expert_cache_size"] = str(size)
    if "kv_tokens" in targets:
        n = body["kv_tokens"]
        if isinstance(n, str) and n.strip().isdigit():
            n = int(n)
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise ValueError(f"kv_tokens must be a positive integer (tokens); got {n!r}")
        if n > MAX_INT:
            raise ValueError(f"kv_tokens must be at most {MAX_INT} (2^63 - 1); got {n!r}")
        fields["kv_tokens"] = n
    if "device_memory_budget" in targets:
        fields["device_memory_budget"] = _parse_bytes(body["device_memory_budget"])
    share = body.get("kv_share")
    if share is not None:
        if "device_memory_budget" not in targets:
            raise ValueError("kv_share splits a device_memory_budget; give one with it")
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
            raise ValueError(f"kv_share must be a number in (0, 1]; got {share!r}")
        fields["kv_share"] = float(share)
    dry_run = body.get("dry_run", False)
    if not isinstance(dry_run, bool):
        raise ValueError(f"dry_run must be true or false; got {dry_run!r}")
    return RebalanceMemoryReqInput(dry_run=dry_run, **fields)


def kv_split(scheduler) -> Dict[str, Any]:
    """The KV side: ``kv_tokens`` (pool size in tokens), ``kv_tokens_free``, ``kv_bytes``
    and, where KV pages resize (:mod:`sglang.srt.mem_cache.elastic_kv`), the token size, the
    floor, the largest pool, the bytes resident and the resize counters
    (``ElasticKV.split``); ``kv_resizable`` says which, ``kv_not_resizable`` why not."""
    from sglang.srt.mem_cache.elastic_kv.scheduler_glue import elastic_kv_of, reserve_tokens

    el, why = elastic_kv_of(scheduler)
    if el is not None:
        out = el.split()
        out["kv_floor_tokens"] = el.floor(reserve_tokens(scheduler))
        out["kv_resizable"] = True
        return out
    alloc = scheduler.token_to_kv_pool_allocator
    out: Dict[str, Any] = dict(
        kv_tokens=int(scheduler.max_total_num_tokens),
        kv_tokens_free=int(alloc.available_size()),
        kv_bytes=None,
        kv_resizable=False,
        kv_not_resizable=why,
    )
    try:
        usage = getattr(alloc.get_kvcache(), "mem_usage", None)  # GiB (memory_pool.GB)
        if usage is not None:
            out["kv_bytes"] = int(float(usage) * (1 << 30))
    except Exception:  # a pool without the attribute: report what is known
        pass
    return out


class _Refused(ValueError):
    pass


def _targets(cache, el, why: str, req, reserve):
    """``(kv_tokens or None, slots spec or None)`` for the request; raises _Refused."""
    from sglang.srt.layers.moe.expert_cache.rebalance import max_feasible_slots
    from sglang.srt.managers.memory_budget import BudgetRefused, Side, split_budget

    if req.device_memory_budget is None:
        if req.kv_tokens is not None and el is None:
            raise _Refused(f"kv_tokens: KV pages do not resize on this server ({why})")
        if req.expert_cache_size is not None and cache is None:
            raise _Refused(
                "this server runs without --enable-expert-cache: there is no expert-slot pool "
                "to resize"
            )
        return req.kv_tokens, req.expert_cache_size
    if el is None and cache is None:
        raise _Refused(
            f"device_memory_budget: neither KV pages nor expert slots resize on this server ({why})"
        )
    if el is None:
        raise _Refused(f"device_memory_budget: KV pages do not resize on this server ({why})")
    kv_side = Side(
        unit_bytes=el.token_bytes,
        fixed_bytes=el.page_size * el.token_bytes,
        floor=el.floor(reserve),
        ceiling=el.max_tokens,
        current=el.size,
        step=el.page_size,
    )
    slot_side = None
    if cache is not None:
        slot_side = Side(
            unit_bytes=cache.host.expert_bytes,
            floor=cache.top_k,
            ceiling=max_feasible_slots(cache),
            current=cache.num_slots,
        )
    try:
        kv_tokens, slots = split_budget(req.device_memory_budget, kv_side, slot_side, req.kv_share)
    except BudgetRefused as e:
        raise _Refused(str(e)) from None
    return kv_tokens, (str(slots) if cache is not None else None)


def handle_rebalance_memory(scheduler, req, auto: bool = False):
    """Answer one ``RebalanceMemoryReqInput`` at the scheduler's safe point (the dispatcher of
    ``Scheduler.process_input_requests``, patch 0036; ``--expert-cache-rebalance auto`` calls it
    too, with ``auto=True``: :mod:`memory_rebalance_auto`). Never raises: every failure becomes
    the reply (a dead scheduler would end every request). An explicit resize that succeeds
    becomes the split auto restores to (:func:`memory_rebalance_auto.note_explicit_rebalance`).

    Returns:
        ``RebalanceMemoryReqOutput``: status 200 and ``split = {"expert_cache": {...} or None,
        "kv": {...}, "memory_pressure": {...} or None}`` (``memory_pressure.pressure_split``)
        plus, after a resize, ``previous_slots``, ``previous_kv_tokens``,
        ``released_bytes`` (slots and KV), ``time_ms``, ``dry_run`` and ``kv_resize`` (the KV
        step's figures); 400 for a target refused (the message names the floor or the largest
        feasible target, or says what does not resize); 500 when a resize failed and rolled
        back, when a KV resize failed past its point of no return (not rolled back: the
        message says so and gives the size the pool is at), or when the KV accounting check
        after it found a problem. The scheduler's copies of the pool size always follow the
        pool (``publish_size`` runs whatever the resize did).
    """
    from sglang.srt.layers.moe.expert_cache.method import get_expert_slot_cache
    from sglang.srt.layers.moe.expert_cache.rebalance import (
        RebalanceFailed,
        RebalanceRefused,
        expert_cache_split,
        rebalance,
        target_slots,
    )
    from sglang.srt.managers.io_struct import RebalanceMemoryReqOutput
    from sglang.srt.mem_cache.elastic_kv.resize import KVResizeFailed, KVResizeRefused
    from sglang.srt.mem_cache.elastic_kv.scheduler_glue import (
        audit_check,
        audit_snapshot,
        check_accounting,
        elastic_kv_of,
        publish_size,
        reserve_tokens,
    )

    cache = get_expert_slot_cache()
    if cache is not None and not cache.finalized:
        cache = None

    def reply(status: HTTPStatus, message: str, extra: Optional[Dict[str, Any]] = None):
        split: Dict[str, Any] = {}
        try:
            split["expert_cache"] = expert_cache_split(cache) if cache is not None else None
        except Exception as e:  # noqa: BLE001 - the answer must go out
            split["expert_cache"] = {"error": str(e)}
        try:
            split["kv"] = kv_split(scheduler)
        except Exception as e:  # noqa: BLE001 - the answer must go out
            split["kv"] = {"error": str(e)}
        try:
            from sglang.srt.managers.memory_pressure import pressure_split

            split["memory_pressure"] = pressure_split(scheduler)
        except Exception as e:  # noqa: BLE001 - the answer must go out
            split["memory_pressure"] = {"error": str(e)}
        split.update(extra or {})
        return RebalanceMemoryReqOutput(
            success=status == HTTPStatus.OK,
            status_code=int(status),
            message=message,
            split=split,
        )

    t0 = time.perf_counter()
    try:
        el, why = elastic_kv_of(scheduler)
        targets = (req.expert_cache_size, req.kv_tokens, req.device_memory_budget)
        if all(t is None for t in targets):
            return reply(HTTPStatus.OK, "")
        if req.device_memory_budget is None and req.kv_tokens is None and cache is None:
            return reply(
                HTTPStatus.BAD_REQUEST,
                "this server runs without --enable-expert-cache: there is no expert-slot pool to "
                "resize" + (f" (and KV pages do not resize: {why})" if el is None else ""),
            )
        reserve = reserve_tokens(scheduler) if el is not None else 0
        kv_target, slot_spec = _targets(cache, el, why, req, reserve)
        # dry run of both sides first: nothing changes unless both targets are feasible
        slots = target_slots(cache, slot_spec) if slot_spec is not None else None
        if kv_target is not None:
            el.plan(kv_target, reserve)
    except (_Refused, RebalanceRefused, KVResizeRefused) as e:
        return reply(HTTPStatus.BAD_REQUEST, str(e))
    except Exception as e:  # noqa: BLE001 - a bug must not end the scheduler
        logger.exception("rebalance_memory failed")
        return reply(HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(e).__name__}: {e}")

    extra: Dict[str, Any] = dict(dry_run=req.dry_run, released_bytes=0)
    if cache is not None:
        extra["previous_slots"] = cache.num_slots
    if el is not None:
        extra["previous_kv_tokens"] = el.size
    if req.dry_run:
        extra.update(target_slots=slots, target_kv_tokens=kv_target)
        extra["time_ms"] = (time.perf_counter() - t0) * 1e3
        return reply(HTTPStatus.OK, "", extra)

    # shrinks first (memory returns before it is taken), grows after; undo on failure
    steps = []
    if slots is not None and slots != cache.num_slots:
        steps.append(("slots", slots, cache.num_slots))
    if kv_target is not None and el.target(kv_target) != el.size:
        steps.append(("kv", el.target(kv_target), el.size))
    steps.sort(key=lambda s: s[1] >= s[2])  # shrinks (new < old) first
    done = []
    audit_problems: List[str] = []

    def apply(kind, target):
        if kind == "slots":
            r = rebalance(cache, str(target))
            return r["released_bytes"], r
        snap = audit_snapshot(scheduler, el)  # None unless SGLANG_ELASTIC_KV_AUDIT=1
        try:
            r = el.resize(target, reserve_tokens=reserve)
        finally:  # the scheduler's copies follow the pool, whatever happened; a resize that
            # failed and rolled back is audited too
            publish_size(scheduler, el.size)
            audit_problems.extend(audit_check(scheduler, el, snap))
        return r["released_bytes"], r

    try:
        for kind, target, old in steps:
            released, r = apply(kind, target)
            extra["released_bytes"] += released
            if kind == "kv":
                extra["kv_resize"] = r
            done.append((kind, target, old))
    except Exception as e:  # noqa: BLE001 - undo the steps done; a bug must not end the scheduler
        known = isinstance(e, (RebalanceFailed, KVResizeFailed, KVResizeRefused, RebalanceRefused))
        if known:
            logger.error("rebalance_memory: %s", e)
        else:
            logger.exception("rebalance_memory failed")
        undo = []
        for kind, _, old in reversed(done):
            try:
                apply(kind, old)
                undo.append(f"{kind} back at {old}")
            except Exception as e2:  # noqa: BLE001
                logger.error("rebalance_memory: undoing the %s step failed: %s", kind, e2)
                undo.append(f"{kind} could not go back to {old} ({e2})")
        msg = (str(e) if known else f"{type(e).__name__}: {e}") + (
            f"; undone: {', '.join(undo)}" if undo else ""
        )
        if audit_problems:
            msg += "; KV audit: " + "; ".join(audit_problems)
        refused = isinstance(e, (KVResizeRefused, RebalanceRefused))
        return reply(HTTPStatus.BAD_REQUEST if refused else HTTPStatus.INTERNAL_SERVER_ERROR, msg)
    extra["time_ms"] = (time.perf_counter() - t0) * 1e3
    if el is not None:
        try:
            problems = check_accounting(scheduler, el)
        except Exception as e:  # noqa: BLE001 - the handler must never raise
            logger.exception("rebalance_memory: the KV accounting check failed")
            problems = [f"the check itself failed ({type(e).__name__}: {e})"]
        problems += audit_problems
        errors = (extra.get("kv_resize") or {}).get("errors") or []
        if errors or problems:
            msg = []
            if errors:  # not rolled back: the pool is at its new size
                msg.append(
                    f"the KV resize to {el.size} tokens failed past the point of no return "
                    f"(the pool is at {el.size} tokens, not rolled back): " + "; ".join(errors)
                )
            if problems:
                msg.append("KV accounting after the rebalance: " + "; ".join(problems))
            return reply(HTTPStatus.INTERNAL_SERVER_ERROR, "; ".join(msg), extra)
    if not auto:
        from sglang.srt.managers.memory_rebalance_auto import note_explicit_rebalance

        note_explicit_rebalance(scheduler)
        logger.info(
            "rebalance_memory: %s in %.1f ms",
            ", ".join(f"{k} {o} -> {t}" for k, t, o in done) or "no change",
            extra["time_ms"],
        )
    return reply(HTTPStatus.OK, "", extra)


def merge_rank_replies(results: List[Any]):
    """One reply from the data-parallel ranks' replies (the tokenizer manager's fan-out): the
    first that failed, else the first."""
    failed = [r for r in results if not r.success]
    return failed[0] if failed else results[0]


async def http_rebalance_memory(request, tokenizer_manager):
    """The route ``GET|POST /rebalance_memory`` (patch 0038): GET reports the current split,
    POST resizes. Bad bodies are answered 400 here, without reaching the scheduler.

    Returns:
        ``JSONResponse`` ``{"success": bool, "message": str, **split}`` with the scheduler's
        status code (200, 400, 500).
    """
    from fastapi.responses import JSONResponse

    from sglang.srt.managers.io_struct import RebalanceMemoryReqInput

    def answer(status: int, message: str, split: Optional[Dict[str, Any]] = None):
        return JSONResponse(
            {"success": status == HTTPStatus.OK, "message": message, **(split or {})},
            status_code=status,
        )

    if request.method == "GET":
        obj = RebalanceMemoryReqInput()
    else:
        raw = await request.body()
        try:
            body = json.loads(raw) if raw.strip() else None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return answer(HTTPStatus.BAD_REQUEST, f"Malformed JSON in the request body: {e}")
        try:
            obj = request_from_body(body)
        except ValueError as e:
            return answer(HTTPStatus.BAD_REQUEST, str(e))
    out = await tokenizer_manager.rebalance_memory(obj)
    return answer(out.status_code, out.message, out.split)
