"""Replay captured agent-client requests against an SGLang server and measure prefix reuse.

A *session* is a folder of request bodies ``NN.json`` exactly as a client sent them, usually with
a ``meta.jsonl`` (one JSON object per request: ``file``, ``path`` such as
``/v1/chat/completions`` or ``/v1/messages?beta=true``, and the request ``headers``). Requests are
POSTed in order to the same path; streamed replies are parsed as OpenAI chat-completion chunks
or Anthropic Messages events and checked for well-formedness (every event parses, the stream ends
with ``[DONE]`` / ``message_stop``, and usage is reported).

Per request we record the HTTP status, time to first streamed content and total time (seconds),
the prompt and cached token counts the server reported (tokens), and the prompt token ids after
the chat template, exactly as the server built them:

* OpenAI ``/v1/chat/completions``: the request carries the header ``x-sglext-return-input-ids: 1``
  (upstream ``OpenAIServingChat._convert_to_internal_request``), so the server appends a chunk
  with ``sglext.input_ids`` before the usage chunk (``OpenAIServingChat._generate_chat_stream``).
* Anthropic ``/v1/messages``: upstream's adapter (``AnthropicServing._generate_anthropic_stream``)
  drops that chunk, so the ids are rebuilt: upstream's own request conversion
  (``AnthropicServing._convert_to_chat_completion_request``) is run here with the server's
  template settings, and the converted chat request is tokenized by the server itself
  (``POST /v1/tokenize`` with ``messages``, same ``_process_messages`` as generation). The result
  must have exactly the number of prompt tokens the server reported for the real request, or the
  ids are discarded and the request is flagged. If the server ever forwards ``sglext.input_ids``
  in the Anthropic stream, those are used instead.

The *reusable* prefix of a request is the longest token prefix it shares with any earlier
request of its session (capped at its length minus one: a server recomputes at least the last
prompt token). Summed over requests and compared with the cached tokens the server reported, it
tells how much reusable work the prefix cache missed.
"""

from __future__ import annotations

import copy
import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional
from urllib.parse import urlsplit

import requests

OPENAI = "openai"
ANTHROPIC = "anthropic"

#: Request-body fields that bound the generated length (tokens); only those present are changed.
LENGTH_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens", "max_new_tokens")
#: Default cap on generated tokens: random-weight test models rarely emit EOS.
DEFAULT_MAX_NEW_TOKENS = 8
#: Header asking upstream SGLang to return the prompt token ids (``sglext.input_ids``).
INPUT_IDS_HEADER = "x-sglext-return-input-ids"

_BODY_NAME = re.compile(r"^(\d+)\.json$")
_SKIP_HEADERS = {
    "host",
    "content-length",
    "connection",
    "keep-alive",
    "accept-encoding",
    "transfer-encoding",
    "te",
    "upgrade",
    "authorization",
    "x-api-key",
    "proxy-authorization",
    "cookie",
    "content-type",
}
# Top-level fields that only the Anthropic Messages API uses.
_ANTHROPIC_FIELDS = (
    "system",
    "stop_sequences",
    "anthropic_version",
    "thinking",
    "output_config",
    "context_management",
)
_ANTHROPIC_BLOCKS = {"tool_use", "tool_result", "thinking", "redacted_thinking"}


# --------------------------------------------------------------------------------------------
# Sessions on disk
# --------------------------------------------------------------------------------------------


@dataclass
class Capture:
    """One captured request: its body, the path to POST it to and the client's headers."""

    session: str
    file: str
    path: str
    body: dict
    headers: dict = field(default_factory=dict)

    @property
    def fmt(self) -> str:
        """``"anthropic"`` for the Messages API, else ``"openai"``."""
        return api_format(self.path)

    @property
    def label(self) -> str:
        """``session/file``."""
        return f"{self.session}/{self.file}"


@dataclass
class Session:
    """A folder of captures replayed in order against one prefix cache."""

    name: str
    folder: Path
    captures: list[Capture]


def api_format(path: str) -> str:
    """API family of a request path: ``"anthropic"`` for ``/v1/messages``, else ``"openai"``."""
    p = urlsplit(path).path.rstrip("/")
    return ANTHROPIC if p.endswith("/messages") else OPENAI


def default_path(body: dict) -> str:
    """Endpoint a body was meant for when no meta.jsonl says so (by the body's shape)."""
    if any(k in body for k in _ANTHROPIC_FIELDS):
        return "/v1/messages"
    for msg in body.get("messages") or []:
        content = msg.get("content") if isinstance(msg, dict) else None
        if isinstance(content, list) and any(
            isinstance(b, dict) and b.get("type") in _ANTHROPIC_BLOCKS for b in content
        ):
            return "/v1/messages"
    return "/v1/chat/completions"


def _is_session_dir(folder: Path) -> bool:
    return folder.is_dir() and any(_BODY_NAME.match(p.name) for p in folder.iterdir())


def load_session(folder: Path, name: Optional[str] = None) -> Session:
    """Read one session folder: every ``NN.json``, in meta.jsonl order (then numeric order)."""
    folder = Path(folder)
    files = {p.name: p for p in folder.iterdir() if _BODY_NAME.match(p.name)}
    meta: dict[str, dict] = {}
    order: list[str] = []
    meta_path = folder / "meta.jsonl"
    if meta_path.exists():
        for line in meta_path.read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            rec = json.loads(line)
            fname = rec.get("file")
            if fname in files and fname not in meta:
                meta[fname] = rec
                order.append(fname)
    rest = sorted((f for f in files if f not in meta), key=lambda f: int(_BODY_NAME.match(f)[1]))
    name = name or folder.name
    captures = []
    for fname in order + rest:
        body = json.loads(files[fname].read_text(encoding="utf-8"))
        rec = meta.get(fname, {})
        captures.append(
            Capture(
                session=name,
                file=fname,
                path=rec.get("path") or default_path(body),
                body=body,
                headers=dict(rec.get("headers") or {}),
            )
        )
    return Session(name, folder, captures)


def discover_sessions(root: Path) -> list[Session]:
    """Sessions under ``root``: ``root`` itself if it holds ``NN.json`` files, else every folder
    below it that does (sorted by relative path, named by it).

    Raises:
        FileNotFoundError: no session was found.
    """
    root = Path(root)
    if _is_session_dir(root):
        return [load_session(root)]
    sessions = [
        load_session(d, str(d.relative_to(root)))
        for d in sorted(p for p in root.rglob("*") if _is_session_dir(p))
    ]
    if not sessions:
        raise FileNotFoundError(f"no captured requests (NN.json) under {root}")
    return sessions


def prepare_body(body: dict, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS) -> dict:
    """The body to send: a copy with each length field present (``LENGTH_FIELDS``) lowered to
    ``max_new_tokens`` tokens; ``max_new_tokens=0`` returns the body unchanged."""
    if not max_new_tokens:
        return body
    out = copy.copy(body)
    for key in LENGTH_FIELDS:
        if key in out:
            cur = out[key]
            out[key] = min(cur, max_new_tokens) if isinstance(cur, int) else max_new_tokens
    return out


def replay_headers(captured: dict) -> dict:
    """Client headers worth replaying (API version/beta flags, user agent); drops hop-by-hop
    headers, credentials and redacted values."""
    out = {}
    for k, v in captured.items():
        if k.lower() in _SKIP_HEADERS or not isinstance(v, str) or v.startswith("<redacted"):
            continue
        out[k] = v
    return out


# --------------------------------------------------------------------------------------------
# Server-sent events
# --------------------------------------------------------------------------------------------


@dataclass
class SSEEvent:
    """One server-sent event: its ``event:`` name (None if absent), joined ``data:`` lines and
    arrival time in seconds since the request was sent."""

    event: Optional[str]
    data: str
    t: float = 0.0


class SSEParser:
    """Incremental ``text/event-stream`` parser: ``feed`` bytes as they arrive, get events."""

    def __init__(self) -> None:
        self._buf = b""
        self._event: Optional[str] = None
        self._data: list[str] = []
        self.stray: list[str] = []  # non-SSE lines (a malformed stream)

    def feed(self, chunk: bytes, t: float = 0.0) -> list[SSEEvent]:
        """Parse ``chunk`` (any split of the stream); return the events it completed."""
        self._buf += chunk
        out = []
        while True:
            nl = self._buf.find(b"\n")
            if nl < 0:
                break
            raw, self._buf = self._buf[:nl], self._buf[nl + 1 :]
            ev = self._line(raw.rstrip(b"\r").decode("utf-8", errors="replace"), t)
            if ev is not None:
                out.append(ev)
        return out

    def close(self, t: float = 0.0) -> list[SSEEvent]:
        """End of stream: flush a final event not followed by a blank line."""
        out = []
        if self._buf:
            ev = self._line(self._buf.rstrip(b"\r").decode("utf-8", errors="replace"), t)
            self._buf = b""
            if ev is not None:
                out.append(ev)
        ev = self._line("", t)
        if ev is not None:
            out.append(ev)
        return out

    def _line(self, line: str, t: float) -> Optional[SSEEvent]:
        if line == "":
            if not self._data and self._event is None:
                return None
            ev = SSEEvent(self._event, "\n".join(self._data), t)
            self._event, self._data = None, []
            return ev
        if line.startswith(":"):
            return None  # comment / keep-alive
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        elif name in ("id", "retry"):
            pass
        else:
            self.stray.append(line[:200])
        return None


def parse_sse(raw: bytes) -> list[SSEEvent]:
    """All events of a complete SSE byte stream (for tests and offline checks)."""
    p = SSEParser()
    return p.feed(raw) + p.close()


@dataclass
class StreamCheck:
    """What a reply said and whether it was well-formed.

    Token counts are in tokens (None when the server did not report them); times in seconds
    since the request was sent.
    """

    fmt: str
    problems: list[str] = field(default_factory=list)
    events: int = 0
    prompt_tokens: Optional[int] = None
    cached_tokens: Optional[int] = None
    completion_tokens: Optional[int] = None
    input_ids: Optional[list[int]] = None
    finish_reason: Optional[str] = None
    first_event_s: Optional[float] = None
    ttft_s: Optional[float] = None
    has_usage: bool = False

    @property
    def ok(self) -> bool:
        """True when the reply is well-formed (no problems found)."""
        return not self.problems


def _sglext_ids(obj: Any) -> Optional[list[int]]:
    if isinstance(obj, dict):
        ext = obj.get("sglext")
        if isinstance(ext, dict) and isinstance(ext.get("input_ids"), list):
            return ext["input_ids"]
        msg = obj.get("message")
        if isinstance(msg, dict):
            return _sglext_ids(msg)
    return None


def _openai_usage(check: StreamCheck, usage: dict) -> None:
    check.has_usage = True
    check.prompt_tokens = usage.get("prompt_tokens")
    check.completion_tokens = usage.get("completion_tokens")
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and details.get("cached_tokens") is not None:
        check.cached_tokens = details["cached_tokens"]


def _event_object(check: StreamCheck, i: int, ev: SSEEvent) -> Optional[dict]:
    """The JSON object carried by event ``i``, or None after recording why it is not one."""
    try:
        obj = json.loads(ev.data)
    except ValueError:
        check.problems.append(f"event {i} is not JSON: {ev.data[:80]!r}")
        return None
    if not isinstance(obj, dict):
        check.problems.append(f"event {i} is not a JSON object")
        return None
    return obj


def check_openai_stream(events: list[SSEEvent], expect_usage: bool = True) -> StreamCheck:
    """Check a ``/v1/chat/completions`` stream.

    Well-formed means: every ``data:`` is JSON except one final ``[DONE]``; no error payload;
    at least one choice chunk and a ``finish_reason``; and, when ``expect_usage``
    (``stream_options.include_usage``), the last chunk carries ``usage`` with ``prompt_tokens``.
    Cached tokens come from ``usage.prompt_tokens_details.cached_tokens``; prompt ids from an
    ``sglext.input_ids`` chunk.
    """
    check = StreamCheck(OPENAI, events=len(events))
    chunks: list[dict] = []
    done_at = None
    for i, ev in enumerate(events):
        if check.first_event_s is None:
            check.first_event_s = ev.t
        if ev.data.strip() == "[DONE]":
            if done_at is not None:
                check.problems.append("more than one [DONE]")
            done_at = i
            continue
        if done_at is not None:
            check.problems.append(f"event after [DONE]: {ev.data[:80]!r}")
        obj = _event_object(check, i, ev)
        if obj is None:
            continue
        if "error" in obj:
            check.problems.append(f"error event: {json.dumps(obj['error'])[:200]}")
            continue
        chunks.append(obj)
        ids = _sglext_ids(obj)
        if ids is not None:
            check.input_ids = ids
        if isinstance(obj.get("usage"), dict):
            _openai_usage(check, obj["usage"])
        for ch in obj.get("choices") or []:
            if ch.get("finish_reason"):
                check.finish_reason = ch["finish_reason"]
            delta = ch.get("delta") or {}
            if check.ttft_s is None and (
                delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls")
            ):
                check.ttft_s = ev.t
    if done_at is None:
        check.problems.append("stream did not end with [DONE]")
    if not any(c.get("choices") for c in chunks):
        check.problems.append("no choice chunks")
    elif check.finish_reason is None:
        check.problems.append("no finish_reason")
    if expect_usage:
        if not chunks or not isinstance(chunks[-1].get("usage"), dict):
            check.problems.append("last chunk carries no usage")
        elif check.prompt_tokens is None:
            check.problems.append("usage has no prompt_tokens")
    return check


def check_anthropic_stream(events: list[SSEEvent]) -> StreamCheck:
    """Check a ``/v1/messages`` stream.

    Well-formed means: every event's data is a JSON object whose ``type`` matches the
    ``event:`` name; it starts with ``message_start`` and ends with ``message_stop``; content
    blocks are started, updated and stopped by index; no ``error`` event; and a
    ``message_delta`` with ``usage`` precedes ``message_stop``. Prompt tokens are
    ``input_tokens + cache_read_input_tokens + cache_creation_input_tokens`` (from
    ``message_delta`` usage when it has ``input_tokens``, else from ``message_start``), cached
    tokens are ``cache_read_input_tokens`` (0 when absent: upstream omits it when nothing was
    cached).
    """
    check = StreamCheck(ANTHROPIC, events=len(events))
    types: list[str] = []
    open_blocks: set[int] = set()
    start_usage: Optional[dict] = None
    delta_usage: Optional[dict] = None
    for i, ev in enumerate(events):
        if check.first_event_s is None:
            check.first_event_s = ev.t
        obj = _event_object(check, i, ev)
        if obj is None:
            continue
        typ = obj.get("type")
        if ev.event is not None and typ != ev.event:
            check.problems.append(f"event {i}: name {ev.event!r} but type {typ!r}")
        types.append(typ)
        ids = _sglext_ids(obj)
        if ids is not None:
            check.input_ids = ids
        if typ == "error":
            check.problems.append(f"error event: {json.dumps(obj.get('error'))[:200]}")
        elif typ == "message_start":
            usage = (obj.get("message") or {}).get("usage")
            start_usage = usage if isinstance(usage, dict) else None
        elif typ == "content_block_start":
            idx = obj.get("index")
            if idx in open_blocks:
                check.problems.append(f"content block {idx} started twice")
            open_blocks.add(idx)
        elif typ == "content_block_delta":
            if obj.get("index") not in open_blocks:
                check.problems.append(f"delta for content block {obj.get('index')} not open")
            if check.ttft_s is None:
                check.ttft_s = ev.t
        elif typ == "content_block_stop":
            if obj.get("index") not in open_blocks:
                check.problems.append(f"stop for content block {obj.get('index')} not open")
            open_blocks.discard(obj.get("index"))
        elif typ == "message_delta":
            if open_blocks:
                check.problems.append(
                    f"message_delta with content blocks open: {sorted(open_blocks)}"
                )
            if isinstance(obj.get("usage"), dict):
                delta_usage = obj["usage"]
                check.has_usage = True
            check.finish_reason = (obj.get("delta") or {}).get("stop_reason")
    if not types or types[0] != "message_start":
        check.problems.append("stream does not start with message_start")
    if not types or types[-1] != "message_stop":
        check.problems.append("stream did not end with message_stop")
    if types.count("message_stop") > 1:
        check.problems.append("more than one message_stop")
    if not check.has_usage:
        check.problems.append("no message_delta usage")
    usage = delta_usage if delta_usage and "input_tokens" in delta_usage else start_usage
    if usage is not None and usage.get("input_tokens") is not None:
        cached = usage.get("cache_read_input_tokens") or 0
        check.cached_tokens = cached
        check.prompt_tokens = (
            usage["input_tokens"] + cached + (usage.get("cache_creation_input_tokens") or 0)
        )
    else:
        check.problems.append("no input_tokens in message_start or message_delta usage")
    if delta_usage is not None:
        check.completion_tokens = delta_usage.get("output_tokens")
    return check


def check_json_reply(fmt: str, obj: Any, t: float) -> StreamCheck:
    """Check a non-streaming reply (a body sent with ``stream: false``)."""
    check = StreamCheck(fmt, events=1, first_event_s=t, ttft_s=t)
    if not isinstance(obj, dict) or "error" in obj or obj.get("type") == "error":
        check.problems.append(f"error reply: {json.dumps(obj)[:200]}")
        return check
    usage = obj.get("usage")
    if not isinstance(usage, dict):
        check.problems.append("reply carries no usage")
        return check
    check.has_usage = True
    check.input_ids = _sglext_ids(obj)
    if fmt == ANTHROPIC:
        cached = usage.get("cache_read_input_tokens") or 0
        check.cached_tokens = cached
        check.prompt_tokens = (
            (usage.get("input_tokens") or 0)
            + cached
            + (usage.get("cache_creation_input_tokens") or 0)
        )
        check.completion_tokens = usage.get("output_tokens")
        check.finish_reason = obj.get("stop_reason")
    else:
        _openai_usage(check, usage)
        choices = obj.get("choices") or []
        check.finish_reason = choices[0].get("finish_reason") if choices else None
    return check


# --------------------------------------------------------------------------------------------
# Prefix reuse
# --------------------------------------------------------------------------------------------


def common_prefix_len(a: list[int], b: list[int]) -> int:
    """Number of leading tokens ``a`` and ``b`` share (tokens)."""
    n = min(len(a), len(b))
    lo, block = 0, 4096
    while lo < n:  # compare blocks at C speed, then scan the first differing block
        hi = min(lo + block, n)
        if a[lo:hi] != b[lo:hi]:
            for i in range(lo, hi):
                if a[i] != b[i]:
                    return i
        lo = hi
    return n


def reusable_prefix_len(ids: Optional[list[int]], earlier: Iterable[Optional[list[int]]]) -> int:
    """Longest token prefix ``ids`` shares with any of ``earlier`` (tokens), capped at
    ``len(ids) - 1`` (a server always computes the last prompt token). Unknown ids (None) count
    0 and are skipped as references."""
    if not ids:
        return 0
    best = max((common_prefix_len(ids, prev) for prev in earlier if prev), default=0)
    return min(best, len(ids) - 1)


def reusable_prefix_lengths(prompts: list[Optional[list[int]]]) -> list[int]:
    """:func:`reusable_prefix_len` of each prompt against all earlier ones (tokens)."""
    return [reusable_prefix_len(ids, prompts[:i]) for i, ids in enumerate(prompts)]


# --------------------------------------------------------------------------------------------
# Anthropic prompt ids: upstream's conversion + the server's /v1/tokenize
# --------------------------------------------------------------------------------------------


class AnthropicPromptIds:
    """Prompt token ids of ``/v1/messages`` requests, as the server builds them.

    Runs upstream's ``AnthropicServing._convert_to_chat_completion_request`` in this process,
    bound to a stand-in for the server's ``OpenAIServingChat`` whose template-dependent state
    (inline-system support, reasoning detector and toggle, native reasoning history) is computed
    by upstream's own helpers from the server's tokenizer and ``/server_info``; then asks the
    server to tokenize the converted chat request (``POST /v1/tokenize``). Needs the server's
    tokenizer folder readable here. Callers must compare the length with the server-reported
    prompt tokens.
    """

    def __init__(self, url: str, timeout_s: float = 600):
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self._serving = None

    def _build(self):
        import logging
        import types

        from transformers import AutoTokenizer

        from sglang.srt.entrypoints.anthropic.serving import AnthropicServing
        from sglang.srt.entrypoints.openai.serving_chat import OpenAIServingChat
        from sglang.srt.parser.reasoning_parser import ReasoningParser
        from sglang.srt.parser.template_detection import detect_reasoning_pattern

        # The conversion logs accept-and-ignore notes (e.g. thinking.display) per request.
        logging.getLogger("sglang.srt.entrypoints.anthropic.serving").setLevel(logging.ERROR)
        info = requests.get(self.url + "/server_info", timeout=60).json()
        model = requests.get(self.url + "/model_info", timeout=60).json()
        tok = AutoTokenizer.from_pretrained(
            info["tokenizer_path"], trust_remote_code=bool(info.get("trust_remote_code"))
        )
        tmpl_arg = info.get("chat_template")
        if tmpl_arg:
            if str(tmpl_arg).endswith(".jinja") and os.path.exists(tmpl_arg):
                tok.chat_template = Path(tmpl_arg).read_text(encoding="utf-8").replace("\\n", "\n")
            else:
                raise RuntimeError(f"server chat template {tmpl_arg!r} is not a local .jinja file")
        chat = types.SimpleNamespace()
        chat.tokenizer_manager = types.SimpleNamespace(
            tokenizer=tok,
            model_config=types.SimpleNamespace(
                hf_config=types.SimpleNamespace(
                    architectures=model.get("architectures") or [],
                    model_type=model.get("model_type"),
                )
            ),
        )
        chat.template_manager = types.SimpleNamespace(
            chat_template_name=None,
            python_chat_template=None,
            reasoning_config=detect_reasoning_pattern(tok.chat_template)[1],
        )
        chat.tool_call_parser = info.get("tool_call_parser")
        chat.reasoning_parser = info.get("reasoning_parser")
        chat.default_chat_template_kwargs = info.get("default_chat_template_kwargs") or {}
        chat._reasoning_detector = None
        if chat.reasoning_parser:
            chat._reasoning_detector = ReasoningParser(
                model_type=chat.reasoning_parser, stream_reasoning=True, tokenizer=tok
            ).detector
        for name in (
            "_resolve_chat_encoding_spec",
            "_resolve_inline_system_support",
            "_chat_template_reads_reasoning_content",
            "supports_native_reasoning_history",
            "wrap_reasoning_history",
            "apply_reasoning_enabled",
            "_reasoning_default_mode",
            "_get_reasoning_toggle_param",
        ):
            setattr(chat, name, getattr(OpenAIServingChat, name).__get__(chat))
        chat.chat_encoding_spec = chat._resolve_chat_encoding_spec()
        chat.supports_inline_system = chat._resolve_inline_system_support()
        chat._template_reads_reasoning_content = chat._chat_template_reads_reasoning_content()
        return AnthropicServing(chat)

    def __call__(self, body: dict) -> list[int]:
        """Token ids (after the chat template) the server builds for Anthropic ``body``."""
        from sglang.srt.entrypoints.anthropic.protocol import AnthropicMessagesRequest

        if self._serving is None:
            import warnings

            with warnings.catch_warnings():  # import-time platform notes (AWQ, GGUF, Triton)
                warnings.simplefilter("ignore")
                self._serving = self._build()
        req = self._serving._convert_to_chat_completion_request(AnthropicMessagesRequest(**body))
        data = req.model_dump(mode="json", exclude_none=True)
        data["stream"] = False
        data.pop("stream_options", None)
        r = requests.post(self.url + "/v1/tokenize", json=data, timeout=self.timeout_s)
        r.raise_for_status()
        return list(r.json()["tokens"])


# --------------------------------------------------------------------------------------------
# Replay
# --------------------------------------------------------------------------------------------


@dataclass
class RequestResult:
    """Outcome of one replayed request.

    ``reusable_tokens`` is filled in by :func:`replay_session` (tokens); times are seconds.
    """

    capture: Capture
    status: int
    total_s: float
    check: StreamCheck
    prompt_ids: Optional[list[int]] = None
    ids_source: str = ""
    reusable_tokens: int = 0

    @property
    def ok(self) -> bool:
        """HTTP 200 and a well-formed reply."""
        return self.status == 200 and self.check.ok

    @property
    def problems(self) -> list[str]:
        """Why the request is not OK (empty when it is)."""
        out = [] if self.status == 200 else [f"HTTP {self.status}"]
        return out + self.check.problems

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens the server reported as served from its cache (0 if not reported)."""
        return self.check.cached_tokens or 0

    def line(self) -> str:
        """One human-readable line: session, file, status, tokens and times."""
        c = self.check

        def n(v: Optional[int]) -> str:
            return "-" if v is None else str(v)

        ttft = "-" if c.ttft_s is None else f"{c.ttft_s:.2f}s"
        reusable = str(self.reusable_tokens) if self.prompt_ids is not None else "?"
        status = "ok" if self.ok else "FAIL " + "; ".join(self.problems)
        return (
            f"{self.capture.session} {self.capture.file} status={self.status} "
            f"prompt={n(c.prompt_tokens)} cached={n(c.cached_tokens)} reusable={reusable} "
            f"ttft={ttft} total={self.total_s:.2f}s {status}"
        )


def replay_request(
    url: str,
    capture: Capture,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    timeout_s: float = 1800,
    session: Optional[requests.Session] = None,
    anthropic_ids: Optional[Callable[[dict], list[int]]] = None,
) -> RequestResult:
    """POST one capture to ``url`` + its path, read and check the reply.

    ``timeout_s`` bounds the wait for each read, including the first byte (seconds).
    ``anthropic_ids`` rebuilds prompt ids of Anthropic requests when the stream carries none
    (default: :class:`AnthropicPromptIds` for ``url``); the ids are kept only if their count
    equals the server-reported prompt tokens.
    """
    http = session or requests.Session()
    body = prepare_body(capture.body, max_new_tokens)
    headers = replay_headers(capture.headers)
    headers["Content-Type"] = "application/json"
    headers[INPUT_IDS_HEADER] = "1"
    stream = bool(body.get("stream"))
    data = json.dumps(body, ensure_ascii=False).encode("utf-8")
    t0 = time.perf_counter()
    try:
        resp = http.post(
            url.rstrip("/") + capture.path,
            data=data,
            headers=headers,
            stream=stream,
            timeout=(30, timeout_s),
        )
    except requests.RequestException as e:
        check = StreamCheck(capture.fmt, problems=[f"request failed: {e}"])
        return RequestResult(capture, 0, time.perf_counter() - t0, check)
    ctype = resp.headers.get("content-type", "")
    if resp.status_code != 200 or not stream or "text/event-stream" not in ctype:
        raw = resp.content
        t = time.perf_counter() - t0
        try:
            obj = json.loads(raw)
        except ValueError:
            obj = raw[:200].decode("utf-8", errors="replace")
        if resp.status_code == 200 and stream:
            check = StreamCheck(capture.fmt, problems=[f"not an event stream ({ctype!r})"])
        elif resp.status_code == 200:
            check = check_json_reply(capture.fmt, obj, t)
        else:
            check = StreamCheck(capture.fmt, problems=[f"error reply: {str(obj)[:300]}"])
        result = RequestResult(capture, resp.status_code, t, check)
    else:
        parser, events = SSEParser(), []
        try:
            for chunk in resp.iter_content(chunk_size=None):
                events += parser.feed(chunk, time.perf_counter() - t0)
        except requests.RequestException as e:
            events += parser.close(time.perf_counter() - t0)
            check = _check_events(capture, body, events)
            check.problems.append(f"stream broken: {e}")
        else:
            events += parser.close(time.perf_counter() - t0)
            check = _check_events(capture, body, events)
        if parser.stray:
            check.problems.append(f"non-SSE lines: {parser.stray[:3]}")
        result = RequestResult(capture, 200, time.perf_counter() - t0, check)
    resp.close()
    _attach_prompt_ids(url, result, anthropic_ids, timeout_s)
    return result


def _check_events(capture: Capture, body: dict, events: list[SSEEvent]) -> StreamCheck:
    if capture.fmt == ANTHROPIC:
        return check_anthropic_stream(events)
    opts = body.get("stream_options") or {}
    return check_openai_stream(events, expect_usage=bool(opts.get("include_usage")))


def _attach_prompt_ids(url, result: RequestResult, anthropic_ids, timeout_s) -> None:
    check = result.check
    if result.status != 200:
        return
    if check.input_ids is not None:
        result.prompt_ids, result.ids_source = check.input_ids, "server"
        if check.prompt_tokens is not None and len(check.input_ids) != check.prompt_tokens:
            check.problems.append(
                f"server returned {len(check.input_ids)} prompt ids but reported "
                f"{check.prompt_tokens} prompt tokens"
            )
        return
    if result.capture.fmt != ANTHROPIC:
        check.problems.append("server returned no prompt ids (sglext.input_ids)")
        return
    try:
        fn = anthropic_ids or AnthropicPromptIds(url, timeout_s)
        ids = fn(result.capture.body)
    except Exception as e:  # noqa: BLE001 - reported, the replay goes on
        check.problems.append(f"could not rebuild prompt ids: {type(e).__name__}: {e}"[:300])
        return
    if check.prompt_tokens is None or len(ids) != check.prompt_tokens:
        check.problems.append(
            f"rebuilt prompt ids have {len(ids)} tokens, server reported {check.prompt_tokens}"
        )
        return
    result.prompt_ids, result.ids_source = ids, "tokenize"


def flush_cache(url: str, attempts: int = 30) -> None:
    """Empty the server's prefix cache (``POST /flush_cache``), retrying while it is busy.

    Raises:
        RuntimeError: the server refused ``attempts`` times (about one per second).
    """
    last = ""
    for _ in range(attempts):
        r = requests.post(url.rstrip("/") + "/flush_cache", timeout=60)
        if r.status_code == 200:
            return
        last = f"HTTP {r.status_code}: {r.text[:200]}"
        time.sleep(1)
    raise RuntimeError(f"flush_cache failed: {last}")


@dataclass
class SessionResult:
    """All results of one session, in replay order, and its wall time (seconds)."""

    session: Session
    results: list[RequestResult]
    wall_s: float

    def summary(self) -> "ReplaySummary":
        """Totals over this session's requests."""
        return ReplaySummary.of(self.results)


def replay_session(
    url: str,
    session: Session,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    timeout_s: float = 1800,
    flush: bool = True,
    on_result: Optional[Callable[[RequestResult], None]] = None,
) -> SessionResult:
    """Replay a session's captures in order (after emptying the prefix cache when ``flush``),
    then compute each request's reusable prefix (tokens). ``on_result`` sees each result as
    soon as it is known (reusable tokens are final then: they depend only on earlier ones)."""
    if flush:
        flush_cache(url)
    http = requests.Session()
    anthropic_ids = AnthropicPromptIds(url, timeout_s)
    results: list[RequestResult] = []
    t0 = time.perf_counter()
    for cap in session.captures:
        res = replay_request(url, cap, max_new_tokens, timeout_s, http, anthropic_ids)
        results.append(res)
        res.reusable_tokens = reusable_prefix_len(
            res.prompt_ids, [r.prompt_ids for r in results[:-1]]
        )
        if on_result:
            on_result(res)
    http.close()
    return SessionResult(session, results, time.perf_counter() - t0)


def replay_sessions(
    url: str,
    sessions: Iterable[Session],
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    timeout_s: float = 1800,
    flush: bool = True,
    on_result: Optional[Callable[[RequestResult], None]] = None,
) -> list[SessionResult]:
    """Replay every session in turn against the server at ``url`` (see :func:`replay_session`)."""
    return [replay_session(url, s, max_new_tokens, timeout_s, flush, on_result) for s in sessions]


@dataclass
class ReplaySummary:
    """Totals over replayed requests (tokens); ``failed`` counts requests that were not OK."""

    requests: int
    cached_tokens: int
    reusable_tokens: int
    prompt_tokens: int
    failed: int

    @classmethod
    def of(cls, results: Iterable[RequestResult]) -> "ReplaySummary":
        """Sum ``results`` (unknown counts add 0)."""
        results = list(results)
        return cls(
            requests=len(results),
            cached_tokens=sum(r.cached_tokens for r in results),
            reusable_tokens=sum(r.reusable_tokens for r in results),
            prompt_tokens=sum(r.check.prompt_tokens or 0 for r in results),
            failed=sum(not r.ok for r in results),
        )

    @property
    def wasted_tokens(self) -> int:
        """Reusable tokens the server did not serve from cache (negative if it cached more)."""
        return self.reusable_tokens - self.cached_tokens

    @property
    def reuse_ratio(self) -> float:
        """Cached / reusable tokens; 1.0 when nothing was reusable."""
        return self.cached_tokens / self.reusable_tokens if self.reusable_tokens else 1.0

    def line(self, prefix: str = "agent_replay") -> str:
        """``agent_replay requests=N cached_tokens=C reusable_tokens=R wasted_tokens=R-C
        reuse_ratio=C/R``, plus ``failed=F`` when any request failed (its tokens are then
        missing from the sums, so the ratio alone would hide it)."""
        line = (
            f"{prefix} requests={self.requests} cached_tokens={self.cached_tokens} "
            f"reusable_tokens={self.reusable_tokens} wasted_tokens={self.wasted_tokens} "
            f"reuse_ratio={self.reuse_ratio:.3f}"
        )
        return line + (f" failed={self.failed}" if self.failed else "")
