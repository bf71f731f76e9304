"""The tiny gpt-oss: openai/gpt-oss-20b's checkpoint layout (MXFP4 experts) at tiny sizes.

Checked: the release's tensor names, dtypes and shapes (``mlp.experts.gate_up_proj_blocks``
uint8 [E, 2I, H/32, 16], ``_scales`` uint8 [E, 2I, H/32], ``_bias`` bf16 [E, 2I], the same for
``down_proj``; router weight + bias, q/k/v/o biases, per-head ``sinks``); ``config.json`` read by
transformers' ``GptOssConfig`` with alternating sliding / full layers and
``quantization_config.quant_method == "mxfp4"``; the packing decoded by transformers' own
``convert_moe_packed_tensors`` equal to :func:`mxfp4_dequantize` and within e2m1 rounding of the
float experts it was made from; transformers loading the model (dequantized on CPU) and
generating.
"""

import json

import torch
from safetensors import safe_open


def test_layout_and_config(gpt_oss_dir):
    cfg = json.loads((gpt_oss_dir / "config.json").read_text())
    assert cfg["architectures"] == ["GptOssForCausalLM"]
    assert cfg["quantization_config"]["quant_method"] == "mxfp4"
    assert cfg["layer_types"][:2] == ["sliding_attention", "full_attention"]
    e, h, i, nh = (
        cfg["num_local_experts"],
        cfg["hidden_size"],
        cfg["intermediate_size"],
        cfg["num_attention_heads"],
    )
    want = {
        "gate_up_proj_blocks": ("U8", [e, 2 * i, h // 32, 16]),
        "gate_up_proj_scales": ("U8", [e, 2 * i, h // 32]),
        "gate_up_proj_bias": ("BF16", [e, 2 * i]),
        "down_proj_blocks": ("U8", [e, h, i // 32, 16]),
        "down_proj_scales": ("U8", [e, h, i // 32]),
        "down_proj_bias": ("BF16", [e, h]),
    }
    with safe_open(str(gpt_oss_dir / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        for layer in range(cfg["num_hidden_layers"]):
            p = f"model.layers.{layer}."
            for suffix, (dtype, shape) in want.items():
                s = f.get_slice(p + "mlp.experts." + suffix)
                assert (s.get_dtype(), s.get_shape()) == (dtype, shape), suffix
            assert f.get_slice(p + "self_attn.sinks").get_shape() == [nh]
            for n in ("router.weight", "router.bias"):
                assert p + "mlp." + n in names
            for proj in "qkvo":
                assert f"{p}self_attn.{proj}_proj.bias" in names
        assert not any(n.endswith(("experts.gate_up_proj", "experts.down_proj")) for n in names)


def test_packing_matches_transformers(gpt_oss_dir):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from sglang.test.tiny_models import builder
    from sglang.test.tiny_models.quantize_mxfp4 import mxfp4_dequantize

    float_state = builder.make_state_dict("gpt_oss")
    with safe_open(str(gpt_oss_dir / "model.safetensors"), "pt") as f:
        for proj in ("gate_up_proj", "down_proj"):
            p = "model.layers.1.mlp.experts." + proj
            blocks, scales = f.get_tensor(p + "_blocks"), f.get_tensor(p + "_scales")
            ref = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, K, N]
            ours = mxfp4_dequantize(blocks, scales).transpose(1, 2)
            assert torch.equal(ref.float(), ours), proj
            w = float_state[p].float()
            # e2m1 keeps 1 mantissa bit: each element within half a step of the group scale
            assert ((ours - w).norm() / w.norm()).item() < 0.2, proj


def test_transformers_loads_and_generates(gpt_oss_dir):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        gpt_oss_dir,
        dtype=torch.float32,
        quantization_config=transformers.Mxfp4Config(dequantize=True),
    )
    assert type(model).__name__ == "GptOssForCausalLM"
    tok = transformers.AutoTokenizer.from_pretrained(gpt_oss_dir)
    # longer than the sliding window, so the sliding layers drop keys
    ids = tok(" ".join(["the capital of France is a city"] * 4), return_tensors="pt").input_ids
    assert ids.shape[1] > model.config.sliding_window
    out = model.generate(ids, max_new_tokens=8, do_sample=False)
    new = out[0, ids.shape[1] :]
    assert new.numel() == 8 and len(set(new.tolist())) > 1  # not a constant token


def test_moe_block_reference_matches_transformers(gpt_oss_dir):
    """The float64 MoE-block reference (the oracle for the executor's biased, clamped-SwiGLU
    epilogue) equals transformers' ``GptOssMLP`` run in float64 on the tiny model's layer 1,
    with inputs scaled so that the clamps at ``swiglu_limit`` are hit."""
    import transformers
    from safetensors.torch import load_file

    from sglang.test.tiny_models.quantize_mxfp4 import gpt_oss_moe_reference

    model = transformers.AutoModelForCausalLM.from_pretrained(
        gpt_oss_dir,
        dtype=torch.float32,
        quantization_config=transformers.Mxfp4Config(dequantize=True),
        experts_implementation="eager",  # the grouped-mm path has no float64
    ).double()
    state = load_file(str(gpt_oss_dir / "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, model.config.hidden_size, generator=g, dtype=torch.float64) * 8.0
    mlp = model.model.layers[1].mlp
    with torch.no_grad():
        want, _ = mlp(x.unsqueeze(0))
        gu = x @ mlp.experts.gate_up_proj[0] + mlp.experts.gate_up_proj_bias[0]
    assert (gu.abs() > model.config.swiglu_limit).any()  # the clamp matters at this scale
    got = gpt_oss_moe_reference(x, state, "model.layers.1.mlp.", model.config.num_experts_per_tok)
    unclamped = gpt_oss_moe_reference(x, state, "model.layers.1.mlp.", 4, limit=1e9)
    assert not torch.allclose(unclamped, got)  # the clamp changes the output here
    torch.testing.assert_close(got, want.reshape(got.shape), rtol=1e-10, atol=1e-10)


def test_quantization_config_read_by_upstream(gpt_oss_dir):
    """Upstream's ``ModelConfig`` finds ``quant_method: mxfp4`` and builds its ``Mxfp4Config``
    (registered on CPU only with the CPU engine, read at import: hence a subprocess)."""
    import os
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from sglang.srt.configs.model_config import ModelConfig\n"
        "from sglang.srt.layers.quantization import get_quantization_config\n"
        "mc = ModelConfig(sys.argv[1])\n"
        "c = get_quantization_config(mc.quantization).from_config(mc.hf_config.quantization_config)\n"
        "print(mc.quantization, type(c).__name__, c.is_checkpoint_mxfp4_serialized,"
        " mc.hf_config.sliding_window)\n"
    )
    env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code, str(gpt_oss_dir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-4:] == ["mxfp4", "Mxfp4Config", "True", "16"], out.stdout
