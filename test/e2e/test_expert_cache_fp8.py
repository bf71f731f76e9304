"""The real server on the tiny block-FP8 Qwen3-MoE (``tiny_models --quant fp8``: the tensor
names, dtypes, 128 x 128 ``weight_scale_inv`` and ``quantization_config`` of the official
Qwen3-30B-A3B-FP8 release), on a CPU without AMX.

Two servers (each start costs ~45 s on a 2-core machine):

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
Accuracy against a float64 dequantized reference is checked at the layer level
(``test_fp8_moe_layer.py``): upstream has no other FP8 MoE path on this CPU (no torch loop),
so ``e2e_util.assert_as_accurate_as_torch_loop`` does not apply.
"""

from __future__ import annotations

from e2e_util import (
    CACHE_SLOTS8,
    assert_identical_outputs,
    assert_split_happened,
    results_fixture,
)

ARCH = "qwen3_moe_fp8"
NEW_TOKENS = 16
# "stock": no cache; "slots8": one layer's top-k with qstar (its counters: "slots8_metrics")
results = results_fixture(ARCH, {"stock": ((), None), "slots8": (CACHE_SLOTS8, None)}, NEW_TOKENS)


def test_fp8_serves_without_the_cache(results):
    outs = results("stock")
    assert [len(o["tokens"]) for o in outs] == [NEW_TOKENS] * len(outs)
    assert all(lp <= 0 for o in outs for lp in o["in_lp"] + o["out_lp"])
    assert "dense FP8 linears are dequantized to torch.bfloat16 at load" in results("stock_log")


def test_eight_slots_equal_all_resident(results):
    stock = results("stock")
    got = results("slots8")
    assert_identical_outputs(stock, got)
    assert_split_happened(results("slots8_metrics"), slots=8)
