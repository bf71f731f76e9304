"""The ``--quant ct-fp8`` / ``ct-fp8-block`` / ``ct-fp8-tensor`` tiny models: llm-compressor's
compressed-tensors FP8-Dynamic, FP8_BLOCK and static per-tensor FP8 layouts
(``quantize_ct_fp8.py``).

Checked against what upstream's loader needs and the releases hold: every decoder projection
``*_proj.weight`` float8_e4m3fn beside a float32 ``*_proj.weight_scale`` (``[N, 1]`` per
channel, ``[ceil(N/128), ceil(K/128)]`` per block, ``[1]`` per tensor, with a float32
``*_proj.input_scale`` [1] beside it), everything else (embeddings, ``lm_head``,
norms, routers, GLM's attention biases and correction bias) as in the bf16 model; the
``quantization_config`` parsed by upstream's ``CompressedTensorsConfig`` into the schemes the
server uses; the dequantized weights within e4m3's rounding of the bf16 model.
"""

import json
import math

import pytest
import torch
from safetensors import safe_open

from sglang.test import tiny_models

CASES = [
    ("qwen3_moe", "ct-fp8"),
    ("glm4_moe", "ct-fp8"),
    ("qwen3_moe", "ct-fp8-block"),
    ("qwen3_moe", "ct-fp8-tensor"),
]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def case(request, tmp_path_factory):
    arch, quant = request.param
    tmp = tmp_path_factory.mktemp("ct")
    return arch, quant, tiny_models.build(arch, tmp / "q", quant=quant), tmp


def test_layout(case):
    arch, quant, qdir, tmp = case
    bf16 = tiny_models.make_state_dict(arch)
    with safe_open(str(qdir / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        projections = [n for n, t in bf16.items() if n.endswith("_proj.weight") and t.dim() == 2]
        assert any(".mlp.experts.0.gate_proj.weight" in n for n in projections)
        scales = {n + "_scale" for n in projections}
        if quant == "ct-fp8-tensor":  # static activations: a calibrated input scale each
            scales |= {n.removesuffix(".weight") + ".input_scale" for n in projections}
        assert names == set(bf16) | scales
        for n, t in bf16.items():
            got = f.get_slice(n)
            assert got.get_shape() == list(t.shape), n
            if n in projections:
                assert got.get_dtype() == "F8_E4M3", n
                s = f.get_slice(n + "_scale")
                assert s.get_dtype() == "F32", n
                n_out, k = t.shape
                want = {
                    "ct-fp8": [n_out, 1],
                    "ct-fp8-block": [math.ceil(n_out / 128), math.ceil(k / 128)],
                    "ct-fp8-tensor": [1],
                }[quant]
                assert s.get_shape() == want, n
                if quant == "ct-fp8-tensor":
                    x = f.get_tensor(n.removesuffix(".weight") + ".input_scale")
                    assert x.dtype == torch.float32 and x.shape == (1,) and x.item() > 0, n
            else:
                assert f.get_tensor(n).dtype == t.dtype, n
        assert f.get_slice("model.layers.1.mlp.gate.weight").get_dtype() in ("BF16", "F32")


def test_quantization_config_read_by_upstream(case):
    from compressed_tensors.quantization import QuantizationStrategy

    from sglang.srt.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig,
    )

    arch, quant, qdir, _ = case
    q = json.loads((qdir / "config.json").read_text())["quantization_config"]
    assert q["quant_method"] == "compressed-tensors" and q["format"] == "float-quantized"
    assert q["ignore"] == ["lm_head", "re:.*mlp.gate$"]
    group = q["config_groups"]["group_0"]
    assert group["targets"] == ["Linear"]
    w, a = group["weights"], group["input_activations"]
    assert (w["num_bits"], w["type"], w["symmetric"], w["dynamic"]) == (8, "float", True, False)
    assert a["dynamic"] is (quant != "ct-fp8-tensor") and a["num_bits"] == 8
    cfg = CompressedTensorsConfig.from_config(q)
    target = cfg.target_scheme_map["Linear"]
    want = {
        "ct-fp8": QuantizationStrategy.CHANNEL,
        "ct-fp8-block": QuantizationStrategy.BLOCK,
        "ct-fp8-tensor": QuantizationStrategy.TENSOR,
    }[quant]
    assert target["weights"].strategy == want
    if quant == "ct-fp8-tensor":
        assert target["input_activations"].strategy == QuantizationStrategy.TENSOR
        assert target["input_activations"].dynamic is False
    assert cfg._is_fp8_w8a8(target["weights"], target["input_activations"])
    if quant == "ct-fp8-block":
        assert target["weights"].block_structure == [128, 128]


def test_dequantized_weights_within_e4m3_rounding(case):
    from sglang.test.tiny_models.quantize_ct_fp8 import dequantize_ct_fp8_checkpoint

    arch, quant, qdir, tmp = case
    bf16 = tiny_models.make_state_dict(arch)
    deq = dequantize_ct_fp8_checkpoint(qdir, tmp / "deq")
    assert "quantization_config" not in json.loads((deq / "config.json").read_text())
    with safe_open(str(deq / "model.safetensors"), "pt") as f:
        assert not any(n.endswith(("weight_scale", "input_scale")) for n in f.keys())
        for n in (
            "model.layers.1.mlp.experts.3.up_proj.weight",
            "model.layers.0.self_attn.o_proj.weight",
        ):
            w, d = bf16[n].double(), f.get_tensor(n).double()
            rel = (d - w).norm() / w.norm()
            assert 0 < rel < 0.04, (n, float(rel))  # e4m3: 3 mantissa bits
