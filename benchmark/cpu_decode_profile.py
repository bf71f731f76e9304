#!/usr/bin/env python
"""torch.profiler breakdown of the CPU decode step on the Qwen3-30B-A3B slice (issue 18).

Starts the server of one ``benchmark/cpu_decode.py`` variant (default ``fork``), streams a long
greedy generation and, once it decodes, asks the server's ``/start_profile`` for ``--steps``
forward steps (CPU activity, no stacks, no shapes: the profiler's own cost stays small). The
Chrome trace it writes is read back: on the scheduler's thread (the one with the most ops),
each top-level torch op (not inside another op) is charged its whole duration, grouped by name;
what the step spends outside any op (Python, the scheduler) is the step's wall time minus the
sum. Printed per step, largest first; then the median per step of the host's time between the
step's landmarks (upstream's ``scheduler.run_batch`` and ``step[...]`` annotations, the
``decode_layers_cpu`` pass, the lm_head's ``dense_linear_cpu``): ``run_to_layers`` (run_batch
start to the pass), ``layers_to_lm_head``, ``lm_head_to_run_end`` (logits, sampling) and
``run_end_to_next`` (result processing, receiving, scheduling). The profiler adds a few us per
recorded op to these; then last::

    cpu_decode_profile variant=fork step_ms=... ops_ms=... outside_ops_ms=... ops_per_step=...
    top=<name>:<ms>,...
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

import requests
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "test" / "e2e"))
sys.path.insert(0, str(REPO / "benchmark"))
from cpu_decode import MODEL, SERVER_ARGS, VARIANTS, ensure_model  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--variant", default="fork", choices=list(VARIANTS))
    p.add_argument("--model-path", type=Path, default=MODEL)
    p.add_argument("--steps", type=int, default=8, help="decode steps profiled")
    p.add_argument("--top", type=int, default=25, help="op names printed")
    p.add_argument(
        "--with-stack",
        action="store_true",
        help="record Python frames too (slower steps; for a self-time breakdown of the trace)",
    )
    p.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="another environment variable for the server (repeatable; A/B runs of a knob)",
    )
    a = p.parse_args(argv)
    bad = [kv for kv in a.env if "=" not in kv]
    if bad:
        p.error(f"--env takes NAME=VALUE, got {bad}")
    a.env = dict(kv.split("=", 1) for kv in a.env)
    return a


def breakdown(trace: dict, steps: int) -> tuple[float, dict[str, list[float]], int]:
    """(window ms, {op name: [ms, count]} of top-level ops, op count) on the busiest thread."""
    by_tid = defaultdict(list)
    for e in trace["traceEvents"]:
        if e.get("ph") == "X" and e.get("cat") == "cpu_op":
            by_tid[(e["pid"], e["tid"])].append(e)
    events = max(by_tid.values(), key=len)
    events.sort(key=lambda e: (e["ts"], -e["dur"]))
    per_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    end_top = -1.0
    n = 0
    for e in events:
        if e["ts"] >= end_top:  # not inside the previous top-level op
            per_name[e["name"]][0] += e["dur"] / 1e3
            per_name[e["name"]][1] += 1
            end_top = e["ts"] + e["dur"]
            n += 1
    window = (max(e["ts"] + e["dur"] for e in events) - events[0]["ts"]) / 1e3
    return window, per_name, n


def phases(trace: dict) -> dict[str, float]:
    """Median ms per step between the step's landmarks (see the module docstring); {} when the
    trace has no flat decode pass (another variant)."""
    ev = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    runs = sorted((e for e in ev if e["name"] == "scheduler.run_batch"), key=lambda e: e["ts"])
    passes = [e for e in ev if e["name"] == "sgl_kernel::decode_layers_cpu"]
    linears = [e for e in ev if e["name"] == "sgl_kernel::dense_linear_cpu"]
    out = defaultdict(list)
    for run, nxt in zip(runs, runs[1:]):
        a, b = run["ts"], run["ts"] + run["dur"]
        p = [e for e in passes if a <= e["ts"] < b]
        if len(p) != 1:
            continue
        p_end = p[0]["ts"] + p[0]["dur"]
        lm = [e for e in linears if p_end <= e["ts"] < b]
        if not lm:
            continue
        lm_end = lm[-1]["ts"] + lm[-1]["dur"]
        out["run_to_layers"].append(p[0]["ts"] - a)
        out["layers_to_lm_head"].append(lm[0]["ts"] - p_end)
        out["lm_head_to_run_end"].append(b - lm_end)
        out["run_end_to_next"].append(nxt["ts"] - b)
    return {k: statistics.median(v) / 1e3 for k, v in out.items()}


def main(argv=None) -> int:
    import server  # test/e2e/server.py

    args = parse_args(argv)
    model = ensure_model(args.model_path)
    out = Path(tempfile.mkdtemp(prefix="cpu-decode-profile-"))
    srv = server.start_server(model, SERVER_ARGS, env={**VARIANTS[args.variant], **args.env})
    try:
        g = torch.Generator().manual_seed(3)
        ids = torch.randint(10, 30000, (64,), generator=g).tolist()
        body = {
            "input_ids": ids,
            "sampling_params": {"temperature": 0, "max_new_tokens": 40 * args.steps + 64},
        }
        gen = threading.Thread(
            target=requests.post, args=(srv.url + "/generate",), kwargs={"json": body}
        )
        gen.start()
        time.sleep(3.0)  # past the prefill, decoding
        r = requests.post(
            srv.url + "/start_profile",
            json={
                "output_dir": str(out),
                "num_steps": args.steps,
                "activities": ["CPU"],
                "with_stack": args.with_stack,
                "record_shapes": False,
            },
            timeout=600,
        )
        r.raise_for_status()
        gen.join()
    finally:
        srv.stop()
    traces = sorted(out.glob("*.trace.json.gz"))
    if not traces:
        raise RuntimeError(f"no trace written to {out}")
    with gzip.open(traces[-1], "rt") as f:
        trace = json.load(f)
    window, per_name, n = breakdown(trace, args.steps)
    between = phases(trace)
    step = window / args.steps
    ops = sum(v[0] for v in per_name.values()) / args.steps
    rows = sorted(per_name.items(), key=lambda kv: -kv[1][0])
    print(f"{traces[-1]}: {args.steps} steps, {step:.2f} ms per step")
    for name, (ms, cnt) in rows[: args.top]:
        print(f"  {ms / args.steps:7.3f} ms  {cnt / args.steps:6.1f}x  {name}")
    if between:
        print(
            "host time between landmarks, ms per step (median): "
            + ", ".join(f"{k} {v:.3f}" for k, v in between.items())
        )
    top = ",".join(f"{k}:{v[0] / args.steps:.2f}" for k, v in rows[:6])
    print(
        f"cpu_decode_profile variant={args.variant} step_ms={step:.2f} ops_ms={ops:.2f} "
        f"outside_ops_ms={step - ops:.2f} ops_per_step={n / args.steps:.0f} top={top}"
        + "".join(f" {k}_ms={v:.3f}" for k, v in between.items())
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
