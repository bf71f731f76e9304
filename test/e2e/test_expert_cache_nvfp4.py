"""The real server on the tiny ModelOpt NVFP4 Qwen3-MoE (``tiny_models --quant nvfp4``: the
tensor names, dtypes, scale shapes and ``hf_quant_config.json`` of nvidia/Qwen3-30B-A3B-FP4), on
the CPU.

Two servers (each start costs ~45 s on a 2-core machine):

* no cache: upstream's ``ModelOptNvFp4FusedMoEMethod``, which upstream refuses on any platform
  but Blackwell or Marlin; with patch 0009 the dense NVFP4 linears are dequantized to bf16 at
  load and the NVFP4 experts run on the CPU executor from their own tensors, all resident;
* ``--enable-expert-cache`` with one layer's top-k, 8 slots, ``qstar`` with B_P / B_H fixed at
  0.5: every layer call fills some misses into slots and runs the others on the CPU from the
  NVFP4 host pool (its metrics say so).

Checked: the no-cache server serves (its log says the dense linears were dequantized), and the
8-slot server's greedy tokens and every logprob are identical to it (on the CPU every
(token, expert) entry runs the same NVFP4 kernel from a slot, the host pool or the resident
layer; ``test/expert_cache/test_nvfp4_moe_layer.py`` shows every cache size from 8 slots to 100%
bit-identical to the stock block at the layer level, and the accuracy against a float64
dequantized reference).
"""

from __future__ import annotations

from e2e_util import (
    CACHE_SLOTS8,
    assert_identical_outputs,
    assert_split_happened,
    results_fixture,
)

ARCH = "qwen3_moe_nvfp4"
NEW_TOKENS = 16
# "stock": no cache; "slots8": one layer's top-k with qstar (its counters: "slots8_metrics")
results = results_fixture(ARCH, {"stock": ((), None), "slots8": (CACHE_SLOTS8, None)}, NEW_TOKENS)


def test_nvfp4_serves_without_the_cache(results):
    outs = results("stock")
    assert [len(o["tokens"]) for o in outs] == [NEW_TOKENS] * len(outs)
    assert all(lp <= 0 for o in outs for lp in o["in_lp"] + o["out_lp"])
    log = results("stock_log")
    assert "Detected nvfp4 checkpoint" in log
    assert "dense NVFP4 linears are dequantized to torch.bfloat16 at load" in log


def test_eight_slots_equal_all_resident(results):
    stock = results("stock")
    got = results("slots8")
    assert_identical_outputs(stock, got)
    assert_split_happened(results("slots8_metrics"), slots=8)
