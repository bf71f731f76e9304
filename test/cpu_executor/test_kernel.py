"""CPU executor (``sgl_kernel_fork.cpu_executor``) vs a float64 torch reference.

The reference is written here from the formula (not from the op): per (t, k),
``g, u = w13[:I] @ x, w13[I:] @ x`` in float64 on the bf16 inputs,
``h = bf16(silu(g) * u)`` (the op's one documented bf16 rounding),
``y = w2 @ h``, ``result[t] = sum_k w[t, k] * y``.

Tolerance: the op computes g, u in float32 (the reference in float64) and SiLU
through a polynomial exp, so an element of h can land on the other side of a
bf16 rounding boundary (one bf16 ulp, 2^-8 relative, of one of I terms): with
inputs scaled to O(1) outputs this moves a result by < 1e-3; float32
accumulation adds ~1e-6. So atol = rtol = 2e-3; a wrong gate/up order, a
missing SiLU or a wrong weight gives O(1) errors.

Exactness (no tolerance): bank-set splits, thread counts, token chunking and
submit/wait must give bit-identical outputs (``torch.equal``).
"""

import os

import pytest
import torch

from sgl_kernel_fork.cpu_executor import (
    expert_pool_info,
    expert_pool_read_bandwidth,
    expert_pool_set_threads,
    moe_experts_cpu,
    moe_experts_cpu_submit,
    moe_experts_cpu_wait,
)

TOL = dict(atol=2e-3, rtol=2e-3)

# (T, K, H, I, N): H not a multiple of 32 and odd I on purpose; T = 17 / 300 with
# few experts put many tokens on one expert (multi-token tiles and remainders).
CASES = [
    (1, 8, 64, 32, 16),
    (2, 1, 72, 37, 5),
    (3, 4, 100, 33, 9),
    (4, 8, 130, 45, 40),
    (17, 6, 96, 19, 3),
    (300, 8, 80, 24, 20),
]


def make_problem(T, K, H, I, N, pad=0.2, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).bfloat16()
    w13 = (torch.randn(N, 2 * I, H, generator=g) / H**0.5).bfloat16()
    w2 = (torch.randn(N, H, I, generator=g) / I**0.5).bfloat16()
    tw = torch.rand(T, K, generator=g) / K
    rows = torch.stack(
        [
            torch.randperm(N, generator=g)[:K] if K <= N else torch.randint(0, N, (K,), generator=g)
            for _ in range(T)
        ]
    ).int()
    rows[torch.rand(T, K, generator=g) < pad] = -1  # padding entries
    return x, tw, rows, w13, w2


def reference(x, tw, rows, w13, w2):
    """float64 result[t] = sum_k tw[t,k] * expert_{rows[t,k]}(x[t]) (rows of one bank)."""
    T, K = rows.shape
    I = w13.shape[1] // 2
    y = torch.zeros(T, K, x.shape[1], dtype=torch.float64)
    xd = x.double()
    for e in rows.unique().tolist():
        if e < 0:
            continue
        t, k = (rows == e).nonzero(as_tuple=True)
        gu = xd[t] @ w13[e].double().T
        h = (torch.nn.functional.silu(gu[:, :I]) * gu[:, I:]).float().bfloat16().double()
        y[t, k] = h @ w2[e].double().T
    return (tw.double()[:, :, None] * y).sum(1)


def split_sets(rows, w13, w2, nsets, seed):
    """The same routing spread over `nsets` banks: every set holds all experts
    (in its own shuffled order, other memory), each (t, k) taken from a random set."""
    g = torch.Generator().manual_seed(seed)
    N = w13.shape[0]
    which = torch.randint(0, nsets, rows.shape, generator=g)
    srows, s13, s2 = [], [], []
    for s in range(nsets):
        perm = torch.randperm(N, generator=g)  # bank row j holds expert perm[j]
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(N)
        r = torch.where(
            (rows >= 0) & (which == s),
            inv[rows.clamp(min=0).long()].int(),
            torch.full_like(rows, -1),
        )
        srows.append(r.int())
        s13.append(w13[perm].contiguous())
        s2.append(w2[perm].contiguous())
    return srows, s13, s2


@pytest.fixture
def threads_restored():
    yield
    expert_pool_set_threads(0)


@pytest.mark.parametrize("T,K,H,I,N", CASES)
def test_matches_reference(executor_isa, T, K, H, I, N):
    x, tw, rows, w13, w2 = make_problem(T, K, H, I, N)
    ref = reference(x, tw, rows, w13, w2)
    out = torch.full((T, H), float("nan"))
    moe_experts_cpu(x, tw, [rows], [w13], [w2], out, accumulate=False)
    torch.testing.assert_close(out.double(), ref, **TOL)
    base = torch.randn(T, H)
    acc = base.clone()
    moe_experts_cpu(x, tw, [rows], [w13], [w2], acc, accumulate=True)
    torch.testing.assert_close(acc.double(), base.double() + ref, **TOL)
    assert torch.equal(acc, base + out)  # out += result: one float32 add of the same result


@pytest.mark.parametrize("T", [1, 4, 300])
def test_split_over_sets_is_bit_identical(executor_isa, T):
    x, tw, rows, w13, w2 = make_problem(T, 8, 72, 37, 24, seed=T)
    one = torch.empty(T, 72)
    moe_experts_cpu(x, tw, [rows], [w13], [w2], one)
    for nsets, seed in ((2, 1), (2, 2), (3, 3)):
        srows, s13, s2 = split_sets(rows, w13, w2, nsets, seed)
        out = torch.empty(T, 72)
        moe_experts_cpu(x, tw, srows, s13, s2, out)
        assert torch.equal(out, one), (nsets, seed)
    # the GPU/CPU merge: the same split, accumulated onto a shared output
    base = torch.randn(T, 72)
    a, b = base.clone(), base.clone()
    moe_experts_cpu(x, tw, [rows], [w13], [w2], a, accumulate=True)
    moe_experts_cpu(x, tw, srows, s13, s2, b, accumulate=True)
    assert torch.equal(a, b)


def test_thread_counts_are_bit_identical(threads_restored):
    x, tw, rows, w13, w2 = make_problem(300, 8, 130, 45, 12, seed=5)
    outs = []
    for n in (1, 2, 3):
        assert expert_pool_set_threads(n) == n
        assert f"threads={n} " in expert_pool_info()
        for T in (1, 4, 300):
            out = torch.empty(T, 130)
            moe_experts_cpu(x[:T], tw[:T], [rows[:T]], [w13], [w2], out)
            outs.append((n, T, out))
    for n, T, out in outs:
        assert torch.equal(out, next(o for m, t, o in outs if m == 1 and t == T)), (n, T)


def test_token_chunks_are_bit_identical(monkeypatch):
    x, tw, rows, w13, w2 = make_problem(300, 8, 96, 40, 10, seed=7)
    whole = torch.empty(300, 96)
    moe_experts_cpu(x, tw, [rows], [w13], [w2], whole)
    monkeypatch.setenv("SGLANG_CPU_EXPERT_SCRATCH_MB", "0.05")  # ~17 tokens per chunk
    chunked = torch.empty(300, 96)
    moe_experts_cpu(x, tw, [rows], [w13], [w2], chunked)
    assert torch.equal(chunked, whole)


def test_submit_wait_equals_sync():
    x, tw, rows, w13, w2 = make_problem(17, 8, 100, 33, 9, seed=3)
    sync = torch.empty(17, 100)
    moe_experts_cpu(x, tw, [rows], [w13], [w2], sync)
    a, b = torch.empty(17, 100), torch.ones(17, 100)
    ha = moe_experts_cpu_submit(x, tw, [rows], [w13], [w2], a, False)
    hb = moe_experts_cpu_submit(x, tw, [rows], [w13], [w2], b, True)
    busy = torch.randn(256, 256) @ torch.randn(256, 256)  # the caller keeps working
    moe_experts_cpu_wait(hb)  # handles may be waited in any order
    moe_experts_cpu_wait(ha)
    assert busy.shape == (256, 256)
    assert torch.equal(a, sync) and torch.equal(b, 1 + sync)
    with pytest.raises(RuntimeError, match="unknown handle"):
        moe_experts_cpu_wait(ha)


def test_concurrent_callers():
    """Python threads calling and submitting at once (the GIL is released while
    the pool works): every call still gets its own exact result."""
    import threading

    probs = [make_problem(4, 8, 72, 37, 24, seed=s) for s in range(3)]
    want = []
    for x, tw, rows, w13, w2 in probs:
        o = torch.empty(4, 72)
        moe_experts_cpu(x, tw, [rows], [w13], [w2], o)
        want.append(o)
    errors = []

    def worker(i):
        try:
            x, tw, rows, w13, w2 = probs[i]
            for it in range(15):
                o = torch.empty(4, 72)
                if it % 2:
                    moe_experts_cpu_wait(
                        moe_experts_cpu_submit(x, tw, [rows], [w13], [w2], o, False)
                    )
                else:
                    moe_experts_cpu(x, tw, [rows], [w13], [w2], o)
                assert torch.equal(o, want[i])
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_rows_absent_everywhere_contribute_nothing():
    x, tw, rows, w13, w2 = make_problem(4, 8, 64, 32, 16, pad=0.0)
    rows[1] = -1  # token 1: no expert at all
    out = torch.full((4, 64), 7.0)
    moe_experts_cpu(x, tw, [rows], [w13], [w2], out)
    assert torch.equal(out[1], torch.zeros(64))
    acc = torch.full((4, 64), 7.0)
    moe_experts_cpu(x, tw, [rows], [w13], [w2], acc, accumulate=True)
    assert torch.equal(acc[1], torch.full((64,), 7.0))
    empty = torch.empty(0, 64)
    moe_experts_cpu(x[:0], tw[:0], [rows[:0]], [w13], [w2], empty)  # T = 0: no-op
    h = moe_experts_cpu_submit(x[:0], tw[:0], [rows[:0]], [w13], [w2], empty, False)
    moe_experts_cpu_wait(h)
    no_h = torch.empty(4, 0)  # H = 0
    moe_experts_cpu(
        x[:, :0].contiguous(),
        tw,
        [rows],
        [w13[:, :, :0].contiguous()],
        [w2[:, :0].contiguous()],
        no_h,
    )
    zero_i = torch.full((4, 64), 7.0)  # I = 0: every expert outputs 0
    moe_experts_cpu(x, tw, [rows], [w13[:, :0].contiguous()], [w2[:, :, :0].contiguous()], zero_i)
    assert torch.equal(zero_i, torch.zeros(4, 64))


def test_errors_say_what_to_fix():
    x, tw, rows, w13, w2 = make_problem(3, 4, 64, 32, 8, pad=0.0)
    out = torch.empty(3, 64)

    def call(**kw):
        a = dict(hidden=x, topk_weights=tw, expert_rows=[rows], w13=[w13], w2=[w2], out=out)
        a.update(kw)
        moe_experts_cpu(**a)

    cases = [
        (dict(hidden=x.float()), "hidden must be a contiguous 2-D \\[T, H\\] bfloat16"),
        (dict(topk_weights=tw.double()), "topk_weights must be a 2-D \\[T, K\\] float32"),
        (dict(topk_weights=tw[:2]), "with T = 3"),
        (dict(expert_rows=[rows[:, :3].contiguous()]), "K as topk_weights"),
        (dict(expert_rows=[rows.long()]), "int32"),
        (dict(w13=[w13.float()]), "w13\\[0\\] must be a \\[N_0, 2\\*I, H\\]"),
        (
            dict(w13=[w13.transpose(1, 2).contiguous().transpose(1, 2)]),
            "w13\\[0\\] must be contiguous",
        ),
        (dict(w2=[w2[:4]]), "w2\\[0\\] must be a \\[N_0, H, I\\]"),
        (dict(out=out.bfloat16()), "out must be a contiguous \\[T, H\\]"),
        (dict(w2=[w2, w2]), "lists of the same length"),
        (dict(expert_rows=[], w13=[], w2=[]), "lists of the same length >= 1"),
    ]
    for kw, msg in cases:
        with pytest.raises(RuntimeError, match=msg):
            call(**kw)
    bad = rows.clone()
    bad[2, 1] = 8
    with pytest.raises(
        RuntimeError, match=r"expert_rows\[0\]\[2, 1\] = 8 is out of range \[0, 8\)"
    ):
        call(expert_rows=[bad])
    bad[2, 1] = -2
    with pytest.raises(RuntimeError, match="out of range"):
        call(expert_rows=[bad])
    with pytest.raises(RuntimeError, match="at most one set"):
        call(expert_rows=[rows, rows], w13=[w13, w13], w2=[w2, w2])
    with pytest.raises(RuntimeError, match="n must be in"):
        expert_pool_set_threads(-1)


def test_pool_info_and_read_bandwidth(threads_restored):
    info = expert_pool_info()
    for field in ("threads=", "pinned=", "cpus=", "physical_cores=", "isa=", "dot="):
        assert field in info, info
    n = expert_pool_set_threads(0)
    assert n >= 1 and f"threads={n} " in expert_pool_info()
    if len(os.sched_getaffinity(0)) >= n:
        assert f"pinned={n}/{n}" in expert_pool_info()
    gbps = expert_pool_read_bandwidth(torch.empty(8 << 20, dtype=torch.uint8), 2)
    assert gbps > 0.0


# ---- fixed-address plans (the CUDA stream branch's CPU side; CpuBranchPlan) -------------------

from sgl_kernel_fork.cpu_executor import CpuBranchPlan  # noqa: E402


def test_plan_run_is_bit_identical_to_a_direct_call():
    x, tw, rows, w13, w2 = make_problem(17, 6, 96, 19, 9)
    plan = CpuBranchPlan(32, 6, w13, w2, pin=False)
    plan.hidden[:17] = x
    plan.weights[:17] = tw
    plan.rows[:17] = rows
    plan.out.fill_(7.0)
    plan.run(17)
    want = torch.empty(17, 96)
    moe_experts_cpu(x, tw, [rows], [w13], [w2], want)
    assert torch.equal(plan.out[:17], want)
    assert torch.all(plan.out[17:] == 7.0), "rows beyond `tokens` must stay untouched"


def test_plan_run_raises_the_executors_errors():
    x, tw, rows, w13, w2 = make_problem(4, 8, 64, 32, 16)
    plan = CpuBranchPlan(8, 8, w13, w2, pin=False)
    plan.hidden[:4] = x
    plan.weights[:4] = tw
    plan.rows[:4] = rows
    plan.rows[2, 3] = 16  # one past the bank
    with pytest.raises(RuntimeError, match="out of range"):
        plan.run(4)
    with pytest.raises(RuntimeError, match="tokens must be in"):
        plan.run(9)


def test_plan_rejects_banks_the_executor_rejects():
    _, _, _, w13, w2 = make_problem(1, 8, 64, 32, 16)
    with pytest.raises(RuntimeError, match="bfloat16"):
        CpuBranchPlan(4, 8, w13.float(), w2, pin=False)
    with pytest.raises(RuntimeError, match="does not exist"):
        torch.ops.sgl_kernel.moe_experts_cpu_run_plan(10**6, 1)
