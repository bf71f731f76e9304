"""The GPU path's slot experts (upstream's Triton fused MoE over the slot table).

On the CPU: ``triton_slot_path_check.py`` in a fresh process with ``TRITON_INTERPRET=1`` (it
must be set before any Triton kernel is defined), fp16. On a GPU (skipped without one): the same
checks in process on real bf16 slots. See that script for what is checked and for the stand-ins
of upstream's CUDA-only plumbing.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).with_name("triton_slot_path_check.py")


def test_slot_experts_through_triton_fused_moe_add_up_with_the_cpu_branch():
    env = dict(os.environ, TRITON_INTERPRET="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    m = re.search(
        r"triton_slot_path calls=(\d+) slot_entries=(\d+) cpu_entries=(\d+) max_err=(\S+)",
        proc.stdout,
    )
    assert m, proc.stdout[-3000:]
    calls, slot_entries, cpu_entries, max_err = (int(m[1]), int(m[2]), int(m[3]), float(m[4]))
    assert calls == 90 and slot_entries > 0 and cpu_entries > 0
    assert max_err <= 2e-2  # triton_slot_path_check.TOL


HAS_CUDA_OP = torch.cuda.is_available() and torch._C._dispatch_has_kernel_for_dispatch_key(
    "sgl_kernel::expert_cache_control", "CUDA"
)


@pytest.mark.skipif(
    not HAS_CUDA_OP,
    reason="needs a GPU and sgl_kernel_fork built with CUDA (torch.cuda unavailable here)",
)
def test_slot_experts_on_cuda_in_bf16_add_up_with_the_cpu_branch():
    """Compiled Triton on the GPU with the cache's own bf16 slots (the interpreter cannot
    compute bf16): every size and policy within ``TOL`` of the float64 reference."""
    from triton_slot_path_check import CONFIGS, TOL, Totals, check_config

    from sglang.test.bare_fused_moe import install_cuda_standins, server_state

    print("stand-ins:", install_cuda_standins() or "none (upstream's CUDA kernels present)")
    totals = Totals()
    with server_state("cuda"):
        for size, policy, *factor in CONFIGS:
            check_config(size, policy, totals, *factor, device="cuda", dtype=torch.bfloat16)
    assert totals.calls == 90 and totals.slot_entries > 0 and totals.cpu_entries > 0
    assert totals.max_err <= TOL
    print(f"triton_slot_path_cuda calls={totals.calls} max_err={totals.max_err:.2e}")


# Block-FP8 slots: bf16 activations are quantized per 128-group to e4m3 by upstream's kernel
# (as Fp8MoEMethod runs it), so the bound is the bf16 one plus e4m3 rounding of x (2^-4
# relative per element, averaging out over the 128-long dot products). A first-run bound: not
# yet run on a GPU.
FP8_TOL = 5e-2


@pytest.mark.skipif(
    not HAS_CUDA_OP,
    reason="needs a GPU and sgl_kernel_fork built with CUDA (torch.cuda unavailable here)",
)
def test_slot_experts_on_cuda_in_block_fp8():
    """``slot_experts`` over block-FP8 slot banks (``w13``/``w2`` float8_e4m3fn, ``w13_scale``
    / ``w2_scale`` float32 per 128 x 128 block, Fp8MoEMethod's layout) against a float64
    reference with the dequantized weights, over the slot entries only (-1 entries add
    nothing): ``max|err| <= FP8_TOL * max(1, max|ref|)``."""
    from dataclasses import replace

    from sglang.srt.layers.moe.expert_cache.cuda_branch import slot_experts
    from sglang.srt.layers.moe.moe_runner.base import MoeRunnerConfig
    from sglang.test.bare_fused_moe import install_cuda_standins, server_state
    from sglang.test.tiny_models.quantize import block_dequantize_fp8, block_quantize_fp8

    S, H, I, K, T = 16, 256, 128, 4, 9
    g = torch.Generator().manual_seed(3)
    w13 = torch.randn(S, 2 * I, H, generator=g) / H**0.5
    w2 = torch.randn(S, H, I, generator=g) / I**0.5
    q13, s13 = zip(*(block_quantize_fp8(w) for w in w13))
    q2, s2 = zip(*(block_quantize_fp8(w) for w in w2))
    slots = {
        "w13": torch.stack(q13).cuda(),
        "w2": torch.stack(q2).cuda(),
        "w13_scale": torch.stack(s13).float().cuda(),
        "w2_scale": torch.stack(s2).float().cuda(),
    }
    x = torch.randn(T, H, generator=g).bfloat16()
    ids = torch.randint(0, S, (T, K), generator=g, dtype=torch.int32)
    ids[::3, 1] = -1  # CPU / padding entries
    w = torch.rand(T, K, generator=g)
    cfg = MoeRunnerConfig(
        num_experts=S,
        num_local_experts=S,
        hidden_size=H,
        intermediate_size_per_partition=I,
        top_k=K,
        params_dtype=torch.bfloat16,
        activation="silu",
    )
    install_cuda_standins()
    with server_state("cuda"):
        got = slot_experts(slots, x.cuda(), w.cuda(), ids.cuda(), replace(cfg), (128, 128))
    ref = torch.zeros(T, H, dtype=torch.float64)
    for s in range(S):
        d13 = block_dequantize_fp8(q13[s], s13[s])
        d2 = block_dequantize_fp8(q2[s], s2[s])
        for t, k in (ids == s).nonzero().tolist():
            xt = x[t].double()
            h = torch.nn.functional.silu(d13[:I] @ xt) * (d13[I:] @ xt)
            ref[t] += w[t, k].double() * (d2 @ h)
    err = (got.double().cpu() - ref).abs().max().item()
    assert err <= FP8_TOL * max(1.0, ref.abs().max().item()), err
    print(f"triton_slot_path_cuda_fp8 max_err={err:.2e}")
