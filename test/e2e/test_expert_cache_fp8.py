"""The real server on the tiny block-FP8 models, on a CPU without AMX, parametrized over two
releases' layouts (``tiny_models --quant fp8``):

* ``qwen3_moe_fp8``: the tensor names, dtypes, bf16 128 x 128 ``weight_scale_inv`` and
  ``quantization_config`` of the official Qwen3-30B-A3B-FP8 release;
* ``deepseek_v3_fp8``: deepseek-ai/DeepSeek-V3's (float32 scales, every MLA projection FP8,
  no ``modules_to_not_convert``): MLA with a block-FP8 ``kv_b_proj`` (dequantized before the
  ``w_kc`` / ``w_vc`` split, patch 0017) on ``torch_native`` (absorbed MLA forward, patch 0018),
  ``noaux_tc`` grouped routing, ``routed_scaling_factor`` 2.5, a shared expert.

Two servers per model (each start costs ~45 s on a 2-core machine):

* no cache: upstream's ``Fp8MoEMethod``, which upstream refuses on a CPU without AMX; with
  patch 0003 the dense FP8 linears are dequantized to bf16 at load and the FP8 experts run on
  the CPU executor from their own tensors, all resident;
* ``--enable-expert-cache`` with one layer's top-k, 8 slots, ``qstar`` with B_P / B_H fixed at
  0.5: every layer call fills some misses into slots and runs the others on the CPU from the
  FP8 host pool (its metrics say so).

Checked: the no-cache server serves (its log says the dense linears were dequantized), and the
8-slot server's greedy tokens and every logprob are identical to it (on the CPU every
(token, expert) entry runs the same FP8 kernel from a slot, the host pool or the resident
layer; ``test/expert_cache/test_fp8_moe_layer.py`` shows the all-resident cache bit-identical
to the stock block at the layer level, so the no-cache server stands for all resident here).
Accuracy: the no-cache server's prompt logprobs on eight more 300-token prompts against
transformers float32 on the dequantized checkpoint (``quantize.dequantize_fp8_checkpoint``:
the weights the server computes with) are as accurate as transformers' own bf16 of that
checkpoint (mean |error| within 1.2x, max within 2x; measured over 2392 tokens on an AVX2
machine: DeepSeek-V3 mean 0.116 / 0.126, max 7.26 / 6.31; Qwen3-MoE mean 0.061 / 0.068, max
0.54 / 0.65). The mean of a bf16 stack's error on a random model is a noisy statistic: over
the 399 tokens of the equality prompts, turning the fused norm ops off (outputs equal to
``forward_native``'s but for one bf16 unit in 10^4) moved DeepSeek-V3's server mean from
0.145 to 0.131 (transformers bf16: 0.117, 0.130 on an AVX-512 machine); over the 2392 tokens
the same switch moves it from 0.1162 to 0.1153. Without patch 0017 (upstream's per-tensor
requantization of ``kv_b_proj``) DeepSeek-V3's mean was 0.168 over the 399 tokens, 1.29x.
Upstream has no other FP8 MoE path on this CPU (no torch loop), so
``e2e_util.assert_as_accurate_as_torch_loop`` does not apply.
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
# "stock": no cache; "slots8": one layer's top-k with qstar (its counters: "slots8_metrics")
CONFIGS = {"stock": ((), None), "slots8": (CACHE_SLOTS8, None)}
qwen3_moe_fp8 = results_fixture("qwen3_moe_fp8", CONFIGS, NEW_TOKENS, accuracy_of="stock")
deepseek_v3_fp8 = results_fixture("deepseek_v3_fp8", CONFIGS, NEW_TOKENS, accuracy_of="stock")
HF_CLASS = {"qwen3_moe_fp8": "Qwen3MoeForCausalLM", "deepseek_v3_fp8": "DeepseekV3ForCausalLM"}


@pytest.fixture(params=tuple(HF_CLASS))
def arch(request):
    return request.param


@pytest.fixture
def results(arch, request):
    return request.getfixturevalue(arch)


def test_fp8_serves_without_the_cache(arch, results):
    outs = results("stock")
    assert [len(o["tokens"]) for o in outs] == [NEW_TOKENS] * len(outs)
    assert all(lp <= 0 for o in outs for lp in o["in_lp"] + o["out_lp"])
    log = results("stock_log")
    assert "dense FP8 linears are dequantized to torch.bfloat16 at load" in log
    if arch == "deepseek_v3_fp8":
        assert "MLA kv_b_proj: block FP8 dequantized to bf16 at load" in log
    else:  # FP8 experts stay on the module path (patch 0007's flat decode is bf16 only)
        assert "CPU decode layers: upstream's module path (layer 0's" in log


def test_eight_slots_equal_all_resident(results):
    stock = results("stock")
    got = results("slots8")
    assert_identical_outputs(stock, got)
    assert_split_happened(results("slots8_metrics"), slots=8)
    assert "routed fp8-block experts" in results("slots8_log")


def test_as_accurate_as_transformers_bf16_on_the_dequantized_checkpoint(arch, results, tmp_path):
    """Prompt logprobs of the no-cache server (= the 8-slot server's, above) against
    transformers float32 on the dequantized checkpoint: mean |error| within 1.2x and max
    within 2x of transformers bf16's on the same checkpoint
    (``e2e_util.assert_as_accurate_as_transformers_bf16``)."""
    from sglang.test.tiny_models.quantize import dequantize_fp8_checkpoint

    deq = dequantize_fp8_checkpoint(model_path(arch), tmp_path / "deq")
    assert_as_accurate_as_transformers_bf16(results("stock_accuracy"), deq, HF_CLASS[arch], arch)
