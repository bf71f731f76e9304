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
