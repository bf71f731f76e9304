"""Extend (prefill) attention for the torch_native backend that only computes
the rows of the new tokens.

The original torch_native extend path padded every request's query up to the
full sequence length (cached prefix + new tokens), ran a square causal SDPA over
the whole sequence and then threw the prefix rows away.  That makes a chunk of
``n`` new tokens on top of a cached prefix of ``p`` tokens cost ``O((p + n)^2)``
instead of ``O(n * (p + n))`` -- minutes per layer stack for agent sessions with
150K+ cached tokens.

``sdpa_extend_new_rows`` has the same inputs and semantics as
``TorchNativeAttnBackend._run_sdpa_forward_extend`` but

* feeds SDPA only the new query rows, against all visible keys, using a
  bottom-right aligned causal mask (query ``i`` of the extend sees keys
  ``[0, prefix_len + i]``, further limited by the sliding window if any);
* processes the query rows of a request in blocks so that no matrix larger
  than ``SGLANG_TORCH_NATIVE_ATTN_BLOCK_ELEMS`` elements is built at once: the
  query_rows x keys mask when SDPA uses a fused (flash / efficient) kernel,
  heads x query_rows x keys scores when it falls back to the math kernel (e.g.
  qk_head_dim != v_head_dim); and slices the keys of every block to the range
  it can actually see (so masked-out work is at most a block's triangle);
* gathers from the KV cache only the keys a request can see (relevant for
  sliding-window layers);
* for causal layers without a window, builds no mask at all: the cached prefix, which
  every new row sees whole, and the new tokens' causal square are two flash calls whose
  results are merged exactly through their log-sum-exps (a masked call over prefix + new
  keys reads a rows x keys mask as well as doing the same arithmetic);
* where the kernel level is avx2 or better and q / k / v are bfloat16 with a head dim of 64,
  128 or 256, runs those layers (and non-causal ones without a window) in one call of our
  flash kernel instead (``sgl_kernel_fork.extend_attention``: GQA without repeating the KV
  heads, the causal diagonal masked in place; ``benchmark/attention/bench_torch_native_extend.py``
  times it against the two ATen calls).
"""

from __future__ import annotations

import math
import os
from typing import Optional

import torch
from torch.nn.functional import scaled_dot_product_attention

try:  # our CPU operator package (always built in this tree; absent on a bare CUDA install)
    import sgl_kernel_fork as _fork_ops
except ImportError:  # pragma: no cover - exercised only without the package
    _fork_ops = None

# Off switch of our flash kernel (extend and decode): ``SGLANG_CPU_EXTEND_ATTENTION=0`` in the
# server's environment keeps ATen's SDPA paths (for comparisons; read once, at import).
KERNEL_OFF_ENV = "SGLANG_CPU_EXTEND_ATTENTION"
_KERNEL_ON = os.environ.get(KERNEL_OFF_ENV) != "0"

# Upper bound on the elements of the largest matrix one SDPA call builds: the
# query_rows x keys mask for fused kernels (CPU flash keeps scores in tiles),
# heads x query_rows x keys scores for the math fallback.
DEFAULT_BLOCK_ELEMS = 1 << 26


def _block_elems() -> int:
    value = os.environ.get("SGLANG_TORCH_NATIVE_ATTN_BLOCK_ELEMS")
    return int(value) if value else DEFAULT_BLOCK_ELEMS


def sdpa_materializes_scores(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, enable_gqa: bool
) -> bool:
    """Whether SDPA would pick the math kernel (which builds the full
    heads x rows x keys score matrix) for a masked call on these inputs.
    q / k / v are [heads, len, dim]."""
    try:
        mask = torch.ones((1, 1), dtype=torch.bool, device=q.device)
        choice = torch._fused_sdp_choice(
            q[:, :1].unsqueeze(0),
            k[:, :1].unsqueeze(0),
            v[:, :1].unsqueeze(0),
            mask.expand(1, 1),
            0.0,
            False,
            enable_gqa=enable_gqa,
        )
        # SDPBackend: ERROR = -1, MATH = 0, fused kernels > 0.
        return choice <= int(torch.nn.attention.SDPBackend.MATH)
    except Exception:
        return True


def query_block_rows(num_heads: int, kv_len: int, window: Optional[int], budget: int) -> int:
    """Rows per query block so that num_heads * rows * visible_keys <= budget
    (pass num_heads=1 when only the rows x keys mask gets materialized).

    A block of ``r`` rows sees at most ``kv_len`` keys, and with a sliding
    window ``w`` at most ``r + w`` keys; either bound being within budget is
    enough.
    """
    per_head = budget // max(1, num_heads)
    rows = per_head // max(1, kv_len)
    if window is not None:
        rows_w = int((-window + math.sqrt(window * window + 4 * per_head)) // 2)
        rows = max(rows, rows_w)
    return max(1, rows)


def _causal_block(
    q_blk: torch.Tensor,
    k_req: torch.Tensor,
    v_req: torch.Tensor,
    *,
    q_pos_start: int,
    k_base: int,
    window: Optional[int],
    scaling,
    enable_gqa: bool,
) -> torch.Tensor:
    """Causal attention of query rows at absolute positions
    [q_pos_start, q_pos_start + rows) over the gathered keys of the request.

    k_req / v_req hold the keys at absolute positions [k_base, k_base + n),
    laid out as [kv_heads, n, head_dim].
    """
    rows = q_blk.shape[1]
    q_pos_end = q_pos_start + rows  # exclusive; last row sees key q_pos_end - 1
    k_lo = 0 if window is None else max(0, q_pos_start - window)
    k_lo = max(k_lo, k_base)
    k_hi = q_pos_end
    k_blk = k_req[:, k_lo - k_base : k_hi - k_base]
    v_blk = v_req[:, k_lo - k_base : k_hi - k_base]

    attn_mask = None
    is_causal = False
    if rows == 1:
        # One row: every key in [k_lo, k_hi) is visible (window already applied).
        pass
    elif window is None and k_lo == q_pos_start:
        # Square diagonal block: top-left causal == bottom-right causal.
        is_causal = True
    else:
        device = q_blk.device
        q_pos = torch.arange(q_pos_start, q_pos_end, device=device).unsqueeze(1)
        k_pos = torch.arange(k_lo, k_hi, device=device).unsqueeze(0)
        attn_mask = k_pos <= q_pos
        if window is not None:
            attn_mask &= k_pos >= q_pos - window

    return scaled_dot_product_attention(
        q_blk.unsqueeze(0),
        k_blk.unsqueeze(0),
        v_blk.unsqueeze(0),
        attn_mask=attn_mask,
        is_causal=is_causal,
        scale=scaling,
        enable_gqa=enable_gqa,
    ).squeeze(0)


_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def flash_supported(q: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether ``flash_with_lse`` runs on these inputs: a CPU tensor of a float dtype the CPU
    flash kernel takes, with qk_head_dim == v_head_dim (q / v [heads, len, dim])."""
    return (
        _FLASH_CPU is not None
        and q.device.type == "cpu"
        and q.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and q.shape[-1] == v.shape[-1]
    )


def flash_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, is_causal: bool, scale
) -> tuple[torch.Tensor, torch.Tensor]:
    """One call of torch's CPU flash-attention kernel, which also returns the log-sum-exp.

    Shapes: q [heads, rows, dim], k / v [heads, keys, dim] (the same number of heads: repeat
    the KV heads for GQA first). Returns ``(out [heads, rows, dim] in q's dtype,
    lse [heads, rows] float32)``, lse being log(sum_j exp(scale * q.k_j)) per row. With
    ``is_causal`` row i sees keys [0, i] (top-left alignment, i.e. rows == keys for a
    square diagonal block). Source: ``aten::_scaled_dot_product_flash_attention_for_cpu``.
    """
    out, lse = _FLASH_CPU(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), 0.0, is_causal, scale=scale
    )
    return out[0], lse[0]


def merge_partials(
    o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor
) -> torch.Tensor:
    """Exact softmax attention over two disjoint key sets from each set's partial result.

    o1 / o2 [heads, rows, dim], lse1 / lse2 [heads, rows] (float32, both finite). Returns
    float32 ``(o1 * e^lse1 + o2 * e^lse2) / (e^lse1 + e^lse2)``, written with the weight
    ``sigmoid(lse1 - lse2)`` so that no exponential overflows (the merge step of
    FlashAttention's split-KV / flash-decoding).
    """
    w1 = torch.sigmoid((lse1 - lse2).float()).unsqueeze(-1)
    return torch.lerp(o2.float(), o1.float(), w1)


def _causal_with_prefix(
    q_req: torch.Tensor, k_req: torch.Tensor, v_req: torch.Tensor, q_pos0: int, scaling
) -> torch.Tensor:
    """Causal attention of the request's new rows without a mask.

    q_req [heads, rows, dim]; k_req / v_req [kv_heads, q_pos0 + rows, dim], the new rows being
    at positions [q_pos0, q_pos0 + rows). The keys split into the cached prefix [0, q_pos0),
    which every new row sees whole (no mask), and the new tokens, a square causal block; the
    two flash calls are merged exactly through their log-sum-exps. A masked call over
    prefix + new keys would read a rows x keys mask and do the same arithmetic.
    Returns [heads, rows, dim] in q's dtype.
    """
    rep = q_req.shape[0] // k_req.shape[0]
    if rep > 1:
        k_req = k_req.repeat_interleave(rep, 0)
        v_req = v_req.repeat_interleave(rep, 0)
    o_new, lse_new = flash_with_lse(
        q_req, k_req[:, q_pos0:], v_req[:, q_pos0:], is_causal=True, scale=scaling
    )
    if q_pos0 == 0:
        return o_new
    o_pre, lse_pre = flash_with_lse(
        q_req, k_req[:, :q_pos0], v_req[:, :q_pos0], is_causal=False, scale=scaling
    )
    return merge_partials(o_pre, lse_pre, o_new, lse_new).to(q_req.dtype)


def extend_kernel_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether our CPU flash kernel (``sgl_kernel_fork.extend_attention``) takes these inputs:
    CPU bfloat16 q / k / v with one head dim (64, 128 or 256) for all three, at a selected
    kernel level of avx2 or better (``sgl_kernel_fork.extend_attention_supported``), and not
    switched off (:data:`KERNEL_OFF_ENV`). Shapes: [..., dim]."""
    return (
        _KERNEL_ON
        and _fork_ops is not None
        and q.device.type == "cpu"
        and q.dtype == k.dtype == v.dtype == torch.bfloat16
        and q.shape[-1] == k.shape[-1] == v.shape[-1]
        and _fork_ops.extend_attention_supported(q.shape[-1])
    )


def sdpa_extend_new_rows(
    query: torch.Tensor,
    output: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_prefix_lens: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    encoder_lens: Optional[torch.Tensor] = None,
    scaling=None,
    enable_gqa: bool = False,
    causal: bool = False,
    is_cross_attn: bool = False,
    sliding_window_size: Optional[int] = None,
    block_elems: Optional[int] = None,
    mask_free: bool = True,
    use_kernel: Optional[bool] = None,
) -> torch.Tensor:
    """Extend attention computing only the new (extend) rows.

    Shapes: query [num_tokens, num_heads, qk_dim], output
    [num_tokens, num_heads, v_dim], k_cache / v_cache [pool_size, kv_heads, dim].
    Keys of request r are req_to_token[req_pool_indices[r], kv_start:kv_end]
    (kv range shifted / replaced by encoder_lens exactly as upstream does).
    For causal self-attention the new rows are the last extend_seq_lens[r]
    positions of the seq_lens[r] keys.

    Causal layers without a sliding window whose head dims agree (and a CPU tensor) take the
    mask-free path (``mask_free``, default): the cached prefix and the new tokens' causal
    square as two flash calls merged exactly (``merge_partials``); the rest, and
    ``mask_free=False``, run query blocks with a bottom-right causal mask under the
    ``block_elems`` budget (default ``SGLANG_TORCH_NATIVE_ATTN_BLOCK_ELEMS``).

    Layers without a window whose inputs :func:`extend_kernel_supported` accepts run in our
    flash kernel instead when ``use_kernel`` is None (the default) or True; False keeps the
    ATen paths (tests and benchmarks compare the two). Writes ``output`` and returns it.
    """
    num_seqs = seq_lens.shape[0]
    assert extend_prefix_lens.shape[0] == num_seqs
    assert extend_seq_lens.shape[0] == num_seqs

    window = (
        sliding_window_size
        if causal and sliding_window_size is not None and sliding_window_size > -1
        else None
    )
    budget = block_elems if block_elems is not None else _block_elems()
    num_heads = query.shape[1]

    seq_lens_l = seq_lens.tolist()
    ext_lens_l = extend_seq_lens.tolist()
    pool_idx_l = req_pool_indices.tolist()
    enc_lens_l = encoder_lens.tolist() if encoder_lens is not None else None

    # [num_tokens, num_heads, dim] -> [num_heads, num_tokens, dim]
    query_t = query.movedim(0, 1)

    start_q = 0
    for i in range(num_seqs):
        q_len = int(ext_lens_l[i])
        seq_len = int(seq_lens_l[i])
        if enc_lens_l is None:
            kv_start, kv_len = 0, seq_len
        elif is_cross_attn:
            kv_start, kv_len = 0, int(enc_lens_l[i])
        else:
            kv_start, kv_len = int(enc_lens_l[i]), seq_len
        end_q = start_q + q_len
        if q_len == 0:
            continue
        if causal:
            # Bottom-right alignment: the new rows are the last q_len positions.
            q_pos0 = kv_len - q_len
            assert q_pos0 >= 0, (q_len, kv_len)
            k_base = 0 if window is None else max(0, q_pos0 - window)
        else:
            q_pos0 = 0
            k_base = 0

        tokens = req_to_token[pool_idx_l[i], kv_start + k_base : kv_start + kv_len]
        if window is None and use_kernel is not False:
            k_rows, v_rows, q_rows = k_cache[tokens], v_cache[tokens], query[start_q:end_q]
            if extend_kernel_supported(q_rows, k_rows, v_rows):
                out_rows = output[start_q:end_q]
                scale = scaling if scaling is not None else 1.0 / math.sqrt(q_rows.shape[-1])
                if out_rows.dtype == torch.bfloat16 and out_rows.stride(-1) == 1:
                    _fork_ops.extend_attention(
                        q_rows, k_rows, v_rows, out_rows, q_pos0, scale, causal
                    )
                else:
                    tmp = torch.empty_like(q_rows)
                    _fork_ops.extend_attention(q_rows, k_rows, v_rows, tmp, q_pos0, scale, causal)
                    out_rows.copy_(tmp)
                start_q = end_q
                continue
        k_req = k_cache[tokens].movedim(0, 1)
        v_req = v_cache[tokens].movedim(0, 1)
        q_req = query_t[:, start_q:end_q]
        if not (q_req.dtype == k_req.dtype == v_req.dtype):
            # SDPA needs query, key and value in the same dtype.
            k_req = k_req.to(q_req.dtype)
            v_req = v_req.to(q_req.dtype)

        fused = not sdpa_materializes_scores(q_req, k_req, v_req, enable_gqa)
        if mask_free and causal and window is None and fused and flash_supported(q_req, v_req):
            o_req = _causal_with_prefix(q_req, k_req, v_req, q_pos0, scaling)
            output[start_q:end_q] = o_req.movedim(0, 1)
            start_q = end_q
            continue
        heads = 1 if fused else num_heads
        rows = query_block_rows(heads, kv_len - k_base, window, budget)
        for a in range(0, q_len, rows):
            b = min(q_len, a + rows)
            q_blk = q_req[:, a:b]
            if causal:
                o_blk = _causal_block(
                    q_blk,
                    k_req,
                    v_req,
                    q_pos_start=q_pos0 + a,
                    k_base=k_base,
                    window=window,
                    scaling=scaling,
                    enable_gqa=enable_gqa,
                )
            else:
                o_blk = scaled_dot_product_attention(
                    q_blk.unsqueeze(0),
                    k_req.unsqueeze(0),
                    v_req.unsqueeze(0),
                    scale=scaling,
                    enable_gqa=enable_gqa,
                ).squeeze(0)
            output[start_q + a : start_q + b] = o_blk.movedim(0, 1)
        start_q = end_q
    return output
