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


@pytest.fixture(scope="module")
def dsv3_fp8(tm, tmp_path_factory):
    """(bf16 twin, ``--quant fp8``) folders of the DeepSeek-V3-style model."""
    root = tmp_path_factory.mktemp("dsv3")
    return tm.build("deepseek_v3", root / "bf16"), tm.build(
        "deepseek_v3", root / "fp8", quant="fp8"
    )


def test_deepseek_v3_fp8_follows_the_release(dsv3_fp8):
    """deepseek-ai/DeepSeek-V3's block-FP8 layout (README_WEIGHTS.md, inference/model.py):
    every decoder projection, MLA's included, float8_e4m3fn beside a float32
    ``weight_scale_inv`` of [ceil(N/128), ceil(K/128)]; the router, embeddings, lm_head and
    every norm bf16, the correction bias float32; the release's four quantization keys."""
    from safetensors import safe_open

    from sglang.srt.layers.quantization.fp8 import Fp8Config

    bf16, fp8 = dsv3_fp8
    ref, names = _names(bf16), _names(fp8)
    proj = {n for n in ref if n.endswith(("_proj.weight", "_proj_with_mqa.weight"))}
    assert names.keys() == ref.keys() | {n + "_scale_inv" for n in proj}
    a, m = "model.layers.0.self_attn.", "model.layers.1.mlp."
    for w in (
        a + "q_a_proj",
        a + "q_b_proj",
        a + "kv_a_proj_with_mqa",
        a + "kv_b_proj",
        a + "o_proj",
        "model.layers.0.mlp.gate_proj",  # the dense first layer
        m + "shared_experts.down_proj",
        m + "experts.63.up_proj",
    ):
        assert names[w + ".weight"] == "F8_E4M3", w
        assert names[w + ".weight_scale_inv"] == "F32", w
    for n in names.keys() - proj:
        if not n.endswith("_scale_inv"):
            assert names[n] == ref[n], n  # as in the bf16 twin
    assert names[m + "gate.weight"] == names[a + "kv_a_layernorm.weight"] == "BF16"
    assert names[a + "q_a_layernorm.weight"] == names["lm_head.weight"] == "BF16"
    assert names[m + "gate.e_score_correction_bias"] == "F32"
    with safe_open(str(fp8 / "model.safetensors"), "pt") as f:
        for n in proj:
            r, c = f.get_slice(n).get_shape()
            assert f.get_slice(n + "_scale_inv").get_shape() == [-(-r // 128), -(-c // 128)], n
    raw = json.loads((fp8 / "config.json").read_text())
    q = raw["quantization_config"]
    assert q == {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    }
    assert not Fp8Config.from_config(q).ignored_layers
    # q_a_proj ends on a block boundary (upstream fuses it with kv_a_proj_with_mqa by rows)
    assert raw["q_lora_rank"] % 128 == 0
    twin = json.loads((bf16 / "config.json").read_text())
    assert {k: v for k, v in raw.items() if k != "quantization_config"} == twin


def test_deepseek_v3_fp8_dequantized_is_the_twin_within_e4m3(tm, dsv3_fp8, tmp_path):
    """The oracle's checkpoint (``dequantize_fp8_checkpoint``): the bf16 twin's weights within
    e4m3's rounding, and transformers loads it with nothing missing or unexpected."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from sglang.test.tiny_models.quantize import dequantize_fp8_checkpoint

    bf16, fp8 = dsv3_fp8
    deq = dequantize_fp8_checkpoint(fp8, tmp_path / "deq")
    got = load_file(str(deq / "model.safetensors"))
    ref = load_file(str(bf16 / "model.safetensors"))
    scales = load_file(str(fp8 / "model.safetensors"))
    assert got.keys() == ref.keys()
    for n in (
        "model.layers.2.self_attn.kv_b_proj.weight",
        "model.layers.3.mlp.experts.5.down_proj.weight",
    ):
        w, r = got[n].double(), ref[n].double()
        assert got[n].dtype == torch.float32
        # e4m3: |err| <= 2^-4 |w| for normal values, plus the subnormal step (2^-9 of the
        # block's scale) near zero
        s = scales[n + "_scale_inv"].double()
        step = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[: r.shape[0], : r.shape[1]]
        assert ((w - r).abs() <= 2**-4 * r.abs() + 2**-9 * step).all(), n
        assert (w - r).abs().max() > 0, n  # really quantized
    gate = "model.layers.1.mlp.gate.weight"
    assert torch.equal(got[gate], ref[gate])
    model, info = AutoModelForCausalLM.from_pretrained(
        str(deq), dtype=torch.float32, output_loading_info=True
    )
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    bad = ("missing_keys", "mismatched_keys", "unexpected_keys")
    assert not any(info.get(k) for k in bad), info
    with pytest.raises(ValueError, match="not block fp8"):
        dequantize_fp8_checkpoint(bf16, tmp_path / "x")


# --quant nvfp4 for qwen3_5_moe: the ModelOpt MIXED_PRECISION layout of
# nvidia/Qwen3.6-35B-A3B-NVFP4 (python/sglang/test/tiny_models/quantize_modelopt_mixed.py).
Q35 = "model.language_model.layers."


@pytest.fixture(scope="module")
def q35_nvfp4(tm, qwen3_5_dir, tmp_path_factory):
    return qwen3_5_dir, tm.build(
        "qwen3_5_moe", tmp_path_factory.mktemp("m") / "qwen3_5_moe_nvfp4", quant="nvfp4"
    )


def _slices(d):
    from safetensors import safe_open

    with safe_open(str(d / "model.safetensors"), "pt") as f:
        return {n: (f.get_slice(n).get_dtype(), f.get_slice(n).get_shape()) for n in f.keys()}


def test_qwen3_5_nvfp4_follows_the_release(q35_nvfp4):
    from sglang.test.tiny_models.quantize_modelopt_mixed import mixed_quant_algo

    bf16, d = q35_nvfp4
    ref, got = _slices(bf16), _slices(d)
    want = {}
    for n, (dtype, shape) in ref.items():
        algo = mixed_quant_algo(n)
        m = n[: -len(".weight")]
        if algo == "W4A16_NVFP4":  # weight-only: no input_scale
            n_rows, k = shape
            want[n] = ("U8", [n_rows, k // 2])
            want[m + ".weight_scale"] = ("F8_E4M3", [n_rows, k // 16])
            want[m + ".weight_scale_2"] = ("F32", [])
        elif algo == "FP8":
            want[n] = ("F8_E4M3", shape)
            want[m + ".weight_scale"] = ("F32", [])
            want[m + ".input_scale"] = ("F32", [])
        else:
            want[n] = (dtype, shape)
    assert got == want
    kinds = {n: mixed_quant_algo(n) for n in ref}
    for n in (
        Q35 + "0.mlp.experts.5.gate_proj.weight",
        Q35 + "0.mlp.shared_expert.down_proj.weight",
        "lm_head.weight",
    ):
        assert kinds[n] == "W4A16_NVFP4", n
    for n in (
        Q35 + "3.self_attn.q_proj.weight",
        Q35 + "3.self_attn.o_proj.weight",
        Q35 + "0.linear_attn.in_proj_qkv.weight",
        Q35 + "0.linear_attn.in_proj_z.weight",
        Q35 + "0.linear_attn.out_proj.weight",
    ):
        assert kinds[n] == "FP8", n
    for n in (
        Q35 + "0.linear_attn.in_proj_a.weight",
        Q35 + "0.linear_attn.in_proj_b.weight",
        Q35 + "0.linear_attn.conv1d.weight",
        Q35 + "0.mlp.gate.weight",
        Q35 + "0.mlp.shared_expert_gate.weight",
        "model.language_model.embed_tokens.weight",
        "model.visual.blocks.0.attn.qkv.weight",
    ):
        assert kinds[n] is None and got[n][0] == "BF16", n
    # fused at serving time: one per-tensor scale
    from safetensors import safe_open

    with safe_open(str(d / "model.safetensors"), "pt") as f:
        for group in (
            [f"{Q35}3.self_attn.{p}_proj.weight_scale" for p in "qkv"],
            [f"{Q35}0.linear_attn.in_proj_{p}.weight_scale" for p in ("qkv", "z")],
            [f"{Q35}1.mlp.experts.9.{p}_proj.weight_scale_2" for p in ("gate", "up")],
            [f"{Q35}1.mlp.shared_expert.{p}_proj.weight_scale_2" for p in ("gate", "up")],
        ):
            first = f.get_tensor(group[0])
            assert all(torch.equal(first, f.get_tensor(n)) for n in group[1:]), group


def test_qwen3_5_nvfp4_quantization_config_read_by_upstream(q35_nvfp4):
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.layers.quantization.modelopt_quant import ModelOptMixedPrecisionConfig

    _, d = q35_nvfp4
    q = json.loads((d / "config.json").read_text())["quantization_config"]
    assert (q["quant_method"], q["quant_algo"], q["kv_cache_scheme"]) == (
        "modelopt",
        "MIXED_PRECISION",
        None,
    )
    hq = json.loads((d / "hf_quant_config.json").read_text())["quantization"]
    assert hq["quantized_layers"] == q["quantized_layers"] and hq["kv_cache_quant_algo"] == "FP8"
    layers = q["quantized_layers"]
    assert layers["lm_head"] == {"group_size": 16, "quant_algo": "W4A16_NVFP4"}
    assert layers[Q35 + "2.mlp.experts"] == {"group_size": 16, "quant_algo": "W4A16_NVFP4"}
    assert not any(".mlp.experts." in k for k in layers)  # one entry per layer, not per expert
    assert Q35 + "0.mlp.gate" in q["ignore"] and "mtp*" in q["ignore"]
    cfg = ModelOptMixedPrecisionConfig.from_config(q)
    cfg.packed_modules_mapping = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
        "in_proj_qkvz": ["in_proj_qkv", "in_proj_z"],
        "in_proj_ba": ["in_proj_b", "in_proj_a"],
    }
    r = cfg.resolve_quant_algo
    assert r(Q35 + "3.self_attn.qkv_proj") == "FP8"
    assert r(Q35 + "0.linear_attn.in_proj_qkvz") == "FP8"
    assert r(Q35 + "0.linear_attn.in_proj_ba") is None
    assert r(Q35 + "0.mlp.experts") == "W4A16_NVFP4"
    assert r(Q35 + "0.mlp.shared_expert.gate_up_proj") == "W4A16_NVFP4"
    assert r("lm_head") == "W4A16_NVFP4"
    assert r(Q35 + "0.mlp.gate") is None
    assert ModelConfig(str(d)).quantization == "modelopt_mixed"


def test_qwen3_5_nvfp4_dequantized_is_the_twin_within_rounding(q35_nvfp4, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from sglang.test.tiny_models.quantize_modelopt_mixed import dequantize_mixed_checkpoint

    bf16, d = q35_nvfp4
    deq = dequantize_mixed_checkpoint(d, tmp_path / "deq")
    got = load_file(str(deq / "model.safetensors"))
    ref = load_file(str(bf16 / "model.safetensors"))
    assert got.keys() == ref.keys()
    for n, bound in (
        (Q35 + "2.mlp.experts.17.up_proj.weight", 0.15),  # NVFP4
        ("lm_head.weight", 0.15),
        (Q35 + "3.self_attn.k_proj.weight", 0.05),  # FP8 e4m3
        (Q35 + "0.linear_attn.out_proj.weight", 0.05),
    ):
        w, r = got[n].double(), ref[n].double()
        rel = float((w - r).norm() / r.norm())
        assert got[n].dtype == torch.float32 and 0 < rel < bound, (n, rel)
    assert torch.equal(got[Q35 + "0.mlp.gate.weight"], ref[Q35 + "0.mlp.gate.weight"])
    model, info = AutoModelForCausalLM.from_pretrained(
        str(deq), dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.get(k) for k in ("missing_keys", "mismatched_keys", "unexpected_keys"))
    with pytest.raises(ValueError, match="not ModelOpt MIXED_PRECISION"):
        dequantize_mixed_checkpoint(bf16, tmp_path / "x")
