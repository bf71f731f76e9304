"""Shared fixtures of the sgl_kernel CPU-op tests.

The tests need the fork's ``sgl_kernel`` built and installed
(``pip install --no-build-isolation ./sgl-kernel``); if it cannot be imported
the whole folder fails (no silent skip).

The references live in ``sglk_refs.py`` (transformers' Qwen3-Next torch code)
or in the tests themselves (plain Python loops).
"""

import pytest
import torch

try:
    import sgl_kernel  # noqa: F401
except ImportError as e:  # pragma: no cover - reported as a collection error
    raise ImportError(
        "sgl_kernel is not importable: build and install it with "
        "`pip install --no-build-isolation ./sgl-kernel` (" + str(e) + ")"
    ) from e


def _available_isas():
    isas = []
    for name in ("avx512", "avx2", "scalar"):
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
