"""The default mamba radix-cache strategy with anchor checkpoints (patch 0044): where upstream's
``auto`` would pick ``extra_buffer`` only to keep the overlap scheduler (every CUDA machine), it
picks ``no_buffer``, the one strategy that stores states at arbitrary positions, so anchors are
on by default on a GPU too. Paging, speculative decoding, ``--disable-anchor-checkpoints``,
whatever turns anchors off anyway, trtllm_mha and Blackwell keep upstream's choice. Runs upstream's resolution hook on a stand-in view of the server args
with the embedded hybrid model's config, the linear-attention backend that supports the extra
buffer (``triton``), and the overlap scheduler wanted, as on a GPU."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import sglang.srt.arg_groups.overrides as overrides

GPU_DEFAULTS = dict(
    mamba_radix_cache_strategy="auto",
    disable_overlap_schedule=False,
    page_size=None,
    disable_anchor_checkpoints=False,
    speculative_algorithm=None,
    disable_radix_cache=False,
    linear_attn_backend="triton",
    enable_hierarchical_cache=False,
    chunked_prefill_size=None,
    skip_tokenizer_init=False,
    disaggregation_mode="null",
    enable_linear_replayssm=False,
    attention_backend=None,
)


@pytest.fixture(scope="module")
def hf_config():
    from server import ensure_model
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(ensure_model("qwen3_next"))


def resolve(monkeypatch, hf_config, **changes) -> dict:
    monkeypatch.setattr(
        overrides, "model_config_of", lambda view: SimpleNamespace(hf_config=hf_config)
    )
    hook = overrides._mamba_radix_cache_resolution
    hook = getattr(hook, "__wrapped__", hook)
    return hook(SimpleNamespace(**{**GPU_DEFAULTS, **changes}))


def test_anchors_on_pick_no_buffer(monkeypatch, hf_config):
    got = resolve(monkeypatch, hf_config)
    assert got["mamba_radix_cache_strategy"] == "no_buffer"
    assert got["disable_overlap_schedule"] is True  # no_buffer requires it (upstream asserts)


@pytest.mark.parametrize(
    "changes",
    [
        {"disable_anchor_checkpoints": True},  # the upstream baseline
        {"page_size": 16},  # no_buffer supports page size 1 only
        {"speculative_algorithm": "EAGLE"},
        # Anchors would be off anyway: keep the overlap scheduler.
        {"enable_hierarchical_cache": True},
        {"chunked_prefill_size": -1},
        {"skip_tokenizer_init": True},
        {"disaggregation_mode": "decode"},
        {"enable_linear_replayssm": True},
        {"attention_backend": "trtllm_mha"},  # needs pages of 64
    ],
)
def test_upstream_choice_kept(monkeypatch, hf_config, changes):
    assert (
        resolve(monkeypatch, hf_config, **changes)["mamba_radix_cache_strategy"] == "extra_buffer"
    )


def test_blackwell_keeps_upstream_choice(monkeypatch, hf_config):
    """On SM100 the model's default attention backend (trtllm_mha) needs pages of 64, chosen
    after this hook runs; no_buffer would fail its validation there."""
    import sglang.srt.runtime_context as runtime_context

    sm100 = SimpleNamespace(is_sm100=True, is_xpu=False)
    monkeypatch.setattr(runtime_context, "get_platform", lambda: sm100)  # read by the predicate
    monkeypatch.setattr(overrides, "get_platform", lambda: sm100)
    assert resolve(monkeypatch, hf_config)["mamba_radix_cache_strategy"] == "extra_buffer"


def test_chunked_prefill_size_set(monkeypatch, hf_config):
    assert (
        resolve(monkeypatch, hf_config, chunked_prefill_size=8192)["mamba_radix_cache_strategy"]
        == "no_buffer"
    )


def test_explicit_strategy_untouched(monkeypatch, hf_config):
    got = resolve(monkeypatch, hf_config, mamba_radix_cache_strategy="extra_buffer")
    assert "mamba_radix_cache_strategy" not in got  # an explicit choice is not resolved again
