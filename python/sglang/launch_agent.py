"""Start an agent client (OpenClaw, OpenCode, Claude Code) configured for a running server.

``python -m sglang.launch_agent openclaw|opencode|claude [--base-url URL] [--profile DIR]
[--print-config] [-- client args]`` reads the server's ``/model_info`` (served model id,
reasoning parser) and ``/v1/models`` (its context length), writes the client's configuration into
a profile folder (a new temporary one unless ``--profile`` names one; never the user's own
configuration) and runs the client with environment variables that point it there:

* ``openclaw``: ``openclaw.json`` (JSON5, strict schema) with a provider ``sglang`` of
  ``api: "openai-completions"``, ``baseUrl`` ``<server>/v1``, the model with ``reasoning: true``,
  ``contextWindow`` and ``maxTokens`` from the server, the provider's ``timeoutSeconds`` set to
  the idle timeout below (in the pinned OpenClaw 2026.9.6 this key is what raises the LLM idle
  watchdog, ``resolveLlmIdleTimeoutMs``, bounded only by a lower ``agents.defaults.timeoutSeconds``
  (48 h by default) or a run's own ``--timeout``), the agents' primary model;
  ``OPENCLAW_CONFIG_PATH`` and ``OPENCLAW_STATE_DIR`` point at the profile;
* ``opencode``: ``opencode.json`` with a provider ``sglang`` (``@ai-sdk/openai-compatible``,
  ``options.baseURL``), the model's ``limit.context`` / ``limit.output``, ``reasoning`` and
  ``tool_call`` on, and ``model: "sglang/<id>"``; ``OPENCODE_CONFIG`` points at it;
* ``claude``: no file but ``CLAUDE_CONFIG_DIR`` (the profile), ``ANTHROPIC_BASE_URL``, a dummy
  ``ANTHROPIC_AUTH_TOKEN``, ``ANTHROPIC_MODEL`` and the default Sonnet/Opus/Haiku models set to
  the served id, ``CLAUDE_CODE_MAX_OUTPUT_TOKENS``, ``CLAUDE_CODE_AUTO_COMPACT_WINDOW`` and
  ``CLAUDE_CODE_MAX_CONTEXT_TOKENS`` (the window: Claude Code 2.1.332 reads it for a model id it
  does not know, else assumes 200K or 1M tokens), ``CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC``,
  and its watchdogs set to the idle timeout: ``CLAUDE_STREAM_IDLE_TIMEOUT_MS`` (no bytes
  mid-stream; at least 300 s), ``CLAUDE_STREAM_FIRST_BYTE_TIMEOUT_MS`` (no response headers: our
  streams send them after the prefill) and ``API_TIMEOUT_MS``.

The idle timeout (``--idle-timeout`` seconds, else measured): a cold prefill of the whole context
must fit in it, since no client sees a byte before the prefill ends. ``launch_agent`` times one
prefill of :data:`PROBE_TOKENS` fresh tokens on the server (``/generate``, one output token) and
extrapolates linearly to the context (:func:`cold_prefill_timeout`).

The output limit is the server's context length divided by :data:`OUTPUT_SHARE`, at most
:data:`MAX_OUTPUT` (the server accepts up to the whole context, but a client that reserves that
much for output has no room left for the prompt).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

__all__ = [
    "ServerInfo",
    "client_setup",
    "cold_prefill_timeout",
    "idle_timeout",
    "main",
    "measure_prefill_rate",
    "output_limit",
    "read_server",
]

CLIENTS = {"openclaw": "openclaw", "opencode": "opencode", "claude": "claude"}
OUTPUT_SHARE = 4
MAX_OUTPUT = 32768
DEFAULT_IDLE_TIMEOUT_S = 1800  # when the prefill probe fails
PROBE_TOKENS = 512
# Linear extrapolation ignores attention's quadratic term and a loaded machine: keep a margin.
PREFILL_SAFETY = 4
MIN_IDLE_TIMEOUT_S, MAX_IDLE_TIMEOUT_S = 300, 86400
PROVIDER = "sglang"


@dataclass(frozen=True)
class ServerInfo:
    """What a client needs to know of the server. ``context`` and ``output`` are in tokens."""

    base_url: str
    model: str
    context: int
    output: int
    reasoning: bool


def _get_json(url: str, timeout: float) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 - user's server
        return json.loads(r.read().decode("utf-8"))


def read_server(base_url: str, timeout: float = 10.0) -> ServerInfo:
    """Ask the server at ``base_url`` (``http://host:port``) for its model id and limits.

    Raises:
        SystemExit: the server does not answer ``/model_info`` or ``/v1/models``, or reports no
            context length; the message says which and how to start one.
    """
    base = base_url.rstrip("/")
    try:
        info = _get_json(base + "/model_info", timeout)
        models = _get_json(base + "/v1/models", timeout)
    except (OSError, ValueError) as e:
        raise SystemExit(
            f"launch_agent: no SGLang server answers at {base} ({e}); start one with "
            "`make serve` or pass --base-url"
        ) from e
    model = info.get("served_model_name") or info.get("model_path")
    card = next((m for m in models.get("data", []) if m.get("id") == model), None)
    context = (card or {}).get("max_model_len")
    if not model or not isinstance(context, int) or context <= 0:
        raise SystemExit(f"launch_agent: {base} reports no model id or context length")
    reasoning = bool(info.get("reasoning_parser"))
    return ServerInfo(base, model, context, output_limit(context), reasoning)


def measure_prefill_rate(base_url: str, tokens: int = PROBE_TOKENS, timeout: float = 600) -> float:
    """Prefill throughput of the server at ``base_url``, in tokens per second: the wall time of
    one ``/generate`` of ``tokens`` fresh token ids (random ids in [100, 1100), so no cached
    prefix) and one output token, HTTP included.

    Raises:
        OSError, ValueError: the server does not answer the request (or not with JSON).
    """
    ids = [random.randrange(100, 1100) for _ in range(tokens)]
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    req = urllib.request.Request(
        base_url.rstrip("/") + "/generate",
        data=json.dumps(body).encode("utf-8"),
        headers={"Content-Type": "application/json"},
    )
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310 - user's server
        json.loads(r.read().decode("utf-8"))
    return tokens / max(time.perf_counter() - t0, 1e-6)


def cold_prefill_timeout(context: int, tokens_per_s: float) -> int:
    """Seconds a client should wait for the first byte of a request that fills ``context``
    tokens on a server that prefills ``tokens_per_s``: ``PREFILL_SAFETY * context /
    tokens_per_s`` (linear in the prompt length), within [MIN_IDLE_TIMEOUT_S,
    MAX_IDLE_TIMEOUT_S].

    Raises:
        ValueError: ``tokens_per_s`` is not positive.
    """
    if not tokens_per_s > 0:
        raise ValueError(f"prefill rate must be positive, got {tokens_per_s}")
    s = math.ceil(PREFILL_SAFETY * context / tokens_per_s)
    return max(MIN_IDLE_TIMEOUT_S, min(MAX_IDLE_TIMEOUT_S, s))


def idle_timeout(s: ServerInfo) -> int:
    """The idle timeout (seconds) for server ``s``: :func:`cold_prefill_timeout` of a measured
    prefill, or :data:`DEFAULT_IDLE_TIMEOUT_S` (with a note on stderr) when the probe fails."""
    try:
        rate = measure_prefill_rate(s.base_url)
    except (OSError, ValueError) as e:
        print(
            f"launch_agent: prefill probe failed ({e}); idle timeout {DEFAULT_IDLE_TIMEOUT_S}s",
            file=sys.stderr,
        )
        return DEFAULT_IDLE_TIMEOUT_S
    return cold_prefill_timeout(s.context, rate)


def output_limit(context: int) -> int:
    """The output limit (tokens) a client gets for a context of ``context`` tokens."""
    return max(1, min(MAX_OUTPUT, context // OUTPUT_SHARE))


def openclaw_config(s: ServerInfo, idle_timeout_s: int) -> dict:
    """OpenClaw's ``openclaw.json`` for server ``s``."""
    return {
        "models": {
            "providers": {
                PROVIDER: {
                    "baseUrl": s.base_url + "/v1",
                    "api": "openai-completions",
                    "apiKey": "sglang",
                    "timeoutSeconds": idle_timeout_s,
                    "models": [
                        {
                            "id": s.model,
                            "name": s.model,
                            "input": ["text"],
                            "reasoning": True,
                            "contextWindow": s.context,
                            "maxTokens": s.output,
                        }
                    ],
                }
            }
        },
        "agents": {"defaults": {"model": {"primary": f"{PROVIDER}/{s.model}"}}},
    }


def opencode_config(s: ServerInfo) -> dict:
    """OpenCode's ``opencode.json`` for server ``s``."""
    return {
        "$schema": "https://opencode.ai/config.json",
        "provider": {
            PROVIDER: {
                "npm": "@ai-sdk/openai-compatible",
                "name": "SGLang",
                "options": {"baseURL": s.base_url + "/v1", "apiKey": "sglang"},
                "models": {
                    s.model: {
                        "name": s.model,
                        "reasoning": True,
                        "tool_call": True,
                        "limit": {"context": s.context, "output": s.output},
                    }
                },
            }
        },
        "model": f"{PROVIDER}/{s.model}",
    }


def claude_env(s: ServerInfo, idle_timeout_s: int = DEFAULT_IDLE_TIMEOUT_S) -> dict[str, str]:
    """Claude Code's environment for server ``s`` (its settings live in CLAUDE_CONFIG_DIR);
    ``idle_timeout_s`` in seconds."""
    ms = str(idle_timeout_s * 1000)
    env = {
        "ANTHROPIC_BASE_URL": s.base_url,
        "ANTHROPIC_AUTH_TOKEN": "sglang",
        "ANTHROPIC_MODEL": s.model,
        "ANTHROPIC_SMALL_FAST_MODEL": s.model,
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(s.output),
        "CLAUDE_CODE_AUTO_COMPACT_WINDOW": str(s.context),
        "CLAUDE_CODE_MAX_CONTEXT_TOKENS": str(s.context),
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "CLAUDE_STREAM_IDLE_TIMEOUT_MS": ms,
        "CLAUDE_STREAM_FIRST_BYTE_TIMEOUT_MS": ms,
        "API_TIMEOUT_MS": ms,
    }
    for tier in ("SONNET", "OPUS", "HAIKU"):
        env[f"ANTHROPIC_DEFAULT_{tier}_MODEL"] = s.model
    return env


def client_setup(
    client: str, s: ServerInfo, profile: Path, idle_timeout_s: int = DEFAULT_IDLE_TIMEOUT_S
) -> dict[str, str]:
    """Write ``client``'s configuration for ``s`` into the folder ``profile`` (created); return
    the environment variables that make the client use it.

    Raises:
        ValueError: ``client`` is not one of :data:`CLIENTS`.
    """
    profile.mkdir(parents=True, exist_ok=True)
    if client == "openclaw":
        path = profile / "openclaw.json"
        path.write_text(json.dumps(openclaw_config(s, idle_timeout_s), indent=2) + "\n")
        return {"OPENCLAW_CONFIG_PATH": str(path), "OPENCLAW_STATE_DIR": str(profile)}
    if client == "opencode":
        path = profile / "opencode.json"
        path.write_text(json.dumps(opencode_config(s), indent=2) + "\n")
        return {"OPENCODE_CONFIG": str(path)}
    if client == "claude":
        return {"CLAUDE_CONFIG_DIR": str(profile), **claude_env(s, idle_timeout_s)}
    raise ValueError(f"unknown client {client!r}: choose one of {', '.join(CLIENTS)}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    client_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, client_args = argv[:i], argv[i + 1 :]
    p = argparse.ArgumentParser(prog="python -m sglang.launch_agent", description=__doc__)
    p.add_argument("client", choices=sorted(CLIENTS))
    p.add_argument("--base-url", default="http://127.0.0.1:30000")
    p.add_argument("--profile", type=Path, help="profile folder (default: a new temporary one)")
    p.add_argument(
        "--idle-timeout",
        type=int,
        help="seconds a client waits for a byte (default: measured for a cold full-context prefill)",
    )
    p.add_argument("--print-config", action="store_true", help="write the profile, print, exit")
    args = p.parse_args(argv)

    server = read_server(args.base_url)
    profile = args.profile or Path(tempfile.mkdtemp(prefix=f"sglang-{args.client}-"))
    timeout_s = args.idle_timeout if args.idle_timeout else idle_timeout(server)
    env = client_setup(args.client, server, profile, timeout_s)
    if args.print_config:
        print(
            json.dumps({"profile": str(profile), "idle_timeout_s": timeout_s, "env": env}, indent=2)
        )
        return 0
    exe = shutil.which(CLIENTS[args.client])
    if exe is None:
        raise SystemExit(
            f"launch_agent: `{CLIENTS[args.client]}` is not on PATH; install it (npm) or add "
            f"--print-config to only write the profile ({profile})"
        )
    os.execvpe(exe, [exe, *client_args], {**os.environ, **env})
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
