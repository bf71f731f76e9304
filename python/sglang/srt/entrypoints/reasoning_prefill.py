"""Whether a chat request continues an assistant prefill whose reasoning is already closed.

Patch ``0022-continue-final-message-closed-reasoning`` asks this when it sets
``require_reasoning`` in upstream's ``OpenAIServingChat._process_messages``: with
``continue_final_message`` the model goes on from the last assistant message, and when that
message already holds the reasoning parser's end token (``</think>``) the continuation is the
answer, so constraints (a forced tool call, a JSON schema) apply at once instead of after a
reasoning phase that will never end.
"""

from __future__ import annotations


def continues_closed_reasoning(request, reasoning_detector) -> bool:
    """True when ``request`` continues (``continue_final_message``) a final assistant message
    whose string content contains ``reasoning_detector.think_end_token``.

    Args:
        request: a ``ChatCompletionRequest``.
        reasoning_detector: the server's reasoning detector, or None (no reasoning parser).
    """
    if not request.continue_final_message or not request.messages or reasoning_detector is None:
        return False
    last = request.messages[-1]
    return (
        last.role == "assistant"
        and isinstance(last.content, str)
        and reasoning_detector.think_end_token in last.content
    )
