"""Decode attention for the torch_native backend on our CPU flash kernel (patch
``0005-torch-native-decode-kernel``).

Upstream's ``TorchNativeAttnBackend._run_sdpa_forward_decode`` runs one
``scaled_dot_product_attention`` per request with ``enable_gqa``: on a CPU that is 0.86 ms per
layer for one query row of 32 heads against ~100 keys of the Qwen3-30B-A3B slice (issue 18's
profile, 13% of the decode step), most of it ATen's dispatch and GQA handling around a tiny
product. :func:`decode_attention` runs the same rows in ``sgl_kernel_fork.extend_attention``
(the kernel the extend path already uses, ``torch_native_extend.py``): one query row per
request, non-causal against all the request's keys, GQA without repeating the KV heads; for
such calls of at most 4 rows the kernel takes its decode path (``decode_attention.cpp``: no
repack of the keys, items of 256 keys merged per head; ``bench_decode_attention.py``). The
kernel reads the request's keys from the KV pool in place (``kv_index``: its ``req_to_token``
slots), not from a gathered copy (``k_cache[tokens]`` was two ``aten::index`` per layer, ~0.2
ms each at ~200 keys under load: issue 18's profile).

It takes a call only where the kernel computes what upstream does: self-attention without an
encoder offset or a sliding window, bf16 q / k / v of one head dim the kernel has (64, 128,
256) at a kernel level of avx2 or better (``torch_native_extend.extend_kernel_supported``);
otherwise it returns False and upstream's loop runs. Numerics: fp32 softmax and
accumulation; at the avx512bf16 level P is rounded to bf16 before P V (SDPA's CPU flash kernel
keeps P in fp32, as the avx2 path does), so outputs differ in the last bf16 bits.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from sglang.srt.layers.attention.torch_native_extend import _fork_ops, extend_kernel_supported


def decode_attention(
    query: torch.Tensor,
    output: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    encoder_lens: Optional[torch.Tensor] = None,
    scaling: Optional[float] = None,
    is_cross_attn: bool = False,
    sliding_window_size: Optional[int] = None,
) -> bool:
    """One decode row per request on the flash kernel; False (nothing written) where it does
    not apply.

    Shapes: query / output [num_seqs, num_heads, dim] (output bf16, written), k_cache /
    v_cache [pool_size, kv_heads, dim]; request r's keys are
    ``req_to_token[req_pool_indices[r], :seq_lens[r]]``, as upstream's decode reads them.
    """
    if (
        encoder_lens is not None
        or is_cross_attn
        or (sliding_window_size is not None and sliding_window_size > -1)
        or output.dtype != torch.bfloat16
        or output.stride(-1) != 1
        or query.shape[0] != seq_lens.shape[0]
        or not extend_kernel_supported(query, k_cache, v_cache)
    ):
        return False
    scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    pool_idx = req_pool_indices.tolist()
    for i, n in enumerate(seq_lens.tolist()):
        _fork_ops.extend_attention(
            query[i : i + 1],
            k_cache,
            v_cache,
            output[i : i + 1],
            0,
            scale,
            False,
            kv_index=req_to_token[pool_idx[i], :n],  # read in place, not gathered
        )
    return True
