"""``benchmark/expert_cache/bench_bandwidth.py`` runs end to end on small shapes and prints its line."""

import re
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmark" / "expert_cache" / "bench_bandwidth.py"


def test_bandwidth_benchmark_prints_measured_figures():
    proc = subprocess.run(
        [
            sys.executable,
            str(BENCH),
            "--layers",
            "1",
            "--experts",
            "16",
            "--hidden",
            "64",
            "--inter",
            "32",
            "--top-k",
            "4",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "source measured" in proc.stdout
    m = re.search(
        r"expert_cache_bandwidth measure_ms=(\d+) fill_gbps=(\S+) cpu_gbps=(\S+) "
        r"fill_ratio=(\S+)$",
        proc.stdout.strip(),
    )
    assert m, proc.stdout
    fill, cpu, ratio = float(m[2]), float(m[3]), float(m[4])
    assert fill > 0 and cpu > 0 and abs(ratio - fill / cpu) < 0.01 * ratio + 1e-3
