"""A tool call cut off by ``max_tokens``: one shape on every route and stream mode.

When generation stops on ``max_tokens`` inside a tool call, the call can neither be dropped (the
client would see an empty answer and no reason) nor be closed by the server (a repaired
``{"command": "ls"}`` looks like a complete call that lacks its other required fields). Upstream
0.5.23 did one of each: the non-streaming chat route dropped the call (only a server log line),
the streaming route closed the argument JSON at the end (``_check_for_unstreamed_tool_args``),
and ``/v1/messages`` inherited the closed JSON in its stream and an empty ``input`` otherwise.

The shape, the same as the OpenAI and Anthropic APIs use for a call their models did not finish:

* ``finish_reason`` is ``"length"`` (``/v1/messages``: ``stop_reason`` ``"max_tokens"``), never
  ``"tool_calls"`` / ``"tool_use"``: a client that checks it (as it must for any ``length``
  answer) knows the call is not to be run;
* the cut call is still reported, as far as it was generated: its ``name`` and, as
  ``function.arguments``, the argument text the model wrote, unterminated (not valid JSON, never
  closed by the server). Complete calls before it are reported as usual, and content before the
  calls stays content. Streaming, the argument deltas concatenate to that same text; on
  ``/v1/messages`` streaming, the ``input_json_delta`` fragments do;
* ``/v1/messages`` without streaming needs an object for ``input``: it is the generated prefix
  parsed leniently (an unterminated string ends where generation stopped, a key without a value
  is left out), which is what Anthropic's SDKs accumulate from the stream's fragments;
* a call cut before its name was complete is not a call: its text is returned as content.

Why not return the cut call as text only: a stream has already sent the call's name and its
first argument deltas when the cut comes, and deltas cannot be taken back, so the only shape a
stream and a non-streamed answer can share is the call as far as it got plus the finish reason.

The format handled is the JSON object of Qwen 2.5 / Hermes-style parsers (``<tool_call>\\n{"name":
..., "arguments": ...``): a detector with ``bot_token`` and ``eot_token``. Other formats keep
upstream's behaviour.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Optional

from partial_json_parser import Allow
from partial_json_parser import loads as partial_loads

__all__ = [
    "CutCall",
    "cut_call_input",
    "cut_tool_call",
    "unstreamed_cut_arguments",
    "with_cut_call",
]

# The head of a call's JSON body: the complete name, then the arguments key.
_HEAD = re.compile(
    r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*(,\s*"(?:arguments|parameters)"\s*:\s*)?',
    re.DOTALL,
)


@dataclass(frozen=True)
class CutCall:
    """The unterminated last tool call of an output.

    ``start``: character offset of its start marker in the output; ``name``: the tool name
    (complete), or None when generation stopped inside the name; ``arguments``: the argument
    text as generated (``""`` when the arguments had not begun); ``raw``: the call's whole text
    from its start marker.
    """

    start: int
    name: Optional[str]
    arguments: str
    raw: str


def _markers(detector: Any) -> Optional[tuple[str, str]]:
    bot, eot = getattr(detector, "bot_token", None), getattr(detector, "eot_token", None)
    if not isinstance(bot, str) or not isinstance(eot, str) or not bot.strip():
        return None
    return bot, eot.strip()


def cut_tool_call(text: str, detector: Any) -> Optional[CutCall]:
    """The tool call that ``text`` (a whole generated output) ends inside, if any.

    ``detector``: the tool-call parser's detector (``FunctionCallParser.detector``); only
    formats with ``bot_token`` / ``eot_token`` markers are recognised. Returns None when the
    output's last call is closed by its end marker or there is no call.
    """
    marks = _markers(detector)
    if marks is None:
        return None
    bot, eot = marks
    start = text.rfind(bot)
    if start < 0 or eot in text[start:]:
        return None
    body = text[start + len(bot) :]
    head = _HEAD.match(body)
    if head is None:
        return CutCall(start, None, "", text[start:])
    try:
        name = json.loads(f'"{head.group(1)}"')
    except json.JSONDecodeError:
        return CutCall(start, None, "", text[start:])
    arguments = body[head.end() :] if head.group(2) else ""  # "" until its key is complete
    return CutCall(start, name, arguments, text[start:])


def cut_call_input(arguments: str) -> dict:
    """``/v1/messages`` ``input`` of a cut call whose argument text is ``arguments``: the
    prefix parsed leniently (``partial_json_parser``, every partial value allowed), ``{}`` when
    it is not an object prefix."""
    if not arguments.strip():
        return {}
    try:
        value = partial_loads(arguments, Allow.ALL)
    except Exception:  # noqa: BLE001 - any unparsable prefix has no input
        return {}
    return value if isinstance(value, dict) else {}


def unstreamed_cut_arguments(
    finish_reason: Optional[dict], text: Optional[str], detector: Any, streamed: str
) -> Optional[str]:
    """What a stream still owes of a cut call's arguments at its end, or None when the output
    does not end inside a call (then upstream's completion of the last call applies).

    ``finish_reason``: the engine's ``meta_info["finish_reason"]``; ``text``: the whole output
    (None when the server streams increments only); ``streamed``: the arguments already sent
    for that call. Returns the rest of the generated argument text (``""`` when the stream
    already carries it, or when what was streamed is not a prefix of it): never a closing
    brace or quote the model did not write.
    """
    if not isinstance(finish_reason, dict) or finish_reason.get("type") != "length":
        return None
    if text is None:
        return None
    cut = cut_tool_call(text, detector)
    if cut is None:
        return None
    if cut.name is None or not cut.arguments.startswith(streamed):
        return ""
    return cut.arguments[len(streamed) :]


def with_cut_call(
    text: str, finish_reason: Optional[dict], parser: Any, normal_text: str, calls: list
) -> tuple[str, list]:
    """The non-streaming parse of ``text`` with its cut call added.

    ``normal_text`` and ``calls`` (``ToolCallItem`` list) are what ``parser.parse_non_stream(text)``
    returned (``parser``: the request's ``FunctionCallParser``); ``finish_reason`` is the engine's
    ``meta_info["finish_reason"]``. When it is ``length`` and ``text`` ends inside a call, the
    call is appended (``parameters`` = its argument text as generated; ``tool_index`` its
    tool's position in the request, -1 if unknown), or, cut inside its name, its text is
    appended to ``normal_text``. Otherwise both are returned unchanged.
    """
    if not isinstance(finish_reason, dict) or finish_reason.get("type") != "length":
        return normal_text, calls
    cut = cut_tool_call(text, getattr(parser, "detector", None))
    if cut is None:
        return normal_text, calls
    if cut.name is None:
        return normal_text + cut.raw, calls
    from sglang.srt.function_call.core_types import ToolCallItem

    names = [getattr(getattr(t, "function", None), "name", None) for t in parser.tools or []]
    index = names.index(cut.name) if cut.name in names else -1
    return normal_text, [
        *calls,
        ToolCallItem(tool_index=index, name=cut.name, parameters=cut.arguments),
    ]
