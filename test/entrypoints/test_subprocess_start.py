"""The launcher's start method for its children (``entrypoints/subprocess_start.py``, patch 0012):
fork only in the ``sglang.launch_server`` process of a CPU server with one thread, no CUDA
device and no ``--numa-node``; spawn otherwise; the environment variable first; forked children
start their own children by spawn, and the launcher returns to spawn after the launch. Each case
that sets the method runs in a fresh interpreter, so this test process keeps its own."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch

from sglang.srt.entrypoints import subprocess_start as ss


@pytest.fixture
def launcher(monkeypatch):
    """As in the ``python -m sglang.launch_server`` process on a machine without CUDA. The
    threads earlier tests left in this pytest process are not counted: a thread started here is."""
    monkeypatch.delenv(ss.ENV, raising=False)
    base = threading.active_count()
    monkeypatch.setattr(ss, "_thread_count", lambda: threading.active_count() - base + 1)
    monkeypatch.setattr(ss, "_main_module", lambda: ss.LAUNCHER_MODULE)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_cpu_launcher_forks_and_cuda_spawns(launcher):
    assert ss.subprocess_start_method("cpu") == "fork"
    assert ss.subprocess_start_method("cuda") == "spawn"
    assert ss.subprocess_start_method(None) == "spawn"


def test_spawn_wherever_fork_is_not_known_safe(launcher, monkeypatch):
    assert ss.subprocess_start_method("cpu", numa_node=[0]) == "spawn"  # numactl needs spawn
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert ss.subprocess_start_method("cpu") == "spawn"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(ss, "_main_module", lambda: "my_app")  # sgl.Engine in a user's program
    assert ss.subprocess_start_method("cpu") == "spawn"
    monkeypatch.setattr(ss, "_main_module", lambda: ss.LAUNCHER_MODULE)
    stop = threading.Event()
    t = threading.Thread(target=stop.wait)
    t.start()
    try:
        assert ss.subprocess_start_method("cpu") == "spawn"  # another thread is alive
    finally:
        stop.set()
        t.join()
    assert ss.subprocess_start_method("cpu") == "fork"


@pytest.mark.parametrize("value", ["spawn", "fork"])
def test_the_environment_variable_wins(monkeypatch, value):
    monkeypatch.setenv(ss.ENV, value)
    assert ss.subprocess_start_method("cpu") == value
    assert ss.subprocess_start_method("cuda") == value


def test_an_unknown_method_is_refused_with_the_choices(monkeypatch):
    monkeypatch.setenv(ss.ENV, "forkserver")
    with pytest.raises(ValueError, match="fork, spawn"):
        ss.subprocess_start_method("cpu")


CHILD = """
import multiprocessing as mp
import signal
import torch
from sglang.srt.entrypoints import subprocess_start as ss

def child(q):
    q.put((mp.get_start_method(), signal.getsignal(signal.SIGQUIT) == signal.SIG_DFL))

if __name__ == "__main__":
    ss._main_module = lambda: ss.LAUNCHER_MODULE
    torch.cuda.is_available = lambda: False
    signal.signal(signal.SIGQUIT, lambda *a: None)  # as the launcher's handler
    print(ss.set_subprocess_start_method("cpu"), mp.get_start_method())
    q = mp.Queue()
    p = mp.Process(target=child, args=(q,))
    p.start()
    method, default_sigquit = q.get(timeout=60)
    print("child", method, default_sigquit)
    p.join(timeout=60)
    print("exit", p.exitcode)
    ss.restore_spawn()
    print("after", mp.get_start_method())
"""


def test_a_forked_child_spawns_its_own_and_the_launcher_returns_to_spawn(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = {k: v for k, v in os.environ.items() if k != ss.ENV}
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [
        "fork",
        "fork",
        "child",
        "spawn",
        "True",
        "exit",
        "0",
        "after",
        "spawn",
    ], out.stdout
