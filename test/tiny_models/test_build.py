"""Building: determinism, config contents, weight dtype/layout, CLI."""

import filecmp
import json
import os
import subprocess
import sys

import pytest
from conftest import PKG_DIR

FILES = [
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
]


def test_output_files(next_dir, moe_dir, glm_dir):
    for d in (next_dir, moe_dir, glm_dir):
        assert sorted(os.listdir(d)) == sorted(FILES)


def test_two_builds_byte_identical(tm, next_dir, tmp_path):
    again = tm.build("qwen3_next", tmp_path / "again")
    for name in FILES:
        assert filecmp.cmp(next_dir / name, again / name, shallow=False), name


def test_seed_changes_weights_only(tm, next_dir, tmp_path):
    other = tm.build("qwen3_next", tmp_path / "seed1", seed=1)
    assert not filecmp.cmp(
        next_dir / "model.safetensors", other / "model.safetensors", shallow=False
    )
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert filecmp.cmp(next_dir / name, other / name, shallow=False), name


def test_tokenizer_training_is_deterministic(tm, next_dir):
    """A fresh training run (no cache) reproduces the shipped tokenizer.json byte for byte."""
    from sglang.test.tiny_models import tokenizer as tok_mod

    fresh = tok_mod.train_tokenizer_json()
    assert fresh == (next_dir / "tokenizer.json").read_text(encoding="utf-8")


def test_refuses_to_overwrite_without_force(tm, next_dir, tmp_path):
    target = tmp_path / "busy"
    target.mkdir()
    (target / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError):
        tm.build("qwen3_next", target)
    assert (target / "keep.txt").exists()
    tm.build("qwen3_moe", target, force=True)
    assert not (target / "keep.txt").exists()
    assert json.loads((target / "config.json").read_text())["model_type"] == "qwen3_moe"


def test_qwen3_next_config(next_dir, tm):
    cfg = json.loads((next_dir / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3NextForCausalLM"]
    assert cfg["model_type"] == "qwen3_next"
    assert cfg["num_experts"] >= 64 and cfg["num_experts_per_tok"] == 8
    assert cfg["shared_expert_intermediate_size"] > 0
    assert cfg["decoder_sparse_step"] == 1 and cfg["mlp_only_layers"] == []  # MoE everywhere
    n, interval = cfg["num_hidden_layers"], cfg["full_attention_interval"]
    full = [i for i in range(n) if (i + 1) % interval == 0]
    assert 0 < len(full) < n  # hybrid: DeltaNet layers and full-attention layers
    assert cfg["max_position_embeddings"] >= 262144
    assert cfg["vocab_size"] == tm.VOCAB_SIZE
    assert cfg["torch_dtype"] == "bfloat16"
    ids = tm.added_token_ids()
    assert cfg["eos_token_id"] == ids["<|im_end|>"]
    gen = json.loads((next_dir / "generation_config.json").read_text())
    assert ids["<|im_end|>"] in gen["eos_token_id"]


def test_qwen3_moe_config(moe_dir):
    cfg = json.loads((moe_dir / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"]
    assert cfg["model_type"] == "qwen3_moe"
    assert cfg["num_experts"] == 64 and cfg["num_experts_per_tok"] == 8
    assert cfg["max_position_embeddings"] >= 262144


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_moe"])
def test_weights_are_bf16_with_per_expert_layout(arch, next_dir, moe_dir):
    import torch
    from safetensors import safe_open

    d = next_dir if arch == "qwen3_next" else moe_dir
    cfg = json.loads((d / "config.json").read_text())
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert all(f.get_slice(n).get_dtype() == "BF16" for n in names)
        emb = f.get_tensor("model.embed_tokens.weight")
        assert emb.dtype == torch.bfloat16
        assert emb.shape == (cfg["vocab_size"], cfg["hidden_size"])
    for j in (0, cfg["num_experts"] - 1):
        assert f"model.layers.0.mlp.experts.{j}.gate_proj.weight" in names
    if arch == "qwen3_next":
        assert "model.layers.0.linear_attn.in_proj_qkvz.weight" in names
        assert "model.layers.3.self_attn.q_proj.weight" in names
        assert "model.layers.0.mlp.shared_expert_gate.weight" in names
    else:
        assert not any("linear_attn" in n or "shared_expert" in n for n in names)


def test_cli(tmp_path, next_dir):
    out = tmp_path / "cli"
    env = dict(os.environ, PYTHONPATH=str(PKG_DIR.parent))
    cmd = [sys.executable, "-m", "tiny_models", "--arch", "qwen3_next", "--out", str(out)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "qwen3_next" in r.stdout
    assert filecmp.cmp(next_dir / "model.safetensors", out / "model.safetensors", shallow=False)
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--force" in r.stderr


def test_released_shape_config(tm):
    """``--shape qwen3-30b-a3b``: Qwen3-30B-A3B's layer sizes at 4 layers (checked on the config
    and the parameter count, without writing the 5 GB checkpoint)."""
    cfg = tm.builder.model_config("qwen3_moe", "qwen3-30b-a3b")
    want = dict(hidden_size=2048, num_experts=128, num_experts_per_tok=8, head_dim=128)
    want.update(moe_intermediate_size=768, num_attention_heads=32, num_key_value_heads=4)
    assert {k: cfg[k] for k in want} == want
    assert cfg["num_hidden_layers"] == 4 and cfg["architectures"] == ["Qwen3MoeForCausalLM"]
    h, v = 2048, cfg["vocab_size"]
    layer = h * 128 * (2 * 32 + 2 * 4) + 128 * h + 128 * 3 * 768 * h + 2 * h + 2 * 128
    assert tm.builder.param_count("qwen3_moe", "qwen3-30b-a3b") == 4 * layer + 2 * v * h + h
    with pytest.raises(ValueError, match="is a qwen3_moe model, not 'qwen3_next'"):
        tm.builder.model_config("qwen3_next", "qwen3-30b-a3b")
    with pytest.raises(ValueError, match="unknown shape"):
        tm.builder.model_config("qwen3_moe", "nope")
