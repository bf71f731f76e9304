"""entrypoints/error_messages.py: messages name the fields as the client sent them (patches 0025,
0026). The e2e side, through a real server, is test/e2e/test_bad_input.py."""

from types import SimpleNamespace

import pytest

from sglang.srt.entrypoints.error_messages import (
    field_path,
    in_anthropic_terms,
    in_request_terms,
    malformed_json_message,
    negative_output_length,
)

TOO_LARGE = (
    "max_completion_tokens is too large: 100000.This model supports at most 8192 completion tokens."
)


@pytest.mark.parametrize(
    "loc, body, want",
    [
        # pydantic's union tag (custom) is not in the body: left out
        (
            ("body", "tools", 0, "custom", "input_schema"),
            {"tools": [{"name": "f", "input_schema": "x"}]},
            "tools.0.input_schema",
        ),
        # a tag inside a list, then a key of the chosen member
        (
            ("body", "messages", 0, "content", "list[union[...]]", 0, "TextBlock", "type"),
            {"messages": [{"content": [{"type": "bogus"}]}]},
            "messages.0.content.0.type",
        ),
        # a missing field is the last part and stays though the body lacks it
        (("body", "max_tokens"), {"model": "m"}, "max_tokens"),
        (("body", "tools", 0, "custom", "name"), {"tools": [{}]}, "tools.0.name"),
        # past a value that is not a container, or without a body: every part but "body"
        (("body", "messages", 0), {"messages": "Hi"}, "messages.0"),
        (("body", "tools", 0, "custom", "input_schema"), None, "tools.0.custom.input_schema"),
        (("body",), {"a": 1}, ""),
    ],
)
def test_field_path_is_the_path_the_client_wrote(loc, body, want):
    assert field_path(loc, body) == want


def test_output_length_messages_name_the_field_sent():
    sent_max_tokens = SimpleNamespace(max_tokens=100000, max_completion_tokens=None)
    sent_completion = SimpleNamespace(max_tokens=None, max_completion_tokens=100000)
    assert in_request_terms(TOO_LARGE, sent_max_tokens) == (
        "max_tokens is too large: 100000. This model supports at most 8192 completion tokens."
    )
    assert in_request_terms(TOO_LARGE, sent_completion).startswith(
        "max_completion_tokens is too large: 100000. "
    )


def test_negative_output_length_names_the_field():
    assert negative_output_length(SimpleNamespace(max_tokens=-1, max_completion_tokens=None)) == (
        "max_tokens must be at least 0, got -1."
    )
    assert negative_output_length(SimpleNamespace(max_tokens=None, max_completion_tokens=-3)) == (
        "max_completion_tokens must be at least 0, got -3."
    )
    assert negative_output_length(SimpleNamespace(max_tokens=0, max_completion_tokens=None)) is None
    assert negative_output_length(SimpleNamespace()) is None


def test_tool_choice_messages_name_the_field():
    r = SimpleNamespace(max_tokens=None)
    for msg in (
        "Tools cannot be empty if tool choice is set to required.",
        "Tool 'nope' not found in tools list.",
    ):
        assert in_request_terms(msg, r) == "tool_choice: " + msg
    assert in_request_terms("Messages cannot be empty.", r) == "Messages cannot be empty."
    assert in_request_terms(None, r) is None and in_request_terms("", r) == ""


def test_anthropic_terms():
    converted = SimpleNamespace(max_tokens=100000, max_completion_tokens=None)
    assert in_anthropic_terms(TOO_LARGE, converted).startswith("max_tokens is too large: 100000. ")
    assert in_anthropic_terms("Tool 2 function has invalid 'parameters' schema at $: bad") == (
        "tools.2.input_schema is not a valid JSON Schema at $: bad"
    )
    assert in_anthropic_terms(None, converted) is None


def test_malformed_json_message():
    err = {
        "type": "json_invalid",
        "loc": ("body", 14),
        "msg": "JSON decode error",
        "ctx": {"error": "Expecting value"},
    }
    assert (
        malformed_json_message(err)
        == "Malformed JSON in the request body at character 14: Expecting value"
    )
    assert malformed_json_message({"type": "json_invalid"}) == "Malformed JSON in the request body"
