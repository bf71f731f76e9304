"""The launcher's start method for its children (``entrypoints/subprocess_start.py``, patch 0012):
fork on a CPU server, spawn otherwise, the environment variable first; forked children start
their own children by spawn. Each case that sets the method runs in a fresh interpreter, so
this test process keeps its own start method."""

from __future__ import annotations

import subprocess
import sys

import pytest

from sglang.srt.entrypoints import subprocess_start as ss


def test_cpu_forks_and_cuda_spawns(monkeypatch):
    monkeypatch.delenv(ss.ENV, raising=False)
    assert ss.subprocess_start_method("cpu") == "fork"
    assert ss.subprocess_start_method("cuda") == "spawn"
    assert ss.subprocess_start_method(None) == "spawn"


@pytest.mark.parametrize("value", ["spawn", "forkserver", "fork"])
def test_the_environment_variable_wins(monkeypatch, value):
    monkeypatch.setenv(ss.ENV, value)
    assert ss.subprocess_start_method("cpu") == value
    assert ss.subprocess_start_method("cuda") == value


def test_an_unknown_method_is_refused_with_the_choices(monkeypatch):
    monkeypatch.setenv(ss.ENV, "vfork")
    with pytest.raises(ValueError, match="fork, spawn, forkserver"):
        ss.subprocess_start_method("cpu")


CHILD = """
import multiprocessing as mp
from sglang.srt.entrypoints.subprocess_start import set_subprocess_start_method

def child(q):
    q.put(mp.get_start_method())

if __name__ == "__main__":
    print(set_subprocess_start_method("cpu"), mp.get_start_method())
    q = mp.Queue()
    p = mp.Process(target=child, args=(q,))
    p.start()
    print("child", q.get(timeout=60))
    p.join(timeout=60)
    print("exit", p.exitcode)
"""


def test_a_forked_child_starts_its_own_children_by_spawn(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = {k: v for k, v in __import__("os").environ.items() if k != ss.ENV}
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["fork", "fork", "child", "spawn", "exit", "0"], out.stdout
