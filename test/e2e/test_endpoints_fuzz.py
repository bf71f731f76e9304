"""Property-based fuzz of the generation routes on one real server.

``/v1/chat/completions``, ``/v1/completions``, ``/v1/messages`` and ``/generate`` get request
bodies from the hypothesis strategies of :mod:`fuzz_requests` (each request model's fields with
valid values or junk: wrong types, missing fields, huge or negative numbers, NaN, odd unicode,
bad tool schemas and tool choices, ``n`` > 1, logprobs, stop lists). The property, for every
body:

* the answer is a 2xx, or a 4xx whose body carries a non-empty error message; never a 5xx;
* it comes within :data:`REQUEST_TIMEOUT_S` (a stream: every event, and the whole of it), and a
  stream is made of JSON events (``[DONE]`` aside);
* the server process stays alive, and its log shows no exception but upstream's logged
  ``ValueError`` refusals (a 4xx refused late can still raise in a task after the answer).

``test_custom_logit_processor_faults`` sends processors that deserialize but fail when the
scheduler runs them (patch 0079): each request is a 400 naming the fault, the others in the
same batches finish normally.

Meanwhile another connection streams chat completions back to back
(:class:`BackgroundStreams`): each must end intact, ``finish_reason`` ``length`` after exactly
its ``max_tokens``, usage, ``[DONE]``.

Bounded: at most :data:`MAX_EXAMPLES` bodies and :data:`BUDGET_S` seconds of fuzzing (the
examples after the budget are not sent), derandomized so CI sees the same bodies every run
(``SGLANG_FUZZ_SEED=N`` draws others). Failing examples are not shrunk (each try is a server
round trip); hypothesis prints the body that failed.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections import Counter

import fuzz_requests
import requests
from hypothesis import HealthCheck, Phase, given, seed, settings

from sglang.srt.sampling.custom_logit_processor import (
    CustomLogitProcessor,
    DisallowedTokensLogitsProcessor,
)

MAX_EXAMPLES = 1000
BUDGET_S = 75
REQUEST_TIMEOUT_S = 60
STREAM_TOKENS = 24


def error_message(body) -> str:
    """The error message of an error response's JSON body (OpenAI ``{"message"}`` or
    ``{"error": {"message"}}``, Anthropic ``{"error": {"message"}}``, FastAPI ``{"detail"}``),
    or ``""``."""
    if not isinstance(body, dict):
        return ""
    err = body.get("error")
    if isinstance(err, dict) and isinstance(err.get("message"), str):
        return err["message"]
    if isinstance(err, str):
        return err
    for key in ("message", "detail"):
        if isinstance(body.get(key), str):
            return body[key]
        if isinstance(body.get(key), list) and body[key]:
            return json.dumps(body[key])
    return ""


def send(url: str, route: str, body: dict) -> tuple[int, str]:
    """POST ``body``; return (status, what is wrong with the answer or "")."""
    t0 = time.monotonic()
    try:
        r = requests.post(
            url + route,
            data=json.dumps(body),  # allow_nan: NaN and Infinity go out as Python writes them
            headers={"Content-Type": "application/json"},
            stream=True,
            timeout=(10, REQUEST_TIMEOUT_S),
        )
        status = r.status_code
        if status >= 500:
            return status, f"HTTP {status}: {r.text[:500]}"
        if status >= 400:
            try:
                msg = error_message(r.json())
            except ValueError:
                msg = ""
            return status, "" if msg.strip() else f"HTTP {status} without a message: {r.text[:300]}"
        if not r.headers.get("content-type", "").startswith("text/event-stream"):
            r.json()
            return status, ""
        for line in r.iter_lines(decode_unicode=True):
            if time.monotonic() - t0 > REQUEST_TIMEOUT_S:
                return status, f"stream still going after {REQUEST_TIMEOUT_S}s"
            if line and line.startswith("data:") and line[5:].strip() != "[DONE]":
                event = json.loads(line[5:])
                code = event.get("error", {}).get("code") if isinstance(event, dict) else None
                if isinstance(code, int) and code >= 500:
                    return status, f"stream error event {line[:300]}"
        return status, ""
    except requests.Timeout:
        return 0, f"no answer within {REQUEST_TIMEOUT_S}s"
    except (requests.ConnectionError, requests.exceptions.ChunkedEncodingError) as e:
        return 0, f"connection failed: {e}"
    except ValueError as e:
        return 200, f"not JSON: {e}"


class BackgroundStreams:
    """Streams chat completions of :data:`STREAM_TOKENS` tokens back to back on its own
    connection until stopped; ``problems`` lists each stream that did not end intact."""

    def __init__(self, url: str) -> None:
        self.url, self.done, self.problems = url, 0, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> BackgroundStreams:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=REQUEST_TIMEOUT_S * 2)

    def _one(self, session: requests.Session) -> str:
        body = {
            "model": "default",
            "messages": [{"role": "user", "content": "Count to a hundred."}],
            "max_tokens": STREAM_TOKENS,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        r = session.post(
            self.url + "/v1/chat/completions", json=body, stream=True, timeout=REQUEST_TIMEOUT_S
        )
        if r.status_code != 200:
            return f"HTTP {r.status_code}: {r.text[:300]}"
        datas = [
            ln[5:].strip() for ln in r.iter_lines(decode_unicode=True) if ln.startswith("data:")
        ]
        if not datas or datas[-1] != "[DONE]":
            return f"no [DONE]: {datas[-2:]}"
        chunks = [json.loads(d) for d in datas[:-1]]
        finish = [c["finish_reason"] for ch in chunks for c in ch.get("choices", [])]
        usage = [ch["usage"] for ch in chunks if ch.get("usage")]
        if [f for f in finish if f] != ["length"]:
            return f"finish reasons {[f for f in finish if f]}"
        if not usage or usage[-1]["completion_tokens"] != STREAM_TOKENS:
            return f"usage {usage}"
        return ""

    def _run(self) -> None:
        with requests.Session() as s:
            while not self._stop.is_set():
                try:
                    problem = self._one(s)
                except (requests.RequestException, ValueError, KeyError) as e:
                    problem = repr(e)
                self.done += 1
                if problem:
                    self.problems.append(problem)


def test_fuzz_generation_routes(server):
    url = server.url
    stats: Counter = Counter()
    failures: list = []
    end = time.monotonic() + BUDGET_S
    fuzz_seed = int(os.environ.get("SGLANG_FUZZ_SEED", "0"))

    @seed(fuzz_seed)
    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        derandomize=fuzz_seed == 0,
        database=None,
        phases=(Phase.explicit, Phase.generate),
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )
    @given(fuzz_requests.requests_)
    def fuzz(case):
        if time.monotonic() > end:
            return
        route, body = case
        status, problem = send(url, route, body)
        stats[(route, status // 100)] += 1
        alive = server.proc.poll() is None
        assert alive, f"server died on {route} {json.dumps(body)[:2000]}\n{server.log_tail(40)}"
        if problem:
            failures.append((route, problem, json.dumps(body)[:1500]))
        assert not problem, f"{route}: {problem}\nbody: {json.dumps(body)[:2000]}"

    log_start = server.log.stat().st_size
    with BackgroundStreams(url) as streams:
        fuzz()
    time.sleep(3)  # the disconnect abort tasks run 2 s after their answer
    log = server.log.read_text(errors="replace")[log_start:]
    # upstream logs some refusals with their traceback (a ValueError: "Error converting
    # Anthropic request"); any other exception in the log is a fault of the server's own code
    faults = [ln for ln in re.findall(r"^(\w+(?:Error|Exception)): ", log, re.M)]
    assert set(faults) <= {"ValueError"}, (Counter(faults), log[-6000:])
    print("fuzz answers (route, status class): count", dict(stats))
    sent = sum(stats.values())
    assert sent >= 100, f"only {sent} requests in {BUDGET_S}s: {dict(stats)}"
    for route in fuzz_requests.ROUTES:
        assert stats[(route, 2)] and stats[(route, 4)], (route, dict(stats))
    assert streams.done >= 1 and not streams.problems, (streams.done, streams.problems)
    r = requests.post(
        url + "/v1/chat/completions",
        json={"model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
        timeout=REQUEST_TIMEOUT_S,
    )
    assert r.status_code == 200, r.text


# Processors that fail when the scheduler runs them. dill pickles a class of an importable
# module by reference (the server cannot import this one) and a class of __main__ by value,
# with its functions' globals: so they are made in a small namespace named __main__.
_FAULTY_SRC = """
class NaNLogits(CustomLogitProcessor):
    def __call__(self, logits, custom_param_list=None):
        return logits * float("nan")

class MaskEveryToken(CustomLogitProcessor):
    def __call__(self, logits, custom_param_list=None):
        return logits.fill_(float("-inf"))

class WrongShape(CustomLogitProcessor):
    def __call__(self, logits, custom_param_list=None):
        return logits[:, :1]
"""
FAULTY = {"__name__": "__main__", "CustomLogitProcessor": CustomLogitProcessor}
exec(_FAULTY_SRC, FAULTY)


def test_custom_logit_processor_faults(server):
    """A processor that fails at run time is a 400 for its request, never a dead server."""
    url = server.url
    disallowed = DisallowedTokensLogitsProcessor.to_str()
    cases = [
        ({}, disallowed, "DisallowedTokensLogitsProcessor raised TypeError"),  # no custom_params
        (
            {"custom_params": {"token_ids": "x"}},
            disallowed,
            "DisallowedTokensLogitsProcessor raised",
        ),
        ({}, FAULTY["NaNLogits"].to_str(), "NaNLogits returned NaN or +inf logits"),
        (
            {},
            FAULTY["MaskEveryToken"].to_str(),
            "MaskEveryToken returned a row without any finite logit",
        ),
        ({}, FAULTY["WrongShape"].to_str(), "WrongShape returned shape"),
    ]
    with BackgroundStreams(url) as streams:
        for params, processor, message in cases:
            for route, body in (
                (
                    "/generate",
                    {
                        "text": "Hi",
                        "sampling_params": {"max_new_tokens": 4, **params},
                        "custom_logit_processor": processor,
                    },
                ),
                (
                    "/v1/chat/completions",
                    {
                        "model": "default",
                        "messages": [{"role": "user", "content": "Hi"}],
                        "max_tokens": 4,
                        **params,
                        "custom_logit_processor": processor,
                    },
                ),
            ):
                r = requests.post(url + route, json=body, timeout=REQUEST_TIMEOUT_S)
                assert r.status_code == 400, (route, message, r.status_code, r.text[:500])
                assert message in error_message(r.json()), (route, r.text[:500])
                assert server.proc.poll() is None, server.log_tail(40)
        # the processor itself works when its parameters are right
        r = requests.post(
            url + "/generate",
            json={
                "text": "Hi",
                "sampling_params": {"max_new_tokens": 4, "custom_params": {"token_ids": [1, 2]}},
                "custom_logit_processor": disallowed,
            },
            timeout=REQUEST_TIMEOUT_S,
        )
        assert r.status_code == 200 and not {1, 2} & set(r.json()["output_ids"]), r.text[:500]
    assert streams.done >= 1 and not streams.problems, (streams.done, streams.problems)
