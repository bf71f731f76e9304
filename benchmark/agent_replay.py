#!/usr/bin/env python
"""Replay captured agent sessions against SGLang and report how much reusable prefix was cached.

Every folder of captured requests (``NN.json`` + ``meta.jsonl``) under ``--traces`` is a session;
sessions are replayed one after another, each starting from an empty prefix cache, every request
in order. One line is printed per request, then one per session, and last:

    agent_replay requests=N cached_tokens=C reusable_tokens=R wasted_tokens=R-C reuse_ratio=C/R

where ``reusable`` is, per request, the longest token prefix (after the chat template) it shares
with any earlier request of its session, and ``cached`` is what the server reported as served
from its prefix cache. Exit status 1 if any request failed or returned a malformed stream.
"""
from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path
from typing import Callable, Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "test" / "e2e"))
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


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--traces", required=True, type=Path,
                   help="a session folder (NN.json [+ meta.jsonl]) or a folder of them")
    p.add_argument("--url", help="replay against this running server instead of starting one "
                   "(e.g. http://127.0.0.1:30000); its prefix cache is flushed per session")
    p.add_argument("--model-arch", default="qwen3_next", choices=["qwen3_next", "qwen3_moe"],
                   help="embedded tiny model to serve when no --url (default: qwen3_next)")
    p.add_argument("--model-path", type=Path,
                   help="serve this model folder instead of the embedded tiny model")
    p.add_argument("--server-args", default="",
                   help="extra launch_server arguments, one shell-quoted string")
    p.add_argument("--max-new-tokens", type=int, default=ar.DEFAULT_MAX_NEW_TOKENS,
                   help="cap on generated tokens per request (default %(default)s): lowers each "
                   "length field present in a body (" + ", ".join(ar.LENGTH_FIELDS) + ") and "
                   "nothing else, since random-weight models rarely stop on their own and "
                   "captures ask for up to 32000 tokens; 0 = send the bodies unchanged")
    p.add_argument("--timeout", type=float, default=1800,
                   help="seconds to wait for each read of a reply, first byte included")
    p.add_argument("--no-flush", action="store_true",
                   help="do not empty the prefix cache before each session")
    return p.parse_args(argv)


def replay(url: str, sessions: list, args: argparse.Namespace,
           out: Callable[[str], None] = print) -> list:
    """Replay ``sessions`` against ``url``, printing a line per request and per session."""
    results = []
    for s in sessions:
        sr = ar.replay_session(url, s, args.max_new_tokens, args.timeout, not args.no_flush,
                               on_result=lambda r: out(r.line()))
        out(sr.summary().line(f"session {s.name} wall={sr.wall_s:.1f}s"))
        results.append(sr)
    return results


def with_server(args: argparse.Namespace, extra: list[str], fn: Callable[[str], object]):
    """Run ``fn(url)`` against ``--url``, or a server started for this run with ``extra``
    launch arguments (stopped afterwards). A ``--compare`` mode calls this once per variant."""
    if args.url:
        return fn(args.url)
    import server  # test/e2e/server.py

    model = args.model_path or server.ensure_model(args.model_arch)
    t0 = time.perf_counter()
    srv = server.start_server(model, shlex.split(args.server_args) + extra)
    print(f"# server {srv.url} model={model} up in {time.perf_counter() - t0:.0f}s "
          f"log={srv.log}", flush=True)
    try:
        return fn(srv.url)
    finally:
        srv.stop()


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    sessions = ar.discover_sessions(args.traces)
    results = with_server(
        args, [], lambda url: replay(url, sessions, args, lambda s: print(s, flush=True))
    )
    summary = ar.ReplaySummary.of(r for sr in results for r in sr.results)
    print(summary.line(), flush=True)
    return 1 if summary.failed else 0


if __name__ == "__main__":
    sys.exit(main())
