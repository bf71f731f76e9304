"""The ``--quant nvfp4`` tiny model: the ModelOpt NVFP4 layout of nvidia/Qwen3-30B-A3B-FP4.

Checked against what upstream's loader needs and the releases hold: every decoder projection
``*_proj`` as ``weight`` uint8 ``[N, K/2]``, ``weight_scale`` float8_e4m3fn ``[N, K/16]``,
``weight_scale_2`` and ``input_scale`` float32 scalars; embeddings, ``lm_head``, norms and the
router bf16; fused projections (q/k/v, an expert's gate/up) sharing ``weight_scale_2``;
``hf_quant_config.json`` read by upstream's ``ModelConfig`` and ``ModelOptFp4Config`` with
``config.json`` left without ``quantization_config``; the dequantized weights within e2m1 /
e4m3 rounding of the bf16 model they were made from.
"""

import json

import pytest
import torch
from safetensors import safe_open

SUFFIXES = ("weight", "weight_scale", "weight_scale_2", "input_scale")


def test_layout(nvfp4_dir, moe_dir):
    with (
        safe_open(str(nvfp4_dir / "model.safetensors"), "pt") as f,
        safe_open(str(moe_dir / "model.safetensors"), "pt") as ref,
    ):
        names = set(f.keys())
        want = set()
        for n in ref.keys():
            shape = ref.get_slice(n).get_shape()
            if not n.endswith("_proj.weight"):
                assert f.get_slice(n).get_dtype() == ref.get_slice(n).get_dtype(), n
                want.add(n)
                continue
            m = n[: -len(".weight")]
            want |= {f"{m}.{s}" for s in SUFFIXES}
            n_rows, k = shape
            assert f.get_slice(n).get_dtype() == "U8" and f.get_slice(n).get_shape() == [
                n_rows,
                k // 2,
            ], n
            s = f.get_slice(m + ".weight_scale")
            assert s.get_dtype() == "F8_E4M3" and s.get_shape() == [n_rows, k // 16], n
            for g in ("weight_scale_2", "input_scale"):
                t = f.get_slice(f"{m}.{g}")
                assert t.get_dtype() == "F32" and t.get_shape() == [], (n, g)
        assert names == want
        assert f.get_slice("model.layers.0.mlp.gate.weight").get_dtype() == "BF16"
        assert f.get_slice("lm_head.weight").get_dtype() == "BF16"
        e = "model.layers.2.mlp.experts.17."
        assert torch.equal(
            f.get_tensor(e + "gate_proj.weight_scale_2"), f.get_tensor(e + "up_proj.weight_scale_2")
        )
        a = "model.layers.2.self_attn."
        qs = f.get_tensor(a + "q_proj.weight_scale_2")
        assert torch.equal(qs, f.get_tensor(a + "k_proj.weight_scale_2"))
        assert torch.equal(qs, f.get_tensor(a + "v_proj.weight_scale_2"))


def test_quantization_config_read_by_upstream(nvfp4_dir):
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.layers.quantization.modelopt_quant import ModelOptFp4Config

    assert "quantization_config" not in json.loads((nvfp4_dir / "config.json").read_text())
    hq = json.loads((nvfp4_dir / "hf_quant_config.json").read_text())
    assert hq["producer"]["name"] == "modelopt"
    q = hq["quantization"]
    assert q["quant_algo"] == "NVFP4" and q["group_size"] == 16
    assert q["kv_cache_quant_algo"] is None
    assert q["exclude_modules"] == ["lm_head"] + [f"model.layers.{i}.mlp.gate" for i in range(4)]
    cfg = ModelOptFp4Config.from_config(hq)
    assert cfg.is_checkpoint_nvfp4_serialized and cfg.group_size == 16
    assert cfg.is_layer_excluded("lm_head") and cfg.is_layer_excluded("model.layers.3.mlp.gate")
    assert not cfg.is_layer_excluded("model.layers.3.mlp.experts")
    assert not cfg.is_layer_excluded("model.layers.3.self_attn.qkv_proj")
    mc = ModelConfig(str(nvfp4_dir))
    assert mc.quantization == "modelopt_fp4"


def test_dequantized_weights_within_rounding(tm, nvfp4_dir):
    from sglang.test.tiny_models.quantize_nvfp4 import nvfp4_dequantize

    ref = tm.make_state_dict("qwen3_moe")
    with safe_open(str(nvfp4_dir / "model.safetensors"), "pt") as f:
        for n in (
            "model.layers.0.self_attn.q_proj.weight",
            "model.layers.2.mlp.experts.17.up_proj.weight",
            "model.layers.3.mlp.experts.63.down_proj.weight",
        ):
            m = n[: -len(".weight")]
            s, g = f.get_tensor(m + ".weight_scale"), f.get_tensor(m + ".weight_scale_2")
            w = nvfp4_dequantize(f.get_tensor(n), s, g)
            r = ref[n].double()
            # Per group of 16: e2m1's largest step is 2 (between 4 and 6), so |err| <= 1 step
            # of the group's effective scale (its e4m3 rounding can clip the group's max).
            eff = (s.double() * g.double()).repeat_interleave(16, dim=1)
            assert ((w - r).abs() <= 1.0 * eff + 1e-12).all(), n
            rel = float((w - r).norm() / r.norm())
            assert 0 < rel < 0.15, (n, rel)  # really quantized, and 4-bit close


def test_quantize_rejects_k_not_multiple_of_16():
    from sglang.test.tiny_models.quantize_nvfp4 import nvfp4_quantize

    with pytest.raises(ValueError, match="multiple of 16"):
        nvfp4_quantize(torch.randn(4, 40), 0.01)


def test_quantize_round_trip_exact_on_grid():
    """Values on the e2m1 grid of a representable scale come back exactly."""
    from sglang.test.tiny_models.quantize_nvfp4 import nvfp4_dequantize, nvfp4_quantize

    vals = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.5, -1, -1.5, -2, -3, -4, -6, 6])
    w = torch.stack([vals * 0.25, vals * 2.0])  # group amax 1.5 and 12 -> e4m3 scales exact
    q, s = nvfp4_quantize(w, 1.0)
    assert q.dtype == torch.uint8 and q.shape == (2, 8) and s.shape == (2, 1)
    assert torch.equal(nvfp4_dequantize(q, s, torch.tensor(1.0)), w.double())
    assert int(q[0, 0]) == (0 | (1 << 4))  # element 0 low nibble (0.0), element 1 high (0.5)
