"""A custom logit processor cannot kill the server: a bad one is a 400, a failing one aborts
its requests.

With ``--enable-custom-logit-processor`` a request may carry a processor serialized by
``CustomLogitProcessor.to_str()``: a JSON object ``{"callable": "<hex of dill.dumps(cls)>"}``
(``srt/sampling/custom_logit_processor.py``). Upstream deserializes it first in the scheduler,
while building the batch's ``SamplingBatchInfo`` (``from_schedule_batch``), so a string that is
not one (``"abc"``, a JSON object without ``callable``, hex that is not a pickle) raised there and
killed the server. Patch 0077 calls :func:`check_custom_logit_processor` from the tokenizer
manager's request validation, beside upstream's own check of the flag, so the request is
refused before it is scheduled.

Deserializing runs the pickle, as the scheduler would: ``--enable-custom-logit-processor`` is
the operator's consent to run the callers' processors, and upstream's ``supports_sampling_mask``
already deserializes them at the same place. The result is cached (upstream's
``_cache_from_str``), so the scheduler's own call is not repeated work in this process.

A processor that deserializes can still fail when the scheduler runs it: upstream's own
``DisallowedTokensLogitsProcessor`` without ``custom_params`` raises ``TypeError``, a caller's
processor may return another shape, NaN, or a row without any finite logit (the sampler's
softmax then gives NaN and ``torch.multinomial`` raises). Upstream calls it unguarded in
``layers/sampler.apply_custom_logit_processor``, so any of these killed the server. Patch 0079
runs each processor call through :func:`run_custom_logit_processor`: a failure leaves that
call's rows as the model gave them (the processor's rows are sampled unprocessed this once) and
is recorded under the processor's key; the batch result processor then calls
:func:`abort_requests_of_failed_processors`, which finishes the requests of that processor in
the batch with a 400 naming the error (``FINISH_ABORT``, as upstream aborts a request whose
grammar fails). Other requests of the batch are not affected.
"""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Union

import torch

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.sampling.sampling_batch_info import ProcessorEntry, SamplingBatchInfo

__all__ = [
    "abort_requests_of_failed_processors",
    "check_custom_logit_processor",
    "run_custom_logit_processor",
]

logger = logging.getLogger(__name__)

# Processor key (``hash(processor_str)``, the key of ``SamplingBatchInfo.custom_logit_processor``)
# -> the error of its last failed call; consumed by the next batch result (one scheduler process).
_failures: Dict[int, str] = {}

HOW = (
    "serialize one with CustomLogitProcessor.to_str() (sglang.srt.sampling.custom_logit_processor)"
)


def _check_one(value: object, where: str) -> None:
    from sglang.srt.sampling.custom_logit_processor import CustomLogitProcessor

    if value is None:
        return
    if not isinstance(value, str):
        raise ValueError(f"{where} must be a string ({HOW}), got {type(value).__name__}.")
    try:
        processor = CustomLogitProcessor.from_str(value)
    except Exception as e:  # any failure of orjson / bytes.fromhex / dill / the constructor
        raise ValueError(
            f"{where} is not a serialized CustomLogitProcessor ({type(e).__name__}: "
            f"{str(e)[:200]}); {HOW}."
        ) from None
    if not isinstance(processor, CustomLogitProcessor):
        raise ValueError(
            f"{where} deserializes to {type(processor).__name__}, not a CustomLogitProcessor "
            f"subclass; {HOW}."
        )


def check_custom_logit_processor(value: Optional[Union[str, List[Optional[str]]]]) -> None:
    """Refuse a ``custom_logit_processor`` field that the scheduler could not deserialize.

    Args:
        value: the request's field: None, one serialized processor, or one per prompt of a
            batch (None entries allowed).

    Raises:
        ValueError: naming the field (and its index in a list) and how to make a valid one
            (a 400 on every route).
    """
    if isinstance(value, list):
        for i, v in enumerate(value):
            _check_one(v, f"custom_logit_processor[{i}]")
    else:
        _check_one(value, "custom_logit_processor")


def _output_fault(result: Any, selected: torch.Tensor) -> Optional[str]:
    if not isinstance(result, torch.Tensor):
        return f"returned {type(result).__name__}, not a tensor"
    if result.shape != selected.shape:
        return f"returned shape {tuple(result.shape)} for logits of shape {tuple(selected.shape)}"
    r = result.float()
    if bool(torch.isnan(r).any()) or bool(torch.isposinf(r).any()):
        return "returned NaN or +inf logits"
    if not bool(torch.isfinite(r).any(dim=-1).all()):
        return "returned a row without any finite logit (every token masked)"
    return None


def run_custom_logit_processor(
    sampling_batch_info: SamplingBatchInfo,
    entry: ProcessorEntry,
    selected: torch.Tensor,
    custom_params: List[Optional[Dict[str, Any]]],
) -> Optional[torch.Tensor]:
    """Call ``entry.processor(selected, custom_params)``; None where it failed.

    Args:
        sampling_batch_info: the batch's sampling info (its ``custom_logit_processor`` dict gives
            the entry's key).
        entry: the processor and the batch rows it applies to.
        selected: ``[len(rows) * tokens_per_row, vocab]`` logits of those rows (a copy: the
            batch's logits are untouched until the caller writes the result back).
        custom_params: one ``custom_params`` per row of ``selected``.

    Returns:
        The processed logits, same shape as ``selected``, or None when the processor raised or
        returned another type or shape, NaN, +inf, or a row without a finite logit; the error
        is then logged (one line, no traceback) and recorded for :func:`abort_requests_of_failed_processors`.
    """
    name = type(entry.processor).__name__
    try:
        result = entry.processor(selected, custom_params)
        fault = _output_fault(result, selected)
    except Exception as e:  # the caller's code: anything it raises
        fault = f"raised {type(e).__name__}: {str(e)[:300]}"
    if fault is None:
        return result
    # one line: the fault is the caller's code, and the caller gets the same message
    logger.warning("Custom logit processor %s; its requests are aborted (400)", fault)
    key = next(
        (k for k, v in (sampling_batch_info.custom_logit_processor or {}).items() if v is entry),
        None,
    )
    _failures[key] = f"custom logit processor {name} {fault}"
    return None


def abort_requests_of_failed_processors(batch: ScheduleBatch) -> int:
    """Abort (400) the requests of the batch whose processor failed in its last call.

    Called first by the batch result processor for prefill and decode results, before the
    results are committed, so the request finishes with the error instead of its token.

    Returns:
        The number of requests aborted.
    """
    if not _failures:
        return 0
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    failures = dict(_failures)
    _failures.clear()
    aborted = 0
    for req in batch.reqs:
        processor_str = getattr(req, "custom_logit_processor", None)
        if not processor_str or req.finished():
            continue
        message = failures.get(hash(processor_str), failures.get(None))
        if message is not None:
            req.to_finish = FINISH_ABORT(message, HTTPStatus.BAD_REQUEST, "BadRequestError")
            aborted += 1
    return aborted
