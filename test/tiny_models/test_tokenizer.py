"""Tokenizer: Qwen control tokens are single ids, text round-trips exactly."""

import json

import pytest

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
NON_SPECIAL = [
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
]


def test_vocab_size_and_ids(hf_tokenizer, tm):
    assert len(hf_tokenizer) == tm.VOCAB_SIZE
    ids = tm.added_token_ids()
    for token in SPECIAL + NON_SPECIAL:
        assert hf_tokenizer.convert_tokens_to_ids(token) == ids[token]
    assert hf_tokenizer.eos_token == "<|im_end|>"
    assert hf_tokenizer.pad_token == "<|endoftext|>"
    assert hf_tokenizer.bos_token is None


@pytest.mark.parametrize("token", SPECIAL + NON_SPECIAL)
def test_control_tokens_are_single_ids_in_context(hf_tokenizer, token):
    tid = hf_tokenizer.convert_tokens_to_ids(token)
    for text in (token, f"abc{token}def", f"\n{token}\n", f'x{token}{{"name"'):
        assert hf_tokenizer.encode(text).count(tid) == 1, text
    assert hf_tokenizer.decode([tid]) == token


def test_special_flags(next_dir):
    cfg = json.loads((next_dir / "tokenizer_config.json").read_text())
    flags = {v["content"]: v["special"] for v in cfg["added_tokens_decoder"].values()}
    assert all(flags[t] for t in SPECIAL)
    assert not any(flags[t] for t in NON_SPECIAL)  # as in Qwen3: parsers must see them
    tok = json.loads((next_dir / "tokenizer.json").read_text())
    flags = {t["content"]: t["special"] for t in tok["added_tokens"]}
    assert all(flags[t] for t in SPECIAL) and not any(flags[t] for t in NON_SPECIAL)


def test_round_trip(hf_tokenizer):
    texts = [
        "def f(x):\n    return {'a': [1, 2, 3]}  # comment\n\n\tTabs\r\nCRLF",
        "Unicode: naïve café — 日本語 テスト 🚀 Ω≈ç√∫",
        '{"name": "bash", "arguments": {"command": "ls -la /tmp && echo \\"done\\""}}',
        "   leading and trailing spaces   ",
        "",
    ]
    for text in texts:
        ids = hf_tokenizer.encode(text)
        assert hf_tokenizer.decode(ids) == text


def test_skip_special_tokens_keeps_think_and_tool_tags(hf_tokenizer):
    text = (
        "<|im_start|>assistant\n<think>\nplan\n</think>\n\nok\n<tool_call>\n"
        '{"name": "read", "arguments": {"path": "a.txt"}}\n</tool_call><|im_end|>'
    )
    ids = hf_tokenizer.encode(text)
    assert hf_tokenizer.decode(ids) == text
    stripped = hf_tokenizer.decode(ids, skip_special_tokens=True)
    assert stripped == text.replace("<|im_start|>", "").replace("<|im_end|>", "")


def test_no_bos_added(hf_tokenizer):
    assert hf_tokenizer.encode("hello") == hf_tokenizer.encode("hello", add_special_tokens=False)


def test_compression_is_reasonable(hf_tokenizer):
    """Sanity: English/code text (not in the training corpus) is > 3 chars per token."""
    from pathlib import Path

    text = Path(__file__).read_text()
    assert len(text) / len(hf_tokenizer.encode(text)) > 3.0
