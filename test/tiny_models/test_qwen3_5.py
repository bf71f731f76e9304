"""The tiny Qwen3.5 MoE (``qwen3_5_moe``): Qwen/Qwen3.5-35B-A3B's checkpoint layout, read by
transformers (both of its classes, no missing or unexpected tensor) and by SGLang's config
and multimodal checks."""

import json

import pytest
import torch


def test_layout(qwen3_5_dir):
    from safetensors import safe_open

    cfg = json.loads((qwen3_5_dir / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3_5MoeForConditionalGeneration"]
    text = cfg["text_config"]
    assert text["model_type"] == "qwen3_5_moe_text" and text["attn_output_gate"]
    assert text["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert sum(text["rope_parameters"]["mrope_section"]) * 2 == text["head_dim"] * 0.25
    for f in ("preprocessor_config.json", "video_preprocessor_config.json", "tokenizer.json"):
        assert (qwen3_5_dir / f).is_file(), f
    with safe_open(str(qwen3_5_dir / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        p = "model.language_model.layers.0."
        # separate gated-DeltaNet projections; one tensor per expert projection
        for proj in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"):
            assert f"{p}linear_attn.{proj}.weight" in names
        assert f"{p}mlp.experts.63.down_proj.weight" in names
        assert f"{p}mlp.shared_expert_gate.weight" in names
        q = f.get_slice("model.language_model.layers.3.self_attn.q_proj.weight").get_shape()
        assert q[0] == 2 * text["num_attention_heads"] * text["head_dim"]  # query + gate
        assert any(n.startswith("model.visual.blocks.0.") for n in names)
        assert f.get_tensor("lm_head.weight").dtype == torch.bfloat16


@pytest.mark.parametrize("cls", ["AutoModelForCausalLM", "Qwen3_5MoeForConditionalGeneration"])
def test_transformers_loads_every_tensor(qwen3_5_dir, cls):
    import transformers

    model, info = getattr(transformers, cls).from_pretrained(
        qwen3_5_dir, dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), (
        info
    )
    if cls == "AutoModelForCausalLM":  # the text model, which the parity tests use as oracle
        assert type(model).__name__ == "Qwen3_5MoeForCausalLM"
        with torch.no_grad():
            logits = model(torch.tensor([[5, 100, 2000, 30, 7, 900]])).logits[0]
        top2 = logits.topk(2, dim=-1).values
        assert logits.std() > 1.0 and (top2[:, 0] - top2[:, 1]).median() > 0.2


def test_sglang_serves_it_text_only_without_torchvision(qwen3_5_dir, monkeypatch):
    from sglang.srt.multimodal import processor_backends as pb
    from sglang.srt.utils.hf_transformers.config import get_config

    cfg = get_config(str(qwen3_5_dir), trust_remote_code=False)
    assert cfg.architectures == ["Qwen3_5MoeForConditionalGeneration"]
    monkeypatch.setattr(pb, "torchvision_available", lambda: False)
    reason = pb.text_only_reason(str(qwen3_5_dir))
    assert reason and "video_preprocessor_config.json" in reason and "torchvision" in reason
    monkeypatch.setattr(pb, "torchvision_available", lambda: True)
    assert pb.text_only_reason(str(qwen3_5_dir)) is None
