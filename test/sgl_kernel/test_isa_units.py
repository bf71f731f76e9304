"""The SIMD units generated from ``csrc/cpu/isa/isa_units.h`` (by sgl-kernel/setup.py): one .cpp
per listed unit, each for the level it names, and every listed level known to the dispatcher."""

import re
from pathlib import Path

import pytest
import torch

KERNEL = Path(__file__).resolve().parents[2] / "sgl-kernel"
UNIT = re.compile(r"^\s*SGLK_ISA_UNIT\((\w+), (\w+), (\d), (\"\"|\w+), ([01])\)", re.M)


def listed_units():
    return UNIT.findall((KERNEL / "csrc" / "cpu" / "isa" / "isa_units.h").read_text())


def test_every_listed_unit_was_generated_and_built():
    units = listed_units()
    assert {(f, n) for f, n, *_ in units} >= {("kernels", "scalar"), ("cpu_executor", "avx512bf16")}
    gen = KERNEL / "build" / "isa_units"
    assert sorted(p.stem for p in gen.glob("*.cpp")) == sorted(f"{f}_{n}" for f, n, *_ in units)
    for family, name, level, _target, dpbf16 in units:
        text = (gen / f"{family}_{name}.cpp").read_text()
        assert f"#define SGLK_ISA_FAMILY_{family.upper()} 1" in text
        assert (
            f"#define SGLK_ISA_LEVEL {level}\n" in text
            and f"#define SGLK_ISA_DPBF16 {dpbf16}\n" in text
        )
        assert f"#define SGLK_ISA_GETTER sglk_{family}_{name}\n" in text


@pytest.mark.parametrize("name", sorted({n for _, n, *_ in listed_units()}))
def test_every_listed_level_is_known_to_the_dispatcher(name):
    """Selectable, or refused as unsupported by this CPU (never as an unknown name)."""
    try:
        assert torch.ops.sgl_kernel.set_cpu_isa(name) == name
    except RuntimeError as e:
        assert "does not support" in str(e), str(e)
    finally:
        torch.ops.sgl_kernel.set_cpu_isa("auto")
