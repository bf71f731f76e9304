"""The real server with --enable-expert-cache on the tiny GLM-4.5-style MoE (``glm4_moe``).

The model (``sglang.test.tiny_models``, transformers' ``Glm4MoeConfig`` keys): layer 0 dense
(``first_k_dense_replace`` 1), layers 1-3 MoE with 64 routed experts top-8 chosen by grouped
sigmoid routing with ``e_score_correction_bias`` (8 groups, 4 kept), ``routed_scaling_factor``
2.5 and one shared expert. Three servers (each start costs ~45 s on a 2-core machine):

* all resident (``--expert-cache-size 100% --expert-cache-policy fill``);
* one layer's top-k, 8 slots, ``qstar`` with B_P / B_H fixed at 0.5, so every layer call fills
  some misses and runs the others on the CPU (its metrics say so);
* no cache, upstream's own CPU MoE (``SGLANG_CPU_MOE_BACKEND=native``: the per-expert torch
  loop, an independent path; the stock path without it is our executor, patch 0032, the
  cache's own kernel).

Checked: greedy tokens and every returned logprob identical between the two cache servers
(on the CPU each (token, expert) entry is computed the same way from a slot or from the host
pool, and the factor is applied once by the model after the layer); and the all-resident
server's input logprobs against transformers in float32 within ``e2e_util.MEAN_SLACK`` (mean),
``P95_SLACK`` (95th percentile) and ``MAX_SLACK`` (max) times the torch-loop server's own error
(the bounds of ``test_expert_cache.py``). A factor lost or applied twice scales every MoE
layer's routed output by 2.5x either way, far outside bf16 rounding
(``test/expert_cache/test_glm_moe_layer.py`` checks the block against transformers with
and without the factor; this file did not measure the whole model with a wrong factor).
"""

from __future__ import annotations

from conftest import model_path
from e2e_util import (
    CACHE_RESIDENT,
    CACHE_SLOTS8,
    TORCH_LOOP_ENV,
    assert_as_accurate_as_torch_loop,
    assert_identical_outputs,
    assert_split_happened,
    random_prompts,
    results_fixture,
)

ARCH = "glm4_moe"
NEW_TOKENS = 16
# "resident": all experts in slots; "slots8": one layer's top-k with qstar (its counters:
# "slots8_metrics"); "native": no cache, upstream's torch MoE loop
results = results_fixture(
    ARCH,
    {
        "resident": (CACHE_RESIDENT, None),
        "slots8": (CACHE_SLOTS8, None),
        "native": ((), TORCH_LOOP_ENV),
    },
    NEW_TOKENS,
)


def test_eight_slots_equal_all_resident(results):
    resident = results("resident")
    got = results("slots8")
    assert_identical_outputs(resident, got)
    assert_split_happened(results("slots8_metrics"), slots=8)


def test_all_resident_as_accurate_as_upstream_moe(results):
    """The cache (all resident) and upstream's torch MoE loop, both bf16, against transformers
    in float32 on the same checkpoint and prompts."""
    assert_as_accurate_as_torch_loop(
        model_path(ARCH),
        random_prompts(),
        native=results("native"),
        resident=results("resident"),
        hf_class="Glm4MoeForCausalLM",
    )
