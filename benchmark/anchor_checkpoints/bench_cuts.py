#!/usr/bin/env python
"""Cost of anchor cuts: cold prefill of a prompt full of markers vs the same-length prompt
without markers, on one server with anchor checkpoints on (default flags of ``make serve``).

The marker prompt is chat-shaped (``<|im_start|>``/``<|im_end|>`` turns with ``<think>`` and
``<tool_call>`` blocks every ``--block`` tokens); the plain prompt has the same length and no
marker, so the planner cuts only the first. Each is prefilled cold (cache flushed) ``--reps``
times, alternating; one generated token, so time to first token is the prefill time. Prints one
line per run and last:

    anchor_cuts tokens=L cuts=C ttft_plain=.. ttft_cuts=.. prefill_tok_s_plain=.. prefill_tok_s_cuts=.. ms_per_cut=..
"""
from __future__ import annotations

import argparse
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
    ids = {t: tok.convert_tokens_to_ids(t) for t in
           ("<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>")}
    words = tok.encode(" alpha beta gamma delta file line value agent tool result", add_special_tokens=False)
    body = lambda n: [words[i % len(words)] for i in range(n)]  # noqa: E731
    marked: list[int] = []
    while len(marked) < tokens:
        q = max(block // 3, 1)
        marked += [ids["<|im_start|>"], *body(q), ids["<think>"], *body(q), ids["</think>"],
                   ids["<tool_call>"], *body(q), ids["</tool_call>"], ids["<|im_end|>"]]
    marked = marked[:tokens]
    return marked, body(tokens)


def ttft(url: str, ids: list[int]) -> float:
    from sglang.test.agent_replay import flush_cache

    flush_cache(url)  # retried while the server finishes the previous request
    t0 = time.perf_counter()
    r = requests.post(url + "/generate", json={
        "input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 1}}, timeout=1800)
    r.raise_for_status()
    assert r.json()["meta_info"]["cached_tokens"] == 0
    return time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    cuts, pos = 0, 0
    while pos < len(marked):  # the server's chunks: 4096 on CPU
        n = min(4096, len(marked) - pos)
        nxt = planner.next_cut(req, pos, n)
        cuts += nxt is not None
        pos = nxt if nxt is not None else pos + n

    srv = server.start_server(model, shlex.split(args.server_args)
                              + ["--anchor-checkpoint-min-gap", str(args.min_gap)])
    try:
        ttft(srv.url, plain[:200])  # warm up
        times = {"plain": [], "cuts": []}
        for rep in range(args.reps):
            for name, ids in (("plain", plain), ("cuts", marked)):
                t = ttft(srv.url, ids)
                times[name].append(t)
                print(f"rep={rep} prompt={name} tokens={len(ids)} ttft={t:.2f}s", flush=True)
    finally:
        srv.stop()
    # The best run of each is the least disturbed by other work on the machine.
    plain_t, cut_t = min(times["plain"]), min(times["cuts"])
    med_p, med_c = statistics.median(times["plain"]), statistics.median(times["cuts"])
    print(
        f"anchor_cuts tokens={args.tokens} cuts={cuts} ttft_plain={plain_t:.2f}s ttft_cuts={cut_t:.2f}s "
        f"prefill_tok_s_plain={args.tokens / plain_t:.0f} prefill_tok_s_cuts={args.tokens / cut_t:.0f} "
        f"ms_per_cut={(cut_t - plain_t) / max(cuts, 1) * 1000:.0f} "
        f"median_ttft_plain={med_p:.2f}s median_ttft_cuts={med_c:.2f}s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
