"""Resident bf16 MoE layers on the CPU executor (``sglang.srt.layers.moe.cpu_executor``, patch 0032).

Reference: float64 from the formula, per (t, k) ``g, u = w13[:I] @ x, w13[I:] @ x``,
``h = bf16(silu(g) * u)`` (the executor's one documented intermediate rounding), ``y = w2 @ h``,
``out[t] = sum_k w[t, k] * y``, then the output's bf16 rounding. Tolerance: one bf16 ulp of the
output (2^-8 relative) plus the executor's fp32/polynomial-exp error (2e-3, see
test/cpu_executor/test_kernel.py); a wrong gate/up order, a missing SiLU, a dropped
router weight or a wrong expert gives O(1) errors. Upstream's ``moe_forward_native`` (bf16 at
every step) must agree with the same reference within its own coarser tolerance, which shows the
two paths compute the same function.
"""

from __future__ import annotations

import types

import pytest
import torch

from sglang.srt.layers.moe import cpu_executor
from sglang.srt.layers.moe.fused_moe_native import moe_forward_native
from sglang.srt.layers.moe.moe_runner import MoeRunnerConfig

ATOL = RTOL = 1e-2


def make_layer(E=12, H=96, I=40, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    layer = torch.nn.Module()
    layer.num_experts = E
    layer.w13_weight = torch.nn.Parameter(
        (torch.randn(E, 2 * I, H, generator=g) / H**0.5).to(dtype), requires_grad=False
    )
    layer.w2_weight = torch.nn.Parameter(
        (torch.randn(E, H, I, generator=g) / I**0.5).to(dtype), requires_grad=False
    )
    return layer


def make_routing(T=37, K=4, E=12, H=96, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).bfloat16()
    logits = torch.randn(T, E, generator=g)
    w, ids = torch.topk(torch.softmax(logits, -1), K, dim=-1)
    return x, (w.float(), ids.int(), None)


def reference(layer, x, topk, act=torch.nn.functional.silu):
    w, ids = topk[0].double(), topk[1].long()
    w13, w2 = layer.w13_weight.double(), layer.w2_weight.double()
    I = w2.shape[2]
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            if e < 0:
                continue
            gu = w13[e] @ x[t].double()
            b13 = getattr(layer, "w13_weight_bias", None)
            if b13 is not None:
                gu = gu + b13[e].double()
            h = (act(gu[:I]) * gu[I:]).bfloat16().double()
            y = w2[e] @ h
            b2 = getattr(layer, "w2_weight_bias", None)
            if b2 is not None:
                y = y + b2[e].double()
            out[t] += w[t, k] * y
    return out


def test_matches_float64_reference_and_upstream_native():
    layer = make_layer()
    x, topk = make_routing()
    cfg = MoeRunnerConfig()
    got = cpu_executor.cpu_executor_forward(layer, x, topk, cfg)
    assert got is not None and got.dtype == torch.bfloat16 and got.shape == x.shape
    ref = reference(layer, x, topk)
    torch.testing.assert_close(got.double(), ref, atol=ATOL, rtol=RTOL)
    native = moe_forward_native(layer, x, topk, cfg)
    torch.testing.assert_close(native.double(), ref, atol=5e-2, rtol=5e-2)


def test_gelu_layer_matches_float64_reference_and_upstream_native():
    """Gated GELU experts (Gemma 4): the executor's ``gelu_tanh``, as upstream's loop runs
    ``GeluAndMul()`` (tanh by default); the SiLU reference misses."""
    layer = make_layer()
    x, topk = make_routing()
    cfg = MoeRunnerConfig(activation="gelu")
    got = cpu_executor.cpu_executor_forward(layer, x, topk, cfg)
    assert got is not None
    ref = reference(layer, x, topk, act=lambda g: torch.nn.functional.gelu(g, approximate="tanh"))
    torch.testing.assert_close(got.double(), ref, atol=ATOL, rtol=RTOL)
    native = moe_forward_native(layer, x, topk, cfg)
    torch.testing.assert_close(native.double(), ref, atol=5e-2, rtol=5e-2)
    assert not torch.allclose(got.double(), reference(layer, x, topk), atol=ATOL, rtol=RTOL)


def test_top1_router_weight_on_the_input(monkeypatch):
    """Llama 4 (top-1, ``apply_router_weight_on_input``): the expert runs on ``w * x`` (bf16, as
    upstream's ``apply_topk_weights_cpu``) with weight 1; weighting the output instead (the
    ordinary path) misses, since the expert is not linear."""
    layer = make_layer()  # no top_k attribute, as Llama 4's FusedMoE (built without one)
    x, (w, ids, _) = make_routing(K=1)
    w = torch.sigmoid(torch.randn(w.shape, generator=torch.Generator().manual_seed(3)) * 2)
    cfg = MoeRunnerConfig(apply_router_weight_on_input=True)
    got = cpu_executor.cpu_executor_forward(layer, x, (w, ids, None), cfg)
    assert got is not None
    xw = x * w.to(x.dtype)
    ref = reference(layer, xw, (torch.ones_like(w), ids, None))
    torch.testing.assert_close(got.double(), ref, atol=ATOL, rtol=RTOL)
    on_output = reference(layer, x, (w, ids, None))
    assert not torch.allclose(got.double(), on_output, atol=ATOL, rtol=RTOL)
    x4, topk4 = make_routing(K=4)
    with pytest.raises(RuntimeError, match="top-1 routing only"):
        cpu_executor.cpu_executor_forward(layer, x4, topk4, cfg)


def test_biased_layer_matches_float64_reference_and_upstream_native():
    """Expert biases (``w13_weight_bias`` [E, 2I], ``w2_weight_bias`` [E, H], float32 as
    upstream's loop adds them) reach the executor's bias banks; a plain-SiLU layer with biases
    runs there, as upstream's loop runs it."""
    layer = make_layer()
    g = torch.Generator().manual_seed(5)
    layer.w13_weight_bias = torch.nn.Parameter(
        torch.randn(12, 80, generator=g), requires_grad=False
    )
    layer.w2_weight_bias = torch.nn.Parameter(torch.randn(12, 96, generator=g), requires_grad=False)
    x, topk = make_routing()
    cfg = MoeRunnerConfig()
    assert cpu_executor.unsupported_reason(layer, x, cfg) is None
    got = cpu_executor.cpu_executor_forward(layer, x, topk, cfg)
    ref = reference(layer, x, topk)
    torch.testing.assert_close(got.double(), ref, atol=ATOL, rtol=RTOL)
    native = moe_forward_native(layer, x, topk, cfg)
    torch.testing.assert_close(native.double(), ref, atol=5e-2, rtol=5e-2)
    del layer.w2_weight_bias  # the bias matters at this tolerance
    layer.__dict__.pop(cpu_executor._REASON_ATTR, None)
    dropped = cpu_executor.cpu_executor_forward(layer, x, topk, cfg)
    assert not torch.allclose(dropped.double(), ref, atol=ATOL, rtol=RTOL)


def test_padding_ids_contribute_nothing():
    layer = make_layer()
    x, (w, ids, _) = make_routing()
    ids = ids.clone()
    ids[::3, -1] = -1
    got = cpu_executor.cpu_executor_forward(layer, x, (w, ids, None), MoeRunnerConfig())
    torch.testing.assert_close(
        got.double(), reference(layer, x, (w, ids, None)), atol=ATOL, rtol=RTOL
    )


def test_out_of_range_expert_id_is_an_error():
    layer = make_layer(E=12)
    x, (w, ids, _) = make_routing(E=12)
    ids = ids.clone()
    ids[0, 0] = 12
    with pytest.raises(RuntimeError):
        cpu_executor.cpu_executor_forward(layer, x, (w, ids, None), MoeRunnerConfig())


@pytest.mark.parametrize(
    "change,reason",
    [
        (lambda l, c: (make_layer(dtype=torch.float32), c), "bf16 only"),
        (lambda l, c: (l, MoeRunnerConfig(activation="relu2")), "gated SiLU and GELU only"),
        (lambda l, c: (l, MoeRunnerConfig(gemm1_alpha=1.702, gemm1_clamp_limit=7.0)), "alpha"),
        (
            lambda l, c: (
                setattr(
                    l,
                    "w2_weight",
                    torch.nn.Parameter(
                        l.w2_weight.transpose(1, 2).contiguous().transpose(1, 2),
                        requires_grad=False,
                    ),
                )
                or l,
                c,
            ),
            "non-contiguous",
        ),
    ],
)
def test_unsupported_layers_keep_upstreams_path(change, reason):
    layer, cfg = change(make_layer(), MoeRunnerConfig())
    x, topk = make_routing()
    why = cpu_executor.unsupported_reason(layer, x, cfg)
    assert why is not None and reason in why
    assert cpu_executor.cpu_executor_forward(layer, x, topk, cfg) is None


def test_env_keeps_upstreams_loop(monkeypatch):
    monkeypatch.setenv(cpu_executor.ENV_BACKEND, "native")
    layer = make_layer()
    x, topk = make_routing()
    assert cpu_executor.cpu_executor_forward(layer, x, topk, MoeRunnerConfig()) is None


def test_patched_forward_cpu_uses_the_executor(monkeypatch):
    """Patch 0032: the installed ``UnquantizedFusedMoEMethod.forward_cpu`` (no AMX here) returns
    the executor's output and never reaches ``moe_forward_native`` for a bf16 SiLU layer."""
    from sglang.srt.layers.moe import fused_moe_native
    from sglang.srt.layers.quantization import unquant

    def no_native(*a, **k):
        raise AssertionError("moe_forward_native called")

    monkeypatch.setattr(fused_moe_native, "moe_forward_native", no_native)
    method = unquant.UnquantizedFusedMoEMethod.__new__(unquant.UnquantizedFusedMoEMethod)
    method.moe_runner_config = MoeRunnerConfig()
    layer = make_layer()
    layer.use_intel_amx_backend = False
    x, topk = make_routing()
    res = method.forward_cpu(layer, types.SimpleNamespace(hidden_states=x, topk_output=topk))
    torch.testing.assert_close(
        res.hidden_states,
        cpu_executor.cpu_executor_forward(layer, x, topk, MoeRunnerConfig()),
        atol=0,
        rtol=0,
    )


def test_float32_activations_keep_upstreams_path():
    layer = make_layer()
    x, topk = make_routing()
    assert cpu_executor.cpu_executor_forward(layer, x.float(), topk, MoeRunnerConfig()) is None
    assert cpu_executor.cpu_executor_forward(layer, x, topk, MoeRunnerConfig()) is not None
