"""``/generate``'s ``sampling_params`` must have the shape of its prompts.

``GenerateReqInput`` takes one ``sampling_params`` object for every prompt or a list of one per
prompt of a batch. Upstream's ``normalize_batch_and_arguments`` reads the list without checking
it: an empty list raises ``IndexError`` (``sampling_params[0]``), and a list beside a single
prompt, or a shorter list than the batch, raises ``AttributeError`` / ``IndexError`` later; the
route answers 500. Found by ``test/e2e/test_endpoints_fuzz.py``; patch 0073 calls
:func:`check_sampling_params_shape` once the batch size is known.
"""

from __future__ import annotations

from typing import Any

__all__ = ["check_sampling_params_shape"]


def check_sampling_params_shape(sampling_params: Any, is_single: bool, batch_size: int) -> None:
    """Refuse a ``sampling_params`` list that does not have one object per prompt.

    Args:
        sampling_params: the request's field (None, an object or a list; the request model has
            already checked that a list holds objects).
        is_single: the request has one prompt (one text or one flat list of input ids).
        batch_size: its number of prompts (1 when ``is_single``).

    Raises:
        ValueError: a list that is empty, beside a single prompt, or shorter than the batch;
            the message says what to send.
    """
    if not isinstance(sampling_params, list):
        return
    n = len(sampling_params)
    if is_single:
        raise ValueError(
            f"sampling_params: a single prompt takes one object, not a list of {n}; send a "
            "list only with a batch of prompts (one object per prompt)"
        )
    if n < batch_size:
        raise ValueError(
            f"sampling_params: a list of {n} for a batch of {batch_size} prompts; send one "
            "object for all of them, or one per prompt"
        )
