"""The GLM-4.5-style tiny model (``--arch glm4_moe``): config, tensors, and both loaders.

Checked against transformers' own ``Glm4MoeConfig`` / ``Glm4MoeForCausalLM`` (the tensor names
load with nothing missing or unexpected, routing behaves as configured) and SGLang's config
reader; the serving path is ``test/e2e/test_expert_cache_glm.py`` and the MoE block at the
layer level ``test/expert_cache/test_glm_moe_layer.py``.
"""

import filecmp
import json

import torch

LAYERS, EXPERTS, TOP_K, HIDDEN = 4, 64, 8, 256


def _names_and_dtypes(d):
    from safetensors import safe_open

    with safe_open(str(d / "model.safetensors"), "pt") as f:
        return {n: f.get_slice(n).get_dtype() for n in f.keys()}


def test_build_is_byte_identical(tm, glm_dir, tmp_path):
    again = tm.build("glm4_moe", tmp_path / "again")
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert filecmp.cmp(glm_dir / name, again / name, shallow=False), name


def test_config_has_the_glm45_moe_features(glm_dir):
    from transformers import AutoConfig, Glm4MoeConfig

    raw = json.loads((glm_dir / "config.json").read_text())
    assert raw["architectures"] == ["Glm4MoeForCausalLM"] and raw["model_type"] == "glm4_moe"
    cfg = AutoConfig.from_pretrained(str(glm_dir))
    assert isinstance(cfg, Glm4MoeConfig)
    assert cfg.routed_scaling_factor == 2.5
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok) == (EXPERTS, TOP_K)
    assert cfg.n_group > 1 and 1 < cfg.topk_group < cfg.n_group  # grouped top-k
    assert cfg.n_shared_experts == 1 and cfg.first_k_dense_replace == 1
    assert cfg.num_hidden_layers == LAYERS and cfg.hidden_size == HIDDEN
    assert cfg.attention_bias and cfg.use_qk_norm and cfg.norm_topk_prob
    assert cfg.rope_parameters["partial_rotary_factor"] == 0.5
    assert cfg.num_nextn_predict_layers == 0


def test_tensors_have_the_release_names_and_dtypes(glm_dir):
    names = _names_and_dtypes(glm_dir)
    dense = "model.layers.0.mlp."
    assert all(dense + f"{n}.weight" in names for n in ("gate_proj", "up_proj", "down_proj"))
    assert not any(n.startswith(dense + "experts") or n.startswith(dense + "gate.") for n in names)
    for i in range(1, LAYERS):
        m = f"model.layers.{i}.mlp."
        assert names[m + "gate.weight"] == "BF16"
        assert names[m + "gate.e_score_correction_bias"] == "F32"
        for j in (0, EXPERTS - 1):
            assert m + f"experts.{j}.down_proj.weight" in names
        assert m + "shared_experts.gate_proj.weight" in names
        assert m + "gate_proj.weight" not in names
    for b in ("q_proj", "k_proj", "v_proj"):
        assert f"model.layers.0.self_attn.{b}.bias" in names
    assert "model.layers.0.self_attn.o_proj.bias" not in names
    assert "model.layers.0.self_attn.q_norm.weight" in names
    assert {d for n, d in names.items() if not n.endswith("e_score_correction_bias")} == {"BF16"}


def test_transformers_loads_every_tensor_and_routes_as_configured(glm_dir):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(
        str(glm_dir), dtype=torch.float32, output_loading_info=True
    )
    assert type(model).__name__ == "Glm4MoeForCausalLM"
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), (
        info
    )
    assert type(model.model.layers[0].mlp).__name__ == "Glm4MoeMLP"
    moe = model.model.layers[1].mlp
    assert type(moe).__name__ == "Glm4MoeMoE"
    with safe_open(str(glm_dir / "model.safetensors"), "pt") as f:
        bias = f.get_tensor("model.layers.1.mlp.gate.e_score_correction_bias")
        gate_up0 = torch.cat(
            [
                f.get_tensor("model.layers.1.mlp.experts.3.gate_proj.weight"),
                f.get_tensor("model.layers.1.mlp.experts.3.up_proj.weight"),
            ]
        )
    # the bias is loaded (not left at its zero init) and experts are fused gate-then-up
    assert torch.equal(moe.gate.e_score_correction_bias, bias) and bias.abs().sum() > 0
    assert torch.equal(moe.experts.gate_up_proj[3], gate_up0.float())

    x = torch.randn(300, HIDDEN, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, weights, ids = moe.gate(x)
    # weights renormalized then scaled by routed_scaling_factor
    torch.testing.assert_close(weights.sum(-1), torch.full((300,), 2.5), atol=1e-5, rtol=0)
    # every token's experts lie in at most topk_group of the n_group groups
    groups = ids // (EXPERTS // 8)
    assert max(len(set(row)) for row in groups.tolist()) <= 4
    # all experts get used: the random router is not degenerate
    assert torch.bincount(ids.flatten(), minlength=EXPERTS).min() > 0

    tokens = torch.randint(10, 30000, (1, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(tokens).logits[0]
    top2 = logits.topk(2, dim=-1).values
    assert torch.isfinite(logits).all() and logits.std() > 1.0
    assert (top2[:, 0] - top2[:, 1]).median() > 0.2


def test_sglang_reads_the_config(glm_dir):
    from sglang.srt.utils.hf_transformers.config import get_config

    cfg = get_config(str(glm_dir), trust_remote_code=False)
    assert type(cfg).__name__ == "Glm4MoeConfig"
    assert cfg.routed_scaling_factor == 2.5 and cfg.first_k_dense_replace == 1
