"""The GPU path's slot experts (upstream's Triton fused MoE over the slot table) on the CPU.

Runs ``triton_slot_path_check.py`` in a fresh process with ``TRITON_INTERPRET=1`` (it must be
set before any Triton kernel is defined); see that script for what is checked and for the
stand-ins of upstream's CUDA-only plumbing.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

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
    assert max_err < 2e-2
