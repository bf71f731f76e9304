"""Bad requests get a 4xx with an error message, and the server keeps serving.

Runs against the default tiny model with ``--context-length 2048`` (``small_ctx_server``), so
over-long prompts are cheap to build. Every case gets a 400 whose message names the offending
field as the client sent it (``max_tokens: Input should be a valid integer``, a bad tool
schema's JSON path, ``tools.N.input_schema`` on /v1/messages), where the JSON stopped parsing,
or the limit the request broke (the context length); afterwards the process must be alive and
answer a normal request.

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
    "invalid_request_error",
    "authentication_error",
    "billing_error",
    "permission_error",
    "not_found_error",
    "request_too_large",
    "rate_limit_error",
    "timeout_error",
    "api_error",
    "overloaded_error",
}


def tool(parameters) -> dict:
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


def chat_body(**kw) -> dict:
    return {"model": "default", "messages": MSG, "max_tokens": 4, **kw}


def anth_body(**kw) -> dict:
    return {"model": "default", "messages": MSG, "max_tokens": 4, **kw}


CHAT, MESSAGES = "/v1/chat/completions", "/v1/messages"
BAD_JSON = '{"model": "default", "messages": ['
CTX = str(SMALL_CONTEXT)
TOO_LONG = "is longer than the model's context length (2048 tokens)"
assert CTX in TOO_LONG
EMPTY = "The input is empty (0 tokens)"
ANTH_TOO_LONG = ["prompt is too long: ", f" tokens > {CTX} maximum"]


def json_error_at(raw: str) -> str:
    """What the message must say of ``raw``: where Python's JSON parser stopped."""
    try:
        json.loads(raw)
    except json.JSONDecodeError as e:
        return f"Malformed JSON in the request body at character {e.pos}: "
    raise AssertionError(f"{raw!r} is valid JSON")


# (id, path, JSON body or raw string, what the message must contain: the offending field as the
# client sent it, or the limit it broke).
CASES = [
    # --- OpenAI chat ---
    ("chat-malformed-json", CHAT, BAD_JSON, [json_error_at(BAD_JSON)]),
    (
        "chat-messages-string",
        CHAT,
        chat_body(messages="Hi"),
        ["messages: Input should be a valid list"],
    ),
    (
        "chat-max-tokens-string",
        CHAT,
        chat_body(max_tokens="lots"),
        ["max_tokens: Input should be a valid integer"],
    ),
    (
        "chat-max-tokens-negative",
        CHAT,
        chat_body(max_tokens=-1),
        ["max_tokens must be at least 0, got -1"],
    ),
    (
        "chat-temperature-string",
        CHAT,
        chat_body(temperature="hot"),
        ["temperature: Input should be a valid number"],
    ),
    ("chat-empty-messages", CHAT, chat_body(messages=[]), ["Messages cannot be empty"]),
    (
        "chat-unknown-role",
        CHAT,
        chat_body(messages=[{"role": "wizard", "content": "x"}]),
        ["messages.0.", ".role: ", "'role' must be one of"],
    ),
    ("chat-tools-string", CHAT, chat_body(tools="f"), ["tools: Input should be a valid list"]),
    (
        "chat-tool-without-function",
        CHAT,
        chat_body(tools=[{"type": "function"}]),
        ["tools.0.function: Field required"],
    ),
    (
        "chat-tool-parameters-string",
        CHAT,
        chat_body(tools=[tool("notadict")]),
        ["Tool 0 function has invalid 'parameters' schema at $: "],
    ),
    (
        "chat-tool-properties-string",
        CHAT,
        chat_body(tools=[tool({"type": "object", "properties": "x"})]),
        ["Tool 0 function has invalid 'parameters' schema at $.properties: "],
    ),
    (
        "chat-tool-bad-schema-type",
        CHAT,
        chat_body(
            tools=[tool({"type": "object", "properties": {"a": {"type": "nonsense"}}})],
            tool_choice="required",
            chat_template_kwargs={"enable_thinking": False},
        ),
        ["Tool 0 function has invalid 'parameters' schema at $.properties.a.type: "],
    ),
    (
        "chat-tool-bad-schema-type-auto",
        CHAT,
        chat_body(  # validated without a tool_choice too
            tools=[tool({"type": "object", "properties": {"a": {"type": "nonsense"}}})]
        ),
        ["Tool 0 function has invalid 'parameters' schema at $.properties.a.type: "],
    ),
    (
        "chat-tool-choice-unknown-tool",
        CHAT,
        chat_body(tools=[OBJ_TOOL], tool_choice={"type": "function", "function": {"name": "nope"}}),
        ["tool_choice: ", "'nope' not found in tools"],
    ),
    (
        "chat-tool-choice-bad-string",
        CHAT,
        chat_body(tools=[OBJ_TOOL], tool_choice="sometimes"),
        ["tool_choice.", "'auto', 'required' or 'none'"],
    ),
    (
        "chat-tool-choice-required-without-tools",
        CHAT,
        chat_body(tool_choice="required"),
        ["tool_choice: ", "Tools cannot be empty", "required"],
    ),
    (
        "chat-max-tokens-over-context",
        CHAT,
        chat_body(max_tokens=100_000),
        ["max_tokens is too large: 100000. ", f"at most {CTX} completion tokens"],
    ),
    (
        "chat-max-completion-tokens-over-context",
        CHAT,
        chat_body(max_completion_tokens=100_000),
        ["max_completion_tokens is too large: 100000", f"at most {CTX} completion tokens"],
    ),
    (
        "chat-prompt-plus-max-tokens-over-context",
        CHAT,
        chat_body(max_tokens=SMALL_CONTEXT - 8),
        [
            f"maximum context length of {CTX} tokens",
            f"{SMALL_CONTEXT - 8} tokens for the completion",
        ],
    ),
    ("chat-prompt-over-context", CHAT, chat_body(messages=LONG_MSG), [TOO_LONG]),
    (
        "chat-prompt-over-context-stream",
        CHAT,
        chat_body(messages=LONG_MSG, stream=True),
        [TOO_LONG],
    ),
    # --- Anthropic messages ---
    ("messages-malformed-json", MESSAGES, BAD_JSON, [json_error_at(BAD_JSON)]),
    (
        "messages-messages-string",
        MESSAGES,
        anth_body(messages="Hi"),
        ["messages: Input should be a valid list"],
    ),
    (
        "messages-max-tokens-string",
        MESSAGES,
        anth_body(max_tokens="lots"),
        ["max_tokens: Input should be a valid integer"],
    ),
    (
        "messages-max-tokens-missing",
        MESSAGES,
        {"model": "default", "messages": MSG},
        ["max_tokens: Field required"],
    ),
    (
        "messages-unknown-block-type",
        MESSAGES,
        anth_body(messages=[{"role": "user", "content": [{"type": "bogus", "text": "x"}]}]),
        ["messages.0.content", "'bogus'"],
    ),
    (
        "messages-input-schema-string",
        MESSAGES,
        anth_body(tools=[{"name": "f", "input_schema": "x"}]),
        ["tools.0.input_schema: Input should be a valid dictionary"],
    ),
    (
        "messages-input-schema-bad-type",
        MESSAGES,
        anth_body(
            tools=[
                {
                    "name": "f",
                    "input_schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}},
                }
            ]
        ),
        ["tools.0.input_schema is not a valid JSON Schema at $.properties.a.type: "],
    ),
    (
        "messages-tool-choice-unknown-tool",
        MESSAGES,
        anth_body(
            tools=[{"name": "f", "input_schema": {"type": "object"}}],
            tool_choice={"type": "tool", "name": "nope"},
        ),
        ["tool_choice", "'nope'"],
    ),
    (
        "messages-thinking-enabled-without-budget",
        MESSAGES,
        anth_body(thinking={"type": "enabled"}),
        ["thinking.budget_tokens is required"],
    ),
    (
        "messages-max-tokens-over-context",
        MESSAGES,
        anth_body(max_tokens=100_000),
        ["max_tokens is too large: 100000. ", f"at most {CTX} completion tokens"],
    ),
    # Anthropic's own overflow message, which Claude Code compacts on (patch 0060)
    ("messages-prompt-over-context", MESSAGES, anth_body(messages=LONG_MSG), ANTH_TOO_LONG),
    (
        "messages-prompt-over-context-stream",
        MESSAGES,
        anth_body(messages=LONG_MSG, stream=True),
        ANTH_TOO_LONG,
    ),
    # --- native and legacy completions ---
    ("generate-malformed-json", "/generate", '{"text": "hi", ', [json_error_at('{"text": "hi", ')]),
    (
        "generate-prompt-over-context",
        "/generate",
        {"text": LONG_TEXT, "sampling_params": {"max_new_tokens": 4}},
        [TOO_LONG],
    ),
    (
        "generate-max-new-tokens-over-context",
        "/generate",
        {"text": "hi", "sampling_params": {"max_new_tokens": 100_000}},
        [f"maximum context length of {CTX} tokens", "100000 tokens for the completion"],
    ),
    (
        "completions-prompt-over-context",
        "/v1/completions",
        {"model": "default", "prompt": LONG_TEXT, "max_tokens": 4},
        [TOO_LONG],
    ),
    # --- found by test_endpoints_fuzz.py ---
    # an empty prompt reached the scheduler and killed it (patch 0071); upstream already
    # refuses "input_ids": [] and an empty /v1/completions prompt
    (
        "generate-empty-text",
        "/generate",
        {"text": "", "sampling_params": {"max_new_tokens": 1}},
        [EMPTY],
    ),
    (
        "generate-empty-text-in-batch",
        "/generate",
        {"text": ["a", ""], "sampling_params": {"max_new_tokens": 1}},
        [EMPTY],
    ),
    ("generate-empty-input-ids-in-batch", "/generate", {"input_ids": [[]]}, [EMPTY]),
    # an id outside the vocabulary failed the embedding lookup and killed the server (0071)
    (
        "completions-prompt-id-negative",
        "/v1/completions",
        {"model": "default", "prompt": [956, -1], "max_tokens": 1},
        ["out-of-vocabulary token id -1 at position 1"],
    ),
    (
        "generate-input-id-beyond-vocab",
        "/generate",
        {"input_ids": [1, 2**31], "sampling_params": {"max_new_tokens": 1}},
        [f"out-of-vocabulary token id {2**31} at position 1"],
    ),
    # an out-of-vocabulary stop id with min_tokens killed the server (patch 0074)
    (
        "completions-stop-token-id-beyond-vocab",
        "/v1/completions",
        {
            "model": "default",
            "prompt": "hi",
            "max_tokens": 4,
            "min_tokens": 2,
            "stop_token_ids": [0, 2**53 + 1],
        },
        [f"stop_token_ids contains out-of-vocabulary token id {2**53 + 1}"],
    ),
    # a tiny repetition penalty overflowed the logits it divides, NaN probabilities killed the
    # server (patch 0076; the fuzz test's body)
    (
        "generate-repetition-penalty-overflows",
        "/generate",
        {
            "text": "hi",
            "sampling_params": {"repetition_penalty": 6.1e-177, "top_k": 31, "max_new_tokens": 5},
        },
        ["repetition_penalty must be in [1e-06, 2]"],
    ),
    # a sampling_params list unlike the prompts: 500 (patch 0073)
    (
        "generate-sampling-params-list-single-prompt",
        "/generate",
        {"text": " ", "sampling_params": [{"max_new_tokens": 1}]},
        ["sampling_params: a single prompt takes one object, not a list of 1"],
    ),
    (
        "generate-sampling-params-empty-list",
        "/generate",
        {"text": ["a"], "sampling_params": []},
        ["sampling_params: a list of 0 for a batch of 1 prompts"],
    ),
    (
        "generate-sampling-params-short-list",
        "/generate",
        {"text": ["a", "b"], "sampling_params": [{"max_new_tokens": 1}]},
        ["sampling_params: a list of 1 for a batch of 2 prompts"],
    ),
    # a "before" validator read the field as a dict: 500 (patch 0072)
    (
        "chat-response-format-bool",
        CHAT,
        chat_body(response_format=True),
        ["response_format", "Input should be a valid dictionary"],
    ),
    (
        "chat-response-format-list",
        CHAT,
        chat_body(response_format=[1]),
        ["response_format", "Input should be a valid dictionary"],
    ),
]
CASE_BY_ID = {c[0]: c for c in CASES}


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


def post_case(srv, path, body) -> tuple[requests.Response, str]:
    """POST a case; (response, its error message), checking the error shape."""
    stream = isinstance(body, dict) and bool(body.get("stream"))
    kw = (
        {"data": body, "headers": {"Content-Type": "application/json"}}
        if isinstance(body, str)
        else {"json": body}
    )
    r = requests.post(srv.url + path, timeout=TIMEOUT, stream=stream, **kw)
    text = r.text[:1500]
    assert 400 <= r.status_code < 500, f"expected a 4xx, got {r.status_code}: {text}"
    try:
        payload = json.loads(r.text)
    except ValueError:
        pytest.fail(f"error body is not JSON: {text}")
    message = error_message(path, payload)
    assert isinstance(message, str) and message.strip(), payload
    return r, message


def check_message(message: str, names: list[str]) -> None:
    """It names what is wrong (every piece of ``names``), without the server's internals (file
    paths, tracebacks, whole JSON meta-schemas)."""
    missing = [n for n in names if n not in message]
    assert not missing, f"message does not name {missing}: {message!r}"
    assert 'File "' not in message and "Traceback" not in message, message
    assert len(message) <= 600, f"{len(message)} characters: {message}"


@pytest.mark.parametrize("path, body, names", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_request(small_ctx_server, path, body, names):
    srv = small_ctx_server
    r, message = post_case(srv, path, body)
    assert r.status_code == 400, f"{r.status_code}: {message}"
    check_message(message, names)
    still_serves(srv)


@pytest.mark.parametrize(
    "generic",
    [
        "Bad request",
        "Invalid request",
        "Input should be a valid list",
        "The request is invalid: 400",
    ],
)
def test_expectations_reject_a_generic_message(generic):
    """No server: every case's expectation fails a message that names nothing in particular."""
    for case_id, _, _, names in CASES:
        assert names, case_id
        with pytest.raises(AssertionError):
            check_message(generic, names)
