"""The chat template renders every captured agent request (read-only use of the traces).

Each request goes through SGLang's own request models and message preprocessing (Anthropic
requests through SGLang's Anthropic-to-OpenAI conversion) before the template, as in
serving_chat. Nothing here is trained or tuned on the traces.
"""

import json
import re
import types

import pytest
from conftest import TRACES, missing_traces

OPENAI_CLIENTS = ("openclaw", "opencode")
ALL_CLIENTS = OPENAI_CLIENTS + ("claude_code_custom_model",)


def trace_files(clients=ALL_CLIENTS):
    files = []
    for client in clients:
        files += sorted((TRACES / client).glob("[0-9][0-9].json"))
    return files


@pytest.fixture(autouse=True, scope="module")
def _traces_present():
    """Every test here fails when a client's traces are missing (see conftest: opt out to skip)."""
    missing = [c for c in ALL_CLIENTS if not trace_files((c,))]
    if missing:
        missing_traces(f"no traces of {', '.join(missing)} under {TRACES}")


def to_chat_request(path):
    body = json.loads(path.read_text())
    if path.parent.name in OPENAI_CLIENTS:
        from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest

        return ChatCompletionRequest(**body)
    from sglang.srt.entrypoints.anthropic.protocol import AnthropicMessagesRequest
    from sglang.srt.entrypoints.anthropic.serving import AnthropicServing

    serving = object.__new__(AnthropicServing)  # only the conversion is used
    serving._merge_inline_system = False  # the template renders inline system messages
    serving.openai_serving_chat = types.SimpleNamespace(
        apply_reasoning_enabled=lambda request, enabled: None,
        supports_native_reasoning_history=lambda: False,
        wrap_reasoning_history=lambda text: f"<think>{text}\n</think>",  # qwen3 detector's
    )
    return serving._convert_to_chat_completion_request(AnthropicMessagesRequest(**body))


def template_inputs(request):
    """(messages, tools) as serving_chat hands them to the template for a string-content one."""
    from sglang.srt.entrypoints.openai.serving_chat import (
        normalize_assistant_tool_call_arguments,
        normalize_tool_content,
    )
    from sglang.srt.parser.jinja_template_utils import process_content_for_template_format

    messages = []
    for msg in (m.model_dump() for m in request.messages):
        normalize_assistant_tool_call_arguments(msg, strict=True)
        if msg.get("content") is None:
            msg["content"] = ""
        msg = process_content_for_template_format(msg, "string", [], [], [], [])
        msg["content"] = normalize_tool_content(msg["role"], msg.get("content"))
        messages.append(msg)
    tools = None
    if request.tools and request.tool_choice != "none":
        tools = [t.model_dump() for t in request.tools]
    return messages, tools


@pytest.fixture(scope="module")
def rendered(hf_tokenizer):
    out = {}
    for path in trace_files():
        request = to_chat_request(path)
        messages, tools = template_inputs(request)
        text = hf_tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=True
        )
        out[f"{path.parent.name}/{path.name}"] = (request, messages, tools, text)
    return out


def test_every_request_renders(rendered):
    assert len(rendered) == len(trace_files())
    for key, (_request, messages, tools, text) in rendered.items():
        assert text.endswith("<|im_start|>assistant\n"), key
        assert text.count("<|im_start|>") == text.count("<|im_end|>") + 1, key
        if tools:
            assert text.startswith("<|im_start|>system\n"), key
            for tool in tools:
                assert json.dumps(tool, ensure_ascii=False) in text, (key, tool["function"]["name"])
        n_tool_msgs = sum(m["role"] == "tool" for m in messages)
        assert text.count("<tool_response>\n") == n_tool_msgs, key
        n_calls = sum(len(m.get("tool_calls") or []) for m in messages)
        assert text.count("<tool_call>\n{") == n_calls + (1 if tools else 0), key


def test_reasoning_kept_only_after_last_user_query(rendered):
    """Scripted replies carry THINK[uXsY] reasoning; only turns after the last user query keep it."""
    checked = 0
    for key, (_, messages, _, text) in rendered.items():
        last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
        for i, msg in enumerate(messages):
            if msg["role"] != "assistant":
                continue
            reasoning = msg.get("reasoning_content")
            if not reasoning:
                m = re.search(r"<think>(.*?)</think>", msg.get("content") or "", re.S)
                reasoning = m.group(1) if m else None
            if not reasoning:
                continue
            checked += 1
            assert (reasoning.strip() in text) == (i > last_user), (key, i)
    assert checked > 0


def test_openclaw_request_fits_context(rendered, hf_tokenizer, tm):
    keys = sorted(k for k in rendered if k.startswith("openclaw/"))
    assert keys
    text = max((rendered[k][3] for k in keys), key=len)
    n = len(hf_tokenizer.encode(text))
    print(
        f"largest openclaw request: {len(text)} chars, {n} tokens, {len(text) / n:.2f} chars/token"
    )
    assert n < tm.MAX_POSITION_EMBEDDINGS // 8


def test_largest_request_fits_context(rendered, hf_tokenizer, tm):
    text = max((v[3] for v in rendered.values()), key=len)
    n = len(hf_tokenizer.encode(text))
    print(f"largest request: {len(text)} chars, {n} tokens, {len(text) / n:.2f} chars/token")
    assert n < tm.MAX_POSITION_EMBEDDINGS * 3 // 4  # room for the reply
