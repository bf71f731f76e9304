"""Anchor markers: the default set of the embedded tokenizer and template, and anchor positions
found in token spans (single special tokens and multi-token markers alike), checked against a
slow reference that decodes token by token."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from sglang.srt.mem_cache.anchor_checkpoints.markers import AnchorScanner, derive_markers

ISSUE_MARKERS = {
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<|im_start|>",
    "<|im_end|>",
}


@pytest.fixture(scope="module")
def scanner(tok):
    return AnchorScanner.from_tokenizer(tok)


def reference_anchors(tok, ids: list[int], markers) -> set[int]:
    """For every marker occurrence in the decoded text, the last token boundary at or before
    its start and its end (tokens decoded one by one; the markers are ASCII)."""
    pieces = [tok.decode([i]) for i in ids]
    bounds = [0]
    for p in pieces:
        bounds.append(bounds[-1] + len(p))
    text = "".join(pieces)
    out = set()
    for m in markers:
        start = text.find(m)
        while start >= 0:
            for off in (start, start + len(m)):
                out.add(max(k for k, b in enumerate(bounds) if b <= off))
            start = text.find(m, start + len(m))
    return out


def test_default_markers_cover_the_issue_list(scanner):
    assert ISSUE_MARKERS <= set(scanner.markers)


def test_derive_markers_from_template_and_added_tokens():
    template = "{{ '<|im_start|>' + role }}{{ '[INST]' }}<think>x</think> a<b"
    got = derive_markers(["<|im_start|>", "[INST]", "<unused_in_template>"], template)
    assert got == sorted({"<|im_start|>", "[INST]", "<think>", "</think>"})
    # Without a template: the added tokens that look like tags or bracket keywords.
    assert derive_markers(["<|eot_id|>", "[TOOL_CALLS]", "hello"], None) == [
        "<|eot_id|>",
        "[TOOL_CALLS]",
    ]


def test_single_token_markers(tok, scanner):
    ids = tok.apply_chat_template(
        [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "<think>\nr\n</think>\n\nok"},
            {"role": "user", "content": "next"},
        ],
        tokenize=True,
        add_generation_prompt=True,
        return_dict=False,
    )
    got = scanner.scan(ids).tolist()
    assert set(got) == reference_anchors(tok, ids, scanner.markers)
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    for i, t in enumerate(ids):
        if t == im_start:
            assert i in got and i + 1 in got  # just before and just after


def test_multi_token_marker_floors_to_token_boundaries(tok, scanner):
    ids = tok.encode("x <tools>y</tools>z", add_special_tokens=False)
    pieces = [tok.decode([i]) for i in ids]
    assert " <" in pieces and len(ids) > 5, pieces  # "<tools>" is several tokens, " <" merged
    got = scanner.scan(ids).tolist()
    assert got == sorted(reference_anchors(tok, ids, scanner.markers))
    assert pieces.index(" <") in got  # before "<tools>": the start of the token holding "<"


def test_span_scan_sees_markers_straddling_its_start(tok, scanner):
    ids = tok.encode("abc <tools>def ghi", add_special_tokens=False)
    full = scanner.scan(ids).tolist()
    after = full[-1]  # the after-anchor of <tools>
    assert scanner.scan(ids, start=after - 1).tolist() == [after]
    assert scanner.scan(ids, start=after + 1).tolist() == []


TEXT = st.lists(
    st.sampled_from(
        [
            "<think>",
            "</think>",
            "<tool_call>",
            "</tool_response>",
            "<|im_start|>",
            "<|im_end|>",
            "<tools>",
            "</tools>",
            " <",
            "tools",
            ">",
            "\n",
            " word",
            "x",
            "é",
            " <tool",
            "_call>",
            "<",
        ]
    ),
    max_size=30,
).map("".join)


@settings(max_examples=150, deadline=None)
@given(text=TEXT)
def test_scan_matches_reference(tok, scanner, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert scanner.scan(ids).tolist() == sorted(reference_anchors(tok, ids, scanner.markers))
