"""The CPU server forks its scheduler and detokenizer (patch 0012, ``subprocess_start.py``): the
default pooled server's log says so, and it serves (every other end-to-end test runs on such
servers). Only where ``scripts/serve.sh`` chose the CPU; on a GPU machine the launcher spawns."""

from __future__ import annotations

import pytest

FORKED = "Scheduler and detokenizer processes are forked"


def test_cpu_server_forks_its_children(server):
    log = server.log.read_text(errors="replace")
    if "'device': 'cpu'" not in log:
        pytest.skip("serve.sh chose CUDA here: the launcher spawns its children, as upstream")
    assert FORKED in log
