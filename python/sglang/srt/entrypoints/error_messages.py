"""Error messages for clients that name what the client sent.

Upstream's messages for a bad request can name things the client never wrote: a request body
that is not JSON is reported as ``JSON decode error`` at a bare character offset, and
``/v1/messages`` validates the OpenAI chat request it converts an Anthropic request into, so a
bad tool ``input_schema`` is reported as a ``parameters`` schema. The upstream handlers call
these helpers (patches 0025 and 0026) to say it in the client's terms.
"""

from __future__ import annotations

import re
from typing import Optional

__all__ = ["in_anthropic_terms", "malformed_json_message"]


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


# The chat handler validates the converted request and names OpenAI's fields; a tool's
# ``input_schema`` became ``function.parameters`` in the conversion.
_OPENAI_TOOL_SCHEMA = (
    (
        re.compile(r"\bTool (\d+) function has invalid 'parameters' schema"),
        r"tools.\1.input_schema is not a valid JSON Schema",
    ),
    (re.compile(r"\bTool (\d+) function 'parameters' schema"), r"tools.\1.input_schema"),
)


def in_anthropic_terms(message: Optional[str]) -> Optional[str]:
    """The chat handler's validation ``message`` with ``/v1/messages`` field names.

    ``Tool N function has invalid 'parameters' schema ...`` reads ``tools.N.input_schema is not
    a valid JSON Schema ...``, and ``Tool N function 'parameters' schema ...`` (too deeply
    nested) reads ``tools.N.input_schema ...``; other messages, and None or an empty message
    (the request is valid), are returned as they are.
    """
    if not message:
        return message
    for pattern, replacement in _OPENAI_TOOL_SCHEMA:
        message = pattern.sub(replacement, message)
    return message
