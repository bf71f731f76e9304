"""The fused norm ops (csrc/cpu/norm_rope.cpp) against upstream's own torch paths.

``rmsnorm_cpu`` / ``fused_add_rmsnorm_cpu`` against ``RMSNorm.forward_native``
(srt/layers/layernorm.py), called on a stand-in for the module; ``fused_qk_norm_cpu`` /
``fused_qk_norm_rope_cpu`` against ``forward_native`` per head followed by upstream's
``apply_rotary_emb`` (rotary_embedding/utils.py) on ``cos_sin_cache`` rows, which is what
``apply_qk_norm`` + ``RotaryEmbedding.forward_native`` compute. q and k are column slices of a
wider qkv row, as Qwen3-MoE hands them over.

The ops follow those formulas with their roundings; only the fp32 sum of squares is added in
another order, so an output may differ by one unit in its last place (bf16: 2^-8 relative) and
then through the rotary's products. Tolerances: float32 1e-5; bf16 / fp16 2^-6 relative plus
1e-2 absolute (after the rotary's subtraction), and at most 2% of the elements differing at all.
"""

from types import SimpleNamespace

import pytest
import torch

from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.rotary_embedding.utils import apply_rotary_emb

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _norm(hidden, w, eps):
    """What RMSNorm.forward_native reads of its module, with upstream's defaults."""
    return SimpleNamespace(
        weight=w,
        variance_epsilon=eps,
        hidden_size=hidden,
        variance_size_override=None,
        override_orig_dtype=None,
        fp32_residual=False,
        cast_x_before_out_mul=False,
    )


def native(norm, x, residual=None):
    return RMSNorm.forward_native(norm, x.clone(), None if residual is None else residual.clone())


def assert_close(out, ref):
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        return
    torch.testing.assert_close(out.float(), ref.float(), atol=1e-2, rtol=2**-6)
    assert (out != ref).float().mean().item() <= 0.02


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 2048), (5, 3, 200)])
def test_rmsnorm(dtype, shape):
    x = (torch.randn(shape) * 3).to(dtype)
    w = (1 + 0.1 * torch.randn(shape[-1])).to(dtype)
    norm = _norm(shape[-1], w, 1e-6)
    out = torch.ops.sgl_kernel.rmsnorm_cpu(x, w, 1e-6)
    assert_close(out, native(norm, x))
    # rows of a wider tensor (a column slice) give the same rows
    x2 = torch.cat([x.reshape(-1, shape[-1]), x.reshape(-1, shape[-1])], dim=1)[:, : shape[-1]]
    assert not x2.is_contiguous()
    torch.testing.assert_close(torch.ops.sgl_kernel.rmsnorm_cpu(x2, w, 1e-6), out.reshape(x2.shape))


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rmsnorm_in_place(dtype):
    T, n = 4, 2048
    x = (torch.randn(T, n) * 3).to(dtype)
    r = (torch.randn(T, n) * 3).to(dtype)
    w = (1 + 0.1 * torch.randn(n)).to(dtype)
    ref_x, ref_r = native(_norm(n, w, 1e-6), x, r)
    xi, ri = x.clone(), r.clone()
    assert torch.ops.sgl_kernel.fused_add_rmsnorm_cpu(xi, ri, w, 1e-6) is None
    # the new residual is one rounding of the sum: exactly the native one
    assert torch.equal(ri, ref_r)
    assert_close(xi, ref_x)


def test_fused_add_rmsnorm_refuses_a_copy():
    x = torch.randn(4, 64).t()  # not dense rows: a reshape would copy and lose the write
    with pytest.raises(RuntimeError, match="in place"):
        torch.ops.sgl_kernel.fused_add_rmsnorm_cpu(x, x.clone(), torch.ones(4), 1e-6)


def _qkv(T, nh, nkv, hd, dtype):
    qkv = (torch.randn(T, (nh + 2 * nkv) * hd) * 3).to(dtype)
    q, k, _ = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
    assert not q.is_contiguous()
    return qkv, q, k


def _ref_qk(q, k, qw, kw, eps, hd, rope=None):
    """apply_qk_norm (native per-head RMSNorm), then RotaryEmbedding.forward_native."""
    T = q.shape[0]
    qn = native(_norm(hd, qw, eps), q.reshape(-1, hd)).view(T, -1, hd)
    kn = native(_norm(hd, kw, eps), k.reshape(-1, hd)).view(T, -1, hd)
    if rope is None:
        return qn.reshape(T, -1), kn.reshape(T, -1)
    positions, cache, rot, neox = rope
    cos, sin = cache.index_select(0, positions).chunk(2, dim=-1)
    out = []
    for x in (qn, kn):
        xr = apply_rotary_emb(x[..., :rot], cos, sin, neox)
        out.append(torch.cat((xr, x[..., rot:]), dim=-1).reshape(T, -1))
    return tuple(out)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_qk_norm(dtype):
    T, nh, nkv, hd, eps = 3, 4, 2, 128, 1e-6
    qkv, q, k = _qkv(T, nh, nkv, hd, dtype)
    v_before = qkv[:, (nh + nkv) * hd :].clone()
    qw, kw = (1 + 0.1 * torch.randn(hd)).to(dtype), (1 + 0.1 * torch.randn(hd)).to(dtype)
    ref_q, ref_k = _ref_qk(q, k, qw, kw, eps, hd)
    torch.ops.sgl_kernel.fused_qk_norm_cpu(q, k, qw, kw, eps)
    assert_close(q, ref_q)
    assert_close(k, ref_k)
    assert torch.equal(qkv[:, (nh + nkv) * hd :], v_before)  # v untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("neox,rot", [(True, 128), (False, 128), (True, 64)])
@pytest.mark.parametrize("cache_dtype", [torch.float32, "q"])
def test_fused_qk_norm_rope(dtype, neox, rot, cache_dtype):
    T, nh, nkv, hd, eps, max_pos = 5, 4, 2, 128, 1e-6, 4096
    qkv, q, k = _qkv(T, nh, nkv, hd, dtype)
    qw, kw = (1 + 0.1 * torch.randn(hd)).to(dtype), (1 + 0.1 * torch.randn(hd)).to(dtype)
    inv = 1.0 / (1e6 ** (torch.arange(0, rot, 2).float() / rot))
    freqs = torch.outer(torch.arange(max_pos).float(), inv)
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    # the cache as RotaryEmbedding keeps it: fp32, or q's dtype after _match_cos_sin_cache_dtype
    cache = cache.to(dtype if cache_dtype == "q" else cache_dtype)
    positions = torch.tensor([0, 1, 17, 1000, max_pos - 1])
    ref_q, ref_k = _ref_qk(q, k, qw, kw, eps, hd, (positions, cache, rot, neox))
    torch.ops.sgl_kernel.fused_qk_norm_rope_cpu(q, k, qw, kw, eps, neox, positions, cache, rot)
    assert_close(q, ref_q)
    assert_close(k, ref_k)


def test_fused_qk_norm_rope_checks_positions():
    qkv, q, k = _qkv(2, 2, 1, 64, torch.bfloat16)
    w = torch.ones(64, dtype=torch.bfloat16)
    cache = torch.zeros(8, 64)
    with pytest.raises(RuntimeError, match="outside the cache"):
        torch.ops.sgl_kernel.fused_qk_norm_rope_cpu(
            q, k, w, w, 1e-6, True, torch.tensor([0, 8]), cache, 64
        )
