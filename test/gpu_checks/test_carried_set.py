"""What a lent GPU session carries (``scripts/gpu_carry.py``, ``make gpu-wheels``) stays under
the device tool's 64 MiB: the working tree measured here plus the wheel set's size as last
measured (and the real set, where ``make gpu-wheels`` has been run); the size check fails above
the limit and without a manifest; the pins are exact and agree with ``requirements/cpu.txt``.
No download: the wheel files here are sparse stand-ins."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("gpu_carry", REPO / "scripts" / "gpu_carry.py")
carry = importlib.util.module_from_spec(_spec)
sys.modules["gpu_carry"] = carry
_spec.loader.exec_module(carry)

# `make gpu-wheels` on 2026-12-02: sglang 0.5.23 cp312 (37.2 MiB) + requirements/gpu-carry.txt.
# Update it when the set changes; the test below compares it with a real set where one exists.
CARRIED_WHEELS_MIB = 45.6
MIB = 1 << 20


def _wheels(dest: Path, sizes: dict) -> None:
    dest.mkdir()
    for name, mib in sizes.items():
        with open(dest / name, "wb") as f:
            f.truncate(int(mib * MIB))  # sparse: st_size counts, no disk used
    (dest / carry.MANIFEST).write_text("\n".join(sizes) + "\n")


def test_the_tree_and_the_wheel_set_fit_in_one_call():
    tree = carry.size_of(carry.tree_files()) / MIB
    assert tree + CARRIED_WHEELS_MIB < carry.LIMIT_MIB - 4, (
        f"working tree {tree:.1f} MiB + wheels {CARRIED_WHEELS_MIB} MiB leave under 4 MiB of "
        f"the {carry.LIMIT_MIB} MiB a device call carries"
    )


def test_the_real_wheel_set_matches_the_recorded_size(capsys):
    if not (carry.DEST / carry.MANIFEST).is_file():
        pytest.skip("no .gpu-wheels here (make gpu-wheels downloads it)")
    real = carry.size_of(carry.DEST.glob("*.whl")) / MIB
    assert abs(real - CARRIED_WHEELS_MIB) < 0.05 * CARRIED_WHEELS_MIB, (
        f".gpu-wheels holds {real:.1f} MiB; update CARRIED_WHEELS_MIB ({CARRIED_WHEELS_MIB})"
    )
    names = (carry.DEST / carry.MANIFEST).read_text().split()
    assert sorted(names) == sorted(p.name for p in carry.DEST.glob("*.whl"))
    assert carry.report(carry.DEST) == 0


def test_the_size_check_fails_over_the_limit_and_without_a_manifest(tmp_path, capsys):
    _wheels(tmp_path / "ok", {"sglang-0.5.23-cp312-cp312-x.whl": 37.2, "a-1-py3-none-any.whl": 8})
    assert carry.report(tmp_path / "ok") == 0
    out = capsys.readouterr().out
    assert re.search(r"carried wheels: 45\.2 MiB in 2 wheels", out), out
    assert re.search(r"total: +\d+\.\d MiB of the 64 MiB", out), out
    _wheels(tmp_path / "big", {"sglang-0.5.23-cp312-cp312-x.whl": 37.2, "b-1-py3-none-any.whl": 30})
    assert carry.report(tmp_path / "big") == 1
    assert "over the limit by" in capsys.readouterr().err
    (tmp_path / "ok" / carry.MANIFEST).unlink()
    assert carry.report(tmp_path / "ok") == 1
    assert "run `make gpu-wheels`" in capsys.readouterr().err


def test_pins_are_exact_and_agree_with_the_cpu_requirements(tmp_path):
    pins = dict(p.split("==") for p in carry.pins())
    assert pins and "sglang" not in pins
    cpu = {}
    for line in (REPO / "requirements" / "cpu.txt").read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9._-]+)==(\S+)", line)
        if m:
            cpu[carry.norm(m[1])] = m[2]
    shared = [n for n in pins if carry.norm(n) in cpu]
    assert shared, "no package pinned in both files: the check below would test nothing"
    for name in shared:
        assert cpu[carry.norm(name)] == pins[name], name
    loose = tmp_path / "pins.txt"
    loose.write_text("pydantic>=2\n")
    with pytest.raises(SystemExit, match="not an exact pin"):
        carry.pins(loose)
