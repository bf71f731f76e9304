"""The real server on the tiny Qwen3.5 MoE (``qwen3_5_moe``), stock and with --enable-expert-cache.

The model (``sglang.test.tiny_models``, the layout of Qwen/Qwen3.5-35B-A3B: a
``Qwen3_5MoeForConditionalGeneration`` whose text model has GemmaRMSNorms, gated DeltaNet
layers with separate ``in_proj_qkv`` / ``in_proj_z`` / ``in_proj_b`` / ``in_proj_a``, an
output-gated full attention every 4th layer with interleaved M-RoPE, 64 routed experts top-8 and
one gated shared expert; a one-block vision tower). Upstream serves it on a CPU through the ops
of ``sgl-kernel/csrc/cpu/qwen3_5.cpp``. Three servers (each start costs ~45 s here):

* all resident (``--expert-cache-size 100% --expert-cache-policy fill``);
* one layer's top-k, 8 slots, ``qstar`` with B_P / B_H fixed, so every layer call fills some
  misses and runs the others on the CPU;
* no cache, upstream's own CPU MoE (``SGLANG_CPU_MOE_BACKEND=native``, the per-expert torch
  loop).

Checked: greedy tokens and every returned logprob identical between the two cache servers, and
the all-resident server's input logprobs against transformers in float32 within the bounds of
``e2e_util.assert_as_accurate_as_torch_loop`` (relative to the torch-loop server's own error).
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

ARCH = "qwen3_5_moe"
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


def test_all_resident_as_accurate_as_upstream_moe(results):
    """The cache (all resident) and upstream's torch MoE loop, both bf16, against transformers
    in float32 on the same checkpoint and prompts."""
    assert_as_accurate_as_torch_loop(
        model_path(ARCH),
        random_prompts(),
        native=results("native"),
        resident=results("resident"),
        hf_class="Qwen3_5MoeForCausalLM",
    )


def test_image_request_refused_when_served_text_only(server_pool):
    """Without torchvision (this machine) the server serves Qwen3.5 text only (patch 0080): an
    image part is a 400 that says so, and the server keeps serving."""
    import requests

    srv = server_pool.get(ARCH, CACHE_RESIDENT)
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "what is it?"}, image]}],
        "max_tokens": 4,
    }
    r = requests.post(srv.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 400, r.text
    assert "multimodal" in r.text.lower() or "image" in r.text.lower(), r.text
    body["messages"][0]["content"] = "what is it?"
    assert requests.post(srv.url + "/v1/chat/completions", json=body, timeout=120).ok


def test_eight_slots_equal_all_resident(results):
    assert_identical_outputs(results("resident"), results("slots8"))
    assert_split_happened(results("slots8_metrics"), slots=8)


def test_hybrid_kv_shrinks_and_grows_with_streams_in_flight(server_pool):
    """Elastic KV on a hybrid model (issue 15): the full-attention layers' KV pool inside
    ``HybridLinearKVPool`` shrinks and grows while greedy streams decode; the recurrent states
    (request-indexed) stay where they are (``test_elastic_kv.assert_kv_storm_keeps_streams``)."""
    from test_elastic_kv import assert_kv_storm_keeps_streams

    assert_kv_storm_keeps_streams(server_pool.get(ARCH, CACHE_SLOTS8), seed=21)
