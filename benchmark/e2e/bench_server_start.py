#!/usr/bin/env python
"""Server start on a CPU machine: scheduler and detokenizer forked (the default since patch
0012) against spawned (upstream's, ``SGLANG_SUBPROCESS_START_METHOD=spawn``), same run.

Each round starts the server with each method in turn (the order alternates between rounds) on
the embedded tiny model with the end-to-end tests' flags, times launch to the first
``/health_generate`` answer (``ready_s``: the test fixtures' wait) and the stop, and checks that
both answer a greedy request with the same tokens. Prints one line per start, then last:

    server_start ready_fork_s=... ready_spawn_s=... start_ratio=fork/spawn stop_s=... loadavg=...

(medians over rounds; ``start_ratio`` below 1 means forking starts sooner).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "test" / "e2e"))
from server import ensure_model, start_server  # noqa: E402

FLAGS = ["--max-total-tokens", "65536", "--max-running-requests", "16"]


def greedy(url: str) -> list:
    body = {
        "text": "The capital of France is",
        "sampling_params": {"max_new_tokens": 8, "temperature": 0},
        "return_logprob": True,
    }
    out = requests.post(url + "/generate", json=body, timeout=120).json()
    return [t[1] for t in out["meta_info"]["output_token_logprobs"]]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--arch", default="qwen3_moe", help="tiny model (test/e2e/server.py)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    model = ensure_model(args.arch)
    ready: dict[str, list[float]] = {"fork": [], "spawn": []}
    stops: list[float] = []
    tokens: dict[str, list] = {}
    load0 = os.getloadavg()[0]
    for r in range(args.rounds):
        for method in ("fork", "spawn") if r % 2 == 0 else ("spawn", "fork"):
            t0 = time.perf_counter()
            srv = start_server(model, FLAGS, env={"SGLANG_SUBPROCESS_START_METHOD": method})
            ready[method].append(time.perf_counter() - t0)
            tokens.setdefault(method, greedy(srv.url))
            if greedy(srv.url) != tokens["fork" if "fork" in tokens else method]:
                print(f"{method}: greedy tokens differ from the forked server's", file=sys.stderr)
                return 1
            t1 = time.perf_counter()
            srv.stop()
            stops.append(time.perf_counter() - t1)
            print(
                f"round={r} method={method} ready_s={ready[method][-1]:.2f} "
                f"stop_s={stops[-1]:.2f} loadavg={os.getloadavg()[0]:.2f}",
                flush=True,
            )
    fork, spawn = statistics.median(ready["fork"]), statistics.median(ready["spawn"])
    print(
        f"server_start ready_fork_s={fork:.2f} ready_spawn_s={spawn:.2f} "
        f"start_ratio={fork / spawn:.3f} stop_s={statistics.median(stops):.2f} "
        f"loadavg={load0:.2f}-{os.getloadavg()[0]:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
