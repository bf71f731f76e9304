"""Server-free checks of ``tool_call_cutoff`` (a tool call cut by ``max_tokens``) and of the
test-only ``scripted_output`` hook; the routes themselves are checked end to end in
test/e2e/test_endpoints_tool_cutoff.py."""

from __future__ import annotations

import json

import pytest

from sglang.srt.entrypoints import scripted_output
from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest, Tool
from sglang.srt.entrypoints.openai.tool_call_cutoff import (
    cut_call_input,
    cut_tool_call,
    unstreamed_cut_arguments,
    with_cut_call,
)
from sglang.srt.function_call.function_call_parser import FunctionCallParser

TOOLS = [
    Tool(
        type="function",
        function={
            "name": "bash",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
        },
    )
]
LENGTH, STOP = {"type": "length", "length": 8}, {"type": "stop", "matched": None}
ARGS = '{"command": "ls -la /tmp && echo'
CUT = 'Sure.<tool_call>\n{"name": "bash", "arguments": ' + ARGS
DONE = '<tool_call>\n{"name": "bash", "arguments": {"command": "pwd"}}\n</tool_call>'


def parser() -> FunctionCallParser:
    return FunctionCallParser(TOOLS, "qwen")


def test_cut_call_found_with_generated_arguments():
    cut = cut_tool_call(CUT, parser().detector)
    assert cut is not None and cut.name == "bash" and cut.arguments == ARGS
    assert cut.raw == CUT[len("Sure.") :]


@pytest.mark.parametrize(
    "text, name, args",
    [
        ('<tool_call>\n{"name": "ba', None, ""),
        ('<tool_call>\n{"name": "bash"', "bash", ""),
        ('<tool_call>\n{"name": "bash", "argu', "bash", ""),
        ('<tool_call>\n{"name": "b\\"q", "arguments": {"a": "x\\"', 'b"q', '{"a": "x\\"'),
    ],
)
def test_cut_call_boundaries(text, name, args):
    cut = cut_tool_call(text, parser().detector)
    assert cut is not None and (cut.name, cut.arguments) == (name, args)


@pytest.mark.parametrize("text", [DONE, "no call here", DONE + "\ntext after"])
def test_closed_or_absent_call_is_not_cut(text):
    assert cut_tool_call(text, parser().detector) is None


def test_detector_without_markers_is_not_handled():
    assert cut_tool_call(CUT, object()) is None


def test_non_stream_parse_keeps_the_cut_call():
    p = parser()
    normal, calls = with_cut_call(CUT, LENGTH, p, *p.parse_non_stream(CUT))
    assert normal == "Sure."
    assert [(c.name, c.parameters, c.tool_index) for c in calls] == [("bash", ARGS, 0)]


def test_non_stream_parse_after_a_complete_call():
    p, text = parser(), DONE + "\n" + CUT[len("Sure.") :]
    _, calls = with_cut_call(text, LENGTH, p, *p.parse_non_stream(text))
    assert [c.name for c in calls] == ["bash", "bash"]
    assert json.loads(calls[0].parameters) == {"command": "pwd"} and calls[1].parameters == ARGS


def test_non_stream_parse_unchanged_unless_length():
    p = parser()
    parsed = p.parse_non_stream(CUT)
    assert with_cut_call(CUT, STOP, p, *parsed) == parsed


def test_cut_in_name_becomes_content():
    p, text = parser(), 'Hi <tool_call>\n{"name": "ba'
    normal, calls = with_cut_call(text, LENGTH, p, *p.parse_non_stream(text))
    assert calls == [] and normal.endswith('<tool_call>\n{"name": "ba')


@pytest.mark.parametrize(
    "streamed, rest", [("", ARGS), ('{"command": ', '"ls -la /tmp && echo'), (ARGS, ""), ("{}", "")]
)
def test_stream_gets_the_generated_rest_never_a_closing(streamed, rest):
    assert unstreamed_cut_arguments(LENGTH, CUT, parser().detector, streamed) == rest


def test_stream_keeps_upstream_when_not_cut():
    d = parser().detector
    assert unstreamed_cut_arguments(STOP, CUT, d, "") is None  # finished on a stop
    assert unstreamed_cut_arguments(LENGTH, DONE, d, "") is None  # call was closed
    assert unstreamed_cut_arguments(LENGTH, None, d, "") is None  # increments only


@pytest.mark.parametrize(
    "args, want",
    [
        (ARGS, {"command": "ls -la /tmp && echo"}),
        ('{"command": "pwd"}', {"command": "pwd"}),
        ('{"command": "pwd", "cw', {"command": "pwd"}),
        ("", {}),
        ("[1, 2", {}),
    ],
)
def test_anthropic_input_of_a_cut_call(args, want):
    assert cut_call_input(args) == want


# --- the test-only scripted-output hook ---


class _Tok:
    eos_token_id = 7

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]


def _request(content: str) -> ChatCompletionRequest:
    return ChatCompletionRequest(
        model="m", messages=[{"role": "user", "content": content}], tools=TOOLS, max_tokens=9
    )


def test_hook_off_without_env_or_rules(tmp_path, monkeypatch):
    monkeypatch.delenv(scripted_output.ENV, raising=False)
    req = _request("hi")
    scripted_output.attach(req, _Tok(), "/v1/chat/completions")
    assert req.custom_logit_processor is None
    monkeypatch.setenv(scripted_output.ENV, str(tmp_path))
    scripted_output.attach(req, _Tok(), "/v1/chat/completions")
    assert req.custom_logit_processor is None and not (tmp_path / "requests.jsonl").exists()


def test_hook_scripts_first_matching_rule_and_records(tmp_path, monkeypatch):
    monkeypatch.setenv(scripted_output.ENV, str(tmp_path))
    (tmp_path / "rules.json").write_text(
        json.dumps([{"when": "RESULT-1", "text": "ok"}, {"when": "list", "text": "ab"}])
    )
    req = _request("please list")
    scripted_output.attach(req, _Tok(), "/v1/messages")
    assert req.custom_params["script"] == [ord("a"), ord("b"), 7]
    assert req.custom_logit_processor
    other = _request("unrelated")
    scripted_output.attach(other, _Tok(), "/v1/chat/completions")
    assert other.custom_logit_processor is None
    rows = [json.loads(x) for x in (tmp_path / "requests.jsonl").read_text().splitlines()]
    assert [(r["route"], r["rule"], r["tools"], r["max_tokens"]) for r in rows] == [
        ("/v1/messages", 1, ["bash"], 9),
        ("/v1/chat/completions", None, ["bash"], 9),
    ]


def test_hook_rejects_malformed_rules(tmp_path, monkeypatch):
    monkeypatch.setenv(scripted_output.ENV, str(tmp_path))
    (tmp_path / "rules.json").write_text(json.dumps([{"when": 1}]))
    with pytest.raises(ValueError, match="rules.json: expected a JSON list"):
        scripted_output.attach(_request("x"), _Tok(), "/v1/chat/completions")
