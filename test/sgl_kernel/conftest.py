"""Shared fixtures of the sgl_kernel CPU-op tests.

The tests need the fork's operator package built and installed
(``pip install --no-build-isolation ./sgl-kernel``, done by ``make setup``). The
tests import ``sgl_kernel_fork``; ``test_api.py`` checks the ``sgl_kernel`` alias
upstream imports on a CPU-only machine. If it cannot be imported the whole folder
fails (no silent skip).

The references live in ``sglk_refs.py`` (transformers' Qwen3-Next torch code)
or in the tests themselves (plain Python loops).
"""

import pytest
import torch

try:
    import sgl_kernel_fork  # noqa: F401
except ImportError as e:  # pragma: no cover - reported as a collection error
    raise ImportError(
        "sgl_kernel_fork is not importable: build and install it with "
        "`pip install --no-build-isolation ./sgl-kernel` (" + str(e) + ")"
    ) from e


def _available_isas(names=("avx512", "avx2", "scalar")):
    isas = []
    for name in names:
        try:
            torch.ops.sgl_kernel.set_cpu_isa(name)
            isas.append(name)
        except RuntimeError:
            pass
    torch.ops.sgl_kernel.set_cpu_isa("auto")
    return isas


ISAS = _available_isas()


@pytest.fixture(params=ISAS)
def isa(request):
    """Run the test once per SIMD kernel set this CPU supports."""
    torch.ops.sgl_kernel.set_cpu_isa(request.param)
    yield request.param
    torch.ops.sgl_kernel.set_cpu_isa("auto")



@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
