"""compressed-tensors FP8 on the CPU (``compressed_tensors_fp8_cpu.py``, patch 0083): the dense
dequantization against a float64 reference of the format's definition, and the load errors
(mis-shaped or missing ``weight_scale``) naming the tensor."""

import pytest
import torch

from sglang.srt.layers.quantization.compressed_tensors_fp8_cpu import (
    check_moe_layer,
    dequantize_weight,
)
from sglang.test.tiny_models.quantize import block_quantize_fp8
from sglang.test.tiny_models.quantize_ct_fp8 import channel_quantize_fp8


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
