"""A ModelOpt NVFP4 Qwen3-MoE block through the expert-slot cache, at the layer level (no
server).

``nvfp4_moe_block_check.py`` (in a fresh process) builds upstream's ``Qwen3MoeSparseMoeBlock``
with upstream's ``ModelOptFp4Config`` from the tiny NVFP4 checkpoint (``tiny_models --quant
nvfp4``: the layout of nvidia/Qwen3-30B-A3B-FP4) without the cache and with it at several sizes
(one layer's top-k = 8 slots to 100%) and policies. Checked:

* the host pool holds every per-expert tensor of ``ModelOptNvFp4FusedMoEMethod.create_weights``
  as banks (``w13``/``w2`` uint8 codes, ``w13_scale``/``w2_scale`` float8_e4m3fn per 16,
  ``w13_scale_2`` (gate, up) / ``w2_scale_2`` float32) with the checkpoint's bytes, and every
  slot holds the bytes of the host row it caches;
* every cache configuration is bit-identical to the stock NVFP4 block (all resident: the CPU
  executor runs the same kernel per (token, expert) from either bank set);
* the output is within the stated tolerance of a float64 reference with dequantized weights,
  and far from it with the scales dropped (so a lost scale cannot pass);
* broken checkpoints fail at load naming the tensor, with the cache and without: a missing or
  mis-shaped expert ``weight_scale``, a missing expert ``weight_scale_2``; a QKV linear without
  a shard's ``weight_scale`` or with a mis-shaped one;
* the dense NVFP4 linears are dequantized to bf16 at load (patch 0009) to within bf16 rounding.
"""

from pathlib import Path

import pytest
import torch
from moe_block_util import run_block_check

SCRIPT = Path(__file__).with_name("nvfp4_moe_block_check.py")
CONFIGS = ("resident", "slots8_qstar", "slots8_cpu", "slots16_fill", "slots50pct_qstar")
# bf16 activations, NVFP4 weights dequantized in fp32 (fp32(e2m1 * fp32(fp8 * global)), the
# float64 reference multiplies exactly), fp32 accumulation, h and the output rounded to bf16
# once each: the rounding budget of the bf16 and FP8 layer tests.
MAX_REL = 2e-2
MEAN_REL = 1e-2


@pytest.fixture(scope="module")
def block_results(tmp_path_factory):
    from sglang.test.tiny_models import build

    tmp = tmp_path_factory.mktemp("nvfp4")
    model = build("qwen3_moe", tmp / "qwen3-moe-nvfp4-tiny", quant="nvfp4")
    return run_block_check(SCRIPT, model, tmp / "out.pt")


def _rel(got: torch.Tensor, ref: torch.Tensor):
    err = (got.double() - ref).abs()
    return float(err.max() / ref.abs().max()), float(err.mean() / ref.abs().mean())


def test_methods(block_results):
    assert block_results["method"]["stock"] == "ModelOptNvFp4FusedMoEMethod"
    for c in CONFIGS:
        assert block_results["method"][c] == "ExpertCacheMoEMethod", c


@pytest.mark.parametrize("config", CONFIGS)
def test_pool_holds_the_checkpoint_bytes(block_results, config):
    pool = block_results["pool"][config]
    assert pool["format"] == "nvfp4"
    assert pool["banks"] == {
        "w13": ("torch.uint8", (256, 256, 128)),
        "w2": ("torch.uint8", (256, 256, 64)),
        "w13_scale": ("torch.float8_e4m3fn", (256, 256, 16)),
        "w2_scale": ("torch.float8_e4m3fn", (256, 256, 8)),
        "w13_scale_2": ("torch.float32", (256, 2)),
        "w2_scale_2": ("torch.float32", (256,)),
    }
    assert pool["host_bytes_match_checkpoint"]
    assert pool["slots_hold_host_bytes"]


@pytest.mark.parametrize("config", CONFIGS)
def test_cache_bit_identical_to_stock(block_results, config):
    for i, (stock, got) in enumerate(zip(block_results["stock"], block_results[config])):
        assert got.dtype == torch.bfloat16 and got.shape == stock.shape
        assert torch.equal(stock, got), f"call {i}: {config} differs from the stock NVFP4 block"


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


E5_UP = "model.layers.1.mlp.experts.5.up_proj.weight_scale"
E9_DOWN = "model.layers.1.mlp.experts.9.down_proj.weight_scale_2"


@pytest.mark.parametrize("where", ("cache", "stock"))
@pytest.mark.parametrize(
    "case, names",
    [
        ("missing_expert_scale", [E5_UP]),
        ("misshaped_expert_scale", [E5_UP, "(128, 1)", "(128, 16)"]),
        ("missing_expert_global", [E9_DOWN]),
    ],
)
def test_broken_expert_scales_fail_at_load_naming_the_tensor(block_results, where, case, names):
    err = block_results["errors"][f"{where}_{case}"]
    assert err.startswith("ValueError"), err
    for n in names:
        assert n in err, (n, err)


@pytest.mark.parametrize("case", ("missing_linear_scale", "misshaped_linear_scale"))
def test_broken_linear_scales_fail_at_load_naming_the_tensor(block_results, case):
    err = block_results["errors"][case]
    assert err.startswith("ValueError"), err
    assert "model.layers.1.self_attn.qkv_proj.weight_scale" in err, err
    # the tiny model's q / k / v shards: 4 x 64, 2 x 64, 2 x 64 rows; k (1) or v (2) is broken
    assert ("shard(s) [1] of [256, 128, 128]" if case.startswith("missing") else "(shard v)") in err
