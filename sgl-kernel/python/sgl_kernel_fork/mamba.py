"""Mamba / Gated DeltaNet entry points imported by upstream sglang on CPU.

Callers (upstream sglang 0.5.23, paths relative to the ``sglang`` package):

* ``srt/layers/attention/linear/gdn_backend.py``: ``causal_conv1d_fn_cpu``
  (prefill conv, keyword arguments after the first three) and
  ``causal_conv1d_update_cpu`` (decode conv, ``conv_state_indices=`` keyword);
* ``srt/layers/attention/linear/kda_backend.py``: ``causal_conv1d_update_cpu``
  with a transposed conv-state view;
* ``srt/layers/attention/linear/kernels/gdn_triton.py``:
  ``chunk_gated_delta_rule_cpu`` (all keyword arguments), result unpacked as
  ``(core_attn_out, last_recurrent_state, h)``.

The signatures accept both the argument order of upstream's CPU wrappers and
the keyword names of the Triton functions they replace
(``kernels/ops/mamba/causal_conv1d_triton.py``,
``kernels/ops/attention/fla/chunk.py``).
"""

from typing import Optional, Union

import torch

from . import ops

PAD_SLOT_ID = -1

_SPEC_MSG = (
    "speculative decoding on CPU needs upstream's sgl-kernel CPU build, which "
    "this fork does not provide"
)


def _is_silu(activation: Union[str, bool, None]) -> bool:
    if isinstance(activation, bool):
        return activation
    if activation is None:
        return False
    if activation in ("silu", "swish"):
        return True
    raise ValueError(f"unsupported activation {activation!r} (None, 'silu' or 'swish')")


def causal_conv1d_fn_cpu(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    activation: Union[str, bool, None] = "silu",
    conv_states: Optional[torch.Tensor] = None,
    has_initial_state: Optional[torch.Tensor] = None,
    cache_indices: Optional[torch.Tensor] = None,
    query_start_loc: Optional[torch.Tensor] = None,
    seq_lens_cpu=None,
    pad_slot_id: int = PAD_SLOT_ID,
    **kwargs,
) -> torch.Tensor:
    """Varlen causal depthwise conv1d for prefill, updating the conv-state cache.

    Args:
        x: ``(dim, total_tokens)``: the sequences concatenated along tokens,
            normally ``mixed_qkv.transpose(0, 1)`` of a ``(tokens, dim)`` tensor;
            float32 or bfloat16.
        weight: ``(dim, W)`` depthwise kernel; bias: ``(dim,)`` or None.
        activation: ``"silu"``/``"swish"``/True for SiLU, None/False for none.
        conv_states: ``(num_slots, dim, >= W - 1)`` conv-state cache (any
            strides), updated in place: each sequence's slot ends up holding its
            last ``W - 1`` inputs (with earlier state columns shifted in when the
            sequence is shorter than ``W - 1``).
        has_initial_state: ``(N,)`` bool: start from the slot's state (else zeros).
        cache_indices: ``(N,)`` slot per sequence; ``pad_slot_id`` skips one.
        query_start_loc: ``(N + 1,)`` token offsets of the sequences.
        seq_lens_cpu: ignored (lengths come from ``query_start_loc``).
        kwargs: ``block_table`` / ``validate_data`` of the Triton version are
            accepted and ignored (they only shape the GPU launch).

    Returns:
        ``(dim, total_tokens)``, x's dtype, token-major memory, so
        ``out.transpose(0, 1)`` is a contiguous ``(tokens, dim)`` tensor.

    Formula: ``out[c, t] = act(bias[c] + sum_w weight[c, w] * win[c, t + w])``,
    ``win = state_or_zeros ++ x``; source ``causal_conv1d_fn`` in
    ``kernels/ops/mamba/causal_conv1d_triton.py``.
    """
    del seq_lens_cpu, kwargs
    return ops.causal_conv1d_fwd(
        x,
        weight,
        bias,
        conv_states,
        query_start_loc,
        cache_indices,
        has_initial_state,
        _is_silu(activation),
        pad_slot_id,
    )


def causal_conv1d_update_cpu(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    activation: Union[str, bool, None] = None,
    conv_state_indices: Optional[torch.Tensor] = None,
    intermediate_conv_window: Optional[torch.Tensor] = None,
    intermediate_state_indices: Optional[torch.Tensor] = None,
    retrieve_next_token: Optional[torch.Tensor] = None,
    retrieve_next_sibling: Optional[torch.Tensor] = None,
    retrieve_parent_token: Optional[torch.Tensor] = None,
    cache_seqlens: Optional[torch.Tensor] = None,
    num_accept_tokens: Optional[torch.Tensor] = None,
    pad_slot_id: int = PAD_SLOT_ID,
    **kwargs,
) -> torch.Tensor:
    """Causal conv1d decode step(s) against the conv-state cache.

    Args:
        x: ``(batch, dim)`` (one new token per sequence) or ``(batch, dim,
            seqlen)``; float32 or bfloat16.
        conv_state: ``(num_slots, dim, >= W - 1)``, any strides (KDA passes a
            transposed view), updated in place.
        weight: ``(dim, W)``; bias: ``(dim,)`` or None; activation as in
            :func:`causal_conv1d_fn_cpu`.
        conv_state_indices: ``(batch,)`` slot per sequence (default: batch
            index); ``pad_slot_id`` skips an entry (its output is zero).

    Returns:
        x's shape and dtype.

    The speculative-decoding arguments (``intermediate_conv_window``,
    ``retrieve_*``, ``num_accept_tokens``) and the circular ``cache_seqlens``
    raise RuntimeError. Source: ``causal_conv1d_update`` in
    ``kernels/ops/mamba/causal_conv1d_triton.py``.
    """
    del intermediate_state_indices, kwargs
    if (
        intermediate_conv_window is not None
        or num_accept_tokens is not None
        or retrieve_next_token is not None
        or retrieve_next_sibling is not None
        or retrieve_parent_token is not None
    ):
        raise RuntimeError(f"causal_conv1d_update_cpu: {_SPEC_MSG}")
    if cache_seqlens is not None:
        raise RuntimeError(
            "causal_conv1d_update_cpu: cache_seqlens (circular conv state) is not supported"
        )
    return ops.causal_conv1d_update(
        x,
        conv_state,
        weight,
        bias,
        _is_silu(activation),
        None,
        conv_state_indices,
        pad_slot_id,
    )


def chunk_gated_delta_rule_cpu(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
    head_first: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    initial_state_indices: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    output_final_state: bool = False,
    inplace_update: bool = True,
    output_chunk_states: bool = True,
    state_emit_indices: Optional[torch.Tensor] = None,
    **kwargs,
):
    """Chunked gated delta rule for prefill (the CPU ``chunk_gated_delta_rule``).

    Args:
        q, k: ``[1, T, H, K]`` (varlen, with ``cu_seqlens``) or ``[B, T, H, K]``;
            v: ``[.., HV, V]``; float32 or bfloat16, strided views allowed.
        g: ``[1, T, HV]`` log decay; beta: ``[1, T, HV]`` (from
            ``fused_gdn_gating_cpu``).
        initial_state: the SSM state pool ``[num_slots, HV, V, K]`` (float32 or
            bfloat16). With ``initial_state_indices`` (``[N]`` slots, negative =
            padding) each sequence starts from its slot and, unless
            ``inplace_update=False``, its final state is written back in place.
        cu_seqlens: ``[N + 1]`` token offsets (``query_start_loc``).
        use_qk_l2norm_in_kernel: L2-normalise q and k (eps 1e-6).
        scale: query scale, default ``K ** -0.5``.
        output_final_state: return the final states ``[N, HV, V, K]`` float32 as
            the second result (otherwise None, as upstream's Triton version).
        output_chunk_states: return ``h`` (default, like the Triton version):
            states at every 64-token chunk start, ``[1, NT, HV, V, K]`` in q's
            dtype, used by the mamba prefix-cache tracking in
            ``srt/layers/attention/hybrid_linear_attn_backend.py``.
        state_emit_indices: ``[NT]`` pool slot per 64-token chunk that receives the state
            at that chunk's start (-1: none); see :func:`sgl_kernel_fork.ops.chunk_gated_delta_rule`.

    Returns:
        ``(o, final_state_or_None, h_or_None)``, ``o`` ``[B, T, HV, V]`` in q's
        dtype.

    Formula and sources: see :func:`sgl_kernel_fork.ops.chunk_gated_delta_rule`.
    """
    del kwargs
    o, final_state, h = ops.chunk_gated_delta_rule(
        q,
        k,
        v,
        g,
        beta,
        initial_state,
        output_final_state,
        cu_seqlens,
        head_first,
        use_qk_l2norm_in_kernel,
        initial_state_indices,
        1e-6,
        output_chunk_states,
        scale,
        inplace_update,
        state_emit_indices,
    )
    return (
        o,
        final_state if output_final_state else None,
        h if output_chunk_states else None,
    )


__all__ = [
    "PAD_SLOT_ID",
    "causal_conv1d_fn_cpu",
    "causal_conv1d_update_cpu",
    "chunk_gated_delta_rule_cpu",
]
