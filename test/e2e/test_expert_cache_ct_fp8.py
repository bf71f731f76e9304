"""The real server on the tiny compressed-tensors FP8 models (llm-compressor's "FP8-Dynamic"
layout, ``tiny_models --quant ct-fp8``; ``ct-fp8-block`` for FP8_BLOCK, ``ct-fp8-tensor`` for
its static per-tensor "FP8"), on this CPU:

* ``qwen3_moe_ct_fp8``: RedHatAI/Qwen3-30B-A3B-FP8-dynamic's layout (every decoder Linear FP8
  with a float32 ``weight_scale`` [N, 1], router and ``lm_head`` ignored);
* ``glm4_moe_ct_fp8``: the GLM-4.5/4.6 FP8-Dynamic releases' (the same over GLM-4.5's attention
  with q/k/v biases, its dense first layer and shared expert; sigmoid grouped routing with a
  correction bias, ``routed_scaling_factor`` 2.5);
* ``qwen3_moe_ct_fp8_block``: llm-compressor's FP8_BLOCK (``weight_scale`` per 128 x 128
  block);
* ``qwen3_moe_ct_fp8_tensor``: llm-compressor's "FP8" (RedHatAI/Mixtral-8x7B-Instruct-v0.1-FP8's
  layout: ``weight_scale`` [1] and a calibrated static ``input_scale`` [1] per projection; the
  fused qkv / gate-up shards keep their own scales).

Two servers per model (each start costs ~45 s on a 2-core machine):

* no cache: upstream's ``CompressedTensorsW8A8Fp8`` / ``CompressedTensorsW8A8Fp8MoE``, which
  upstream cannot even select on a CPU (its capability check needs CUDA); with patch 0083 the
  dense FP8 linears are dequantized to bf16 at load and the FP8 experts run on the CPU executor
  from their own tensors, all resident;
* ``--enable-expert-cache`` with one layer's top-k, 8 slots, ``qstar`` with B_P / B_H fixed:
  every layer call fills some misses into slots and runs the others on the CPU from the FP8
  host pool (per-channel scales in the pool and slots; its metrics say so).

Checked: the no-cache server serves (its log says the dense linears were dequantized), the
8-slot server's greedy tokens and every logprob are identical to it (every (token, expert)
entry runs the same FP8 kernel from a slot, the host pool or the resident layer), and the
no-cache server's prompt logprobs against transformers float32 on the dequantized checkpoint
(``quantize_ct_fp8.dequantize_ct_fp8_checkpoint``) are as accurate as transformers' own bf16 of
that checkpoint (``e2e_util.assert_as_accurate_as_transformers_bf16``: mean |error| within
1.2x, max within 2x; measured over 2392 tokens on an AVX2 machine, server / transformers bf16:
Qwen3-MoE mean 0.061 / 0.066, max 0.73 / 0.73; GLM-4.5 mean 0.142 / 0.155, max 4.51 / 4.30;
Qwen3-MoE FP8_BLOCK mean 0.064 / 0.068, max 0.88 / 0.62; Qwen3-MoE per-tensor mean 0.062 /
0.069, max 0.77 / 0.63).
"""

from __future__ import annotations

import pytest
from conftest import model_path
from e2e_util import (
    CACHE_SLOTS8,
    assert_as_accurate_as_transformers_bf16,
    assert_identical_outputs,
    assert_split_happened,
    results_fixture,
)

NEW_TOKENS = 16
CONFIGS = {"stock": ((), None), "slots8": (CACHE_SLOTS8, None)}
qwen3_moe_ct_fp8 = results_fixture("qwen3_moe_ct_fp8", CONFIGS, NEW_TOKENS, accuracy_of="stock")
glm4_moe_ct_fp8 = results_fixture("glm4_moe_ct_fp8", CONFIGS, NEW_TOKENS, accuracy_of="stock")
qwen3_moe_ct_fp8_block = results_fixture(
    "qwen3_moe_ct_fp8_block", CONFIGS, NEW_TOKENS, accuracy_of="stock"
)
qwen3_moe_ct_fp8_tensor = results_fixture(
    "qwen3_moe_ct_fp8_tensor", CONFIGS, NEW_TOKENS, accuracy_of="stock"
)
HF_CLASS = {
    "qwen3_moe_ct_fp8": "Qwen3MoeForCausalLM",
    "glm4_moe_ct_fp8": "Glm4MoeForCausalLM",
    "qwen3_moe_ct_fp8_block": "Qwen3MoeForCausalLM",
    "qwen3_moe_ct_fp8_tensor": "Qwen3MoeForCausalLM",
}
LABEL = {
    "qwen3_moe_ct_fp8": "ct-fp8 (per channel)",
    "glm4_moe_ct_fp8": "ct-fp8 (per channel)",
    "qwen3_moe_ct_fp8_block": "ct-fp8 (block 128x128)",
    "qwen3_moe_ct_fp8_tensor": "ct-fp8 (per tensor)",
}


@pytest.fixture(params=tuple(HF_CLASS))
def arch(request):
    return request.param


@pytest.fixture
def results(arch, request):
    return request.getfixturevalue(arch)


def test_ct_fp8_serves_without_the_cache(arch, results):
    outs = results("stock")
    assert [len(o["tokens"]) for o in outs] == [NEW_TOKENS] * len(outs)
    assert all(lp <= 0 for o in outs for lp in o["in_lp"] + o["out_lp"])
    log = results("stock_log")
    assert "compressed-tensors FP8 on the CPU: dense FP8 linears are dequantized" in log
    assert "Using CompressedTensorsW8A8Fp8MoE" in log
    static = "static input scales are loaded and not applied" in log
    assert static == arch.endswith("_tensor")


def test_eight_slots_equal_all_resident(arch, results):
    stock = results("stock")
    got = results("slots8")
    assert_identical_outputs(stock, got)
    assert_split_happened(results("slots8_metrics"), slots=8)
    assert f"routed {LABEL[arch]} experts" in results("slots8_log")


def test_as_accurate_as_transformers_bf16_on_the_dequantized_checkpoint(arch, results, tmp_path):
    """Prompt logprobs of the no-cache server (= the 8-slot server's, above) against
    transformers float32 on the dequantized checkpoint: mean |error| within 1.2x and max
    within 2x of transformers bf16's on the same checkpoint
    (``e2e_util.assert_as_accurate_as_transformers_bf16``)."""
    from sglang.test.tiny_models.quantize_ct_fp8 import dequantize_ct_fp8_checkpoint

    deq = dequantize_ct_fp8_checkpoint(model_path(arch), tmp_path / "deq")
    assert_as_accurate_as_transformers_bf16(results("stock_accuracy"), deq, HF_CLASS[arch], arch)


@pytest.mark.parametrize("model", ["qwen3_moe_ct_fp8", "qwen3_moe_ct_fp8_tensor"])
@pytest.mark.parametrize("extra", [(), ("--enable-expert-cache",)], ids=["stock", "cache"])
def test_missing_expert_scale_fails_at_load_by_name(extra, model, tmp_path):
    """A checkpoint without one expert's ``weight_scale`` refuses to start, naming it (stock:
    the scheme's scales start as NaN with patch 0083, upstream's were 1.0, which would have
    served wrong weights; cache: the host pool's scale rows start as NaN; per tensor: the
    up projection's one scale, whose rows the gate's scale must not hide)."""
    import shutil

    from safetensors.torch import load_file, save_file
    from server import start_server

    src = model_path(model)
    dst = tmp_path / "broken"
    shutil.copytree(src, dst)
    name = "model.layers.1.mlp.experts.5.up_proj.weight_scale"
    state = load_file(str(dst / "model.safetensors"))
    del state[name]
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(RuntimeError, match=name.replace(".", r"\.")):
        srv = start_server(dst, ["--max-total-tokens", "65536", *extra], timeout_s=300)
        srv.stop()
