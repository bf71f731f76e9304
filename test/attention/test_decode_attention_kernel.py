"""The decode path of our CPU attention kernel (``sgl-kernel/csrc/cpu/decode_attention.cpp``):
``extend_attention`` with at most 4 query rows reads K / V where they lie, in work items of
(row, KV head, 256-key chunk) merged per row and head.

* against the float64 reference: key counts around the chunk size (1, 255, 256, 257, 3000),
  GQA group sizes 1 to 16, head dims 64 / 128 / 256, 1 to 4 rows, causal and not;
* scores of magnitude ~50 that peak in different chunks (the merge's rescaling);
* ``kv_index`` gives the gathered copy's result bit for bit, also over many chunks;
* results do not depend on the thread count;
* 4 rows (decode path) and the same rows inside a 5-row call (flash path) agree within
  tolerance.

Each test runs once per ISA path the CPU has (the ``level`` fixture, conftest.py).
"""

import math

import pytest
import torch
from test_extend_attention_kernel import (
    LEVELS,
    TOL,
    outputs_at_thread_counts,
    rand,
    ref_attention,
)

import sgl_kernel_fork

pytestmark = pytest.mark.skipif(not LEVELS, reason="no kernel path on this CPU (not x86-64 AVX2)")


@pytest.mark.parametrize(
    "rows,keys,heads,kv_heads,dim,causal",
    [
        (1, 1, 4, 2, 64, False),
        (1, 255, 8, 1, 128, False),
        (1, 256, 16, 1, 64, False),
        (1, 257, 32, 4, 128, False),
        (1, 3000, 32, 4, 128, False),
        (2, 3000, 8, 8, 64, True),
        (3, 600, 16, 2, 256, True),
        (4, 260, 4, 4, 128, True),
        (4, 4, 4, 2, 64, True),
    ],
)
def test_decode_matches_float64(level, rows, keys, heads, kv_heads, dim, causal):
    q = rand(rows, heads, dim, seed=1)
    k = rand(keys, kv_heads, dim, seed=2)
    v = rand(keys, kv_heads, dim, seed=3)
    out = torch.full_like(q, float("nan"))
    scale = 1.0 / math.sqrt(dim)
    q_pos0 = keys - rows if causal else 0
    sgl_kernel_fork.extend_attention(q, k, v, out, q_pos0, scale, causal)
    torch.testing.assert_close(out.double(), ref_attention(q, k, v, q_pos0, scale, causal), **TOL)


def test_chunk_merge_with_large_logits(level):
    """Scores ~50 whose maxima lie in different chunks: each chunk's P is relative to its own
    max, so a wrong rescale in the merge is off by factors of e^tens."""
    keys, dim = 1100, 64
    q = rand(1, 8, dim, seed=4) * 8
    k = rand(keys, 2, dim, seed=5) * 8
    v = rand(keys, 2, dim, seed=6)
    out = torch.empty_like(q)
    sgl_kernel_fork.extend_attention(q, k, v, out, 0, 0.125, False)
    torch.testing.assert_close(out.double(), ref_attention(q, k, v, 0, 0.125, False), **TOL)


@pytest.mark.parametrize("rows,causal", [(1, False), (3, True)])
def test_decode_kv_index_reads_the_pool_in_place(level, rows, causal):
    slots, keys, kv_heads, dim = 4000, 1500, 4, 128
    pool_k = rand(slots, kv_heads, dim, seed=10)
    pool_v = rand(slots, kv_heads, dim, seed=11)
    idx = torch.randperm(slots, generator=torch.Generator().manual_seed(12))[:keys]
    q = rand(rows, 32, dim, seed=13)
    want, got = torch.empty_like(q), torch.empty_like(q)
    q_pos0 = keys - rows
    sgl_kernel_fork.extend_attention(q, pool_k[idx], pool_v[idx], want, q_pos0, 0.1, causal)
    sgl_kernel_fork.extend_attention(q, pool_k, pool_v, got, q_pos0, 0.1, causal, kv_index=idx)
    assert torch.equal(got, want)


def test_decode_thread_count_does_not_change_results(level):
    q = rand(2, 16, 128, seed=7)
    k = rand(2100, 2, 128, seed=8)
    v = rand(2100, 2, 128, seed=9)
    outs = outputs_at_thread_counts(q, k, v, 2098, 0.09, True)
    assert torch.equal(outs[0], outs[1])


def test_decode_and_flash_paths_agree(level):
    """Rows 1-4 of a 5-row causal call (the flash path) against the same 4 rows alone (the
    decode path, same keys): both within bf16 tolerance of each other."""
    keys, dim = 700, 64
    q = rand(5, 8, dim, seed=14)
    k = rand(keys, 2, dim, seed=15)
    v = rand(keys, 2, dim, seed=16)
    flash = torch.empty_like(q)
    sgl_kernel_fork.extend_attention(q, k, v, flash, keys - 5, 0.125, True)
    decode = torch.empty_like(q[1:])
    sgl_kernel_fork.extend_attention(q[1:].contiguous(), k, v, decode, keys - 4, 0.125, True)
    torch.testing.assert_close(decode.float(), flash[1:].float(), **TOL)
