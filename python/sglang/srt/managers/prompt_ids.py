"""A prompt's token ids are checked before the request reaches the scheduler.

Two prompts that upstream's ``TokenizerManager._validate_one_request`` let through kill the
scheduler, and with it the server (found by ``test/e2e/test_endpoints_fuzz.py``):

* zero tokens (``/generate`` with ``"text": ""`` or ``["a", ""]``, ``"input_ids": [[]]``): the
  extend of zero tokens fails inside the model's forward (Qwen3-Next's linear attention:
  ``cannot reshape tensor of 0 elements``);
* a token id outside the vocabulary (``"prompt": [956, -1]`` on ``/v1/completions``,
  ``input_ids`` on ``/generate``): the embedding lookup fails (``index out of range in self``).

Upstream checks only the prompt's length against the context. Patch 0071 calls
:func:`check_prompt_ids` first; its ``ValueError`` is answered with a 400 by every route.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

__all__ = ["EMPTY_INPUT", "check_prompt_ids"]

EMPTY_INPUT = (
    "The input is empty (0 tokens): send a non-empty prompt (text, input_ids, prompt or messages)"
)


MULTIMODAL_FIELDS = ("image_data", "video_data", "audio_data")


def check_prompt_ids(
    input_ids: Optional[Sequence[int]], vocab_size: int, request: Any = None
) -> None:
    """Refuse an empty prompt or one with a token id outside ``[0, vocab_size)``.

    Args:
        input_ids: the request's tokenized prompt; None (a request given ``input_embeds``)
            passes.
        vocab_size: the model's vocabulary size (``ModelConfig.vocab_size``).
        request: the ``GenerateReqInput`` / ``EmbeddingReqInput``; when it carries images,
            video or audio the range is not checked (a processor may use placeholder ids of
            its own).

    Raises:
        ValueError: the prompt is empty (:data:`EMPTY_INPUT`), or names the first id out of
            range, its position and the range.
    """
    if input_ids is None:
        return
    if len(input_ids) == 0:
        raise ValueError(EMPTY_INPUT)
    multimodal = any(getattr(request, k, None) for k in MULTIMODAL_FIELDS)
    if multimodal or (0 <= min(input_ids) and max(input_ids) < vocab_size):
        return
    pos, bad = next((i, t) for i, t in enumerate(input_ids) if not 0 <= t < vocab_size)
    raise ValueError(
        f"input_ids contains out-of-vocabulary token id {bad} at position {pos}; "
        f"valid range is [0, {vocab_size})"
    )
