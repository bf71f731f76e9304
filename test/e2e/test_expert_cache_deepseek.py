"""The real server with --enable-expert-cache on the tiny DeepSeek-V3-style model
(``deepseek_v3``, SGLang's ``DeepseekV3ForCausalLM``; issue 13's model coverage).

The model (``sglang.test.tiny_models``, deepseek-ai/DeepSeek-V3's config keys and tensor names,
bf16): multi-head latent attention (low-rank q and kv projections, decoupled RoPE with YaRN) on
``torch_native``, layer 0 dense, layers 1-3 MoE with 64 routed experts top-8 chosen by grouped
sigmoid routing with ``e_score_correction_bias`` (``noaux_tc``: 8 groups, 4 kept),
``routed_scaling_factor`` 2.5 and one shared expert (run unfused beside the cache, patch 0034).

Three servers, as ``test_expert_cache_glm.py``: all resident, 8 slots with ``qstar`` at
B_P / B_H = 0.5, and no cache with upstream's torch MoE loop. Checked: greedy tokens and every
returned logprob identical between the two cache servers, the 8-slot server's counters show
fills and CPU experts; the all-resident server's input logprobs against transformers in
float32 within the bounds of ``e2e_util.assert_as_accurate_as_torch_loop``.
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

ARCH = "deepseek_v3"
NEW_TOKENS = 16
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
    assert_identical_outputs(results("resident"), results("slots8"))
    assert_split_happened(results("slots8_metrics"), slots=8)


def test_mla_kv_shrinks_and_grows_with_streams_in_flight(server_pool):
    """Elastic KV on an MLA pool (issue 15): ``MLATokenToKVPool``'s one latent row per token
    and layer shrinks and grows while greedy streams decode
    (``test_elastic_kv.assert_kv_storm_keeps_streams``)."""
    from test_elastic_kv import assert_kv_storm_keeps_streams

    assert_kv_storm_keeps_streams(server_pool.get(ARCH, CACHE_SLOTS8), seed=31)


def test_all_resident_as_accurate_as_upstream_moe(results):
    """The cache (all resident) and upstream's torch MoE loop, both bf16, against transformers
    in float32 on the same checkpoint and prompts."""
    assert_as_accurate_as_torch_loop(
        model_path(ARCH),
        random_prompts(),
        native=results("native"),
        resident=results("resident"),
        hf_class="DeepseekV3ForCausalLM",
    )
