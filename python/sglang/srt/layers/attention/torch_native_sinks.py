"""Attention with per-head sink logits (gpt-oss) for the torch_native backend.

gpt-oss (openai/gpt-oss-20b / -120b) adds to every head's softmax one learned logit ``sink[h]``
with no value: the probabilities of the real keys are

    p_j = exp(s_j) / (exp(sink[h]) + sum_k exp(s_k)),   s_j = scaling * q . k_j

(``eager_attention_forward`` of transformers' ``modeling_gpt_oss.py``: the sink column is
concatenated to the masked scores, softmaxed, and dropped). Its layers alternate full causal
attention with a sliding window (``config.sliding_window`` keys including the query's own;
SGLang's ``sliding_window_size`` is that minus one, so query ``i`` sees keys
``[i - sliding_window_size, i]``).

Upstream's torch_native backend ignores ``sinks`` (the model refuses the backend for that
reason). The functions here compute it directly: per request, float32 scores of the new rows
against the keys they can see (the cached prefix too, limited to the window), the sink column,
softmax, and the values. Query rows go in blocks so that no score matrix larger than
``SGLANG_TORCH_NATIVE_ATTN_BLOCK_ELEMS`` elements (default 2^26) is built at once. It is a plain
reference-speed path meant for the small models a CPU serves; layers without sinks keep the
backend's own paths, except Llama 4's chunked local attention layers (``chunk``: each query sees
the keys of its own ``attention_chunk_size`` chunk), which upstream's backend attended globally
(patch 0016).
"""

from __future__ import annotations

import os
from typing import Callable, Optional

import torch

DEFAULT_BLOCK_ELEMS = 1 << 26


def _block_elems() -> int:
    value = os.environ.get("SGLANG_TORCH_NATIVE_ATTN_BLOCK_ELEMS")
    return int(value) if value else DEFAULT_BLOCK_ELEMS


def swa_translate_for(kv_pool, layer_id: int) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
    """The full-pool -> SWA-pool index translation to apply before reading ``layer_id``'s keys
    from ``kv_pool``, or None when the layer's buffer is indexed by the full pool's locations.

    A hybrid SWA pool (``SWAKVPool``) keeps sliding-window layers in a smaller buffer whose
    locations ``translate_loc_from_full_to_swa`` maps ``req_to_token``'s entries to.
    """
    mapping = getattr(kv_pool, "layers_mapping", None)
    if mapping is None or layer_id not in mapping:
        return None
    _, is_swa = mapping[layer_id]
    return kv_pool.translate_loc_from_full_to_swa if is_swa else None


def attend_with_sinks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: Optional[torch.Tensor],
    *,
    q_pos0: int,
    k_pos0: int,
    window: Optional[int],
    scaling: float,
    causal: bool = True,
    chunk: Optional[int] = None,
) -> torch.Tensor:
    """Softmax attention of consecutive query rows with a sink logit per head, in float32.

    Shapes: q [rows, heads, qk_dim], k [n, kv_heads, qk_dim], v [n, kv_heads, v_dim], sinks
    [heads] (any float dtype; None: no sink) with heads a multiple of kv_heads (query head h
    reads KV head h // (heads // kv_heads), as ``repeat_interleave`` does). Query row r is at
    absolute position ``q_pos0 + r``, key j at ``k_pos0 + j``. With ``causal`` row r sees keys at
    positions <= its own and, with ``window`` (SGLang's sliding_window_size), >= its own minus
    ``window``; without it every key; with ``chunk`` (Llama 4's ``attention_chunk_size``) only
    keys of its own chunk, positions >= ``(pos // chunk) * chunk`` (transformers'
    ``chunked_causal_mask_function``). A row that sees no key returns zeros (all weight on the
    sink). Returns [rows, heads, v_dim] float32.

    Raises:
        ValueError: heads is not a multiple of kv_heads.
    """
    rows, heads, dim = q.shape
    n, kv_heads, _ = k.shape
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} KV heads")
    rep = heads // kv_heads
    qf = q.float().reshape(rows, kv_heads, rep, dim)
    scores = torch.einsum("rgpd,ngd->gprn", qf, k.float()) * scaling  # [kv, rep, rows, n]
    if causal:
        q_pos = torch.arange(q_pos0, q_pos0 + rows, device=q.device).unsqueeze(1)
        k_pos = torch.arange(k_pos0, k_pos0 + n, device=q.device).unsqueeze(0)
        allowed = k_pos <= q_pos
        if window is not None:
            allowed &= k_pos >= q_pos - window
        if chunk is not None:
            allowed &= k_pos >= (q_pos // chunk) * chunk
        scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        sink = sinks.float().reshape(kv_heads, rep, 1, 1).expand(kv_heads, rep, rows, 1)
    else:
        sink = scores.new_full((kv_heads, rep, rows, 1), float("-inf"))
    logits = torch.cat([scores, sink], dim=-1)
    probs = torch.softmax(logits, dim=-1)[..., :-1].nan_to_num(0.0)
    out = torch.einsum("gprn,ngd->rgpd", probs, v.float())
    return out.reshape(rows, heads, v.shape[-1])


def _gather(cache: torch.Tensor, locs: torch.Tensor, translate) -> torch.Tensor:
    if translate is not None:
        locs = translate(locs)
    return cache[locs.long()]


def extend_with_sinks(
    query: torch.Tensor,
    output: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    sinks: Optional[torch.Tensor],
    *,
    scaling: float,
    causal: bool = True,
    sliding_window_size: Optional[int] = None,
    translate_loc: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    block_elems: Optional[int] = None,
    chunk: Optional[int] = None,
) -> torch.Tensor:
    """Extend (prefill) attention with sinks, computing only the new rows.

    Shapes: query [num_tokens, heads, qk_dim], output [num_tokens, heads, v_dim], k_cache /
    v_cache [pool_size, kv_heads, dim] (the new tokens' K/V already written), sinks [heads].
    Request r's keys are ``req_to_token[req_pool_indices[r], :seq_lens[r]]`` (through
    ``translate_loc`` when the layer's buffer is a hybrid SWA pool's, see
    :func:`swa_translate_for`); its new rows are the last ``extend_seq_lens[r]`` positions.
    ``sliding_window_size`` None or < 0: full attention; ``chunk``: chunked local attention
    (:func:`attend_with_sinks`). Writes ``output`` (cast to its dtype) and returns it.
    """
    window = (
        sliding_window_size
        if sliding_window_size is not None and sliding_window_size > -1
        else None
    )
    budget = block_elems if block_elems is not None else _block_elems()
    heads = query.shape[1]
    start = 0
    for pool_idx, seq_len, q_len in zip(
        req_pool_indices.tolist(), seq_lens.tolist(), extend_seq_lens.tolist()
    ):
        if q_len == 0:
            continue
        q_pos0 = seq_len - q_len
        rows_per_block = max(1, budget // max(1, heads * seq_len))
        for a in range(0, q_len, rows_per_block):
            b = min(q_len, a + rows_per_block)
            # keys this block can see: [k_lo, k_hi)
            k_hi = q_pos0 + b if causal else seq_len
            k_lo = max(0, q_pos0 + a - window) if (causal and window is not None) else 0
            if causal and chunk is not None:
                k_lo = max(k_lo, (q_pos0 + a) // chunk * chunk)
            locs = req_to_token[pool_idx, k_lo:k_hi]
            k = _gather(k_cache, locs, translate_loc)
            v = _gather(v_cache, locs, translate_loc)
            o = attend_with_sinks(
                query[start + a : start + b],
                k,
                v,
                sinks,
                q_pos0=q_pos0 + a,
                k_pos0=k_lo,
                window=window,
                scaling=scaling,
                causal=causal,
                chunk=chunk if causal else None,
            )
            output[start + a : start + b] = o.to(output.dtype)
        start += q_len
    return output


def decode_with_sinks(
    query: torch.Tensor,
    output: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    sinks: Optional[torch.Tensor],
    *,
    scaling: float,
    sliding_window_size: Optional[int] = None,
    translate_loc: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    chunk: Optional[int] = None,
) -> torch.Tensor:
    """Decode attention with sinks: one query row per request, at position seq_lens[r] - 1.

    Shapes: query [batch, heads, qk_dim], output [batch, heads, v_dim], k_cache / v_cache
    [pool_size, kv_heads, dim] (the new token's K/V already written), sinks [heads]. Keys as in
    :func:`extend_with_sinks`. Writes ``output`` (cast to its dtype) and returns it.
    """
    window = (
        sliding_window_size
        if sliding_window_size is not None and sliding_window_size > -1
        else None
    )
    for i, (pool_idx, seq_len) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        pos = seq_len - 1
        k_lo = max(0, pos - window) if window is not None else 0
        if chunk is not None:
            k_lo = max(k_lo, pos // chunk * chunk)
        locs = req_to_token[pool_idx, k_lo:seq_len]
        o = attend_with_sinks(
            query[i : i + 1],
            _gather(k_cache, locs, translate_loc),
            _gather(v_cache, locs, translate_loc),
            sinks,
            q_pos0=pos,
            k_pos0=k_lo,
            window=window,
            scaling=scaling,
            chunk=chunk,
        )
        output[i : i + 1] = o.to(output.dtype)
    return output


def layer_chunk(backend, layer) -> Optional[int]:
    """The chunk of Llama 4's chunked local attention for ``layer`` on ``backend``, or None: the
    model's ``attention_chunk_size`` (``ModelRunner.attention_chunk_size``, which the backend
    keeps, patch 0016) on its RoPE layers (``RadixAttention.use_irope``); its NoPE layers attend
    globally."""
    size = getattr(backend, "attention_chunk_size", None)
    return size if size and getattr(layer, "use_irope", False) else None


def _layer_window(layer) -> Optional[int]:
    w = getattr(layer, "sliding_window_size", None)
    return w if w is not None and w > -1 else None


def _check_self_attention(layer, forward_batch) -> None:
    """Raise NotImplementedError for cross-attention or encoder offsets (no model with sinks
    has them)."""
    if layer.is_cross_attention or forward_batch.encoder_lens is not None:
        raise NotImplementedError(
            "attention sinks on torch_native support decoder self-attention only; "
            "use another attention backend for encoder-decoder models with sinks"
        )


def extend_for_layer(
    backend, q, o, layer, forward_batch, sinks: Optional[torch.Tensor], causal: bool, chunk=None
):
    """``TorchNativeAttnBackend.forward_extend`` for a layer with sinks (patch
    ``0011-gpt-oss-cpu``) or with chunked local attention (patch 0016, :func:`layer_chunk`):
    :func:`extend_with_sinks` on the backend's pools.

    q [tokens, heads, qk_dim], o [tokens, heads, v_dim] (written), sinks [heads] or None.

    Raises:
        NotImplementedError: cross-attention or encoder offsets (no model with sinks has them).
    """
    _check_self_attention(layer, forward_batch)
    pool = backend.token_to_kv_pool
    extend_with_sinks(
        q,
        o,
        pool.get_key_buffer(layer.layer_id),
        pool.get_value_buffer(layer.layer_id),
        backend.req_to_token_pool.req_to_token,
        forward_batch.req_pool_indices,
        forward_batch.seq_lens,
        forward_batch.extend_seq_lens,
        sinks,
        scaling=layer.scaling,
        causal=causal,
        sliding_window_size=_layer_window(layer) if causal else None,
        translate_loc=swa_translate_for(pool, layer.layer_id),
        chunk=chunk,
    )


def decode_for_layer(
    backend, q, o, layer, forward_batch, sinks: Optional[torch.Tensor], chunk=None
):
    """``TorchNativeAttnBackend.forward_decode`` for a layer with sinks (patch
    ``0011-gpt-oss-cpu``) or chunked local attention (patch 0016): :func:`decode_with_sinks` on
    the backend's pools.

    q [batch, heads, qk_dim], o [batch, heads, v_dim] (written), sinks [heads] or None.

    Raises:
        NotImplementedError: cross-attention or encoder offsets.
    """
    _check_self_attention(layer, forward_batch)
    pool = backend.token_to_kv_pool
    decode_with_sinks(
        q,
        o,
        pool.get_key_buffer(layer.layer_id),
        pool.get_value_buffer(layer.layer_id),
        backend.req_to_token_pool.req_to_token,
        forward_batch.req_pool_indices,
        forward_batch.seq_lens,
        sinks,
        scaling=layer.scaling,
        sliding_window_size=_layer_window(layer),
        translate_loc=swa_translate_for(pool, layer.layer_id),
        chunk=chunk,
    )
