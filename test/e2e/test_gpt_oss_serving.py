"""The stock server on the tiny gpt-oss (``tiny_models --arch gpt_oss``) on a CPU without AMX.

The model has openai/gpt-oss-20b's layout: sliding-window (16) and full attention layers
alternating, attention sinks, q/k/v/o, router and expert biases, 32 experts top-4 stored in
MXFP4 only, clamped SwiGLU. On this CPU (patch 0011) attention runs in torch_native with
``torch_native_sinks.py`` and the experts are dequantized at load (``mxfp4_cpu.py``) and run by
upstream's ``moe_forward_native``.

Oracle: transformers' ``GptOssForCausalLM`` on the same checkpoint, dequantized and run in
float32 throughout (``.float()``: transformers otherwise keeps the dequantized experts in bf16),
eager attention (its sink implementation). The server runs ``--dtype float32``:

- greedy tokens identical for 16 new tokens on prompts of 9, 40 and 57 tokens (the longer ones
  cross the 16-token window, so the sliding layers drop keys in prefill and in decode);
- every logprob the server returns (input and output tokens) within ``LOGPROB_ATOL`` = 2e-3 of
  transformers' (the two stacks differ in reduction order only: ~1e-5 here; a lost sink, a
  window off by one key or a swapped gate/up moves logprobs by > 1e-1);
- the same after a prefix-cache hit, and with the three prompts in one batch.

``/v1/chat/completions`` serves too (the tiny tokenizer's chat template, not harmony).

With ``--enable-expert-cache`` (8 slots, ``qstar`` at B_P / B_H = 0.5: ``e2e_util.CACHE_SLOTS8``,
the one cache server of this file) the MXFP4 experts stay MXFP4 in the host pool, with their
bias banks, gate/up de-interleaved at load, and run on the CPU executor with gpt-oss's clamped
SwiGLU. Its bf16 input logprobs against transformers in float32 are as accurate as the stock
bf16 server's (upstream's torch loop over the dequantized experts;
``e2e_util.assert_as_accurate_as_torch_loop``), and its metrics show fills and CPU experts.
"""

from __future__ import annotations

import concurrent.futures

import pytest
import requests
import torch
from conftest import model_path
from e2e_util import (
    CACHE_SLOTS8,
    assert_as_accurate_as_torch_loop,
    assert_split_happened,
    expert_cache_counters,
    greedy_with_logprobs,
    random_prompts,
)

ARCH = "gpt_oss"
FLOAT32 = ["--dtype", "float32"]
LOGPROB_ATOL = 2e-3
NEW_TOKENS = 16
PROMPT_LENS = (9, 40, 57)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(10, 32000, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def hf():
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_path(ARCH),
        dtype=torch.float32,
        quantization_config=transformers.Mxfp4Config(dequantize=True),
        attn_implementation="eager",
    )
    return model.float().eval()


def _hf_greedy(model, ids: list[int], n: int) -> tuple[list[int], list[float]]:
    """transformers' greedy continuation of ``ids``: (new ids, logprobs of tokens 1.. of
    prompt + continuation)."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
        full = model(out[:, :-1]).logits.float().log_softmax(-1)[0]
    all_ids = out[0].tolist()
    return all_ids[len(ids) :], [full[i - 1, all_ids[i]].item() for i in range(1, len(all_ids))]


def _generate(url: str, ids: list[int], n: int, input_logprobs: bool = True) -> dict:
    r = requests.post(
        url + "/generate",
        json={
            "input_ids": ids,
            "sampling_params": {"temperature": 0, "max_new_tokens": n, "ignore_eos": True},
            "return_logprob": True,
            "logprob_start_len": 0 if input_logprobs else -1,
        },
        timeout=600,
    )
    assert r.status_code == 200, r.text
    return r.json()["meta_info"]


def _check(meta: dict, hf_new: list[int], hf_lp: list[float], prompt_len: int) -> None:
    got = [t[1] for t in meta["output_token_logprobs"]]
    assert got == hf_new, f"greedy tokens differ:\n server {got}\n hf     {hf_new}"
    out_lp = [t[0] for t in meta["output_token_logprobs"]]
    in_lp = [t[0] for t in meta.get("input_token_logprobs") or []][1:]
    ref = hf_lp[prompt_len - 1 :] if not in_lp else hf_lp
    err = max(abs(a - b) for a, b in zip(in_lp + out_lp, ref))
    assert len(in_lp + out_lp) == len(ref)
    assert err < LOGPROB_ATOL, err


def test_greedy_and_logprobs_match_transformers(server_pool, hf):
    srv = server_pool.get(ARCH, FLOAT32)
    for ids in _prompts():
        hf_new, hf_lp = _hf_greedy(hf, ids, NEW_TOKENS)
        _check(_generate(srv.url, ids, NEW_TOKENS), hf_new, hf_lp, len(ids))
    log = srv.log.read_text(errors="replace")
    assert "dequantizing MXFP4 experts to float32 at load" in log


def test_batched_requests_match_transformers(server_pool, hf):
    """The three prompts in flight together: one prefill batch of unequal lengths, then
    batched decode rows at different positions relative to the window."""
    srv = server_pool.get(ARCH, FLOAT32)
    requests.post(srv.url + "/flush_cache", timeout=60)
    prompts = _prompts()
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        metas = list(pool.map(lambda ids: _generate(srv.url, ids, NEW_TOKENS), prompts))
    for ids, meta in zip(prompts, metas):
        hf_new, hf_lp = _hf_greedy(hf, ids, NEW_TOKENS)
        _check(meta, hf_new, hf_lp, len(ids))


def test_prefix_cache_hit_matches_cold(server_pool, hf):
    """A prompt extending a cached one (the prefix longer than the window): the extend reads
    the cached keys it can see, in both the full and the sliding-window pool."""
    srv = server_pool.get(ARCH, FLOAT32)
    g = torch.Generator().manual_seed(99)
    prefix = torch.randint(10, 32000, (45,), generator=g).tolist()
    suffix = torch.randint(10, 32000, (21,), generator=g).tolist()
    requests.post(srv.url + "/flush_cache", timeout=60)
    assert _generate(srv.url, prefix, 2)["cached_tokens"] == 0
    meta = _generate(srv.url, prefix + suffix, NEW_TOKENS, input_logprobs=False)
    assert meta["cached_tokens"] >= 32, f"no prefix-cache hit: {meta['cached_tokens']}"
    hf_new, hf_lp = _hf_greedy(hf, prefix + suffix, NEW_TOKENS)
    _check(meta, hf_new, hf_lp, len(prefix + suffix))


def test_chat_completions_serves(server_pool):
    """/v1/chat/completions on the tiny tokenizer's chat template: the prompt is the rendered
    template's tokens and greedy output runs to max_tokens."""
    from transformers import AutoTokenizer

    srv = server_pool.get(ARCH, FLOAT32)
    messages = [{"role": "user", "content": "Name three rivers of France, then stop."}]
    r = requests.post(
        srv.url + "/v1/chat/completions",
        json={"model": "default", "messages": messages, "max_tokens": 8, "temperature": 0},
        timeout=300,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    tok = AutoTokenizer.from_pretrained(model_path(ARCH))
    rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(rendered, dict) or hasattr(rendered, "input_ids"):
        rendered = rendered["input_ids"]
    assert body["usage"]["prompt_tokens"] == len(rendered)
    assert body["usage"]["completion_tokens"] == 8
    assert body["choices"][0]["finish_reason"] == "length"


def _input_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        lp = model(torch.tensor([ids])).logits.float().log_softmax(-1)[0]
    return torch.tensor([lp[i - 1, ids[i]].item() for i in range(1, len(ids))])


def test_default_dtype_serves_in_bf16_as_accurately_as_transformers_bf16(server_pool, hf):
    """Without --dtype the MXFP4 override picks bf16 (experts dequantized to bf16). Its prompt
    logprobs against the float32 oracle are as accurate as transformers' own model cast to
    bf16 (an independent bf16 stack): mean error within 1.5x, max within 2x of transformers
    bf16's (measured: 0.3x-1.03x; a defect is many times that)."""
    import copy

    srv = server_pool.get(ARCH)
    assert "dequantizing MXFP4 experts to bfloat16 at load" in srv.log.read_text(errors="replace")
    hf_bf16 = copy.deepcopy(hf).to(torch.bfloat16)
    ours, theirs = [], []
    for ids in _prompts():
        meta = _generate(srv.url, ids, 1)
        served = torch.tensor([t[0] for t in meta["input_token_logprobs"][1:]])
        ref = _input_logprobs(hf, ids)
        ours.append((served - ref).abs())
        theirs.append((_input_logprobs(hf_bf16, ids) - ref).abs())
    ours, theirs = torch.cat(ours), torch.cat(theirs)
    assert ours.mean() <= 1.5 * theirs.mean(), (ours.mean(), theirs.mean())
    assert ours.max() <= 2 * theirs.max(), (ours.max(), theirs.max())


def test_expert_cache_serves_mxfp4_as_accurately_as_stock(server_pool, hf):
    """``--enable-expert-cache`` with 8 of the 128 routed experts in slots: MXFP4 banks with
    biases and the clamped SwiGLU through the cache's hit / fill / CPU paths, as accurate
    against transformers float32 as the stock bf16 server (upstream's torch loop); greedy
    decoding mostly follows the stock server's, and the counters show the q* split."""
    prompts = random_prompts()
    # the stock bf16 server first: the previous test's, still running (the pool keeps one)
    stock = greedy_with_logprobs(server_pool.get(ARCH).url, prompts, NEW_TOKENS)
    cache = server_pool.get(ARCH, CACHE_SLOTS8)
    log = cache.log.read_text(errors="replace")
    assert "routed mxfp4 experts" in log and "dequantizing MXFP4" not in log
    cached = greedy_with_logprobs(cache.url, prompts, NEW_TOKENS)
    assert all(len(o["tokens"]) == NEW_TOKENS for o in cached)
    assert_split_happened(expert_cache_counters(cache.url), slots=8)
    # Greedy tokens: the same model, but two bf16 kernels, so a near-tie may go either way and
    # the continuations part (measured: 16, 9 and 16 of 16 equal to the stock server's).
    same = [sum(a == b for a, b in zip(c["tokens"], s["tokens"])) for c, s in zip(cached, stock)]
    print("greedy tokens equal to the stock server's:", same, "of", NEW_TOKENS)
    assert all(c["tokens"][0] == s["tokens"][0] for c, s in zip(cached, stock)), same
    assert sum(same) >= len(prompts) * NEW_TOKENS // 2, same
    assert_as_accurate_as_torch_loop(
        model_path(ARCH), prompts, native=stock, resident=cached, hf_model=hf
    )
