"""Chat template: Qwen3-style rendering of system/tools, tool calls, tool results, reasoning."""

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
                "properties": {"path": {"type": "string"}},
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


def call(name, args, as_string=False, cid="c1"):
    return {
        "id": cid,
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(args) if as_string else args},
    }


@pytest.fixture(scope="module")
def render(hf_tokenizer):
    def _render(messages, tools=None, add_generation_prompt=False, **kwargs):
        return hf_tokenizer.apply_chat_template(
            messages,
            tools=tools,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **kwargs,
        )

    return _render


def test_plain_conversation(render):
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ]
    assert render(msgs, add_generation_prompt=True) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nBye<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert render(msgs[1:2]) == "<|im_start|>user\nHi<|im_end|>\n"


def test_tools_listed_in_system_turn(render):
    out = render(
        [{"role": "system", "content": "SYS"}, {"role": "user", "content": "go"}], tools=TOOLS
    )
    system_turn = out.split("<|im_end|>")[0]
    assert system_turn.startswith("<|im_start|>system\nSYS\n\n# Tools\n")
    lines = system_turn.split("<tools>\n")[1].split("\n</tools>")[0].split("\n")
    assert [json.loads(line) for line in lines] == TOOLS
    assert (
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
        in system_turn
    )
    assert out.count("<|im_start|>system") == 1
    # without a system message the tool block is still a system turn
    out = render([{"role": "user", "content": "go"}], tools=TOOLS)
    assert out.startswith("<|im_start|>system\n# Tools\n")
    assert out.endswith("<|im_start|>user\ngo<|im_end|>\n")


def test_assistant_tool_calls_and_grouped_tool_results(render):
    msgs = [
        {"role": "user", "content": "look"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                call("read", {"path": "a.txt"}),
                call("bash", {"command": "ls"}, cid="c2"),
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "AAA"},
        {"role": "tool", "tool_call_id": "c2", "content": "a.txt\nb.txt"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [call("read", {"path": "b.txt"}, cid="c3")],
        },
        {"role": "tool", "tool_call_id": "c3", "content": "BBB"},
    ]
    out = render(msgs, tools=TOOLS, add_generation_prompt=True)
    conv = out.split("<|im_start|>user\nlook<|im_end|>\n")[1]
    assert conv == (
        "<|im_start|>assistant\n"
        "Checking.\n"
        '<tool_call>\n{"name": "read", "arguments": {"path": "a.txt"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n"
        "<tool_response>\nAAA\n</tool_response>\n"
        "<tool_response>\na.txt\nb.txt\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
        '<tool_call>\n{"name": "read", "arguments": {"path": "b.txt"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nBBB\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # arguments given as a JSON string (raw OpenAI format) render the same
    as_str = [dict(m) for m in msgs]
    as_str[1] = dict(
        msgs[1],
        tool_calls=[
            call("read", {"path": "a.txt"}, True),
            call("bash", {"command": "ls"}, True, "c2"),
        ],
    )
    as_str[4] = dict(msgs[4], tool_calls=[call("read", {"path": "b.txt"}, True, "c3")])
    assert render(as_str, tools=TOOLS, add_generation_prompt=True) == out


def test_reasoning_dropped_before_last_user_query(render):
    msgs = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1", "reasoning_content": "R1"},
        {"role": "user", "content": "q2"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "R2",
            "tool_calls": [call("bash", {"command": "ls"})],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "out"},
        {"role": "assistant", "content": "a2", "reasoning_content": "\nR3\n"},
    ]
    out = render(msgs, tools=TOOLS)
    assert "R1" not in out
    assert "<|im_start|>assistant\na1<|im_end|>" in out
    # turns after the last user query keep their reasoning (tool results do not count as a query)
    assert '<|im_start|>assistant\n<think>\nR2\n</think>\n\n<tool_call>\n{"name": "bash"' in out
    assert out.endswith("<|im_start|>assistant\n<think>\nR3\n</think>\n\na2<|im_end|>\n")
    # a new user query drops all of it
    out2 = render(
        msgs + [{"role": "user", "content": "q3"}], tools=TOOLS, add_generation_prompt=True
    )
    assert "<think>" not in out2 and "R2" not in out2 and "R3" not in out2
    # the rendered prefix before the dropped reasoning is unchanged (prefix-cache friendly)
    cut = out.index("<|im_start|>assistant\n<think>\nR2")
    assert out2[:cut] == out[:cut]


def test_reasoning_from_think_tags_in_content(render):
    msgs = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "<think>\nhidden plan\n</think>\n\nvisible"},
    ]
    assert render(msgs).endswith(
        "<|im_start|>assistant\n<think>\nhidden plan\n</think>\n\nvisible<|im_end|>\n"
    )
    out = render(msgs + [{"role": "user", "content": "next"}])
    assert "hidden plan" not in out and "<|im_start|>assistant\nvisible<|im_end|>" in out


def test_tool_response_user_message_is_not_a_query(render):
    msgs = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "x", "reasoning_content": "R"},
        {"role": "user", "content": "<tool_response>\nold style\n</tool_response>"},
    ]
    assert "<think>\nR\n</think>" in render(msgs)


def test_enable_thinking(render):
    msgs = [{"role": "user", "content": "hi"}]
    assert render(msgs, add_generation_prompt=True).endswith("<|im_start|>assistant\n")
    assert render(msgs, add_generation_prompt=True, enable_thinking=True).endswith(
        "<|im_start|>assistant\n"
    )
    assert render(msgs, add_generation_prompt=True, enable_thinking=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


def test_content_parts_and_null_content(render):
    parts = [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}]
    msgs = [
        {"role": "system", "content": [{"type": "text", "text": "SYS"}]},
        {"role": "user", "content": parts},
        {"role": "assistant", "content": None, "tool_calls": [call("read", {"path": "x"})]},
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "T"}]},
    ]
    out = render(msgs, tools=TOOLS)
    assert out.startswith("<|im_start|>system\nSYS\n\n# Tools")
    # parts are joined with one space, exactly like SGLang flattens them for this template
    assert "<|im_start|>user\npart one part two<|im_end|>\n" in out
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "read"' in out
    assert "<tool_response>\nT\n</tool_response>" in out


def test_inline_system_message(render):
    msgs = [
        {"role": "system", "content": "first"},
        {"role": "user", "content": "u"},
        {"role": "system", "content": "second"},
    ]
    assert render(msgs).endswith("<|im_start|>system\nsecond<|im_end|>\n")
