#!/usr/bin/env python
"""Cost of looking for anchors in generated text: the scheduler asks the planner after every
decode step whether the tokens fed so far end at an anchor (``AnchorPlanner.decode_anchor``).

The generated text is every assistant turn of the trace folders, written as a Qwen-family model
emits it (``<think>`` reasoning ``</think>``, content, ``<tool_call>`` JSON ``</tool_call>``,
``<|im_end|>``) and tokenized with the embedded tokenizer. Each turn is stepped through token by
token, as decode feeds it, once with the planner's check (an O(1) byte filter on the two tokens
around the boundary, then a scan of ``lookback`` tokens) and once with the naive check in the
same run (a scan of the same window at every step). No server: this is the per-step, per-request
host cost the hook adds; a save itself is one state copy and one tree insert (see the e2e test).
Prints, last:

    anchor_decode turns=T steps=N anchors=A saves=S us_per_step=.. us_per_step_naive=.. naive_ratio=..
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "test" / "e2e"))


def _text(part) -> str:
    if isinstance(part, str):
        return part
    if isinstance(part, list):
        return "".join(p.get("text", "") for p in part if isinstance(p, dict))
    return ""


def generated_turns(traces: Path) -> list[str]:
    """Each distinct assistant turn of the captured requests, in a Qwen-family model's format."""
    seen, out = set(), []
    for f in sorted(traces.rglob("*.json")):
        for m in json.loads(f.read_text()).get("messages", []):
            if m.get("role") != "assistant":
                continue
            think, text, calls = m.get("reasoning_content") or "", _text(m.get("content")), []
            for c in m.get("tool_calls") or []:
                fn = c.get("function", {})
                calls.append({"name": fn.get("name"), "arguments": fn.get("arguments")})
            if isinstance(m.get("content"), list):  # Anthropic blocks
                for b in m["content"]:
                    if b.get("type") == "thinking":
                        think += b.get("thinking", "")
                    elif b.get("type") == "tool_use":
                        calls.append({"name": b.get("name"), "arguments": b.get("input")})
            turn = f"<think>\n{think}\n</think>\n\n{text}"
            for c in calls:
                turn += "\n<tool_call>\n" + json.dumps(c) + "\n</tool_call>"
            turn += "<|im_end|>"
            if turn not in seen:
                seen.add(turn)
                out.append(turn)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--traces", type=Path, default=REPO.parent / "shared" / "traces")
    ap.add_argument("--min-gap", type=int, default=64, help="--anchor-checkpoint-min-gap")
    ap.add_argument("--reps", type=int, default=5, help="passes over all turns (best taken)")
    args = ap.parse_args()

    from server import ensure_model
    from transformers import AutoTokenizer

    from sglang.srt.mem_cache.anchor_checkpoints.markers import AnchorScanner
    from sglang.srt.mem_cache.anchor_checkpoints.planner import AnchorPlanner

    tok = AutoTokenizer.from_pretrained(ensure_model("qwen3_next"))
    scanner = AnchorScanner.from_tokenizer(tok)
    planner = AnchorPlanner(scanner, args.min_gap)
    prompt = tok.encode("<|im_start|>assistant\n", add_special_tokens=False)
    turns = [tok.encode(t, add_special_tokens=False) for t in generated_turns(args.traces)]
    if not turns:
        sys.exit(f"no assistant turns under {args.traces}")

    def planner_pass() -> tuple[int, int]:
        steps = saves = 0
        for gen in turns:
            last = len(prompt)
            req = types.SimpleNamespace(
                origin_input_ids=prompt,
                output_ids=[gen[0]],
                kv=types.SimpleNamespace(cache_protected_len=last),
            )
            for k in range(2, len(gen) + 1):  # step k feeds output k-1 and appends output k
                req.output_ids.append(gen[k - 1])
                fed = len(prompt) + k - 1
                steps += 1
                if planner.decode_anchor(req, fed):
                    saves += 1
                    req.kv.cache_protected_len = fed
        return steps, saves

    def naive_pass() -> int:
        found = 0
        for gen in turns:
            ids = prompt + gen
            for fed in range(len(prompt) + 1, len(ids)):
                lo = max(0, fed - scanner.lookback)
                pos = scanner.scan(ids[lo : fed + 1], fed - lo, fed - lo + 1)
                found += bool(len(pos)) and int(pos[0]) == fed - lo
        return found

    best_p = best_n = float("inf")
    for _ in range(args.reps):
        t0 = time.perf_counter()
        steps, saves = planner_pass()
        best_p = min(best_p, time.perf_counter() - t0)
        t0 = time.perf_counter()
        anchors = naive_pass()
        best_n = min(best_n, time.perf_counter() - t0)
    us, us_naive = best_p / steps * 1e6, best_n / steps * 1e6
    print(
        f"anchor_decode turns={len(turns)} steps={steps} anchors={anchors} saves={saves} "
        f"us_per_step={us:.2f} us_per_step_naive={us_naive:.2f} naive_ratio={us_naive / us:.1f}"
    )


if __name__ == "__main__":
    main()
