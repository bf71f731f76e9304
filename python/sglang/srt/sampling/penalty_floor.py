"""A repetition penalty small enough to overflow the logits is refused.

Upstream's ``SamplingParams.verify`` accepts any ``repetition_penalty`` in ``(0, 2]``. The
repetition penalizer divides the positive logits of seen tokens by it (``logits / p``,
``srt/sampling/penaltylib/repetition_penalty.py``), so a tiny positive value such as ``6e-177``
makes them ``inf``; the softmax then gives NaN probabilities and ``torch.multinomial`` raises
in the scheduler, which kills the server. Found by ``test/e2e/test_endpoints_fuzz.py``; patch
0076 calls :func:`check_repetition_penalty` from ``verify``.

The floor, :data:`MIN_REPETITION_PENALTY` = 1e-6, keeps ``logit / p`` finite in float32 for any
logit below 3e32 in magnitude, and refuses only values no client means (1e-6 already makes a
seen token's positive logit a million times larger).
"""

from __future__ import annotations

import math

__all__ = ["MIN_REPETITION_PENALTY", "check_repetition_penalty"]

MIN_REPETITION_PENALTY = 1e-6


def check_repetition_penalty(repetition_penalty: float) -> None:
    """Refuse a ``repetition_penalty`` below :data:`MIN_REPETITION_PENALTY` or not finite.

    Raises:
        ValueError: naming the value and the accepted range (a 400 on every route).
    """
    p = repetition_penalty
    if not math.isfinite(p) or p < MIN_REPETITION_PENALTY:
        raise ValueError(
            f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, 2] (1.0 = no penalty; "
            f"smaller values overflow the logits they divide), got {p}."
        )
