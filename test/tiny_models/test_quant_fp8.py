"""The ``--quant fp8`` tiny model: the block-FP8 layout of Qwen's ``-FP8`` releases.

Checked against what upstream's loader needs and the releases hold: every decoder projection
``*_proj.weight`` float8_e4m3fn beside ``*_proj.weight_scale_inv`` of ``[ceil(N/128),
ceil(K/128)]`` (bf16 as stored in the releases); embeddings, ``lm_head``, norms and the router
bf16; ``quantization_config`` read by upstream's ``Fp8Config``; the dequantized weights within
e4m3's rounding of the bf16 model they were made from; the build deterministic.
"""

import filecmp
import json
import math

import pytest
import torch
from safetensors import safe_open


def test_layout(fp8_dir, moe_dir):
    with (
        safe_open(str(fp8_dir / "model.safetensors"), "pt") as f,
        safe_open(str(moe_dir / "model.safetensors"), "pt") as ref,
    ):
        names = set(f.keys())
        for n in ref.keys():
            shape = ref.get_slice(n).get_shape()
            dtype = f.get_slice(n).get_dtype()
            if n.endswith("_proj.weight"):
                assert dtype == "F8_E4M3", n
                s = f.get_slice(n + "_scale_inv")
                assert s.get_dtype() == "BF16", n
                assert s.get_shape() == [math.ceil(shape[0] / 128), math.ceil(shape[1] / 128)], n
                assert f.get_slice(n).get_shape() == shape, n
            else:
                assert dtype == "BF16" and n + "_scale_inv" not in names, n
        assert names == set(ref.keys()) | {
            n + "_scale_inv" for n in ref.keys() if n.endswith("_proj.weight")
        }
        assert "model.layers.0.mlp.experts.63.down_proj.weight_scale_inv" in names
        assert f.get_slice("model.layers.0.mlp.gate.weight").get_dtype() == "BF16"


def test_quantization_config_read_by_upstream(fp8_dir):
    from sglang.srt.layers.quantization.fp8 import Fp8Config

    cfg = json.loads((fp8_dir / "config.json").read_text())
    q = cfg["quantization_config"]
    assert q["quant_method"] == "fp8" and q["fmt"] == "e4m3"
    assert q["activation_scheme"] == "dynamic" and q["weight_block_size"] == [128, 128]
    fp8 = Fp8Config.from_config(q)
    assert fp8.is_checkpoint_fp8_serialized and fp8.weight_block_size == [128, 128]
    assert "lm_head" in fp8.ignored_layers and "model.layers.3.mlp.gate" in fp8.ignored_layers


def test_dequantized_weights_within_e4m3_rounding(tm, fp8_dir):
    from sglang.test.tiny_models.quantize import block_dequantize_fp8

    ref = tm.make_state_dict("qwen3_moe")
    with safe_open(str(fp8_dir / "model.safetensors"), "pt") as f:
        for n in (
            "model.layers.0.self_attn.q_proj.weight",
            "model.layers.2.mlp.experts.17.up_proj.weight",
            "model.layers.3.mlp.experts.63.down_proj.weight",
        ):
            w = block_dequantize_fp8(f.get_tensor(n), f.get_tensor(n + "_scale_inv"))
            r = ref[n].double()
            # e4m3: 3 mantissa bits, so |err| <= 2^-4 |w| for normal values, plus the
            # subnormal step (2^-9 of the block's scale) near zero.
            scale = f.get_tensor(n + "_scale_inv").double()
            step = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[
                : r.shape[0], : r.shape[1]
            ]
            assert ((w - r).abs() <= 2**-4 * r.abs() + 2**-9 * step).all(), n
            assert (w - r).abs().max() > 0, n  # really quantized


def test_two_builds_byte_identical(tm, fp8_dir, tmp_path):
    again = tm.build("qwen3_moe", tmp_path / "again", quant="fp8")
    for name in ("config.json", "model.safetensors"):
        assert filecmp.cmp(fp8_dir / name, again / name, shallow=False), name


def test_unsupported_quant_and_arch(tm, tmp_path):
    with pytest.raises(ValueError, match="choose from"):
        tm.build("qwen3_moe", tmp_path / "a", quant="int3")
    with pytest.raises(ValueError, match="qwen3_moe"):
        tm.build("glm4_moe", tmp_path / "b", quant="fp8")


def test_block_quantize_partial_blocks():
    from sglang.test.tiny_models.quantize import block_dequantize_fp8, block_quantize_fp8

    w = torch.randn(200, 130, generator=torch.Generator().manual_seed(0))
    q, s = block_quantize_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (200, 130)
    assert s.dtype == torch.bfloat16 and s.shape == (2, 2)
    assert torch.allclose(block_dequantize_fp8(q, s), w.double(), rtol=2**-4, atol=1e-2)
