"""The ``/rebalance_memory`` route (patch 0038, ``managers/memory_rebalance.py``) without a
server: upstream's route function in a bare FastAPI app with upstream's API-key middleware, the
tokenizer manager replaced by a stand-in that records what would reach the scheduler.

* an admin endpoint: with ``--admin-api-key`` (or only ``--api-key``) set, 401 without the
  key, with a wrong one, or (both set) with the plain API key; GET as POST;
* bodies: what reaches the scheduler (a slot count as an int or a string, a share, a size,
  ``dry_run``), and 400s that say what to send for every malformed body, without reaching the
  scheduler (a target with the budget, ``kv_share`` without one, bad sizes and shares);
* the scheduler's status and split come back as the answer.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from fastapi import FastAPI
from starlette.testclient import TestClient

from sglang.srt.entrypoints import http_server
from sglang.srt.managers.io_struct import RebalanceMemoryReqOutput
from sglang.srt.utils.auth import add_api_key_middleware


class _TokenizerManager:
    def __init__(self, reply=None):
        self.sent = []
        self.reply = reply or RebalanceMemoryReqOutput(
            success=True, split={"expert_cache": {"slots": 8}, "kv": {"kv_tokens": 64}}
        )

    async def rebalance_memory(self, obj):
        self.sent.append(obj)
        return self.reply


@pytest.fixture
def client(monkeypatch):
    """``client(api_key=None, admin_api_key=None, reply=None)``: a TestClient of the route."""

    def make(api_key=None, admin_api_key=None, reply=None):
        tm = _TokenizerManager(reply)
        monkeypatch.setattr(http_server, "_global_state", SimpleNamespace(tokenizer_manager=tm))
        app = FastAPI()
        app.add_api_route(
            "/rebalance_memory", http_server.rebalance_memory, methods=["GET", "POST"]
        )
        if api_key or admin_api_key:
            add_api_key_middleware(app, api_key=api_key, admin_api_key=admin_api_key)
        c = TestClient(app)
        c.tm = tm
        return c

    return make


def _bearer(key):
    return {"Authorization": f"Bearer {key}"}


def test_admin_key_guards_the_route(client):
    c = client(api_key="user", admin_api_key="admin")
    body = {"expert_cache_size": "16"}
    assert c.post("/rebalance_memory", json=body).status_code == 401
    assert c.post("/rebalance_memory", json=body, headers=_bearer("wrong")).status_code == 401
    assert c.post("/rebalance_memory", json=body, headers=_bearer("user")).status_code == 401
    assert c.get("/rebalance_memory").status_code == 401
    assert c.tm.sent == []
    assert c.post("/rebalance_memory", json=body, headers=_bearer("admin")).status_code == 200
    assert c.get("/rebalance_memory", headers=_bearer("admin")).status_code == 200
    only_api = client(api_key="user")
    assert only_api.post("/rebalance_memory", json=body).status_code == 401
    assert only_api.post("/rebalance_memory", json=body, headers=_bearer("user")).status_code == 200


def test_what_reaches_the_scheduler(client):
    c = client()
    r = c.get("/rebalance_memory")
    assert r.status_code == 200, r.text
    assert r.json() == {
        "success": True,
        "message": "",
        "expert_cache": {"slots": 8},
        "kv": {"kv_tokens": 64},
    }
    for body, size, dry in [
        ({"expert_cache_size": 64}, "64", False),
        ({"expert_cache_size": "25%"}, "25%", False),
        ({"expert_cache_size": "4GB", "dry_run": True}, "4GB", True),
    ]:
        assert c.post("/rebalance_memory", json=body).status_code == 200
        assert (c.tm.sent[-1].expert_cache_size, c.tm.sent[-1].dry_run) == (size, dry)
    assert c.tm.sent[0].expert_cache_size is None  # the GET
    for body, want in [
        ({"kv_tokens": 4096}, dict(kv_tokens=4096)),
        (
            {"kv_tokens": "512", "expert_cache_size": 16},
            dict(kv_tokens=512, expert_cache_size="16"),
        ),
        ({"device_memory_budget": "1GB"}, dict(device_memory_budget=10**9, kv_share=None)),
        (
            {"device_memory_budget": "1GiB", "kv_share": 0.25},
            dict(device_memory_budget=1 << 30, kv_share=0.25),
        ),
        ({"device_memory_budget": 123456}, dict(device_memory_budget=123456)),
    ]:
        assert c.post("/rebalance_memory", json=body).status_code == 200
        assert {k: getattr(c.tm.sent[-1], k) for k in want} == want, body


@pytest.mark.parametrize(
    "raw,match",
    [
        (b'{"expert_cache_size": ', "Malformed JSON"),
        (b"", "must be a JSON object"),
        (b'["25%"]', "must be a JSON object"),
        (b'{"expert_cache": "25%"}', "unknown field(s) expert_cache; accepted: expert_cache_size"),
        (b"{}", "give a target: expert_cache_size, kv_tokens, device_memory_budget; got none"),
        (
            b'{"expert_cache_size": "8", "device_memory_budget": "10GB"}',
            "give it alone (with kv_share for the KV side's share), not with expert_cache_size",
        ),
        (b'{"device_memory_budget": "lots"}', 'must be a size such as "10GB"'),
        (b'{"device_memory_budget": "25%"}', 'must be a size such as "10GB"'),
        (b'{"device_memory_budget": 0}', "must be positive"),
        (b'{"kv_tokens": 64, "kv_share": 0.5}', "kv_share splits a device_memory_budget"),
        (b'{"device_memory_budget": "1GB", "kv_share": 1.5}', "kv_share must be a number in"),
        (b'{"kv_tokens": -3}', "kv_tokens must be a positive integer"),
        (b'{"kv_tokens": true}', "kv_tokens must be a positive integer"),
        (b'{"kv_tokens": 9223372036854775808}', "kv_tokens must be at most 9223372036854775807"),
        (b'{"kv_tokens": "99999999999999999999"}', "kv_tokens must be at most"),
        (b'{"device_memory_budget": "99999999999999999999GB"}', "device_memory_budget must be at"),
        (b'{"device_memory_budget": 9223372036854775808}', "device_memory_budget must be at"),
        (b'{"expert_cache_size": "lots"}', "expert_cache_size must be auto, a slot count"),
        (b'{"expert_cache_size": "150%"}', "percentage must be in (0, 100]"),
        (b'{"expert_cache_size": true}', "must be a string or an integer"),
        (b'{"expert_cache_size": "8", "dry_run": "yes"}', "dry_run must be true or false"),
    ],
)
def test_bad_bodies_are_400s_that_say_what_to_send(client, raw, match):
    c = client()
    r = c.post("/rebalance_memory", content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert not r.json()["success"] and match in r.json()["message"], r.json()
    assert c.tm.sent == []


def test_the_schedulers_status_is_the_answer(client):
    refused = RebalanceMemoryReqOutput(
        success=False,
        status_code=400,
        message="below the floor of one layer's top-k: 8 slots",
        split={"expert_cache": {"slots": 32}},
    )
    r = client(reply=refused).post("/rebalance_memory", json={"expert_cache_size": "1"})
    assert r.status_code == 400
    assert r.json()["message"].endswith("8 slots") and r.json()["expert_cache"]["slots"] == 32


def test_the_largest_integers_travel_to_the_scheduler():
    """2^63 - 1 is accepted and survives the msgspec encoding the scheduler request takes."""
    import msgspec

    from sglang.srt.managers.io_struct import RebalanceMemoryReqInput
    from sglang.srt.managers.memory_rebalance import MAX_INT, request_from_body

    for body in ({"kv_tokens": MAX_INT}, {"device_memory_budget": str(MAX_INT)}):
        req = request_from_body(body)
        back = msgspec.msgpack.decode(msgspec.msgpack.encode(req), type=RebalanceMemoryReqInput)
        assert back == req
