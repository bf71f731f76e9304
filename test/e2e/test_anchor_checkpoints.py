"""Anchor checkpoints on the real server: edited agent histories restore from the anchor, and the
output is the same as with anchors off.

Two float32 servers of the tiny hybrid Qwen3-Next (``SGLANG_MAMBA_CONV_DTYPE=float32``, as the
parity test), one after the other: ``--disable-anchor-checkpoints`` (upstream) and the default
(anchors on). For each edited history, the cache is flushed, the first request is sent, then the
edited second one, greedy with output logprobs. Checks:

- greedy tokens identical with anchors on and off, logprobs within the parity tolerance;
- with anchors on, the second request's ``cached_tokens`` is exactly the anchor checkpoint the
  server should have stored while prefilling the first one (the planner's cuts replayed here)
  fewer than the planner's gap (``max(min_gap, d / 8)``) before the edit, and more than with anchors off;
- the anchor counters (``--enable-metrics``) count the saves and restores.

Edits: OpenClaw's trailing internal-context message moved after new turns; OpenCode's old tool
output cleared; the Qwen3-style template dropping reasoning once a new user query arrives;
``/v1/messages`` without the thinking blocks of earlier turns; a restore in the middle of a
multi-token marker (``<tools>`` is three tokens in this tokenizer); a prompt ending exactly at
an anchor.

Anchors in generated text (decode): the first request GENERATES a reasoning block, content and
a tool call (forced token by token with ``sglang.test.scripted_logits``; the model still runs on
every token), and the second re-serializes that turn: its tool call re-formatted, or its content
after the reasoning replaced. With anchors on, the second request restores from the state saved
during decode, fewer than ``min_gap`` tokens before the edit; with anchors off, from the prompt
end.
"""

from __future__ import annotations

import random
import re
import types

import pytest
import requests
from server import ensure_model, start_server
from test_parity import LOGPROB_ATOL

from sglang.srt.mem_cache.anchor_checkpoints.markers import AnchorScanner
from sglang.srt.mem_cache.anchor_checkpoints.planner import SPACING_DIVISOR, AnchorPlanner
from sglang.test.agent_replay import flush_cache

NEW_TOKENS = 12
MIN_GAP = 64  # the server default
CHUNK = 4096  # chunked_prefill_size of the CPU server

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read",
            "description": "Read a file",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    }
]


def _words(rng: random.Random, n: int) -> str:
    vocab = [
        "alpha",
        "beta",
        "gamma",
        "delta",
        "file",
        "line",
        "value",
        "agent",
        "tool",
        "read",
        "write",
        "check",
        "result",
        "output",
        "error",
        "path",
        "count",
        "word",
        "next",
    ]
    return " ".join(rng.choice(vocab) for _ in range(n))


def _call(path: str) -> dict:
    return {"type": "function", "function": {"name": "read", "arguments": {"path": path}}}


def _chat_cases(tok) -> dict[str, tuple[list[int], list[int]]]:
    rng = random.Random(7)

    def ids(msgs):
        return tok.apply_chat_template(
            msgs, tools=TOOLS, tokenize=True, add_generation_prompt=True, return_dict=False
        )

    system = {"role": "system", "content": "You are a coding agent. " + _words(rng, 60)}
    user1 = {"role": "user", "content": "Look at a.txt. " + _words(rng, 40)}
    a1 = {
        "role": "assistant",
        "reasoning_content": _words(rng, 50),
        "content": _words(rng, 15),
        "tool_calls": [_call("a.txt")],
    }
    tool1 = {"role": "tool", "content": _words(rng, 120)}
    a2 = {
        "role": "assistant",
        "reasoning_content": _words(rng, 40),
        "content": _words(rng, 10),
        "tool_calls": [_call("b.txt")],
    }
    tool2 = {"role": "tool", "content": _words(rng, 100)}
    internal = {
        "role": "user",
        "content": "<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>> " + _words(rng, 50),
    }
    user2 = {"role": "user", "content": "Now b.txt please. " + _words(rng, 20)}
    cleared = dict(tool1, content="[Old tool result content cleared]")
    a3 = {
        "role": "assistant",
        "reasoning_content": _words(rng, 30),
        "content": "",
        "tool_calls": [_call("c.txt")],
    }
    tool3 = {"role": "tool", "content": _words(rng, 60)}
    return {
        # OpenClaw: the trailing internal-context message moves behind the new turns.
        "openclaw_trailing_message": (
            ids([system, user1, a1, tool1, internal]),
            ids([system, user1, a1, tool1, a2, tool2, internal]),
        ),
        # OpenCode: an old tool output becomes a placeholder in place.
        "opencode_old_tool_output_cleared": (
            ids([system, user1, a1, tool1, user2, a2, tool2]),
            ids([system, user1, a1, cleared, user2, a2, tool2, a3, tool3]),
        ),
        # Qwen3-style template: a1's reasoning is dropped once user2 is the last user query.
        "qwen3_template_drops_reasoning": (
            ids([system, user1, a1, tool1]),
            ids([system, user1, a1, tool1, a2, tool2, user2]),
        ),
    }


def _token_cases(tok) -> dict[str, tuple[list[int], list[int]]]:
    rng = random.Random(11)
    plain = lambda n: tok.encode(" " + _words(rng, n), add_special_tokens=False)  # noqa: E731
    marker = tok.encode(" <tools>", add_special_tokens=False)
    assert len(marker) >= 3, "the test needs <tools> to be several tokens"
    head, tail = plain(90), plain(90)
    first = head + marker + tail
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    ends = plain(150) + [im_start]
    return {
        # The second prompt shares the first up to the middle of the multi-token marker.
        "restore_mid_multitoken_marker": (first, head + marker[:2] + plain(40)),
        # The first prompt ends exactly at an anchor (after <|im_start|>).
        "prompt_ends_at_anchor": (ends, ends + plain(30)),
    }


def _anthropic_case(url: str) -> tuple[list[int], list[int]]:
    from sglang.test.agent_replay import AnthropicPromptIds

    rng = random.Random(5)
    conv = AnthropicPromptIds(url)
    think = {"type": "thinking", "thinking": _words(rng, 60), "signature": "x"}
    use = {"type": "tool_use", "id": "t1", "name": "read", "input": {"path": "a.txt"}}
    result = {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": "t1", "content": _words(rng, 80)}],
    }
    tools = [
        {
            "name": "read",
            "description": "Read a file",
            "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}},
        }
    ]
    base = {
        "model": "default",
        "max_tokens": 8,
        "system": "You are Claude Code. " + _words(rng, 60),
        "tools": tools,
    }
    user1 = {"role": "user", "content": "Read a.txt. " + _words(rng, 30)}
    first = dict(base, messages=[user1, {"role": "assistant", "content": [think, use]}, result])
    second = dict(
        base,
        messages=[
            user1,
            {"role": "assistant", "content": [use]},
            result,  # earlier thinking dropped
            {"role": "assistant", "content": [{"type": "text", "text": _words(rng, 20)}]},
            {"role": "user", "content": "And b.txt? " + _words(rng, 20)},
        ],
    )
    return conv(first), conv(second)


def _decode_cases(tok) -> dict[str, tuple[list[int], list[int], list[int]]]:
    """(prompt, generated tokens, edited second prompt) per case: the first request generates
    the whole script; the second prompt repeats it up to the edit."""
    rng = random.Random(13)
    prompt = tok.apply_chat_template(
        [
            {"role": "system", "content": "You are a coding agent. " + _words(rng, 40)},
            {"role": "user", "content": "Look at a.txt. " + _words(rng, 30)},
        ],
        tools=TOOLS,
        tokenize=True,
        add_generation_prompt=True,
        return_dict=False,
    )
    enc = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    im_end, tool_call, think_end = (
        tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<tool_call>", "</think>")
    )
    script = enc(
        "<think>\n" + _words(rng, 70) + "\n</think>\n\n" + _words(rng, 70) + "\n<tool_call>\n"
        '{"name": "read", "arguments": {"path": "a.txt"}}\n</tool_call>'
    ) + [im_end]
    turn_rest = enc(
        "\n<|im_start|>user\n<tool_response>\n"
        + _words(rng, 40)
        + "\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    at_call = prompt + script[: script.index(tool_call)]
    after_think = prompt + script[: script.index(think_end) + 1]
    return {
        # The harness re-serializes the tool call (arguments re-formatted, a default added).
        "decode_tool_call_reserialized": (
            prompt,
            script,
            at_call
            + enc(
                '<tool_call>\n{"name": "read", "arguments": {"path": "a.txt", "offset": 0}}\n'
                "</tool_call>"
            )
            + [im_end]
            + turn_rest,
        ),
        # The harness keeps the reasoning but replaces the content after it.
        "decode_content_after_thinking_replaced": (
            prompt,
            script,
            after_think
            + enc(
                "\n\n" + _words(rng, 25) + "\n<tool_call>\n"
                '{"name": "read", "arguments": {"path": "a.txt"}}\n</tool_call>'
            )
            + [im_end]
            + turn_rest,
        ),
    }


def _generate(url: str, ids: list[int], n: int, script: list[int] | None = None) -> dict:
    body = {
        "input_ids": ids,
        "sampling_params": {"temperature": 0, "max_new_tokens": n, "ignore_eos": True},
        "return_logprob": True,
        "logprob_start_len": -1,
    }
    if script is not None:
        from sglang.test.scripted_logits import ScriptedTokens

        body["custom_logit_processor"] = ScriptedTokens.to_str()
        body["sampling_params"]["custom_params"] = {"script": script}
    r = requests.post(url + "/generate", json=body, timeout=600)
    assert r.status_code == 200, r.text
    return r.json()["meta_info"]


def _run_cases(url: str, cases: dict) -> dict[str, dict]:
    """Per case: the second request's cached tokens, greedy tokens and logprobs, and both
    requests' prefill passes with their upstream count (``passes``: [(counted, upstream)],
    counted by the anchor cache's ``sglang:anchor_prefill_passes_total``; None with anchors off)."""
    out = {}
    for name, case in cases.items():
        flush_cache(url)  # retried while the server is busy
        passes = []
        if len(case) == 3:  # decode: the first request generates the script
            first, script, second = case
            meta = _counting(url, passes, first, len(script), script)
            assert [t[1] for t in meta["output_token_logprobs"]] == script
        else:
            first, second = case
            _counting(url, passes, first, 2)
        meta = _counting(url, passes, second, NEW_TOKENS)
        out[name] = {
            "cached": meta["cached_tokens"],
            "tokens": [t[1] for t in meta["output_token_logprobs"]],
            "logprobs": [t[0] for t in meta["output_token_logprobs"]],
            "passes": passes,
        }
    return out


def _prefill_passes(url: str) -> float | None:
    text = requests.get(url + "/metrics", timeout=60).text
    m = re.search(r"^sglang:anchor_prefill_passes_total(?:\{[^}]*\})? (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


def _counting(url: str, passes: list, ids: list[int], n: int, script=None) -> dict:
    """``_generate`` alone on the server, appending (prefill passes it took, upstream's count:
    one per ``CHUNK`` tokens prefilled) to ``passes``."""
    before = _prefill_passes(url)
    meta = _generate(url, ids, n, script)
    after = _prefill_passes(url)
    upstream = -(-(len(ids) - meta["cached_tokens"]) // CHUNK)
    passes.append((None if after is None else round(after - (before or 0)), upstream))
    return meta


def _anchor_metrics(url: str) -> dict[str, float]:
    text = requests.get(url + "/metrics", timeout=60).text
    got = {}
    for name in ("saved", "saved_decode", "restored", "evicted"):
        m = re.search(rf"^sglang:anchor_checkpoints_{name}_total\{{[^}}]*\}} (\S+)$", text, re.M)
        got[name] = float(m.group(1)) if m else None
    return got


@pytest.fixture(scope="module")
def runs():
    """Both servers' results for every case: {"off": {case: result}, "on": {...}}, plus the
    cases and the anchors-on server's metrics."""
    from transformers import AutoTokenizer

    model = ensure_model("qwen3_next")
    tok = AutoTokenizer.from_pretrained(model)
    cases = {**_chat_cases(tok), **_token_cases(tok), **_decode_cases(tok)}
    results, metrics, emit_metrics = {}, None, None
    cases["resent_identical_prompt"] = (cases["openclaw_trailing_message"][1],) * 2
    modes = (
        ("off", ["--disable-anchor-checkpoints"]),
        ("on", ["--anchor-checkpoint-mode", "cut"]),
        ("emit", ["--anchor-checkpoint-mode", "emit"]),
    )
    for mode, extra in modes:
        srv = start_server(
            model,
            ["--dtype", "float32", "--enable-metrics", "--enable-custom-logit-processor", *extra],
            env={"SGLANG_MAMBA_CONV_DTYPE": "float32"},
        )
        try:
            if "messages_drop_thinking_blocks" not in cases:
                cases["messages_drop_thinking_blocks"] = _anthropic_case(srv.url)
            results[mode] = _run_cases(srv.url, cases)
            if mode == "on":
                metrics = _anchor_metrics(srv.url)
            if mode == "emit":
                emit_metrics = _anchor_metrics(srv.url)
        finally:
            srv.stop()
    for name in cases:  # shown with -s: what each edit cost with anchors off and on
        print(
            f"{name}: prompt={len(cases[name][-1])} edit_at={_lcp(*_pair(cases[name]))} "
            + " ".join(f"cached_{m}={results[m][name]['cached']}" for m, _ in modes)
            + " "
            + " ".join(f"passes_{m}={results[m][name]['passes']}" for m, _ in modes[1:])
        )
    print(f"anchor metrics: cut {metrics} emit {emit_metrics}")
    return types.SimpleNamespace(
        cases=cases, results=results, metrics=metrics, emit_metrics=emit_metrics, tok=tok
    )


def _lcp(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _pair(case: tuple) -> tuple[list[int], list[int]]:
    """(what the first request ran, the second prompt): for a decode case, the prompt and the
    generated tokens but the last (never fed)."""
    if len(case) == 3:
        first, script, second = case
        return first + script[:-1], second
    return case


def _expected_restore(tok, case: tuple, *, emit: bool = False) -> int:
    """Where the anchors-on server must restore the second prompt from: the deepest state it
    stored while serving the first request (chunk ends, cut at anchors by the planner, or with
    ``emit`` every ``CHUNK`` tokens and the states emitted inside each pass; the prompt end; for
    a decode case, the decode steps that ended at an anchor and the request end) that the second
    prompt still shares, short of its last token."""
    planner = AnchorPlanner(AnchorScanner.from_tokenizer(tok), MIN_GAP, emit=emit)
    first = case[0]
    req = types.SimpleNamespace(full_untruncated_fill_ids=first, multimodal_inputs=None)
    states, pos = {len(first)}, 0
    while pos < len(first):
        n = min(CHUNK, len(first) - pos)
        if emit:
            states.update(planner.emit_positions(req, pos, n))
        cut = planner.next_cut(req, pos, n) if not emit else None
        pos = cut if cut is not None else pos + n
        states.add(pos)
    if len(case) == 3:  # decode: step k feeds output k-1; the last step finishes the request
        script, last = case[1], len(first)
        for k in range(2, len(script)):
            dreq = types.SimpleNamespace(
                origin_input_ids=first,
                output_ids=script[:k],
                kv=types.SimpleNamespace(cache_protected_len=last),
            )
            if planner.decode_anchor(dreq, len(first) + k - 1):
                last = len(first) + k - 1
                states.add(last)
        states.add(len(first) + len(script) - 1)
    ran, second = _pair(case)
    limit = min(_lcp(ran, second), len(second) - 1)
    return max([s for s in states if s <= limit], default=0)


CASE_NAMES = [
    "openclaw_trailing_message",
    "opencode_old_tool_output_cleared",
    "qwen3_template_drops_reasoning",
    "messages_drop_thinking_blocks",
    "restore_mid_multitoken_marker",
    "prompt_ends_at_anchor",
    "decode_tool_call_reserialized",
    "decode_content_after_thinking_replaced",
]


@pytest.mark.parametrize("case", CASE_NAMES)
def test_same_output_with_anchors_on_and_off(runs, case):
    off, on = runs.results["off"][case], runs.results["on"][case]
    assert on["tokens"] == off["tokens"], (
        f"greedy tokens differ:\n on  {on['tokens']}\n off {off['tokens']}"
    )
    err = max(abs(a - b) for a, b in zip(on["logprobs"], off["logprobs"]))
    assert err < LOGPROB_ATOL, err


@pytest.mark.parametrize("case", CASE_NAMES)
def test_restores_from_the_anchor(runs, case):
    first, second = _pair(runs.cases[case])
    on, off = runs.results["on"][case], runs.results["off"][case]
    expected = _expected_restore(runs.tok, runs.cases[case])
    assert on["cached"] == expected, (on["cached"], expected)
    edit = _lcp(first, second)
    # A restore loses fewer than the planner's gap at the restore point (module doc of
    # planner.py); in generated text, the gap is min_gap.
    gap = max(MIN_GAP, (len(first) - on["cached"]) // SPACING_DIVISOR)
    if case.startswith("decode_"):
        gap = MIN_GAP
        # Inside the generated text, just before or after a marker token (checked here on the
        # tokens, independently of the planner the expectation above replays).
        prompt, script = runs.cases[case][:2]
        i = on["cached"] - len(prompt)
        markers = {
            runs.tok.convert_tokens_to_ids(t)
            for t in ("<think>", "</think>", "<tool_call>", "</tool_call>", "<|im_end|>")
        }
        assert 0 < i < len(script) and (script[i] in markers or script[i - 1] in markers), i
    assert edit - gap < on["cached"] <= edit, (edit, gap, on["cached"])
    if case == "prompt_ends_at_anchor":
        assert on["cached"] == off["cached"] == len(first)  # the prompt-end state, as upstream
    else:
        assert on["cached"] > off["cached"], (on["cached"], off["cached"])


def test_anchor_metrics(runs):
    m = runs.metrics
    assert m["saved"] and m["saved"] >= len(CASE_NAMES) - 1
    restored = sum(
        runs.results["on"][c]["cached"] != len(_pair(runs.cases[c])[0]) for c in CASE_NAMES
    )
    assert m["restored"] >= restored, (m, restored)
    decode_cases = [c for c in CASE_NAMES if c.startswith("decode_")]
    assert m["saved_decode"] and m["saved_decode"] >= len(decode_cases), m


@pytest.mark.parametrize("case", CASE_NAMES)
def test_emit_mode_same_output_as_anchors_off(runs, case):
    """--anchor-checkpoint-mode emit: the states written inside the pass give the same greedy
    tokens as upstream, logprobs within the parity tolerance."""
    off, emit = runs.results["off"][case], runs.results["emit"][case]
    assert emit["tokens"] == off["tokens"], (emit["tokens"], off["tokens"])
    err = max(abs(a - b) for a, b in zip(emit["logprobs"], off["logprobs"]))
    assert err < LOGPROB_ATOL, err


@pytest.mark.parametrize("case", CASE_NAMES)
def test_emit_mode_restores_near_the_anchor_without_extra_passes(runs, case):
    first, second = _pair(runs.cases[case])
    emit, off = runs.results["emit"][case], runs.results["off"][case]
    assert emit["cached"] == _expected_restore(runs.tok, runs.cases[case], emit=True)
    edit = _lcp(first, second)
    # the cut mode's bound, plus the rounding down to a 64-token kernel-chunk boundary
    gap = max(MIN_GAP, (len(first) - emit["cached"]) // SPACING_DIVISOR) + 64
    if case.startswith("decode_"):
        gap = MIN_GAP
    assert edit - gap < emit["cached"] <= edit, (edit, gap, emit["cached"])
    assert emit["cached"] >= off["cached"], (emit["cached"], off["cached"])
    # every request took exactly upstream's prefill passes (cut mode: more, where it cut)
    assert all(got == upstream for got, upstream in emit["passes"]), emit["passes"]


def test_emit_mode_resent_prompt_reuses_all_but_64_tokens(runs):
    prompt = runs.cases["resent_identical_prompt"][0]
    emit, off = (
        runs.results["emit"]["resent_identical_prompt"],
        runs.results["off"]["resent_identical_prompt"],
    )
    assert emit["cached"] >= len(prompt) - 64, (emit["cached"], len(prompt))
    assert emit["tokens"] == off["tokens"]
    assert max(abs(a - b) for a, b in zip(emit["logprobs"], off["logprobs"])) < LOGPROB_ATOL
