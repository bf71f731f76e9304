"""Replay of real captured agent requests, plus unit tests of the replay library.

End to end: every request under ``$TRACES_DIR`` (default ``../shared/traces`` next to the repo)
is POSTed in order, per session, to ONE server of the default tiny model, and must come back
200 with a well-formed stream (OpenAI chunks ending in ``[DONE]``, Anthropic events ending in
``message_stop``) that carries usage and lets the prompt token ids be recovered. Generation is
capped at ``agent_replay.DEFAULT_MAX_NEW_TOKENS`` tokens per request.

``REPLAY_MODEL_PATH`` serves another model folder and ``REPLAY_SERVER_ARGS`` adds launch
arguments (both optional, for development). No captured session under ``$TRACES_DIR`` is a
failure (``test_traces_present``), not a silent skip; ``SGLANG_ALLOW_MISSING_TRACES=1`` makes it
a skip (as in ``test/tiny_models/conftest.py``).

The unit tests need no server: SSE parsing and stream checks on synthetic streams (including
malformed ones), prefix arithmetic, body capping and session discovery.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from pathlib import Path

import pytest
from server import REPO, ensure_model, start_server

try:
    from sglang.test import agent_replay as ar
except ImportError:  # our modules not linked into the environment yet: load by path
    import importlib.util

    _spec = importlib.util.spec_from_file_location(
        "sglang_test_agent_replay", REPO / "python" / "sglang" / "test" / "agent_replay.py"
    )
    ar = importlib.util.module_from_spec(_spec)
    sys.modules[_spec.name] = ar
    _spec.loader.exec_module(ar)

TRACES_DIR = Path(os.environ.get("TRACES_DIR", REPO.parent / "shared" / "traces"))


def _sessions():
    try:
        return ar.discover_sessions(TRACES_DIR)
    except FileNotFoundError:
        return []


SESSIONS = _sessions()


def test_traces_present():
    if not SESSIONS:
        reason = f"no captured sessions under {TRACES_DIR}"
        if os.environ.get("SGLANG_ALLOW_MISSING_TRACES") == "1":
            pytest.skip(f"{reason} (SGLANG_ALLOW_MISSING_TRACES=1)")
        pytest.fail(
            f"{reason}: set TRACES_DIR, or SGLANG_ALLOW_MISSING_TRACES=1 to skip", pytrace=False
        )


# --------------------------------------------------------------------------------------------
# End to end
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server_url():
    model = os.environ.get("REPLAY_MODEL_PATH") or ensure_model()
    srv = start_server(Path(model), shlex.split(os.environ.get("REPLAY_SERVER_ARGS", "")))
    yield srv.url
    srv.stop()


@pytest.mark.skipif(not SESSIONS, reason=f"no captured sessions under {TRACES_DIR}")
@pytest.mark.parametrize("session", SESSIONS, ids=[s.name for s in SESSIONS])
def test_replay_session(server_url, session):
    t0 = time.perf_counter()
    sr = ar.replay_session(server_url, session)
    lines = "\n".join(r.line() for r in sr.results)
    print(
        f"\n{lines}\n{sr.summary().line(f'session {session.name}')} "
        f"wall={time.perf_counter() - t0:.1f}s"
    )
    assert len(sr.results) == len(session.captures)
    for r in sr.results:
        assert r.status == 200, r.line()
        assert r.check.ok, r.line()
        assert r.check.has_usage and r.check.prompt_tokens, r.line()
        assert r.prompt_ids is not None and len(r.prompt_ids) == r.check.prompt_tokens, r.line()


# --------------------------------------------------------------------------------------------
# Unit tests: SSE parsing and stream checks
# --------------------------------------------------------------------------------------------


def _sse(*events) -> bytes:
    out = []
    for ev in events:
        if isinstance(ev, tuple):
            name, data = ev
            out.append(
                f"event: {name}\ndata: {data if isinstance(data, str) else json.dumps(data)}\n\n"
            )
        else:
            out.append(f"data: {ev if isinstance(ev, str) else json.dumps(ev)}\n\n")
    return "".join(out).encode()


def _chunk(delta=None, finish=None, usage=None, choices=True, **extra):
    obj = {
        "id": "x",
        "object": "chat.completion.chunk",
        "model": "m",
        "choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish}] if choices else [],
        "usage": usage,
    }
    obj.update(extra)
    return obj


USAGE = {
    "prompt_tokens": 10,
    "completion_tokens": 2,
    "total_tokens": 12,
    "prompt_tokens_details": {"cached_tokens": 6},
}
GOOD_OPENAI = _sse(
    _chunk({"role": "assistant", "content": ""}),
    _chunk({"reasoning_content": "hm"}),
    _chunk({"content": "hi"}, finish="length"),
    _chunk(choices=False, sglext={"input_ids": list(range(10))}),
    _chunk(choices=False, usage=USAGE),
    "[DONE]",
)


def _anthropic(*, stop=True, delta_usage=True, start_usage=None):
    start_usage = start_usage or {
        "input_tokens": 4,
        "output_tokens": 0,
        "cache_read_input_tokens": 6,
    }
    evs = [
        (
            "message_start",
            {
                "type": "message_start",
                "message": {"id": "m", "role": "assistant", "content": [], "usage": start_usage},
            },
        ),
        (
            "content_block_start",
            {
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "text", "text": ""},
            },
        ),
        ("ping", {"type": "ping"}),
        (
            "content_block_delta",
            {
                "type": "content_block_delta",
                "index": 0,
                "delta": {"type": "text_delta", "text": "hi"},
            },
        ),
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        (
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": "max_tokens"},
                **({"usage": {"output_tokens": 2}} if delta_usage else {}),
            },
        ),
    ]
    if stop:
        evs.append(("message_stop", {"type": "message_stop"}))
    return evs


def test_sse_parser_any_split():
    whole = ar.parse_sse(GOOD_OPENAI)
    assert len(whole) == 6 and whole[-1].data == "[DONE]"
    for step in (1, 7, 64):
        p, got = ar.SSEParser(), []
        for i in range(0, len(GOOD_OPENAI), step):
            got += p.feed(
                GOOD_OPENAI[i : i + step].replace(b"\n", b"\r\n")
                if step == 7
                else GOOD_OPENAI[i : i + step]
            )
        got += p.close()
        assert [(e.event, e.data) for e in got] == [(e.event, e.data) for e in whole]


def test_sse_parser_multiline_comments_and_unterminated_last_event():
    evs = ar.parse_sse(b": keep-alive\n\nevent: a\ndata: 1\ndata: 2\n\ndata: tail")
    assert [(e.event, e.data) for e in evs] == [("a", "1\n2"), (None, "tail")]


def test_openai_stream_well_formed():
    c = ar.check_openai_stream(ar.parse_sse(GOOD_OPENAI))
    assert c.ok, c.problems
    assert (c.prompt_tokens, c.cached_tokens, c.completion_tokens) == (10, 6, 2)
    assert c.input_ids == list(range(10)) and c.finish_reason == "length" and c.has_usage


def test_openai_stream_timing():
    p = ar.SSEParser()
    evs = []
    for i, part in enumerate(GOOD_OPENAI.split(b"\n\n")[:-1]):
        evs += p.feed(part + b"\n\n", t=float(i))
    c = ar.check_openai_stream(evs)
    assert c.first_event_s == 0.0 and c.ttft_s == 1.0  # first non-empty delta


@pytest.mark.parametrize(
    "raw, problem",
    [
        (GOOD_OPENAI.replace(b"data: [DONE]\n\n", b""), "[DONE]"),
        (GOOD_OPENAI.replace(b'"hi"', b'"hi'), "not JSON"),
        (_sse(_chunk({"content": "hi"}, finish="stop"), "[DONE]"), "no usage"),
        (
            _sse(
                _chunk({"content": "hi"}, finish="stop"),
                _chunk(choices=False, usage=USAGE),
                "[DONE]",
                _chunk({"content": "late"}),
            ),
            "after [DONE]",
        ),
        (_sse({"error": {"message": "boom", "code": 400}}, "[DONE]"), "error event"),
        (
            _sse(_chunk({"content": "hi"}), _chunk(choices=False, usage=USAGE), "[DONE]"),
            "finish_reason",
        ),
        (GOOD_OPENAI + b"garbage line\n", None),  # stray line: reported by the parser
    ],
)
def test_openai_stream_malformed(raw, problem):
    p = ar.SSEParser()
    evs = p.feed(raw) + p.close()
    c = ar.check_openai_stream(evs)
    if problem is None:
        assert p.stray
    else:
        assert not c.ok and any(problem in x for x in c.problems), c.problems


def test_openai_stream_usage_optional_when_not_requested():
    raw = _sse(_chunk({"content": "hi"}, finish="stop"), "[DONE]")
    assert ar.check_openai_stream(ar.parse_sse(raw), expect_usage=False).ok


def test_anthropic_stream_well_formed():
    c = ar.check_anthropic_stream(ar.parse_sse(_sse(*_anthropic())))
    assert c.ok, c.problems
    assert (c.prompt_tokens, c.cached_tokens, c.completion_tokens) == (10, 6, 2)
    assert c.finish_reason == "max_tokens" and c.ttft_s is not None
    # Nothing cached: upstream omits cache_read_input_tokens.
    c = ar.check_anthropic_stream(
        ar.parse_sse(_sse(*_anthropic(start_usage={"input_tokens": 10, "output_tokens": 0})))
    )
    assert c.ok and (c.prompt_tokens, c.cached_tokens) == (10, 0)


@pytest.mark.parametrize(
    "events, problem",
    [
        (_anthropic(stop=False), "message_stop"),
        (_anthropic(delta_usage=False), "usage"),
        (_anthropic()[1:], "message_start"),
        ([("message_start", {"type": "message_delta"})] + _anthropic()[1:], "type"),
        (_anthropic()[:4] + _anthropic()[5:], "content blocks open"),
        (
            _anthropic()[:-1] + [("error", {"type": "error", "error": {"type": "api_error"}})],
            "error event",
        ),
        (_anthropic()[:3] + [("content_block_delta", "{not json")] + _anthropic()[4:], "not JSON"),
    ],
)
def test_anthropic_stream_malformed(events, problem):
    c = ar.check_anthropic_stream(ar.parse_sse(_sse(*events)))
    assert not c.ok and any(problem in x for x in c.problems), c.problems


# --------------------------------------------------------------------------------------------
# Unit tests: prefixes, bodies, sessions
# --------------------------------------------------------------------------------------------


def test_common_prefix_len():
    a = list(range(10000))
    assert ar.common_prefix_len(a, a) == 10000
    assert ar.common_prefix_len(a, a[:5000]) == 5000
    assert ar.common_prefix_len(a, a[:4097] + [-1] + a[4098:]) == 4097
    assert ar.common_prefix_len([], a) == 0 and ar.common_prefix_len([1], [2]) == 0


def test_reusable_prefix_against_any_earlier_request():
    sys_p = [1, 2, 3, 4]
    prompts = [
        sys_p + [10, 11, 12],  # first: nothing earlier
        sys_p + [10, 11, 12, 13, 14],  # extends #0
        [9, 9, 9],  # unrelated (e.g. a title request)
        sys_p + [10, 11, 20, 21],  # diverges inside history: 6 shared with #0/#1
        None,  # unknown ids: 0, and no reference for later
        sys_p + [10, 11, 20, 21],  # repeats #3: capped at len - 1
    ]
    assert ar.reusable_prefix_lengths(prompts) == [0, 7, 0, 6, 0, 7]
    assert ar.reusable_prefix_len([9, 9, 9, 5], prompts) == 3


def test_summary_line():
    s = ar.ReplaySummary(
        requests=3, cached_tokens=70, reusable_tokens=100, prompt_tokens=300, failed=0
    )
    assert s.line() == (
        "agent_replay requests=3 cached_tokens=70 reusable_tokens=100 "
        "wasted_tokens=30 reuse_ratio=0.700"
    )
    assert ar.ReplaySummary(1, 0, 0, 5, 0).line().endswith("wasted_tokens=0 reuse_ratio=1.000")
    # A failed request's tokens are missing from the sums: the line must say so.
    assert ar.ReplaySummary(2, 0, 0, 5, 1).line().endswith("reuse_ratio=1.000 failed=1")


def test_prepare_body_caps_only_present_length_fields():
    body = {"messages": [], "max_completion_tokens": 8192, "stream": True}
    out = ar.prepare_body(body, 8)
    assert out == {"messages": [], "max_completion_tokens": 8, "stream": True}
    assert body["max_completion_tokens"] == 8192  # the capture is untouched
    assert ar.prepare_body({"max_tokens": 4}, 8)["max_tokens"] == 4  # never raised
    assert "max_tokens" not in ar.prepare_body({"messages": []}, 8)
    assert ar.prepare_body(body, 0) is body


def test_default_path_and_format():
    assert ar.default_path({"messages": [], "model": "m"}) == "/v1/chat/completions"
    assert (
        ar.default_path({"system": [{"type": "text", "text": "s"}], "messages": []})
        == "/v1/messages"
    )
    assert (
        ar.default_path(
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "tool_result", "tool_use_id": "t", "content": "x"}],
                    }
                ]
            }
        )
        == "/v1/messages"
    )
    assert ar.api_format("/v1/messages?beta=true") == ar.ANTHROPIC
    assert ar.api_format("/v1/chat/completions") == ar.OPENAI


def test_replay_headers_drop_credentials_and_hop_by_hop():
    h = ar.replay_headers(
        {
            "Host": "h",
            "Content-Length": "5",
            "x-api-key": "k",
            "Authorization": "<redacted:24 chars>",
            "anthropic-version": "2023-06-01",
            "anthropic-beta": "a,b",
            "X-Other": "<redacted:3 chars>",
        }
    )
    assert h == {"anthropic-version": "2023-06-01", "anthropic-beta": "a,b"}


def test_discover_sessions(tmp_path):
    a = tmp_path / "a"
    a.mkdir()
    (a / "02.json").write_text(json.dumps({"messages": [], "n": 2}))
    (a / "01.json").write_text(json.dumps({"messages": [], "n": 1}))
    (a / "10.json").write_text(json.dumps({"system": "s", "messages": [], "n": 10}))
    (a / "meta.jsonl").write_text(
        json.dumps({"file": "02.json", "path": "/v1/messages?beta=true", "headers": {"x": "y"}})
        + "\n"
        + json.dumps({"file": "01.json", "path": "/v1/chat/completions"})
        + "\n"
    )
    (a / "diffs.txt").write_text("ignored")
    b = tmp_path / "nested" / "b"
    b.mkdir(parents=True)
    (b / "1.json").write_text(json.dumps({"messages": []}))
    sessions = ar.discover_sessions(tmp_path)
    assert [s.name for s in sessions] == ["a", "nested/b"]
    caps = sessions[0].captures
    assert [c.file for c in caps] == ["02.json", "01.json", "10.json"]  # meta order, then numeric
    assert [c.path for c in caps] == [
        "/v1/messages?beta=true",
        "/v1/chat/completions",
        "/v1/messages",
    ]
    assert caps[0].headers == {"x": "y"} and caps[0].label == "a/02.json"
    assert [s.name for s in ar.discover_sessions(a)] == ["a"]
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError):
        ar.discover_sessions(empty)
