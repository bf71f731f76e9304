"""Causal conv1d ops vs transformers' Qwen3-Next torch implementation.

``causal_conv1d_fn_cpu`` / ``causal_conv1d_update_cpu`` (sgl_kernel.mamba) are
checked against transformers' ``causal_conv1d_update`` (stateful: conv over
``cat(conv_state, x)``, state <- last columns) and ``causal_conv1d_fn``
(stateless), run per sequence in float32 on the same (bfloat16-rounded) inputs.

Tolerances: float32 outputs 1e-5 (a W-term dot product plus SiLU through the
kernels' polynomial exp); bfloat16 outputs are rounded once by the op, so 2e-2
(a few bf16 ulps at magnitude 1). States are copies of inputs: exact.
"""

import pytest
import torch
from sglk_refs import ref_causal_conv1d_fn, ref_causal_conv1d_update

from sgl_kernel_fork.mamba import causal_conv1d_fn_cpu, causal_conv1d_update_cpu


def tol(dtype):
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


def make_states(num_slots, dim, W, dtype, layout):
    if layout == "dim_major":  # upstream's default pool: (slots, dim, W-1) contiguous
        return torch.randn(num_slots, dim, W - 1).to(dtype)
    # AMX / KDA layout: (slots, W-1, dim) storage viewed as (slots, dim, W-1)
    return torch.randn(num_slots, W - 1, dim).to(dtype).transpose(1, 2)


def ref_seq(x, state, weight, bias, silu):
    """x: (dim, L) float32, state: (dim, W-1) float32 or None -> (out, new_state)."""
    act = "silu" if silu else None
    if state is None:
        out = ref_causal_conv1d_fn(x[None], weight, bias, activation=act)[0]
        state = torch.zeros(x.shape[0], weight.shape[1] - 1)
        st = state[None].clone()
        out2 = ref_causal_conv1d_update(x[None], st, weight, bias, activation=act)[0]
        torch.testing.assert_close(out, out2)  # the two references agree
        return out, st[0]
    st = state[None].clone()
    out = ref_causal_conv1d_update(x[None], st, weight, bias, activation=act)[0]
    return out, st[0]


@pytest.mark.parametrize(
    "dim,W,lens,dtype,layout,silu,with_bias",
    [
        (40, 4, [1, 2, 5, 17], torch.float32, "dim_major", True, True),
        (300, 4, [3, 64, 1], torch.bfloat16, "dim_major", True, False),
        (72, 2, [4, 1, 9], torch.float32, "token_major", False, True),
        (48, 3, [2, 6], torch.bfloat16, "token_major", True, True),
    ],
)
def test_causal_conv1d_fn(isa, dim, W, lens, dtype, layout, silu, with_bias):
    n, T = len(lens), sum(lens)
    mixed = torch.randn(T, dim).to(dtype)  # token-major, as upstream's mixed_qkv
    weight = torch.randn(dim, W).to(dtype)
    bias = torch.randn(dim).to(dtype) if with_bias else None
    states = make_states(n + 3, dim, W, dtype, layout)
    states0 = states.clone()
    cache_indices = torch.randperm(n + 3)[:n].to(torch.int32)
    has_init = torch.tensor([i % 2 == 0 for i in range(n)])
    qsl = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)

    out = causal_conv1d_fn_cpu(
        mixed.transpose(0, 1),
        weight,
        bias,
        activation="silu" if silu else None,
        conv_states=states,
        has_initial_state=has_init,
        cache_indices=cache_indices,
        query_start_loc=qsl,
        seq_lens_cpu=lens,
    )
    assert out.shape == (dim, T) and out.dtype == dtype
    out_t = out.transpose(0, 1)
    assert out_t.is_contiguous()  # upstream splits and .view()s it
    wf, bf = weight.float(), None if bias is None else bias.float()
    for i in range(n):
        s, e = int(qsl[i]), int(qsl[i + 1])
        init = states0[cache_indices[i]].float() if has_init[i] else None
        o_ref, st_ref = ref_seq(mixed[s:e].float().t(), init, wf, bf, silu)
        torch.testing.assert_close(out_t[s:e].float(), o_ref.t(), **tol(dtype))
        torch.testing.assert_close(states[cache_indices[i]].float(), st_ref, atol=0, rtol=0)
    untouched = torch.ones(n + 3, dtype=torch.bool)
    untouched[cache_indices.long()] = False
    assert torch.equal(states[untouched], states0[untouched])


def test_causal_conv1d_fn_pad_slot(isa):
    dim, W = 32, 4
    mixed = torch.randn(5, dim)
    weight = torch.randn(dim, W)
    states = torch.randn(3, dim, W - 1)
    states0 = states.clone()
    out = causal_conv1d_fn_cpu(
        mixed.transpose(0, 1),
        weight,
        None,
        activation="silu",
        conv_states=states,
        has_initial_state=torch.tensor([True, True]),
        cache_indices=torch.tensor([-1, 2], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 2, 5], dtype=torch.int32),
        seq_lens_cpu=[2, 3],
    ).transpose(0, 1)
    assert torch.equal(out[:2], torch.zeros(2, dim))  # padded sequence: zeros, no state write
    o_ref, st_ref = ref_seq(mixed[2:].t(), states0[2], weight, None, True)
    torch.testing.assert_close(out[2:], o_ref.t(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states[2], st_ref, atol=0, rtol=0)
    assert torch.equal(states[:2], states0[:2])


@pytest.mark.parametrize(
    "dim,W,seqlen,dtype,layout",
    [
        (40, 4, None, torch.float32, "dim_major"),
        (300, 4, None, torch.bfloat16, "token_major"),
        (64, 4, 3, torch.float32, "dim_major"),
        (48, 2, 2, torch.bfloat16, "dim_major"),
    ],
)
def test_causal_conv1d_update(isa, dim, W, seqlen, dtype, layout):
    bs = 4
    x = torch.randn(bs, dim) if seqlen is None else torch.randn(bs, seqlen, dim).transpose(1, 2)
    x = x.to(dtype)
    weight = torch.randn(dim, W).to(dtype)
    bias = torch.randn(dim).to(dtype)
    states = make_states(bs + 2, dim, W, dtype, layout)
    states0 = states.clone()
    idx = torch.tensor([5, 0, -1, 2], dtype=torch.int32)
    out = causal_conv1d_update_cpu(x, states, weight, bias, "silu", conv_state_indices=idx)
    assert out.shape == x.shape and out.dtype == dtype
    for i in range(bs):
        xi = (x[i] if seqlen is not None else x[i][:, None]).float()
        if idx[i] < 0:
            assert torch.equal(out[i], torch.zeros_like(out[i]))
            continue
        o_ref, st_ref = ref_seq(xi, states0[idx[i]].float(), weight.float(), bias.float(), True)
        o = out[i] if seqlen is not None else out[i][:, None]
        torch.testing.assert_close(o.float(), o_ref, **tol(dtype))
        torch.testing.assert_close(states[idx[i]].float(), st_ref, atol=0, rtol=0)
    assert torch.equal(states[[1, 3, 4]], states0[[1, 3, 4]])


def test_update_rejects_speculative_arguments():
    x, st, w = torch.randn(1, 8), torch.randn(1, 8, 3), torch.randn(8, 4)
    with pytest.raises(RuntimeError, match="speculative decoding on CPU"):
        causal_conv1d_update_cpu(
            x,
            st,
            w,
            None,
            "silu",
            conv_state_indices=None,
            intermediate_conv_window=torch.zeros(1, 1, 8, 3),
        )
