"""``benchmark/expert_cache/bench_gpu_step.py`` on the CPU (its GPU form, graph replays
included, runs in ``scripts/gpu_checks.sh``): every configuration prints its figures, the step
outputs are identical across cache sizes and policies (on the CPU they compute the same), the
counters follow the policies, the last line carries the issue's keys; a routing trace replays,
and a trace of another shape is refused with the flags to give."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmark" / "expert_cache" / "bench_gpu_step.py"
_spec = importlib.util.spec_from_file_location("bench_gpu_step", SCRIPT)
bench = importlib.util.module_from_spec(_spec)
sys.modules["bench_gpu_step"] = bench  # dataclasses look their module up
_spec.loader.exec_module(bench)

SMALL = "--device cpu --layers 2 --experts 16 --top-k 4 --hidden 64 --intermediate 32".split()
SMALL += "--warmup 1 --steps 2 --cpu-threads 1".split()


def run(capsys, *extra: str) -> tuple[list[str], dict]:
    assert bench.main(SMALL + list(extra)) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    last = lines[-1].split()
    assert last[0] == "expert_cache_gpu_step"
    return lines, dict(kv.split("=", 1) for kv in last[1:])


def config_lines(lines: list[str]) -> dict:
    out = {}
    for line in lines:
        m = re.match(r"^c(\S+) (\w+)\s+slots=(\d+) (.*)$", line)
        if m:
            fields = dict(kv.split("=", 1) for kv in m[4].split() if "=" in kv)
            out[(m[1], m[2])] = {"slots": int(m[3]), **fields}
    return out


def test_cpu_run_prints_every_configuration_and_the_last_line(capsys):
    lines, last = run(capsys, "--batch", "2")
    configs = config_lines(lines)
    assert set(configs) == {(s, p) for s in ("37", "11", "100") for p in ("qstar", "fill", "cpu")}
    for key, c in configs.items():
        assert float(c["out_err"]) == 0.0, f"{key}: the step output differs from c37 qstar's"
        assert float(c["eager_ms"]) > 0 and c["graph_ms"] == "nan"  # no graph on the CPU
    for p in ("qstar", "fill", "cpu"):
        assert float(configs[("100", p)]["hit"]) == 1.0  # the load-time placement holds all
    for s in ("37", "11"):
        assert float(configs[(s, "cpu")]["q_per_call"]) == 0.0
        assert float(configs[(s, "fill")]["q_per_call"]) > 0
        assert float(configs[(s, "qstar")]["q_per_call"]) >= 1.0  # at least one fill per miss
    assert configs[("37", "qstar")]["slots"] == round(0.37 * 2 * 16)
    keys = ["step_ms_c37", "roofline_ratio_c37", "qstar_vs_fill", "qstar_vs_cpu"]
    assert list(last)[:5] == keys + ["graph_vs_eager"]
    for k in keys + ["b_p_gbps", "b_h_gbps", "b_d_gbps"]:
        assert float(last[k]) > 0 and math.isfinite(float(last[k])), k
    assert last["graph_vs_eager"] == "nan" and last["device"] == "cpu"
    assert any(line.startswith("# routing: synthetic") and "reuse" in line for line in lines)


def test_a_routing_trace_replays_and_a_wrong_shape_is_refused(capsys, tmp_path):
    import random

    rng = random.Random(0)
    path = tmp_path / "routing.jsonl"
    with path.open("w") as f:
        for step in range(8):
            for layer in range(2):
                experts = sorted(rng.sample(range(16), 4))
                rec = dict(step=step, layer=layer, phase="decode", tokens=1, experts=experts)
                f.write(json.dumps(rec | dict(counts=[1] * 4, num_experts=16, num_layers=2)))
                f.write("\n")
    lines, last = run(capsys, "--trace", str(path), "--sizes", "37", "--policies", "qstar")
    assert any(line.startswith(f"# routing: trace={path}") for line in lines)
    assert float(last["step_ms_c37"]) > 0 and last["qstar_vs_fill"] == "nan"
    with pytest.raises(SystemExit, match="give --layers 2 --experts 16"):
        bench.main([*SMALL[:3], "3", *SMALL[4:], "--trace", str(path)])
    with pytest.raises(SystemExit, match="this run needs 10"):
        bench.main(SMALL + ["--trace", str(path), "--steps", "4"])
