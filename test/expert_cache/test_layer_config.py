"""``make_for_layer``: which FusedMoE layers and server configurations the cache accepts, and
the error that lists every problem with what to change (no server; the runtime context that
upstream's layer reads is replaced by plain namespaces)."""

from types import SimpleNamespace

import pytest
import torch

import sglang.srt.runtime_context as runtime_context
from sglang.srt.layers.moe.expert_cache.method import (
    ExpertCacheMoEMethod,
    make_for_layer,
    output_scale,
)
from sglang.srt.layers.moe.moe_runner.base import MoeRunnerConfig
from sglang.srt.layers.quantization.unquant import UnquantizedFusedMoEMethod


def _context(monkeypatch, *, tp=1, ep=1, paged=False, device="cpu", **moe_flags):
    moe = SimpleNamespace(
        enable_expert_cache=True,
        enable_paged_experts=paged,
        expert_cache_size="25%",
        expert_cache_policy="qstar",
        **moe_flags,
    )
    monkeypatch.setattr(runtime_context, "get_exec", lambda: SimpleNamespace(moe=moe))
    monkeypatch.setattr(
        runtime_context,
        "get_parallel",
        lambda: SimpleNamespace(tp_size=tp, ep_size=ep, pp_size=1, dp_size=1),
    )
    monkeypatch.setattr(
        runtime_context,
        "process_model_config",
        lambda: SimpleNamespace(
            hf_text_config=SimpleNamespace(num_experts_per_tok=8, num_hidden_layers=4)
        ),
    )
    monkeypatch.setattr(runtime_context, "get_device", lambda: SimpleNamespace(device=device))


def _layer(**cfg):
    runner = MoeRunnerConfig(**{"num_experts": 64, "top_k": 8, "activation": "silu", **cfg})
    return SimpleNamespace(
        moe_runner_config=runner, top_k=8, layer_id=2, num_fused_shared_experts=0
    )


def _unquant():
    return UnquantizedFusedMoEMethod.__new__(UnquantizedFusedMoEMethod)


def test_a_plain_bf16_layer_gets_the_cache_method(monkeypatch):
    _context(monkeypatch)
    method = make_for_layer(_layer(), _unquant())
    assert isinstance(method, ExpertCacheMoEMethod)
    assert (method.layer_id, method.top_k, method.num_layers) == (2, 8, 4)
    assert method.config.size.fraction == 0.25


def _nvfp4():
    from sglang.srt.layers.quantization.modelopt_quant import ModelOptNvFp4FusedMoEMethod

    method = ModelOptNvFp4FusedMoEMethod.__new__(ModelOptNvFp4FusedMoEMethod)
    method.quant_config = SimpleNamespace(is_checkpoint_nvfp4_serialized=True)
    return method


def test_modelopt_nvfp4_experts_are_served_on_the_cpu_only(monkeypatch):
    _context(monkeypatch)
    method = make_for_layer(_layer(), _nvfp4())
    assert (method.label, method.weight_block_size) == ("nvfp4", None)
    _context(monkeypatch, device="cuda")
    with pytest.raises(RuntimeError, match="NVFP4 experts in GPU slots are not supported yet"):
        make_for_layer(_layer(), _nvfp4())


def _mxfp4():
    from sglang.srt.layers.quantization.mxfp4 import Mxfp4MoEMethod

    return Mxfp4MoEMethod.__new__(Mxfp4MoEMethod)


GPT_OSS = dict(gemm1_alpha=1.702, gemm1_clamp_limit=7.0)  # gpt_oss.py's FusedMoE arguments


def test_gpt_oss_mxfp4_experts_get_the_cache_with_their_swiglu(monkeypatch):
    import torch

    _context(monkeypatch)
    method = make_for_layer(_layer(params_dtype=torch.bfloat16, **GPT_OSS), _mxfp4())
    assert (method.label, method.weight_block_size) == ("mxfp4", None)
    assert method.activation == ("swiglu_oai", 1.702, 7.0)
    assert method.gate_up_interleaved  # MoeRunnerConfig.gate_up_interleaved's default
    method = make_for_layer(_layer(gate_up_interleaved=False, **GPT_OSS), _mxfp4())
    assert not method.gate_up_interleaved
    _context(monkeypatch, device="cuda")
    with pytest.raises(RuntimeError, match="MXFP4 experts in GPU slots are not supported yet"):
        make_for_layer(_layer(**GPT_OSS), _mxfp4())
    _context(monkeypatch)
    with pytest.raises(RuntimeError, match="runs in float32: serve it with --dtype bfloat16"):
        make_for_layer(_layer(params_dtype=torch.float32, **GPT_OSS), _mxfp4())


@pytest.mark.parametrize(
    "cfg,want",
    [
        ({}, ("silu", None, None)),
        (GPT_OSS, ("swiglu_oai", 1.702, 7.0)),
        (dict(swiglu_limit=10.0), ("swiglu_limit", None, 10.0)),
        (dict(gemm1_alpha=1.702), "needs gemm1_clamp_limit"),
        (dict(gemm1_clamp_limit=7.0), "without gemm1_alpha is not supported"),
        (dict(gemm1_beta=1.0, **GPT_OSS), "gemm1_beta are not supported"),
        (dict(activation="gelu"), ("gelu_tanh", None, None)),  # Gemma 4
        (dict(activation="gelu", swiglu_limit=7.0), "GELU experts with swiglu_limit"),
        (dict(activation="relu2"), "only gated SiLU and GELU experts"),
        (dict(is_gated=False), "only gated SiLU and GELU experts"),
    ],
)
def test_expert_activation_reads_the_runner_config(cfg, want):
    from sglang.srt.layers.moe.expert_cache.method import expert_activation

    runner = MoeRunnerConfig(**{"activation": "silu", **cfg})
    if isinstance(want, tuple):
        assert expert_activation(runner) == want
    else:
        with pytest.raises(ValueError, match=want):
            expert_activation(runner)


def test_every_problem_is_listed_with_what_to_change(monkeypatch):
    _context(monkeypatch, tp=2, paged=True, expert_cache_max_fills=0)
    layer = _layer(activation="relu2", apply_router_weight_on_input=True)
    layer.num_fused_shared_experts = 1
    with pytest.raises(RuntimeError) as err:
        make_for_layer(layer, object())
    msg = str(err.value)
    for part in (
        "--tp-size must be 1",
        "--enable-paged-experts and --enable-expert-cache exclude each other",
        "experts are not supported yet: serve the bf16 checkpoint",
        "only gated SiLU and GELU experts are supported (got relu2",
        "router weights applied on the input are supported with top-1 routing only",
        "drop --enforce-shared-experts-fusion",
        "--expert-cache-max-fills must be >= 1",
    ):
        assert part in msg, (part, msg)


def test_a_routed_scaling_factor_is_accepted(monkeypatch):
    """GLM-4.5 / DeepSeek-V3 layers (factor 2.5): the cache applies it where upstream does."""
    _context(monkeypatch)
    assert isinstance(
        make_for_layer(_layer(routed_scaling_factor=2.5), _unquant()), ExpertCacheMoEMethod
    )


@pytest.mark.parametrize(
    "factor,device,fused_in_topk,want",
    [
        (2.5, "cpu", False, None),  # the model multiplies the layer's output (glm4_moe.py:619)
        (2.5, "cuda", False, 2.5),  # the Triton combine multiplies its fp32 sum
        (2.5, "cuda", True, None),  # the router weights already carry it
        (None, "cuda", False, None),
        (1.0, "cuda", False, None),
    ],
)
def test_output_scale_follows_upstreams_stock_path(factor, device, fused_in_topk, want):
    import torch

    layer = SimpleNamespace(should_fuse_routed_scaling_factor_in_topk=fused_in_topk)
    cfg = MoeRunnerConfig(routed_scaling_factor=factor)
    assert output_scale(layer, cfg, torch.device(device)) == want


class _FusingModel:
    """A model class whose own gate allows fusing one shared expert (GLM-4.5 on CUDA)."""

    @classmethod
    def shared_experts_fusion_disable_reason(cls, hf_config, quant_config):
        return None

    @classmethod
    def num_fusable_shared_experts(cls, hf_config):
        return 1


@pytest.mark.parametrize("cache,enforce", [(True, False), (False, False), (True, True)])
def test_expert_cache_turns_shared_expert_fusion_off(monkeypatch, cache, enforce):
    """Patch 0034: with --enable-expert-cache, upstream's resolve_shared_experts_config builds
    the model unfused and logs why (through its log_info_on_rank0, which logs only on rank 0 of
    a started process group, so it is captured here); without the cache (or with fusion
    enforced, which make_for_layer then refuses) the model's own gate decides."""
    from sglang.srt.layers.moe import utils as moe_utils

    logged = []
    monkeypatch.setattr(moe_utils, "log_info_on_rank0", lambda _logger, msg: logged.append(msg))

    moe = SimpleNamespace(
        enable_expert_cache=cache,
        enforce_shared_experts_fusion=enforce,
        disable_shared_experts_fusion=False,
        enable_waterfill=False,
    )
    exec_ = lambda: SimpleNamespace(moe=moe)  # noqa: E731
    monkeypatch.setattr(runtime_context, "get_exec", exec_)
    monkeypatch.setattr(moe_utils, "get_exec", exec_)
    got = moe_utils.resolve_shared_experts_config(_FusingModel, None, None)
    if cache and not enforce:
        assert got.fusion_disabled and got.num_fused_shared_experts == 0
        assert logged == [
            "--enable-expert-cache runs shared experts unfused, as a resident MLP beside the "
            "expert-slot cache. Shared experts fusion optimization is disabled."
        ]
    else:
        assert not got.fusion_disabled and got.num_fused_shared_experts == 1
        assert logged == []


def test_top1_router_weight_on_the_input_is_applied_before_the_cache(monkeypatch):
    """Llama 4 (top-1, ``apply_router_weight_on_input``): the cache method is built, and its
    ``apply`` hands the cache ``w * x`` with weight 1 (upstream's ``apply_topk_weights_cpu``);
    top-k above 1 stays refused."""
    _context(monkeypatch)
    layer = _layer(apply_router_weight_on_input=True, top_k=1)
    layer.top_k = 1
    method = make_for_layer(layer, _unquant())
    seen = {}

    class FakeCache:
        def forward(self, layer_id, x, weights, ids, cfg, scale=None):
            seen.update(x=x, weights=weights)
            return x

    method.cache = FakeCache()
    method.moe_runner_config = layer.moe_runner_config  # as create_moe_runner sets it
    x = torch.randn(5, 16).bfloat16()
    w = torch.rand(5, 1)
    topk = (w, torch.zeros(5, 1, dtype=torch.int32), None)
    method.apply(layer, SimpleNamespace(hidden_states=x, topk_output=topk))
    assert torch.equal(seen["x"], x * w.to(x.dtype))
    assert torch.equal(seen["weights"], torch.ones(5, 1))
    with pytest.raises(RuntimeError, match="top-1 routing only .* got top-k 8"):
        make_for_layer(_layer(apply_router_weight_on_input=True), _unquant())
