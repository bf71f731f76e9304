"""Shared fixtures for the end-to-end tests against the real server.

Servers come from one session-wide pool that keeps AT MOST ONE server alive (this suite runs on
small CPU machines): asking for another configuration stops the current one first, and a test
that uses none of the pool's fixtures releases it, so other modules that start their own server
never run beside a pooled one.

Fixtures (function-scoped handles onto the pooled server; starting is paid once per run of
consecutive tests that share a configuration):

* ``server``: the default tiny Qwen3-Next model, flags of ``make serve``, with the test-only
  output script (``sglang.srt.entrypoints.scripted_output``, folder :data:`SCRIPT_DIR`, which
  does nothing while no test has written rules there) and ``--enable-custom-logit-processor``;
* ``moe_server``: the tiny Qwen3-MoE model;
* ``small_ctx_server``: the default model with ``--context-length 2048`` (input-limit tests);
* ``server_pool``: the pool itself, ``server_pool.get(arch, extra_args, env)`` for anything else.

Every pooled server also gets ``TEST_SERVER_ARGS``: without ``--max-total-tokens`` the CPU
engine sizes its KV pool from free RAM (about 12 GB, ~40 s to allocate on a 2-core machine).

Development overrides: ``E2E_MODEL_QWEN3_NEXT`` / ``E2E_MODEL_QWEN3_MOE`` point an arch at another
model folder; ``PYTHON`` (read by scripts/serve.sh) runs the server from another interpreter.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest
from e2e_util import SMALL_CONTEXT
from server import Server, ensure_model, start_server

TEST_SERVER_ARGS = ["--max-total-tokens", "65536", "--max-running-requests", "16"]
# The default server's output script: tests write rules.json there (scripted_rules), the server
# forces the matching rule's text. One folder per test session.
SCRIPT_DIR = Path(tempfile.mkdtemp(prefix="sglang-e2e-script-"))
SCRIPTED = (["--enable-custom-logit-processor"], {"SGLANG_TEST_SCRIPTED_OUTPUT": str(SCRIPT_DIR)})

_POOL_FIXTURES = {"server", "moe_server", "small_ctx_server", "server_pool"}


def model_path(arch: str) -> Path:
    override = os.environ.get(f"E2E_MODEL_{arch.upper()}")
    return Path(override) if override else ensure_model(arch)


class ServerPool:
    """Hands out servers by (arch, extra args), keeping at most one alive."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._srv: Server | None = None
        self._failed: dict[tuple, str] = {}

    def get(
        self,
        arch: str = "qwen3_next",
        extra: list[str] | tuple[str, ...] = (),
        env: dict[str, str] | None = None,
    ) -> Server:
        """The server of ``arch`` with more launch flags ``extra`` and more environment
        variables ``env`` (part of the configuration: another ``env`` starts another server)."""
        key = (arch, tuple(extra), tuple(sorted((env or {}).items())))
        if key in self._failed:  # do not wait for a broken configuration once per test
            pytest.fail(
                f"server {key} failed to start earlier:\n{self._failed[key]}", pytrace=False
            )
        if self._key == key and self._srv is not None and self._srv.proc.poll() is None:
            return self._srv
        self.release()
        try:
            srv = start_server(model_path(arch), [*TEST_SERVER_ARGS, *extra], env=env)
        except Exception as e:  # noqa: BLE001 - remembered and reported per test
            self._failed[key] = str(e)
            raise
        self._key, self._srv = key, srv
        return srv

    def release(self) -> None:
        if self._srv is not None:
            self._srv.stop()
        self._key, self._srv = None, None


_POOL = ServerPool()


def pytest_runtest_setup(item):
    if not _POOL_FIXTURES & set(getattr(item, "fixturenames", ())):
        _POOL.release()


def pytest_sessionfinish(session, exitstatus):
    _POOL.release()


@pytest.fixture
def server_pool() -> ServerPool:
    return _POOL


@pytest.fixture
def server(server_pool) -> Server:
    return server_pool.get("qwen3_next", SCRIPTED[0], env=SCRIPTED[1])


@pytest.fixture
def scripted_rules():
    """``write(rules)`` puts ``rules`` (``[{"when": str, "text": str}, ...]``, see
    ``scripted_output``) where the ``server`` fixture's server reads them and returns the path
    of its ``requests.jsonl`` (emptied); the rules are removed after the test."""
    rules, seen = SCRIPT_DIR / "rules.json", SCRIPT_DIR / "requests.jsonl"

    def write(value: list[dict]) -> Path:
        seen.unlink(missing_ok=True)
        rules.write_text(json.dumps(value))
        return seen

    yield write
    rules.unlink(missing_ok=True)
    seen.unlink(missing_ok=True)


@pytest.fixture
def moe_server(server_pool) -> Server:
    return server_pool.get("qwen3_moe")


@pytest.fixture
def small_ctx_server(server_pool) -> Server:
    return server_pool.get("qwen3_next", ["--context-length", str(SMALL_CONTEXT)])
