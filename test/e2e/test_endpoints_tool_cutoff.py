"""A tool call cut off by ``max_tokens`` is reported one way on every route and stream mode.

The shape (``sglang/srt/entrypoints/openai/tool_call_cutoff.py``): ``finish_reason`` ``length``
(``/v1/messages``: ``stop_reason`` ``max_tokens``), and the cut call as far as it was generated:
its name and, as arguments, the text the model wrote, unterminated (streaming: the deltas, or
``input_json_delta`` fragments, concatenate to it); ``/v1/messages`` without streaming gives the
prefix parsed leniently as ``input``. A call cut inside its name is returned as content.

The model's output is scripted server-side (``scripted_rules``, the default ``server`` fixture's
``SGLANG_TEST_SCRIPTED_OUTPUT`` hook), so the model deterministically opens a call and runs out
of tokens; ``max_tokens`` is the script's token count, so the end-of-turn token after it never
comes. Runs on the default pooled server right after test_endpoints.py (no server start of its
own).
"""

from __future__ import annotations

import functools
import json

import pytest
from e2e_util import chat, chat_stream, messages, messages_stream, user

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a shell command",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string"}, "cwd": {"type": "string"}},
                "required": ["command", "cwd"],
            },
        },
    }
]
ANTH_TOOLS = [
    {"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS
]
PROMPT = "List the files in /tmp."
ARGS = '{"command": "ls -la /tmp && echo'  # the cut call's arguments as generated
CUT = '<tool_call>\n{"name": "bash", "arguments": ' + ARGS
DONE_CALL = (
    '<tool_call>\n{"name": "bash", "arguments": {"command": "pwd", "cwd": "/"}}\n</tool_call>'
)
NAME_CUT = '<tool_call>\n{"name": "ba'
# The chat template leaves the model inside <think>: the script closes it first.
THINK = "Let me look.\n</think>\n\n"


@functools.lru_cache(maxsize=2)
def _tokenizer(model_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def n_tokens(server, text: str) -> int:
    """Tokens the server forces for ``text`` (the hook's encoding, without its end token)."""
    return len(_tokenizer(str(server.model)).encode(text, add_special_tokens=False))


def script(server, scripted_rules, output: str) -> int:
    """Make the server answer ``PROMPT`` with ``THINK + output``; return the token budget that
    ends the output exactly there."""
    scripted_rules([{"when": PROMPT, "text": THINK + output}])
    return n_tokens(server, THINK + output)


def chat_body(budget: int) -> dict:
    return dict(messages=[user(PROMPT)], tools=TOOLS, max_tokens=budget)


def anth_body(budget: int) -> dict:
    return dict(messages=[user(PROMPT)], tools=ANTH_TOOLS, max_tokens=budget)


def stream_calls(chunks: list[dict]) -> tuple[list[tuple[str, str]], str | None, str]:
    """(name, concatenated arguments) per streamed call, the last finish_reason, the content."""
    calls: dict[int, list[str]] = {}
    finish, content = None, ""
    for c in chunks:
        for choice in c["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            for tc in delta.get("tool_calls") or []:
                entry = calls.setdefault(tc["index"], ["", ""])
                entry[0] += tc["function"].get("name") or ""
                entry[1] += tc["function"].get("arguments") or ""
            finish = choice.get("finish_reason") or finish
    return [tuple(calls[i]) for i in sorted(calls)], finish, content


def not_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return True
    return False


def test_chat_cut_call(server, scripted_rules):
    j = chat(server, **chat_body(script(server, scripted_rules, CUT)))
    choice = j["choices"][0]
    assert choice["finish_reason"] == "length", choice
    calls = choice["message"]["tool_calls"]
    assert calls and len(calls) == 1, choice["message"]
    assert calls[0]["function"]["name"] == "bash"
    assert calls[0]["function"]["arguments"] == ARGS and not_json(ARGS)
    assert not (choice["message"]["content"] or "").strip()


def test_chat_stream_cut_call(server, scripted_rules):
    chunks = chat_stream(server, **chat_body(script(server, scripted_rules, CUT)))
    calls, finish, content = stream_calls(chunks)
    assert finish == "length"
    assert calls == [("bash", ARGS)], "the stream closed or dropped the cut call"
    assert not content.strip()


def test_chat_complete_then_cut_call(server, scripted_rules):
    """A complete call before the cut one stays a normal call; streaming says the same."""
    budget = script(server, scripted_rules, DONE_CALL + "\n" + CUT)
    j = chat(server, **chat_body(budget))
    choice = j["choices"][0]
    assert choice["finish_reason"] == "length"
    got = [
        (c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"]
    ]
    assert got[0][0] == "bash" and json.loads(got[0][1]) == {"command": "pwd", "cwd": "/"}
    assert got[1] == ("bash", ARGS)
    calls, finish, _ = stream_calls(chat_stream(server, **chat_body(budget)))
    assert finish == "length" and [c[0] for c in calls] == ["bash", "bash"]
    assert json.loads(calls[0][1]) == {"command": "pwd", "cwd": "/"} and calls[1][1] == ARGS


def test_chat_cut_in_name_is_content(server, scripted_rules):
    """Cut before its name is complete there is no call: its text is content, not dropped."""
    j = chat(server, **chat_body(script(server, scripted_rules, NAME_CUT)))
    choice = j["choices"][0]
    assert choice["finish_reason"] == "length"
    assert not choice["message"].get("tool_calls")
    assert choice["message"]["content"] == NAME_CUT


def test_messages_cut_call(server, scripted_rules):
    j = messages(server, **anth_body(script(server, scripted_rules, CUT)))
    assert j["stop_reason"] == "max_tokens", j
    blocks = [b for b in j["content"] if b["type"] == "tool_use"]
    assert len(blocks) == 1 and blocks[0]["name"] == "bash"
    # the generated prefix, parsed leniently: what an Anthropic SDK accumulates from the stream
    assert blocks[0]["input"] == {"command": "ls -la /tmp && echo"}


def test_messages_stream_cut_call(server, scripted_rules):
    events = messages_stream(server, **anth_body(script(server, scripted_rules, CUT)))
    starts = [d for e, d in events if e == "content_block_start"]
    tool_blocks = [d["index"] for d in starts if d["content_block"]["type"] == "tool_use"]
    assert len(tool_blocks) == 1
    assert [d for d in starts if d["index"] == tool_blocks[0]][0]["content_block"]["name"] == "bash"
    partial = "".join(
        d["delta"]["partial_json"]
        for e, d in events
        if e == "content_block_delta" and d["index"] == tool_blocks[0]
    )
    assert partial == ARGS, "the stream closed the cut call's JSON"
    stop = [d["delta"]["stop_reason"] for e, d in events if e == "message_delta"]
    assert stop == ["max_tokens"]
    assert events[-1][0] == "message_stop"


@pytest.mark.parametrize("stream", [False, True])
def test_complete_call_still_tool_calls(server, scripted_rules, stream):
    """Control: the same call finished (end-of-turn token inside the budget) is a normal call."""
    budget = script(server, scripted_rules, DONE_CALL) + 1
    if stream:
        calls, finish, _ = stream_calls(chat_stream(server, **chat_body(budget)))
    else:
        choice = chat(server, **chat_body(budget))["choices"][0]
        finish = choice["finish_reason"]
        calls = [
            (c["function"]["name"], c["function"]["arguments"])
            for c in choice["message"]["tool_calls"]
        ]
    assert finish == "tool_calls"
    assert len(calls) == 1 and json.loads(calls[0][1]) == {"command": "pwd", "cwd": "/"}


def test_script_requests_are_recorded(server, scripted_rules):
    """The hook records what the server was sent (the client e2e tests assert on it)."""
    seen = scripted_rules([{"when": PROMPT, "text": THINK + "Done."}])
    j = messages(server, **anth_body(16))
    assert j["stop_reason"] == "end_turn"
    assert [b["text"].strip() for b in j["content"] if b["type"] == "text"] == ["Done."]
    rows = [json.loads(line) for line in seen.read_text().splitlines()]
    assert [(r["route"], r["rule"], r["tools"]) for r in rows] == [("/v1/messages", 0, ["bash"])]
