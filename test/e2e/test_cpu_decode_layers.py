"""The flat CPU decode layers (patch 0007, ``models/qwen3_moe_cpu_decode.py``) in the real
server: greedy tokens and logprobs identical with ``SGLANG_CPU_DECODE_LAYERS=0`` (upstream's
layer loop and modules), ``=python`` (every decode pass's layers as one flat sequence of the
fork's ops, called from Python) and the default (the same sequence as one
``decode_layers_cpu`` call, ``sgl-kernel/csrc/cpu/decode_layers.cpp``), on the tiny Qwen3-MoE
(bf16 checkpoint).

The flat path runs the same ops with the same arguments in the same order as the module path,
so a decode step's output is bit-identical: the check is equality, not a tolerance. A wrong
residual, a swapped weight, a shifted rotary position or another request's KV slots would move
this random model's logprobs by > 1e-1. Prefill stays on the module path in both (the input
logprobs compare that nothing else changed). Requests sent together share decode passes of
several rows (the log names each row count the flat path first ran), which checks that each row
attends to its own request's KV slots.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from e2e_util import greedy_with_logprobs, random_prompts

NEW_TOKENS = 16
OFF = {"SGLANG_CPU_DECODE_LAYERS": "0"}
PYTHON = {"SGLANG_CPU_DECODE_LAYERS": "python"}
USED = "CPU decode layers: 4 Qwen3-MoE layers as one flat op sequence at decode"
NATIVE = "CPU decode layers: one decode_layers_cpu call per decode pass"


def _run(server_pool, env):
    srv = server_pool.get("qwen3_moe", env=env)
    prompts = random_prompts((5, 97), seed=23)
    one_by_one = greedy_with_logprobs(srv.url, prompts, NEW_TOKENS)
    batch = random_prompts((4, 40), seed=24)
    with ThreadPoolExecutor(len(batch)) as pool:
        together = list(
            pool.map(lambda ids: greedy_with_logprobs(srv.url, [ids], NEW_TOKENS)[0], batch)
        )
    return one_by_one, together, srv.log.read_text(errors="replace")


def _same(a: list[dict], b: list[dict], what: str) -> None:
    for i, (x, y) in enumerate(zip(a, b)):
        assert x["tokens"] == y["tokens"], f"{what} {i}: greedy tokens differ"
        for name in ("out_lp", "in_lp"):
            worst = max(abs(p - q) for p, q in zip(x[name], y[name]))
            assert x[name] == y[name], f"{what} {i}: {name} differ by up to {worst:.3g}"


def test_tokens_and_logprobs_identical_with_the_flat_path_off(server_pool):
    on_one, on_together, on_log = _run(server_pool, None)
    off_one, off_together, off_log = _run(server_pool, OFF)
    assert USED in on_log and NATIVE in on_log
    assert "CPU decode layers: first flat decode pass of 1 row(s)" in on_log
    assert any(f"first flat decode pass of {n} row(s)" in on_log for n in (2, 3, 4)), (
        "the requests sent together never shared a flat decode pass"
    )
    assert "CPU decode layers" not in off_log
    _same(on_one, off_one, "prompt")
    _same(on_together, off_together, "concurrent prompt")


def test_one_native_call_matches_the_sequence_from_python(server_pool):
    """The C++ pass against the same ops called one by one from Python: equal tokens and
    logprobs, one request at a time and several sharing decode passes."""
    on_one, on_together, on_log = _run(server_pool, None)
    py_one, py_together, py_log = _run(server_pool, PYTHON)
    assert NATIVE in on_log
    assert USED in py_log and NATIVE not in py_log
    assert any(f"first flat decode pass of {n} row(s)" in py_log for n in (2, 3, 4))
    _same(on_one, py_one, "prompt")
    _same(on_together, py_together, "concurrent prompt")
