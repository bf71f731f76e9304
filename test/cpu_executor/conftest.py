"""Shared fixtures of the CPU executor tests (the op ``moe_experts_cpu`` and its use by a resident
MoE layer, FreeToken §3.2 / §4.1).

The ``executor_isa`` fixture (one run per executor kernel level) is in ``test/conftest.py``.
"""

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
