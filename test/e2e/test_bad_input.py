"""Bad requests get a 4xx with an error message, and the server keeps serving.

Runs against the default tiny model with ``--context-length 2048`` (``small_ctx_server``), so
over-long prompts are cheap to build. Every case checks, afterwards, that the process is alive
and answers a normal request.

Anthropic errors must use the Anthropic error shape and one of its documented error types, and a
streaming request that is invalid must be refused with a 4xx before any event is sent (as
/v1/chat/completions does), not with HTTP 200 and an error event inside the stream.
"""
from __future__ import annotations

import json

import pytest
import requests

from e2e_util import SMALL_CONTEXT, TIMEOUT

LONG_TEXT = "The quick brown fox jumps over the lazy dog. " * 500  # ~6.5k tokens > 2048
MSG = [{"role": "user", "content": "Hi"}]
LONG_MSG = [{"role": "user", "content": LONG_TEXT}]
OBJ_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}

ANTHROPIC_ERROR_TYPES = {
    "invalid_request_error", "authentication_error", "billing_error", "permission_error",
    "not_found_error", "request_too_large", "rate_limit_error", "timeout_error", "api_error",
    "overloaded_error",
}


def tool(parameters) -> dict:
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


def chat_body(**kw) -> dict:
    return {"model": "default", "messages": MSG, "max_tokens": 4, **kw}


def anth_body(**kw) -> dict:
    return {"model": "default", "messages": MSG, "max_tokens": 4, **kw}


CHAT, MESSAGES = "/v1/chat/completions", "/v1/messages"

# (id, path, JSON body or raw string)
CASES = [
    # --- OpenAI chat ---
    ("chat-malformed-json", CHAT, '{"model": "default", "messages": ['),
    ("chat-messages-string", CHAT, chat_body(messages="Hi")),
    ("chat-max-tokens-string", CHAT, chat_body(max_tokens="lots")),
    ("chat-max-tokens-negative", CHAT, chat_body(max_tokens=-1)),
    ("chat-temperature-string", CHAT, chat_body(temperature="hot")),
    ("chat-empty-messages", CHAT, chat_body(messages=[])),
    ("chat-unknown-role", CHAT, chat_body(messages=[{"role": "wizard", "content": "x"}])),
    ("chat-tools-string", CHAT, chat_body(tools="f")),
    ("chat-tool-without-function", CHAT, chat_body(tools=[{"type": "function"}])),
    ("chat-tool-parameters-string", CHAT, chat_body(tools=[tool("notadict")])),
    ("chat-tool-properties-string", CHAT, chat_body(tools=[tool({"type": "object", "properties": "x"})])),
    ("chat-tool-bad-schema-type", CHAT, chat_body(
        tools=[tool({"type": "object", "properties": {"a": {"type": "nonsense"}}})],
        tool_choice="required", chat_template_kwargs={"enable_thinking": False})),
    ("chat-tool-choice-unknown-tool", CHAT, chat_body(
        tools=[OBJ_TOOL], tool_choice={"type": "function", "function": {"name": "nope"}})),
    ("chat-tool-choice-bad-string", CHAT, chat_body(tools=[OBJ_TOOL], tool_choice="sometimes")),
    ("chat-tool-choice-required-without-tools", CHAT, chat_body(tool_choice="required")),
    ("chat-max-tokens-over-context", CHAT, chat_body(max_tokens=100_000)),
    ("chat-max-completion-tokens-over-context", CHAT, chat_body(max_completion_tokens=100_000)),
    ("chat-prompt-plus-max-tokens-over-context", CHAT, chat_body(max_tokens=SMALL_CONTEXT - 8)),
    ("chat-prompt-over-context", CHAT, chat_body(messages=LONG_MSG)),
    ("chat-prompt-over-context-stream", CHAT, chat_body(messages=LONG_MSG, stream=True)),
    # --- Anthropic messages ---
    ("messages-malformed-json", MESSAGES, '{"model": "default", "messages": ['),
    ("messages-messages-string", MESSAGES, anth_body(messages="Hi")),
    ("messages-max-tokens-string", MESSAGES, anth_body(max_tokens="lots")),
    ("messages-max-tokens-missing", MESSAGES, {"model": "default", "messages": MSG}),
    ("messages-unknown-block-type", MESSAGES, anth_body(
        messages=[{"role": "user", "content": [{"type": "bogus", "text": "x"}]}])),
    ("messages-input-schema-string", MESSAGES, anth_body(tools=[{"name": "f", "input_schema": "x"}])),
    ("messages-input-schema-bad-type", MESSAGES, anth_body(
        tools=[{"name": "f", "input_schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}])),
    ("messages-tool-choice-unknown-tool", MESSAGES, anth_body(
        tools=[{"name": "f", "input_schema": {"type": "object"}}], tool_choice={"type": "tool", "name": "nope"})),
    ("messages-thinking-enabled-without-budget", MESSAGES, anth_body(thinking={"type": "enabled"})),
    ("messages-max-tokens-over-context", MESSAGES, anth_body(max_tokens=100_000)),
    ("messages-prompt-over-context", MESSAGES, anth_body(messages=LONG_MSG)),
    ("messages-prompt-over-context-stream", MESSAGES, anth_body(messages=LONG_MSG, stream=True)),
    # --- native and legacy completions ---
    ("generate-malformed-json", "/generate", '{"text": "hi", '),
    ("generate-prompt-over-context", "/generate", {"text": LONG_TEXT, "sampling_params": {"max_new_tokens": 4}}),
    ("generate-max-new-tokens-over-context", "/generate",
     {"text": "hi", "sampling_params": {"max_new_tokens": 100_000}}),
    ("completions-prompt-over-context", "/v1/completions", {"model": "default", "prompt": LONG_TEXT, "max_tokens": 4}),
]


def error_message(path: str, payload) -> str:
    """The error message of an error body, checking the Anthropic shape on /v1/messages."""
    assert isinstance(payload, dict), payload
    if path == MESSAGES:
        assert payload.get("type") == "error", payload
        err = payload["error"]
        assert err["type"] in ANTHROPIC_ERROR_TYPES, f"not an Anthropic error type: {err}"
        return err["message"]
    err = payload.get("error", payload)
    if isinstance(err, str):
        return err
    return err.get("message") or payload.get("message")


def still_serves(srv) -> None:
    assert srv.proc.poll() is None, f"server died:\n{srv.log_tail()}"
    r = requests.post(srv.url + CHAT, json=chat_body(max_tokens=1), timeout=TIMEOUT)
    assert r.status_code == 200, f"{r.status_code} {r.text[:500]}\n{srv.log_tail()}"
    assert r.json()["usage"]["completion_tokens"] == 1


@pytest.mark.parametrize("path, body", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_request(small_ctx_server, path, body):
    srv = small_ctx_server
    stream = isinstance(body, dict) and bool(body.get("stream"))
    kw = {"data": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, str) else {"json": body}
    r = requests.post(srv.url + path, timeout=TIMEOUT, stream=stream, **kw)
    text = r.text[:1500]
    assert 400 <= r.status_code < 500, f"expected a 4xx, got {r.status_code}: {text}"
    try:
        payload = json.loads(r.text)
    except ValueError:
        pytest.fail(f"error body is not JSON: {text}")
    message = error_message(path, payload)
    assert isinstance(message, str) and message.strip(), payload
    # It names what is wrong, without the server's internals (file paths, tracebacks, whole
    # JSON meta-schemas).
    assert 'File "' not in message and "Traceback" not in message, message
    assert len(message) <= 600, f"{len(message)} characters: {message}"
    still_serves(srv)


@pytest.mark.parametrize("path, body, names", [
    (CHAT, '{"model": "default", "messages": [', "Malformed JSON in the request body at character"),
    (MESSAGES, '{"model": "default", "messages": [', "Malformed JSON in the request body at character"),
    (CHAT, chat_body(max_tokens="lots"), "max_tokens"),
    (CHAT, chat_body(tools=[tool({"type": "object", "properties": {"a": {"type": "nonsense"}}})]),
     "$.properties.a.type"),
    (MESSAGES, anth_body(tools=[{"name": "f", "input_schema": {
        "type": "object", "properties": {"a": {"type": "nonsense"}}}}]),
     "tools.0.input_schema is not a valid JSON Schema at $.properties.a.type"),
], ids=["chat-json", "messages-json", "chat-field", "chat-tool-schema-path", "messages-tool-schema-field"])
def test_message_names_what_is_wrong(small_ctx_server, path, body, names):
    kw = {"data": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, str) else {"json": body}
    r = requests.post(small_ctx_server.url + path, timeout=TIMEOUT, **kw)
    assert r.status_code == 400, r.text[:500]
    assert names in error_message(path, r.json()), r.text[:500]
