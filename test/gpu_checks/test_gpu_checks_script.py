"""``scripts/gpu_checks.sh`` on this machine: its preflight, with fakes for what a lent GPU
machine has (``nvidia-smi``, a CUDA torch, ``nvcc``, the carried wheels), stops with a clear
message at each missing piece, naming all of them at once; with every piece faked, the dry run
plans the steps, and a run with a fake interpreter goes through the steps, their summary, a
failing step (later steps not run), a skipped GPU test (a failure there) and the time budget.
Nothing is built; each case takes a fraction of a second (the real CPU torch case a few)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_checks.sh"
WHEEL = "sglang-0.5.23-cp312-cp312-manylinux_2_34_x86_64.whl"
PROBE = {
    "python": "3.12",
    "torch": "2.11.0+cu130",
    "torch_cuda": "13.0",
    "cuda_available": "1",
    "gpu_name": "NVIDIA H200",
    "capability": "9.0",
    "triton": "3.6.0",
    "pytest": "9.0.0",
    "hypothesis": "6.0",
    "ninja": "found",
}

FAKE_PYTHON = r"""#!/usr/bin/env bash
# A stand-in interpreter: answers the preflight probe from $FAKE_PROBE, writes pytest's junit
# report, fails when its arguments contain $FAKE_FAIL, else prints its arguments.
case "$*" in
  *'print("python='*) cat "$FAKE_PROBE"; exit 0;;
esac
for a in "$@"; do
  case "$a" in --junitxml=*)
    echo "<testsuite name=\"pytest\" errors=\"0\" failures=\"0\" skipped=\"${FAKE_SKIPPED:-0}\" tests=\"3\">" > "${a#--junitxml=}";;
  esac
done
echo "fake python: $*"
if [ -n "${FAKE_FAIL:-}" ] && [[ "$*" == *"$FAKE_FAIL"* ]]; then
  [ -n "${FAKE_CRASH:-}" ] && { echo "Fatal Python error: Segmentation fault"; exit 139; }
  exit 3
fi
exit 0
"""


# The files of the tests step (scripts/gpu_checks.sh TESTS), each its own step.
TEST_FILES = (
    "test_cuda_op",
    "test_cuda_pack_pin",
    "test_cuda_sources",
    "test_cuda_cache",
    "test_triton_slot_path",
    "test_gdn_emit_triton",
)


def _exe(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o755)


@pytest.fixture
def machine(tmp_path):
    """A fake lent machine: returns (env, dirs) with every piece present."""
    bin_ = tmp_path / "bin"
    cuda = tmp_path / "cuda"
    wheels = tmp_path / "wheels"
    for d in (bin_, cuda / "bin", wheels):
        d.mkdir(parents=True)
    _exe(bin_ / "nvidia-smi", "#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-fake)'\n")
    _exe(bin_ / "python-fake", FAKE_PYTHON)
    _exe(
        cuda / "bin" / "nvcc",
        "#!/bin/sh\necho 'Cuda compilation tools, release 13.0, V13.0.0'\necho 'Build cuda_13.0'\n",
    )
    for name in (WHEEL, "orjson-3.13.0-cp312-cp312-manylinux_2_17_x86_64.whl"):
        (wheels / name).write_bytes(b"")
    (wheels / "MANIFEST").write_text(
        f"{WHEEL}\norjson-3.13.0-cp312-cp312-manylinux_2_17_x86_64.whl\n"
    )
    probe = tmp_path / "probe.txt"
    probe.write_text("".join(f"{k}={v}\n" for k, v in PROBE.items()))
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_HOME", "CUDA_PATH", "PYTHONPATH")}
    env.update(
        PATH=f"{bin_}:{env['PATH']}",
        PYTHON=str(bin_ / "python-fake"),
        CUDA_HOME=str(cuda),
        GPU_WHEELS=str(wheels),
        GPU_SITE=str(tmp_path / "site"),
        OUT=str(tmp_path / "out"),
        FAKE_PROBE=str(probe),
    )
    return env, dict(bin=bin_, cuda=cuda, wheels=wheels, probe=probe, out=tmp_path / "out")


def run(env, *args):
    proc = subprocess.run(
        ["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=120
    )
    summary = (Path(env["OUT"]) / "summary.txt").read_text()
    return proc.returncode, proc.stdout + proc.stderr, summary


def problems(out: str) -> list[str]:
    return [line[4:] for line in out.splitlines() if line.startswith("  - ")]


def set_probe(dirs, **changes):
    dirs["probe"].write_text("".join(f"{k}={changes.get(k, v)}\n" for k, v in PROBE.items()))


def test_dry_run_with_every_piece_present_plans_the_steps(machine):
    env, _ = machine
    rc, out, summary = run(env, "--dry-run")
    assert rc == 0, out
    assert "machine: NVIDIA H200 (sm 9.0), python 3.12, torch 2.11.0+cu130" in out
    assert "release 13.0" in out
    assert "dry run: every piece is here; the steps would be: install apply build tests" in out
    assert "dry run" in summary and not problems(out)


MISSING = {
    "gpu": ("no GPU: nvidia-smi -L lists none", None),
    "cuda torch": ("has no CUDA build (torch.version.cuda is None)", {"torch_cuda": "None"}),
    "gpu unseen": ("sees no GPU: torch.cuda.is_available() is False", {"cuda_available": "0"}),
    "nvcc": ("no nvcc at", None),
    "manifest": ("missing wheels: no", None),
    "a wheel": ("missing wheels in", None),
    "python": ("wheels for another python: " + WHEEL + ", but", {"python": "3.11"}),
    "ninja": ("no ninja for", {"ninja": "missing"}),
}


@pytest.mark.parametrize("piece", list(MISSING))
@pytest.mark.parametrize("dry", [True, False])
def test_each_missing_piece_stops_with_its_message(machine, piece, dry):
    env, dirs = machine
    message, probe = MISSING[piece]
    if probe:
        set_probe(dirs, **probe)
    if piece == "gpu":
        _exe(dirs["bin"] / "nvidia-smi", "#!/bin/sh\necho 'No devices were found'\nexit 6\n")
    elif piece == "nvcc":
        (dirs["cuda"] / "bin" / "nvcc").unlink()
    elif piece == "manifest":
        (dirs["wheels"] / "MANIFEST").unlink()
    elif piece == "a wheel":
        (dirs["wheels"] / WHEEL).unlink()
    rc, out, summary = run(env, *(["--dry-run"] if dry else []))
    assert rc == 2, out
    assert "cannot run, 1 missing piece(s)" in out
    (line,) = problems(out)
    assert message in line, out
    assert message in summary
    assert "make gpu-wheels" in line or piece not in ("manifest", "a wheel")
    assert "== install" not in out  # nothing ran


def test_this_cpu_machine_lacks_every_gpu_piece(machine):
    """The real interpreter of this machine (CPU torch), no nvidia-smi that answers, no
    toolkit, no wheels: all four named in one stop."""
    env, dirs = machine
    env["PYTHON"] = sys.executable
    _exe(dirs["bin"] / "nvidia-smi", "#!/bin/sh\nexit 9\n")
    env["CUDA_HOME"] = str(dirs["cuda"] / "absent")
    env["GPU_WHEELS"] = str(dirs["wheels"] / "absent")
    rc, out, _ = run(env, "--dry-run")
    assert rc == 2, out
    found = problems(out)
    import torch

    want = ["no GPU", "no nvcc at", "missing wheels: no"]
    want.append("has no CUDA build" if torch.version.cuda is None else "sees no GPU")
    assert len(found) == 4, out
    for w in want:
        assert any(w in p for p in found), (w, found)


def test_a_run_goes_through_every_step_and_summarizes(machine):
    env, _ = machine
    rc, out, summary = run(env)
    assert rc == 0, out
    for name in ("install", "apply", "build", "cuda-op", "control", "step", "prefill"):
        assert f"PASS  {name} " in summary, (name, summary)
    for test_file in TEST_FILES:  # one pytest process and report per file
        assert f"PASS  tests:{test_file} " in summary, (test_file, summary)
        assert f'tests:{test_file}: errors="0" failures="0" skipped="0" tests="3"' in summary
    assert "every step passed" in summary
    assert "TORCH_CUDA_ARCH_LIST=9.0" in (Path(env["OUT"]) / "log.txt").read_text()


def test_a_failing_step_stops_the_steps_that_need_it(machine):
    env, _ = machine
    env["FAKE_FAIL"] = "setup.py"
    rc, out, summary = run(env)
    assert rc == 1
    assert "FAIL  build" in summary and "(exit 3); its last lines:" in summary
    assert "stopping: build failed" in summary and "PASS  tests" not in summary


def test_a_crashing_test_file_loses_only_itself(machine):
    """A native crash in one file (faulthandler's "Fatal Python error") fails that file, says
    so (with gdb's backtrace where the machine has gdb: not faked here), and the other files
    and the later steps still run."""
    env, _ = machine
    env["FAKE_FAIL"] = "test_cuda_cache.py"
    env["FAKE_CRASH"] = "1"
    rc, _, summary = run(env)
    assert rc == 1
    assert "FAIL  tests:test_cuda_cache " in summary
    assert "tests:test_cuda_cache crashed" in summary
    for test_file in TEST_FILES:
        if test_file != "test_cuda_cache":
            assert f"PASS  tests:{test_file} " in summary, (test_file, summary)
    assert "PASS  step " in summary


def test_a_skipped_gpu_test_fails_the_run(machine):
    env, _ = machine
    env["FAKE_SKIPPED"] = "2"
    rc, _, summary = run(env)
    assert rc == 1
    assert "FAIL  tests:test_cuda_op: a GPU test skipped on the GPU machine" in summary


def test_steps_beyond_the_budget_are_skipped_with_how_to_rerun(machine):
    env, _ = machine
    env["GPU_CHECKS_BUDGET"] = "10"
    rc, _, summary = run(env)
    assert rc == 1
    assert 'SKIP  install: the 10s budget is spent (rerun with GPU_CHECKS_STEPS="install' in summary
    env["GPU_CHECKS_BUDGET"] = "540"
    env["GPU_CHECKS_STEPS"] = "tests"
    rc, _, summary = run(env)
    assert rc == 0 and "PASS  tests:test_cuda_op " in summary and "PASS  build" not in summary
