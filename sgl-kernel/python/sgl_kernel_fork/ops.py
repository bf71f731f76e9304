"""Documented Python entry points of the ``torch.ops.sgl_kernel`` CPU operators.

Upstream sglang calls most of these ops directly as ``torch.ops.sgl_kernel.X``;
the functions here call the same ops and carry their contracts (shapes, dtypes,
in-place effects and where each formula comes from). Paths such as
``kernels/ops/...`` or ``srt/...`` are relative to the upstream ``sglang``
package (0.5.23) whose GPU kernels define the semantics.

Dtypes: activations, states and gates may be float32 or bfloat16 unless noted;
all arithmetic is float32 and results are rounded once (round-to-nearest-even
for bfloat16).
"""

from typing import Optional, Tuple

import torch

_ops = torch.ops.sgl_kernel


def fused_gdn_gating(
    A_log: torch.Tensor, a: torch.Tensor, b: torch.Tensor, dt_bias: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Gated DeltaNet gates for prefill: ``torch.ops.sgl_kernel.fused_gdn_gating_cpu``.

    Args:
        A_log: ``[H]`` log decay rate (any float dtype).
        a: ``[batch, H]`` decay input (rows may be strided).
        b: ``[batch, H]`` beta input.
        dt_bias: ``[H]``.

    Returns:
        ``g``: ``[1, batch, H]`` float32, ``g = -exp(A_log) * softplus(a + dt_bias)``
        (softplus with beta 1, threshold 20); ``beta``: ``[1, batch, H]`` in ``b``'s
        dtype, ``beta = sigmoid(b)``.

    Source: ``kernels/ops/attention/linear/fused_gdn_gating.py`` (Triton) and
    the gating lines of transformers' ``Qwen3NextGatedDeltaNet.forward``. Like
    upstream's CPU op, ``beta`` keeps ``b``'s dtype (the Triton op returns float32).
    """
    return _ops.fused_gdn_gating_cpu(A_log, a, b, dt_bias)


def chunk_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: Optional[torch.Tensor],
    output_final_state: bool,
    cu_seqlens: Optional[torch.Tensor],
    head_first: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    initial_state_indices: Optional[torch.Tensor] = None,
    eps: float = 1e-6,
    output_chunk_states: bool = False,
    scale: Optional[float] = None,
    inplace_update: bool = True,
    state_emit_indices: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Chunked gated delta rule (prefill): ``torch.ops.sgl_kernel.chunk_gated_delta_rule_cpu``.

    Per value head, with state ``S`` of shape ``[K, V]`` (stored transposed):
    ``S <- exp(g_t) S``; ``u_t = beta_t (v_t - S^T k_t)``; ``S <- S + k_t u_t^T``;
    ``o_t = S^T (scale q_t)``, q and k L2-normalised first (``x / sqrt(sum x^2 +
    eps)``) when ``use_qk_l2norm_in_kernel``. Evaluated 64 tokens at a time in the
    UT-transform ("WY") form of FLA. Sources: Gated Delta Networks
    (arXiv:2412.06464); ``kernels/ops/attention/fla/chunk.py`` and
    ``chunk_delta_h.py``; transformers' ``torch_chunk_gated_delta_rule``.

    Args:
        query, key: ``[B, T, H, K]``; value: ``[B, T, HV, V]`` (HV a multiple of H;
            value head ``i`` reads key head ``i // (HV // H)``). Same dtype. Token
            and head strides are free, the last dim must be contiguous (else copied).
        g: ``[B, T, HV]`` log-space decay (<= 0), float32 or bfloat16.
        beta: ``[B, T, HV]``.
        initial_state: state pool ``[num_slots, HV, V, K]`` (contiguous inside a
            slot, any slot stride), float32 or bfloat16, or None (zero states).
        output_final_state: also return the final states ``[N, HV, V, K]`` float32.
        cu_seqlens: ``[N + 1]`` varlen offsets (then ``B == 1``), or None: N = B
            sequences of length T.
        head_first: must be False.
        initial_state_indices: ``[N]`` slot of each sequence in ``initial_state``;
            a negative slot means "no state": start from zeros, write nothing.
            With indices the final states are written back into the pool in place
            (unless ``inplace_update=False``). Without indices ``initial_state`` is
            ``[N, HV, V, K]``, read only.
        eps: epsilon of the q/k L2 norm.
        output_chunk_states: also return ``h``, the state at the start of every
            64-token chunk, ``[B, NT, HV, V, K]`` in the input dtype, with
            ``NT = sum_i ceil(len_i / 64)`` (varlen) or ``ceil(T / 64)`` -- the
            ``h`` of upstream's Triton kernel, used for mamba prefix-cache tracking.
        scale: query scale, default ``K ** -0.5``.
        state_emit_indices: ``[NT]`` int (NT as for ``h``; ``B * ceil(T / 64)`` without
            ``cu_seqlens``), or None: for chunk ``c`` of a sequence, the pool slot of
            ``initial_state`` that receives the state after its first ``64 * c`` tokens
            (the ``h`` entry of that chunk, but in the pool's dtype, rounded once from fp32
            like the final write-back), -1 for none. The emitted state equals the final
            state of a pass over those tokens alone. Used for anchor checkpoints inside a
            prefill pass (``srt/mem_cache/anchor_checkpoints/emit.py``). Needs
            ``initial_state`` with ``initial_state_indices``.

    Raises:
        RuntimeError: an emit entry on chunk 0 of a sequence (its initial state), on a
            padding sequence, out of range, or naming a slot written twice (a sequence's
            own slot or another emitted state); a wrong number of entries.

    Returns:
        ``(o, final_state, h)``: ``o`` ``[B, T, HV, V]`` in the input dtype; empty
        tensors for the outputs not requested.
    """
    return _ops.chunk_gated_delta_rule_cpu(
        query,
        key,
        value,
        g,
        beta,
        initial_state,
        output_final_state,
        cu_seqlens,
        head_first,
        use_qk_l2norm_in_kernel,
        initial_state_indices,
        eps,
        output_chunk_states,
        scale,
        inplace_update,
        state_emit_indices,
    )


def fused_sigmoid_gating_delta_rule_update(
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    initial_state_source: torch.Tensor,
    initial_state_indices: torch.Tensor,
    cu_seqlens: Optional[torch.Tensor],
    use_qk_l2norm_in_kernel: bool,
    softplus_beta: float = 1.0,
    softplus_threshold: float = 20.0,
) -> torch.Tensor:
    """Decode: gating + recurrent gated delta rule, ``torch.ops.sgl_kernel.fused_sigmoid_gating_delta_rule_update_cpu``.

    For every token (in order within each sequence) and value head:
    ``g = -exp(A_log) * softplus(a + dt_bias)`` (``softplus_beta`` /
    ``softplus_threshold`` as ``torch.nn.functional.softplus``), ``beta =
    sigmoid(b)``, then the delta-rule step of :func:`chunk_gated_delta_rule` with
    ``scale = K ** -0.5`` and L2-norm eps 1e-6. Source:
    ``kernels/ops/attention/linear/fused_sigmoid_gating_recurrent.py``;
    transformers' ``torch_recurrent_gated_delta_rule``.

    Args:
        A_log, dt_bias: ``[HV]``.
        q, k: ``[B, T, H, K]``; v: ``[B, T, HV, V]``, same dtype (strided views OK).
        a, b: ``[B * T, HV]`` or ``[B, T, HV]``.
        initial_state_source: state pool ``[num_slots, HV, V, K]`` float32 or
            bfloat16, updated in place.
        initial_state_indices: ``[N]`` slots; negative = padding (zero state,
            not written back).
        cu_seqlens: ``[N + 1]`` (``B == 1``) or None (N = B sequences of T tokens).

    Returns:
        ``[B, T, HV, V]`` in q's dtype (the Triton op's layout).
    """
    return _ops.fused_sigmoid_gating_delta_rule_update_cpu(
        A_log,
        dt_bias,
        q,
        k,
        v,
        a,
        b,
        initial_state_source,
        initial_state_indices,
        cu_seqlens,
        use_qk_l2norm_in_kernel,
        softplus_beta,
        softplus_threshold,
    )


def causal_conv1d_fwd(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    conv_states: Optional[torch.Tensor],
    query_start_loc: Optional[torch.Tensor],
    cache_indices: Optional[torch.Tensor],
    has_initial_state: Optional[torch.Tensor],
    silu_activation: bool,
    pad_slot_id: int = -1,
) -> torch.Tensor:
    """Prefill causal conv1d: ``torch.ops.sgl_kernel.causal_conv1d_fwd_cpu``.

    ``out[c, t] = act(bias[c] + sum_{w<W} weight[c, w] * win[c, t + w])`` with
    ``win = prior ++ x_seq``, ``prior`` the ``W - 1`` columns of the sequence's
    conv state when ``has_initial_state`` (else zeros); afterwards the state
    holds the last ``W - 1`` columns of ``win``. ``act`` is SiLU or identity.
    Source: ``causal_conv1d_fn`` in ``kernels/ops/mamba/causal_conv1d_triton.py``.

    Args:
        x: ``(dim, total_tokens)`` (usually the transpose of a token-major tensor)
            with ``query_start_loc`` ``[N + 1]``, or ``(batch, dim, seqlen)``.
        weight: ``(dim, W)``; bias: ``(dim,)`` or None.
        conv_states: ``(num_slots, dim, >= W - 1)`` any strides, float32/bfloat16,
            updated in place; or None (no cache).
        cache_indices: ``[N]`` slot per sequence (default: the sequence index); an
            entry equal to ``pad_slot_id`` skips the sequence (output zeros).
        has_initial_state: ``[N]`` bool.

    Returns:
        x's shape and dtype, token-major memory (``out.transpose(-1, -2)`` is
        contiguous).
    """
    return _ops.causal_conv1d_fwd_cpu(
        x,
        weight,
        bias,
        conv_states,
        query_start_loc,
        cache_indices,
        has_initial_state,
        silu_activation,
        pad_slot_id,
    )


def causal_conv1d_update(
    x: torch.Tensor,
    conv_states: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    silu_activation: bool,
    cache_seqlens: Optional[torch.Tensor] = None,
    conv_state_indices: Optional[torch.Tensor] = None,
    pad_slot_id: int = -1,
) -> torch.Tensor:
    """Decode causal conv1d: ``torch.ops.sgl_kernel.causal_conv1d_update_cpu``.

    Same formula as :func:`causal_conv1d_fwd` with the state always used as
    prior, for ``x`` of shape ``(batch, dim)`` (one token) or ``(batch, dim,
    seqlen)``. ``conv_states``: ``(num_slots, dim, >= W - 1)``, any strides,
    updated in place (columns ``0 .. W-2``). ``cache_seqlens`` (circular buffer)
    is not supported. Source: ``causal_conv1d_update`` in
    ``kernels/ops/mamba/causal_conv1d_triton.py`` (non-speculative path).

    Returns:
        x's shape and dtype.
    """
    return _ops.causal_conv1d_update_cpu(
        x,
        conv_states,
        weight,
        bias,
        silu_activation,
        cache_seqlens,
        conv_state_indices,
        pad_slot_id,
    )


def fused_rmsnorm_gated(
    input: torch.Tensor, weight: Optional[torch.Tensor], gate: Optional[torch.Tensor], eps: float
) -> torch.Tensor:
    """Gated RMSNorm: ``torch.ops.sgl_kernel.fused_rmsnorm_gated_cpu``.

    ``y = x * rsqrt(mean(x^2, -1) + eps) * weight * silu(gate)`` (no gate factor
    when ``gate`` is None), in float32, rounded once to x's dtype.

    Args:
        input: ``[..., n]``; weight: ``[n]`` or None (no scaling, as
            ``FusedRMSNormGated(elementwise_affine=False)``); gate: input's
            shape or None.

    Source: ``kernels/ops/attention/fla/layernorm_gated.py`` (``is_rms_norm``,
    ``norm_before_gate``, swish) and transformers' ``Qwen3NextRMSNormGated``
    (which rounds ``x * rstd`` to the input dtype before the weight).
    """
    return _ops.fused_rmsnorm_gated_cpu(input, weight, gate, eps)


def fused_sigmoid_mul(x: torch.Tensor, gate: torch.Tensor) -> None:
    """In place ``x *= sigmoid(gate)``: ``torch.ops.sgl_kernel.fused_sigmoid_mul_cpu``.

    Args:
        x: ``[rows, hidden]`` (or any shape equal to gate's), last dim contiguous.
        gate: x's shape, or ``[rows, heads, head_dim]`` with ``heads * head_dim ==
            hidden`` (a strided view is fine).

    Source: ``fused_sigmoid_mul`` in ``kernels/ops/elementwise/elementwise.py``.
    """
    _ops.fused_sigmoid_mul_cpu(x, gate)


def fused_qk_gemma_rmsnorm(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    head_dim: int,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-head GemmaRMSNorm of q and k: ``torch.ops.sgl_kernel.fused_qk_gemma_rmsnorm_cpu``.

    ``y = x * rsqrt(mean(x^2) + eps) * (1 + w)`` over each head of ``head_dim`` values, in
    float32, rounded once to the input's dtype.

    Args:
        q: ``[T, nh * head_dim]`` float32 or bfloat16 (a column slice of the qkv projection
            is read in place; any shape whose last dimension holds whole heads); k likewise
            with ``nkv`` heads; q_weight, k_weight: ``[head_dim]``.

    Returns:
        ``(q_out [T * nh, head_dim], k_out [T * nkv, head_dim])``, contiguous.

    Raises:
        RuntimeError: a last dimension that is not whole heads, a weight of another size, a
        dtype other than float32 / bfloat16.

    Source: ``_fused_qk_gemma_rmsnorm_kernel`` in upstream's ``srt/models/utils.py``;
    transformers' ``Qwen3_5MoeRMSNorm``.
    """
    return _ops.fused_qk_gemma_rmsnorm_cpu(q, k, q_weight, k_weight, eps, head_dim)


def fused_qk_gemma_rmsnorm_with_gate(
    q_gate: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    head_dim: int,
    num_head: int,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`fused_qk_gemma_rmsnorm` for an output-gated attention (Qwen3.5, Qwen3-Next):
    ``torch.ops.sgl_kernel.fused_qk_gemma_rmsnorm_with_gate_cpu``.

    Args:
        q_gate: ``[T, num_head * 2 * head_dim]``, each head ``[q_h | gate_h]`` (a column slice
            of the qkv projection is read in place); k: ``[T, nkv * head_dim]``.

    Returns:
        ``(q_out [T * num_head, head_dim], k_out [T * nkv, head_dim], gate_out [T * num_head,
        head_dim])``: q and k normed, the gate copied; contiguous.

    Raises:
        RuntimeError: q_gate's width is not ``num_head * 2 * head_dim``, or as
        :func:`fused_qk_gemma_rmsnorm`.

    Source: ``_fused_qk_gemma_rmsnorm_gate_kernel`` in upstream's ``srt/models/utils.py``.
    """
    return _ops.fused_qk_gemma_rmsnorm_with_gate_cpu(
        q_gate, k, q_weight, k_weight, eps, head_dim, num_head
    )


def fused_qkvzba_split_reshape_cat_contiguous(
    mixed_qkvz: torch.Tensor,
    mixed_ba: torch.Tensor,
    num_heads_qk: int,
    num_heads_v: int,
    head_qk: int,
    head_v: int,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split of Qwen3.5's gated-DeltaNet input projections:
    ``torch.ops.sgl_kernel.fused_qkvzba_split_reshape_cat_contiguous_cpu``.

    Args:
        mixed_qkvz: ``[B, qkv_dim + nv * hv]`` laid out ``[all_q | all_k | all_v | all_z]``,
            where ``qkv_dim = 2 * num_heads_qk * head_qk + num_heads_v * head_v``;
            mixed_ba: ``[B, 2 * nv]`` laid out ``[all_b | all_a]``.

    Returns:
        New tensors (never views of the inputs): ``mixed_qkv [B, qkv_dim]``, ``z [B, nv, hv]``,
        ``b [B, nv]``, ``a [B, nv]``.

    Raises:
        RuntimeError: inputs narrower than these layouts, or ``num_heads_v`` not a multiple
        of ``num_heads_qk``.

    Source: ``fused_qkvzba_split_reshape_cat_contiguous`` in upstream's
    ``kernels/ops/attention/triton_gdn_fused_proj.py``.
    """
    return _ops.fused_qkvzba_split_reshape_cat_contiguous_cpu(
        mixed_qkvz, mixed_ba, num_heads_qk, num_heads_v, head_qk, head_v
    )


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Write newly allocated KV slots into ``req_to_token`` rows, in place.

    For request ``i`` (its tokens packed in request order in ``out_cache_loc``)::

        req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]] =
            out_cache_loc[sum_{j<i}(end_offset[j] - start_offset[j]) : ...]

    Args:
        req_pool_indices, start_offset, end_offset: ``[bs]`` integer tensors.
        req_to_token: ``[pool_size, pool_len]`` integer (int32 upstream).
        out_cache_loc: ``[sum of lengths]`` integer (int64 upstream).
        pool_len: ``req_to_token.shape[1]``.

    Source: the Triton ``assign_req_to_token_pool`` in ``srt/mem_cache/allocation.py``.
    """
    _ops.assign_req_to_token_pool_cpu(
        req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len
    )


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor,
    data_strides: torch.Tensor,
    tgt_loc: torch.Tensor,
    src_loc: torch.Tensor,
) -> None:
    """Copy KV rows ``src_loc[i] -> tgt_loc[i]`` inside every KV buffer.

    Args:
        data_ptrs: ``[n_buffers]`` uint64 (or int64) base addresses of slot-major
            KV buffers (all layers' K and V).
        data_strides: ``[n_buffers]`` bytes per slot row of each buffer.
        tgt_loc, src_loc: ``[num_locs]`` slot indices.

    All sources are read before any target is written (as upstream's tiled
    Triton kernel ``copy_all_layer_kv_cache_tiled`` in
    ``kernels/ops/kvcache/cache_move.py``), so overlapping moves are safe. The
    raw addresses are trusted.
    """
    _ops.copy_all_layer_kv_cache_cpu(data_ptrs, data_strides, tgt_loc, src_loc)


def murmur_hash32(
    seed: torch.Tensor, positions: torch.Tensor, col_indices: torch.Tensor
) -> torch.Tensor:
    """``torch.ops.sgl_kernel.murmur_hash32_cpu``: ``[n, m]`` uint32 hashes.

    ``out[r, c]`` = MurmurHash3_x86_32 (hash seed 0) of the 16-byte key
    ``(seed[r] low 32 bits, seed[r] high 32 bits, uint32(positions[r]),
    uint32(col_indices[c]))``. ``seed``: ``[n]`` uint64/int64; ``positions``:
    ``[n]``; ``col_indices``: ``[m]``. Source:
    ``kernels/ops/sampling/murmur_hash.py`` (used by seeded sampling in
    ``srt/layers/sampler.py``).
    """
    return _ops.murmur_hash32_cpu(seed, positions, col_indices)


def cpu_isa() -> str:
    """Name of the SIMD kernel level in use: ``"avx512bf16"``, ``"avx512"``, ``"avx2"`` or ``"scalar"``.

    ``avx512bf16`` (AVX-512 with AVX512_BF16) differs from ``avx512`` only in
    the CPU executor, whose bf16 dots then use ``vdpbf16ps``.
    """
    return _ops.cpu_isa()


def set_cpu_isa(name: str) -> str:
    """Switch the SIMD kernel level (``"auto"``, ``"avx512bf16"``, ``"avx512"``, ``"avx2"``, ``"scalar"``).

    Raises if the CPU lacks the requested ISA. Returns the name now in use.
    Meant for tests and diagnostics; the default (``auto``, capped by the
    ``SGLANG_CPU_KERNEL_ISA`` environment variable) is the fastest available.
    """
    return _ops.set_cpu_isa(name)


def extend_attention_supported(head_dim: int) -> bool:
    """Whether :func:`extend_attention` runs here: the selected kernel level (:func:`cpu_isa`,
    capped by ``SGLANG_CPU_KERNEL_ISA``) is ``"avx512bf16"`` (the ``vdpbf16ps`` path) or
    ``"avx512"`` / ``"avx2"`` (the AVX2 + FMA fp32 path), not ``"scalar"``, and ``head_dim``
    is 64, 128 or 256."""
    return _ops.extend_attention_cpu_supported(head_dim)


def extend_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    q_pos0: int,
    scale: float,
    causal: bool,
    kv_index: Optional[torch.Tensor] = None,
) -> None:
    """``torch.ops.sgl_kernel.extend_attention_cpu``: one request's extend attention, in place.

    Args:
        q: ``[rows, heads, dim]`` bfloat16, the new tokens' queries (head dim contiguous).
        k, v: ``[keys, kv_heads, dim]`` bfloat16, every key the rows can see, in position
            order (``heads`` a multiple of ``kv_heads``: query head h reads KV head
            ``h // (heads // kv_heads)``, as ``repeat_interleave``). With ``kv_index``: a KV
            pool ``[slots, kv_heads, dim]`` (any slot stride), read in place.
        out: ``[rows, heads, dim]`` bfloat16, written.
        q_pos0: position of row 0; with ``causal`` row i sees keys ``[0, q_pos0 + i]``
            (bottom-right alignment, ``q_pos0 + rows <= keys``), without it every key.
        scale: softmax scale (``1 / sqrt(dim)`` usually).
        kv_index: ``[keys]`` int32 / int64, key j's row of k / v (a request's
            ``req_to_token`` slots), or None (key j is row j). Slots outside ``k``'s rows raise.

    FlashAttention-2's online softmax (Dao, 2023), fp32 softmax and accumulation: at the
    ``avx512bf16`` level with ``vdpbf16ps`` dot products and P rounded to bf16 before P V, at
    ``avx512`` / ``avx2`` with AVX2 FMA fp32 products (bf16 operands widened in registers, P
    kept fp32). Raises ``RuntimeError`` for other dtypes, shapes or head dims, or at the
    ``scalar`` level (see :func:`extend_attention_supported`). Source: ``sgl-kernel/csrc/cpu/extend_attention.cpp``.
    """
    _ops.extend_attention_cpu(q, k, v, out, q_pos0, scale, causal, kv_index)


def dense_linear_max_rows() -> int:
    """The most rows (tokens) :func:`dense_linear` takes (16)."""
    return _ops.dense_linear_cpu_max_rows()


def dense_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """``torch.ops.sgl_kernel.dense_linear_cpu``: ``y = bf16(x @ weight.T + bias)`` for decode.

    Args:
        x: ``[M, K]`` bfloat16, ``M <= dense_linear_max_rows()``; unit stride along ``K``,
            any row stride.
        weight: ``[N, K]`` bfloat16 (``nn.Linear``'s layout); unit stride along ``K``, any row
            stride (a slice of a fused weight works in place).
        bias: ``[N]`` bfloat16 or float32, or None.

    Returns:
        ``[M, N]`` bfloat16, contiguous: each element one float32 dot of exact bf16 products
        (``vdpbf16ps`` with AVX-512 BF16, float32 FMA on the other levels), plus the bias in
        float32, rounded once to bfloat16 (nearest-even). Bit-identical for any
        ``expert_pool_set_threads`` count (for one :func:`cpu_isa` level).

    Runs on the CPU executor's pinned pool (``csrc/cpu/cpu_executor_pool.h``): the weight is
    streamed once for all ``M`` rows, so the op is bound by memory bandwidth, as a decode
    step's linears are. Raises ``RuntimeError`` (naming the argument) for other dtypes,
    devices, shapes, ``M`` above the limit, or a stride along ``K`` other than 1.
    Source: ``sgl-kernel/csrc/cpu/dense_linear.cpp``.
    """
    return _ops.dense_linear_cpu(x, weight, bias)
