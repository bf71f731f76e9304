"""OpenAI- and Anthropic-compatible endpoints of the real server, over real HTTP.

One pooled server of the default tiny model (flags of ``make serve``: qwen tool-call parser,
qwen3 reasoning parser, cache report) serves every test. The model has random weights: tests
assert the shape of responses and the behaviour of parsers and constraints, never wording.
Outputs that a random model would not produce by itself are forced with the server's own
request knobs: a regex constraint for ``<think>...</think>answer``, forced tool choice plus a
whitespace ``logit_bias`` for tool calls (see ``e2e_util.whitespace_ban``).
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from e2e_util import (
    bias_where,
    chat,
    chat_stream,
    messages,
    messages_stream,
    token_id,
    user,
    whitespace_ban,
)

NO_THINK = {"enable_thinking": False}


def check_usage(usage: dict, max_completion: int | None = None) -> None:
    assert usage["prompt_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    if max_completion is not None:
        assert 0 < usage["completion_tokens"] <= max_completion
    # --enable-cache-report
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert 0 <= cached <= usage["prompt_tokens"]


# ------------------------------------------------------------------------------------------
# /v1/chat/completions
# ------------------------------------------------------------------------------------------


def test_chat_completion(server):
    j = chat(server, messages=[user("Say hi.")], max_tokens=8)
    assert j["object"] == "chat.completion" and j["id"]
    assert len(j["choices"]) == 1
    choice = j["choices"][0]
    assert choice["index"] == 0 and choice["message"]["role"] == "assistant"
    assert choice["finish_reason"] in ("length", "stop")
    text = (choice["message"]["content"] or "") + (choice["message"].get("reasoning_content") or "")
    if choice["finish_reason"] == "length":
        assert text
    check_usage(j["usage"], 8)


@pytest.mark.parametrize(
    "limits, expected",
    [
        ({"max_tokens": 5}, 5),
        ({"max_completion_tokens": 5}, 5),
        ({"max_tokens": 12, "max_completion_tokens": 3}, 3),  # the newer field wins
    ],
    ids=["max_tokens", "max_completion_tokens", "both"],
)
def test_chat_token_limits(server, limits, expected):
    j = chat(server, messages=[user("Count to one hundred.")], ignore_eos=True, **limits)
    assert j["usage"]["completion_tokens"] == expected
    assert j["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("include_usage", [True, False])
def test_chat_streaming(server, include_usage):
    body = dict(messages=[user("Say hi.")], max_tokens=6)
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    chunks = chat_stream(server, **body)
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert len({c["id"] for c in chunks}) == 1
    with_choices = [c for c in chunks if c["choices"]]
    assert with_choices[0]["choices"][0]["delta"]["role"] == "assistant"
    finishes = [
        c["choices"][0]["finish_reason"] for c in with_choices if c["choices"][0]["finish_reason"]
    ]
    assert len(finishes) == 1 and finishes[0] in ("length", "stop")
    streamed = "".join(
        (c["choices"][0]["delta"].get("content") or "")
        + (c["choices"][0]["delta"].get("reasoning_content") or "")
        for c in with_choices
    )
    usage_chunks = [c for c in chunks if c.get("usage")]
    if include_usage:
        # exactly one usage chunk, last, with no choices
        assert len(usage_chunks) == 1 and usage_chunks[0] is chunks[-1]
        assert chunks[-1]["choices"] == []
        check_usage(chunks[-1]["usage"], 6)
        if finishes[0] == "length":
            assert chunks[-1]["usage"]["completion_tokens"] == 6
            assert streamed
    else:
        assert usage_chunks == []


# ---- forced tool calls (constrained decoding with xgrammar) --------------------------------

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Oslo"]},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
ZAP = {  # the only name with a "z": see test_named_tool_choice_streaming
    "type": "function",
    "function": {
        "name": "zap",
        "description": "Switch the zapper.",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {"on": {"type": "boolean"}},
            "required": ["on"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, ZAP]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def tool_call_body(server, **extra) -> dict:
    """A forced-tool-call request that ends right after the first call.

    Thinking is off (with thinking on, the grammar only starts after ``</think>``, which a random
    model never writes). The stop string ends generation after the call; ``no_stop_trim`` keeps
    ``</tool_call>`` for the parser. The grammar admits any tokenization of the call's fixed
    text; the bias makes the model write ``<tool_call>`` and ``</tool_call>`` as their single
    tokens, which saves decode steps and lets the stop string match (one emitted in several
    smaller tokens is missed upstream, see ``test_stop_string_in_split_tokens``).
    """
    bias = whitespace_ban(server.model)
    for tag in ("<tool_call>", "</tool_call>"):
        bias[str(token_id(server.model, tag))] = 30
    bias.update(extra.pop("logit_bias", {}))
    return dict(
        messages=[user("What is the weather in Paris? Use a tool.")],
        tools=TOOLS,
        max_tokens=80,
        chat_template_kwargs=NO_THINK,
        stop=["</tool_call>"],
        no_stop_trim=True,
        logit_bias=bias,
        **extra,
    )


def check_call(name: str, arguments: str) -> None:
    assert name in SCHEMAS, name
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_required_tool_choice(server):
    j = chat(server, **tool_call_body(server, tool_choice="required"))
    choice = j["choices"][0]
    calls = choice["message"].get("tool_calls")
    assert calls, choice
    for call in calls:
        assert call["type"] == "function" and call["id"]
        check_call(call["function"]["name"], call["function"]["arguments"])
    assert choice["finish_reason"] == "tool_calls"
    assert not (choice["message"]["content"] or "").strip()


def test_named_tool_choice_streaming(server):
    """A named tool_choice must be honoured even when the model leans away from that tool.

    Every token containing "z" is biased to -100, so a model left free to choose would never
    write "zap"; the named choice must constrain the call to it anyway.
    """
    zbias = bias_where(server.model, lambda s: "z" in s.lower(), -100)
    body = tool_call_body(
        server,
        tool_choice={"type": "function", "function": {"name": "zap"}},
        logit_bias=zbias,
        stream_options={"include_usage": True},
    )
    chunks = chat_stream(server, **body)
    names, args, ids = {}, {}, {}
    finish = None
    for c in chunks:
        if not c["choices"]:
            continue
        delta = c["choices"][0]["delta"]
        for tc in delta.get("tool_calls") or []:
            i = tc["index"]
            if tc.get("id"):
                ids[i] = tc["id"]
            if tc["function"].get("name"):
                names[i] = tc["function"]["name"]
            args[i] = args.get(i, "") + (tc["function"].get("arguments") or "")
        finish = c["choices"][0]["finish_reason"] or finish
    assert names, f"no tool call streamed: {chunks[-3:]}"
    assert set(names.values()) == {"zap"}, f"named tool_choice not honoured: {names}"
    for i, name in names.items():
        assert ids.get(i)
        check_call(name, args[i])
    assert finish == "tool_calls"
    assert chunks[-1]["usage"]["completion_tokens"] <= 80


def test_stop_string_in_split_tokens(server):
    """A stop string must stop generation however the model tokenizes it.

    ``</tool_call>`` is one token of the tokenizer; banning that token makes the regex-forced
    output spell it in several smaller tokens, which must still match ``stop``.
    """
    ban = {str(token_id(server.model, "</tool_call>")): -100}
    j = chat(
        server,
        messages=[user("x")],
        max_tokens=40,
        chat_template_kwargs=NO_THINK,
        regex=r"hello</tool_call>world[a-z]{30}",
        stop=["</tool_call>"],
        logit_bias=ban,
    )
    choice = j["choices"][0]
    assert choice["message"]["content"] == "hello", choice
    assert choice["finish_reason"] == "stop" and choice["matched_stop"] == "</tool_call>", choice


# ---- reasoning parser ---------------------------------------------------------------------

WORD = r"[a-z]{2,5}"
THINK_REGEX = rf"<think>{WORD}</think>{WORD}"


def think_body(server, **extra) -> dict:
    """A request forced (regex) to write ``<think>R</think>A``, thinking off in the template so
    the grammar applies from the first token. The bias makes the model write the think tags as
    their single tokens, which keeps the output to a few decode steps."""
    bias = {str(token_id(server.model, tag)): 30 for tag in ("<think>", "</think>")}
    return dict(
        messages=[user("Think, then answer.")],
        max_tokens=30,
        regex=THINK_REGEX,
        chat_template_kwargs=NO_THINK,
        logit_bias=bias,
        **extra,
    )


@pytest.mark.parametrize("separate", [True, False])
def test_reasoning_split(server, separate):
    """The reasoning parser returns R as reasoning_content and A as content."""
    j = chat(server, **think_body(server, separate_reasoning=separate))
    msg = j["choices"][0]["message"]
    assert j["choices"][0]["finish_reason"] == "stop"
    if separate:
        assert re.fullmatch(WORD, msg["reasoning_content"].strip()), msg
        assert re.fullmatch(WORD, msg["content"].strip()), msg
    else:
        assert msg.get("reasoning_content") is None
        assert re.fullmatch(THINK_REGEX, msg["content"].strip()), msg


def test_reasoning_split_streaming(server):
    chunks = chat_stream(server, **think_body(server, stream_options={"include_usage": True}))
    kinds, reasoning, content = [], "", ""
    for c in chunks:
        if not c["choices"]:
            continue
        d = c["choices"][0]["delta"]
        if d.get("reasoning_content"):
            kinds.append("r")
            reasoning += d["reasoning_content"]
        if d.get("content"):
            kinds.append("c")
            content += d["content"]
    assert re.fullmatch(WORD, reasoning.strip()), reasoning
    assert re.fullmatch(WORD, content.strip()), content
    # all reasoning deltas come before the first content delta
    assert kinds[0] == "r" and "r" not in kinds[kinds.index("c") :], kinds


def test_thinking_default_goes_to_reasoning(server):
    """Thinking is on by default (Qwen3 template): unterminated output is reasoning."""
    j = chat(server, messages=[user("Hi")], max_tokens=6, ignore_eos=True)
    msg = j["choices"][0]["message"]
    assert msg["reasoning_content"] and not msg["content"]
    assert j["usage"]["reasoning_tokens"] == 6


def test_continue_final_message_after_closed_think(server):
    """An assistant prefill that already closed its reasoning continues as the answer.

    Its constraint must apply to the continuation at once (not wait for a ``</think>`` that is
    in the prompt), and the continuation is not reasoning.
    """
    j = chat(
        server,
        messages=[
            user("Yes or no?"),
            {"role": "assistant", "content": "<think>\nShort.\n</think>\n\n"},
        ],
        continue_final_message=True,
        max_tokens=12,
        regex=r"(yes|no)\.",
    )
    msg = j["choices"][0]["message"]
    assert msg.get("reasoning_content") is None
    assert msg["content"] in ("yes.", "no."), msg
    assert j["usage"].get("reasoning_tokens", 0) == 0, j["usage"]


# ------------------------------------------------------------------------------------------
# /v1/messages (Anthropic)
# ------------------------------------------------------------------------------------------


def prompt_tokens(resp: dict) -> int:
    u = resp["usage"]
    return (
        u["input_tokens"]
        + u.get("cache_read_input_tokens", 0)
        + u.get("cache_creation_input_tokens", 0)
    )


def check_message(resp: dict, max_tokens: int) -> None:
    assert resp["type"] == "message" and resp["role"] == "assistant" and resp["id"]
    assert resp["stop_reason"] in ("end_turn", "max_tokens", "stop_sequence", "tool_use")
    assert 0 < resp["usage"]["output_tokens"] <= max_tokens
    for block in resp["content"]:
        assert block["type"] in ("text", "thinking", "tool_use"), block


def test_messages_system_blocks(server):
    """``system`` as text blocks is the same prompt as the joined string."""
    base = dict(messages=[user("Hi")], max_tokens=2, thinking={"type": "disabled"})
    blocks = messages(
        server,
        system=[
            {"type": "text", "text": "You are terse."},
            {"type": "text", "text": "Answer in French."},
        ],
        **base,
    )
    check_message(blocks, 2)
    joined = messages(server, system="You are terse.\nAnswer in French.", **base)
    bare = messages(server, **base)
    assert prompt_tokens(blocks) == prompt_tokens(joined) > prompt_tokens(bare)


def test_messages_inline_system_message(server):
    base = dict(max_tokens=2, thinking={"type": "disabled"})
    with_sys = messages(
        server,
        messages=[
            {"role": "system", "content": "You are terse."},
            user("Hi"),
            {"role": "assistant", "content": "Hello."},
            {"role": "system", "content": [{"type": "text", "text": "Now answer in French."}]},
            user("Again"),
        ],
        **base,
    )
    check_message(with_sys, 2)
    without = messages(
        server,
        messages=[user("Hi"), {"role": "assistant", "content": "Hello."}, user("Again")],
        **base,
    )
    assert prompt_tokens(with_sys) > prompt_tokens(without)


THINKING = {
    "adaptive": {"type": "adaptive"},
    "enabled": {"type": "enabled", "budget_tokens": 1024},
    "disabled": {"type": "disabled"},
}


@pytest.mark.parametrize("mode", list(THINKING))
def test_messages_thinking(server, mode):
    """Thinking on: a random model never closes its reasoning, so all output is a thinking block.

    Thinking off: text only.
    """
    r = messages(server, messages=[user("Hi")], max_tokens=6, thinking=THINKING[mode])
    check_message(r, 6)
    types = [b["type"] for b in r["content"]]
    if mode == "disabled":
        assert "thinking" not in types and types == ["text"], r
    else:
        assert types[0] == "thinking" and r["content"][0]["thinking"], r


@pytest.mark.parametrize("mode", ["enabled", "disabled"])
def test_messages_streaming(server, mode):
    events = messages_stream(server, messages=[user("Hi")], max_tokens=6, thinking=THINKING[mode])
    names = [e for e, _ in events]
    assert names[0] == "message_start" and names[-1] == "message_stop", names
    assert "message_delta" in names and "error" not in names, names
    # content blocks: start, deltas, stop, properly nested and indexed in order
    open_index, seen, text = None, [], {"thinking": "", "text": ""}
    for name, data in events:
        if name == "content_block_start":
            assert open_index is None
            open_index = data["index"]
            seen.append(data["content_block"]["type"])
            assert open_index == len(seen) - 1
        elif name == "content_block_delta":
            assert data["index"] == open_index
            d = data["delta"]
            if d["type"] == "thinking_delta":
                text["thinking"] += d["thinking"]
            elif d["type"] == "text_delta":
                text["text"] += d["text"]
        elif name == "content_block_stop":
            assert data["index"] == open_index
            open_index = None
    assert open_index is None
    delta = next(d for n, d in events if n == "message_delta")
    assert delta["delta"]["stop_reason"] in ("end_turn", "max_tokens")
    assert 0 < delta["usage"]["output_tokens"] <= 6
    if mode == "enabled":
        assert seen and seen[0] == "thinking" and text["thinking"]
    else:
        assert "thinking" not in seen


WEATHER_ANTHROPIC = {
    "name": "get_weather",
    "description": "Current weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


def tool_history(n_results: int) -> list[dict]:
    results = [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny, 21 C"},
        {
            "type": "tool_result",
            "tool_use_id": "toolu_2",
            "content": [{"type": "text", "text": "Rain, 9 C"}],
        },
        {
            "type": "tool_result",
            "tool_use_id": "toolu_3",
            "content": "city not found",
            "is_error": True,
        },
    ][:n_results]
    calls = [
        {"type": "tool_use", "id": f"toolu_{i + 1}", "name": "get_weather", "input": {"city": c}}
        for i, c in enumerate(["Paris", "Oslo", "Atlantis"][:n_results])
    ]
    return [
        user("Weather in Paris, Oslo and Atlantis?"),
        {"role": "assistant", "content": [{"type": "text", "text": "Checking."}, *calls]},
        {"role": "user", "content": [*results, {"type": "text", "text": "Summarize."}]},
    ]


@pytest.mark.parametrize("stream", [False, True])
def test_messages_tool_use_and_results(server, stream):
    """tool_use blocks, then several tool_result blocks (string, block list, is_error) in one
    user message, followed by text."""
    body = dict(tools=[WEATHER_ANTHROPIC], max_tokens=4, thinking={"type": "disabled"})
    if stream:
        events = messages_stream(server, messages=tool_history(3), **body)
        names = [e for e, _ in events]
        assert names[0] == "message_start" and names[-1] == "message_stop", names
        assert "error" not in names
        return
    three = messages(server, messages=tool_history(3), **body)
    check_message(three, 4)
    one = messages(server, messages=tool_history(1), **body)
    # every result reaches the prompt
    assert prompt_tokens(three) > prompt_tokens(one)
