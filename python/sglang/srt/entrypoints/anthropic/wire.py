"""What ``/v1/messages`` puts on the wire where Claude Code reads Anthropic's exact shapes.

Upstream's Anthropic handler (``entrypoints/anthropic/serving.py``) calls these (patches
0060-0063):

* :func:`anthropic_context_message`: the engine's context-length errors in Anthropic's words
  (``prompt is too long: N tokens > M maximum``, HTTP 400 ``invalid_request_error``), which
  Claude Code matches to start its own recovery (compacting the conversation);
* :func:`thinking_signature`: a signature for a thinking block. Ours are not cryptographic: a
  stable placeholder, ``sglang-unsigned-`` and the first 32 hex digits of the SHA-256 of the
  block's text. Clients send it back in their history; the server accepts any signature and
  ignores it (there is nothing to verify: the model's reasoning is not secret here);
* :func:`omit_thinking`: ``thinking.display: "omitted"`` (Anthropic: thinking blocks come
  with an empty ``thinking`` and a signature);
* :func:`message_start_json` / :func:`message_delta_json`: the events with
  ``stop_reason`` / ``stop_sequence`` present as null where Anthropic sends null (upstream
  dumps every event with ``exclude_none``).
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any, Optional

__all__ = [
    "SIGNATURE_PREFIX",
    "anthropic_context_message",
    "message_delta_json",
    "message_start_json",
    "omit_thinking",
    "thinking_signature",
]

SIGNATURE_PREFIX = "sglang-unsigned-"

# tokenizer_manager._validate_one_request's two context-length errors.
_PROMPT_OVER = re.compile(
    r"The input \((\d+) tokens\) is longer than the model's context length \((\d+) tokens\)"
)
_TOTAL_OVER = re.compile(
    r"maximum context length of (\d+) tokens\. You requested a total of \d+ tokens: "
    r"(\d+) tokens from the input messages and (\d+) tokens for the completion"
)


def anthropic_context_message(message: Optional[str]) -> Optional[str]:
    """``message`` in Anthropic's words when it is one of the engine's context-length errors.

    * ``The input (N tokens) is longer than the model's context length (M tokens).`` becomes
      ``prompt is too long: N tokens > M maximum`` (Anthropic's overflow error, the one Claude
      Code compacts on);
    * ``... maximum context length of M tokens. You requested a total of T tokens: P tokens from
      the input messages and Q tokens for the completion ...`` becomes ``input length and
      `max_tokens` exceed context limit: P + Q > M, decrease input length or `max_tokens` and
      try again`` (Anthropic's, on which Claude Code lowers ``max_tokens``).

    Any other message (and None) is returned unchanged.
    """
    if not message:
        return message
    m = _PROMPT_OVER.search(message)
    if m:
        return f"prompt is too long: {m.group(1)} tokens > {m.group(2)} maximum"
    m = _TOTAL_OVER.search(message)
    if m:
        limit, prompt, completion = m.groups()
        return (
            f"input length and `max_tokens` exceed context limit: {prompt} + {completion} > "
            f"{limit}, decrease input length or `max_tokens` and try again"
        )
    return message


def thinking_signature(thinking: str) -> str:
    """The placeholder signature of a thinking block whose text is ``thinking`` (stable: the
    same text always gets the same signature)."""
    digest = hashlib.sha256(thinking.encode("utf-8", "surrogatepass")).hexdigest()
    return SIGNATURE_PREFIX + digest[:32]


def omit_thinking(anthropic_request) -> bool:
    """True when the request asks for ``thinking.display: "omitted"``."""
    thinking = getattr(anthropic_request, "thinking", None)
    return getattr(thinking, "display", None) == "omitted"


def _dump(event) -> dict[str, Any]:
    return event.model_dump(mode="json", exclude_none=True)


def message_start_json(event) -> str:
    """A ``MessageStartEvent`` as JSON, its message's ``stop_reason`` and ``stop_sequence``
    null (Anthropic: ``"stop_reason": null, "stop_sequence": null`` until message_delta)."""
    data = _dump(event)
    data["message"].setdefault("stop_reason", None)
    data["message"].setdefault("stop_sequence", None)
    return json.dumps(data, ensure_ascii=False)


def message_delta_json(event) -> str:
    """A ``MessageDeltaEvent`` as JSON with ``delta.stop_sequence`` null when no stop sequence
    matched (Anthropic always sends the key)."""
    data = _dump(event)
    data["delta"].setdefault("stop_sequence", None)
    return json.dumps(data, ensure_ascii=False)
