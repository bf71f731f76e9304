"""``benchmark/expert_cache/bench_prefill_stream.py`` on the CPU (its CUDA form runs in
``scripts/gpu_checks.sh``): it runs every path at every length, the outputs of the three paths
are identical (the script exits 1 otherwise), every pass of the two stream paths was streamed,
the output says the link is simulated, and the last line carries the issue's keys. No timing
is asserted."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

SCRIPT = (
    Path(__file__).resolve().parents[2] / "benchmark" / "expert_cache" / "bench_prefill_stream.py"
)
_spec = importlib.util.spec_from_file_location("bench_prefill_stream", SCRIPT)
bench = importlib.util.module_from_spec(_spec)
sys.modules["bench_prefill_stream"] = bench
_spec.loader.exec_module(bench)

SMALL = "--layers 3 --experts 8 --top-k 2 --hidden 64 --intermediate 32 --reps 1".split()
SMALL += "--lengths 4,16 --link-gbps 50 --threads 1".split()


def test_cpu_run_prints_every_path_and_the_overlap(capsys):
    assert bench.main(SMALL) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert "SIMULATED link" in out[0]
    rows = [line.split() for line in out if line.startswith("# ") and line.split()[1].isdigit()]
    assert [(r[1], r[2]) for r in rows] == [
        (T, p) for T in ("4", "16") for p in ("two_buffers", "one_buffer", "split")
    ]
    last = out[-1].split()
    assert last[0] == "expert_cache_prefill_stream"
    kv = dict(f.split("=", 1) for f in last[1:])
    for T in (4, 16):
        for p in ("two", "one", "split"):
            assert float(kv[f"tok_s_{p}_{T}"]) > 0
    assert kv["simulated_link_gbps"] == "50"
    assert math.isfinite(float(kv["overlap_ratio"])) and list(kv)[-1] == "overlap_ratio"


def test_cuda_without_a_gpu_fails_loudly(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the CUDA form runs in scripts/gpu_checks.sh")
    with pytest.raises(SystemExit) as e:
        bench.main(["--device", "cuda"])
    assert e.value.code == 1
    assert "without a CUDA device" in capsys.readouterr().err
