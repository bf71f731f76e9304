"""Test-only hook: the server scripts the model's output of chat requests it did not write.

End-to-end tests of agent clients (OpenClaw, OpenCode, Claude Code) and of tool calls cut off by
``max_tokens`` need a random-weights model to write a particular answer to requests that the
test does not build itself. With the environment variable ``SGLANG_TEST_SCRIPTED_OUTPUT`` set to
a folder when the server starts (and ``--enable-custom-logit-processor``), every request of
``/v1/chat/completions`` and ``/v1/messages`` (both go through
``OpenAIServingChat._convert_to_internal_request``, patch 0029) is checked against the rules in
``<folder>/rules.json``, read at each request:

    [{"when": "text the request must contain", "text": "output to force"}, ...]

The first rule whose ``when`` occurs in the request's messages (their JSON, as the chat handler
received them; ``""`` matches every request) scripts the output: the rule's ``text`` is
tokenized and forced token by token with :class:`sglang.test.scripted_logits.ScriptedTokens`,
followed by the model's end-of-turn token, so the request ends with ``finish_reason`` ``stop``
unless ``max_tokens`` runs out first. A request no rule matches is left to the model. While
``rules.json`` exists, every request is appended to ``<folder>/requests.jsonl`` (route, stream,
max_tokens, tool names, the messages and which rule scripted it), so a test can assert on what
the client sent.

Without the environment variable, or without ``rules.json`` in its folder, nothing changes (an
``os.environ`` lookup and a ``stat`` per request), so the e2e tests' default server can carry
the hook for the tests that write rules.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

ENV = "SGLANG_TEST_SCRIPTED_OUTPUT"
RULES = "rules.json"
REQUESTS = "requests.jsonl"


def script_folder() -> Optional[Path]:
    """The folder of ``SGLANG_TEST_SCRIPTED_OUTPUT``, or None when the hook is off."""
    value = os.environ.get(ENV)
    return Path(value) if value else None


def load_rules(folder: Path) -> list[dict[str, str]]:
    """The rules in ``folder/rules.json``.

    Raises:
        ValueError: the file is not a JSON list of objects with string ``when`` and ``text``;
            the message names the file and the bad entry.
    """
    path = folder / RULES
    try:
        rules = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e})") from e
    ok = isinstance(rules, list) and all(
        isinstance(r, dict) and isinstance(r.get("when"), str) and isinstance(r.get("text"), str)
        for r in rules
    )
    if not ok:
        raise ValueError(f"{path}: expected a JSON list of {{'when': str, 'text': str}} objects")
    return rules


def match_rule(rules: list[dict[str, str]], messages_json: str) -> Optional[int]:
    """Index of the first rule whose ``when`` occurs in ``messages_json``, or None."""
    for i, rule in enumerate(rules):
        if rule["when"] in messages_json:
            return i
    return None


def script_ids(tokenizer: Any, text: str) -> list[int]:
    """Token ids that spell ``text`` then end the turn: ``tokenizer.encode(text)`` without
    special tokens, then the tokenizer's ``eos_token_id`` (for Qwen chat models
    ``<|im_end|>``)."""
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    eos = getattr(tokenizer, "eos_token_id", None)
    return ids + ([int(eos)] if eos is not None else [])


def attach(request: Any, tokenizer: Any, route: str) -> None:
    """Script ``request`` (a ``ChatCompletionRequest``) when the hook is on and a rule matches;
    record it in ``requests.jsonl`` whenever ``rules.json`` exists.

    Sets ``request.custom_logit_processor`` and ``request.custom_params["script"]`` (token ids
    from :func:`script_ids`). ``route`` is the HTTP path the request came in on.

    Raises:
        ValueError: the rules file is malformed (see :func:`load_rules`).
    """
    folder = script_folder()
    if folder is None or not (folder / RULES).exists():
        return
    messages = [m if isinstance(m, dict) else m.model_dump() for m in request.messages]
    messages_json = json.dumps(messages, ensure_ascii=False, default=str)
    rules = load_rules(folder)
    rule = match_rule(rules, messages_json)
    if rule is not None:
        from sglang.test.scripted_logits import ScriptedTokens

        text = rules[rule]["text"]
        request.custom_logit_processor = ScriptedTokens.to_str()
        request.custom_params = {
            **(request.custom_params or {}),
            "script": script_ids(tokenizer, text),
        }
    tools = [t.function.name for t in (request.tools or [])]
    record = {
        "route": route,
        "stream": bool(request.stream),
        "max_tokens": request.max_completion_tokens or request.max_tokens,
        "tools": tools,
        "rule": rule,
        "messages": messages,
    }
    with (folder / REQUESTS).open("a") as f:
        f.write(json.dumps(record, ensure_ascii=False, default=str) + "\n")
