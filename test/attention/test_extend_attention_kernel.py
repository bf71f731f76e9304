"""Our CPU flash kernel for torch_native extend (``sgl_kernel_fork.extend_attention``).

* the op against a float64 softmax reference: causal (bottom-right aligned, prefix 0 and long
  prefixes, rows not a multiple of the 64-row block, a single row), non-causal, GQA ratios
  1/2/4/8, head dims 64/128/256, keys not a multiple of the 64-key block;
* ``kv_index`` (keys read from a KV pool in place) gives the gathered copy's result exactly;
* results do not depend on the thread count (each output row is computed by one thread);
* ``sdpa_extend_new_rows`` takes it for bf16 layers without a window (no ATen attention call
  made) and its result matches the ATen paths (``use_kernel=False``) on mixed batches;
* bad input is refused with the reason; the scalar kernel level keeps the ATen paths.

Every kernel test runs once per ISA path the CPU has (``level``): ``avx512bf16`` (vdpbf16ps, P
rounded to bf16) and ``avx2`` (AVX2 FMA fp32, taken at the avx512 and avx2 levels), selected
with ``set_cpu_isa``; the fallback test runs everywhere.
"""

import math
import os

import pytest
import torch
from test_torch_native_extend import count_sdpa, make_batch, reference, run_new

import sgl_kernel_fork
from sglang.srt.layers.attention import torch_native_extend as tne


def _has_level(name: str) -> bool:
    before = sgl_kernel_fork.cpu_isa()
    try:
        return sgl_kernel_fork.set_cpu_isa(name) == name
    except RuntimeError:  # the CPU lacks it
        return False
    finally:
        sgl_kernel_fork.set_cpu_isa(before)


# The kernel's two paths; a CPU with neither (not x86-64 with AVX2) generates no kernel test.
# The `level` fixture (conftest.py) runs a test at each of them.
LEVELS = [name for name in ("avx512bf16", "avx512", "avx2") if _has_level(name)]


# bf16 inputs, fp32 softmax, P rounded to bf16, bf16 output (|out| <~ 1: half an ulp 2e-3).
TOL = dict(atol=1.5e-2, rtol=2e-2)


def ref_attention(q, k, v, q_pos0, scale, causal):
    """float64 softmax attention; q [R, H, D], k / v [P, Hkv, D] -> [R, H, D]."""
    rows, heads, _ = q.shape
    keys, kv_heads, _ = k.shape
    rep = heads // kv_heads
    qd = q.double()
    kd = k.double().repeat_interleave(rep, 1)
    vd = v.double().repeat_interleave(rep, 1)
    s = torch.einsum("rhd,phd->hrp", qd, kd) * scale
    if causal:
        pos = torch.arange(rows).unsqueeze(1) + q_pos0
        s = s.masked_fill(torch.arange(keys).unsqueeze(0) > pos, float("-inf"))
    return torch.einsum("hrp,phd->rhd", s.softmax(-1), vd)


def rand(*shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).bfloat16()


CASES = [
    # rows, q_pos0 (prefix), heads, kv_heads, dim, causal
    (1, 0, 4, 2, 64, True),
    (1, 300, 4, 2, 64, True),
    (5, 0, 4, 2, 64, True),
    (64, 64, 4, 4, 64, True),
    (70, 130, 8, 1, 64, True),
    (129, 1000, 8, 2, 128, True),
    (33, 77, 4, 1, 256, True),
    (20, 100, 4, 2, 64, False),
    (3, 1, 2, 2, 128, False),
]


@pytest.mark.parametrize("rows,q_pos0,heads,kv_heads,dim,causal", CASES)
def test_op_matches_float64(level, rows, q_pos0, heads, kv_heads, dim, causal):
    keys = q_pos0 + rows if causal else q_pos0
    q = rand(rows, heads, dim, seed=1)
    k = rand(keys, kv_heads, dim, seed=2)
    v = rand(keys, kv_heads, dim, seed=3)
    out = torch.full_like(q, float("nan"))
    scale = 1.0 / math.sqrt(dim)
    sgl_kernel_fork.extend_attention(q, k, v, out, q_pos0, scale, causal)
    torch.testing.assert_close(out.double(), ref_attention(q, k, v, q_pos0, scale, causal), **TOL)


def test_large_logits_and_strided_views(level):
    """Scores of magnitude ~50 (online softmax rescaling) through strided q / out views."""
    rows, heads, dim, prefix = 90, 4, 64, 400
    q = (rand(rows, heads + 2, dim, seed=4) * 8)[:, 1 : heads + 1]  # non-contiguous heads
    k = rand(prefix + rows, 2, dim, seed=5) * 8
    v = rand(prefix + rows, 2, dim, seed=6)
    big = torch.full((rows, heads + 2, dim), float("nan"), dtype=torch.bfloat16)
    out = big[:, 1 : heads + 1]
    sgl_kernel_fork.extend_attention(q, k, v, out, prefix, 0.125, True)
    torch.testing.assert_close(out.double(), ref_attention(q, k, v, prefix, 0.125, True), **TOL)
    assert torch.isnan(big[:, 0]).all() and torch.isnan(big[:, -1]).all()  # nothing else written


@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("rows,causal", [(1, False), (7, True)])
def test_kv_index_reads_the_pool_in_place(level, index_dtype, rows, causal):
    """``kv_index``: k / v are a KV pool and key j is its row kv_index[j]; the result is the
    one of the gathered copy, bit for bit (the same keys in the same order)."""
    slots, keys, kv_heads, dim = 500, 150, 2, 128
    pool_k = rand(slots, kv_heads, dim, seed=10)
    pool_v = rand(slots, kv_heads, dim, seed=11)
    g = torch.Generator().manual_seed(12)
    idx = torch.randperm(slots, generator=g)[:keys].to(index_dtype)
    q = rand(rows, 8, dim, seed=13)
    want, got = torch.empty_like(q), torch.empty_like(q)
    q_pos0 = keys - rows
    sgl_kernel_fork.extend_attention(
        q, pool_k[idx.long()], pool_v[idx.long()], want, q_pos0, 0.1, causal
    )
    sgl_kernel_fork.extend_attention(q, pool_k, pool_v, got, q_pos0, 0.1, causal, kv_index=idx)
    assert torch.equal(got, want)
    with pytest.raises(RuntimeError, match="outside the 500 rows"):
        bad = idx.clone()
        bad[3] = slots
        sgl_kernel_fork.extend_attention(q, pool_k, pool_v, got, q_pos0, 0.1, causal, kv_index=bad)


def outputs_at_thread_counts(q, k, v, q_pos0, scale, causal, counts=(1, 2)):
    """The op's output at each torch thread count of ``counts`` (the count restored after)."""
    outs = []
    before = torch.get_num_threads()
    try:
        for n in counts:
            torch.set_num_threads(n)
            out = torch.empty_like(q)
            sgl_kernel_fork.extend_attention(q, k, v, out, q_pos0, scale, causal)
            outs.append(out)
    finally:
        torch.set_num_threads(before)
    return outs


def test_thread_count_does_not_change_results(level):
    q = rand(150, 4, 64, seed=7)
    k = rand(2150, 2, 64, seed=8)
    v = rand(2150, 2, 64, seed=9)
    outs = outputs_at_thread_counts(q, k, v, 2000, 0.125, True)
    assert torch.equal(outs[0], outs[1])


def test_extend_takes_the_kernel_and_matches_aten(level):
    """Mixed batch (prefix 0, extend 1, long prefix), GQA, dim 64 in bf16: no ATen attention
    call with the kernel, and the same result as the ATen paths within bf16 tolerance."""
    prefix, extend = [0, 37, 900, 3], [19, 1, 40, 70]
    args, full_q = make_batch(prefix, extend, 8, 2, 64, 64, torch.bfloat16, seed=11)
    args.update(scaling=0.125, causal=True, enable_gqa=True)
    with count_sdpa(tne) as rec:
        out = run_new(args, 64)
    assert rec.calls == []
    aten = run_new(args, 64, use_kernel=False)
    ref = reference(args, full_q, prefix, scale=0.125, causal=True)
    torch.testing.assert_close(out.double(), ref, **TOL)
    torch.testing.assert_close(out.float(), aten.float(), **TOL)


def test_window_and_float32_keep_aten(level):
    for dtype, window in ((torch.bfloat16, 16), (torch.float32, None)):
        args, _ = make_batch([50], [20], 4, 2, 64, 64, dtype, seed=12)
        args.update(scaling=0.125, causal=True, enable_gqa=True, sliding_window_size=window)
        with count_sdpa(tne) as rec:
            run_new(args, 64)
        assert rec.calls, (dtype, window)


def test_bad_input_is_refused(level):
    q = rand(4, 4, 64, seed=1)
    k = rand(10, 2, 64, seed=2)
    out = torch.empty_like(q)
    with pytest.raises(RuntimeError, match="bfloat16"):
        sgl_kernel_fork.extend_attention(q.float(), k, k, out, 6, 0.125, True)
    with pytest.raises(RuntimeError, match="head dim 32"):
        q32 = rand(4, 4, 32, seed=1)
        k32 = rand(10, 2, 32, seed=2)
        sgl_kernel_fork.extend_attention(q32, k32, k32, torch.empty_like(q32), 6, 0.125, True)
    with pytest.raises(RuntimeError, match="need that many keys"):
        sgl_kernel_fork.extend_attention(q, k, k, out, 7, 0.125, True)
    with pytest.raises(RuntimeError, match="multiple of"):
        k3 = rand(10, 3, 64, seed=2)
        sgl_kernel_fork.extend_attention(q, k3, k3, out, 6, 0.125, True)


@pytest.mark.skipif(
    not {"avx512bf16", "avx2"} <= set(LEVELS), reason="needs both paths (an AVX-512 BF16 CPU)"
)
def test_the_level_picks_the_path():
    """avx512bf16 rounds P to bf16 before P V and avx2 does not: on the same input the two
    outputs differ (so set_cpu_isa reaches the kernel), both within tolerance of float64."""
    q, k, v = rand(64, 4, 64, seed=20), rand(600, 2, 64, seed=21), rand(600, 2, 64, seed=22)
    ref = ref_attention(q, k, v, 536, 0.125, True)
    outs = {}
    before = sgl_kernel_fork.cpu_isa()
    try:
        for name in ("avx512bf16", "avx2"):
            sgl_kernel_fork.set_cpu_isa(name)
            outs[name] = torch.empty_like(q)
            sgl_kernel_fork.extend_attention(q, k, v, outs[name], 536, 0.125, True)
            torch.testing.assert_close(outs[name].double(), ref, **TOL)
    finally:
        sgl_kernel_fork.set_cpu_isa(before)
    assert not torch.equal(outs["avx512bf16"], outs["avx2"])


def test_scalar_kernel_level_keeps_aten():
    """At the scalar kernel level (no SIMD path) the ATen paths run (and stay correct)."""
    before = sgl_kernel_fork.cpu_isa()
    try:
        sgl_kernel_fork.set_cpu_isa("scalar")
        assert not sgl_kernel_fork.extend_attention_supported(64)
        args, full_q = make_batch([30], [10], 4, 2, 64, 64, torch.bfloat16, seed=13)
        args.update(scaling=0.125, causal=True, enable_gqa=True)
        with count_sdpa(tne) as rec:
            out = run_new(args, 64)
        assert rec.calls
        ref = reference(args, full_q, [30], scale=0.125, causal=True)
        torch.testing.assert_close(out.double(), ref, atol=3e-2, rtol=3e-2)
    finally:
        sgl_kernel_fork.set_cpu_isa(before)


def test_off_switch_keeps_aten():
    """``SGLANG_CPU_EXTEND_ATTENTION=0`` (read at import) turns the kernel off for every layer."""
    import subprocess
    import sys

    code = (
        "import torch; from sglang.srt.layers.attention import torch_native_extend as t; "
        "x = torch.zeros(1, 1, 64, dtype=torch.bfloat16); "
        "print(t.extend_kernel_supported(x, x, x))"
    )
    env = {**os.environ, tne.KERNEL_OFF_ENV: "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"
    if LEVELS:  # and without the switch the same probe takes the kernel
        env.pop(tne.KERNEL_OFF_ENV)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert out.stdout.strip().splitlines()[-1] == "True", out.stderr[-2000:]
