"""The real server with --enable-expert-cache on the tiny Mixtral- and OLMoE-style models
(``mixtral``, ``olmoe``: SGLang's ``MixtralForCausalLM`` / ``OlmoeForCausalLM``; issue 13's
model coverage).

* ``mixtral`` (transformers' ``MixtralConfig`` keys, mistralai/Mixtral-8x7B-v0.1's tensor names:
  ``block_sparse_moe.gate``, ``experts.{j}.w1`` / ``w3`` / ``w2``): 4 MoE layers of 8 experts,
  top-2, softmax routing renormalized over the top-k, no shared expert, no q/k norm.
* ``olmoe`` (``OlmoeConfig`` keys, allenai/OLMoE-1B-7B-0924's tensor names): 4 MoE layers of 64
  experts, top-8, softmax routing WITHOUT renormalizing the top-k weights (``norm_topk_prob``
  false, as released), q/k RMSNorms over the whole projection.

Two servers per model (CI time: the all-resident one of ``test_expert_cache_glm.py`` is left
out, since on the CPU an 8-slot cache is bit-identical to it by construction, which the Qwen,
GLM and DeepSeek files check on real servers): 8 slots with ``qstar`` at B_P / B_H = 0.5
(fills and CPU experts both happen: its metrics say so), and no cache with upstream's torch
MoE loop. Checked: the 8-slot server's input logprobs against transformers in float32 within
the bounds of ``e2e_util.assert_as_accurate_as_torch_loop``, and its split.
"""

from __future__ import annotations

import pytest
from conftest import model_path
from e2e_util import (
    CACHE_SLOTS8,
    TORCH_LOOP_ENV,
    assert_as_accurate_as_torch_loop,
    assert_split_happened,
    random_prompts,
    results_fixture,
)

NEW_TOKENS = 16
HF_CLASS = {"mixtral": "MixtralForCausalLM", "olmoe": "OlmoeForCausalLM"}
CONFIGS = {"slots8": (CACHE_SLOTS8, None), "native": ((), TORCH_LOOP_ENV)}
results_mixtral = results_fixture("mixtral", CONFIGS, NEW_TOKENS)
results_olmoe = results_fixture("olmoe", CONFIGS, NEW_TOKENS)


@pytest.fixture(params=sorted(HF_CLASS))
def arch_results(request):
    """(arch, its ``results``), one model after the other (each model's servers together)."""
    return request.param, request.getfixturevalue(f"results_{request.param}")


def test_eight_slots_split_the_misses(arch_results):
    _, results = arch_results
    assert_split_happened(results("slots8_metrics"), slots=8)


def test_eight_slots_as_accurate_as_upstream_moe(arch_results):
    """The cache (8 slots, qstar) and upstream's torch MoE loop, both bf16, against
    transformers in float32 on the same checkpoint and prompts."""
    arch, results = arch_results
    assert_as_accurate_as_torch_loop(
        model_path(arch),
        random_prompts(),
        native=results("native"),
        resident=results("slots8"),
        hf_class=HF_CLASS[arch],
    )
