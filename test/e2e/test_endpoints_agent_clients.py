"""Real agent clients (OpenClaw 2026.9.6, OpenCode 1.18.33, Claude Code 2.1.332) run whole turns
against the real server, configured by ``sglang.launch_agent``.

The clients come from npm at pinned versions (``make agents``: ``scripts/install_agents.sh``
into ``.cache/agents``, with Node 24 from the npm ``node`` package for OpenClaw); ``make test``
installs them first, so these tests run in CI. Without the install they fail saying how to get
it; ``SGLANG_TEST_SKIP_AGENTS=1`` skips them instead (a developer without the npm registry).

Every client talks to the server through a :class:`RecordingProxy`, so a test sees each
exchange of the turn: the status of every response and the whole body of every stream.

* Scripted turns (one per client): the model's output is scripted server-side (the default
  ``server`` fixture's ``SGLANG_TEST_SCRIPTED_OUTPUT`` hook, ``scripted_rules``): the first
  request of the turn (it contains the prompt) gets a shell tool call that prints a marker
  computed by the shell, the request carrying the tool's result (it contains the marker) gets
  an answer quoting it. The client must exit 0 with that answer, and the server must have seen
  the marker come back in a tool result.
* Unscripted turns (one per client): the random-weights model writes whatever it writes, with
  the client's output limit set to :data:`SMALL_OUTPUT` tokens. Every response is a 200, every
  stream well formed (:func:`recording_proxy.stream_problems`) and the client ends within its
  timeout.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from pathlib import Path

import pytest
from recording_proxy import RecordingProxy, stream_problems

from sglang import launch_agent as la

REPO = Path(__file__).resolve().parents[2]
AGENTS = REPO / ".cache" / "agents"
BIN = AGENTS / "node_modules" / ".bin"
MARKER = "SGLANG-RESULT-4242"  # what the shell prints: the script's command computes it
COMMAND = "echo SGLANG-RESULT-$((4200+42))"
PROMPT = "Run the echo command from the task and report its output."
ANSWER = f"The command printed {MARKER}."
CLIENT_TIMEOUT_S = 600
SMALL_OUTPUT = 16  # tokens: the unscripted turns' output limit


@pytest.fixture(autouse=True)
def clients_installed():
    if (AGENTS / ".pinned").exists():
        return
    if os.environ.get("SGLANG_TEST_SKIP_AGENTS") == "1":
        pytest.skip("SGLANG_TEST_SKIP_AGENTS=1: agent clients not installed")
    pytest.fail(
        f"agent clients not installed in {AGENTS}: run `make agents` (npm; `make test` does it), "
        "or set SGLANG_TEST_SKIP_AGENTS=1 to skip these tests",
        pytrace=False,
    )


@pytest.fixture
def proxy(server):
    p = RecordingProxy(server.url)
    yield p
    p.close()


def rules(tool: str, args: dict) -> list[dict]:
    """Answer once the tool result is in the history; before that, call ``tool``."""
    call = json.dumps({"name": tool, "arguments": args})
    return [
        {"when": MARKER, "text": f"Done.\n</think>\n\n{ANSWER}"},
        {"when": PROMPT, "text": f"I will run it.\n</think>\n\n<tool_call>\n{call}\n</tool_call>"},
    ]


def run_client(args: list[str], env: dict, cwd: Path) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **env, "PATH": f"{BIN}:{os.environ['PATH']}", "HOME": str(cwd)}
    return subprocess.run(
        args, env=full_env, cwd=cwd, capture_output=True, text=True, timeout=CLIENT_TIMEOUT_S
    )


def recorded(seen: Path) -> list[dict]:
    return [json.loads(line) for line in seen.read_text().splitlines()] if seen.exists() else []


def describe(p: subprocess.CompletedProcess) -> str:
    return f"exit {p.returncode}:\n{p.stdout[-3000:]}\n--- stderr ---\n{p.stderr[-3000:]}"


def assert_exchanges_clean(proxy: RecordingProxy, route: str) -> list:
    """Every response through ``proxy`` was a 200 and every stream well formed; returns the
    exchanges of ``route`` (at least one)."""
    bad = [(e.method, e.path, e.status, e.error, e.response[:500]) for e in proxy.exchanges]
    bad = [b for b in bad if b[2] != 200 or b[3]]
    assert not bad, bad
    gen = [e for e in proxy.generation() if e.path.startswith(route)]
    assert gen, [(e.method, e.path) for e in proxy.exchanges]
    for e in gen:
        if e.content_type.startswith("text/event-stream"):
            assert not stream_problems(e), (stream_problems(e), e.response[-2000:])
    return gen


# --- the clients' command lines ---------------------------------------------------------------


def claude_cmd(prompt: str) -> list[str]:
    return [str(BIN / "claude"), "-p", prompt, "--allowedTools", "Bash", "--output-format", "json"]


def opencode_cmd(prompt: str) -> list[str]:
    return [str(BIN / "opencode"), "run", prompt]


def openclaw_cmd(prompt: str, s: la.ServerInfo, env: dict, cwd: Path) -> list[str]:
    return [
        str(BIN / "openclaw"),
        "agent",
        "exec",
        prompt,
        "--config",
        env["OPENCLAW_CONFIG_PATH"],
        "--model",
        f"{la.PROVIDER}/{s.model}",
        "--cwd",
        str(cwd),
        "--code-mode",
        "direct",
        "--json",
        "--timeout",
        str(CLIENT_TIMEOUT_S),
    ]


# --- scripted tool loops ----------------------------------------------------------------------


def test_claude_code_tool_loop(proxy, scripted_rules, tmp_path):
    seen = scripted_rules(rules("Bash", {"command": COMMAND, "description": "echo"}))
    s = la.read_server(proxy.url)
    env = la.client_setup("claude", s, tmp_path / "profile", idle_timeout_s=CLIENT_TIMEOUT_S)
    p = run_client(claude_cmd(PROMPT), env, tmp_path)
    assert p.returncode == 0, describe(p)
    out = json.loads(p.stdout)
    assert MARKER in out["result"], out
    rows = [r for r in recorded(seen) if r["route"] == "/v1/messages"]
    scripted = [r["rule"] for r in rows if r["rule"] is not None]
    assert scripted[:1] == [1] and 0 in scripted, rows  # the call, then the answer
    answer_req = next(r for r in rows if r["rule"] == 0)
    assert "Bash" in answer_req["tools"]
    # the tool's real output went back to the server (the shell computed the marker)
    assert MARKER in json.dumps(answer_req["messages"])
    assert_exchanges_clean(proxy, "/v1/messages")


def test_opencode_tool_loop(proxy, scripted_rules, tmp_path):
    seen = scripted_rules(rules("bash", {"command": COMMAND, "description": "echo"}))
    s = la.read_server(proxy.url)
    env = la.client_setup("opencode", s, tmp_path / "profile")
    p = run_client(opencode_cmd(PROMPT), env, tmp_path)
    assert p.returncode == 0, describe(p)
    # the shell's own output, then the scripted answer quoting it
    assert MARKER in p.stdout and ANSWER in p.stdout, p.stdout[-3000:]
    rows = [r for r in recorded(seen) if r["route"] == "/v1/chat/completions"]
    answer_req = next((r for r in rows if r["rule"] == 0), None)
    assert answer_req is not None, rows
    assert "bash" in answer_req["tools"] and answer_req["stream"]
    assert MARKER in json.dumps(answer_req["messages"])
    assert_exchanges_clean(proxy, "/v1/chat/completions")


def test_openclaw_tool_loop(proxy, scripted_rules, tmp_path):
    seen = scripted_rules(rules("exec", {"command": COMMAND}))
    s = la.read_server(proxy.url)
    env = la.client_setup("openclaw", s, tmp_path / "profile", idle_timeout_s=CLIENT_TIMEOUT_S)
    work = tmp_path / "work"
    work.mkdir()
    p = run_client(openclaw_cmd(PROMPT, s, env, work), env, tmp_path)
    assert p.returncode == 0, describe(p)
    out = json.loads(p.stdout)
    assert out["ok"] and out["status"] == "ok", out
    assert ANSWER in out["final"], out
    assert "exec" in out.get("toolSummary", {}).get("tools", []), out
    rows = [r for r in recorded(seen) if r["route"] == "/v1/chat/completions"]
    scripted = [r["rule"] for r in rows if r["rule"] is not None]
    assert scripted[:1] == [1] and 0 in scripted, rows
    answer_req = next(r for r in rows if r["rule"] == 0)
    assert "exec" in answer_req["tools"] and answer_req["stream"]
    assert MARKER in json.dumps(answer_req["messages"])
    assert_exchanges_clean(proxy, "/v1/chat/completions")


# --- unscripted turns with a small output limit -----------------------------------------------


def small(s: la.ServerInfo) -> la.ServerInfo:
    return dataclasses.replace(s, output=SMALL_OUTPUT)


def assert_small_outputs(gen: list) -> None:
    """The client asked for at most :data:`SMALL_OUTPUT` tokens in each generation request."""
    asked = [
        e.request_json().get("max_tokens") or e.request_json().get("max_completion_tokens")
        for e in gen
    ]
    assert all(a is not None and a <= SMALL_OUTPUT for a in asked), asked


def test_claude_code_unscripted(proxy, scripted_rules, tmp_path):
    scripted_rules([])  # record, script nothing
    s = small(la.read_server(proxy.url))
    env = la.client_setup("claude", s, tmp_path / "profile", idle_timeout_s=CLIENT_TIMEOUT_S)
    p = run_client(claude_cmd("Say hello."), env, tmp_path)
    gen = assert_exchanges_clean(proxy, "/v1/messages")
    assert_small_outputs(gen)
    out = json.loads(p.stdout)  # the client's own result envelope, whatever the model wrote
    # 16 tokens rarely end a turn: Claude Code reports the cut answer as its own error (exit 1)
    assert p.returncode == 0 or out.get("api_error") == "max_output_tokens", describe(p)


def test_opencode_unscripted(proxy, scripted_rules, tmp_path):
    scripted_rules([])
    s = small(la.read_server(proxy.url))
    env = la.client_setup("opencode", s, tmp_path / "profile")
    p = run_client(opencode_cmd("Say hello."), env, tmp_path)
    gen = assert_exchanges_clean(proxy, "/v1/chat/completions")
    assert_small_outputs(gen)
    assert p.returncode == 0, describe(p)


def test_openclaw_unscripted(proxy, scripted_rules, tmp_path):
    scripted_rules([])
    s = small(la.read_server(proxy.url))
    env = la.client_setup("openclaw", s, tmp_path / "profile", idle_timeout_s=CLIENT_TIMEOUT_S)
    work = tmp_path / "work"
    work.mkdir()
    p = run_client(openclaw_cmd("Say hello.", s, env, work), env, tmp_path)
    gen = assert_exchanges_clean(proxy, "/v1/chat/completions")
    assert_small_outputs(gen)
    out = json.loads(p.stdout)
    assert out["status"] in ("ok", "error"), describe(p)  # not "timeout"
    # 16 tokens of a random model are often all reasoning: OpenClaw retries, then reports that
    # the model wrote no answer (exit 1); a transport or parse error would be another kind
    ok = p.returncode == 0 and out["ok"]
    assert ok or out.get("error", {}).get("kind") == "fallback_exhausted", describe(p)
    assert out["usage"]["output"] > 0, out  # it read the tokens of each stream
