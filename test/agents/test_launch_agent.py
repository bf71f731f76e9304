"""sglang.launch_agent against a stand-in server (a thread answering /model_info and /v1/models
as upstream's http_server does): the configuration each client gets, where it is written, the
errors. The real clients against the real server are not run here."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from sglang import launch_agent as la

MODEL, CONTEXT = "qwen3-next-tiny", 262144


@pytest.fixture
def fake_server():
    bodies = {
        "/model_info": {
            "model_path": ".models/qwen3-next-tiny",
            "served_model_name": MODEL,
            "reasoning_parser": "qwen3",
            "tool_call_parser": "qwen",
        },
        "/v1/models": {"object": "list", "data": [{"id": MODEL, "max_model_len": CONTEXT}]},
    }
    seen = []
    prefill = {"ok": True, "delay_s": 0.05}

    class H(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            seen.append(self.path)
            body = json.dumps(bodies[self.path]).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self):  # noqa: N802
            n = int(self.headers["Content-Length"])
            req = json.loads(self.rfile.read(n))
            seen.append((self.path, len(req["input_ids"]), req["sampling_params"]))
            if self.path != "/generate" or not prefill["ok"]:
                self.send_response(404)
                self.end_headers()
                return
            time.sleep(prefill["delay_s"])
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b'{"text": "x", "meta_info": {}}')

        def log_message(self, *a):
            pass

    srv = HTTPServer(("127.0.0.1", 0), H)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_port}", seen, prefill
    srv.shutdown()


def test_read_server(fake_server):
    url, seen, _ = fake_server
    s = la.read_server(url + "/")
    assert s == la.ServerInfo(url, MODEL, CONTEXT, la.MAX_OUTPUT, True)
    assert seen == ["/model_info", "/v1/models"]


def test_output_limit():
    assert la.output_limit(2048) == 512  # a share of a small context
    assert la.output_limit(CONTEXT) == la.MAX_OUTPUT  # capped
    assert la.output_limit(2) == 1


def test_openclaw_profile(fake_server, tmp_path):
    s = la.read_server(fake_server[0])
    env = la.client_setup("openclaw", s, tmp_path / "p", idle_timeout_s=900)
    cfg = json.loads(Path(env["OPENCLAW_CONFIG_PATH"]).read_text())
    prov = cfg["models"]["providers"]["sglang"]
    assert prov["baseUrl"] == fake_server[0] + "/v1" and prov["api"] == "openai-completions"
    assert prov["timeoutSeconds"] == 900
    (m,) = prov["models"]
    assert (m["id"], m["reasoning"], m["contextWindow"], m["maxTokens"]) == (
        MODEL,
        True,
        CONTEXT,
        la.MAX_OUTPUT,
    )
    assert cfg["agents"]["defaults"]["model"]["primary"] == f"sglang/{MODEL}"
    assert env["OPENCLAW_STATE_DIR"] == str(tmp_path / "p")


def test_opencode_profile(fake_server, tmp_path):
    s = la.read_server(fake_server[0])
    env = la.client_setup("opencode", s, tmp_path)
    cfg = json.loads(Path(env["OPENCODE_CONFIG"]).read_text())
    assert cfg["model"] == f"sglang/{MODEL}"
    prov = cfg["provider"]["sglang"]
    assert prov["npm"] == "@ai-sdk/openai-compatible"
    assert prov["options"]["baseURL"] == fake_server[0] + "/v1"
    m = prov["models"][MODEL]
    assert m["limit"] == {"context": CONTEXT, "output": la.MAX_OUTPUT}
    assert m["reasoning"] is True and m["tool_call"] is True


def test_claude_env(fake_server, tmp_path):
    s = la.read_server(fake_server[0])
    env = la.client_setup("claude", s, tmp_path)
    assert env["CLAUDE_CONFIG_DIR"] == str(tmp_path)
    assert env["ANTHROPIC_BASE_URL"] == fake_server[0]
    assert env["ANTHROPIC_MODEL"] == env["ANTHROPIC_DEFAULT_SONNET_MODEL"] == MODEL
    assert env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] == env["CLAUDE_CODE_AUTO_COMPACT_WINDOW"]
    assert int(env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"]) == CONTEXT
    assert int(env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"]) == la.MAX_OUTPUT


def test_print_config_writes_only_the_profile(fake_server, tmp_path, monkeypatch, capsys):
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    prof = tmp_path / "prof"
    rc = la.main(
        ["opencode", "--base-url", fake_server[0], "--profile", str(prof), "--print-config"]
    )
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["profile"] == str(prof) and (prof / "opencode.json").exists()
    assert list(home.iterdir()) == []  # the user's own configuration is never touched


def test_temporary_profile_by_default(fake_server, capsys):
    assert la.main(["claude", "--base-url", fake_server[0], "--print-config"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert Path(out["profile"]).is_dir() and "sglang-claude-" in out["profile"]


def test_no_server_says_how_to_start_one():
    with pytest.raises(SystemExit, match="make serve"):
        la.read_server("http://127.0.0.1:9", timeout=2)


def test_missing_client_says_so(fake_server, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SystemExit, match="not on PATH"):
        la.main(["openclaw", "--base-url", fake_server[0], "--profile", str(tmp_path / "p")])


def test_unknown_client(tmp_path):
    with pytest.raises(ValueError, match="choose one of"):
        la.client_setup("vim", la.ServerInfo("u", "m", 10, 2, True), tmp_path)


def test_client_args_after_double_dash(fake_server, monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(la.shutil, "which", lambda name: "/bin/" + name)
    monkeypatch.setattr(la.os, "execvpe", lambda exe, args, env: calls.append((exe, args, env)))
    la.main(["claude", "--base-url", fake_server[0], "--profile", str(tmp_path), "--", "-p", "hi"])
    ((exe, args, env),) = calls
    assert exe == "/bin/claude" and args == ["/bin/claude", "-p", "hi"]
    assert env["ANTHROPIC_MODEL"] == MODEL


def test_prefill_rate_is_timed_on_fresh_tokens(fake_server):
    url, seen, prefill = fake_server
    rate = la.measure_prefill_rate(url)
    assert 0 < rate < la.PROBE_TOKENS / prefill["delay_s"]  # the server's delay is included
    ((path, n, params),) = [x for x in seen if isinstance(x, tuple)]
    assert (path, n, params["max_new_tokens"]) == ("/generate", la.PROBE_TOKENS, 1)


@pytest.mark.parametrize(
    "context, rate, want",
    [
        (262144, 1000.0, 1049),  # ceil(4 * 262144 / 1000)
        (2048, 1e6, la.MIN_IDLE_TIMEOUT_S),
        (10**7, 1.0, la.MAX_IDLE_TIMEOUT_S),
    ],
)
def test_cold_prefill_timeout(context, rate, want):
    assert la.cold_prefill_timeout(context, rate) == want


def test_cold_prefill_timeout_rejects_a_bad_rate():
    with pytest.raises(ValueError, match="must be positive"):
        la.cold_prefill_timeout(100, 0.0)


def test_idle_timeout_measured_or_default(fake_server, capsys):
    url, _, prefill = fake_server
    s = la.read_server(url)
    prefill["delay_s"] = 0.5  # 512 tokens in >= 0.5 s: a full 262144-token prefill >= 256 s
    assert la.idle_timeout(s) >= la.cold_prefill_timeout(CONTEXT, la.PROBE_TOKENS / 0.5)
    prefill["ok"] = False
    assert la.idle_timeout(s) == la.DEFAULT_IDLE_TIMEOUT_S
    assert "prefill probe failed" in capsys.readouterr().err


def test_claude_watchdogs_get_the_idle_timeout(fake_server, tmp_path):
    s = la.read_server(fake_server[0])
    env = la.client_setup("claude", s, tmp_path, idle_timeout_s=900)
    for name in (
        "CLAUDE_STREAM_IDLE_TIMEOUT_MS",
        "CLAUDE_STREAM_FIRST_BYTE_TIMEOUT_MS",
        "API_TIMEOUT_MS",
    ):
        assert env[name] == "900000"


def test_print_config_reports_the_measured_timeout(fake_server, tmp_path, capsys):
    args = ["openclaw", "--base-url", fake_server[0], "--profile", str(tmp_path), "--print-config"]
    assert la.main(args) == 0
    out = json.loads(capsys.readouterr().out)
    cfg = json.loads((tmp_path / "openclaw.json").read_text())
    assert cfg["models"]["providers"]["sglang"]["timeoutSeconds"] == out["idle_timeout_s"]
    assert out["idle_timeout_s"] >= la.MIN_IDLE_TIMEOUT_S
    assert la.main([*args, "--idle-timeout", "4321"]) == 0
    cfg = json.loads((tmp_path / "openclaw.json").read_text())
    assert cfg["models"]["providers"]["sglang"]["timeoutSeconds"] == 4321
