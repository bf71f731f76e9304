"""The CPU server forks its scheduler and detokenizer (patch 0012, ``subprocess_start.py``):
the default pooled server says so in its log, its scheduler process is a child of the launcher
that was not started by spawn (no ``multiprocessing.spawn`` in its command line), and it serves
(every other end-to-end test runs on such servers)."""

from __future__ import annotations

import psutil


def test_cpu_server_forks_its_children(server):
    assert "Scheduler and detokenizer processes are forked" in server.log.read_text(
        errors="replace"
    )
    launcher = psutil.Process(server.proc.pid)
    children = launcher.children()
    assert len(children) >= 2, [c.cmdline() for c in children]
    for child in children:
        cmd = " ".join(child.cmdline())
        assert "multiprocessing" not in cmd and "spawn_main" not in cmd, cmd
