"""Numerical parity of the real server against transformers on the same random weights.

Both tiny models (hybrid Qwen3-Next, attention-only Qwen3-MoE) are served with
``--dtype float32`` and compared with ``transformers`` in float32 on the same token ids:

- greedy tokens must be identical;
- every logprob the server returns (input tokens and generated tokens) must be within
  ``LOGPROB_ATOL`` of transformers' ``log_softmax`` of its logits.

Tolerance: in float32 (weights, activations, KV and recurrent states) the two stacks differ only in reduction order (SDPA vs eager attention,
our C++ gated-delta-rule vs transformers' torch loop, fused vs per-expert MoE), which moves a
logprob by ~1e-5 on these models; 2e-3 leaves room for that across 24-token greedy runs while
still failing on any real defect (a wrong expert, a wrong state, a shifted position changes
logprobs by > 1e-1 on a random model). Float32 also keeps near-ties in a random model from
flipping greedy tokens.

Prefix cache: a second request whose prompt extends the first one's must report cached tokens
and still match the cold transformers result.
"""

from __future__ import annotations

import pytest
import requests
import torch
from server import ensure_model, start_server

LOGPROB_ATOL = 2e-3
NEW_TOKENS = 24


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1234)
    # Lengths cross the chunk sizes of the gated delta rule (64) and leave odd tails.
    return [torch.randint(10, vocab, (n,), generator=g).tolist() for n in (7, 130, 613)]


def _hf_greedy(model, ids: list[int], n: int) -> tuple[list[int], list[float], list[float]]:
    """Greedy continuation of ``ids`` by transformers.

    Returns (generated ids, logprobs of the input tokens 1..L-1, logprobs of generated tokens).
    """
    seq = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(
            seq,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
        full = model(out.sequences[:, :-1]).logits.float().log_softmax(-1)[0]
    all_ids = out.sequences[0].tolist()
    lp = [full[i - 1, all_ids[i]].item() for i in range(1, len(all_ids))]
    return all_ids[len(ids) :], lp[: len(ids) - 1], lp[len(ids) - 1 :]


def _server_greedy(url: str, ids: list[int], n: int, input_logprobs: bool = True) -> dict:
    """Greedy /generate; input-token logprobs (``logprob_start_len=0``) make the server
    recompute the whole prompt, so a prefix-cache test asks for output logprobs only."""
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
    return r.json()


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_moe"])
def served(request):
    from transformers import AutoModelForCausalLM

    model_dir = ensure_model(request.param)
    # Recurrent conv state defaults to bf16 whatever the model dtype (SGLANG_MAMBA_CONV_DTYPE,
    # srt/configs/mamba_utils.py); keep every state in float32 for parity.
    srv = start_server(
        model_dir, ["--dtype", "float32"], env={"SGLANG_MAMBA_CONV_DTYPE": "float32"}
    )
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    yield srv, hf
    srv.stop()


def _check(out: dict, hf_new: list[int], hf_in_lp: list[float], hf_out_lp: list[float]) -> None:
    meta = out["meta_info"]
    got_new = [t[1] for t in meta["output_token_logprobs"]]
    assert got_new == hf_new, f"greedy tokens differ:\n server {got_new}\n hf     {hf_new}"
    # input_token_logprobs[0] is None (no logprob for the first token)
    in_lp = [t[0] for t in meta["input_token_logprobs"][1:]] if hf_in_lp else []
    out_lp = [t[0] for t in meta["output_token_logprobs"]]
    assert len(in_lp) == len(hf_in_lp)
    err_in = max((abs(a - b) for a, b in zip(in_lp, hf_in_lp)), default=0.0)
    err_out = max(abs(a - b) for a, b in zip(out_lp, hf_out_lp))
    assert err_in < LOGPROB_ATOL and err_out < LOGPROB_ATOL, (err_in, err_out)


def test_greedy_and_logprobs_match_transformers(served):
    srv, hf = served
    for ids in _prompts(hf.config.vocab_size):
        hf_new, hf_in_lp, hf_out_lp = _hf_greedy(hf, ids, NEW_TOKENS)
        _check(_server_greedy(srv.url, ids, NEW_TOKENS), hf_new, hf_in_lp, hf_out_lp)


def test_prefix_cache_hit_matches_cold(served):
    srv, hf = served
    g = torch.Generator().manual_seed(99)
    prefix = torch.randint(10, hf.config.vocab_size, (700,), generator=g).tolist()
    suffix = torch.randint(10, hf.config.vocab_size, (45,), generator=g).tolist()
    requests.post(srv.url + "/flush_cache", timeout=60)
    first = _server_greedy(srv.url, prefix, 4)
    assert first["meta_info"]["cached_tokens"] == 0
    second = _server_greedy(srv.url, prefix + suffix, NEW_TOKENS, input_logprobs=False)
    assert second["meta_info"]["cached_tokens"] >= len(prefix), "no prefix-cache hit"
    hf_new, _, hf_out_lp = _hf_greedy(hf, prefix + suffix, NEW_TOKENS)
    _check(second, hf_new, [], hf_out_lp)
