"""CPU executor on quantized experts (fp8 block, fp8 per channel, mxfp4, nvfp4) vs a float64
reference.

``fp8-channel`` is the executor's fp8 format with compressed-tensors FP8-Dynamic's scales (one
float32 per output row, ``[N, 2I, 1]`` / ``[N, H, 1]``, ``formats.CT_FP8_CHANNEL``).

The reference dequantizes the banks in float64 (``expert_cache.formats``: the formats'
definitions, written apart from the kernels), then runs the executor's formula: ``g, u`` in
float64 on the bf16 activations, ``h = bf16(silu(g) * u)``, ``y = w2 @ h``, the k-sum. The op
dequantizes in registers: each weight is fp32(code * scale), and products and sums are float32,
so it differs from the reference by float32 accumulation (~1e-6) and the occasional bf16
rounding of an element of ``h`` landing on the other side (< 1e-3 at O(1) outputs): the bf16
tests' atol = rtol = 2e-3. A wrong nibble order, scale block, group or global scale gives O(1)
errors (checked by ``test_reference_catches_layout_mistakes``).

Exactness (no tolerance): bank-set splits, thread counts, token chunks, submit/wait and plans
give bit-identical outputs for every format, as for bf16.
"""

import pytest
import torch
from test_kernel import reference as bf16_reference

from sgl_kernel_fork.cpu_executor import (
    CpuBranchPlan,
    expert_formats,
    expert_pool_set_threads,
    moe_experts_cpu,
    moe_experts_cpu_submit,
    moe_experts_cpu_wait,
)
from sglang.srt.layers.moe.expert_cache.formats import QUANT_FORMATS, executor_args

TOL = dict(atol=2e-3, rtol=2e-3)
FORMATS = ("fp8", "fp8-channel", "mxfp4", "nvfp4")

# (T, K, H, I, N). fp8 takes any H and I: 196 and 72 leave partial 128-blocks and a partial
# last SIMD chunk; the 4-bit formats need multiples of their group (32 / 16). T = 40 with few
# experts puts many tokens on one expert (prefill column tiles).
CASES = {
    "fp8": [(1, 8, 256, 128, 16), (3, 4, 196, 72, 9), (4, 8, 128, 200, 10), (40, 6, 96, 48, 3)],
    "fp8-channel": [
        (1, 8, 256, 128, 16),
        (3, 4, 196, 72, 9),
        (4, 8, 128, 200, 10),
        (40, 6, 96, 48, 3),
    ],
    "mxfp4": [(1, 8, 256, 128, 16), (3, 4, 160, 96, 9), (4, 8, 64, 224, 10), (40, 6, 96, 64, 3)],
    "nvfp4": [(1, 8, 256, 128, 16), (3, 4, 176, 80, 9), (4, 8, 48, 208, 10), (40, 6, 96, 64, 3)],
}


def make_problem(fmt, T, K, H, I, N, pad=0.2, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).bfloat16()
    # rows of different magnitudes, so that block / group scales differ
    w13 = torch.randn(N, 2 * I, H, generator=g) / H**0.5 * torch.rand(N, 2 * I, 1, generator=g)
    w2 = torch.randn(N, H, I, generator=g) / I**0.5 * torch.rand(N, H, 1, generator=g)
    banks = QUANT_FORMATS[fmt].quantize(w13, w2)
    tw = torch.rand(T, K, generator=g) / K
    rows = torch.stack(
        [
            torch.randperm(N, generator=g)[:K] if K <= N else torch.randint(0, N, (K,), generator=g)
            for _ in range(T)
        ]
    ).int()
    rows[torch.rand(T, K, generator=g) < pad] = -1
    return x, tw, rows, banks


def reference(fmt, x, tw, rows, banks):
    """The bf16 tests' float64 formula over the float64 dequantized banks."""
    w13, w2 = QUANT_FORMATS[fmt].dequantize(banks)
    return bf16_reference(x, tw, rows, w13, w2)


def run(fmt, x, tw, rows_list, sets, out, accumulate=False):
    moe_experts_cpu(
        x, tw, rows_list, out=out, accumulate=accumulate, **executor_args(QUANT_FORMATS[fmt], sets)
    )


def test_format_names_come_from_the_op():
    assert expert_formats() == ["bf16", "fp8", "mxfp4", "nvfp4"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantizer_round_trip(fmt):
    """The test quantizer and the float64 dequantize agree (what every case below rests on)."""
    g = torch.Generator().manual_seed(1)
    w13 = torch.randn(3, 64, 96, generator=g)
    w2 = torch.randn(3, 96, 32, generator=g)
    d13, d2 = QUANT_FORMATS[fmt].dequantize(QUANT_FORMATS[fmt].quantize(w13, w2))
    rel = 0.07 if fmt.startswith("fp8") else 0.35  # e4m3: 3 mantissa bits; e2m1: 1 bit
    for w, d in ((w13, d13), (w2, d2)):
        assert d.shape == w.shape
        assert ((d - w.double()).norm() / w.double().norm()).item() < rel


@pytest.mark.parametrize("fmt", FORMATS)
def test_bank_shapes_and_bytes_are_upstreams(fmt):
    f = QUANT_FORMATS[fmt]
    banks = f.quantize(torch.randn(2, 256, 256), torch.randn(2, 256, 128))
    for spec in f.banks(256, 128):
        assert banks[spec.name].dtype == spec.dtype, spec
        assert tuple(banks[spec.name].shape[1:]) == spec.row_shape, spec
    want = {
        "fp8": 3 * 256 * 128 + 4 * (2 * 2 + 2 * 1),
        "fp8-channel": 3 * 256 * 128 + 4 * (256 + 256),  # one float32 per w13 and w2 row
        "mxfp4": 3 * 256 * 128 * 17 // 32,
    }
    if fmt in want:
        assert f.expert_bytes(256, 128) == want[fmt]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", range(4))
def test_matches_float64_reference(executor_isa, fmt, case):
    x, tw, rows, banks = make_problem(fmt, *CASES[fmt][case], seed=case)
    ref = reference(fmt, x, tw, rows, banks)
    out = torch.full(ref.shape, float("nan"))
    run(fmt, x, tw, [rows], [banks], out)
    torch.testing.assert_close(out.double(), ref, **TOL)
    base = torch.randn(ref.shape)
    acc = base.clone()
    run(fmt, x, tw, [rows], [banks], acc, accumulate=True)
    assert torch.equal(acc, base + out)


@pytest.mark.parametrize("fmt", FORMATS)
def test_reference_catches_layout_mistakes(fmt):
    """The tolerance is tight enough to see a swapped nibble order or scale layout."""
    x, tw, rows, banks = make_problem(fmt, 4, 8, 128, 64, 10, pad=0.0)
    out = torch.empty(4, 128)
    run(fmt, x, tw, [rows], [banks], out)
    wrong = dict(banks)
    if fmt == "fp8":
        wrong["w13_scale"] = banks["w13_scale"].flip(-1).contiguous()
        wrong["w13_scale"][:, 0] *= 3
    elif fmt == "fp8-channel":  # a block layout's mistake: one scale per 128 rows
        rows128 = banks["w13_scale"][:, ::128].repeat_interleave(128, 1)
        wrong["w13_scale"] = rows128[:, : banks["w13_scale"].shape[1]].contiguous()
    else:
        wrong["w13"] = ((banks["w13"] >> 4) | (banks["w13"] << 4)).contiguous()
    ref = reference(fmt, x, tw, rows, wrong)
    assert not torch.allclose(out.double(), ref, **TOL)


def split_sets(rows, banks, nsets, seed):
    """The routing spread over `nsets` bank sets, each holding every expert in its own order."""
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


@pytest.mark.parametrize("fmt", FORMATS)
def test_splits_threads_chunks_are_bit_identical(executor_isa, fmt, monkeypatch):
    x, tw, rows, banks = make_problem(fmt, 40, 8, 96, 64, 12, seed=3)
    one = torch.empty(40, 96)
    run(fmt, x, tw, [rows], [banks], one)
    for nsets, seed in ((2, 1), (3, 2)):
        srows, sets = split_sets(rows, banks, nsets, seed)
        out = torch.empty(40, 96)
        run(fmt, x, tw, srows, sets, out)
        assert torch.equal(out, one), (nsets, seed)
    try:
        for n in (1, 3):
            expert_pool_set_threads(n)
            out = torch.empty(40, 96)
            run(fmt, x, tw, [rows], [banks], out)
            assert torch.equal(out, one), n
    finally:
        expert_pool_set_threads(0)
    for T in (1, 4):  # a decode batch is the same rows of the prefill result
        out = torch.empty(T, 96)
        run(fmt, x[:T], tw[:T], [rows[:T]], [banks], out)
        assert torch.equal(out, one[:T]), T
    monkeypatch.setenv("SGLANG_CPU_EXPERT_SCRATCH_MB", "0.05")  # a few tokens per chunk
    out = torch.empty(40, 96)
    run(fmt, x, tw, [rows], [banks], out)
    assert torch.equal(out, one)


@pytest.mark.parametrize("fmt", FORMATS)
def test_submit_and_plan_equal_a_direct_call(fmt):
    x, tw, rows, banks = make_problem(fmt, 5, 8, 64, 32, 9, seed=4)
    want = torch.empty(5, 64)
    run(fmt, x, tw, [rows], [banks], want)
    kw = executor_args(QUANT_FORMATS[fmt], [banks])
    got = torch.empty(5, 64)
    moe_experts_cpu_wait(moe_experts_cpu_submit(x, tw, [rows], out=got, **kw))
    assert torch.equal(got, want)
    scales = {k: banks[k] for k in banks if k not in ("w13", "w2")}
    name = QUANT_FORMATS[fmt].executor_format
    plan = CpuBranchPlan(8, 8, banks["w13"], banks["w2"], pin=False, format=name, **scales)
    plan.hidden[:5] = x
    plan.weights[:5] = tw
    plan.rows[:5] = rows
    plan.run(5)
    assert torch.equal(plan.out[:5], want)


def test_nvfp4_one_global_per_expert_for_w13():
    """w13_scale_2 of shape [N] (after upstream's post-load step) means gate = up."""
    x, tw, rows, banks = make_problem("nvfp4", 3, 4, 64, 32, 6, pad=0.0)
    banks["w13_scale_2"] = banks["w13_scale_2"][:, :1].expand(-1, 2).contiguous()
    two = torch.empty(3, 64)
    run("nvfp4", x, tw, [rows], [banks], two)
    one = torch.empty(3, 64)
    run("nvfp4", x, tw, [rows], [dict(banks, w13_scale_2=banks["w13_scale_2"][:, 0].clone())], one)
    assert torch.equal(one, two)
    torch.testing.assert_close(two.double(), reference("nvfp4", x, tw, rows, banks), **TOL)


def test_errors_name_the_tensor_and_format():
    x, tw, rows, fp8 = make_problem("fp8", 3, 4, 64, 32, 8, pad=0.0)
    _, _, _, mx = make_problem("mxfp4", 3, 4, 64, 32, 8, pad=0.0)
    _, _, _, ch = make_problem("fp8-channel", 3, 4, 64, 32, 8, pad=0.0)
    out = torch.empty(3, 64)
    cases = [
        (
            dict(fp8, w13_scale=fp8["w13_scale"][:, :, :0]),
            "fp8",
            r"w13_scale\[0\] must be a \[8, 1, 1\]",
        ),
        (
            dict(fp8, w2=fp8["w2"].view(torch.uint8)),
            "fp8",
            r"w2\[0\] must be .*Float8_e4m3fn.*w2_weight",
        ),
        (dict(mx, w13_scale=mx["w13_scale"].float()), "mxfp4", r"w13_scale\[0\] .*e8m0 per 32"),
        (  # per-channel w13 scales with block w2 scales
            dict(ch, w2_scale=fp8["w2_scale"]),
            "fp8",
            r"w2_scale\[0\] must be a \[8, 64, 1\] .*one per output channel",
        ),
        (mx, "nvfp4", "one w13_scale_2 / w2_scale_2 per set"),
    ]
    for banks, fmt, msg in cases:
        kw = executor_args(QUANT_FORMATS["fp8"], [banks])
        kw["format"] = fmt
        with pytest.raises(RuntimeError, match=msg):
            moe_experts_cpu(x, tw, [rows], out=out, **kw)
    with pytest.raises(RuntimeError, match="format bf16 takes no w13_scale"):
        moe_experts_cpu(x, tw, [rows], [fp8["w13"]], [fp8["w2"]], out, w13_scale=[fp8["w13_scale"]])
    with pytest.raises(RuntimeError, match=r"format must be one of bf16 \(0\), fp8 \(1\)"):
        moe_experts_cpu(
            x, tw, [rows], out=out, **dict(executor_args(QUANT_FORMATS["fp8"], [fp8]), format=7)
        )
    with pytest.raises(ValueError, match="unknown expert format 'int4'"):
        moe_experts_cpu(
            x,
            tw,
            [rows],
            out=out,
            **dict(executor_args(QUANT_FORMATS["fp8"], [fp8]), format="int4"),
        )
    with pytest.raises(ValueError, match="multiples of 32"):
        QUANT_FORMATS["mxfp4"].banks(64, 48)
