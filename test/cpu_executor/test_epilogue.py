"""CPU executor epilogue: per-expert biases and the activations (gpt-oss's clamped SwiGLU,
DeepSeek-V4's clamped SiLU, Gemma 4's tanh GELU).

Oracles:

* gpt-oss: ``quantize_mxfp4.gpt_oss_experts_reference``, the float64 expert part of
  ``gpt_oss_moe_reference`` (checked equal to transformers' ``GptOssMLP`` in
  ``test/tiny_models/test_gpt_oss.py``), on the tiny gpt-oss checkpoint's layer-1 experts: the
  MXFP4 banks as upstream's ``Mxfp4MoEMethod`` holds them and a bf16 dequantized copy (e2m1 times
  a power of two is exact in bf16), gate/up de-interleaved once by
  ``formats.deinterleave_gate_up``. Inputs are scaled (x 8) so that the clamps at 7 are hit and
  change the output (asserted). Tolerance: the executor rounds ``h`` to bf16 once (relative
  2^-9 per element) and sums in float32, so ``max|out - ref| <= 3e-3 * max|ref|`` (1.3e-3 measured); the
  unclamped activation, the SiLU activation, a missing bias or the interleaved layout are
  each asserted to miss that tolerance.
* synthetic bf16 experts: a float64 formula per activation (``swiglu_limit`` from upstream's
  ``swiglu_limit_func`` definition, ``gelu_tanh`` torch's ``gelu(approximate="tanh")``) with ``h`` rounded to bf16 like the executor, the
  ``test_kernel.py`` tolerance (2e-3).

Exactness (no tolerance): with biases and each activation, thread counts, bank-set splits and
token chunks give bit-identical outputs at every ISA level; the default SiLU path without
biases equals a call that passes zero biases.
"""

import pytest
import torch

from sgl_kernel_fork.cpu_executor import (
    activation_args,
    expert_activations,
    expert_pool_set_threads,
    moe_experts_cpu,
)
from sglang.srt.layers.moe.expert_cache.executor_args import executor_kwargs
from sglang.srt.layers.moe.expert_cache.formats import deinterleave_gate_up

LAYER = "model.layers.1.mlp."


# ------------------------------------------------------------------------ tiny gpt-oss
@pytest.fixture(scope="module")
def gpt_oss():
    """(config, checkpoint state) of the tiny gpt-oss, as ``tiny_models.build`` writes it."""
    from sglang.test.tiny_models import builder
    from sglang.test.tiny_models.quantize_mxfp4 import quantize_experts

    cfg = builder.model_config("gpt_oss")
    return cfg, quantize_experts(builder.make_state_dict("gpt_oss"))


def gpt_oss_banks(state, interleaved=False):
    """The layer's experts as executor banks: MXFP4 (upstream Mxfp4MoEMethod's w13_weight
    [E, 2I, H/2], w13_weight_scale [E, 2I, H/32], ...) and a bf16 dequantized copy, with bf16
    biases; gate/up de-interleaved unless ``interleaved`` (the mistake the test must catch)."""
    from sglang.test.tiny_models.quantize_mxfp4 import mxfp4_dequantize

    e = LAYER + "experts."
    fix = (lambda t: t.contiguous()) if interleaved else deinterleave_gate_up
    b13, s13 = state[e + "gate_up_proj_blocks"], state[e + "gate_up_proj_scales"]
    b2, s2 = state[e + "down_proj_blocks"], state[e + "down_proj_scales"]
    bias = {
        "w13_bias": fix(state[e + "gate_up_proj_bias"].bfloat16()),
        "w2_bias": state[e + "down_proj_bias"].bfloat16().contiguous(),
    }
    mx = {
        "w13": fix(b13.flatten(2)),
        "w2": b2.flatten(2).contiguous(),
        "w13_scale": fix(s13),
        "w2_scale": s2.contiguous(),
        **bias,
    }
    bf = {
        "w13": fix(mxfp4_dequantize(b13, s13).bfloat16()),
        "w2": mxfp4_dequantize(b2, s2).bfloat16().contiguous(),
        **bias,
    }
    return mx, bf


def gpt_oss_routing(cfg, state, T, seed=0):
    """Scaled bf16 inputs and the router's top-k (transformers' GptOssTopKRouter)."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, cfg["hidden_size"], generator=g) * 8.0).bfloat16()
    logits = (
        x.double() @ state[LAYER + "router.weight"].double().T
        + state[LAYER + "router.bias"].double()
    )
    val, idx = torch.topk(logits, cfg["num_experts_per_tok"], dim=-1)
    return x, idx.int(), torch.softmax(val, -1).float()


def run_gpt_oss(x, idx, tw, banks, fmt, **act):
    out = torch.full((x.shape[0], x.shape[1]), float("nan"))
    kw = dict(w13=[banks["w13"]], w2=[banks["w2"]])
    if fmt == "mxfp4":
        kw.update(format="mxfp4", w13_scale=[banks["w13_scale"]], w2_scale=[banks["w2_scale"]])
    for b in ("w13_bias", "w2_bias"):
        if b in banks:
            kw[b] = [banks[b]]
    moe_experts_cpu(x, tw, [idx], out=out, **kw, **act)
    return out.double()


def rel_err(out, ref):
    return ((out - ref).abs().max() / ref.abs().max()).item()


GPT_OSS_TOL = 3e-3  # relative to max|ref| (module doc; measured 1.3e-3)


@pytest.mark.parametrize("fmt", ["mxfp4", "bf16"])
def test_gpt_oss_experts_match_float64_reference(executor_isa, gpt_oss, fmt):
    from sglang.test.tiny_models.quantize_mxfp4 import gpt_oss_experts_reference

    cfg, state = gpt_oss
    x, idx, tw = gpt_oss_routing(cfg, state, 12)
    ref = gpt_oss_experts_reference(x, state, LAYER, idx, tw)
    e = LAYER + "experts."
    # the clamp is hit (gate above 7, up outside [-7, 7]) and changes the output
    from sglang.test.tiny_models.quantize_mxfp4 import mxfp4_dequantize

    w13 = mxfp4_dequantize(state[e + "gate_up_proj_blocks"], state[e + "gate_up_proj_scales"])
    gu = torch.einsum("th,tkoh->tko", x.double(), w13.double()[idx.long()])
    gu = gu + state[e + "gate_up_proj_bias"].double()[idx.long()]
    assert (gu[..., 0::2] > 7).any() and (gu[..., 1::2].abs() > 7).any()
    unclamped = gpt_oss_experts_reference(x, state, LAYER, idx, tw, limit=1e9)
    assert rel_err(unclamped, ref) > 10 * GPT_OSS_TOL

    mx, bf = gpt_oss_banks(state)
    banks = mx if fmt == "mxfp4" else bf
    out = run_gpt_oss(x, idx, tw, banks, fmt, activation="swiglu_oai", alpha=1.702, limit=7.0)
    assert rel_err(out, ref) <= GPT_OSS_TOL, rel_err(out, ref)
    # defaults of swiglu_oai are gpt-oss's
    assert torch.equal(run_gpt_oss(x, idx, tw, banks, fmt, activation="swiglu_oai"), out)

    # each mistake misses the tolerance: the tolerance can see the epilogue
    wrong = {
        "silu": run_gpt_oss(x, idx, tw, banks, fmt),
        "no clamp": run_gpt_oss(x, idx, tw, banks, fmt, activation="swiglu_oai", limit=1e9),
        "no w13 bias": run_gpt_oss(
            x,
            idx,
            tw,
            {k: v for k, v in banks.items() if k != "w13_bias"},
            fmt,
            activation="swiglu_oai",
        ),
        "no w2 bias": run_gpt_oss(
            x,
            idx,
            tw,
            {k: v for k, v in banks.items() if k != "w2_bias"},
            fmt,
            activation="swiglu_oai",
        ),
        "interleaved": run_gpt_oss(
            x,
            idx,
            tw,
            gpt_oss_banks(state, interleaved=True)[fmt == "bf16"],
            fmt,
            activation="swiglu_oai",
        ),
    }
    for what, o in wrong.items():
        assert rel_err(o, ref) > 2 * GPT_OSS_TOL, what


def test_gpt_oss_mxfp4_and_bf16_copy_agree(gpt_oss):
    """The two bank formats hold the same weights; outputs differ by float32 accumulation order
    and the rare bf16 rounding flip of an element of h."""
    cfg, state = gpt_oss
    x, idx, tw = gpt_oss_routing(cfg, state, 7, seed=1)
    mx, bf = gpt_oss_banks(state)
    a = run_gpt_oss(x, idx, tw, mx, "mxfp4", activation="swiglu_oai")
    b = run_gpt_oss(x, idx, tw, bf, "bf16", activation="swiglu_oai")
    assert rel_err(a, b) <= 5e-3


def test_bias_dtypes_fp32_equals_bf16(gpt_oss):
    """A float32 bias bank holding the bf16 values gives the same bits (both are added in fp32)."""
    cfg, state = gpt_oss
    x, idx, tw = gpt_oss_routing(cfg, state, 5, seed=2)
    mx, _ = gpt_oss_banks(state)
    f32 = dict(mx, w13_bias=mx["w13_bias"].float(), w2_bias=mx["w2_bias"].float())
    a = run_gpt_oss(x, idx, tw, mx, "mxfp4", activation="swiglu_oai")
    b = run_gpt_oss(x, idx, tw, f32, "mxfp4", activation="swiglu_oai")
    assert torch.equal(a, b)


# ------------------------------------------------------------------------ synthetic bf16
ACTS = {
    "silu": {},
    "swiglu_oai": dict(activation="swiglu_oai", alpha=1.702, limit=7.0),
    "swiglu_limit": dict(activation="swiglu_limit", limit=3.0),
    "gelu_tanh": dict(activation="gelu_tanh"),
}
CLAMPED = ("swiglu_oai", "swiglu_limit")


def act_ref(name, g, u, limit=None):
    """float64 activations: transformers' GptOssExperts._apply_gate (swiglu_oai) and upstream
    fused_marlin_moe.swiglu_limit_func's torch path (swiglu_limit), torch's tanh GELU
    (gelu_tanh: transformers' gelu_pytorch_tanh); ``limit`` overrides ACTS'."""
    F = torch.nn.functional
    if name == "silu":
        return F.silu(g) * u
    if name == "gelu_tanh":
        return F.gelu(g, approximate="tanh") * u
    lim = ACTS[name]["limit"] if limit is None else limit
    g, u = g.clamp(max=lim), u.clamp(-lim, lim)
    if name == "swiglu_oai":
        return (u + 1) * g * torch.sigmoid(1.702 * g)
    return F.silu(g) * u


def make_problem(T, K, H, I, N, seed=0, scale=6.0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, H, generator=g) * scale).bfloat16()
    w13 = (torch.randn(N, 2 * I, H, generator=g) / H**0.5).bfloat16()
    w2 = (torch.randn(N, H, I, generator=g) / I**0.5).bfloat16()
    b13 = (torch.randn(N, 2 * I, generator=g) * 2).bfloat16()
    b2 = torch.randn(N, H, generator=g)  # float32 bank
    tw = torch.rand(T, K, generator=g) / K
    rows = torch.stack([torch.randperm(N, generator=g)[:K] for _ in range(T)]).int()
    rows[torch.rand(T, K, generator=g) < 0.2] = -1
    return x, tw, rows, dict(w13=w13, w2=w2, w13_bias=b13, w2_bias=b2)


def reference(name, x, tw, rows, banks, limit=None):
    T, K = rows.shape
    I = banks["w13"].shape[1] // 2
    y = torch.zeros(T, K, x.shape[1], dtype=torch.float64)
    for t in range(T):
        for k in range(K):
            e = int(rows[t, k])
            if e < 0:
                continue
            gu = banks["w13"][e].double() @ x[t].double() + banks["w13_bias"][e].double()
            h = act_ref(name, gu[:I], gu[I:], limit).float().bfloat16().double()
            y[t, k] = banks["w2"][e].double() @ h + banks["w2_bias"][e].double()
    return (tw.double()[:, :, None] * y).sum(1)


def run(x, tw, rows_list, sets, out, act):
    moe_experts_cpu(x, tw, rows_list, out=out, **executor_kwargs(sets, **act))


def test_activation_names_come_from_the_op():
    assert expert_activations() == ["silu", "swiglu_oai", "swiglu_limit", "gelu_tanh"]


@pytest.mark.parametrize("name", list(ACTS))
@pytest.mark.parametrize("shape", [(1, 4, 96, 40, 8), (9, 3, 64, 72, 4)])
def test_bf16_epilogue_matches_float64(executor_isa, name, shape):
    x, tw, rows, banks = make_problem(*shape)
    ref = reference(name, x, tw, rows, banks)
    out = torch.empty(ref.shape)
    run(x, tw, [rows], [banks], out, ACTS[name])
    torch.testing.assert_close(out.double(), ref, atol=2e-3 * ref.abs().max().item(), rtol=2e-3)
    if name == "gelu_tanh":  # not the SiLU (tanh vs erf GELU differ below bf16's rounding of h)
        wrong = reference("silu", x, tw, rows, banks)
        assert not torch.allclose(wrong, ref, atol=2e-3 * ref.abs().max().item(), rtol=2e-3)
    if name in CLAMPED:  # the clamp matters at this input scale
        unclamped = reference(name, x, tw, rows, banks, limit=1e9)
        assert not torch.allclose(unclamped, ref, atol=2e-2 * ref.abs().max().item(), rtol=0)


def split_sets(rows, banks, nsets, seed):
    g = torch.Generator().manual_seed(seed)
    N = banks["w13"].shape[0]
    which = torch.randint(0, nsets, rows.shape, generator=g)
    srows, sets = [], []
    for s in range(nsets):
        perm = torch.randperm(N, generator=g)
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(N)
        sel = (rows >= 0) & (which == s)
        srows.append(torch.where(sel, inv[rows.clamp(min=0).long()].int(), -1).int())
        sets.append({k: v[perm].contiguous() for k, v in banks.items()})
    return srows, sets


@pytest.mark.parametrize("name", ["swiglu_oai", "swiglu_limit", "gelu_tanh"])
def test_epilogue_bit_identical_across_threads_splits_chunks(executor_isa, name, monkeypatch):
    x, tw, rows, banks = make_problem(40, 4, 96, 72, 6, seed=3)
    act = ACTS[name]
    one = torch.empty(40, 96)
    run(x, tw, [rows], [banks], one, act)
    for nsets, seed in ((2, 1), (3, 2)):
        srows, sets = split_sets(rows, banks, nsets, seed)
        out = torch.empty(40, 96)
        run(x, tw, srows, sets, out, act)
        assert torch.equal(out, one), (nsets, seed)
    try:
        for n in (1, 3):
            expert_pool_set_threads(n)
            out = torch.empty(40, 96)
            run(x, tw, [rows], [banks], out, act)
            assert torch.equal(out, one), n
    finally:
        expert_pool_set_threads(0)
    for T in (1, 3):
        out = torch.empty(T, 96)
        run(x[:T], tw[:T], [rows[:T]], [banks], out, act)
        assert torch.equal(out, one[:T]), T
    monkeypatch.setenv("SGLANG_CPU_EXPERT_SCRATCH_MB", "0.05")
    out = torch.empty(40, 96)
    run(x, tw, [rows], [banks], out, act)
    assert torch.equal(out, one)


@pytest.mark.parametrize("name", ["swiglu_oai", "swiglu_limit"])
def test_submit_and_plan_equal_a_direct_call(gpt_oss, name):
    """The epilogue reaches moe_experts_cpu_submit and CpuBranchPlan (the CUDA branch's host
    side) unchanged: the same bits as a direct call, on the gpt-oss MXFP4 banks."""
    from sgl_kernel_fork.cpu_executor import (
        CpuBranchPlan,
        moe_experts_cpu_submit,
        moe_experts_cpu_wait,
    )

    cfg, state = gpt_oss
    x, idx, tw = gpt_oss_routing(cfg, state, 5, seed=3)
    mx, _ = gpt_oss_banks(state)
    act = ACTS[name]
    want = run_gpt_oss(x, idx, tw, mx, "mxfp4", **act).float()
    scales = dict(format="mxfp4", w13_scale=[mx["w13_scale"]], w2_scale=[mx["w2_scale"]])
    bias = dict(w13_bias=[mx["w13_bias"]], w2_bias=[mx["w2_bias"]])
    got = torch.empty_like(want)
    h = moe_experts_cpu_submit(x, tw, [idx], [mx["w13"]], [mx["w2"]], got, **scales, **bias, **act)
    moe_experts_cpu_wait(h)
    assert torch.equal(got, want)
    plan = CpuBranchPlan(
        8,
        idx.shape[1],
        mx["w13"],
        mx["w2"],
        pin=False,
        format="mxfp4",
        w13_scale=mx["w13_scale"],
        w2_scale=mx["w2_scale"],
        w13_bias=mx["w13_bias"],
        w2_bias=mx["w2_bias"],
        **act,
    )
    plan.hidden[:5] = x
    plan.weights[:5] = tw
    plan.rows[:5] = idx
    plan.run(5)
    assert torch.equal(plan.out[:5], want)
    with pytest.raises(RuntimeError, match=r"w2_bias\[0\] must be"):
        CpuBranchPlan(
            8,
            4,
            mx["w13"],
            mx["w2"],
            pin=False,
            format="mxfp4",
            w13_scale=mx["w13_scale"],
            w2_scale=mx["w2_scale"],
            w2_bias=mx["w2_bias"][:1].contiguous(),
        )


def test_default_silu_unchanged_by_zero_biases():
    """No bias banks and zero bias banks give the same bits (the default path is the old one:
    its own tests, test_kernel.py, check it against float64)."""
    x, tw, rows, banks = make_problem(6, 4, 64, 40, 5, seed=4)
    plain = {"w13": banks["w13"], "w2": banks["w2"]}
    zero = dict(
        plain, w13_bias=torch.zeros(5, 80), w2_bias=torch.zeros(5, 64, dtype=torch.bfloat16)
    )
    a, b = torch.empty(6, 64), torch.empty(6, 64)
    run(x, tw, [rows], [plain], a, {})
    run(x, tw, [rows], [zero], b, {})
    assert torch.equal(a, b)


def test_deinterleave_gate_up():
    t = torch.arange(2 * 6 * 3).reshape(2, 6, 3)
    d = deinterleave_gate_up(t)
    assert torch.equal(d[:, :3], t[:, 0::2]) and torch.equal(d[:, 3:], t[:, 1::2])
    with pytest.raises(ValueError, match="even dim 1"):
        deinterleave_gate_up(torch.zeros(2, 5))


def test_bad_combinations_are_refused():
    x, tw, rows, banks = make_problem(2, 2, 32, 16, 3)
    out = torch.empty(2, 32)
    base = dict(w13=[banks["w13"]], w2=[banks["w2"]])
    with pytest.raises(ValueError, match="unknown activation"):
        moe_experts_cpu(x, tw, [rows], out=out, **base, activation="gelu")
    with pytest.raises(ValueError, match="takes no alpha"):
        activation_args("silu", limit=7.0)
    with pytest.raises(ValueError, match="takes no alpha"):
        activation_args("gelu_tanh", alpha=1.0)
    with pytest.raises(ValueError, match="needs limit"):
        activation_args("swiglu_limit")
    with pytest.raises(ValueError, match="takes no alpha"):
        activation_args("swiglu_limit", alpha=1.0, limit=7.0)
    with pytest.raises(ValueError, match="finite and > 0"):
        activation_args("swiglu_oai", limit=-1.0)
    with pytest.raises(RuntimeError, match=r"w13_bias\[0\] must be a \[N_0, 2\*I"):
        moe_experts_cpu(
            x, tw, [rows], out=out, **base, w13_bias=[banks["w13_bias"][:, :16].contiguous()]
        )
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        moe_experts_cpu(x, tw, [rows], out=out, **base, w2_bias=[banks["w2_bias"].double()])
    with pytest.raises(RuntimeError, match="one tensor per bank set"):
        moe_experts_cpu(x, tw, [rows], out=out, **base, w2_bias=[banks["w2_bias"]] * 2)
    with pytest.raises(RuntimeError, match=r"activation must be one of silu \(0\).*got 7"):
        torch.ops.sgl_kernel.moe_experts_cpu(
            x, tw, [rows], out=out, accumulate=False, **base, activation=7
        )
    with pytest.raises(ValueError, match="bank sets disagree on w2_bias"):
        executor_kwargs(
            [banks, {"w13": banks["w13"], "w2": banks["w2"], "w13_bias": banks["w13_bias"]}]
        )
