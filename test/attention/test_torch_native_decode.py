"""torch_native decode on our CPU flash kernel (patch 0005, ``torch_native_decode.py``).

Reference: upstream's own ``TorchNativeAttnBackend._run_sdpa_forward_decode`` on the same
bf16 KV pool and tables, and a float64 softmax(q k^T * scale) v per request. The kernel rounds
P to bf16 before P V (its contract) and outputs bf16: within 2e-2 of both on O(1) outputs; a
wrong key range, a wrong KV head for a query head or a lost scale is off by O(1).
"""

import pytest
import torch

from sglang.srt.layers.attention import torch_native_backend as tnb
from sglang.srt.layers.attention import torch_native_decode as tnd
from sglang.srt.layers.attention import torch_native_extend as tne

TOL = dict(atol=2e-2, rtol=2e-2)
POOL = 1024


def batch(seq_lens, hq, hkv, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(POOL, hkv, d, generator=g).bfloat16()
    v = torch.randn(POOL, hkv, d, generator=g).bfloat16()
    q = torch.randn(len(seq_lens), hq, d, generator=g).bfloat16()
    req_to_token = torch.zeros(len(seq_lens) + 2, max(seq_lens) + 5, dtype=torch.int32)
    perm = torch.randperm(POOL, generator=g)
    pos = 0
    for r, n in enumerate(seq_lens):  # rows in another order than the batch
        req_to_token[r + 1, :n] = perm[pos : pos + n].int()
        pos += n
    pool_idx = torch.arange(1, len(seq_lens) + 1)
    return q, k, v, req_to_token, pool_idx, torch.tensor(seq_lens)


def reference(q, k, v, req_to_token, pool_idx, seq_lens, scale):
    out = torch.empty(q.shape, dtype=torch.float64)
    group = q.shape[1] // k.shape[1]
    for i, n in enumerate(seq_lens.tolist()):
        t = req_to_token[pool_idx[i], :n].long()
        kk = k[t].double().repeat_interleave(group, 1)  # [n, hq, d]
        vv = v[t].double().repeat_interleave(group, 1)
        p = torch.einsum("hd,nhd->hn", q[i].double(), kk).mul(scale).softmax(-1)
        out[i] = torch.einsum("hn,nhd->hd", p, vv)
    return out


needs_kernel = pytest.mark.skipif(
    not tne.extend_kernel_supported(*(torch.zeros(1, 1, 64, dtype=torch.bfloat16),) * 3),
    reason="the flash kernel needs AVX-512 BF16",
)


@needs_kernel
@pytest.mark.parametrize("seq_lens,hq,hkv,d", [([1, 37, 130], 32, 4, 128), ([5, 64], 4, 2, 64)])
def test_matches_upstream_and_float64(seq_lens, hq, hkv, d):
    q, k, v, r2t, idx, lens = batch(seq_lens, hq, hkv, d)
    scale = d**-0.5
    out = torch.empty_like(q)
    assert tnd.decode_attention(q, out, k, v, r2t, idx, lens, scaling=scale)
    ref = reference(q, k, v, r2t, idx, lens, scale)
    torch.testing.assert_close(out.double(), ref, **TOL)
    backend = tnb.TorchNativeAttnBackend.__new__(tnb.TorchNativeAttnBackend)
    up = torch.empty_like(q)
    backend._run_sdpa_forward_decode(
        q, up, k, v, r2t, idx, lens, scaling=scale, enable_gqa=hq != hkv, causal=False
    )
    torch.testing.assert_close(out.float(), up.float(), **TOL)


def test_declines_what_upstream_keeps():
    q, k, v, r2t, idx, lens = batch([4, 9], 4, 2, 64)
    out = torch.zeros_like(q)
    args = (q, out, k, v, r2t, idx, lens)
    assert not tnd.decode_attention(*args, sliding_window_size=8)
    assert not tnd.decode_attention(*args, is_cross_attn=True)
    assert not tnd.decode_attention(*args, encoder_lens=torch.zeros(2, dtype=torch.int64))
    assert not tnd.decode_attention(q.float(), out.float(), k.float(), v.float(), *args[4:])
    qq, kk, vv = (torch.zeros(2, 4, 96, dtype=torch.bfloat16),) * 3  # head dim 96
    assert not tnd.decode_attention(qq, torch.zeros_like(qq), kk, vv, *args[4:])
    assert torch.count_nonzero(out) == 0  # nothing written when declined


def test_forward_decode_is_wired():
    import inspect

    assert "decode_attention(" in inspect.getsource(tnb.TorchNativeAttnBackend.forward_decode)
