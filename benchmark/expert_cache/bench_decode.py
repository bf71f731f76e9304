#!/usr/bin/env python
"""Decode tokens/s of the real server with the expert-slot cache at 25%, 50% and 100% of the
routed-expert pool, against the stock MoE path, in one run.

A server per variant is started on the tiny model (default: the hybrid Qwen3-Next), and for
each of ``--batch`` concurrent requests a prompt of ``--prompt-len`` random tokens is
decoded greedily for ``--new-tokens`` tokens, streamed. Decode rate = tokens after the first
(server-counted) / time from the first streamed chunk to the last (prefill excluded), summed
over the batch; median of ``--repeats`` runs, taken round robin over the variants' servers
(all started first), so the machine's load drifts over every variant alike. Printed: a line
per variant, then last

    expert_cache_decode model=... batch=B stock_tps=... c25_tps=... c50_tps=... c100_tps=... c25_ratio=... c50_ratio=... c100_ratio=...

(ratios against stock, measured in the same run). On this CPU-only machine the cache's
"device" is the host too, so the figure measures the cache's control and copy overhead and
our CPU expert kernel against upstream's torch MoE, not a PCIe trade-off.

``--formats bf16,fp8,nvfp4,mxfp4`` runs the four variants on the tiny model of each expert
format instead (:data:`FORMAT_MODELS`: Qwen3-MoE in bf16, in Qwen's block-FP8 layout and in
ModelOpt NVFP4, and gpt-oss with its MXFP4 experts as released; built into ``.models/`` when
missing), a line per format, and last

    expert_cache_decode_formats batch=B bf16_stock_tps=... bf16_c25_ratio=... ... mxfp4_c100_ratio=...

Stock gpt-oss on a CPU is upstream's torch MoE over experts dequantized to bf16 at load
(``mxfp4_cpu.py``); with the cache its MXFP4 bytes stay MXFP4 in the host pool and the slots.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

import requests
import torch

from sglang.srt.layers.moe.expert_cache.control import MissPolicy

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "test" / "e2e"))

# Expert format -> the key of the tiny model (test/e2e/server.py DEFAULT_MODELS) in it.
FORMAT_MODELS = {
    "bf16": "qwen3_moe",
    "fp8": "qwen3_moe_fp8",
    "nvfp4": "qwen3_moe_nvfp4",
    "mxfp4": "gpt_oss",
}
VARIANTS = [
    ("stock", []),
    ("c25", ["--enable-expert-cache", "--expert-cache-size", "25%"]),
    ("c50", ["--enable-expert-cache", "--expert-cache-size", "50%"]),
    ("c100", ["--enable-expert-cache", "--expert-cache-size", "100%"]),
]


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model-arch", default="qwen3_next", choices=["qwen3_next", "qwen3_moe"])
    p.add_argument("--model-path", type=Path, help="model folder (default: the tiny model)")
    p.add_argument("--batch", type=int, default=1, help="concurrent requests")
    p.add_argument("--prompt-len", type=int, default=64, help="tokens per prompt")
    p.add_argument("--new-tokens", type=int, default=128, help="tokens decoded per request")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--policy", default="qstar", choices=[m.name.lower() for m in MissPolicy])
    p.add_argument("--server-args", default="", help="extra launch arguments for every variant")
    p.add_argument(
        "--formats",
        default="",
        help=f"comma-separated expert formats ({','.join(FORMAT_MODELS)}): their tiny models "
        "instead of --model-arch / --model-path",
    )
    args = p.parse_args(argv)
    args.formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    unknown = [f for f in args.formats if f not in FORMAT_MODELS]
    if unknown:
        p.error(f"unknown --formats {unknown}; choose from {', '.join(FORMAT_MODELS)}")
    return args


def stream_decode(url: str, ids: list[int], n: int) -> tuple[int, float, float]:
    """Stream a greedy generation of ``n`` tokens; return (tokens after the first, seconds
    from the first streamed token to the last: decode only, prefill excluded, and the largest
    gap between two streamed chunks in seconds)."""
    r = requests.post(
        url + "/generate",
        json={
            "input_ids": ids,
            "sampling_params": {"temperature": 0, "max_new_tokens": n, "ignore_eos": True},
            "stream": True,
        },
        timeout=1800,
        stream=True,
    )
    r.raise_for_status()
    first = last = None
    gap = 0.0
    for line in r.iter_lines():
        if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
            continue
        done = json.loads(line[5:])["meta_info"]["completion_tokens"]
        now = time.perf_counter()
        if last is not None:
            gap = max(gap, now - last[1])
        if first is None:
            first = (done, now)
        last = (done, now)
    # A chunk may carry several tokens: count tokens, not chunks.
    return last[0] - first[0], last[1] - first[1], gap


def decode_run(url: str, args, g: torch.Generator) -> float:
    """One run: aggregate decode tokens/s of ``args.batch`` concurrent streams of fresh
    prompts (so the prefix cache never serves them)."""
    prompts = [
        torch.randint(10, 30000, (args.prompt_len,), generator=g).tolist()
        for _ in range(args.batch)
    ]
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        runs = list(pool.map(lambda ids: stream_decode(url, ids, args.new_tokens + 1)[:2], prompts))
    tokens = sum(n for n, _ in runs)
    seconds = max(t for _, t in runs)
    return tokens / max(seconds, 1e-9)


def run_variants(model: Path, args, label: str = "") -> dict:
    """Median decode tokens/s of each of :data:`VARIANTS` on ``model`` over ``args.repeats``
    runs. Every variant's server is started first (idle servers sleep: ``--sleep-on-idle``),
    then the runs go round robin over the variants, so a change of the machine's load hits
    each variant alike instead of the ones measured at that moment; prints a line per
    variant."""
    import server  # test/e2e/server.py

    servers, rates = {}, {}
    try:
        for name, extra in VARIANTS:
            if extra:
                extra = extra + ["--expert-cache-policy", args.policy]
            srv = server.start_server(model, shlex.split(args.server_args) + extra)
            servers[name] = (srv, extra)
        gens = {name: torch.Generator().manual_seed(7) for name in servers}
        for name, (srv, _) in servers.items():  # warm-up: 8 tokens each
            stream_decode(srv.url, torch.randint(10, 30000, (args.prompt_len,)).tolist(), 8)
            rates[name] = []
        for _ in range(args.repeats):
            for name, (srv, _) in servers.items():
                rates[name].append(decode_run(srv.url, args, gens[name]))
    finally:
        for srv, _ in servers.values():
            srv.stop()
    tps = {name: statistics.median(r) for name, r in rates.items()}
    for name, (_, extra) in servers.items():
        print(
            f"{label}{name:6s} decode {tps[name]:8.1f} tok/s  ({' '.join(extra) or 'stock MoE'})",
            flush=True,
        )
    return tps


def main(argv=None) -> int:
    import server  # test/e2e/server.py

    args = parse_args(argv)
    if args.formats:
        fields = [f"batch={args.batch}"]
        for fmt in args.formats:
            model = server.ensure_model(FORMAT_MODELS[fmt])
            tps = run_variants(model, args, label=f"{fmt:6s} {model.name}: ")
            fields += [f"{fmt}_stock_tps={tps['stock']:.1f}"]
            fields += [
                f"{fmt}_{k}_ratio={v / tps['stock']:.2f}" for k, v in tps.items() if k != "stock"
            ]
        print("expert_cache_decode_formats " + " ".join(fields), flush=True)
        return 0
    model = args.model_path or server.ensure_model(args.model_arch)
    tps = run_variants(model, args)
    fields = [f"model={model.name}", f"batch={args.batch}"]
    fields += [f"{k}_tps={v:.1f}" for k, v in tps.items()]
    fields += [f"{k}_ratio={v / tps['stock']:.2f}" for k, v in tps.items() if k != "stock"]
    print("expert_cache_decode " + " ".join(fields), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
