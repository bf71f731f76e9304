"""``dense_linear_cpu`` (``sgl_kernel_fork.ops.dense_linear``) vs a float64 reference.

Reference: ``x.double() @ w.double().T + bias.double()`` on the bf16 inputs (the products of
bf16 values are exact in float64 and float32), then one bf16 rounding. The op sums in float32,
so an output can land on the other side of a bf16 rounding boundary: atol = rtol = 1e-2 with
O(1) outputs (one bf16 ulp is 2^-8 relative); a wrong row, a transposed weight or a lost bias
is off by O(1).

Exactness (no tolerance): thread counts, item splits (shapes) and strided inputs give
bit-identical outputs (``torch.equal``), the op's documented contract.
"""

import pytest
import torch

from sgl_kernel_fork.cpu_executor import expert_pool_set_threads
from sgl_kernel_fork.ops import dense_linear, dense_linear_max_rows

TOL = dict(atol=1e-2, rtol=1e-2)


def problem(M, N, K, seed=0, bias=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).bfloat16()
    w = (torch.randn(N, K, generator=g) / K**0.5).bfloat16()
    b = None
    if bias is not None:
        b = torch.randn(N, generator=g).to(bias)
    return x, w, b


def reference(x, w, b=None):
    y = x.double() @ w.double().T
    if b is not None:
        y = y + b.double()
    return y.bfloat16()


@pytest.fixture
def threads_restored():
    yield
    expert_pool_set_threads(0)


# (M, N, K): K below, at and off the 32-element vdpbf16ps step; N off the 16-row item
# alignment; one case large enough to be split into many items.
@pytest.mark.parametrize(
    "M,N,K", [(1, 1, 1), (1, 37, 31), (2, 100, 64), (3, 17, 130), (4, 300, 2048), (4, 2, 33)]
)
def test_matches_reference(executor_isa, M, N, K):
    x, w, _ = problem(M, N, K)
    y = dense_linear(x, w)
    assert y.dtype == torch.bfloat16 and y.shape == (M, N) and y.is_contiguous()
    torch.testing.assert_close(y.float(), reference(x, w).float(), **TOL)


@pytest.mark.parametrize("bias_dtype", [torch.bfloat16, torch.float32])
def test_bias(bias_dtype):
    x, w, b = problem(3, 45, 96, bias=bias_dtype)
    torch.testing.assert_close(dense_linear(x, w, b).float(), reference(x, w, b).float(), **TOL)


def test_rows_up_to_the_limit_and_none():
    limit = dense_linear_max_rows()
    assert limit >= 4
    x, w, _ = problem(limit, 50, 80)
    torch.testing.assert_close(dense_linear(x, w).float(), reference(x, w).float(), **TOL)
    assert dense_linear(x[:0], w).shape == (0, 50)


def test_bit_identical_for_any_thread_count(threads_restored):
    x, w, b = problem(4, 1000, 512, bias=torch.bfloat16)
    outs = []
    for n in (1, 2, 3):
        assert expert_pool_set_threads(n) == n
        outs.append([dense_linear(x[:m], w, b) for m in (1, 4)])
    for got in outs[1:]:
        for a, e in zip(got, outs[0]):
            assert torch.equal(a, e)
    # a row's outputs do not depend on the other rows of the call
    assert torch.equal(outs[0][0][0], outs[0][1][0])


def test_strided_rows_in_place():
    x, w, _ = problem(2, 64, 96)
    wide_w = torch.zeros(64, 160, dtype=torch.bfloat16)
    wide_w[:, 32:128] = w
    wide_x = torch.zeros(2, 200, dtype=torch.bfloat16)
    wide_x[:, 100:196] = x
    ws, xs = wide_w[:, 32:128], wide_x[:, 100:196]
    assert not ws.is_contiguous() and not xs.is_contiguous()
    assert torch.equal(dense_linear(xs, ws), dense_linear(x, w))
    # a slice of rows of a fused weight (qkv) equals the op on that slice alone
    assert torch.equal(dense_linear(x, w[10:30]), dense_linear(x, w)[:, 10:30])


@pytest.mark.parametrize(
    "args,match",
    [
        ((torch.zeros(1, 8), torch.zeros(4, 8, dtype=torch.bfloat16)), "bfloat16"),
        (
            (torch.zeros(1, 8, dtype=torch.bfloat16), torch.zeros(4, 9, dtype=torch.bfloat16)),
            "K = 8",
        ),
        (
            (torch.zeros(8, dtype=torch.bfloat16), torch.zeros(4, 8, dtype=torch.bfloat16)),
            "\\[M, K\\]",
        ),
        (
            (torch.zeros(99, 8, dtype=torch.bfloat16), torch.zeros(4, 8, dtype=torch.bfloat16)),
            "at most",
        ),
        (
            (torch.zeros(1, 8, dtype=torch.bfloat16), torch.zeros(8, 4, dtype=torch.bfloat16).T),
            "unit stride",
        ),
        (
            (
                torch.zeros(1, 8, dtype=torch.bfloat16),
                torch.zeros(4, 8, dtype=torch.bfloat16),
                torch.zeros(5),
            ),
            "bias",
        ),
    ],
)
def test_errors_name_the_argument(args, match):
    with pytest.raises(RuntimeError, match="dense_linear_cpu: .*" + match):
        dense_linear(*args)
