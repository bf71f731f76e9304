"""Gated RMSNorm and sigmoid gating vs transformers / plain torch.

``fused_rmsnorm_gated_cpu`` vs transformers' ``Qwen3NextRMSNormGated`` run in
float32 on the same inputs (the op computes in float32 and rounds once; the
module would round ``x * rstd`` to bfloat16 before the weight, so it is fed
float32 copies). ``fused_sigmoid_mul_cpu`` vs ``x * torch.sigmoid(gate)`` in
float32 (Qwen3-Next's attention output gate). Tolerances: float32 1e-5;
bfloat16 outputs rounded once by the op, 1e-2 relative (2-3 bf16 ulps).
"""

import pytest
import torch
from sglk_refs import RefRMSNormGated


def tol(dtype):
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("n", [128, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_gated(isa, n, dtype):
    rows, eps = 37, 1e-6
    x = (torch.randn(rows, n) * 3).to(dtype)
    z = torch.randn(rows, n).to(dtype)
    weight = (torch.rand(n) + 0.5).to(dtype)
    ref = RefRMSNormGated(n, eps=eps)
    with torch.no_grad():
        ref.weight.copy_(weight.float())
        expect = ref(x.float(), z.float())
    out = torch.ops.sgl_kernel.fused_rmsnorm_gated_cpu(x, weight, z, eps)
    assert out.shape == x.shape and out.dtype == dtype
    torch.testing.assert_close(out.float(), expect, **tol(dtype))
    # 3-D input (tokens, heads, head_dim) as upstream's layernorm_gated passes it
    out3 = torch.ops.sgl_kernel.fused_rmsnorm_gated_cpu(
        x.view(rows, 1, n), weight, z.view(rows, 1, n), eps
    )
    assert torch.equal(out3.view(rows, n), out)
    # no gate
    out_ng = torch.ops.sgl_kernel.fused_rmsnorm_gated_cpu(x, weight, None, eps)
    xf = x.float()
    expect_ng = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    torch.testing.assert_close(out_ng.float(), expect_ng, **tol(dtype))
    # no weight (FusedRMSNormGated(elementwise_affine=False))
    out_nw = torch.ops.sgl_kernel.fused_rmsnorm_gated_cpu(x, None, None, eps)
    torch.testing.assert_close(out_nw.float(), expect_ng / weight.float(), **tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sigmoid_mul(isa, dtype):
    T, heads, D = 9, 4, 40
    # flat path: same shapes
    x = torch.randn(T, heads * D).to(dtype)
    gate = torch.randn(T, heads * D).to(dtype)
    expect = x.float() * torch.sigmoid(gate.float())
    y = x.clone()
    torch.ops.sgl_kernel.fused_sigmoid_mul_cpu(y, gate)
    torch.testing.assert_close(y.float(), expect, **tol(dtype))
    # strided 3-D gate, as Qwen3.5's q/gate split hands it over
    qg = torch.randn(T, heads, 2 * D).to(dtype)
    gate3 = qg[:, :, D:]
    expect = x.float() * torch.sigmoid(gate3.reshape(T, heads * D).float())
    y = x.clone()
    torch.ops.sgl_kernel.fused_sigmoid_mul_cpu(y, gate3)
    torch.testing.assert_close(y.float(), expect, **tol(dtype))


def test_nan_propagates(isa):
    """A NaN gate must not be clamped into a finite sigmoid (the kernels' exp
    keeps NaN)."""
    x = torch.ones(2, 32)
    gate = torch.zeros(2, 32)
    gate[1, 5] = float("nan")
    torch.ops.sgl_kernel.fused_sigmoid_mul_cpu(x, gate)
    assert torch.isnan(x[1, 5]) and torch.isfinite(x[0]).all()
    z = torch.randn(2, 32)
    z[0, 3] = float("nan")
    y = torch.ops.sgl_kernel.fused_rmsnorm_gated_cpu(torch.randn(2, 32), None, z, 1e-6)
    assert torch.isnan(y[0, 3]) and torch.isfinite(y[1]).all()
