"""HTTP and tokenizer helpers shared by the end-to-end endpoint tests.

The tiny models have random weights, so tests assert structure and behaviour, never wording.
Where a test needs the model to produce something specific it forces it with the server's own
knobs (regex constraints, forced tool choice, ``logit_bias``), built from the model's tokenizer
here.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Callable, Iterator

import requests
from server import Server

TIMEOUT = 300
SMALL_CONTEXT = 2048  # --context-length of the `small_ctx_server` fixture


def _fail_message(srv: Server, r: requests.Response) -> str:
    return f"HTTP {r.status_code}: {r.text[:2000]}\n--- server log ---\n{srv.log_tail(40)}"


def post(
    srv: Server,
    path: str,
    body: dict | None = None,
    *,
    data: str | None = None,
    stream: bool = False,
) -> requests.Response:
    if data is not None:
        return requests.post(
            srv.url + path,
            data=data,
            timeout=TIMEOUT,
            stream=stream,
            headers={"Content-Type": "application/json"},
        )
    return requests.post(srv.url + path, json=body, timeout=TIMEOUT, stream=stream)


def ok_json(srv: Server, path: str, body: dict) -> dict:
    r = post(srv, path, body)
    assert r.status_code == 200, _fail_message(srv, r)
    return r.json()


def chat(srv: Server, **body) -> dict:
    body.setdefault("model", "default")
    return ok_json(srv, "/v1/chat/completions", body)


def messages(srv: Server, **body) -> dict:
    body.setdefault("model", "default")
    return ok_json(srv, "/v1/messages", body)


def sse_lines(r: requests.Response) -> Iterator[str]:
    for line in r.iter_lines(decode_unicode=True):
        if line:
            yield line


def chat_stream(srv: Server, **body) -> list[dict]:
    """Stream a chat completion; return its JSON chunks (the stream must end with [DONE])."""
    body.setdefault("model", "default")
    body["stream"] = True
    r = post(srv, "/v1/chat/completions", body, stream=True)
    assert r.status_code == 200, _fail_message(srv, r)
    assert r.headers["content-type"].startswith("text/event-stream")
    datas = [line[len("data:") :].strip() for line in sse_lines(r) if line.startswith("data:")]
    assert datas and datas[-1] == "[DONE]", f"stream did not end with [DONE]: {datas[-3:]}"
    chunks = [json.loads(d) for d in datas[:-1]]
    for c in chunks:
        assert "error" not in c, c
    return chunks


def messages_stream(srv: Server, **body) -> list[tuple[str, dict]]:
    """Stream an Anthropic message; return (event, data) pairs, checking event == data.type."""
    body.setdefault("model", "default")
    body["stream"] = True
    r = post(srv, "/v1/messages", body, stream=True)
    assert r.status_code == 200, _fail_message(srv, r)
    events, event = [], None
    for line in sse_lines(r):
        if line.startswith("event:"):
            event = line[len("event:") :].strip()
        elif line.startswith("data:"):
            data = json.loads(line[len("data:") :].strip())
            assert event == data["type"], (event, data)
            events.append((event, data))
            event = None
    return events


def user(text: str) -> dict:
    return {"role": "user", "content": text}


# ------------------------------------------------------------------------------------------
# Tokenizer-derived logit biases
# ------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=4)
def vocab(model_dir: str) -> tuple[str, ...]:
    """Text of every token id of the model's tokenizer (special tokens included)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    return tuple(tok.decode([i], skip_special_tokens=False) for i in range(tok.get_vocab_size()))


def bias_where(model_dir: Path, pred: Callable[[str], bool], value: float) -> dict[str, float]:
    return {str(i): value for i, s in enumerate(vocab(str(model_dir))) if pred(s)}


def whitespace_ban(model_dir: Path) -> dict[str, float]:
    """Bias every whitespace-only token to -100.

    Constrained JSON allows whitespace between tokens, and a random model picks from the dozens of
    whitespace tokens far more often than from the few tokens that advance the JSON, so forced
    tool-call arguments would otherwise rarely finish within a small token budget. The bias
    leaves the grammar in charge: where only whitespace is allowed, it is still produced.
    """
    return bias_where(model_dir, lambda s: s != "" and s.strip() == "", -100)


def token_id(model_dir: Path, text: str) -> int:
    ids = [i for i, s in enumerate(vocab(str(model_dir))) if s == text]
    assert ids, f"{text!r} is not a single token of {model_dir}"
    return ids[0]


def random_prompts(lengths=(5, 97, 300), seed: int = 99) -> list[list[int]]:
    """Prompts of random token ids in [10, 30000), one per length (a random model needs no
    words): the prompts of the expert-cache equality tests."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 30000, (n,), generator=g).tolist() for n in lengths]


def greedy_with_logprobs(url: str, prompts: list[list[int]], new_tokens: int) -> list[dict]:
    """Greedy ``/generate`` of ``new_tokens`` tokens (EOS ignored) per prompt, with every input
    and output logprob; per prompt ``dict(tokens, out_lp, in_lp)`` (``in_lp`` from the second
    input token on)."""
    outs = []
    for ids in prompts:
        r = requests.post(
            url + "/generate",
            json={
                "input_ids": ids,
                "sampling_params": {
                    "temperature": 0,
                    "max_new_tokens": new_tokens,
                    "ignore_eos": True,
                },
                "return_logprob": True,
                "logprob_start_len": 0,
            },
            timeout=600,
        )
        assert r.status_code == 200, r.text
        meta = r.json()["meta_info"]
        outs.append(
            dict(
                tokens=[t[1] for t in meta["output_token_logprobs"]],
                out_lp=[t[0] for t in meta["output_token_logprobs"]],
                in_lp=[t[0] for t in meta["input_token_logprobs"][1:]],
            )
        )
    return outs


def metric(text: str, name: str) -> float:
    """The value of Prometheus metric ``name`` (any labels) in a ``/metrics`` page ``text``.

    Raises:
        AssertionError: not exported (the message lists the expert-cache lines there are).
    """
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
    assert m, f"{name} not exported:\n" + "\n".join(
        line for line in text.splitlines() if "expert_cache" in line
    )
    return float(m.group(1))


def expert_cache_counters(url: str) -> dict[str, float]:
    """The server's ``sglang:expert_cache_{misses_total,fills_total,cpu_experts_total,slots}``
    (``--enable-metrics``), keyed without the prefix."""
    text = requests.get(url + "/metrics", timeout=60).text
    keys = ("misses_total", "fills_total", "cpu_experts_total", "slots")
    return {k: metric(text, f"sglang:expert_cache_{k}") for k in keys}


def assert_identical_outputs(want: list[dict], got: list[dict]) -> None:
    """Greedy tokens, input and output logprobs of :func:`greedy_with_logprobs` identical,
    prompt by prompt."""
    assert len(want) == len(got)
    for i, (a, b) in enumerate(zip(want, got)):
        assert a["tokens"] == b["tokens"], f"prompt {i}: greedy tokens differ"
        assert a["in_lp"] == b["in_lp"], f"prompt {i}: input logprobs differ"
        assert a["out_lp"] == b["out_lp"], f"prompt {i}: output logprobs differ"


def assert_split_happened(counters: dict[str, float], slots: int) -> None:
    """:func:`expert_cache_counters` of a server with ``slots`` slots: misses were filled and
    misses ran on the CPU, and fills + CPU experts account for every miss."""
    assert counters["slots"] == slots
    assert counters["fills_total"] >= 1 and counters["cpu_experts_total"] >= 1
    assert counters["fills_total"] + counters["cpu_experts_total"] == counters["misses_total"]


# Prompts of the accuracy checks against transformers bf16: eight of 300 tokens (2392 scored),
# not the 399 tokens of random_prompts(). The mean |error| of a bf16 stack on a random model is
# a sum of chaotic per-token errors: over 399 tokens a change of one bf16 unit in 10^4 norm
# outputs moved DeepSeek-V3 FP8's mean 11% (0.145 / 0.131), over 2392 tokens 0.8%.
ACCURACY_PROMPT_LENGTHS = (300,) * 8
ACCURACY_SEED = 7


def accuracy_prompts() -> list[list[int]]:
    """The prompts of :func:`assert_as_accurate_as_transformers_bf16`."""
    return random_prompts(ACCURACY_PROMPT_LENGTHS, seed=ACCURACY_SEED)


def assert_as_accurate_as_transformers_bf16(
    outs: list[dict], model_dir: Path, hf_class: str, label: str
) -> None:
    """Prompt logprobs of a server (``outs``: :func:`greedy_with_logprobs` of it on
    :func:`accuracy_prompts`) against transformers float32 on ``model_dir``
    (the weights the server computes with, e.g. a dequantized checkpoint) are as accurate as
    transformers' own bf16 of ``model_dir``: mean |error| within 1.2x, max within 2x (an
    independent bf16 stack; a wrong scale or attention path is many times that), on the
    :data:`ACCURACY_PROMPT_LENGTHS` prompts. ``hf_class``: the class the folder must load as;
    ``label``: names the model in the printed figures."""
    import torch
    from transformers import AutoModelForCausalLM

    prompts = accuracy_prompts()
    assert len(outs) == len(prompts)
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    assert type(hf).__name__ == hf_class, type(hf).__name__
    hf_bf16 = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).eval()
    ours, theirs = [], []
    for ids, out in zip(prompts, outs):
        with torch.no_grad():
            lp = hf(torch.tensor([ids])).logits.float().log_softmax(-1)[0]
            lpb = hf_bf16(torch.tensor([ids])).logits.float().log_softmax(-1)[0]
        pos = torch.arange(1, len(ids))
        tok = torch.tensor(ids[1:])
        ref, ref_bf16 = lp[pos - 1, tok], lpb[pos - 1, tok]
        ours.append((torch.tensor(out["in_lp"]) - ref).abs())
        theirs.append((ref_bf16 - ref).abs())
    ours, theirs = torch.cat(ours), torch.cat(theirs)
    figures = (
        f"{label}: |logprob error| vs float32 over {ours.numel()} tokens: mean server "
        f"{ours.mean():.4f} / transformers bf16 {theirs.mean():.4f}, max {ours.max():.4f} / "
        f"{theirs.max():.4f}"
    )
    print(figures)
    assert theirs.mean() > 0, "transformers bf16 matched float32 exactly"
    assert ours.mean() <= 1.2 * theirs.mean(), figures
    assert ours.max() <= 2 * theirs.max(), figures


# Bounds of a cache server's error against transformers in float32, relative to the error of
# upstream's per-expert torch loop (SGLANG_CPU_MOE_BACKEND=native) on the same prompts: the
# whole-model error is dominated by bf16 rounding elsewhere, and its max is a near-tie token.
MEAN_SLACK, P95_SLACK, MAX_SLACK = 1.15, 1.25, 2.0


def assert_as_accurate_as_torch_loop(
    model_dir: Path,
    prompts: list[list[int]],
    native: list[dict],
    resident: list[dict],
    hf_class: str | None = None,
    hf_model=None,
) -> None:
    """Input logprobs of the all-resident cache server (``resident``) and of the torch-loop
    server (``native``), as :func:`greedy_with_logprobs` returns them for ``prompts``, against
    transformers in float32 on ``model_dir``: the cache's |error| within ``MEAN_SLACK`` (mean),
    ``P95_SLACK`` (95th percentile) and ``MAX_SLACK`` (max) times the loop's. ``hf_class``:
    the transformers model class the checkpoint must load as; ``hf_model``: the float32
    transformers model to use instead of loading ``model_dir`` (e.g. gpt-oss dequantized)."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = hf_model
    if hf is None:
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if hf_class is not None:
        assert type(hf).__name__ == hf_class, type(hf).__name__
    err = {"native": [], "resident": []}
    for i, ids in enumerate(prompts):
        with torch.no_grad():
            lp = hf(torch.tensor([ids])).logits.float().log_softmax(-1)[0]
        ref = torch.tensor([lp[j - 1, ids[j]].item() for j in range(1, len(ids))])
        for name, outs in (("native", native), ("resident", resident)):
            got = torch.tensor(outs[i]["in_lp"])
            assert got.shape == ref.shape, (name, i, got.shape, ref.shape)
            err[name].append((got - ref).abs())
    loop, cache = torch.cat(err["native"]), torch.cat(err["resident"])

    def p95(t):
        return torch.quantile(t, 0.95).item()

    figures = (
        f"|logprob error| vs float32 over {cache.numel()} tokens: mean cache "
        f"{cache.mean():.4f} / torch loop {loop.mean():.4f}, p95 {p95(cache):.4f} / "
        f"{p95(loop):.4f}, max {cache.max():.4f} / {loop.max():.4f}"
    )
    print(figures)
    assert loop.mean() > 0, "the torch loop server matched float32 exactly: not a bf16 run?"
    # Else the comparison is with the cache's own kernel (the environment variable not applied).
    assert loop.ne(cache).any(), "the torch loop server ran the cache's MoE kernel"
    assert cache.mean() <= MEAN_SLACK * loop.mean(), figures
    assert p95(cache) <= P95_SLACK * p95(loop), figures
    assert cache.max() <= MAX_SLACK * loop.max(), figures


# Expert-cache server configurations shared by the per-model e2e files (test_expert_cache_*.py):
# B_P / B_H fixed so the q* split does not depend on a startup measurement.
CACHE_BANDWIDTHS = ("--expert-cache-fill-gbps", "10", "--expert-cache-cpu-gbps", "20")
CACHE_RESIDENT = (
    "--enable-expert-cache",
    "--expert-cache-size",
    "100%",
    "--expert-cache-policy",
    "fill",
    *CACHE_BANDWIDTHS,
)
CACHE_SLOTS8 = (
    "--enable-expert-cache",
    "--expert-cache-size",
    "8",
    "--expert-cache-policy",
    "qstar",
    *CACHE_BANDWIDTHS,
    "--enable-metrics",
)
TORCH_LOOP_ENV = {"SGLANG_CPU_MOE_BACKEND": "native"}  # upstream's per-expert torch MoE loop


def results_fixture(
    arch: str,
    configs: dict,
    new_tokens: int = 16,
    name: str | None = None,
    accuracy_of: str | None = None,
):
    """A pytest fixture ``results`` for ``arch``: ``results(name)`` is the output of
    :func:`greedy_with_logprobs` on :func:`random_prompts` from the pooled server of
    ``configs[name] = (extra launch flags, env or None)``, measured once per test session;
    ``results(name + "_log")`` is that server's log text and ``results(name + "_metrics")``
    its :func:`expert_cache_counters` (for configurations with ``--enable-metrics``). ``name``:
    the fixture's name; None (the default) leaves it to pytest, i.e. the module attribute the
    fixture is assigned to (``results_mixtral = results_fixture("mixtral", ...)``).
    ``accuracy_of``: a configuration whose server also answers :func:`accuracy_prompts` (one
    new token each) while it is up: ``results(accuracy_of + "_accuracy")``."""
    import pytest

    store: dict = {}

    @pytest.fixture(**({"name": name} if name else {}))
    def results(server_pool):
        def get(name: str):
            if name not in store:
                base = name.removesuffix("_log").removesuffix("_metrics").removesuffix("_accuracy")
                extra, env = configs[base]
                srv = server_pool.get(arch, extra, env=env)
                store[base] = greedy_with_logprobs(srv.url, random_prompts(), new_tokens)
                if base == accuracy_of:
                    store[base + "_accuracy"] = greedy_with_logprobs(srv.url, accuracy_prompts(), 1)
                store[base + "_log"] = srv.log.read_text(errors="replace")
                if "--enable-metrics" in extra:
                    store[base + "_metrics"] = expert_cache_counters(srv.url)
            return store[name]

        return get

    return results
