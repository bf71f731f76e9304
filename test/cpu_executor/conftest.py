"""Shared fixtures of the CPU executor tests (the op ``moe_experts_cpu`` and its use by a resident
MoE layer, FreeToken §3.2 / §4.1).

The tests need the fork's operator package built and installed (``make setup``); if
``sgl_kernel_fork`` cannot be imported the folder fails (no silent skip).
"""

import pytest
import torch

try:
    import sgl_kernel_fork  # noqa: F401
except ImportError as e:  # pragma: no cover - reported as a collection error
    raise ImportError(
        "sgl_kernel_fork is not importable: build and install it with `make setup` (" + str(e) + ")"
    ) from e


def _available_levels(names=("avx512bf16", "avx512", "avx2", "scalar")):
    levels = []
    for name in names:
        try:
            torch.ops.sgl_kernel.set_cpu_isa(name)
            levels.append(name)
        except RuntimeError:
            pass
    torch.ops.sgl_kernel.set_cpu_isa("auto")
    return levels


@pytest.fixture(params=_available_levels())
def executor_isa(request):
    """Run the test once per CPU executor kernel level this CPU supports (the executor has one
    level more than the other ops: avx512bf16, whose dots use vdpbf16ps)."""
    torch.ops.sgl_kernel.set_cpu_isa(request.param)
    yield request.param
    torch.ops.sgl_kernel.set_cpu_isa("auto")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
