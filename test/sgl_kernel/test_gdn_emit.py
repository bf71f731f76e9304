"""``chunk_gated_delta_rule_cpu(state_emit_indices=...)``: recurrent states emitted at 64-token
chunk boundaries inside one prefill pass, into slots of the state pool (anchor checkpoints
without a pass ending there).

Every emitted state must equal (1) the final state of a pass over the same tokens that ends at
that position, bit for bit (the same float32 recurrence, rounded once to the pool dtype), and
(2) transformers' token-by-token recurrent reference within the float32 tolerance of
``test_gdn.py`` (1e-4; bfloat16 pools 2e-2, one rounding). Nothing else of the pool changes.
"""

import pytest
import torch
from sglk_refs import expand_heads, ref_gating, ref_recurrent_gated_delta_rule
from test_gdn import cu_of, make_inputs

from sgl_kernel_fork.mamba import chunk_gated_delta_rule_cpu

F32_TOL = dict(atol=1e-4, rtol=1e-4)
BF16_TOL = dict(atol=2e-2, rtol=2e-2)


def ref_token_by_token(q, k, v, g, beta, init, HV):
    """State after every token of one sequence: list of [HV, V, K] float32."""
    state = init.float().transpose(-1, -2)[None]
    states = []
    for t in range(q.shape[1]):
        _, state = ref_recurrent_gated_delta_rule(
            expand_heads(q[:, t : t + 1], HV),
            expand_heads(k[:, t : t + 1], HV),
            v[:, t : t + 1],
            g=g[:, t : t + 1],
            beta=beta[:, t : t + 1],
            initial_state=state,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        states.append(state[0].transpose(-1, -2).clone())
    return states


def run(q, k, v, g, beta, pool, idx, cu, emit=None):
    return chunk_gated_delta_rule_cpu(
        q=q,
        k=k,
        v=v,
        g=g[None],
        beta=beta[None],
        initial_state=pool,
        cu_seqlens=cu,
        use_qk_l2norm_in_kernel=True,
        initial_state_indices=idx,
        state_emit_indices=emit,
    )


@pytest.mark.parametrize(
    "dtype,state_dtype",
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32),
    ],
)
def test_emitted_states_equal_a_pass_ending_there(isa, dtype, state_dtype):
    lens, H, HV, K, V = [200, 64, 130], 2, 4, 32, 16
    T = sum(lens)
    q, k, v, A_log, dt_bias, a, b = make_inputs(T, H, HV, K, V, dtype)
    g, beta = ref_gating(A_log, a, b, dt_bias)
    n_slots = 12
    pool = (torch.randn(n_slots, HV, V, K) * 0.5).to(state_dtype)
    pool0 = pool.clone()
    idx = torch.tensor([3, 0, 7], dtype=torch.int64)
    cu = cu_of(lens)
    # chunks per sequence: 4, 1, 3 -> emit after 64, 128 and 192 tokens of seq 0, 128 of seq 2
    emit = torch.full((8,), -1, dtype=torch.int64)
    wanted = {(0, 64): 5, (0, 128): 9, (0, 192): 1, (2, 128): 11}
    chunk0 = [0, 4, 5]
    for (i, pos), slot in wanted.items():
        emit[chunk0[i] + pos // 64] = slot
    out, _, _ = run(q, k, v, g, beta, pool, idx, cu, emit)

    # the same pass without emission: identical outputs and final states
    plain = pool0.clone()
    out_plain, _, _ = run(q, k, v, g, beta, plain, idx, cu)
    assert torch.equal(out, out_plain)
    assert torch.equal(pool[idx], plain[idx])
    untouched = torch.ones(n_slots, dtype=torch.bool)
    untouched[idx] = False
    untouched[list(wanted.values())] = False
    assert torch.equal(pool[untouched], pool0[untouched])

    tol = F32_TOL if state_dtype == torch.float32 and dtype == torch.float32 else BF16_TOL
    for (i, pos), slot in wanted.items():
        s = int(cu[i])
        # (1) a pass over the first `pos` tokens of the sequence ends there: its write-back
        short = pool0.clone()
        sl = slice(s, s + pos)
        run(q[:, sl], k[:, sl], v[:, sl], g[sl], beta[sl], short, idx[i : i + 1], cu_of([pos]))
        assert torch.equal(pool[slot], short[idx[i]]), (i, pos)
        # (2) token by token
        ref = ref_token_by_token(
            q[:, sl], k[:, sl], v[:, sl], g[None, sl], beta[None, sl], pool0[idx[i]], HV
        )
        torch.testing.assert_close(pool[slot].float(), ref[-1], **tol)


def test_emit_without_varlen(isa):
    """B > 1 without cu_seqlens: one entry per (batch row, chunk)."""
    B, T, H, HV, K, V = 2, 130, 1, 2, 16, 16
    qs = [make_inputs(T, H, HV, K, V, torch.float32) for _ in range(B)]
    q = torch.cat([x[0] for x in qs])
    k = torch.cat([x[1] for x in qs])
    v = torch.cat([x[2] for x in qs])
    g, beta = ref_gating(qs[0][3], torch.randn(B * T, HV), torch.randn(B * T, HV), qs[0][4])
    g, beta = g.view(B, T, HV), beta.view(B, T, HV)
    pool = torch.randn(6, HV, V, K)
    pool0 = pool.clone()
    idx = torch.tensor([0, 1])
    emit = torch.tensor([-1, 4, -1, -1, -1, 5])  # row 0 after 64, row 1 after 128 tokens
    chunk_gated_delta_rule_cpu(
        q=q,
        k=k,
        v=v,
        g=g,
        beta=beta,
        initial_state=pool,
        use_qk_l2norm_in_kernel=True,
        initial_state_indices=idx,
        state_emit_indices=emit,
    )
    for row, pos, slot in [(0, 64, 4), (1, 128, 5)]:
        short = pool0.clone()
        chunk_gated_delta_rule_cpu(
            q=q[row : row + 1, :pos],
            k=k[row : row + 1, :pos],
            v=v[row : row + 1, :pos],
            g=g[row : row + 1, :pos],
            beta=beta[row : row + 1, :pos],
            initial_state=short,
            use_qk_l2norm_in_kernel=True,
            initial_state_indices=idx[row : row + 1],
        )
        assert torch.equal(pool[slot], short[idx[row]])


@pytest.mark.parametrize(
    "emit,idx,match",
    [
        ([2, -1, -1, -1], [0, 1], "chunk 0"),
        ([-1, 0, -1, -1], [0, 1], "written twice"),
        ([-1, 2, -1, 2], [0, 1], "written twice"),
        ([-1, 9, -1, -1], [0, 1], "out of range"),
        ([-1, -1, -1, 3], [0, -1], "padding"),
        ([-1, 2], [0, 1], "one entry per 64-token chunk"),
    ],
)
def test_emit_errors(isa, emit, idx, match):
    lens, H, HV, K, V = [100, 100], 1, 2, 16, 16
    q, k, v, A_log, dt_bias, a, b = make_inputs(sum(lens), H, HV, K, V, torch.float32)
    g, beta = ref_gating(A_log, a, b, dt_bias)
    pool = torch.zeros(4, HV, V, K)
    with pytest.raises(RuntimeError, match=match):
        run(q, k, v, g, beta, pool, torch.tensor(idx), cu_of(lens), torch.tensor(emit))
