"""Shared fixtures of the sgl_kernel CPU-op tests.

The tests import ``sgl_kernel_fork`` (checked by ``test/conftest.py``, which
also holds the ``isa`` fixture: one run per kernel level); ``test_api.py`` checks
the ``sgl_kernel`` alias upstream imports on a CPU-only machine.

The references live in ``sglk_refs.py`` (transformers' Qwen3-Next torch code)
or in the tests themselves (plain Python loops).
"""

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
