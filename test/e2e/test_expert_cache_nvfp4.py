"""The real server on the tiny ModelOpt NVFP4 checkpoints (``tiny_models --quant nvfp4``), on the
CPU, parametrized over two releases' layouts:

* ``qwen3_moe_nvfp4``: the tensor names, dtypes, scale shapes and ``hf_quant_config.json`` of
  nvidia/Qwen3-30B-A3B-FP4 (ModelOpt ``NVFP4``: every decoder projection NVFP4 W4A4);
* ``qwen3_5_moe_nvfp4``: nvidia/Qwen3.6-35B-A3B-NVFP4 (ModelOpt ``MIXED_PRECISION``: W4A16
  NVFP4 routed experts, shared expert and ``lm_head``; FP8 attention and gated-DeltaNet
  projections; upstream's ``Qwen3_5MoeForConditionalGeneration``). Patch 0081 dequantizes its
  FP8 and W4A16 NVFP4 linears at load; its routed experts stay NVFP4 as below. Also checked:
  the stock server's input logprobs against transformers in float32 on the dequantized
  checkpoint (``quantize_modelopt_mixed.dequantize_mixed_checkpoint``), the figures printed.

Two servers per layout (each start costs ~45 s on a 2-core machine):

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

import pytest
from conftest import model_path
from e2e_util import (
    CACHE_SLOTS8,
    assert_identical_outputs,
    assert_split_happened,
    random_prompts,
    results_fixture,
)

ARCHS = ("qwen3_moe_nvfp4", "qwen3_5_moe_nvfp4")
NEW_TOKENS = 16
# "stock": no cache; "slots8": one layer's top-k with qstar (its counters: "slots8_metrics")
CONFIGS = {"stock": ((), None), "slots8": (CACHE_SLOTS8, None)}
results_qwen3_moe_nvfp4 = results_fixture(
    ARCHS[0], CONFIGS, NEW_TOKENS, name="results_qwen3_moe_nvfp4"
)
results_qwen3_5_moe_nvfp4 = results_fixture(
    ARCHS[1], CONFIGS, NEW_TOKENS, name="results_qwen3_5_moe_nvfp4"
)
# what the stock server's log says about its dense (non-expert) quantized linears
LOAD_LOG = {
    "qwen3_moe_nvfp4": ("Detected nvfp4 checkpoint",),
    "qwen3_5_moe_nvfp4": ("per-tensor FP8 linears are dequantized to torch.bfloat16 at load",),
}
# the stock bf16 server's |input logprob error| against transformers float32 on the dequantized
# checkpoint, within these factors of transformers' own bf16 error on the same weights (measured
# 2026-12-03, 399 tokens: server mean 0.0635 / p95 0.1615 / max 0.639, transformers bf16
# 0.0634 / 0.1613 / 0.413)
ORACLE_SLACK = {"mean": 1.25, "p95": 1.5, "max": 2.0}


@pytest.fixture(params=ARCHS)
def arch_results(request):
    return request.param, request.getfixturevalue(f"results_{request.param}")


def test_nvfp4_serves_without_the_cache(arch_results):
    arch, results = arch_results
    outs = results("stock")
    assert [len(o["tokens"]) for o in outs] == [NEW_TOKENS] * len(outs)
    assert all(lp <= 0 for o in outs for lp in o["in_lp"] + o["out_lp"])
    log = results("stock_log")
    for line in LOAD_LOG[arch]:
        assert line in log, line
    assert "dense NVFP4 linears are dequantized to torch.bfloat16 at load" in log


def test_eight_slots_equal_all_resident(arch_results):
    _, results = arch_results
    stock = results("stock")
    got = results("slots8")
    assert_identical_outputs(stock, got)
    assert_split_happened(results("slots8_metrics"), slots=8)
    # the host pool and slots hold the checkpoint's NVFP4 experts (not a bf16 copy)
    assert "routed nvfp4 experts" in results("slots8_log")


def test_qwen3_5_nvfp4_against_the_dequantized_oracle(results_qwen3_5_moe_nvfp4, tmp_path):
    """The stock server (bf16 activations, the checkpoint's weights) against transformers in
    float32 on the same weights dequantized in float64 (``Qwen3_5MoeForCausalLM``): as accurate
    as transformers itself in bf16 on those weights (``ORACLE_SLACK``), i.e. the NVFP4 / FP8
    weights are used exactly and what remains is bf16 arithmetic."""
    import torch
    from transformers import AutoModelForCausalLM

    from sglang.test.tiny_models.quantize_modelopt_mixed import dequantize_mixed_checkpoint

    deq = dequantize_mixed_checkpoint(model_path(ARCHS[1]), tmp_path / "deq")
    f32 = AutoModelForCausalLM.from_pretrained(deq, dtype=torch.float32).eval()
    b16 = AutoModelForCausalLM.from_pretrained(deq, dtype=torch.bfloat16).eval()
    assert type(f32).__name__ == "Qwen3_5MoeForCausalLM"
    outs = results_qwen3_5_moe_nvfp4("stock")
    err = {"server": [], "hf_bf16": []}
    for ids, out in zip(random_prompts(), outs):
        with torch.no_grad():
            lp = f32(torch.tensor([ids])).logits.float().log_softmax(-1)[0]
            lb = b16(torch.tensor([ids])).logits.float().log_softmax(-1)[0]
        pick = range(1, len(ids))
        ref = torch.tensor([lp[j - 1, ids[j]].item() for j in pick])
        got = torch.tensor(out["in_lp"])
        assert got.shape == ref.shape
        err["server"].append((got - ref).abs())
        err["hf_bf16"].append(torch.tensor([lb[j - 1, ids[j]].item() for j in pick]) - ref)
    srv, hf = torch.cat(err["server"]), torch.cat(err["hf_bf16"]).abs()
    stats = {
        "mean": (srv.mean().item(), hf.mean().item()),
        "p95": (torch.quantile(srv, 0.95).item(), torch.quantile(hf, 0.95).item()),
        "max": (srv.max().item(), hf.max().item()),
    }
    figures = f"|logprob error| vs float32 over {srv.numel()} tokens, server / transformers bf16: "
    figures += ", ".join(f"{k} {a:.4f} / {b:.4f}" for k, (a, b) in stats.items())
    print(figures)
    assert hf.mean() > 0 and srv.mean() > 0, figures
    for k, (a, b) in stats.items():
        assert a <= ORACLE_SLACK[k] * b, figures
