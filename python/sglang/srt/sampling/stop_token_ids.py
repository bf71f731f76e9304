"""Stop token ids must be token ids of the model's vocabulary.

Upstream's ``SamplingParams.verify`` checks temperature, top-p/k, penalties and the rest, but not
``stop_token_ids``. An id outside ``[0, vocab_size)`` with ``min_tokens`` > 0 reaches the
min-new-tokens penalizer, whose ``scatter_add_`` over the vocabulary fails (``index
9007199254740993 is out of bounds for dimension 1 with size 32769``) and kills the scheduler and
the server. Found by ``test/e2e/test_endpoints_fuzz.py``; patch 0074 calls
:func:`check_stop_token_ids` from ``verify``.
"""

from __future__ import annotations

from typing import Iterable, Optional

__all__ = ["check_stop_token_ids"]


def check_stop_token_ids(stop_token_ids: Optional[Iterable[int]], vocab_size: int) -> None:
    """Refuse a stop token id outside ``[0, vocab_size)``.

    Raises:
        ValueError: naming the smallest id out of range and the range (a 400 on every route).
    """
    bad = sorted(t for t in (stop_token_ids or ()) if not 0 <= t < vocab_size)
    if bad:
        raise ValueError(
            f"stop_token_ids contains out-of-vocabulary token id {bad[0]}; "
            f"valid range is [0, {vocab_size})"
        )
