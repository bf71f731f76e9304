"""Fixtures for the tiny-model tests.

``sglang.test.tiny_models`` lives in this repository (python/sglang/test/tiny_models) and is
linked into the installed sglang package by ``scripts/patch_queue.py apply``. When it is not
linked yet, the package is imported straight from the repository under the same name.

Captured agent traces (``test_traces.py``) are read from ``$TRACES_DIR``, by default
``../shared/traces`` resolved from the repository root (as ``test/e2e/test_replay.py`` and
``make bench-replay`` do). Missing traces are a FAILURE, on every machine, so that a moved or
unmounted folder cannot turn the trace tests into silent skips; set
``SGLANG_ALLOW_MISSING_TRACES=1`` to skip them instead (a clone without the shared folder).
"""

import importlib
import importlib.util
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PKG_DIR = REPO / "python" / "sglang" / "test" / "tiny_models"
TRACES = Path(os.environ.get("TRACES_DIR", REPO.parent / "shared" / "traces"))
ALLOW_MISSING_TRACES_ENV = "SGLANG_ALLOW_MISSING_TRACES"


def missing_traces(reason: str) -> None:
    """Fail with ``reason``; skip instead when ``SGLANG_ALLOW_MISSING_TRACES=1``."""
    if os.environ.get(ALLOW_MISSING_TRACES_ENV) == "1":
        pytest.skip(f"{reason} ({ALLOW_MISSING_TRACES_ENV}=1)")
    pytest.fail(f"{reason}: set TRACES_DIR, or {ALLOW_MISSING_TRACES_ENV}=1 to skip", pytrace=False)


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _import_tiny_models():
    try:
        mod = importlib.import_module("sglang.test.tiny_models")
        if Path(mod.__file__).resolve().parent == PKG_DIR.resolve():
            return mod
    except ImportError:
        pass
    # Not linked (or linked elsewhere): load this checkout's copy as sglang.test.tiny_models.
    for name in [n for n in sys.modules if n.startswith("sglang.test.tiny_models")]:
        del sys.modules[name]
    spec = importlib.util.spec_from_file_location(
        "sglang.test.tiny_models",
        PKG_DIR / "__init__.py",
        submodule_search_locations=[str(PKG_DIR)],
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules["sglang.test.tiny_models"] = mod
    spec.loader.exec_module(mod)
    return mod


tiny_models = _import_tiny_models()


@pytest.fixture(scope="session")
def tm():
    return tiny_models


@pytest.fixture(scope="session")
def next_dir(tmp_path_factory):
    return tiny_models.build("qwen3_next", tmp_path_factory.mktemp("m") / "qwen3_next")


@pytest.fixture(scope="session")
def moe_dir(tmp_path_factory):
    return tiny_models.build("qwen3_moe", tmp_path_factory.mktemp("m") / "qwen3_moe")


@pytest.fixture(scope="session")
def glm_dir(tmp_path_factory):
    return tiny_models.build("glm4_moe", tmp_path_factory.mktemp("m") / "glm4_moe")


@pytest.fixture(scope="session")
def hf_tokenizer(next_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(next_dir))


@pytest.fixture(scope="session")
def fp8_dir(tmp_path_factory):
    return tiny_models.build(
        "qwen3_moe", tmp_path_factory.mktemp("m") / "qwen3_moe_fp8", quant="fp8"
    )


@pytest.fixture(scope="session")
def qwen3_5_dir(tmp_path_factory):
    return tiny_models.build("qwen3_5_moe", tmp_path_factory.mktemp("m") / "qwen3_5_moe")


@pytest.fixture(scope="session")
def nvfp4_dir(tmp_path_factory):
    return tiny_models.build(
        "qwen3_moe", tmp_path_factory.mktemp("m") / "qwen3_moe_nvfp4", quant="nvfp4"
    )


@pytest.fixture(scope="session")
def gpt_oss_dir(tmp_path_factory):
    return tiny_models.build("gpt_oss", tmp_path_factory.mktemp("m") / "gpt_oss")
