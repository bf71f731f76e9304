"""Exact tests of the memory-management ops against plain Python loops."""

import torch

import sgl_kernel_fork as sgl_kernel


def test_assign_req_to_token_pool():
    req_to_token = torch.zeros(8, 32, dtype=torch.int32)
    req_pool_indices = torch.tensor([3, 0, 5, 6], dtype=torch.int64)
    start = torch.tensor([2, 0, 7, 31], dtype=torch.int64)
    end = torch.tensor([5, 4, 7, 32], dtype=torch.int64)
    n = int((end - start).sum())
    out_cache_loc = torch.arange(n, dtype=torch.int64) + 100
    expect = req_to_token.clone()
    off = 0
    for r, s, e in zip(req_pool_indices.tolist(), start.tolist(), end.tolist()):
        for t in range(s, e):
            expect[r, t] = out_cache_loc[off]
            off += 1
    sgl_kernel.assign_req_to_token_pool_cpu(
        req_pool_indices, req_to_token, start, end, out_cache_loc, req_to_token.shape[1]
    )
    assert torch.equal(req_to_token, expect)


def test_assign_req_to_token_pool_bounds_checked():
    req_to_token = torch.zeros(2, 4, dtype=torch.int32)
    try:
        sgl_kernel.assign_req_to_token_pool_cpu(
            torch.tensor([0]),
            req_to_token,
            torch.tensor([2]),
            torch.tensor([6]),
            torch.arange(4),
            4,
        )
    except RuntimeError as e:
        assert "pool_len" in str(e)
    else:
        raise AssertionError("out-of-range write was not rejected")
    assert torch.equal(req_to_token, torch.zeros(2, 4, dtype=torch.int32))


def test_copy_all_layer_kv_cache():
    bufs = [
        torch.randn(16, 2, 8),
        torch.randn(16, 3, 4).to(torch.bfloat16),
        torch.randint(-100, 100, (16, 5), dtype=torch.int8),
    ]
    before = [b.clone() for b in bufs]
    data_ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64)
    strides = torch.tensor([b.stride(0) * b.element_size() for b in bufs])
    # overlapping chain: every source is read before any target is written
    src = torch.tensor([1, 2, 3, 9], dtype=torch.int64)
    tgt = torch.tensor([2, 3, 4, 0], dtype=torch.int64)
    sgl_kernel.copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt, src)
    for b, b0 in zip(bufs, before):
        expect = b0.clone()
        for s, t in zip(src.tolist(), tgt.tolist()):
            expect[t] = b0[s]
        assert torch.equal(b, expect)
    # upstream's warm-up call: one identity move of slot 0
    dummy = torch.zeros(128, dtype=torch.int64)
    snapshot = [b.clone() for b in bufs]
    sgl_kernel.copy_all_layer_kv_cache_cpu(data_ptrs, strides, dummy[:1], dummy[:1])
    assert all(torch.equal(b, s) for b, s in zip(bufs, snapshot))
