"""``benchmark/e2e/agent_replay.py --compare`` sends each request to both servers (anchors off
and on) before the next one, the order rotating from request to request, and computes each
mode's reusable prefix from that mode's own replies. Checked with ``replay_request`` and
``flush_cache`` replaced by fakes, so no server is started; no timing is asserted."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmark" / "e2e" / "agent_replay.py"
_spec = importlib.util.spec_from_file_location("bench_agent_replay", SCRIPT)
bench = importlib.util.module_from_spec(_spec)
sys.modules["bench_agent_replay"] = bench
_spec.loader.exec_module(bench)
ar = bench.ar


def _session(name: str, n: int) -> "ar.Session":
    caps = [
        ar.Capture(name, f"{i:02d}.json", "/v1/chat/completions", {"messages": [], "i": i})
        for i in range(n)
    ]
    return ar.Session(name, Path("/nonexistent") / name, caps)


def test_requests_alternate_between_modes_and_reuse_is_per_mode(monkeypatch, capsys):
    calls, flushed = [], []

    def fake_request(url, cap, max_new_tokens, timeout_s, http, ids):
        calls.append((url, cap.session, cap.body["i"]))
        # prompt i extends prompt i-1 by 10 tokens; the "on" server reports 2 ids fewer on the
        # third request, so its reusable prefix for the fourth must come from its own replies
        i = cap.body["i"]
        prompt = list(range(10 * (i + 1) - (2 if url == "on-url" and i == 2 else 0)))
        check = ar.StreamCheck(ar.OPENAI, prompt_tokens=len(prompt), ttft_s=0.01)
        return ar.RequestResult(cap, 200, 0.02, check, prompt_ids=prompt)

    monkeypatch.setattr(ar, "replay_request", fake_request)
    monkeypatch.setattr(ar, "flush_cache", lambda url: flushed.append(url))
    args = bench.parse_args(["--traces", "/nonexistent", "--compare"])
    runs = bench.replay_interleaved(
        {"off": "off-url", "on": "on-url"}, [_session("a", 4), _session("b", 1)], args
    )
    assert [c[0] for c in calls] == [
        "off-url", "on-url",  # request a/00: off first
        "on-url", "off-url",  # a/01: on first
        "off-url", "on-url",
        "on-url", "off-url",
        "off-url", "on-url",  # b/00: the rotation continues across sessions
    ]  # fmt: skip
    assert [(s, i) for _, s, i in calls[::2]] == [("a", 0), ("a", 1), ("a", 2), ("a", 3), ("b", 0)]
    assert flushed == ["off-url", "on-url", "off-url", "on-url"]  # each server, each session
    assert [r.reusable_tokens for r in runs["off"]] == [0, 10, 20, 30, 0]
    assert [r.reusable_tokens for r in runs["on"]] == [0, 10, 20, 28, 0]
    out = capsys.readouterr().out
    assert out.count("[off] session a") == 1 and out.count("[on] session b") == 1


def test_sequential_needs_compare():
    import pytest

    with pytest.raises(SystemExit):
        bench.parse_args(["--traces", "/x", "--sequential"])
