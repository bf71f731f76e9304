"""Patch 0018: DeepSeek's MLA takes the absorbed forward on ``torch_native`` for every batch.

Without the handler, upstream's registry fell back to Triton's, which picks the MHA forward
for a prefill without a cached prefix; ``torch_native`` attends over the latent KV pool, so
that prefill was wrong (``test/e2e/test_expert_cache_fp8.py`` checks the served logprobs
against transformers).
"""

from types import SimpleNamespace


def _batch(extend: bool, prefix_lens):
    mode = SimpleNamespace(
        is_extend_without_speculative=lambda: extend,
        is_decode=lambda: not extend,
        is_decode_or_idle=lambda: not extend,
    )
    return SimpleNamespace(forward_mode=mode, extend_prefix_lens_cpu=prefix_lens)


def test_torch_native_takes_the_absorbed_mla_forward():
    from sglang.srt.models.deepseek_common.attention_backend_handler import (
        AttentionBackendRegistry,
        _dispatch_mla_subtype,
    )
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import (
        AttnForwardMethod,
    )

    handler = AttentionBackendRegistry.get_handler("torch_native")
    assert handler is _dispatch_mla_subtype
    attn = SimpleNamespace()  # no fused AMX projection: the plain absorbed forward
    for batch in (_batch(True, [0]), _batch(True, [7]), _batch(False, None)):
        assert handler(attn, batch) == AttnForwardMethod.MLA
