"""Qwen3.5's CPU ops (csrc/cpu/qwen3_5.cpp) vs transformers / plain torch.

``fused_qk_gemma_rmsnorm_cpu`` and its ``_with_gate`` variant against transformers'
``Qwen3_5MoeRMSNorm`` (``x * rsqrt(mean(x^2) + eps) * (1 + w)``) run in float64 on the
same values, per head; the inputs are column slices of a wider qkv row, as the model hands
them over. ``fused_qkvzba_split_reshape_cat_contiguous_cpu`` against plain slicing (an exact
copy). Tolerances: float32 1e-5; bfloat16 outputs rounded once by the op, 1e-2 relative.
"""

import pytest
import torch
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeRMSNorm


def tol(dtype):
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)


def ref_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' GemmaRMSNorm over the last dim, in float64."""
    m = Qwen3_5MoeRMSNorm(x.shape[-1], eps=eps).double()
    with torch.no_grad():
        m.weight.copy_(w.double())
        return m(x.double())


def _qkv(T, nh, nkv, hd, dtype, gate):
    """A qkv projection row [q (| gate per head) | k | v] and its q/k column slices."""
    qw = nh * hd * (2 if gate else 1)
    qkv = (torch.randn(T, qw + 2 * nkv * hd) * 3).to(dtype)
    q, k, _ = qkv.split([qw, nkv * hd, nkv * hd], dim=-1)
    return q, k


@pytest.mark.parametrize("hd", [64, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qk_gemma_rmsnorm(isa, hd, dtype):
    T, nh, nkv, eps = 7, 4, 2, 1e-6
    q, k = _qkv(T, nh, nkv, hd, dtype, gate=False)
    assert not q.is_contiguous()
    qw, kw = (torch.randn(hd) * 0.1).to(dtype), (torch.randn(hd) * 0.1).to(dtype)
    qo, ko = torch.ops.sgl_kernel.fused_qk_gemma_rmsnorm_cpu(q, k, qw, kw, eps, hd)
    assert qo.shape == (T * nh, hd) and ko.shape == (T * nkv, hd)
    assert qo.dtype == dtype and qo.is_contiguous()
    torch.testing.assert_close(qo.double(), ref_norm(q.reshape(-1, hd), qw, eps), **tol(dtype))
    torch.testing.assert_close(ko.double(), ref_norm(k.reshape(-1, hd), kw, eps), **tol(dtype))
    # a 3-D q [T, nh, hd] gives the same rows
    qo3, _ = torch.ops.sgl_kernel.fused_qk_gemma_rmsnorm_cpu(
        q.contiguous().view(T, nh, hd), k, qw, kw, eps, hd
    )
    assert torch.equal(qo3, qo)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qk_gemma_rmsnorm_with_gate(isa, dtype):
    T, nh, nkv, hd, eps = 5, 4, 2, 64, 1e-6
    q_gate, k = _qkv(T, nh, nkv, hd, dtype, gate=True)
    qw, kw = (torch.randn(hd) * 0.1).to(dtype), (torch.randn(hd) * 0.1).to(dtype)
    qo, ko, go = torch.ops.sgl_kernel.fused_qk_gemma_rmsnorm_with_gate_cpu(
        q_gate, k, qw, kw, eps, hd, nh
    )
    q, gate = q_gate.reshape(T, nh, 2 * hd).chunk(2, dim=-1)  # the model's native split
    assert qo.shape == go.shape == (T * nh, hd) and ko.shape == (T * nkv, hd)
    torch.testing.assert_close(qo.double(), ref_norm(q.reshape(-1, hd), qw, eps), **tol(dtype))
    torch.testing.assert_close(ko.double(), ref_norm(k.reshape(-1, hd), kw, eps), **tol(dtype))
    assert torch.equal(go, gate.reshape(-1, hd))
    # the q half agrees with the ungated op on the same values
    qo2, ko2 = torch.ops.sgl_kernel.fused_qk_gemma_rmsnorm_cpu(q.reshape(T, -1), k, qw, kw, eps, hd)
    assert torch.equal(qo2, qo) and torch.equal(ko2, ko)


@pytest.mark.parametrize("B", [1, 6])
def test_qkvzba_split_contiguous(B):
    nqk, nv, hqk, hv = 2, 4, 16, 24
    qkv_dim, z_dim = 2 * nqk * hqk + nv * hv, nv * hv
    qkvz = torch.randn(B, qkv_dim + z_dim).to(torch.bfloat16)
    ba = torch.randn(B, 2 * nv).to(torch.bfloat16)
    qkv, z, b, a = torch.ops.sgl_kernel.fused_qkvzba_split_reshape_cat_contiguous_cpu(
        qkvz, ba, nqk, nv, hqk, hv
    )
    assert torch.equal(qkv, qkvz[:, :qkv_dim])
    assert torch.equal(z, qkvz[:, qkv_dim:].view(B, nv, hv))
    assert torch.equal(b, ba[:, :nv]) and torch.equal(a, ba[:, nv:])
    # new storage, never a view of the projection (the conv update writes into mixed_qkv)
    for t in (qkv, z, b, a):
        assert t.is_contiguous() and t.untyped_storage().data_ptr() not in (
            qkvz.untyped_storage().data_ptr(),
            ba.untyped_storage().data_ptr(),
        )


def test_errors():
    x = torch.randn(3, 100)
    w = torch.zeros(64)
    with pytest.raises(RuntimeError, match="whole heads"):
        torch.ops.sgl_kernel.fused_qk_gemma_rmsnorm_cpu(x, x, w, w, 1e-6, 64)
    with pytest.raises(RuntimeError, match="head_dim = 50"):
        torch.ops.sgl_kernel.fused_qk_gemma_rmsnorm_cpu(x, x, w, w, 1e-6, 50)
    with pytest.raises(RuntimeError, match="num_head \\* 2 \\* head_dim"):
        torch.ops.sgl_kernel.fused_qk_gemma_rmsnorm_with_gate_cpu(
            torch.randn(3, 256), torch.randn(3, 64), w, w, 1e-6, 64, 4
        )
    with pytest.raises(RuntimeError, match="multiple of num_heads_qk"):
        torch.ops.sgl_kernel.fused_qkvzba_split_reshape_cat_contiguous_cpu(
            torch.randn(2, 400), torch.randn(2, 10), 2, 5, 16, 16
        )
    with pytest.raises(RuntimeError, match="at least"):
        torch.ops.sgl_kernel.fused_qkvzba_split_reshape_cat_contiguous_cpu(
            torch.randn(2, 10), torch.randn(2, 8), 2, 4, 16, 16
        )
