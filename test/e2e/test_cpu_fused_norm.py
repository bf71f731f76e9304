"""The CPU fused norms (patch 0006, ``layers/layernorm_cpu.py``, ``csrc/cpu/norm_rope.cpp``) in
the real server: bf16 greedy tokens identical with ``SGLANG_CPU_FUSED_NORM=0`` (upstream's
torch ops for RMSNorm, the per-head q/k norm and the rotary) and with the default (the ops).

test_parity.py checks the float32 path against transformers (the ops take float32 too); this is
the bf16 check, on the tiny Qwen3-MoE (bf16 checkpoint): every decoder layer's two RMSNorms
(``fused_add_rmsnorm_cpu``), the final norm, and Qwen3-MoE's ``fused_qk_norm_rope_cpu`` in
prefill and decode. The ops round where upstream's torch ops round and sum the squares in
another order, so now and then one element differs by one bf16 unit: on the 97-token prompt one
q element of 24832 in layer 0 (token 12), after which that prompt's logprobs move by up to 0.23
(mean ~0.03) on this random model, the same amount from every later position on. Hence two
bounds: the mean difference ``MEAN_ATOL`` (a lost residual, a wrong weight or a shifted rotary
position moves every logprob of this model by > 1e-1) and the largest ``MAX_ATOL``.
"""

from __future__ import annotations

from e2e_util import greedy_with_logprobs, random_prompts

NEW_TOKENS = 16
MEAN_ATOL = 5e-2
MAX_ATOL = 0.3
OFF = {"SGLANG_CPU_FUSED_NORM": "0"}


def _run(server_pool, env):
    srv = server_pool.get("qwen3_moe", env=env)
    outs = greedy_with_logprobs(srv.url, random_prompts((5, 97), seed=19), NEW_TOKENS)
    return outs, srv.log.read_text(errors="replace")


def test_greedy_tokens_identical_with_the_ops_off(server_pool):
    on, on_log = _run(server_pool, None)
    off, off_log = _run(server_pool, OFF)
    assert "CPU fused norms: rmsnorm_cpu / fused_add_rmsnorm_cpu" in on_log
    assert "CPU fused norms: upstream's torch ops (SGLANG_CPU_FUSED_NORM=0)" in off_log
    for i, (a, b) in enumerate(zip(on, off)):
        assert a["tokens"] == b["tokens"], f"prompt {i}: greedy tokens differ"
        for name in ("out_lp", "in_lp"):
            diffs = [abs(x - y) for x, y in zip(a[name], b[name])]
            mean = sum(diffs) / len(diffs)
            assert mean <= MEAN_ATOL, f"prompt {i}: {name} differ by {mean:.3g} on average"
            assert max(diffs) <= MAX_ATOL, f"prompt {i}: {name} differ by {max(diffs):.3g}"
