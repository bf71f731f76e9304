"""Host-pool bytes per expert format for a Qwen3-30B-A3B-shaped MoE layer (issue 13).

For each format (bf16; block FP8 as Qwen3-30B-A3B-FP8; ModelOpt NVFP4 as
nvidia/Qwen3-30B-A3B-FP4) the host banks of one layer (E experts of hidden size H and
intermediate size I, ``expert_cache.banks.ExpertBanks``: every per-expert tensor of the quant
method, weights and scales) are allocated and their bytes summed; the pool of all MoE layers is
that times L. No timing: the figures are sizes, exact for the shapes given.

    python benchmark/expert_cache/bench_pool_bytes.py [--hidden 2048 --inter 768 --experts 128
        --layers 48]

Last line: ``name=value`` with ``layer_mb_FMT``, ``pool_gb_FMT`` and ``ratio_FMT`` (bytes against
bf16) per format.
"""

from __future__ import annotations

import argparse

import torch

from sglang.srt.layers.moe.expert_cache.banks import BF16, ExpertBanks
from sglang.srt.layers.moe.expert_cache.formats import FP8, NVFP4


def layer_bytes(fmt, hidden: int, inter: int, experts: int) -> dict:
    """Bytes of each bank of one layer's host pool (allocated, never touched)."""
    banks = ExpertBanks(fmt, hidden, inter, experts, "cpu")
    return {n: t.numel() * t.element_size() for n, t in banks.tensors.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--layers", type=int, default=48)
    a = p.parse_args()
    print(f"Qwen3-30B-A3B-shaped layer: H={a.hidden} I={a.inter} E={a.experts}, {a.layers} layers")
    figures = {}
    base = None
    for name, fmt in (("bf16", BF16), ("fp8", FP8), ("nvfp4", NVFP4)):
        banks = layer_bytes(fmt, a.hidden, a.inter, a.experts)
        total = sum(banks.values())
        base = base or total
        detail = ", ".join(f"{n} {b / 1e6:.2f} MB" for n, b in banks.items())
        print(
            f"  {name:6s} {total / 1e6:8.2f} MB/layer  {total * a.layers / 1e9:6.2f} GB pool  "
            f"x{total / base:.3f} of bf16  ({detail})"
        )
        figures[f"layer_mb_{name}"] = f"{total / 1e6:.2f}"
        figures[f"pool_gb_{name}"] = f"{total * a.layers / 1e9:.2f}"
        figures[f"ratio_{name}"] = f"{total / base:.4f}"
    print(" ".join(f"{k}={v}" for k, v in figures.items()))


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
