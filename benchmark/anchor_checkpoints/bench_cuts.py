#!/usr/bin/env python
"""Cost of anchor checkpoints in a cold prefill: a prompt full of markers on three servers, one
after the other in the same run: anchors off (upstream), cut mode (prefill chunks end at
anchors) and emit mode (``--anchor-checkpoint-mode emit``: the states are written inside the
ordinary passes).

The prompt is chat-shaped (``<|im_start|>``/``<|im_end|>`` turns with ``<think>`` and
``<tool_call>`` blocks every ``--block`` tokens). On each server it is prefilled cold (cache
flushed) ``--reps`` times after a warm-up; one generated token, so time to first token is the
prefill time. The best TTFT of each server is reported (the least disturbed by other work), the
median beside it, and the load average at each server's start.

``passes`` is what the server counted: the growth of ``sglang:anchor_prefill_passes_total``
(``--enable-metrics``) over a cold prefill; with anchors off there is no anchor cache to count,
so upstream's count is printed, ``ceil(tokens / 4096)`` (the CPU server's chunk size).
``saved`` is the growth of ``sglang:anchor_checkpoints_saved_total`` (anchor states stored).
Prints one line per run and last:

    ttft_ratio=EMIT/OFF ttft_ratio_cut=CUT/OFF tokens=L passes_off=.. passes_cut=.. passes_emit=.. saved_cut=.. saved_emit=.. ttft_off=.. ttft_cut=.. ttft_emit=.. ...
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import statistics
import sys
import time
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "test" / "e2e"))


def prompts(tok, tokens: int, block: int) -> tuple[list[int], list[int]]:
    """(marker prompt, plain prompt) of ``tokens`` tokens each."""
    ids = {
        t: tok.convert_tokens_to_ids(t)
        for t in (
            "<|im_start|>",
            "<|im_end|>",
            "<think>",
            "</think>",
            "<tool_call>",
            "</tool_call>",
        )
    }
    words = tok.encode(
        " alpha beta gamma delta file line value agent tool result", add_special_tokens=False
    )
    body = lambda n: [words[i % len(words)] for i in range(n)]  # noqa: E731
    marked: list[int] = []
    while len(marked) < tokens:
        q = max(block // 3, 1)
        marked += [
            ids["<|im_start|>"],
            *body(q),
            ids["<think>"],
            *body(q),
            ids["</think>"],
            ids["<tool_call>"],
            *body(q),
            ids["</tool_call>"],
            ids["<|im_end|>"],
        ]
    marked = marked[:tokens]
    return marked, body(tokens)


def counter(url: str, name: str) -> float:
    """A counter of the server's ``/metrics`` (0 before its first increment)."""
    text = requests.get(url + "/metrics", timeout=60).text
    m = re.search(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


COUNTERS = {
    "passes": "sglang:anchor_prefill_passes_total",
    "saved": "sglang:anchor_checkpoints_saved_total",
}


def ttft(url: str, ids: list[int]) -> tuple[float, dict[str, int]]:
    """(time to first token of a cold prefill of ``ids``, growth of ``COUNTERS`` over it)."""
    from sglang.test.agent_replay import flush_cache

    flush_cache(url)  # retried while the server finishes the previous request
    before = {k: counter(url, n) for k, n in COUNTERS.items()}
    t0 = time.perf_counter()
    r = requests.post(
        url + "/generate",
        json={"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 1}},
        timeout=1800,
    )
    r.raise_for_status()
    took = time.perf_counter() - t0
    assert r.json()["meta_info"]["cached_tokens"] == 0
    return took, {k: round(counter(url, n) - before[k]) for k, n in COUNTERS.items()}


MODES = {
    "off": ["--disable-anchor-checkpoints"],
    "cut": ["--anchor-checkpoint-mode", "cut"],
    "emit": ["--anchor-checkpoint-mode", "emit"],
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--block", type=int, default=96, help="tokens per marker-delimited turn")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--min-gap", type=int, default=64, help="--anchor-checkpoint-min-gap")
    ap.add_argument("--server-args", default="")
    args = ap.parse_args(argv)

    import server  # test/e2e/server.py
    from transformers import AutoTokenizer

    model = server.ensure_model("qwen3_next")
    tok = AutoTokenizer.from_pretrained(model)
    marked, _ = prompts(tok, args.tokens, args.block)
    times, counts, loads = {}, {}, {}
    for mode, flags in MODES.items():
        loads[mode] = os.getloadavg()[0]
        srv = server.start_server(
            model,
            shlex.split(args.server_args)
            + flags
            + ["--anchor-checkpoint-min-gap", str(args.min_gap), "--enable-metrics"],
        )
        try:
            ttft(srv.url, marked[:200])  # warm up
            times[mode], counts[mode] = [], []
            for rep in range(args.reps):
                t, c = ttft(srv.url, marked)
                times[mode].append(t)
                counts[mode].append(c)
                print(
                    f"mode={mode} rep={rep} tokens={len(marked)} ttft={t:.3f}s {c} "
                    f"load1={os.getloadavg()[0]:.2f}",
                    flush=True,
                )
        finally:
            srv.stop()
    upstream_passes = -(-len(marked) // 4096)
    got = {}
    for mode in MODES:
        for k in COUNTERS:
            vals = {c[k] for c in counts[mode]}
            if len(vals) > 1:  # cold prefills of one prompt behave alike; a differing rep is shown
                print(f"# {mode}: {k} differ between reps: {[c[k] for c in counts[mode]]}")
            got[f"{k}_{mode}"] = statistics.median(c[k] for c in counts[mode])
    got["passes_off"] = upstream_passes  # no anchor cache to count them: upstream's chunking
    best = {m: min(t) for m, t in times.items()}
    med = {m: statistics.median(t) for m, t in times.items()}
    print(
        f"ttft_ratio={best['emit'] / best['off']:.3f} ttft_ratio_cut={best['cut'] / best['off']:.3f} "
        f"tokens={len(marked)} "
        + " ".join(f"{k}={v:g}" for k, v in got.items() if not k.startswith("saved_off"))
        + " "
        + " ".join(f"ttft_{m}={best[m]:.3f}s" for m in MODES)
        + " "
        + " ".join(f"median_ttft_{m}={med[m]:.3f}s" for m in MODES)
        + " "
        + " ".join(f"load1_{m}={loads[m]:.2f}" for m in MODES)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
