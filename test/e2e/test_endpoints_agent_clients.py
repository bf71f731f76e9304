"""Real agent clients (Claude Code 2.1.332, OpenCode 1.18.33; OpenClaw not yet) run one tool loop
against the real server, configured by ``sglang.launch_agent``.

Opt-in: the clients are 1.5 GB from npm (``make agents``, about 4.5 minutes cold, cached in
``.cache/agents``), too much for the CI budget, so ``make test-agents`` installs them and runs
this module; without the install the tests are skipped with that instruction (never counted as
passed).

The model's output is scripted server-side (the default ``server`` fixture's
``SGLANG_TEST_SCRIPTED_OUTPUT`` hook, ``scripted_rules``): the first request of the turn (it
contains the prompt) gets a shell tool call that prints a marker computed by the shell, the
request carrying the tool's result (it contains the marker) gets an answer quoting it. The test
asserts on the client's own output and on the requests the server recorded.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from sglang import launch_agent as la

REPO = Path(__file__).resolve().parents[2]
AGENTS = REPO / ".cache" / "agents"
BIN = AGENTS / "node_modules" / ".bin"
MARKER = "SGLANG-RESULT-4242"  # what the shell prints: the script's command computes it
PROMPT = "Run the echo command from the task and report its output."
ANSWER = f"The command printed {MARKER}."
CLIENT_TIMEOUT_S = 600

needs_clients = pytest.mark.skipif(
    not (AGENTS / ".pinned").exists(),
    reason="agent clients not installed: run `make test-agents` (installs them into .cache/agents)",
)


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


@needs_clients
def test_claude_code_tool_loop(server, scripted_rules, tmp_path):
    seen = scripted_rules(
        rules("Bash", {"command": "echo SGLANG-RESULT-$((4200+42))", "description": "echo"})
    )
    s = la.read_server(server.url)
    env = la.client_setup("claude", s, tmp_path / "profile", idle_timeout_s=CLIENT_TIMEOUT_S)
    p = run_client(
        [str(BIN / "claude"), "-p", PROMPT, "--allowedTools", "Bash", "--output-format", "json"],
        env,
        tmp_path,
    )
    assert p.returncode == 0, (
        f"claude exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    )
    out = json.loads(p.stdout)
    assert MARKER in out["result"], out
    rows = [r for r in recorded(seen) if r["route"] == "/v1/messages"]
    scripted = [r["rule"] for r in rows if r["rule"] is not None]
    assert scripted[:1] == [1] and 0 in scripted, rows  # the call, then the answer
    answer_req = next(r for r in rows if r["rule"] == 0)
    assert "Bash" in answer_req["tools"]
    # the tool's real output went back to the server (the shell computed the marker)
    assert MARKER in json.dumps(answer_req["messages"])


@needs_clients
def test_opencode_tool_loop(server, scripted_rules, tmp_path):
    seen = scripted_rules(
        rules("bash", {"command": "echo SGLANG-RESULT-$((4200+42))", "description": "echo"})
    )
    s = la.read_server(server.url)
    env = la.client_setup("opencode", s, tmp_path / "profile")
    p = run_client([str(BIN / "opencode"), "run", PROMPT], env, tmp_path)
    assert p.returncode == 0, (
        f"opencode exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    )
    # the shell's own output, then the scripted answer quoting it
    assert MARKER in p.stdout and ANSWER in p.stdout, p.stdout[-3000:]
    rows = [r for r in recorded(seen) if r["route"] == "/v1/chat/completions"]
    answer_req = next((r for r in rows if r["rule"] == 0), None)
    assert answer_req is not None, rows
    assert "bash" in answer_req["tools"] and answer_req["stream"]
    assert MARKER in json.dumps(answer_req["messages"])
