#!/usr/bin/env python
"""Cost of anchor cuts: cold prefill of a prompt full of markers vs the same-length prompt
without markers, on one server with anchor checkpoints on (default flags of ``make serve``).

The marker prompt is chat-shaped (``<|im_start|>``/``<|im_end|>`` turns with ``<think>`` and
``<tool_call>`` blocks every ``--block`` tokens); the plain prompt has the same length and no
marker, so the planner cuts only the first. Each is prefilled cold (cache flushed) ``--reps``
times, alternating; one generated token, so time to first token is the prefill time.

``cuts`` is what the server counted: the growth of its ``sglang:anchor_checkpoints_saved_total``
counter (``--enable-metrics``) over each cold prefill, less any decode saves (one generated
token: none), i.e. the prefill chunks that ended at an anchor. ``predicted_cuts`` is the
planner's own prediction for the marker prompt, replayed here over 4096-token chunks (the CPU
server's chunk size); the two differ if the server chunks differently. Prints one line per run
and last:

    anchor_cuts tokens=L cuts=C predicted_cuts=P plain_cuts=0 ttft_plain=.. ttft_cuts=.. prefill_tok_s_plain=.. prefill_tok_s_cuts=.. ms_per_cut=..
"""

from __future__ import annotations

import argparse
import re
import shlex
import statistics
import sys
import time
import types
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


def anchor_saves(url: str) -> float:
    """The server's anchor checkpoints saved at prefill chunk ends so far (counted by the
    scheduler, ``--enable-metrics``): ``saved_total`` less ``saved_decode_total``."""
    text = requests.get(url + "/metrics", timeout=60).text
    got = {}
    for name in ("saved", "saved_decode"):
        m = re.search(
            rf"^sglang:anchor_checkpoints_{name}_total(?:\{{[^}}]*\}})? (\S+)$", text, re.M
        )
        got[name] = float(m.group(1)) if m else 0.0  # a counter appears at its first increment
    return got["saved"] - got["saved_decode"]


def ttft(url: str, ids: list[int]) -> tuple[float, int]:
    """(time to first token of a cold prefill of ``ids``, anchor cuts the server counted)."""
    from sglang.test.agent_replay import flush_cache

    flush_cache(url)  # retried while the server finishes the previous request
    before = anchor_saves(url)
    t0 = time.perf_counter()
    r = requests.post(
        url + "/generate",
        json={"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 1}},
        timeout=1800,
    )
    r.raise_for_status()
    took = time.perf_counter() - t0
    assert r.json()["meta_info"]["cached_tokens"] == 0
    return took, round(anchor_saves(url) - before)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--block", type=int, default=96, help="tokens per marker-delimited turn")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--min-gap", type=int, default=64, help="--anchor-checkpoint-min-gap")
    ap.add_argument("--server-args", default="")
    args = ap.parse_args(argv)

    import server  # test/e2e/server.py
    from transformers import AutoTokenizer

    from sglang.srt.mem_cache.anchor_checkpoints.markers import AnchorScanner
    from sglang.srt.mem_cache.anchor_checkpoints.planner import AnchorPlanner

    model = server.ensure_model("qwen3_next")
    tok = AutoTokenizer.from_pretrained(model)
    marked, plain = prompts(tok, args.tokens, args.block)
    planner = AnchorPlanner(AnchorScanner.from_tokenizer(tok), args.min_gap)
    req = types.SimpleNamespace(full_untruncated_fill_ids=marked, multimodal_inputs=None)
    predicted, pos = 0, 0
    while pos < len(marked):  # the server's chunks: 4096 on CPU
        n = min(4096, len(marked) - pos)
        nxt = planner.next_cut(req, pos, n)
        predicted += nxt is not None
        pos = nxt if nxt is not None else pos + n

    srv = server.start_server(
        model,
        shlex.split(args.server_args)
        + ["--anchor-checkpoint-min-gap", str(args.min_gap), "--enable-metrics"],
    )
    try:
        ttft(srv.url, plain[:200])  # warm up
        times = {"plain": [], "cuts": []}
        counted = {"plain": [], "cuts": []}
        for rep in range(args.reps):
            for name, ids in (("plain", plain), ("cuts", marked)):
                t, c = ttft(srv.url, ids)
                times[name].append(t)
                counted[name].append(c)
                print(
                    f"rep={rep} prompt={name} tokens={len(ids)} ttft={t:.2f}s cuts={c}", flush=True
                )
    finally:
        srv.stop()
    # Cold prefills of one prompt are cut alike; a rep that differs is reported, not hidden.
    cuts, plain_cuts = statistics.median(counted["cuts"]), statistics.median(counted["plain"])
    if len(set(counted["cuts"])) > 1 or len(set(counted["plain"])) > 1:
        print(f"# counted cuts differ between reps: {counted}", flush=True)
    # The best run of each is the least disturbed by other work on the machine.
    plain_t, cut_t = min(times["plain"]), min(times["cuts"])
    med_p, med_c = statistics.median(times["plain"]), statistics.median(times["cuts"])
    print(
        f"anchor_cuts tokens={args.tokens} cuts={cuts:g} predicted_cuts={predicted} "
        f"plain_cuts={plain_cuts:g} ttft_plain={plain_t:.2f}s ttft_cuts={cut_t:.2f}s "
        f"prefill_tok_s_plain={args.tokens / plain_t:.0f} prefill_tok_s_cuts={args.tokens / cut_t:.0f} "
        f"ms_per_cut={(cut_t - plain_t) / cuts * 1000 if cuts else float('nan'):.0f} "
        f"median_ttft_plain={med_p:.2f}s median_ttft_cuts={med_c:.2f}s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
