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

Targets: ``expert_cache_size`` (the units of ``--expert-cache-size``). ``device_memory_budget``
(KV pages and slots together) is the next slice and answers 400 "not supported yet".
"""

from __future__ import annotations

import json
import logging
from http import HTTPStatus
from typing import Any, Dict, List, Optional

logger = logging.getLogger(__name__)

# Body fields of POST /rebalance_memory: the targets (exactly one) and the options.
TARGETS = ("expert_cache_size", "device_memory_budget")
NOT_SUPPORTED_YET = {
    "device_memory_budget": (
        "device_memory_budget is not supported yet: KV pages do not resize yet, only the "
        'expert-slot pool does; give {"expert_cache_size": "N" | "25%" | "4GB"}'
    ),
}
OPTIONS = ("dry_run",)


def request_from_body(body: Any):
    """The scheduler request for a ``POST /rebalance_memory`` JSON body.

    Args:
        body: the decoded JSON: an object with exactly one target, ``expert_cache_size``
            (string or integer, as ``--expert-cache-size``: ``"64"``, ``"25%"``, ``"4GB"``),
            and optionally ``dry_run`` (bool: check the target, change nothing).

    Returns:
        ``io_struct.RebalanceMemoryReqInput``.

    Raises:
        ValueError: not an object, unknown fields, no target or two, a target that is not
            supported yet, a malformed size; the message says what to send.
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
    if len(targets) != 1:
        raise ValueError(
            f"give exactly one target of {', '.join(TARGETS)}; got {len(targets)}"
            + (f" ({', '.join(targets)})" if targets else "")
        )
    if targets[0] in NOT_SUPPORTED_YET:
        raise ValueError(NOT_SUPPORTED_YET[targets[0]])
    size = body["expert_cache_size"]
    if isinstance(size, bool) or not isinstance(size, (str, int)):
        raise ValueError(
            f"expert_cache_size must be a string or an integer; got {type(size).__name__}"
        )
    try:
        CacheSize.parse(str(size))
    except ValueError as e:
        raise ValueError(str(e).replace("--expert-cache-size", "expert_cache_size")) from None
    dry_run = body.get("dry_run", False)
    if not isinstance(dry_run, bool):
        raise ValueError(f"dry_run must be true or false; got {dry_run!r}")
    return RebalanceMemoryReqInput(expert_cache_size=str(size), dry_run=dry_run)


def kv_split(scheduler) -> Dict[str, Any]:
    """The KV side as it is (it does not resize yet): ``kv_tokens`` (pool size in tokens),
    ``kv_tokens_free`` and ``kv_bytes`` (None where the pool does not say)."""
    alloc = scheduler.token_to_kv_pool_allocator
    out: Dict[str, Any] = dict(
        kv_tokens=int(scheduler.max_total_num_tokens),
        kv_tokens_free=int(alloc.available_size()),
        kv_bytes=None,
    )
    try:
        usage = getattr(alloc.get_kvcache(), "mem_usage", None)  # GiB (memory_pool.GB)
        if usage is not None:
            out["kv_bytes"] = int(float(usage) * (1 << 30))
    except Exception:  # a pool without the attribute: report what is known
        pass
    return out


def handle_rebalance_memory(scheduler, req):
    """Answer one ``RebalanceMemoryReqInput`` at the scheduler's safe point (the dispatcher of
    ``Scheduler.process_input_requests``, patch 0036). Never raises: every failure becomes the
    reply (a dead scheduler would end every request).

    Returns:
        ``RebalanceMemoryReqOutput``: status 200 and ``split = {"expert_cache": {...},
        "kv": {...}}`` plus, after a resize, ``previous_slots``, ``released_bytes``,
        ``time_ms``, ``dry_run``; 400 for a target refused (the message names the floor or the
        largest feasible target, or says the cache is off); 500 when a resize failed and rolled
        back.
    """
    from sglang.srt.layers.moe.expert_cache.method import get_expert_slot_cache
    from sglang.srt.layers.moe.expert_cache.rebalance import (
        RebalanceFailed,
        RebalanceRefused,
        expert_cache_split,
        rebalance,
    )
    from sglang.srt.managers.io_struct import RebalanceMemoryReqOutput

    def reply(status: HTTPStatus, message: str, split: Optional[Dict[str, Any]] = None):
        split = dict(split or {})
        try:
            split["kv"] = kv_split(scheduler)
        except Exception as e:  # noqa: BLE001 - the answer must go out
            split["kv"] = {"error": str(e)}
        return RebalanceMemoryReqOutput(
            success=status == HTTPStatus.OK,
            status_code=int(status),
            message=message,
            split=split,
        )

    cache = get_expert_slot_cache()
    if cache is None or not cache.finalized:
        return reply(
            HTTPStatus.BAD_REQUEST,
            "this server runs without --enable-expert-cache: there is no expert-slot pool to "
            "resize (and KV pages do not resize yet)",
        )
    try:
        if req.expert_cache_size is None:
            return reply(HTTPStatus.OK, "", {"expert_cache": expert_cache_split(cache)})
        result = rebalance(cache, req.expert_cache_size, dry_run=req.dry_run)
    except RebalanceRefused as e:
        return reply(HTTPStatus.BAD_REQUEST, str(e), {"expert_cache": expert_cache_split(cache)})
    except RebalanceFailed as e:
        logger.error("rebalance_memory: %s", e)
        return reply(
            HTTPStatus.INTERNAL_SERVER_ERROR, str(e), {"expert_cache": expert_cache_split(cache)}
        )
    except Exception as e:  # noqa: BLE001 - a bug must not end the scheduler
        logger.exception("rebalance_memory failed")
        return reply(HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(e).__name__}: {e}")
    logger.info(
        "rebalance_memory: expert cache %d -> %d slots in %.1f ms%s",
        result["previous_slots"],
        result["expert_cache"]["slots"],
        result["time_ms"],
        " (dry run)" if result["dry_run"] else "",
    )
    return reply(HTTPStatus.OK, "", result)


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
