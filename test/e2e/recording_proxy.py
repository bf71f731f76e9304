"""A recording HTTP proxy between an agent client and the server under test.

The agent-client tests point a client at :class:`RecordingProxy` instead of the server, so they
can assert on every exchange of a turn the client ran on its own: the status of each response
and the whole body of each stream (:func:`stream_problems` checks an OpenAI or Anthropic event
stream for well-formedness). Responses are passed through as they arrive (a stream stays a
stream); each one is closed after its body (``Connection: close``), which every client handles.
"""

from __future__ import annotations

import http.client
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "host"}


@dataclass
class Exchange:
    """One request the proxy forwarded and what came back (``response`` is the raw body)."""

    method: str
    path: str
    request: bytes
    status: int = 0
    content_type: str = ""
    response: bytes = b""
    error: str = ""

    def request_json(self) -> dict:
        try:
            return json.loads(self.request or b"{}")
        except ValueError:
            return {}


@dataclass
class RecordingProxy:
    """Forwards ``http://127.0.0.1:<port>`` to ``upstream`` and records every exchange."""

    upstream: str
    exchanges: list[Exchange] = field(default_factory=list)

    def __post_init__(self) -> None:
        target = urlsplit(self.upstream)
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    out = b""
                    while size := int(self.rfile.readline().split(b";")[0], 16):
                        out += self.rfile.read(size)
                        self.rfile.readline()
                    self.rfile.readline()
                    return out
                n = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(n) if n else b""

            def _forward(self) -> None:
                ex = Exchange(self.command, self.path, self._body())
                proxy.exchanges.append(ex)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_HEADERS}
                conn = http.client.HTTPConnection(target.hostname, target.port, timeout=900)
                try:
                    conn.request(self.command, self.path, body=ex.request or None, headers=headers)
                    r = conn.getresponse()
                    ex.status, ex.content_type = r.status, r.getheader("Content-Type", "")
                    self.send_response(r.status)
                    for k, v in r.getheaders():
                        if k.lower() not in HOP_HEADERS:
                            self.send_header(k, v)
                    self.send_header("Connection", "close")
                    self.end_headers()
                    while chunk := r.read1(65536):
                        ex.response += chunk
                        self.wfile.write(chunk)
                        self.wfile.flush()
                except OSError as e:
                    ex.error = repr(e)
                finally:
                    conn.close()
                    self.close_connection = True

            do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = _forward

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        threading.Thread(target=self._httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def generation(self) -> list[Exchange]:
        """The exchanges of the generation routes (not the model-info GETs)."""
        routes = ("/v1/chat/completions", "/v1/messages", "/v1/completions", "/generate")
        return [e for e in self.exchanges if e.path.split("?")[0] in routes]


def _sse(raw: bytes) -> list[tuple[str | None, str]]:
    """(event, data) of each event of a server-sent event stream."""
    events, event, data = [], None, []
    for line in raw.decode("utf-8", errors="replace").splitlines() + [""]:
        if not line:
            if data:
                events.append((event, "\n".join(data)))
            event, data = None, []
        elif line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].strip())
    return events


def stream_problems(ex: Exchange) -> list[str]:
    """What is wrong with ``ex``'s event stream (empty when it is well formed).

    OpenAI (``/v1/chat/completions``): every ``data:`` is a JSON chunk without ``error`` until a
    last ``[DONE]``, and every choice gets exactly one ``finish_reason``. Anthropic
    (``/v1/messages``): the events' names match their ``type``, the stream is ``message_start``
    ... ``message_stop`` with one ``message_delta`` carrying a ``stop_reason``, no ``error``
    event, and every content block is started and stopped once, in index order.
    """
    events = _sse(ex.response)
    if not events:
        return ["empty stream"]
    problems = []
    if ex.path.startswith("/v1/messages"):
        names = [e for e, _ in events]
        if names[0] != "message_start" or names[-1] != "message_stop":
            problems.append(f"stream is {names[0]} ... {names[-1]}")
        open_blocks, seen = set(), []
        for event, data in events:
            d = json.loads(data)
            if d.get("type") != event:
                problems.append(f"event {event} carries type {d.get('type')}")
            if event == "error":
                problems.append(f"error event: {data[:300]}")
            elif event == "content_block_start":
                if d["index"] != len(seen):
                    problems.append(f"block {d['index']} started after {len(seen)} blocks")
                seen.append(d["index"])
                open_blocks.add(d["index"])
            elif event == "content_block_stop":
                if d["index"] not in open_blocks:
                    problems.append(f"block {d['index']} stopped but not open")
                open_blocks.discard(d["index"])
        if open_blocks:
            problems.append(f"blocks never stopped: {sorted(open_blocks)}")
        deltas = [json.loads(d) for e, d in events if e == "message_delta"]
        if len(deltas) != 1 or not deltas[0].get("delta", {}).get("stop_reason"):
            problems.append(f"message_delta events: {deltas}")
        return problems
    datas = [d for _, d in events]
    if datas[-1] != "[DONE]":
        problems.append(f"stream ends with {datas[-1][:200]!r}, not [DONE]")
    finishes: dict[int, int] = {}
    for d in datas[:-1]:
        chunk = json.loads(d)
        if "error" in chunk:
            problems.append(f"error chunk: {d[:300]}")
        for c in chunk.get("choices", []):
            if c.get("finish_reason"):
                finishes[c["index"]] = finishes.get(c["index"], 0) + 1
    if not finishes or any(v != 1 for v in finishes.values()):
        problems.append(f"finish_reason count per choice: {finishes}")
    return problems
