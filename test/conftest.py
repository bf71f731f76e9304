"""Shared by every test folder: the fork's operator package, and the CPU kernel levels to sweep.

The tests run in the virtual environment ``make setup`` builds, with ``sgl_kernel_fork`` (the
fork's operators, ``sgl-kernel/``) installed; if it cannot be imported, collection fails with
what to do (no silent skip).

Level fixtures run a test once per SIMD kernel level this CPU supports (``sgl_kernel.set_cpu_isa``;
levels it lacks are left out, ``scalar`` is always there) and restore ``auto`` afterwards.
"""

import pytest
import torch

try:
    import sgl_kernel_fork  # noqa: F401  (registers torch.ops.sgl_kernel.*)
except ImportError as e:  # pragma: no cover - reported as a collection error
    raise ImportError(
        "sgl_kernel_fork is not importable: build and install it with `make setup` (" + str(e) + ")"
    ) from e

# On a GPU machine without upstream's CUDA kernel wheel (scripts/gpu_checks.sh), upstream modules
# that test files import at collection (model_loader -> quantization -> `from sgl_kernel import
# int8_scaled_mm`) need the stand-in `sgl_kernel` before the first of them; a no-op elsewhere.
from sglang.test.bare_fused_moe import install_cuda_standins  # noqa: E402

install_cuda_standins()


def _supported(levels):
    out = []
    for name in levels:
        try:
            torch.ops.sgl_kernel.set_cpu_isa(name)
            out.append(name)
        except RuntimeError:
            pass
    torch.ops.sgl_kernel.set_cpu_isa("auto")
    return out


def _level_fixture(levels, doc):
    @pytest.fixture(params=_supported(levels))
    def fixture(request):
        torch.ops.sgl_kernel.set_cpu_isa(request.param)
        yield request.param
        torch.ops.sgl_kernel.set_cpu_isa("auto")

    fixture.__doc__ = doc
    return fixture


isa = _level_fixture(("avx512", "avx2", "scalar"), "The levels of the general CPU ops' kernels.")
executor_isa = _level_fixture(
    ("avx512bf16", "avx512", "avx2", "scalar"),
    "The CPU executor's levels: one more than the other ops, avx512bf16 (vdpbf16ps dots).",
)
victim_scan_isa = _level_fixture(
    ("avx2", "scalar"), "The two paths of the control op's victim pass (scalar, AVX2)."
)
