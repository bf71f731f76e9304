"""/v1/messages as Claude Code reads it (patches 0060-0063, ``entrypoints/anthropic/wire.py``),
through upstream's ``AnthropicServing`` driven directly (no server): its stream converter fed an
OpenAI chat stream, its non-streaming converter fed a ``ChatCompletionResponse``, and its error
response. The overflow errors through a real server are in test/e2e/test_bad_input.py."""

from __future__ import annotations

import asyncio
import json
import re
from types import SimpleNamespace

import pytest

from sglang.srt.entrypoints.anthropic.protocol import AnthropicMessagesRequest
from sglang.srt.entrypoints.anthropic.serving import AnthropicServing
from sglang.srt.entrypoints.anthropic.wire import (
    SIGNATURE_PREFIX,
    anthropic_context_message,
    thinking_signature,
)
from sglang.srt.entrypoints.openai.protocol import (
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatMessage,
    UsageInfo,
)

REASONING = ["Let me ", "think."]
# Claude Code 2.1.332's own patterns (its bundled cli), which start its recovery.
CLAUDE_PROMPT_TOO_LONG = re.compile(r"^prompt is too long: \d+ tokens > \d+ maximum$")
CLAUDE_MAX_TOKENS = re.compile(
    r"input length and `max_tokens` exceed context limit: (\d+) \+ (\d+) > (\d+)"
)


def serving() -> AnthropicServing:
    return AnthropicServing(SimpleNamespace(supports_inline_system=True))


def request(**kw) -> AnthropicMessagesRequest:
    return AnthropicMessagesRequest(
        model="m", max_tokens=64, messages=[{"role": "user", "content": "hi"}], **kw
    )


def chunk(delta: dict, finish=None, usage=None) -> str:
    body = {
        "id": "c",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "m",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    if usage:
        body["usage"] = usage
    return "data: " + json.dumps(body) + "\n\n"


USAGE = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}


async def _openai_stream():
    yield chunk({"role": "assistant", "content": ""})
    for piece in REASONING:
        yield chunk({"reasoning_content": piece}, usage=USAGE)
    yield chunk({"content": "Hello"}, usage=USAGE)
    yield chunk({}, finish="stop", usage=USAGE)
    yield "data: [DONE]\n\n"


def stream_events(req: AnthropicMessagesRequest) -> list[dict]:
    async def run():
        gen = serving()._generate_anthropic_stream(None, None, req, None, _openai_stream())
        return [frame async for frame in gen]

    events = []
    for frame in asyncio.run(run()):
        event_line, data_line = frame.strip().split("\n")
        data = json.loads(data_line.removeprefix("data: "))
        assert event_line == "event: " + data["type"]
        events.append(data)
    return events


def non_stream(req_display=None):
    resp = ChatCompletionResponse(
        id="c",
        model="m",
        choices=[
            ChatCompletionResponseChoice(
                index=0,
                message=ChatMessage(
                    role="assistant", content="Hello", reasoning_content="".join(REASONING)
                ),
                finish_reason="stop",
            )
        ],
        usage=UsageInfo(prompt_tokens=5, completion_tokens=3, total_tokens=8),
    )
    return serving()._convert_response(resp, req_display == "omitted").model_dump(exclude_none=True)


def thinking_request(display=None) -> AnthropicMessagesRequest:
    thinking = {"type": "enabled", "budget_tokens": 1024}
    if display:
        thinking["display"] = display
    return request(thinking=thinking)


def test_message_start_has_null_stop_fields():
    events = stream_events(request())
    start = events[0]
    assert start["type"] == "message_start"
    assert "stop_reason" in start["message"] and start["message"]["stop_reason"] is None
    assert "stop_sequence" in start["message"] and start["message"]["stop_sequence"] is None
    (delta,) = [e for e in events if e["type"] == "message_delta"]
    assert delta["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert events[-1]["type"] == "message_stop"


def test_stream_thinking_block_is_signed():
    events = stream_events(thinking_request())
    thinking = [
        e["delta"]["thinking"] for e in events if e.get("delta", {}).get("type") == "thinking_delta"
    ]
    assert "".join(thinking) == "".join(REASONING)
    sig = [e for e in events if e.get("delta", {}).get("type") == "signature_delta"]
    assert len(sig) == 1 and sig[0]["index"] == 0
    assert sig[0]["delta"]["signature"] == thinking_signature("".join(REASONING))
    # the signature comes before the thinking block's stop
    i = events.index(sig[0])
    assert events[i + 1] == {"type": "content_block_stop", "index": 0}


def test_stream_display_omitted_sends_no_thinking_text():
    events = stream_events(thinking_request("omitted"))
    kinds = [(e["type"], e.get("delta", {}).get("type")) for e in events]
    assert ("content_block_delta", "thinking_delta") not in kinds
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert starts == ["thinking", "text"]
    sig = [e for e in events if e.get("delta", {}).get("type") == "signature_delta"]
    assert sig[0]["delta"]["signature"] == thinking_signature("".join(REASONING))
    text = [e["delta"]["text"] for e in events if e.get("delta", {}).get("type") == "text_delta"]
    assert text == ["Hello"]


@pytest.mark.parametrize("display", [None, "summarized", "omitted"])
def test_non_stream_thinking_signed_and_display(display):
    block = non_stream(display)["content"][0]
    assert block["type"] == "thinking"
    assert block["signature"] == thinking_signature("".join(REASONING))
    assert block["thinking"] == ("" if display == "omitted" else "".join(REASONING))


def test_signature_is_stable_and_accepted_back():
    a, b = thinking_signature("x"), thinking_signature("x")
    assert a == b and a.startswith(SIGNATURE_PREFIX) and a != thinking_signature("y")
    # a history that sends the block back with it converts (the server ignores signatures)
    req = AnthropicMessagesRequest(
        model="m",
        max_tokens=8,
        messages=[
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "x", "signature": a},
                    {"type": "text", "text": "Hello"},
                ],
            },
            {"role": "user", "content": "again"},
        ],
    )
    assert req.messages[1].content[0].signature == a


PROMPT_OVER = "The input (6571 tokens) is longer than the model's context length (2048 tokens)."
TOTAL_OVER = (
    "Requested token count exceeds the model's maximum context length of 2048 tokens. You "
    "requested a total of 100010 tokens: 10 tokens from the input messages and 100000 tokens "
    "for the completion. Please reduce the number of tokens in the input messages or the "
    "completion to fit within the limit."
)


def test_overflow_messages_match_claude_code():
    assert (
        anthropic_context_message(PROMPT_OVER) == "prompt is too long: 6571 tokens > 2048 maximum"
    )
    assert CLAUDE_PROMPT_TOO_LONG.match(anthropic_context_message(PROMPT_OVER))
    m = CLAUDE_MAX_TOKENS.search(anthropic_context_message(TOTAL_OVER))
    assert m and m.groups() == ("10", "100000", "2048")
    assert anthropic_context_message("max_tokens: Input should be a valid integer") == (
        "max_tokens: Input should be a valid integer"
    )
    assert anthropic_context_message(None) is None


def test_error_response_is_anthropic_overflow():
    resp = serving()._error_response(400, "invalid_request_error", PROMPT_OVER)
    assert resp.status_code == 400
    body = json.loads(resp.body)
    assert body == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": "prompt is too long: 6571 tokens > 2048 maximum",
        },
    }
