"""The tool-call grammar of a forced tool choice, compiled by upstream's XGrammar backend on the
tiny model's tokenizer (no server): arguments follow the tool's schema whether or not the tool
is strict (patch 0027), and the whitespace between JSON tokens is bounded by the server's flags
(patch 0028, ``constrained/json_whitespace.py``)."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

from sglang.srt.constrained.json_whitespace import (
    DEFAULT_MAX_WHITESPACE,
    bound_structural_tag_whitespace,
    whitespace_bound,
)
from sglang.srt.constrained.xgrammar_backend import XGrammarGrammarBackend
from sglang.srt.entrypoints.openai.protocol import Function, Tool, ToolChoice, ToolChoiceFuncName
from sglang.srt.function_call.function_call_parser import FunctionCallParser
from sglang.test.tiny_models import VOCAB_SIZE, tokenizer_json

PARAMS = {
    "type": "object",
    "properties": {"mode": {"type": "string", "enum": ["fast", "slow"]}, "n": {"type": "integer"}},
    "required": ["mode"],
}
BEGIN = '<tool_call>\n{"name":"run", "arguments":'
END = "}\n</tool_call>"


def tools(strict: bool) -> list[Tool]:
    other = {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}
    return [
        Tool(type="function", function=Function(name="run", parameters=PARAMS, strict=strict)),
        Tool(type="function", function=Function(name="find", parameters=other, strict=strict)),
    ]


@pytest.fixture(scope="module")
def tokenizer():
    """The tiny models' tokenizer (the one the e2e server loads)."""
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tokenizer_json()))


def backend(tokenizer, **ws) -> XGrammarGrammarBackend:
    return XGrammarGrammarBackend(tokenizer, vocab_size=max(VOCAB_SIZE, len(tokenizer)), **ws)


def accepts(grammar, text: str) -> bool:
    return grammar.matcher.accept_string(text)


def forced_grammar(be, tool_choice, strict: bool):
    kind, tag = FunctionCallParser(tools(strict), "qwen").get_structure_constraint(tool_choice)
    assert kind == "structural_tag"
    key = tag.model_dump_json(by_alias=True) if hasattr(tag, "model_dump_json") else json.dumps(tag)
    return be.dispatch_structural_tag(key)


NAMED = ToolChoice(type="function", function=ToolChoiceFuncName(name="run"))


@pytest.mark.parametrize("strict", [False, True], ids=["not-strict", "strict"])
@pytest.mark.parametrize("tool_choice", [NAMED, "required"], ids=["named", "required"])
def test_forced_call_follows_schema(tokenizer, tool_choice, strict):
    be = backend(tokenizer)
    good = ['{"mode":"fast"}', '{"mode":"slow","n":3}']
    bad = ['"fast"', '{"mode":"medium"}', '{"n":3}', '{"mode":"fast","n":"3"}', "[1]"]
    for args in good:
        assert accepts(forced_grammar(be, tool_choice, strict), BEGIN + args + END), args
    for args in bad:
        assert not accepts(forced_grammar(be, tool_choice, strict), BEGIN + args + END), args


def test_auto_not_strict_is_unconstrained(tokenizer):
    """``auto`` keeps upstream's rule: no constraint unless a tool is strict."""
    assert FunctionCallParser(tools(False), "qwen").get_structure_constraint("auto") is None


@pytest.mark.parametrize(
    "flags, bound",
    [
        ({}, DEFAULT_MAX_WHITESPACE),
        ({"any_whitespace": False}, 1),
        ({"max_whitespace_cnt": 4}, 4),
        ({"any_whitespace": False, "max_whitespace_cnt": 4}, 1),
    ],
    ids=["default", "disable-any-whitespace", "max-whitespace-cnt", "both"],
)
def test_forced_call_whitespace_is_bounded(tokenizer, flags, bound):
    be = backend(tokenizer, **flags)
    for ws in (" ", "\n", "\t"):
        for n, ok in ((bound, True), (bound + 1, False), (200, False)):
            pad = ws * n
            for args in ("{" + pad + '"mode":"fast"}', '{"mode":' + pad + '"fast"}'):
                got = accepts(forced_grammar(be, NAMED, False), BEGIN + args + END)
                assert got == ok, (flags, repr(args))


def test_client_structural_tag_bound_kept_and_defaulted():
    fmt = {
        "type": "structural_tag",
        "format": {
            "type": "sequence",
            "elements": [
                {"type": "json_schema", "json_schema": {}},
                {"type": "json_schema", "json_schema": {}, "max_whitespace_cnt": 3},
                {
                    "type": "triggered_tags",
                    "triggers": ["<a>"],
                    "tags": [
                        {
                            "type": "tag",
                            "begin": "<a>",
                            "end": "</a>",
                            "content": {"type": "json_schema", "json_schema": {}},
                        }
                    ],
                },
                {"type": "any_text"},
            ],
        },
    }
    out = bound_structural_tag_whitespace(fmt, 7)
    els = out["format"]["elements"]
    assert [els[0]["max_whitespace_cnt"], els[1]["max_whitespace_cnt"]] == [7, 3]
    assert els[2]["tags"][0]["content"]["max_whitespace_cnt"] == 7
    assert "max_whitespace_cnt" not in els[3]


def test_whitespace_bound():
    assert whitespace_bound(False, None) == DEFAULT_MAX_WHITESPACE
    assert whitespace_bound(True, None) == 1
    assert whitespace_bound(False, 0) == 1  # XGrammar refuses 0 in structural tags
    assert whitespace_bound(False, 5) == 5
