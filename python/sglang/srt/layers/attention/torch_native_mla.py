"""DeepSeek's multi-head latent attention (MLA) on the ``torch_native`` backend (patch
``0018-deepseek-mla-torch-native``).

Upstream 0.5.23 has no attention handler for ``torch_native`` in
``models/deepseek_common/attention_backend_handler.py``: ``AttentionBackendRegistry.get_handler``
falls back to Triton's, which picks the MHA forward (``forward_normal``: k and v decompressed by
``kv_b_proj``, ``save_kv_cache=False``) for a prefill without a cached prefix. The MHA forward
needs a backend that attends over the k / v it is given; ``TorchNativeAttnBackend.forward_extend``
attends over the KV pool instead, which for MLA holds the compressed latent
``[kv_lora_rank + qk_rope_head_dim]`` per token. With the release's shapes (query head 192,
latent 576) that fails; when the dims happen to agree (a model with ``qk_nope_head_dim ==
kv_lora_rank`` and ``v_head_dim == kv_lora_rank``, as the tiny DeepSeek-V3 model had) every
prefill silently attended over the latent as if it were the decompressed keys and values: the
prompt's logprobs were ~2.9 nats off transformers' (float32, mean) and every KV entry past
layer 0 was wrong.

Here ``torch_native`` always takes the absorbed MLA forward (``forward_absorb``: the query
multiplied into the latent space by ``w_kc``, attention over the latent pool, the output
multiplied out by ``w_vc``), which is the same attention (DeepSeek-V2 paper, §2.1.2, "weight
absorption") and is what upstream's own decode already ran on this backend.
"""

from __future__ import annotations


def handle_attention_torch_native(attn, forward_batch):
    """The DeepSeek attention forward method for the ``torch_native`` backend: the absorbed
    MLA forward for prefill and decode (``AttnForwardMethod.MLA``, or upstream's AMX fused
    variant where ``_dispatch_mla_subtype`` picks it).

    Args:
        attn: a ``DeepseekV2AttentionMLA``.
        forward_batch: the batch (unused: the choice does not depend on it).

    Returns:
        An ``AttnForwardMethod``.
    """
    from sglang.srt.models.deepseek_common.attention_backend_handler import (
        _dispatch_mla_subtype,
    )

    return _dispatch_mla_subtype(attn, forward_batch)
