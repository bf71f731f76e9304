"""A block-FP8 Qwen3-MoE block through the expert-slot cache, at the layer level (no server).

``fp8_moe_block_check.py`` (in a fresh process) builds upstream's ``Qwen3MoeSparseMoeBlock``
with upstream's ``Fp8Config`` from the tiny FP8 checkpoint (``tiny_models --quant fp8``: the
layout of Qwen3-30B-A3B-FP8) without the cache and with it at several sizes and policies.
Checked:

* the host pool holds every per-expert tensor of ``Fp8MoEMethod.create_weights`` as banks
  (``w13``/``w2`` float8_e4m3fn, ``w13_scale``/``w2_scale`` float32) with the checkpoint's
  bytes, and every slot holds the bytes of the host row it caches;
* every cache configuration is bit-identical to the stock FP8 block (all resident: the CPU
  executor runs the same kernel per (token, expert) from either bank set);
* the output is within the stated tolerance of a float64 reference with dequantized weights,
  and far from it with the scales dropped (so a lost scale cannot pass);
* broken checkpoints fail at load naming the tensor: a missing or mis-shaped expert
  ``weight_scale_inv``, a missing or mis-shaped attention ``weight_scale_inv``;
* the dense FP8 linears are dequantized to bf16 at load (patch 0003) to within bf16 rounding.
"""

from pathlib import Path

import pytest
import torch
from moe_block_util import run_block_check

SCRIPT = Path(__file__).with_name("fp8_moe_block_check.py")
CONFIGS = ("resident", "slots8_qstar", "slots8_cpu", "slots16_fill", "slots50pct_qstar")
# bf16 activations, FP8 weights dequantized exactly in fp32, fp32 accumulation, h and the
# output rounded to bf16 once each: the same rounding budget as the bf16 layer test
# (test_glm_moe_layer.py: measured ~6e-3 max, ~4e-3 mean there).
MAX_REL = 2e-2
MEAN_REL = 1e-2


@pytest.fixture(scope="module")
def block_results(tmp_path_factory):
    from sglang.test.tiny_models import build

    tmp = tmp_path_factory.mktemp("fp8")
    model = build("qwen3_moe", tmp / "qwen3-moe-fp8-tiny", quant="fp8")
    return run_block_check(SCRIPT, model, tmp / "out.pt")


def _rel(got: torch.Tensor, ref: torch.Tensor):
    err = (got.double() - ref).abs()
    return float(err.max() / ref.abs().max()), float(err.mean() / ref.abs().mean())


def test_methods(block_results):
    assert block_results["method"]["stock"] == "Fp8MoEMethod"
    for c in CONFIGS:
        assert block_results["method"][c] == "ExpertCacheMoEMethod", c


@pytest.mark.parametrize("config", CONFIGS)
def test_pool_holds_the_checkpoint_bytes(block_results, config):
    pool = block_results["pool"][config]
    assert pool["format"] == "fp8-block"
    assert pool["banks"] == {
        "w13": ("torch.float8_e4m3fn", (256, 256, 256)),
        "w2": ("torch.float8_e4m3fn", (256, 256, 128)),
        "w13_scale": ("torch.float32", (256, 2, 2)),
        "w2_scale": ("torch.float32", (256, 2, 1)),
    }
    assert pool["host_bytes_match_checkpoint"]
    assert pool["slots_hold_host_bytes"]


@pytest.mark.parametrize("config", CONFIGS)
def test_cache_bit_identical_to_stock(block_results, config):
    for i, (stock, got) in enumerate(zip(block_results["stock"], block_results[config])):
        assert got.dtype == torch.bfloat16 and got.shape == stock.shape
        assert torch.equal(stock, got), f"call {i}: {config} differs from the stock FP8 block"


def test_small_caches_hit_fill_and_run_on_the_cpu(block_results):
    snap = block_results["snapshot"]
    assert snap["resident"]["misses"] == 0 and snap["resident"]["hits"] > 0
    for c in ("slots8_qstar", "slots16_fill", "slots50pct_qstar"):
        s = snap[c]
        assert s["hits"] > 0 and s["fills"] > 0 and s["fills"] + s["cpu_experts"] == s["misses"]
    assert snap["slots8_cpu"]["fills"] == 0 and snap["slots8_cpu"]["cpu_experts"] > 0
    assert snap["slots8_qstar"]["cpu_experts"] > 0


@pytest.mark.parametrize("config", ("stock",) + CONFIGS)
def test_block_matches_float64_dequantized_reference(block_results, config):
    for i, (got, ref, unscaled) in enumerate(
        zip(block_results[config], block_results["ref"], block_results["ref_unscaled"])
    ):
        max_rel, mean_rel = _rel(got, ref)
        assert max_rel < MAX_REL and mean_rel < MEAN_REL, (config, i, max_rel, mean_rel)
        off_max, off_mean = _rel(got, unscaled)
        assert off_max > 5 * MAX_REL and off_mean > 5 * MEAN_REL, (config, i, off_max, off_mean)


def test_dense_linears_dequantized_at_load(block_results):
    q = block_results["qkv"]
    assert q["method"] == "UnquantizedLinearMethod" and q["dtype"] == "torch.bfloat16"
    assert not q["has_scale"]
    assert q["max_abs_err"] <= 2**-8 * q["max_abs_ref"]  # one bf16 rounding


@pytest.mark.parametrize(
    "case, names",
    [
        ("missing_expert_scale", ["model.layers.1.mlp.experts.5.up_proj.weight_scale_inv"]),
        (
            "misshaped_expert_scale",
            ["model.layers.1.mlp.experts.5.up_proj.weight_scale_inv", "(1, 1)", "(1, 2)"],
        ),
        ("missing_linear_scale", ["model.layers.1.self_attn.qkv_proj.weight_scale_inv"]),
        ("misshaped_linear_scale", ["model.layers.1.self_attn.qkv_proj.weight_scale_inv"]),
    ],
)
def test_broken_checkpoint_fails_at_load_naming_the_tensor(block_results, case, names):
    err = block_results["errors"][case]
    assert err.startswith("ValueError"), err
    for n in names:
        assert n in err, (n, err)
