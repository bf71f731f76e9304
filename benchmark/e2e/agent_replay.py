#!/usr/bin/env python
"""Replay captured agent sessions against SGLang and report how much reusable prefix was cached.

Every folder of captured requests (``NN.json`` + ``meta.jsonl``) under ``--traces`` is a session;
sessions are replayed one after another, each starting from an empty prefix cache, every request
in order. One line is printed per request, then one per session, and last:

    agent_replay requests=N cached_tokens=C reusable_tokens=R wasted_tokens=R-C reuse_ratio=C/R

where ``reusable`` is, per request, the longest token prefix (after the chat template) it shares
with any earlier request of its session, and ``cached`` is what the server reported as served
from its prefix cache. Exit status 1 if any request failed or returned a malformed stream.

``--compare`` replays the same folder twice in one invocation, each on its own server: anchor
checkpoints off (``--disable-anchor-checkpoints``, upstream's hybrid cache) and on (the default).
Both servers run side by side and each request is sent to one, then to the other, the order
alternating from request to request, so that a change in the machine's load (another job
starting halfway) falls on both modes alike; ``--sequential`` replays the whole folder with
anchors off, then starts the second server and replays it again (half the memory). It prints
both runs' lines, a per-request table (cached tokens and TTFT in both modes), both summary
lines, and last:

    wasted_tokens_off=X wasted_tokens_on=Y reuse_ratio_off=A reuse_ratio_on=B ...
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import requests

REPO = Path(__file__).resolve().parents[2]
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
    p.add_argument(
        "--traces",
        required=True,
        type=Path,
        help="a session folder (NN.json [+ meta.jsonl]) or a folder of them",
    )
    p.add_argument(
        "--url",
        help="replay against this running server instead of starting one "
        "(e.g. http://127.0.0.1:30000); its prefix cache is flushed per session",
    )
    p.add_argument(
        "--model-arch",
        default="qwen3_next",
        choices=["qwen3_next", "qwen3_moe"],
        help="embedded tiny model to serve when no --url (default: qwen3_next)",
    )
    p.add_argument(
        "--model-path", type=Path, help="serve this model folder instead of the embedded tiny model"
    )
    p.add_argument(
        "--server-args", default="", help="extra launch_server arguments, one shell-quoted string"
    )
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=ar.DEFAULT_MAX_NEW_TOKENS,
        help="cap on generated tokens per request (default %(default)s): lowers each "
        "length field present in a body (" + ", ".join(ar.LENGTH_FIELDS) + ") and "
        "nothing else, since random-weight models rarely stop on their own and "
        "captures ask for up to 32000 tokens; 0 = send the bodies unchanged",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=1800,
        help="seconds to wait for each read of a reply, first byte included",
    )
    p.add_argument(
        "--no-flush", action="store_true", help="do not empty the prefix cache before each session"
    )
    p.add_argument(
        "--compare",
        action="store_true",
        help="replay twice, anchor checkpoints off and on (a server each, requests "
        "interleaved; not with --url)",
    )
    p.add_argument(
        "--sequential",
        action="store_true",
        help="with --compare: the whole replay with anchors off, then with anchors on, one "
        "server at a time (load changes between the two runs then bias the TTFT ratio)",
    )
    args = p.parse_args(argv)
    if args.sequential and not args.compare:
        p.error("--sequential only applies to --compare")
    if args.compare and args.url:
        p.error("--compare starts its own servers (anchors off, then on); drop --url")
    return args


def replay(
    url: str, sessions: list, args: argparse.Namespace, out: Callable[[str], None] = print
) -> list:
    """Replay ``sessions`` against ``url``, printing a line per request and per session."""
    results = []
    for s in sessions:
        sr = ar.replay_session(
            url,
            s,
            args.max_new_tokens,
            args.timeout,
            not args.no_flush,
            on_result=lambda r: out(r.line()),
        )
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
    print(
        f"# server {srv.url} model={model} up in {time.perf_counter() - t0:.0f}s log={srv.log}",
        flush=True,
    )
    try:
        return fn(srv.url)
    finally:
        srv.stop()


# Server flags of the two --compare modes (anchor checkpoints are on by default on hybrid models).
COMPARE_MODES = (("off", ["--disable-anchor-checkpoints"]), ("on", []))


def _ttft(r) -> str:
    return "-" if r.check.ttft_s is None else f"{r.check.ttft_s:.2f}"


def compare_table(off: list, on: list) -> list[str]:
    """Per-request lines of a --compare run: tokens, cached tokens and TTFT (s) in both modes."""
    lines = ["# session file prompt reusable cached_off cached_on ttft_off_s ttft_on_s"]
    for a, b in zip(off, on):
        lines.append(
            f"{a.capture.session} {a.capture.file} prompt={a.check.prompt_tokens} "
            f"reusable={a.reusable_tokens} cached_off={a.cached_tokens} cached_on={b.cached_tokens} "
            f"ttft_off={_ttft(a)} ttft_on={_ttft(b)}"
        )
    return lines


def compare_line(
    off: "ar.ReplaySummary", on: "ar.ReplaySummary", off_ttft: float, on_ttft: float
) -> str:
    """The last line of --compare: its figures as name=value."""
    return (
        f"wasted_tokens_off={off.wasted_tokens} wasted_tokens_on={on.wasted_tokens} "
        f"reuse_ratio_off={off.reuse_ratio:.3f} reuse_ratio_on={on.reuse_ratio:.3f} "
        f"ttft_sum_off={off_ttft:.1f}s ttft_sum_on={on_ttft:.1f}s"
    )


def _run_sequential(args: argparse.Namespace, sessions: list) -> dict:
    """Each mode's results (flattened over sessions), one server after the other."""
    runs = {}
    for mode, extra in COMPARE_MODES:
        print(f"# anchors={mode}", flush=True)
        results = with_server(
            args,
            extra,
            lambda url, mode=mode: replay(
                url, sessions, args, lambda s: print(f"[{mode}] {s}", flush=True)
            ),
        )
        runs[mode] = [r for sr in results for r in sr.results]
    return runs


def replay_interleaved(urls: dict, sessions: list, args: argparse.Namespace) -> dict:
    """Replay ``sessions`` on every server of ``urls`` (mode -> URL) at once: each request goes
    to every mode in turn before the next request is sent, the order rotating by one mode from
    request to request, so slow drifts of the machine's load fall on every mode alike.

    Returns:
        mode -> list of :class:`agent_replay.RequestResult`, in capture order over sessions,
        with ``reusable_tokens`` filled in (from that mode's own prompt ids).
    """
    modes = list(urls)
    runs = {m: [] for m in modes}
    n = 0
    for s in sessions:
        per = {m: [] for m in modes}
        https = {}
        ids = {}
        for m in modes:
            if not args.no_flush:
                ar.flush_cache(urls[m])
            https[m] = requests.Session()
            ids[m] = ar.AnthropicPromptIds(urls[m], args.timeout)
        t0 = time.perf_counter()
        for cap in s.captures:
            order = modes[n % len(modes) :] + modes[: n % len(modes)]
            n += 1
            for m in order:
                res = ar.replay_request(
                    urls[m], cap, args.max_new_tokens, args.timeout, https[m], ids[m]
                )
                res.reusable_tokens = ar.reusable_prefix_len(
                    res.prompt_ids, [r.prompt_ids for r in per[m]]
                )
                per[m].append(res)
                print(f"[{m}] {res.line()}", flush=True)
        wall = time.perf_counter() - t0
        for m in modes:
            https[m].close()
            summary = ar.ReplaySummary.of(per[m])
            print(f"[{m}] " + summary.line(f"session {s.name} wall={wall:.1f}s (both modes)"))
            runs[m].extend(per[m])
    return runs


def _run_interleaved(args: argparse.Namespace, sessions: list) -> dict:
    import server  # test/e2e/server.py

    model = args.model_path or server.ensure_model(args.model_arch)
    servers = {}
    try:
        for mode, extra in COMPARE_MODES:
            t0 = time.perf_counter()
            srv = server.start_server(model, shlex.split(args.server_args) + extra)
            servers[mode] = srv
            print(
                f"# anchors={mode}: server {srv.url} model={model} up in "
                f"{time.perf_counter() - t0:.0f}s log={srv.log}",
                flush=True,
            )
        return replay_interleaved({m: s.url for m, s in servers.items()}, sessions, args)
    finally:
        for srv in servers.values():
            srv.stop()


def main_compare(args: argparse.Namespace, sessions: list) -> int:
    runs = _run_sequential(args, sessions) if args.sequential else _run_interleaved(args, sessions)
    for line in compare_table(runs["off"], runs["on"]):
        print(line)
    summaries = {m: ar.ReplaySummary.of(rs) for m, rs in runs.items()}
    ttft = {m: sum(r.check.ttft_s or 0.0 for r in rs) for m, rs in runs.items()}
    for mode, _ in COMPARE_MODES:
        print(summaries[mode].line(f"anchors={mode} agent_replay"))
    print(compare_line(summaries["off"], summaries["on"], ttft["off"], ttft["on"]), flush=True)
    return 1 if any(s.failed for s in summaries.values()) else 0


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    sessions = ar.discover_sessions(args.traces)
    if args.compare:
        return main_compare(args, sessions)
    results = with_server(
        args, [], lambda url: replay(url, sessions, args, lambda s: print(s, flush=True))
    )
    summary = ar.ReplaySummary.of(r for sr in results for r in sr.results)
    print(summary.line(), flush=True)
    return 1 if summary.failed else 0


if __name__ == "__main__":
    sys.exit(main())
