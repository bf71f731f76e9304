"""CPU executor benchmark: decode bandwidth and prefill throughput.

Qwen3-30B-A3B expert shapes (hidden 2048, expert intermediate 768, bf16: 9.4 MB
per expert). A bank of --experts experts (default 256, 2.4 GB, far beyond the
last-level cache) is filled once; each decode step routes --batch-max tokens x
top-8 to experts not touched for a whole cycle of the bank (consecutive blocks,
all distinct), so every step streams its experts from memory.

Measured in the same run, with the same thread count (--threads, default one
per physical core; torch.set_num_threads is set to the same count):

* read: sequential read bandwidth of the pool threads over the bank (one
  contiguous slice per thread, ``expert_pool_read_bandwidth``, C++ SIMD loads);
* ours: ``moe_experts_cpu`` per decode step, batch 1..4; effective bandwidth =
  bytes of the step's distinct experts / wall time of the call;
* torch: the same steps with torch's own CPU ops (bf16 ``F.linear`` per expert,
  SiLU-and-mul, weighted sum);
* kt: KTransformers' kt-kernel, when installed: its native BF16 MoE operator
  (``kt_kernel_ext.moe``; --kt-backend auto: AMXBF16_MOE where the CPU has AMX,
  else AVX2BF16_MOE, the fastest kt decode on the AVX-512 BF16 EPYC without AMX:
  ahead of AMXBF16_MOE's AVX512-BF16 kernels, kt's LLAMAFILE BF16 and its
  online-quantized AMXInt8/AMXInt4) on the same steps. kt runs on its own
  WorkerPool while the calling thread spin-waits (``forward`` called directly,
  no CPUInfer queue hop), so with one worker per core it has one busy thread
  more than cores, which costs it much on a small machine. kt is therefore
  measured at several pool sizes within the thread budget (--kt-threads,
  default 1, N-1 and N for N = --threads), and kt's figure in each round is
  its best pool size: "kt-kernel's best" on the same cores. Each pool size
  is one kt operator with its own copy of the bank in kt's layout (memory:
  one more bank per size). kt rounds its output to bf16; one step is checked
  against ours and torch. It is
  imported from sys.path or from --kt-path (default .cache/kt in the repo),
  appended after our sgl_kernel_fork is imported: kt-kernel's wheel also ships
  top-level ``sgl_kernel``, ``deep_gemm``, ... and pins torch, so install it
  there, not into the venv (``pip install --no-deps --target .cache/kt
  kt-kernel``). Absent or failing to load: kt_ratio=nan, the reason printed;
* prefill: --prefill-tokens tokens (512) over the first --prefill-experts
  experts (64), top-8: GFLOP/s (2 * 3 * H * I per (token, k)) of ours vs torch
  grouped per expert (index_select, two F.linear, index_add_).

* --format bf16,fp8,mxfp4,nvfp4 (default all): each quantized format gets a bank of the
  same --experts experts in upstream's per-expert tensors (``expert_cache.formats``: 8 quantized
  experts tiled over the bank), decoded by ``moe_experts_cpu`` in registers; effective bandwidth
  = bytes of the packed experts (weights + scales) / wall time, batch 1..4, beside the same
  sequential read and torch (float32 dequantize + F.linear per expert, --torch-steps steps).
  bf16 is always measured (the lines above); kt-kernel is run for bf16 only (its FP8 / MXFP4
  backends are not wired here: printed as skipped). Last line adds, per format of the run,
  ``read_ratio_FMT`` (batch 1 / read), its spread ``read_ratio_FMT_lo`` / ``_hi`` (the lowest and
  highest same-round ratio), ``bw_gbps_FMT_bB`` and ``torch_ratio_FMT``.

Measurements are interleaved in --rounds rounds (torch decode: --torch-steps
steps per round), so that a shared machine's load hits all of them alike;
figures are medians over rounds, ratios the median of same-round ratios. Last
line (one line)::

    cpu_expert_kernel threads=N bw_gbps_b1=.. bw_gbps_b2=.. bw_gbps_b3=.. bw_gbps_b4=.. read_gbps=..
        torch_gbps=.. kt_gbps=.. read_ratio=.. torch_ratio=.. kt_ratio=.. bw_best_gbps_b1=.. read_best_gbps=..
        prefill_gflops=.. prefill_torch_gflops=.. prefill_ratio=.. load_avg=..

Ratios at batch 1: read_ratio = ours / sequential read, torch_ratio = ours /
torch, kt_ratio = ours / kt's best pool size in the same round (torch_gbps and
kt_gbps are torch and kt's best at batch 1; nan without kt); *_best_* are the
best rounds; load_avg is the 1-minute load average (start or end, the larger).

    .venv/bin/python benchmark/cpu_executor/bench_kernel.py [--threads N] [--experts 256]
        [--kt-path DIR] [--kt-backend auto|AVX2BF16_MOE|AMXBF16_MOE] [--kt-threads 1,2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import sgl_kernel_fork  # noqa: F401  (registers torch.ops.sgl_kernel)
from sgl_kernel_fork.cpu_executor import (
    expert_pool_info,
    expert_pool_read_bandwidth,
    expert_pool_set_threads,
    moe_experts_cpu,
)

HIDDEN, INTER, TOPK = 2048, 768, 8
# kt-kernel's pool workers spin for 50 ms after each job before they sleep
KT_SETTLE_S = 0.07


def filled_bank(shape: tuple[int, ...], block: torch.Tensor) -> torch.Tensor:
    """A bf16 tensor tiled with a random block (cheap to fill, same bytes to read)."""
    t = torch.empty(shape, dtype=torch.bfloat16)
    flat = t.view(-1)
    for i in range(0, flat.numel(), block.numel()):
        n = min(block.numel(), flat.numel() - i)
        flat[i : i + n] = block[:n]
    return t


class Bench:
    def __init__(self, args: argparse.Namespace):
        self.E = args.experts
        g = torch.Generator().manual_seed(0)
        block = (torch.randn(8 << 20, generator=g) * 0.02).bfloat16()
        self.w13 = filled_bank((self.E, 2 * INTER, HIDDEN), block)
        self.w2 = filled_bank((self.E, HIDDEN, INTER), block)
        self.expert_bytes = 3 * HIDDEN * INTER * 2
        self.cursor = 0  # next expert of the decode cycle
        self.x = torch.randn(4, HIDDEN, generator=g).bfloat16()
        self.tw = torch.rand(4, TOPK, generator=g)

    # ----------------------------------------------------------------- decode
    def next_rows(self, B: int) -> torch.Tensor:
        n = B * TOPK
        rows = (torch.arange(n, dtype=torch.int32) + self.cursor) % self.E
        self.cursor = (self.cursor + n) % self.E
        return rows.view(B, TOPK)

    def decode_ours(self, B: int) -> float:
        steps = max(2, self.E // (B * TOPK))  # one cycle through the bank
        x, tw, out = self.x[:B].contiguous(), self.tw[:B].contiguous(), torch.empty(B, HIDDEN)
        routes = [self.next_rows(B) for _ in range(steps)]
        t0 = time.perf_counter()
        for rows in routes:
            moe_experts_cpu(x, tw, [rows], [self.w13], [self.w2], out)
        dt = time.perf_counter() - t0
        return steps * B * TOPK * self.expert_bytes / dt / 1e9

    def torch_step(self, x: torch.Tensor, tw: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(x.shape[0], HIDDEN)
        for t in range(x.shape[0]):
            for k in range(TOPK):
                e = int(rows[t, k])
                gu = F.linear(x[t : t + 1], self.w13[e])
                h = F.silu(gu[:, :INTER]) * gu[:, INTER:]
                out[t] += tw[t, k] * F.linear(h, self.w2[e])[0].float()
        return out

    def decode_torch(self, B: int, max_steps: int) -> float:
        steps = max(2, min(max_steps, self.E // (B * TOPK)))
        x, tw = self.x[:B], self.tw[:B]
        routes = [self.next_rows(B) for _ in range(steps)]
        t0 = time.perf_counter()
        for rows in routes:
            self.torch_step(x, tw, rows)
        dt = time.perf_counter() - t0
        return steps * B * TOPK * self.expert_bytes / dt / 1e9

    def decode_kt(self, kt: "KtMoE", B: int) -> float:
        steps = max(2, self.E // (B * TOPK))
        x, tw = self.x[:B].contiguous(), self.tw[:B].contiguous()
        out = torch.empty(B, HIDDEN, dtype=torch.bfloat16)
        routes = [self.next_rows(B).long() for _ in range(steps)]
        t0 = time.perf_counter()
        for rows in routes:
            kt.forward(x, tw, rows, out)
        dt = time.perf_counter() - t0
        return steps * B * TOPK * self.expert_bytes / dt / 1e9

    def decode_check(self, kt: "KtMoE", B: int) -> tuple[float, float, float]:
        """One decode step through all three: max |kt - ours|, max |kt - torch|, max |torch|."""
        x, tw, rows = self.x[:B].contiguous(), self.tw[:B].contiguous(), self.next_rows(B)
        ours, kt_out = torch.empty(B, HIDDEN), torch.empty(B, HIDDEN, dtype=torch.bfloat16)
        moe_experts_cpu(x, tw, [rows], [self.w13], [self.w2], ours)
        kt.forward(x, tw, rows.long(), kt_out)
        ref = self.torch_step(x, tw, rows)
        kt_out = kt_out.float()
        return (
            (kt_out - ours).abs().max().item(),
            (kt_out - ref).abs().max().item(),
            ref.abs().max().item(),
        )

    def read(self) -> float:
        return expert_pool_read_bandwidth(self.w13, 1)

    # ---------------------------------------------------------------- prefill
    def prefill_setup(self, T: int, NE: int) -> None:
        g = torch.Generator().manual_seed(1)
        self.px = torch.randn(T, HIDDEN, generator=g).bfloat16()
        self.ptw = torch.rand(T, TOPK, generator=g)
        self.prows = torch.stack([torch.randperm(NE, generator=g)[:TOPK] for _ in range(T)]).int()
        self.pflop = 2.0 * 3 * HIDDEN * INTER * T * TOPK

    def prefill_ours(self) -> tuple[float, torch.Tensor]:
        out = torch.empty(self.px.shape[0], HIDDEN)
        t0 = time.perf_counter()
        moe_experts_cpu(self.px, self.ptw, [self.prows], [self.w13], [self.w2], out)
        return self.pflop / (time.perf_counter() - t0) / 1e9, out

    def prefill_torch(self) -> tuple[float, torch.Tensor]:
        t0 = time.perf_counter()
        out = torch.zeros(self.px.shape[0], HIDDEN)
        for e in self.prows.unique().tolist():
            t, k = (self.prows == e).nonzero(as_tuple=True)
            gu = F.linear(self.px[t], self.w13[e])
            h = F.silu(gu[:, :INTER]) * gu[:, INTER:]
            y = F.linear(h, self.w2[e]).float() * self.ptw[t, k][:, None]
            out.index_add_(0, t, y)
        return self.pflop / (time.perf_counter() - t0) / 1e9, out


class QuantBench:
    """Decode steps of one quantized format over a bank of the same shapes."""

    def __init__(self, bench: Bench, fmt: str):
        from sglang.srt.layers.moe.expert_cache.formats import QUANT_FORMATS, executor_args

        self.bench, self.fmt = bench, QUANT_FORMATS[fmt]
        g = torch.Generator().manual_seed(2)
        w13 = torch.randn(8, 2 * INTER, HIDDEN, generator=g) * 0.02
        w2 = torch.randn(8, HIDDEN, INTER, generator=g) * 0.02
        small = self.fmt.quantize(w13, w2)
        idx = torch.arange(bench.E) % 8
        self.banks = {k: v[idx].contiguous() for k, v in small.items()}
        self.kw = executor_args(self.fmt, [self.banks])
        self.expert_bytes = self.fmt.expert_bytes(HIDDEN, INTER)

    def decode_ours(self, B: int) -> float:
        b = self.bench
        steps = max(2, b.E // (B * TOPK))
        x, tw, out = b.x[:B].contiguous(), b.tw[:B].contiguous(), torch.empty(B, HIDDEN)
        routes = [b.next_rows(B) for _ in range(steps)]
        t0 = time.perf_counter()
        for rows in routes:
            moe_experts_cpu(x, tw, [rows], out=out, **self.kw)
        return steps * B * TOPK * self.expert_bytes / (time.perf_counter() - t0) / 1e9

    def decode_torch(self, B: int, max_steps: int) -> float:
        """torch: dequantize each routed expert (float32), then F.linear, SiLU-and-mul, sum."""
        b = self.bench
        steps = max(1, min(max_steps, b.E // (B * TOPK)))
        x, tw = b.x[:B].float(), b.tw[:B]
        routes = [b.next_rows(B) for _ in range(steps)]
        t0 = time.perf_counter()
        for rows in routes:
            out = torch.zeros(B, HIDDEN)
            for e in rows.unique().tolist():
                w13, w2 = self.fmt.dequantize({k: v[e] for k, v in self.banks.items()})
                t, k = (rows == e).nonzero(as_tuple=True)
                gu = F.linear(x[t], w13.float())
                h = F.silu(gu[:, :INTER]) * gu[:, INTER:]
                out.index_add_(0, t, F.linear(h, w2.float()) * tw[t, k][:, None])
        return steps * B * TOPK * self.expert_bytes / (time.perf_counter() - t0) / 1e9


class KtMoE:
    """kt-kernel's MoE operator over the bench's bank (kt copies it into its own layout)."""

    def __init__(self, bench: Bench, backend: str, threads: int, max_tokens: int):
        import kt_kernel

        ext = kt_kernel.kt_kernel_ext
        if backend == "auto":  # kt's own CPU detection
            backend = "AMXBF16_MOE" if kt_kernel.__cpu_variant__ == "amx" else "AVX2BF16_MOE"
        cls = getattr(ext.moe, backend, None)
        if cls is None:
            raise RuntimeError(
                f"kt_kernel_ext.moe has no {backend} (cpu variant {kt_kernel.__cpu_variant__})"
            )
        E = bench.E
        self.name = f"kt-kernel {getattr(kt_kernel, '__version__', '?')} {backend}"
        self.variant = kt_kernel.__cpu_variant__
        self.threads = threads
        self.pool = ext.WorkerPool(threads)  # one subpool (NUMA node 0) of `threads` workers
        # the config holds raw pointers to these: keep them alive with the operator
        self.gpu_mask = torch.zeros(E, dtype=torch.bool)  # no expert on a GPU
        self.expert_map = torch.arange(E, dtype=torch.int64)  # physical -> logical: identity
        cfg = ext.moe.MOEConfig(E, TOPK, HIDDEN, INTER, self.gpu_mask.data_ptr())
        cfg.layer_idx = 0
        cfg.pool = self.pool
        cfg.max_len = -(-max_tokens // 32) * 32  # kt sizes its buffers in 32-row steps
        cfg.physical_to_logical_map = self.expert_map.data_ptr()
        # per-expert pointers into our bank (numa 0): gate and up are the halves of w13
        cfg.gate_projs = [[bench.w13[e, :INTER].data_ptr() for e in range(E)]]
        cfg.up_projs = [[bench.w13[e, INTER:].data_ptr() for e in range(E)]]
        cfg.down_projs = [[bench.w2[e].data_ptr() for e in range(E)]]
        self.moe = cls(cfg)
        self.moe.load_weights()  # copies the experts into kt's buffers; kt keeps no pointer into the bank
        self.bsz = {}

    def forward(
        self, x: torch.Tensor, tw: torch.Tensor, rows: torch.Tensor, out: torch.Tensor
    ) -> None:
        """out (bf16) = the MoE of x (bf16) over rows (int64 expert ids) weighted by tw (fp32)."""
        B = x.shape[0]
        bsz = self.bsz.setdefault(
            B, torch.tensor([B], dtype=torch.int32)
        )  # kt reads the token count by pointer
        self.moe.forward(
            bsz.data_ptr(),
            TOPK,
            rows.data_ptr(),
            tw.data_ptr(),
            x.data_ptr(),
            out.data_ptr(),
            False,
        )


def load_kt(bench: Bench, args: argparse.Namespace, threads: list[int]) -> tuple[list[KtMoE], str]:
    """kt-kernel's operators over the bank, one per pool size in ``threads``, or [] and why not."""
    if args.kt_path:
        if not os.path.isdir(args.kt_path):
            return [], f"--kt-path {args.kt_path} is not a directory"
        if args.kt_path not in sys.path:
            sys.path.append(
                args.kt_path
            )  # after our sgl_kernel_fork is imported: ours stays the one used
    try:
        import kt_kernel  # noqa: F401
    except Exception as e:
        return [], f"kt_kernel not importable ({type(e).__name__}: {e})"
    try:
        kts = [KtMoE(bench, args.kt_backend, t, args.batch_max) for t in threads]
    except Exception as e:
        return [], f"kt-kernel failed to load the experts ({type(e).__name__}: {e})"
    return kts, (
        f"{kts[0].name}, cpu variant {kts[0].variant}, pool sizes {threads} (+ the calling "
        "thread, which spin-waits)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--threads", type=int, default=0, help="pool and torch threads (0: one per physical core)"
    )
    ap.add_argument("--experts", type=int, default=256, help="experts in the bank (9.4 MB each)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch-max", type=int, default=4)
    ap.add_argument("--torch-steps", type=int, default=8, help="decode steps per torch measurement")
    ap.add_argument("--prefill-tokens", type=int, default=512)
    ap.add_argument("--prefill-experts", type=int, default=64)
    ap.add_argument("--prefill-rounds", type=int, default=2)
    default_kt = Path(__file__).resolve().parents[2] / ".cache" / "kt"
    ap.add_argument(
        "--kt-path",
        default=str(default_kt) if default_kt.is_dir() else "",
        help="directory holding kt-kernel (pip install --no-deps --target DIR kt-kernel), appended "
        "to sys.path after our sgl_kernel_fork is imported (default: .cache/kt in the repo, if present)",
    )
    ap.add_argument(
        "--kt-backend",
        default="auto",
        help="kt_kernel_ext.moe class: auto (AMXBF16_MOE with AMX, "
        "else AVX2BF16_MOE), AVX2BF16_MOE, AMXBF16_MOE",
    )
    ap.add_argument(
        "--kt-threads",
        default="",
        help="comma-separated kt-kernel pool sizes, its best taken "
        "per round (default: 1, N-1 and N for N = --threads)",
    )
    ap.add_argument(
        "--format",
        default="bf16,fp8,mxfp4,nvfp4",
        help="comma-separated expert formats (bf16 is always measured: the lines above)",
    )
    ap.add_argument(
        "--quant-torch-steps", type=int, default=2, help="torch steps per quantized round"
    )
    args = ap.parse_args()
    formats = [f for f in args.format.split(",") if f]
    bad = [f for f in formats if f not in ("bf16", "fp8", "mxfp4", "nvfp4")]
    if bad:
        ap.error(f"--format: unknown {bad}; choose from bf16,fp8,mxfp4,nvfp4")

    t_start = time.perf_counter()
    load0 = os.getloadavg()[0]
    n = expert_pool_set_threads(args.threads)
    torch.set_num_threads(n)
    print(f"# pool: {expert_pool_info()}")
    print(
        f"# torch {torch.__version__}, torch threads {torch.get_num_threads()}, "
        f"cpus online {os.cpu_count()}, load average at start {load0:.1f}"
    )
    bench = Bench(args)
    print(
        f"# bank: {args.experts} experts x {bench.expert_bytes / 1e6:.1f} MB = "
        f"{args.experts * bench.expert_bytes / 1e9:.2f} GB"
    )
    batches = list(range(1, args.batch_max + 1))
    quants = [QuantBench(bench, f) for f in formats if f != "bf16"]
    for q in quants:
        print(
            f"# {q.fmt.name} bank: {args.experts} experts x {q.expert_bytes / 1e6:.2f} MB (weights + scales)"
        )
        q.decode_ours(1)  # warm-up: page mapping
    bench.prefill_setup(args.prefill_tokens, min(args.prefill_experts, args.experts))
    t_kt = time.perf_counter()
    kt_threads = (
        [int(t) for t in args.kt_threads.split(",")]
        if args.kt_threads
        else sorted({1, max(1, n - 1), n})
    )
    kts, kt_status = load_kt(bench, args, kt_threads)
    kt = kts[0] if kts else None
    print(
        f"# kt-kernel: {kt_status}"
        + (f"; imported and loaded in {time.perf_counter() - t_kt:.1f} s" if kt else "")
    )

    # warm-up: pool threads, scratch, page mapping of the banks, oneDNN
    bench.read()
    bench.decode_ours(1)
    bench.decode_torch(1, 2)
    bench.prefill_ours()
    for k in kts:
        bench.decode_kt(k, 1)
        time.sleep(KT_SETTLE_S)
    if kt:
        kt_check = bench.decode_check(kt, args.batch_max)
        time.sleep(KT_SETTLE_S)

    res: dict[str, list[float]] = {}

    def add(key: str, v: float, settle: float = 0.02) -> None:
        res.setdefault(key, []).append(v)
        # let idle threads (torch's OpenMP workers spin after each parallel
        # region, the pool's for SGLANG_CPU_EXPERT_SPIN_US, kt-kernel's for
        # KT_SETTLE_S) go to sleep before the next measurement, so that no
        # side runs against another
        time.sleep(settle)

    for _ in range(args.rounds):  # interleaved, so that load changes hit all alike
        add("read", bench.read())
        for B in batches:
            add(f"ours_b{B}", bench.decode_ours(B))
            add(f"torch_b{B}", bench.decode_torch(B, args.torch_steps))
            for k in kts:
                add(f"kt{k.threads}_b{B}", bench.decode_kt(k, B), settle=KT_SETTLE_S)
            if kts:  # kt's best pool size this round
                res.setdefault(f"kt_b{B}", []).append(
                    max(res[f"kt{k.threads}_b{B}"][-1] for k in kts)
                )
        for q in quants:
            for B in batches:
                add(f"{q.fmt.name}_b{B}", q.decode_ours(B))
                add(f"{q.fmt.name}_torch_b{B}", q.decode_torch(B, args.quant_torch_steps))
    prefill_out = {}
    for _ in range(args.prefill_rounds):
        v, prefill_out["ours"] = bench.prefill_ours()
        add("prefill_ours", v)
        v, prefill_out["torch"] = bench.prefill_torch()
        add("prefill_torch", v)
    diff = (prefill_out["ours"] - prefill_out["torch"]).abs().max().item()
    scale = prefill_out["torch"].abs().max().item()

    med = {k: statistics.median(v) for k, v in res.items()}
    best = {k: max(v) for k, v in res.items()}

    def ratio(a: str, b: str) -> float:  # median over rounds of the same-round ratio
        return statistics.median(x / y for x, y in zip(res[a], res[b]))

    def spread(a: str, b: str) -> tuple[float, float]:  # lowest and highest same-round ratio
        rs = [x / y for x, y in zip(res[a], res[b])]
        return min(rs), max(rs)

    read = med["read"]
    print()
    print(
        f"decode, {args.rounds} rounds (GB/s = expert bytes read / wall time; ratios: median of same-round ratios)"
    )
    print()
    print("| measure | batch | GB/s median | GB/s best | vs read | ours vs torch | ours vs kt |")
    print("|---|---|---|---|---|---|---|")
    print(f"| sequential read (C++ pool) | - | {read:.1f} | {best['read']:.1f} | 1.00 | | |")
    for B in batches:
        o, t, k = f"ours_b{B}", f"torch_b{B}", f"kt_b{B}"
        vs_kt = f"{ratio(o, k):.2f}" if kt else "n/a"
        print(
            f"| moe_experts_cpu | {B} | {med[o]:.1f} | {best[o]:.1f} | {ratio(o, 'read'):.2f} | {ratio(o, t):.2f} "
            f"| {vs_kt} |"
        )
        print(
            f"| torch bf16 F.linear | {B} | {med[t]:.1f} | {best[t]:.1f} | {ratio(t, 'read'):.2f} | | |"
        )
        for kk in kts:
            kb = f"kt{kk.threads}_b{B}"
            print(
                f"| {kk.name}, {kk.threads} threads | {B} | {med[kb]:.1f} | {best[kb]:.1f} "
                f"| {ratio(kb, 'read'):.2f} | | {ratio(o, kb):.2f} |"
            )
        if kts:
            print(
                f"| kt-kernel, best pool size per round | {B} | {med[k]:.1f} | {best[k]:.1f} "
                f"| {ratio(k, 'read'):.2f} | | |"
            )
    if quants:
        print()
        print(
            "| format | batch | GB/s median | GB/s min-max | vs read (rounds' min-max) "
            "| ours vs torch | torch GB/s |"
        )
        print("|---|---|---|---|---|---|---|")
    for q in quants:
        for B in batches:
            o, t = f"{q.fmt.name}_b{B}", f"{q.fmt.name}_torch_b{B}"
            lo, hi = spread(o, "read")
            print(
                f"| moe_experts_cpu {q.fmt.name} | {B} | {med[o]:.1f} | {min(res[o]):.1f}-{best[o]:.1f} "
                f"| {ratio(o, 'read'):.2f} ({lo:.2f}-{hi:.2f}) | {ratio(o, t):.2f} | {med[t]:.2f} |"
            )
        print(
            f"# kt-kernel {q.fmt.name}: not measured (this benchmark wires kt's BF16 operator only)"
        )
    po, pt = med["prefill_ours"], med["prefill_torch"]
    print()
    print(
        f"| prefill T={args.prefill_tokens} x top-{TOPK} over {bench.prows.unique().numel()} experts "
        "| GFLOP/s median | GFLOP/s best |"
    )
    print("|---|---|---|")
    print(f"| moe_experts_cpu | {po:.1f} | {best['prefill_ours']:.1f} |")
    print(f"| torch bf16 F.linear grouped per expert | {pt:.1f} | {best['prefill_torch']:.1f} |")
    print(
        f"# prefill max |ours - torch| = {diff:.3g} (max |out| {scale:.3g}; torch also rounds gate/up and "
        "each expert's output to bf16)"
    )
    if kt:
        d_ours, d_torch, kt_scale = kt_check
        print(
            f"# kt decode check (one step, batch {args.batch_max}): max |kt - ours| = {d_ours:.3g}, "
            f"max |kt - torch| = {d_torch:.3g} (max |out| {kt_scale:.3g}; kt rounds its output to bf16)"
        )
    else:
        print(f"# kt-kernel: {kt_status}, so kt_ratio=nan")
    load1 = os.getloadavg()[0]
    print(
        f"# load average at end {load1:.1f} on {os.cpu_count()} cpus; wall {time.perf_counter() - t_start:.0f} s. "
        "On a shared machine every figure moves with the load; torch's OpenMP barriers suffer most from it."
    )
    fields = [f"threads={n}"]
    fields += [f"bw_gbps_b{B}={med[f'ours_b{B}']:.2f}" for B in batches]
    fields += [
        f"read_gbps={read:.2f}",
        f"torch_gbps={med['torch_b1']:.2f}",
        f"kt_gbps={med['kt_b1']:.2f}" if kt else "kt_gbps=nan",
        f"read_ratio={ratio('ours_b1', 'read'):.3f}",
        f"torch_ratio={ratio('ours_b1', 'torch_b1'):.3f}",
        f"kt_ratio={ratio('ours_b1', 'kt_b1'):.3f}" if kt else "kt_ratio=nan",
        f"bw_best_gbps_b1={best['ours_b1']:.2f}",
        f"read_best_gbps={best['read']:.2f}",
        f"prefill_gflops={po:.1f}",
        f"prefill_torch_gflops={pt:.1f}",
        f"prefill_ratio={ratio('prefill_ours', 'prefill_torch'):.3f}",
    ]
    fields += [f"read_ratio_bf16={ratio('ours_b1', 'read'):.3f}"] if "bf16" in formats else []
    for q in quants:
        f = q.fmt.name
        lo, hi = spread(f + "_b1", "read")
        fields += [f"read_ratio_{f}={ratio(f + '_b1', 'read'):.3f}"]
        fields += [f"read_ratio_{f}_lo={lo:.3f}", f"read_ratio_{f}_hi={hi:.3f}"]
        fields += [f"bw_gbps_{f}_b{B}={med[f'{f}_b{B}']:.2f}" for B in batches]
        fields += [f"torch_ratio_{f}={ratio(f + '_b1', f + '_torch_b1'):.3f}"]
    fields += [f"load_avg={max(load0, load1):.1f}"]
    print("cpu_expert_kernel " + " ".join(fields))


if __name__ == "__main__":
    main()
