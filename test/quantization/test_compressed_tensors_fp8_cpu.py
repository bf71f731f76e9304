"""compressed-tensors FP8 on the CPU (``compressed_tensors_fp8_cpu.py``, patch 0083): the dense
dequantization against a float64 reference of the format's definition, and the load errors
(mis-shaped or missing ``weight_scale``) naming the tensor."""

import pytest
import torch

from sglang.srt.layers.quantization.compressed_tensors_fp8_cpu import (
    check_moe_layer,
    dequantize_linear,
    dequantize_weight,
    per_tensor_to_channel,
)
from sglang.test.tiny_models.quantize import block_quantize_fp8
from sglang.test.tiny_models.quantize_ct_fp8 import channel_quantize_fp8, tensor_quantize_fp8


def test_channel_dequantization_is_fp8_times_the_row_scale():
    w = torch.randn(96, 200) * torch.rand(96, 1) * 3
    q, s = channel_quantize_fp8(w)
    got = dequantize_weight(q, s, "x")
    want = q.double() * s.double()  # [96, 1] broadcast over the row
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=2**-23, atol=0)
    assert ((got.double() - w.double()).norm() / w.double().norm()) < 0.04
    assert not torch.allclose(got, q.float() * s[0])  # the rows' scales do differ


def test_block_dequantization_is_fp8_times_the_block_scale():
    w = torch.randn(200, 260)
    q, s = block_quantize_fp8(w, scale_dtype=torch.float32)
    got = dequantize_weight(q, s, "x", block=(128, 128))
    want = q.double() * s.double().repeat_interleave(128, 0).repeat_interleave(128, 1)[:200, :260]
    torch.testing.assert_close(got.double(), want, rtol=2**-23, atol=0)


def test_per_tensor_scales_become_row_scales():
    scale = torch.tensor([0.5, 2.0, 0.25])
    rows = per_tensor_to_channel(scale, [4, 2, 2], "qkv")
    assert rows.shape == (8, 1) and rows.dtype == torch.float32
    assert rows.flatten().tolist() == [0.5] * 4 + [2.0] * 2 + [0.25] * 2
    experts = torch.tensor([[1.0, 3.0], [5.0, 7.0]])  # [E, 2]: gate, up
    rows = per_tensor_to_channel(experts, (3, 3), "experts")
    assert rows.shape == (2, 6, 1)
    assert rows[1, :, 0].tolist() == [5.0] * 3 + [7.0] * 3
    with pytest.raises(ValueError, match=r"qkv.weight_scale: 3 per-tensor scales for 2 fused"):
        per_tensor_to_channel(scale, [4, 4], "qkv")
    scale[1] = torch.finfo(torch.float32).min  # k_proj's scale never loaded
    with pytest.raises(
        ValueError, match=r"qkv.weight_scale was not in the checkpoint \(shards \[1\]"
    ):
        per_tensor_to_channel(scale, [4, 2, 2], "qkv")


def test_fused_per_tensor_linear_dequantizes_each_shard_with_its_scale():
    from compressed_tensors.quantization import QuantizationStrategy

    shards = [torch.randn(16, 24) * m for m in (1.0, 10.0, 0.1)]  # q, k, v
    qs = [tensor_quantize_fp8(w) for w in shards]
    layer = torch.nn.Module()
    layer.prefix = "model.layers.0.self_attn.qkv_proj"
    layer.logical_widths = [16, 16, 16]
    layer.orig_dtype = torch.bfloat16
    layer.weight = torch.nn.Parameter(torch.cat([q for q, _ in qs]), requires_grad=False)
    layer.weight_scale = torch.nn.Parameter(torch.cat([s for _, s in qs]), requires_grad=False)
    layer.input_scale = torch.nn.Parameter(torch.full((3,), 0.05), requires_grad=False)
    scheme = type("Scheme", (), {"strategy": QuantizationStrategy.TENSOR})()
    dequantize_linear(layer, scheme)
    assert layer.weight.dtype == torch.bfloat16 and layer.weight.shape == (48, 24)
    assert not hasattr(layer, "weight_scale") and not hasattr(layer, "input_scale")
    want = torch.cat([q.double() * s.double() for q, s in qs]).to(torch.bfloat16)
    assert torch.equal(layer.weight.data, want)
    for got, w in zip(layer.weight.data.double().split(16), shards):
        assert ((got - w.double()).norm() / w.double().norm()) < 0.04


def test_scale_errors_name_the_tensor():
    q, s = channel_quantize_fp8(torch.randn(64, 32))
    with pytest.raises(
        ValueError, match=r"model.layers.0.self_attn.o_proj.weight_scale: shape \(64,\)"
    ):
        dequantize_weight(q, s.flatten(), "model.layers.0.self_attn.o_proj")
    s[5] = torch.finfo(torch.float32).min  # what upstream leaves where nothing was loaded
    with pytest.raises(ValueError, match=r"o_proj.weight_scale was not in the checkpoint .*\[5\]"):
        dequantize_weight(q, s, "model.layers.0.self_attn.o_proj")


def test_missing_expert_scales_are_named_at_load():
    layer = torch.nn.Module()
    layer.layer_id = 3
    layer.w13_weight_scale = torch.nn.Parameter(torch.ones(4, 64, 1), requires_grad=False)
    layer.w2_weight_scale = torch.nn.Parameter(torch.ones(4, 48, 1), requires_grad=False)
    layer.w13_weight_scale.data[2, 40] = float("nan")  # expert 2's up_proj (rows 32..63)
    layer.w2_weight_scale.data[1] = float("nan")
    with pytest.raises(ValueError) as e:
        check_moe_layer(layer)
    msg = str(e.value)
    assert "model.layers.3.mlp.experts.2.up_proj.weight_scale" in msg
    assert "model.layers.3.mlp.experts.1.down_proj.weight_scale" in msg
    assert "gate_proj" not in msg


def test_per_tensor_expert_scales_are_checked_then_held_per_row():
    layer = torch.nn.Module()
    layer.layer_id = 1
    layer.w13_weight = torch.nn.Parameter(torch.zeros(3, 8, 6, dtype=torch.float8_e4m3fn), False)
    layer.w2_weight = torch.nn.Parameter(torch.zeros(3, 6, 4, dtype=torch.float8_e4m3fn), False)
    w13 = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, float("nan")]])  # expert 2's up missing
    layer.w13_weight_scale = torch.nn.Parameter(w13, requires_grad=False)
    layer.w2_weight_scale = torch.nn.Parameter(torch.tensor([7.0, 8.0, 9.0]), False)
    with pytest.raises(ValueError) as e:
        check_moe_layer(layer)
    assert "model.layers.1.mlp.experts.2.up_proj.weight_scale" in str(e.value)
    assert "gate_proj" not in str(e.value) and "down_proj" not in str(e.value)
    layer.w13_weight_scale.data[2, 1] = 6.0
    layer.moe_runner_config = type("Cfg", (), {"activation": "silu", "is_gated": True})()
    layer.moe_runner_config.gemm1_alpha = layer.moe_runner_config.gemm1_clamp_limit = None
    check_moe_layer(layer)
    assert layer.w13_weight_scale.shape == (3, 8, 1) and layer.w2_weight_scale.shape == (3, 6, 1)
    assert layer.w13_weight_scale[2, :, 0].tolist() == [5.0] * 4 + [6.0] * 4
    assert layer.w2_weight_scale[1, :, 0].tolist() == [8.0] * 6
