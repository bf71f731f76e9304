"""The ``level`` fixture of the CPU attention kernel tests: each test runs once per ISA path the
CPU has (``test_extend_attention_kernel.LEVELS``), selected with ``set_cpu_isa``."""

import pytest
from test_extend_attention_kernel import LEVELS

import sgl_kernel_fork


@pytest.fixture(params=LEVELS)
def level(request):
    """Runs the test at one kernel level (one path of the kernel), then restores the level."""
    before = sgl_kernel_fork.cpu_isa()
    sgl_kernel_fork.set_cpu_isa(request.param)
    assert sgl_kernel_fork.extend_attention_supported(64)
    try:
        yield request.param
    finally:
        sgl_kernel_fork.set_cpu_isa(before)
