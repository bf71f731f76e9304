"""The Mixtral-, OLMoE-, DeepSeek-V3-, Gemma-4- and Llama-4-style tiny models (``--arch
mixtral`` / ``olmoe`` / ``deepseek_v3`` / ``gemma4`` / ``llama4``): config, tensor names, and transformers loading them
with nothing missing or unexpected and routing as configured. The serving path is
``test/e2e/test_expert_cache_{mixtral_olmoe,deepseek,gemma4,llama4}.py``.
"""

import json

import pytest
import torch

LAYERS, HIDDEN = 4, 256


@pytest.fixture(scope="module", params=["mixtral", "olmoe", "deepseek_v3", "gemma4", "llama4"])
def built(request, tm, tmp_path_factory):
    arch = request.param
    return arch, tm.build(arch, tmp_path_factory.mktemp("m") / arch)


def _names(d):
    from safetensors import safe_open

    with safe_open(str(d / "model.safetensors"), "pt") as f:
        return {n: f.get_slice(n).get_dtype() for n in f.keys()}


def test_config_and_tensor_names_follow_the_release(built):
    arch, d = built
    raw = json.loads((d / "config.json").read_text())
    names = _names(d)
    a = "model.layers.0.self_attn."
    if arch == "gemma4":  # google/gemma-4-26B-A4B's layout: a VLM wrapper, fused experts
        assert raw["architectures"] == ["Gemma4ForConditionalGeneration"]
        t = raw["text_config"]
        assert (t["enable_moe_block"], t["num_experts"], t["top_k_experts"]) == (True, 32, 4)
        assert t["layer_types"][-1] == "full_attention" and t["global_head_dim"] > t["head_dim"]
        assert raw["tie_word_embeddings"] and "lm_head.weight" not in names
        p = "model.language_model.layers.0."
        for w in (
            "experts.gate_up_proj",
            "experts.down_proj",
            "router.proj.weight",
            "router.scale",
            "router.per_expert_scale",
            "mlp.gate_proj.weight",
        ):
            assert p + w in names, w
        assert any(n.startswith("model.vision_tower.") for n in names)
        assert set(names.values()) == {"BF16"}
        return
    if arch == "llama4":  # meta-llama/Llama-4-Scout's layout: top-1, fused input-major experts
        assert raw["architectures"] == ["Llama4ForConditionalGeneration"]
        t = raw["text_config"]
        assert (t["num_local_experts"], t["num_experts_per_tok"]) == (16, 1)
        p = "language_model.model.layers.0.feed_forward."
        assert names.keys() >= {
            p + "experts.gate_up_proj",
            p + "experts.down_proj",
            p + "router.weight",
            p + "shared_expert.down_proj.weight",
        }
        assert any(n.startswith("vision_model.") for n in names)
        assert set(names.values()) == {"BF16"}
        return
    if arch == "deepseek_v3":
        assert raw["architectures"] == ["DeepseekV3ForCausalLM"]
        assert (raw["topk_method"], raw["scoring_func"], raw["routed_scaling_factor"]) == (
            "noaux_tc",
            "sigmoid",
            2.5,
        )
        assert raw["rope_scaling"]["type"] == "yarn" and raw["first_k_dense_replace"] == 1
        for w in ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"):
            assert a + w + ".weight" in names
        assert "model.layers.0.mlp.gate_proj.weight" in names  # the dense first layer
        m = "model.layers.1.mlp."
        assert names[m + "gate.e_score_correction_bias"] == "F32"
        assert m + "shared_experts.down_proj.weight" in names
        assert m + "experts.63.up_proj.weight" in names
        return
    assert set(names.values()) == {"BF16"}
    if arch == "mixtral":
        assert raw["architectures"] == ["MixtralForCausalLM"]
        assert (raw["num_local_experts"], raw["num_experts_per_tok"]) == (8, 2)
        m = "model.layers.0.block_sparse_moe."
        assert m + "gate.weight" in names
        for j in range(8):
            assert all(m + f"experts.{j}.{w}.weight" in names for w in ("w1", "w2", "w3"))
        assert not any(".mlp." in n or "q_norm" in n for n in names)
    else:
        assert raw["architectures"] == ["OlmoeForCausalLM"]
        assert (raw["num_experts"], raw["num_experts_per_tok"]) == (64, 8)
        assert raw["norm_topk_prob"] is False and "head_dim" not in raw
        assert "model.layers.0.mlp.experts.63.down_proj.weight" in names
        hd = HIDDEN // raw["num_attention_heads"]
        from safetensors import safe_open

        with safe_open(str(d / "model.safetensors"), "pt") as f:  # whole-projection norms
            assert f.get_slice(a + "q_norm.weight").get_shape() == [HIDDEN]
            kv = raw["num_key_value_heads"] * hd
            assert f.get_slice(a + "k_norm.weight").get_shape() == [kv]


def test_transformers_loads_every_tensor_and_routes_as_configured(built):
    from transformers import AutoModelForCausalLM

    arch, d = built
    model, info = AutoModelForCausalLM.from_pretrained(
        str(d), dtype=torch.float32, output_loading_info=True
    )
    want = {
        "mixtral": "MixtralForCausalLM",
        "olmoe": "OlmoeForCausalLM",
        "deepseek_v3": "DeepseekV3ForCausalLM",
        "gemma4": "Gemma4ForConditionalGeneration",
        "llama4": "Llama4ForCausalLM",  # transformers' text-only class (the vision keys unused)
    }
    assert type(model).__name__ == want[arch]
    unused = {
        k
        for k in info.get("unexpected_keys", ())
        if not (arch == "llama4" and k.startswith(("vision_model.", "multi_modal_projector.")))
    }
    assert not (info.get("missing_keys") or info.get("mismatched_keys") or unused), info
    if arch == "llama4":  # top-1 of 16 over real hidden states spreads over the experts
        tm = model.model
        assert len(tm.layers) == LAYERS
        ids = torch.arange(1, 65).reshape(1, 64)
        with torch.no_grad():
            h = tm.embed_tokens(ids).reshape(64, -1)
            _, logits = tm.layers[0].feed_forward.router(h)  # (scores, logits)
            out = model(ids)
        assert logits.shape[-1] == 16 and logits.argmax(-1).unique().numel() > 16 // 2
        assert torch.isfinite(out.logits).all()
        return
    if arch == "gemma4":  # the router's top-k over real hidden states spreads over the experts
        lm = model.model.language_model
        assert len(lm.layers) == LAYERS
        ids = torch.arange(1, 65).reshape(1, 64)
        with torch.no_grad():
            h = lm.embed_tokens(ids).reshape(64, -1)
            _, _, top = lm.layers[0].router(h)
            out = model(ids)
        assert top.shape == (64, 4) and top.unique().numel() > 32 // 2
        assert torch.isfinite(out.logits).all()
        return
    assert len(model.model.layers) == LAYERS
    if arch == "deepseek_v3":  # no router logits output: the model runs and the MoE is there
        assert type(model.model.layers[1].mlp).__name__ == "DeepseekV3MoE"
        out = model(torch.arange(1, 65).reshape(1, 64))
        assert torch.isfinite(out.logits).all()
        return
    # router logits of a real input: every expert reachable, the top-k as configured
    ids = torch.arange(1, 65).reshape(1, 64)
    out = model(ids, output_router_logits=True)
    logits = out.router_logits[0]
    e, k = (
        model.config.num_local_experts if arch == "mixtral" else model.config.num_experts,
        (model.config.num_experts_per_tok),
    )
    assert logits.shape[-1] == e
    chosen = torch.topk(logits.reshape(-1, e), k, dim=-1).indices.unique()
    assert chosen.numel() > e // 2  # routing spreads over the experts
    assert torch.isfinite(out.logits).all()
