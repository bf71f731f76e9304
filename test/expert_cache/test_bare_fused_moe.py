"""``sglang/test/bare_fused_moe.py``: the stand-ins for upstream's CUDA kernel wheel that let the
GPU checks run upstream's Triton fused MoE on the lent machine. Their arithmetic against plain
torch, the stand-in package's import behaviour (in a fresh process), and that nothing is
installed where it is not needed. The align stand-in's Triton path runs under Triton's
interpreter in ``test_triton_slot_path.py``; its sort path (prefill chunks) here."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from sglang.test import bare_fused_moe


def test_moe_sum_reduce_sums_top_k_in_float32_once_rounded():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 8, 64, generator=g).bfloat16()
    out = torch.empty(5, 64, dtype=torch.bfloat16)
    bare_fused_moe.moe_sum_reduce(x, out, 2.5)
    want = (x.double().sum(1) * 2.5).bfloat16()
    assert torch.equal(out, want)


def test_silu_and_mul_is_silu_gate_times_up():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, 2 * 48, generator=g).bfloat16()
    out = torch.empty(7, 48, dtype=torch.bfloat16)
    ret = bare_fused_moe.silu_and_mul(x, out, expert_ids=None, expert_step=1)
    gate, up = x.double()[:, :48], x.double()[:, 48:]
    want = (torch.nn.functional.silu(gate) * up).bfloat16()
    assert ret is out
    assert (out.double() - want.double()).abs().max() <= 2**-7 * want.double().abs().max()


def test_align_refuses_what_it_does_not_stand_in_for():
    ids = torch.zeros(4, 1, dtype=torch.int32)
    z = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="ignore_invalid_expert=True"):
        bare_fused_moe.moe_align_block_size(ids, 9, 16, z, z, z, z, True, True)


def _align_reference(ids, num_experts, block_size):
    """The "+1 offset" align in plain Python: (the used prefix of sorted_token_ids, expert_ids
    of the used blocks, total)."""
    flat = [int(v) + 1 for v in ids.reshape(-1)]
    numel = len(flat)
    sorted_ids, expert_ids = [], []
    for b in range(num_experts):
        members = [i for i, v in enumerate(flat) if v == b]
        if not members:
            continue
        n = -(-len(members) // block_size) * block_size
        sorted_ids += members + [numel] * (n - len(members))
        expert_ids += [b - 1] * (n // block_size)
    return sorted_ids, expert_ids, len(sorted_ids)


@pytest.mark.parametrize("T, K, E, block", [(300, 8, 64, 16), (37, 8, 256, 64), (1024, 2, 8, 32)])
def test_align_by_sort_matches_the_plus_one_offset_contract(T, K, E, block):
    """The align of prefill chunks (above ``ALIGN_MAX_ENTRIES``): every bucket's entries in
    entry order, padded with ``numel`` to a block multiple, the blocks' experts (-1 for the
    filtered bucket), the total; the buffers past the total untouched."""
    g = torch.Generator().manual_seed(T + E)
    ids = torch.randint(-1, E, (T, K), generator=g, dtype=torch.int32)
    ids[: T // 4] = torch.randint(0, 3, (T // 4, K), generator=g, dtype=torch.int32)  # skew
    cap = T * K + (E + 1) * block
    sorted_ids = torch.full((cap,), -7, dtype=torch.int32)
    expert_ids = torch.full((cap // block,), -7, dtype=torch.int32)
    post_pad = torch.zeros(1, dtype=torch.int32)
    z = torch.zeros(1, dtype=torch.int32)
    bare_fused_moe.moe_align_block_size(ids, E + 1, block, sorted_ids, expert_ids, post_pad, z)
    want_sorted, want_experts, total = _align_reference(ids, E + 1, block)
    assert int(post_pad) == total
    assert sorted_ids[:total].tolist() == want_sorted
    assert expert_ids[: total // block].tolist() == want_experts
    assert (sorted_ids[total:] == -7).all() and (expert_ids[total // block :] == -7).all()


def test_nothing_is_installed_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert bare_fused_moe.install_cuda_standins() == []
    import sgl_kernel  # our CPU alias, untouched

    assert not isinstance(sgl_kernel, bare_fused_moe._StandinModule)


def test_the_standin_package_imports_every_name_and_raises_on_calls_it_does_not_provide():
    # The module file alone (it imports only torch): importing the sglang package costs ~20 s.
    code = f"""
import importlib.util, sys
spec = importlib.util.spec_from_file_location("bare_fused_moe", {bare_fused_moe.__file__!r})
b = importlib.util.module_from_spec(spec)
spec.loader.exec_module(b)
sys.modules.pop("sgl_kernel", None)
sys.meta_path.insert(0, b._StandinFinder())
import sgl_kernel
from sgl_kernel import moe_sum_reduce, moe_align_block_size, int8_scaled_mm
from sgl_kernel.quantization import ggml_dequantize
from sgl_kernel.scalar_type import scalar_types
assert moe_sum_reduce is b.moe_sum_reduce and moe_align_block_size is b.moe_align_block_size
assert repr(scalar_types.uint4b8) == "<missing sgl_kernel.scalar_type.scalar_types.uint4b8>"
for fn in (int8_scaled_mm, ggml_dequantize, scalar_types.uint4b8):
    try:
        fn(1, 2)
    except RuntimeError as e:
        assert "absent on this machine" in str(e), e
    else:
        raise AssertionError(repr(fn) + " did not raise")
print("standin-ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "standin-ok" in proc.stdout, proc.stderr[-3000:]


def test_a_namespace_folder_is_not_upstreams_package(tmp_path, monkeypatch):
    """Under pytest ``test/`` is on ``sys.path`` and ``test/sgl_kernel/`` (no ``__init__.py``)
    imports as a namespace package named ``sgl_kernel``: that is not upstream's wheel."""
    (tmp_path / "ns_only_pkg").mkdir()
    monkeypatch.syspath_prepend(str(tmp_path))
    assert not bare_fused_moe.has_real_package("ns_only_pkg")
    assert bare_fused_moe.has_real_package("json")
    assert not bare_fused_moe.has_real_package("no_such_package_here")
