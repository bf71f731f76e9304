#!/usr/bin/env python
"""CPU-only decode and prefill of the real server on the Qwen3-30B-A3B slice (issue 18), against
upstream's CPU path and, with ``--llama-cpp``, llama.cpp on the same model and threads.

The model: ``python -m sglang.test.tiny_models --shape qwen3-30b-a3b`` (Qwen3-30B-A3B's layer
sizes, 4 layers, random bf16 weights), built once into ``.models/``. Variants (``--variants``),
each a server started with these environment variables:

* ``base``: upstream's CPU path: ``SGLANG_CPU_MOE_BACKEND=native`` (upstream's per-expert
  loop), ``SGLANG_CPU_DENSE_LINEAR_MAX_ROWS=0`` (upstream's linears), ``OMP_WAIT_POLICY`` empty
  (libgomp's default);
* ``executor``: the fork's MoE executor only (the branch point of issue 18);
* ``linears``: ``base`` plus the decode linears on ``dense_linear_cpu`` (patch 0004);
* ``unfused``: ``fork`` with ``SGLANG_CPU_FUSED_NORM=0`` (RMSNorm, q/k norm and rotary as
  upstream's torch ops: the fork before patch 0006);
* ``modules``: ``fork`` with ``SGLANG_CPU_DECODE_LAYERS=0`` (each decode pass through upstream's
  layer loop and modules: the fork before patch 0007);
* ``aten_attn``: ``fork`` with ``SGLANG_CPU_EXTEND_ATTENTION=0`` (extend and decode attention on
  upstream's ATen SDPA paths; compare at a long ``--prompt-len``);
* ``fork``: everything on (executor, decode linears, fused norms, the flat decode layers,
  ``OMP_WAIT_POLICY=PASSIVE``: serve.sh).

Decode tok/s: one greedy stream of ``--new-tokens`` after a ``--prompt-len`` random prompt,
tokens after the first / time from the first streamed chunk to the last; median of
``--repeats``. Prefill tok/s: a fresh random ``--prefill-len`` prompt, one new token,
prompt tokens / request time; median of ``--repeats``. llama.cpp: ``llama-bench -t THREADS -p
PREFILL_LEN -n NEW_TOKENS`` on the bf16 GGUF (benchmark/llama_cpp.py).

Bandwidth limit: the executor's measured read bandwidth (``expert_pool_read_bandwidth``, the
pool's threads, a 1 GiB buffer) over the bytes one decode token reads: every dense weight
(q/k/v/o, router, lm_head) plus the top-k routed experts of each layer (KV and activations
are ignored: < 0.1%). ``limit_share`` = fork decode / that limit.

Interleaved (``--llama-cpp --interleave R``, default 3): the memory bandwidth of a shared VM
moves by tens of percent within minutes (llama.cpp measured 45 and 75 tok/s ten minutes apart
on 2026-12-07), so a fork figure and a llama.cpp figure taken minutes apart can say little.
With the fork's server up (idle: it sleeps), R rounds each take one fork decode stream and
one ``llama-bench -n NEW_TOKENS -r 1`` decode back to back; ``decode_ratio_interleaved`` is
the median of the R per-round ratios (``fork_decode_rounds`` / ``llamacpp_decode_rounds``
list them).

Loaded (``--loaded``): the fork and llama.cpp decode again while one busy-looping process
holds a core (``loaded_decode_ratio`` = fork / llama.cpp).

Last line::

    cpu_decode model=... threads=T fork_decode_tps=... base_decode_tps=... fork_vs_base=...
    limit_tps=... decode_ratio_vs_llamacpp=... limit_share=... prefill_ratio_vs_llamacpp=...
    loaded_decode_ratio=... decode_ratio_interleaved=...

(llama.cpp ratios only with ``--llama-cpp``, the loaded one only with ``--loaded``.)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import requests
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "test" / "e2e"))
sys.path.insert(0, str(REPO / "benchmark"))
sys.path.insert(0, str(REPO / "benchmark" / "expert_cache"))
from bench_decode import stream_decode  # noqa: E402  (the same streamed decode measurement)

SHAPE = "qwen3-30b-a3b"
MODEL = REPO / ".models" / "qwen3-30b-a3b-slice"

BASE_ENV = {
    "SGLANG_CPU_MOE_BACKEND": "native",
    "SGLANG_CPU_DENSE_LINEAR_MAX_ROWS": "0",
    "OMP_WAIT_POLICY": "",
    "SGLANG_CPU_FUSED_NORM": "0",
}
VARIANTS = {
    "base": BASE_ENV,
    "executor": {
        "SGLANG_CPU_DENSE_LINEAR_MAX_ROWS": "0",
        "OMP_WAIT_POLICY": "",
        "SGLANG_CPU_FUSED_NORM": "0",
    },
    "linears": {**BASE_ENV, "SGLANG_CPU_DENSE_LINEAR_MAX_ROWS": "4"},
    "unfused": {"SGLANG_CPU_FUSED_NORM": "0"},
    "modules": {"SGLANG_CPU_DECODE_LAYERS": "0"},
    "aten_attn": {"SGLANG_CPU_EXTEND_ATTENTION": "0"},
    "fork": {},
}
# Small KV and state pools: the benchmark runs one request at a time.
SERVER_ARGS = ["--max-total-tokens", "16384", "--max-mamba-cache-size", "8"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--variants", default="base,linears,fork", help=f"of {','.join(VARIANTS)}")
    p.add_argument("--model-path", type=Path, default=MODEL)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prefill-len", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--interleave",
        type=int,
        default=3,
        help="with --llama-cpp: rounds of one fork and one llama.cpp decode back to back (0: none)",
    )
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama.cpp's -t")
    p.add_argument("--llama-cpp", action="store_true", help="also run llama.cpp (built once)")
    p.add_argument("--loaded", action="store_true", help="also decode with one core busy")
    a = p.parse_args(argv)
    a.variants = [v for v in a.variants.split(",") if v]
    bad = [v for v in a.variants if v not in VARIANTS]
    if bad:
        p.error(f"--variants: unknown {bad}; choose from {list(VARIANTS)}")
    return a


def ensure_model(path: Path) -> Path:
    if not (path / "config.json").exists():
        cmd = [sys.executable, "-m", "sglang.test.tiny_models", "--shape", SHAPE]
        subprocess.run(cmd + ["--out", str(path)], check=True)
    return path


def bytes_per_token(cfg: dict) -> int:
    """Weight bytes (bf16) one decode token reads: dense linears, top-k experts, lm_head."""
    h, hd = cfg["hidden_size"], cfg["head_dim"]
    attn = h * hd * (2 * cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"])
    experts = cfg["num_experts_per_tok"] * 3 * cfg["moe_intermediate_size"] * h
    router = cfg["num_experts"] * h
    layer = attn + experts + router
    return 2 * (cfg["num_hidden_layers"] * layer + cfg["vocab_size"] * h)


def read_bandwidth_gbps() -> float:
    from sgl_kernel_fork.cpu_executor import expert_pool_read_bandwidth

    buf = torch.ones(1 << 30, dtype=torch.uint8)
    expert_pool_read_bandwidth(buf, 1)  # fault the pages in
    return statistics.median(expert_pool_read_bandwidth(buf, 2) for _ in range(3))


def _random_ids(g: torch.Generator, n: int) -> list[int]:
    return torch.randint(10, 30000, (n,), generator=g).tolist()


def decode_tps(url: str, args, seed: int) -> float:
    g = torch.Generator().manual_seed(seed)
    stream_decode(url, _random_ids(g, args.prompt_len), 4)  # warm-up
    rates = []
    for _ in range(args.repeats):
        n, s, _ = stream_decode(url, _random_ids(g, args.prompt_len), args.new_tokens + 1)
        rates.append(n / max(s, 1e-9))
    return statistics.median(rates)


def prefill_tps(url: str, args, seed: int) -> float:
    g = torch.Generator().manual_seed(seed + 1)
    rates = []
    for _ in range(args.repeats):
        ids = _random_ids(g, args.prefill_len)
        t0 = time.perf_counter()
        r = requests.post(
            url + "/generate",
            json={"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 1}},
            timeout=1800,
        )
        r.raise_for_status()
        rates.append(len(ids) / (time.perf_counter() - t0))
    return statistics.median(rates)


class BusyCore:
    """One busy-looping process (another job holding a core) while the context is open."""

    def __enter__(self):
        self.proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        time.sleep(0.5)
        return self

    def __exit__(self, *exc):
        self.proc.kill()
        self.proc.wait()


def interleaved_rounds(url: str, model: Path, args) -> tuple[list[float], list[float]]:
    """``args.interleave`` rounds of one fork decode stream (the server at ``url``) and one
    llama.cpp decode (``llama-bench -p 0 -n new_tokens -r 1``), back to back: (fork tok/s,
    llama.cpp tok/s) per round."""
    import llama_cpp

    llama_cpp.ensure_built()
    gguf = llama_cpp.ensure_gguf(model)
    g = torch.Generator().manual_seed(11)
    fork, lc = [], []
    for _ in range(args.interleave):
        n, s, _ = stream_decode(url, _random_ids(g, args.prompt_len), args.new_tokens + 1)
        fork.append(n / max(s, 1e-9))
        lc.append(llama_cpp.bench(gguf, args.threads, 0, args.new_tokens, repeats=1)["decode"])
    return fork, lc


def loadavg() -> str:
    return Path("/proc/loadavg").read_text().split(" ")[0]


def main(argv=None) -> int:
    import server  # test/e2e/server.py

    args = parse_args(argv)
    model = ensure_model(args.model_path)
    cfg = json.loads((model / "config.json").read_text())
    bpt = bytes_per_token(cfg)
    bw = read_bandwidth_gbps()
    limit = bw * 1e9 / bpt
    print(
        f"model {model.name}: {bpt / 1e6:.0f} MB read per decode token; read bandwidth "
        f"{bw:.1f} GB/s -> limit {limit:.1f} tok/s ({1e3 / limit:.1f} ms/token)  "
        f"[load {loadavg()}]",
        flush=True,
    )
    dec, pre, loaded = {}, {}, {}
    rounds = None
    for name in args.variants:
        srv = server.start_server(model, SERVER_ARGS, env=VARIANTS[name])
        try:
            dec[name] = decode_tps(srv.url, args, seed=7)
            pre[name] = prefill_tps(srv.url, args, seed=7)
            if args.loaded and name == "fork":
                with BusyCore():
                    loaded[name] = decode_tps(srv.url, args, seed=8)
            if args.llama_cpp and args.interleave > 0 and name == "fork":
                rounds = interleaved_rounds(srv.url, model, args)
        finally:
            srv.stop()
        print(
            f"{name:8s} decode {dec[name]:7.2f} tok/s ({1e3 / dec[name]:6.1f} ms/token)  "
            f"prefill {pre[name]:7.1f} tok/s"
            + (f"  loaded decode {loaded[name]:6.2f} tok/s" if name in loaded else "")
            + f"  [load {loadavg()}]",
            flush=True,
        )
    fields = [f"model={model.name}", f"threads={args.threads}"]
    fields += [f"{k}_decode_tps={v:.2f}" for k, v in dec.items()]
    fields += [f"{k}_prefill_tps={v:.1f}" for k, v in pre.items()]
    if "fork" in dec and "base" in dec:
        fields.append(f"fork_vs_base={dec['fork'] / dec['base']:.2f}")
        fields.append(f"fork_prefill_vs_base={pre['fork'] / pre['base']:.2f}")
    fields.append(f"limit_tps={limit:.1f}")
    if args.llama_cpp:
        import llama_cpp

        llama_cpp.ensure_built()
        gguf = llama_cpp.ensure_gguf(model)
        lc = llama_cpp.bench(gguf, args.threads, args.prefill_len, args.new_tokens)
        print(
            f"llama.cpp decode {lc['decode']:7.2f} tok/s  prefill {lc['prefill']:7.1f} tok/s "
            f"(-t {args.threads})  [load {loadavg()}]",
            flush=True,
        )
        fields += [
            f"llamacpp_decode_tps={lc['decode']:.2f}",
            f"llamacpp_prefill_tps={lc['prefill']:.1f}",
        ]
        if "fork" in dec:
            fields.append(f"decode_ratio_vs_llamacpp={dec['fork'] / lc['decode']:.2f}")
        if rounds is not None:
            fork_r, lc_r = rounds
            ratios = [f / c for f, c in zip(fork_r, lc_r)]
            print(
                "interleaved rounds (fork / llama.cpp tok/s): "
                + ", ".join(f"{f:.1f}/{c:.1f}" for f, c in zip(fork_r, lc_r))
            )
            fields += [
                "fork_decode_rounds=" + ",".join(f"{v:.1f}" for v in fork_r),
                "llamacpp_decode_rounds=" + ",".join(f"{v:.1f}" for v in lc_r),
                f"decode_ratio_interleaved={statistics.median(ratios):.2f}",
            ]
        if args.loaded and "fork" in loaded:
            with BusyCore():
                lcl = llama_cpp.bench(gguf, args.threads, 0, args.new_tokens)
            print(f"llama.cpp loaded decode {lcl['decode']:6.2f} tok/s  [load {loadavg()}]")
            fields.append(f"loaded_decode_ratio={loaded['fork'] / lcl['decode']:.2f}")
    if "fork" in dec:
        fields.append(f"limit_share={dec['fork'] / limit:.2f}")
    if args.llama_cpp and "fork" in pre:
        fields.append(f"prefill_ratio_vs_llamacpp={pre['fork'] / lc['prefill']:.2f}")
    fields.append(f"loadavg={loadavg()}")
    print("cpu_decode " + " ".join(fields), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
