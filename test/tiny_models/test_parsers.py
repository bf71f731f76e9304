"""SGLang's qwen3 reasoning parser and qwen/qwen25 tool-call parser read what the template writes.

The assistant turn is rendered by the chat template (exactly what a model trained on it would
emit), tokenized, and detokenized the way SGLang does, then parsed in one go and streamed token
by token.
"""

import json

import pytest

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read",
            "description": "Read a file",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "limit": {"type": "integer"}},
                "required": ["path"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a shell command",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string"}},
                "required": ["command"],
            },
        },
    },
]

CALLS = [
    ("read", {"path": "/tmp/a b/ü.txt", "limit": 20}),
    ("bash", {"command": 'grep -n "x" *.py | head -n 3 && echo \'{"k": [1]}\''}),
]
REASONING = "The user wants the file.\nI will read it, then list matches."
CONTENT = "Let me check."


def assistant_turn(render, reasoning=REASONING, content=CONTENT, calls=CALLS):
    msgs = [
        {"role": "user", "content": "look"},
        {
            "role": "assistant",
            "content": content,
            "reasoning_content": reasoning,
            "tool_calls": [
                {"id": f"c{i}", "type": "function", "function": {"name": n, "arguments": a}}
                for i, (n, a) in enumerate(calls)
            ],
        },
    ]
    text = render(msgs)
    head = "<|im_start|>assistant\n"
    return text[text.rindex(head) + len(head) :]  # generated part, ends with <|im_end|>\n


@pytest.fixture(scope="module")
def render(hf_tokenizer):
    return lambda msgs: hf_tokenizer.apply_chat_template(msgs, tools=TOOLS, tokenize=False)


@pytest.fixture(scope="module")
def sgl_tools():
    from sglang.srt.entrypoints.openai.protocol import Tool

    return [Tool(**t) for t in TOOLS]


def generated_text(hf_tokenizer, turn, skip_special_tokens):
    """Tokenize the turn up to and excluding <|im_end|> (the stop token), detokenize."""
    ids = hf_tokenizer.encode(turn)
    stop = hf_tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = ids[: ids.index(stop)]
    return ids, hf_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def check_calls(calls):
    assert [c.name for c in calls] == [n for n, _ in CALLS]
    assert [json.loads(c.parameters) for c in calls] == [a for _, a in CALLS]


@pytest.mark.parametrize("skip_special_tokens", [False, True])
@pytest.mark.parametrize("parser_name", ["qwen25", "qwen"])
def test_non_stream(render, hf_tokenizer, sgl_tools, parser_name, skip_special_tokens):
    from sglang.srt.function_call.function_call_parser import FunctionCallParser
    from sglang.srt.parser.reasoning_parser import ReasoningParser

    turn = assistant_turn(render)
    assert turn.startswith("<think>\n")
    _, text = generated_text(hf_tokenizer, turn, skip_special_tokens)
    reasoning, normal = ReasoningParser("qwen3", stream_reasoning=False).parse_non_stream(text)
    assert reasoning.strip() == REASONING
    parser = FunctionCallParser(sgl_tools, parser_name)
    assert parser.has_tool_call(normal)
    rest, calls = parser.parse_non_stream(normal)
    assert rest.strip() == CONTENT
    check_calls(calls)


def test_streaming_token_by_token(render, hf_tokenizer, sgl_tools):
    from sglang.srt.function_call.function_call_parser import FunctionCallParser
    from sglang.srt.parser.reasoning_parser import ReasoningParser

    ids, full = generated_text(hf_tokenizer, assistant_turn(render), False)
    reasoning_parser = ReasoningParser("qwen3", stream_reasoning=True)
    tool_parser = FunctionCallParser(sgl_tools, "qwen25")
    reasoning, normal = "", ""
    names, args = {}, {}
    prev = ""
    for n in range(1, len(ids) + 1):
        text = hf_tokenizer.decode(ids[:n])
        if text.endswith("\ufffd") and n < len(ids):
            continue  # incomplete UTF-8 sequence: wait for more tokens, as SGLang's detokenizer does
        delta, prev = text[len(prev) :], text
        r, c = reasoning_parser.parse_stream_chunk(delta)
        reasoning += r or ""
        if c:
            out, calls = tool_parser.parse_stream_chunk(c)
            normal += out or ""
            for call in calls:
                if call.name:
                    names[call.tool_index] = call.name
                args[call.tool_index] = args.get(call.tool_index, "") + (call.parameters or "")
    assert prev == full
    assert reasoning.strip() == REASONING
    assert normal.strip() == CONTENT
    assert [names[i] for i in sorted(names)] == [n for n, _ in CALLS]
    assert [json.loads(args[i]) for i in sorted(args)] == [a for _, a in CALLS]


def test_thinking_disabled_prompt_then_plain_answer(hf_tokenizer, sgl_tools):
    """enable_thinking=False pre-fills an empty think block; a plain answer has no reasoning."""
    from sglang.srt.parser.reasoning_parser import ReasoningParser

    prompt = hf_tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}],
        tokenize=False,
        add_generation_prompt=True,
        enable_thinking=False,
    )
    assert prompt.endswith("<think>\n\n</think>\n\n")
    reasoning, normal = ReasoningParser("qwen3", stream_reasoning=False).parse_non_stream("Hello!")
    assert not reasoning and normal == "Hello!"
