"""The CPU decode linears (patch 0004, ``layers/quantization/unquant_cpu.py``) in the real server:
bf16 greedy tokens identical with ``SGLANG_CPU_DENSE_LINEAR_MAX_ROWS=0`` (upstream's
``F.linear`` / ``torch.matmul``) and with the default (``dense_linear_cpu`` for <= 4 rows).

test_parity.py runs in float32, where the op never applies; this is the bf16 check, on the tiny
Qwen3-MoE (bf16 checkpoint): qkv_proj, o_proj, the router and the lm_head of every decode step
(and of a prefill's last-token logits) on the op. Logprobs may differ in the last bf16 bits
(another summation order): within ``LOGPROB_ATOL``; a wrong weight row or a lost bias moves a
logprob of this random model by > 1e-1.
"""

from __future__ import annotations

from e2e_util import greedy_with_logprobs, random_prompts

NEW_TOKENS = 16
LOGPROB_ATOL = 5e-2
OFF = {"SGLANG_CPU_DENSE_LINEAR_MAX_ROWS": "0"}


def _run(server_pool, env):
    srv = server_pool.get("qwen3_moe", env=env)
    outs = greedy_with_logprobs(srv.url, random_prompts((5, 97), seed=18), NEW_TOKENS)
    return outs, srv.log.read_text(errors="replace")


def test_greedy_tokens_identical_with_the_op_off(server_pool):
    on, on_log = _run(server_pool, None)
    off, off_log = _run(server_pool, OFF)
    assert "CPU decode linears: dense_linear_cpu for bf16 inputs of <= 4 rows" in on_log
    assert "CPU decode linears: upstream's F.linear (SGLANG_CPU_DENSE_LINEAR_MAX_ROWS=0)" in off_log
    for i, (a, b) in enumerate(zip(on, off)):
        assert a["tokens"] == b["tokens"], f"prompt {i}: greedy tokens differ"
        for name in ("out_lp", "in_lp"):
            worst = max(abs(x - y) for x, y in zip(a[name], b[name]))
            assert worst <= LOGPROB_ATOL, f"prompt {i}: {name} differ by {worst:.3g}"
