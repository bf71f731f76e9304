"""A GLM-4.5 MoE block through the expert-slot cache, at the layer level (no server).

``glm_moe_block_check.py`` (in a fresh process: it publishes SGLang's runtime context and a
one-process gloo group) builds upstream's ``Glm4MoeSparseMoeBlock`` for layer 1 of the tiny
``glm4_moe`` model (grouped sigmoid routing with ``e_score_correction_bias``,
``routed_scaling_factor`` 2.5, one shared expert) without the cache, all resident and at one
layer's top-k, and runs upstream's ``forward_normal`` on five batches. Checked:

* the cache's block output is bit-identical to the stock block's for both cache sizes: on the
  CPU the cache and the stock path run the same executor kernel per (token, expert), upstream's
  ``TopK`` hands both the same routed ids and weights, and the factor is applied once, by the
  model, after the layer (``method.output_scale``: None on the CPU);
* upstream's ``TopK`` picks the experts transformers' router picks, and its weights are
  transformers' divided by the factor (on the CPU the factor is not folded into the weights);
* the block output is within bf16 rounding of transformers' ``Glm4MoeMoE`` in float32, and the
  same comparison against transformers with the factor dropped fails by far, so a lost or a
  doubled factor cannot pass;
* the shared expert stays unfused (upstream's own reason on the CPU; with the cache on CUDA,
  patch 0034's, tested in ``test_layer_config.py``).
"""

from pathlib import Path

import pytest
import torch
from moe_block_util import run_block_check

SCRIPT = Path(__file__).with_name("glm_moe_block_check.py")
# bf16 activations and weights, fp32 accumulation, two bf16 roundings (h and the output) and
# the model's bf16 multiply by the factor: measured max |err| / max |ref| ~6e-3, mean ~4e-3.
MAX_REL = 2e-2
MEAN_REL = 1e-2


@pytest.fixture(scope="module")
def block_results(tmp_path_factory):
    from sglang.test.tiny_models import build

    tmp = tmp_path_factory.mktemp("glm")
    model = build("glm4_moe", tmp / "glm4-moe-tiny")
    return run_block_check(SCRIPT, model, tmp / "out.pt", env=dict(TORCHDYNAMO_DISABLE="1"))


def _rel(got: torch.Tensor, ref: torch.Tensor):
    err = (got.float() - ref).abs()
    return float(err.max() / ref.abs().max()), float(err.mean() / ref.abs().mean())


def test_methods_and_unfused_shared_expert(block_results):
    r = block_results
    assert r["method"] == {
        "stock": "UnquantizedFusedMoEMethod",
        "resident": "ExpertCacheMoEMethod",
        "slots8": "ExpertCacheMoEMethod",
    }
    for name, (fusion_disabled, fused) in r["shared"].items():
        assert fusion_disabled and fused == 0, name


@pytest.mark.parametrize("config", ["resident", "slots8"])
def test_cache_block_bit_identical_to_stock(block_results, config):
    for i, (stock, got) in enumerate(zip(block_results["stock"], block_results[config])):
        assert got.dtype == torch.bfloat16 and got.shape == stock.shape
        assert torch.equal(stock, got), f"call {i}: {config} differs from the stock block"


def test_eight_slots_hit_fill_and_run_on_the_cpu(block_results):
    snap = block_results["snapshot"]
    assert snap["resident"]["misses"] == 0 and snap["resident"]["hits"] > 0
    s = snap["slots8"]
    assert s["slots"] == 8 and s["hits"] > 0 and s["fills"] > 0 and s["cpu_experts"] > 0
    assert s["fills"] + s["cpu_experts"] == s["misses"]


def test_upstream_topk_routes_like_transformers(block_results):
    """Same experts per token; on the CPU upstream's weights do not carry the factor."""
    factor = 2.5
    for i, ((ids, w), (hf_ids, hf_w)) in enumerate(
        zip(block_results["topk"], block_results["hf_topk"])
    ):
        assert torch.equal(ids.long().sort(-1).values, hf_ids.sort(-1).values), f"call {i}"
        dense = torch.zeros(ids.shape[0], 64).scatter(1, ids.long(), w.float())
        hf_dense = torch.zeros(ids.shape[0], 64).scatter(1, hf_ids, hf_w.float())
        torch.testing.assert_close(dense * factor, hf_dense, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(w.sum(-1), torch.ones(ids.shape[0]), atol=1e-5, rtol=0)


@pytest.mark.parametrize("config", ["stock", "resident", "slots8"])
def test_block_matches_transformers_float32(block_results, config):
    for i, (got, ref, unscaled) in enumerate(
        zip(block_results[config], block_results["hf"], block_results["hf_unscaled"])
    ):
        max_rel, mean_rel = _rel(got, ref)
        assert max_rel < MAX_REL and mean_rel < MEAN_REL, (config, i, max_rel, mean_rel)
        # The bounds tell a factor applied zero or two times apart from once.
        off_max, off_mean = _rel(got, unscaled)
        assert off_max > 5 * MAX_REL and off_mean > 5 * MEAN_REL, (config, i, off_max, off_mean)
