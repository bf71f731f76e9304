"""Gated DeltaNet ops vs transformers' Qwen3-Next torch implementation.

* ``chunk_gated_delta_rule_cpu`` (prefill) vs ``torch_chunk_gated_delta_rule``
* ``fused_sigmoid_gating_delta_rule_update_cpu`` (decode) vs the model's gating
  formula + ``torch_recurrent_gated_delta_rule``
* ``fused_gdn_gating_cpu`` vs the model's gating formula

Layouts: the ops keep upstream's state pool ``[slots, HV, V, K]``; the
references use ``[B, HV, K, V]``, hence the transposes.

Tolerances. Everything in the kernels is float32, like the references, so the
float32 cases differ only by summation order and the kernels' polynomial exp
(~1 ulp): 1e-4 absolute/relative on outputs and states of magnitude ~1 after
a few hundred tokens. With bfloat16 activations both sides read the same
bfloat16 inputs and compute in float32; the op then rounds its output once to
bfloat16 (relative error <= 2^-9), so outputs get 2e-2 (about 4 bf16 ulps at
magnitude 1, allowing for values near rounding ties). A bfloat16 state pool is
rounded to bfloat16 when written back (<= 2^-9 relative per write), so
bfloat16 states get the same 2e-2; for several decode steps the reference
state is rounded to bfloat16 after every step, exactly as the pool does. With
bfloat16 activations the model computes ``beta = sigmoid(b)`` in bfloat16
while the fused decode kernel (like upstream's Triton kernel) keeps it in
float32, so decode states are compared at the bfloat16 tolerance then too.
"""

import pytest
import torch
from sglk_refs import (
    expand_heads,
    ref_chunk_gated_delta_rule,
    ref_gating,
    ref_recurrent_gated_delta_rule,
)

import sgl_kernel_fork as sgl_kernel
from sgl_kernel_fork.mamba import chunk_gated_delta_rule_cpu

F32_TOL = dict(atol=1e-4, rtol=1e-4)
BF16_TOL = dict(atol=2e-2, rtol=2e-2)


def tol(dtype):
    return F32_TOL if dtype == torch.float32 else BF16_TOL


def _width(dtype):
    return torch.finfo(dtype).bits if dtype != torch.bfloat16 else 16


def make_inputs(T, H, HV, K, V, dtype, strong_decay=False):
    q = torch.randn(1, T, H, K).to(dtype)
    k = torch.randn(1, T, H, K).to(dtype)
    v = torch.randn(1, T, HV, V).to(dtype)
    hi = 16.0 if strong_decay else 1.0
    A_log = torch.log(torch.empty(HV).uniform_(0.05, hi))
    dt_bias = (torch.rand(HV) * 2 - 3).to(dtype)
    a = torch.randn(T, HV).to(dtype)
    b = torch.randn(T, HV).to(dtype)
    return q, k, v, A_log, dt_bias, a, b


def cu_of(lens):
    return torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)


def ref_chunk(q, k, v, g, beta, init, HV):
    """One sequence through transformers' chunked reference; init: [HV, V, K] or None."""
    o, state = ref_chunk_gated_delta_rule(
        expand_heads(q, HV),
        expand_heads(k, HV),
        v,
        g=g,
        beta=beta,
        initial_state=None if init is None else init.float().transpose(-1, -2)[None],
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    return o, state[0].transpose(-1, -2)  # -> [HV, V, K]


@pytest.mark.parametrize(
    "lens,H,HV,K,V,dtype,state_dtype",
    [
        ([1, 63, 64, 65, 130], 2, 4, 32, 32, torch.float32, torch.float32),
        ([200, 7], 2, 2, 40, 24, torch.float32, torch.float32),
        ([150], 1, 2, 128, 128, torch.float32, torch.float32),
        ([90, 3, 64], 2, 4, 64, 32, torch.bfloat16, torch.float32),
        ([90, 3, 64], 2, 4, 64, 32, torch.bfloat16, torch.bfloat16),
    ],
)
def test_chunk_vs_transformers(isa, lens, H, HV, K, V, dtype, state_dtype):
    T = sum(lens)
    q, k, v, A_log, dt_bias, a, b = make_inputs(T, H, HV, K, V, dtype)
    g, beta = ref_gating(A_log, a, b, dt_bias)
    n = len(lens)
    num_slots = n + 3
    pool = (torch.randn(num_slots, HV, V, K) * 0.5).to(state_dtype)
    pool0 = pool.clone()
    idx = torch.randperm(num_slots)[:n].to(torch.int32)
    cu = cu_of(lens)

    out, last, h = chunk_gated_delta_rule_cpu(
        q=q,
        k=k,
        v=v,
        g=g[None],
        beta=beta[None],
        initial_state=pool,
        cu_seqlens=cu,
        head_first=False,
        use_qk_l2norm_in_kernel=True,
        initial_state_indices=idx,
    )
    assert out.shape == (1, T, HV, V) and out.dtype == dtype
    assert last is None  # state goes to the pool, like upstream's Triton path
    for i in range(n):
        s, e = int(cu[i]), int(cu[i + 1])
        o_ref, st_ref = ref_chunk(
            q[:, s:e], k[:, s:e], v[:, s:e], g[None, s:e], beta[None, s:e], pool0[idx[i]], HV
        )
        torch.testing.assert_close(out[:, s:e].float(), o_ref.float(), **tol(dtype))
        # the model rounds beta = sigmoid(b) to bf16, the fused kernel keeps it
        # in fp32 (as upstream's Triton kernel): bf16-level state agreement
        torch.testing.assert_close(
            pool[idx[i]].float(), st_ref, **tol(min(dtype, state_dtype, key=_width))
        )
    untouched = torch.ones(num_slots, dtype=torch.bool)
    untouched[idx.long()] = False
    assert torch.equal(pool[untouched], pool0[untouched])


def test_chunk_chunk_states_and_padding(isa):
    """h = state at each 64-token chunk start; negative slot = zero state, no write."""
    lens, H, HV, K, V = [70, 130, 5], 1, 2, 32, 16
    T = sum(lens)
    q, k, v, A_log, dt_bias, a, b = make_inputs(T, H, HV, K, V, torch.float32)
    g, beta = ref_gating(A_log, a, b, dt_bias)
    pool = torch.randn(4, HV, V, K) * 0.5
    pool0 = pool.clone()
    idx = torch.tensor([2, -1, 0], dtype=torch.int64)
    cu = cu_of(lens)
    out, last, h = torch.ops.sgl_kernel.chunk_gated_delta_rule_cpu(
        q, k, v, g[None], beta[None], pool, True, cu, False, True, idx, 1e-6, True
    )
    assert h.shape == (1, 2 + 3 + 1, HV, V, K)
    assert last.shape == (3, HV, V, K) and last.dtype == torch.float32
    off = 0
    for i, L in enumerate(lens):
        s = int(cu[i])
        init = pool0[idx[i]] if idx[i] >= 0 else torch.zeros(HV, V, K)
        for c in range((L + 63) // 64):
            if c == 0:
                expect = init
            else:
                sl = slice(s, s + 64 * c)
                _, expect = ref_chunk(
                    q[:, sl], k[:, sl], v[:, sl], g[None, sl], beta[None, sl], init, HV
                )
            torch.testing.assert_close(h[0, off + c], expect, **F32_TOL)
        off += (L + 63) // 64
        sl = slice(s, s + L)
        o_ref, st_ref = ref_chunk(
            q[:, sl], k[:, sl], v[:, sl], g[None, sl], beta[None, sl], init, HV
        )
        torch.testing.assert_close(out[:, sl], o_ref, **F32_TOL)
        torch.testing.assert_close(last[i], st_ref, **F32_TOL)
    assert torch.equal(pool[1], pool0[1]) and torch.equal(pool[3], pool0[3])
    assert not torch.equal(pool[2], pool0[2])


def test_chunk_strong_decay_and_strided_inputs(isa):
    """Decays far below exp(-87) inside a chunk, q/k/v as views of one packed
    projection (upstream splits mixed_qkv), no initial state."""
    T, H, HV, K, V = 100, 2, 2, 32, 32
    _, _, _, A_log, dt_bias, a, b = make_inputs(T, H, HV, K, V, torch.float32, strong_decay=True)
    a = a * 4 + 6  # softplus(a + dt_bias) up to ~10, times A up to 16
    g, beta = ref_gating(A_log, a, b, dt_bias)
    mixed = torch.randn(T, 2 * H * K + HV * V)
    q, k, v = torch.split(mixed, [H * K, H * K, HV * V], dim=-1)
    q, k, v = q.view(1, T, H, K), k.view(1, T, H, K), v.view(1, T, HV, V)
    out, last, _ = torch.ops.sgl_kernel.chunk_gated_delta_rule_cpu(
        q, k, v, g[None], beta[None], None, True, None, False, True
    )
    o_ref, st_ref = ref_chunk(q, k, v, g[None], beta[None], None, HV)
    torch.testing.assert_close(out, o_ref, **F32_TOL)
    torch.testing.assert_close(last[0], st_ref, **F32_TOL)


def ref_decode(q, k, v, A_log, dt_bias, a, b, init, HV, state_dtype=torch.float32):
    """Model gating + transformers' recurrent reference, token by token, with
    the state rounded to the pool dtype after every step."""
    g, beta = ref_gating(A_log, a, b, dt_bias)
    state = init.float().transpose(-1, -2)[None]
    outs = []
    for t in range(q.shape[1]):
        o, state = ref_recurrent_gated_delta_rule(
            expand_heads(q[:, t : t + 1], HV),
            expand_heads(k[:, t : t + 1], HV),
            v[:, t : t + 1],
            g=g[None, t : t + 1],
            beta=beta[None, t : t + 1],
            initial_state=state,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        state = state.to(state_dtype).float()
        outs.append(o)
    return torch.cat(outs, dim=1), state[0].transpose(-1, -2)


@pytest.mark.parametrize(
    "lens,H,HV,K,V,dtype,state_dtype",
    [
        ([1, 1, 1, 1, 1], 2, 4, 32, 32, torch.float32, torch.float32),
        ([1, 3, 2], 1, 2, 40, 24, torch.float32, torch.float32),
        ([1, 1, 1], 2, 4, 128, 128, torch.bfloat16, torch.float32),
        ([1, 2, 1], 2, 4, 64, 32, torch.bfloat16, torch.bfloat16),
    ],
)
def test_decode_vs_transformers(isa, lens, H, HV, K, V, dtype, state_dtype):
    T = sum(lens)
    q, k, v, A_log, dt_bias, a, b = make_inputs(T, H, HV, K, V, dtype)
    n = len(lens)
    pool = (torch.randn(n + 2, HV, V, K) * 0.5).to(state_dtype)
    pool0 = pool.clone()
    idx = torch.randperm(n + 2)[:n].to(torch.int32)
    cu = cu_of(lens)
    # keyword call exactly as upstream's gdn_triton.TritonGDNKernel.decode
    out = torch.ops.sgl_kernel.fused_sigmoid_gating_delta_rule_update_cpu(
        A_log=A_log,
        dt_bias=dt_bias,
        q=q,
        k=k,
        v=v,
        a=a,
        b=b,
        initial_state_source=pool,
        initial_state_indices=idx,
        cu_seqlens=cu,
        use_qk_l2norm_in_kernel=True,
        softplus_beta=1.0,
        softplus_threshold=20.0,
    )
    assert out.shape == (1, T, HV, V) and out.dtype == dtype
    for i in range(n):
        s, e = int(cu[i]), int(cu[i + 1])
        o_ref, st_ref = ref_decode(
            q[:, s:e],
            k[:, s:e],
            v[:, s:e],
            A_log,
            dt_bias,
            a[s:e],
            b[s:e],
            pool0[idx[i]],
            HV,
            state_dtype,
        )
        torch.testing.assert_close(out[:, s:e].float(), o_ref.float(), **tol(dtype))
        # the model rounds beta = sigmoid(b) to bf16, the fused kernel keeps it
        # in fp32 (as upstream's Triton kernel): bf16-level state agreement
        torch.testing.assert_close(
            pool[idx[i]].float(), st_ref, **tol(min(dtype, state_dtype, key=_width))
        )


def test_decode_steps_padding_and_threshold(isa):
    """Three successive decode steps on a bf16 pool, a padded slot (-1), a
    softplus input above the threshold, and 3-D a/b."""
    H, HV, K, V, bs = 1, 2, 32, 32, 3
    A_log = torch.log(torch.empty(HV).uniform_(0.05, 1.0))
    dt_bias = torch.zeros(HV)
    pool = (torch.randn(5, HV, V, K) * 0.5).to(torch.bfloat16)
    pool0 = pool.clone()
    idx = torch.tensor([4, -1, 1], dtype=torch.int32)
    cu = torch.arange(bs + 1, dtype=torch.int32)
    ref_state = {i: pool0[idx[i]].float() for i in (0, 2)}
    for _ in range(3):
        q, k, v = torch.randn(1, bs, H, K), torch.randn(1, bs, H, K), torch.randn(1, bs, HV, V)
        a, b = torch.randn(1, bs, HV), torch.randn(1, bs, HV)
        a[0, 0, 0] = 25.0  # softplus(x) = x above the threshold
        out = torch.ops.sgl_kernel.fused_sigmoid_gating_delta_rule_update_cpu(
            A_log, dt_bias, q, k, v, a, b, pool, idx, cu, True
        )
        for i in range(bs):
            init = ref_state[i] if i in ref_state else torch.zeros(HV, V, K)
            o_ref, st = ref_decode(
                q[:, i : i + 1],
                k[:, i : i + 1],
                v[:, i : i + 1],
                A_log,
                dt_bias,
                a[0, i : i + 1],
                b[0, i : i + 1],
                init,
                HV,
                torch.bfloat16,
            )
            # float32 activations, so every row (the padded slot's zero-state row too) at F32_TOL
            torch.testing.assert_close(out[:, i : i + 1], o_ref, **F32_TOL)
            if i in ref_state:
                ref_state[i] = st
                torch.testing.assert_close(pool[idx[i]].float(), st, **BF16_TOL)
    assert torch.equal(pool[[0, 2, 3]], pool0[[0, 2, 3]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gating_vs_model_formula(dtype):
    bs, HV = 37, 12
    A_log = torch.log(torch.empty(HV).uniform_(0.01, 16))
    dt_bias = torch.randn(HV).to(dtype)
    ab = torch.randn(bs, 2 * HV + 3).to(dtype) * 4
    ab[0, 0] = 30  # above the softplus threshold
    a, b = ab[:, :HV], ab[:, HV : 2 * HV]  # strided rows, as sliced from a projection
    g, beta = torch.ops.sgl_kernel.fused_gdn_gating_cpu(A_log, a, b, dt_bias)
    g_ref, beta_ref = ref_gating(A_log, a, b, dt_bias)
    assert g.shape == (1, bs, HV) and g.dtype == torch.float32
    assert beta.shape == (1, bs, HV) and beta.dtype == dtype
    torch.testing.assert_close(g[0], g_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        beta[0], beta_ref, **(F32_TOL if dtype == torch.float32 else dict(atol=4e-3, rtol=0))
    )


def test_prefill_then_decode_matches_longer_prefill(isa):
    """Upstream's call pattern end to end (gdn_backend + gdn_triton on CPU):
    conv + chunk on T tokens, then conv-update + fused decode for 2 tokens,
    equals conv + chunk on the T + 2 tokens."""
    from sgl_kernel_fork.mamba import causal_conv1d_fn_cpu, causal_conv1d_update_cpu

    H, HV, K, V, W, T = 2, 4, 32, 32, 4, 70
    dim = 2 * H * K + HV * V
    x = torch.randn(T + 2, dim)
    weight = torch.randn(dim, W) * 0.5
    A_log = torch.log(torch.empty(HV).uniform_(0.05, 1.0))
    dt_bias = torch.randn(HV)
    a, b = torch.randn(T + 2, HV), torch.randn(T + 2, HV)

    def split(m):
        n = m.shape[0]
        qq, kk, vv = torch.split(m, [H * K, H * K, HV * V], dim=-1)
        return qq.view(1, n, H, K), kk.view(1, n, H, K), vv.view(1, n, HV, V)

    def prefill(tokens, conv_states, ssm):
        m = causal_conv1d_fn_cpu(
            x[:tokens].transpose(0, 1),
            weight,
            None,
            activation="silu",
            conv_states=conv_states,
            has_initial_state=torch.tensor([False]),
            cache_indices=torch.tensor([1], dtype=torch.int32),
            query_start_loc=torch.tensor([0, tokens], dtype=torch.int32),
            seq_lens_cpu=[tokens],
        ).transpose(0, 1)[:tokens]
        qq, kk, vv = split(m)
        g, beta = torch.ops.sgl_kernel.fused_gdn_gating_cpu(A_log, a[:tokens], b[:tokens], dt_bias)
        o, _, _ = chunk_gated_delta_rule_cpu(
            q=qq,
            k=kk,
            v=vv,
            g=g,
            beta=beta,
            initial_state=ssm,
            cu_seqlens=torch.tensor([0, tokens], dtype=torch.int32),
            head_first=False,
            use_qk_l2norm_in_kernel=True,
            initial_state_indices=torch.tensor([1], dtype=torch.int32),
        )
        return o

    conv_a, ssm_a = torch.zeros(3, dim, W - 1), torch.zeros(3, HV, V, K)
    o_a = prefill(T + 2, conv_a, ssm_a)

    conv_b, ssm_b = torch.zeros(3, dim, W - 1), torch.zeros(3, HV, V, K)
    prefill(T, conv_b, ssm_b)
    idx = torch.tensor([1], dtype=torch.int32)
    outs = []
    for t in (T, T + 1):
        m = causal_conv1d_update_cpu(
            x[t : t + 1], conv_b, weight, None, "silu", conv_state_indices=idx
        )
        qq, kk, vv = split(m)
        outs.append(
            torch.ops.sgl_kernel.fused_sigmoid_gating_delta_rule_update_cpu(
                A_log=A_log,
                dt_bias=dt_bias,
                q=qq,
                k=kk,
                v=vv,
                a=a[t : t + 1],
                b=b[t : t + 1],
                initial_state_source=ssm_b,
                initial_state_indices=idx,
                cu_seqlens=torch.tensor([0, 1], dtype=torch.int32),
                use_qk_l2norm_in_kernel=True,
                softplus_beta=1.0,
                softplus_threshold=20.0,
            )
        )
    torch.testing.assert_close(torch.cat(outs, dim=1), o_a[:, T:], **F32_TOL)
    torch.testing.assert_close(conv_b, conv_a, **F32_TOL)
    torch.testing.assert_close(ssm_b, ssm_a, **F32_TOL)


def test_isa_is_reported():
    assert sgl_kernel.cpu_isa() in ("avx512bf16", "avx512", "avx2", "scalar")
