"""MXFP4 experts dequantized at load on a CPU without AMX (patch 0011, ``mxfp4_cpu.py``).

Oracles: transformers' ``convert_moe_packed_tensors`` (what transformers' gpt-oss runs on the
release's ``*_blocks`` / ``*_scales``) for the dequantization, exact in float32; and
``quantize_mxfp4.gpt_oss_moe_reference`` (float64, equal to transformers' ``GptOssMLP``) for the
whole MoE block once the dequantized layer runs through upstream's ``moe_forward_native`` (the
path ``Mxfp4MoEMethod.apply`` takes on such a CPU: biases, clamped SwiGLU on interleaved
gate/up rows), within 1e-4 relative in float32 (a swapped gate/up, a lost bias or clamp moves
it by O(1)).
"""

import pytest
import torch
from safetensors.torch import load_file

from sglang.srt.layers.quantization import mxfp4_cpu
from sglang.test import tiny_models
from sglang.test.tiny_models.quantize_mxfp4 import SWIGLU_ALPHA, gpt_oss_moe_reference


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = tiny_models.build("gpt_oss", tmp_path_factory.mktemp("m") / "gpt_oss")
    import json

    return load_file(str(d / "model.safetensors")), json.loads((d / "config.json").read_text())


def test_dequantize_matches_transformers(checkpoint):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    state, _ = checkpoint
    for p in ("gate_up_proj", "down_proj"):
        blocks = state[f"model.layers.1.mlp.experts.{p}_blocks"]
        scales = state[f"model.layers.1.mlp.experts.{p}_scales"]
        hf = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)
        ours = mxfp4_cpu.dequantize_mxfp4(blocks.flatten(-2), scales, torch.float32)
        assert ours.shape == hf.shape
        assert torch.equal(ours, hf)
        # bf16 holds every e2m1 * 2^k exactly (scales of a real checkpoint)
        assert torch.equal(
            mxfp4_cpu.dequantize_mxfp4(blocks.flatten(-2), scales, torch.bfloat16).float(), hf
        )


def test_dequantize_errors_name_the_problem():
    codes = torch.zeros(2, 4, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="must be uint8"):
        mxfp4_cpu.dequantize_mxfp4(
            codes.float(), torch.zeros(2, 4, 1, dtype=torch.uint8), torch.float32
        )
    with pytest.raises(ValueError, match="do not match"):
        mxfp4_cpu.dequantize_mxfp4(codes, torch.zeros(2, 4, 2, dtype=torch.uint8), torch.float32)


def _layer(state, prefix, num_experts):
    """A stand-in for upstream's FusedMoE after ``Mxfp4MoEMethod.create_weights`` and the
    gpt-oss loader: uint8 codes [E, N, K / 2], uint8 scales [E, N, K / 32], bf16 biases."""
    layer = torch.nn.Module()
    e = prefix + "experts."
    for ours, theirs in (("w13", "gate_up_proj"), ("w2", "down_proj")):
        blocks = state[f"{e}{theirs}_blocks"]
        layer.register_parameter(
            f"{ours}_weight", torch.nn.Parameter(blocks.flatten(-2).clone(), requires_grad=False)
        )
        layer.register_parameter(
            f"{ours}_weight_scale",
            torch.nn.Parameter(state[f"{e}{theirs}_scales"].clone(), requires_grad=False),
        )
        layer.register_parameter(
            f"{ours}_weight_bias",
            torch.nn.Parameter(state[f"{e}{theirs}_bias"].clone(), requires_grad=False),
        )
    layer.num_experts = num_experts
    return layer


def test_moe_block_through_upstream_native_path_matches_reference(checkpoint, caplog):
    from sglang.srt.layers.moe.fused_moe_native import moe_forward_native
    from sglang.srt.layers.moe.moe_runner import MoeRunnerConfig

    state, cfg = checkpoint
    prefix, top_k = "model.layers.2.mlp.", cfg["num_experts_per_tok"]
    layer = _layer(state, prefix, cfg["num_local_experts"])
    with caplog.at_level("INFO"):
        mxfp4_cpu._logged = False
        mxfp4_cpu.dequantize_moe_weights(layer, torch.float32)
    assert "dequantizing MXFP4 experts to float32 at load" in caplog.text
    assert layer.w13_weight.dtype == torch.float32 and not hasattr(layer, "w13_weight_scale")
    H, I2 = cfg["hidden_size"], 2 * cfg["intermediate_size"]
    assert layer.w13_weight.shape == (cfg["num_local_experts"], I2, H)
    assert layer.w2_weight.shape == (cfg["num_local_experts"], H, I2 // 2)

    x = torch.randn(23, H, generator=torch.Generator().manual_seed(0)) * 4  # clamps engage
    logits = x @ state[prefix + "router.weight"].float().T + state[prefix + "router.bias"].float()
    top_val, top_idx = torch.topk(logits, top_k, dim=-1)
    config = MoeRunnerConfig(
        activation="silu", gemm1_alpha=SWIGLU_ALPHA, gemm1_clamp_limit=cfg["swiglu_limit"]
    )
    out = moe_forward_native(layer, x, (top_val.softmax(-1), top_idx, None), config)
    ref = gpt_oss_moe_reference(x, state, prefix, top_k, limit=cfg["swiglu_limit"])
    err = (out.double() - ref).abs().max() / ref.abs().max()
    assert err < 1e-4, err
