"""The real server with --enable-expert-cache on the tiny mixtral model (``mixtral``, SGLang's
``MixtralForCausalLM``; issue 13's model coverage).

The model (transformers' ``MixtralConfig`` keys, mistralai/Mixtral-8x7B-v0.1's tensor names:
``block_sparse_moe.gate``, ``experts.{j}.w1`` / ``w3`` / ``w2``): 4 MoE layers of 8 experts, top-2, softmax
routing renormalized over the top-k, no shared expert, no q/k norm.

Three servers, as ``test_expert_cache_glm.py``: all resident, 8 slots with ``qstar`` at
B_P / B_H = 0.5 (fills and CPU experts both happen: its metrics say so), and no cache with
upstream's torch MoE loop. Checked: greedy tokens and every returned logprob identical between
the two cache servers; the all-resident server's input logprobs against transformers in float32
within the bounds of ``e2e_util.assert_as_accurate_as_torch_loop``.
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

ARCH = "mixtral"
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


def test_all_resident_as_accurate_as_upstream_moe(results):
    """The cache (all resident) and upstream's torch MoE loop, both bf16, against transformers
    in float32 on the same checkpoint and prompts."""
    assert_as_accurate_as_torch_loop(
        model_path(ARCH),
        random_prompts(),
        native=results("native"),
        resident=results("resident"),
        hf_class="MixtralForCausalLM",
    )
