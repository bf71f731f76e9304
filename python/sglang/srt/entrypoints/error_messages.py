"""Error messages for clients that name what the client sent.

Upstream's messages for a bad request can name things the client never wrote: a request body
that is not JSON is reported as ``JSON decode error`` at a bare character offset; a field's path
carries pydantic's union tags (``tools.0.custom.input_schema``); a ``max_tokens`` the client
sent is reported as ``max_new_tokens`` or ``max_completion_tokens``; a bad ``tool_choice`` is
"tool choice" in prose; and ``/v1/messages`` validates the OpenAI chat request it converts an
Anthropic request into, so a bad tool ``input_schema`` is reported as a ``parameters`` schema.
The upstream handlers call these helpers (patches 0025 and 0026) to say it in the client's terms.
"""

from __future__ import annotations

import re
from typing import Optional

__all__ = [
    "field_path",
    "in_anthropic_terms",
    "in_request_terms",
    "malformed_json_message",
    "negative_output_length",
]


def malformed_json_message(err: dict) -> str:
    """The message for one validation error of type ``json_invalid`` (a body that is not JSON).

    FastAPI reports it with ``loc`` ``("body", <character offset>)``, ``msg``
    ``"JSON decode error"`` and the decoder's reason in ``ctx["error"]``; the message says where
    the body breaks and why: ``Malformed JSON in the request body at character N: <reason>``
    (the offset and the reason are left out when the error lacks them).

    Args:
        err: one entry of ``RequestValidationError.errors()``.
    """
    loc = err.get("loc") or ()
    where = loc[-1] if loc and isinstance(loc[-1], int) else None
    why = str((err.get("ctx") or {}).get("error") or "").strip()
    return (
        "Malformed JSON in the request body"
        + (f" at character {where}" if where is not None else "")
        + (f": {why}" if why else "")
    )


def field_path(loc, body=None) -> str:
    """The dotted path of a validation error's ``loc`` as the client wrote it.

    ``loc`` is pydantic's location (``("body", "tools", 0, "custom", "input_schema")``); the
    leading ``"body"`` goes, and so does every string before the last that is not a key of the
    request ``body`` at that point: the tags pydantic inserts for a union member or a validator
    (``custom``, ``function-after[...]``). The last part stays (a missing field is not in the
    body). Without a body (or past a value that is not a dict or a list) every part but
    ``"body"`` is kept.

    Args:
        loc: the error's ``loc`` tuple.
        body: the decoded request body (``RequestValidationError.body``), or None.
    """
    parts = [p for p in loc if p != "body"]
    kept = []
    node = body
    for i, p in enumerate(parts):
        if isinstance(node, dict) and p in node:
            kept.append(str(p))
            node = node[p]
        elif isinstance(node, list) and isinstance(p, int) and 0 <= p < len(node):
            kept.append(str(p))
            node = node[p]
        elif isinstance(node, (dict, list)) and isinstance(p, str) and i < len(parts) - 1:
            pass  # a tag the client never wrote
        else:
            kept.append(str(p))
            node = None
    return ".".join(kept)


def _output_length_field(request) -> str:
    """The output-length field the client sent: ``max_completion_tokens`` when set, else
    ``max_tokens`` (OpenAI chat and completions, and /v1/messages after its conversion)."""
    if getattr(request, "max_completion_tokens", None) is not None:
        return "max_completion_tokens"
    return "max_tokens"


_TOO_LARGE = re.compile(r"^max_completion_tokens is too large: (\d+)\.\s*")
_TOOL_CHOICE = re.compile(
    r"^(Tools cannot be empty if tool choice is set to|Tool '.*' not found in tools list)"
)


def in_request_terms(message: Optional[str], request) -> Optional[str]:
    """An OpenAI-route error ``message`` with the fields ``request`` was sent with.

    * ``max_completion_tokens is too large: N.This model ...`` names the field the client set
      (``max_tokens`` unless ``max_completion_tokens`` was given);
    * the ``tool_choice`` checks' messages get a ``tool_choice: `` prefix.

    Other messages, and None or an empty message (the request is valid), are returned as they
    are.

    Args:
        message: the handler's validation message.
        request: the OpenAI request model it was raised for (any object; fields read with
            ``getattr``).
    """
    if not message:
        return message
    m = _TOO_LARGE.match(message)
    if m:
        return f"{_output_length_field(request)} is too large: {m.group(1)}. " + message[m.end() :]
    if _TOOL_CHOICE.match(message):
        return "tool_choice: " + message
    return message


def negative_output_length(request) -> Optional[str]:
    """``max_tokens must be at least 0, got N`` (or ``max_completion_tokens ...``) for a request
    whose output length is negative, else None. Upstream finds it only in the sampling
    parameters, after conversion, and names its own ``max_new_tokens``.

    Args:
        request: an OpenAI request model (fields read with ``getattr``).
    """
    for field in ("max_completion_tokens", "max_tokens"):
        value = getattr(request, field, None)
        if isinstance(value, int) and value < 0:
            return f"{field} must be at least 0, got {value}."
    return None


# The chat handler validates the converted request and names OpenAI's fields; a tool's
# ``input_schema`` became ``function.parameters`` in the conversion.
_OPENAI_TOOL_SCHEMA = (
    (
        re.compile(r"\bTool (\d+) function has invalid 'parameters' schema"),
        r"tools.\1.input_schema is not a valid JSON Schema",
    ),
    (re.compile(r"\bTool (\d+) function 'parameters' schema"), r"tools.\1.input_schema"),
)


def in_anthropic_terms(message: Optional[str], chat_request=None) -> Optional[str]:
    """The chat handler's validation ``message`` with ``/v1/messages`` field names.

    ``Tool N function has invalid 'parameters' schema ...`` reads ``tools.N.input_schema is not
    a valid JSON Schema ...``, and ``Tool N function 'parameters' schema ...`` (too deeply
    nested) reads ``tools.N.input_schema ...``; with the converted ``chat_request``, the
    message is first put in its terms (:func:`in_request_terms`: an Anthropic ``max_tokens``
    becomes the chat request's ``max_tokens``). Other messages, and None or an empty message
    (the request is valid), are returned as they are.
    """
    if chat_request is not None:
        message = in_request_terms(message, chat_request)
    if not message:
        return message
    for pattern, replacement in _OPENAI_TOOL_SCHEMA:
        message = pattern.sub(replacement, message)
    return message
