"""Fixtures for the anchor-checkpoint unit tests (no server): the embedded tiny tokenizer."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))  # server.ensure_model


@pytest.fixture(scope="module")
def tok():
    from server import ensure_model
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ensure_model("qwen3_next"))
