"""The real server with --enable-expert-cache on the tiny Gemma-4-MoE-style model (``gemma4``:
SGLang's ``Gemma4ForConditionalGeneration``, served text-only; issue 13's model coverage).

The checkpoint (``tiny_models.builder._gemma4_config``) has google/gemma-4-26B-A4B's layout:
each decoder layer runs a dense GELU MLP beside a routed MoE of 32 GELU experts, top-4
(softmax router with a per-expert output scale, applied by upstream's ``TopK`` custom routing
function; the experts fused as ``experts.gate_up_proj`` / ``down_proj``), three sliding-window
layers and a last full-attention layer of wider heads (SGLang's hybrid SWA pool), tied
embeddings and final logit softcapping. What this needs here: the torch_native backend accepted
for Gemma 4 on the CPU (patch 0013), the model served text-only without torchvision
(``multimodal/processor_backends.py``), and the executor's ``gelu_tanh`` epilogue for the
experts (upstream's ``GeluAndMul`` default, transformers' ``gelu_pytorch_tanh``).

Three servers: 8 slots with ``qstar`` at B_P / B_H = 0.5 (fills and CPU experts both happen:
its metrics say so), no cache with upstream's torch MoE loop, and that loop in float32. Checked:
the float32 server equals transformers in float32 (what caught the router scale patch 0014
restores: both bf16 servers were equally far from transformers without it, so comparing them
with each other could not), and the cache's error within the bounds of
``e2e_util.assert_as_accurate_as_torch_loop``, and the split.
"""

from __future__ import annotations

import torch
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
CONFIGS = {
    "slots8": (CACHE_SLOTS8, None),
    "native": ((), TORCH_LOOP_ENV),
    "fp32": (("--dtype", "float32"), TORCH_LOOP_ENV),
}
FP32_MAX_ERROR = 1e-3  # |logprob| difference of two float32 runs (measured: 2.5e-5 mean)
results = results_fixture("gemma4", CONFIGS, NEW_TOKENS)


def test_eight_slots_split_the_misses(results):
    assert_split_happened(results("slots8_metrics"), slots=8)


def test_float32_server_equals_transformers(results):
    """SGLang's Gemma 4 (torch_native attention over the hybrid SWA pool, the MoE block with its
    router scales) in float32 against transformers' ``Gemma4ForConditionalGeneration``."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_path("gemma4"), dtype=torch.float32).eval()
    assert type(hf).__name__ == "Gemma4ForConditionalGeneration"
    for i, ids in enumerate(random_prompts()):
        with torch.no_grad():
            lp = hf(torch.tensor([ids])).logits.float().log_softmax(-1)[0]
        ref = torch.tensor([lp[j - 1, ids[j]].item() for j in range(1, len(ids))])
        err = (torch.tensor(results("fp32")[i]["in_lp"]) - ref).abs()
        assert err.max() <= FP32_MAX_ERROR, (i, len(ids), err.mean().item(), err.max().item())


def test_eight_slots_as_accurate_as_upstream_moe(results):
    """The cache (8 slots, qstar; GELU experts on the executor's epilogue) and upstream's torch
    MoE loop, both bf16, against transformers in float32 on the same checkpoint and prompts."""
    assert_as_accurate_as_torch_loop(
        model_path("gemma4"),
        random_prompts(),
        native=results("native"),
        resident=results("slots8"),
        hf_class="Gemma4ForConditionalGeneration",
    )


def test_served_text_only_with_the_reason_logged(results):
    log = results("native_log")
    assert "Multimodal is disabled for gemma4-moe-tiny" in log
    assert "Gemma4Processor" in log
