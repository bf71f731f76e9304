"""torch_native attention with gpt-oss's sinks and sliding window (patch 0011,
``torch_native_sinks.py``).

Reference: transformers' ``eager_attention_forward`` of ``modeling_gpt_oss.py`` written out in
float64 over each request's whole sequence: scores ``q k^T * scale``, the causal mask with its
sliding window (``config.sliding_window`` keys: key j visible to query i when
``i - sliding_window < j <= i``), the sink logit concatenated as a last column, softmax, the
column dropped, ``P V``. The new rows of each request (after a cached prefix) are compared, in
float32, within 1e-5 on O(1) outputs; a lost sink moves outputs by O(1e-1), a window off by one
key or a wrong KV head by O(1).
"""

from types import SimpleNamespace

import pytest
import torch

from sglang.srt.layers.attention import torch_native_backend as tnb
from sglang.srt.layers.attention import torch_native_sinks as tns

TOL = dict(atol=1e-5, rtol=1e-5)
POOL = 512


def reference(q_seq, k_seq, v_seq, sinks, scale, sliding_window, chunk=None):
    """float64 gpt-oss eager attention of one whole sequence: q [L, hq, d], k / v
    [L, hkv, d], sinks [hq]; ``sliding_window`` None (full) or the config's window (keys
    counted including the query's own). Returns [L, hq, d]."""
    L, hq, _ = q_seq.shape
    group = hq // k_seq.shape[1]
    k = k_seq.double().repeat_interleave(group, 1)
    v = v_seq.double().repeat_interleave(group, 1)
    s = torch.einsum("qhd,khd->hqk", q_seq.double(), k) * scale
    i = torch.arange(L).unsqueeze(1)
    j = torch.arange(L).unsqueeze(0)
    visible = j <= i
    if sliding_window is not None:
        visible &= j > i - sliding_window
    if chunk is not None:  # transformers' chunked_causal_mask_function (Llama 4)
        visible &= (j // chunk) == (i // chunk)
    s = s.masked_fill(~visible, float("-inf"))
    if sinks is None:
        sinks = torch.full((hq,), float("-inf"))
    sink = sinks.double().reshape(hq, 1, 1).expand(hq, L, 1)
    logits = torch.cat([s, sink], -1)
    logits = logits - logits.max(-1, keepdim=True).values
    p = logits.softmax(-1)[..., :-1]
    return torch.einsum("hqk,khd->qhd", p, v)


def make_batch(seq_lens, ext_lens, hq, hkv, d, seed=0):
    """A pool holding every request's keys at scattered locations, the queries of the new
    rows, and each request's full-sequence queries (for the reference)."""
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(POOL, hkv, d, generator=g)
    v_cache = torch.randn(POOL, hkv, d, generator=g)
    req_to_token = torch.zeros(len(seq_lens) + 2, max(seq_lens) + 3, dtype=torch.int32)
    perm = torch.randperm(POOL, generator=g)
    pos = 0
    q_full, q_new = [], []
    for r, n in enumerate(seq_lens):
        req_to_token[r + 1, :n] = perm[pos : pos + n].int()
        pos += n
        qf = torch.randn(n, hq, d, generator=g)
        q_full.append(qf)
        q_new.append(qf[n - ext_lens[r] :])
    sinks = torch.randn(hq, generator=g) * 2
    return dict(
        k_cache=k_cache,
        v_cache=v_cache,
        req_to_token=req_to_token,
        pool_idx=torch.arange(1, len(seq_lens) + 1),
        seq_lens=torch.tensor(seq_lens),
        ext_lens=torch.tensor(ext_lens),
        q_full=q_full,
        q=torch.cat(q_new),
        sinks=sinks,
    )


def expected_new_rows(b, scale, sliding_window, chunk=None, sinks=True):
    outs = []
    for r, n in enumerate(b["seq_lens"].tolist()):
        t = b["req_to_token"][b["pool_idx"][r], :n].long()
        ref = reference(
            b["q_full"][r],
            b["k_cache"][t],
            b["v_cache"][t],
            b["sinks"] if sinks else None,
            scale,
            sliding_window,
            chunk,
        )
        outs.append(ref[n - int(b["ext_lens"][r]) :])
    return torch.cat(outs)


# (seq_lens, extend lens): whole prompts, prompts after a cached prefix (longer than the
# window), one-row extends
CASES = [([40, 7, 57], [40, 7, 57]), ([60, 33], [12, 33]), ([45, 20], [1, 2])]


@pytest.mark.parametrize("seq_lens,ext_lens", CASES)
@pytest.mark.parametrize("sliding_window", [None, 16, 1])
@pytest.mark.parametrize("block_elems", [None, 64])
def test_extend_matches_eager_reference(seq_lens, ext_lens, sliding_window, block_elems):
    hq, hkv, d = 4, 2, 16
    scale = d**-0.5
    b = make_batch(seq_lens, ext_lens, hq, hkv, d)
    out = torch.full_like(b["q"], float("nan"))
    tns.extend_with_sinks(
        b["q"],
        out,
        b["k_cache"],
        b["v_cache"],
        b["req_to_token"],
        b["pool_idx"],
        b["seq_lens"],
        b["ext_lens"],
        b["sinks"],
        scaling=scale,
        # SGLang's sliding_window_size is the config's window minus one
        sliding_window_size=None if sliding_window is None else sliding_window - 1,
        block_elems=block_elems,
    )
    torch.testing.assert_close(out.double(), expected_new_rows(b, scale, sliding_window), **TOL)


@pytest.mark.parametrize("sliding_window", [None, 16])
def test_decode_matches_eager_reference(sliding_window):
    hq, hkv, d = 8, 2, 32
    scale = d**-0.5
    seq_lens = [1, 15, 16, 17, 70]
    b = make_batch(seq_lens, [1] * len(seq_lens), hq, hkv, d, seed=3)
    out = torch.empty_like(b["q"])
    tns.decode_with_sinks(
        b["q"],
        out,
        b["k_cache"],
        b["v_cache"],
        b["req_to_token"],
        b["pool_idx"],
        b["seq_lens"],
        b["sinks"],
        scaling=scale,
        sliding_window_size=None if sliding_window is None else sliding_window - 1,
    )
    torch.testing.assert_close(out.double(), expected_new_rows(b, scale, sliding_window), **TOL)


def test_sinks_and_window_matter():
    """The reference is sensitive to what the tests check: without the sink, or with the
    window one key wider, the outputs move far beyond the tolerance."""
    hq, hkv, d = 4, 2, 16
    b = make_batch([40], [40], hq, hkv, d)
    scale = d**-0.5
    ref = expected_new_rows(b, scale, 16)
    no_sink = dict(b, sinks=torch.full_like(b["sinks"], -1e30))
    assert (expected_new_rows(no_sink, scale, 16) - ref).abs().max() > 1e-2
    assert (expected_new_rows(b, scale, 17) - ref).abs().max() > 1e-2


def test_swa_pool_locations_translated():
    """A hybrid SWA pool keeps sliding layers in their own buffer: the keys are read at the
    translated locations, not at req_to_token's."""
    hq, hkv, d = 4, 2, 16
    scale = d**-0.5
    b = make_batch([30, 9], [30, 9], hq, hkv, d, seed=5)
    shift = torch.randperm(POOL, generator=torch.Generator().manual_seed(1))
    k_swa, v_swa = torch.empty_like(b["k_cache"]), torch.empty_like(b["v_cache"])
    k_swa[shift], v_swa[shift] = b["k_cache"], b["v_cache"]  # full loc l lives at shift[l]

    class Pool:
        layers_mapping = {0: (0, False), 1: (0, True)}

        @staticmethod
        def translate_loc_from_full_to_swa(locs):
            return shift[locs.long()]

    assert tns.swa_translate_for(Pool, 0) is None
    translate = tns.swa_translate_for(Pool, 1)
    out = torch.empty_like(b["q"])
    tns.extend_with_sinks(
        b["q"],
        out,
        k_swa,
        v_swa,
        b["req_to_token"],
        b["pool_idx"],
        b["seq_lens"],
        b["ext_lens"],
        b["sinks"],
        scaling=scale,
        sliding_window_size=15,
        translate_loc=translate,
    )
    torch.testing.assert_close(out.double(), expected_new_rows(b, scale, 16), **TOL)
    assert tns.swa_translate_for(object(), 1) is None  # a plain pool


class _FakePool:
    def __init__(self, k, v):
        self.k, self.v = k, v

    def set_kv_buffer(self, layer, loc, k, v):
        self.k[loc.loc.long()] = k.view(-1, *self.k.shape[1:])
        self.v[loc.loc.long()] = v.view(-1, *self.v.shape[1:])

    def get_key_buffer(self, layer_id):
        return self.k

    def get_value_buffer(self, layer_id):
        return self.v


def test_backend_forward_passes_sinks_to_module():
    """The patched ``TorchNativeAttnBackend.forward_extend`` / ``forward_decode`` take the
    ``sinks`` keyword the gpt-oss attention passes, write the new K/V and return the sinks
    attention (the upstream paths ignore sinks, which the reference tells apart)."""
    hq, hkv, d = 4, 2, 16
    scale = d**-0.5
    seq_lens, ext_lens = [40, 20], [10, 20]
    b = make_batch(seq_lens, ext_lens, hq, hkv, d, seed=9)
    k_pool, v_pool = b["k_cache"].clone(), b["v_cache"].clone()
    new_locs, new_k, new_v = [], [], []
    for r, n in enumerate(seq_lens):  # the new tokens' K/V come with the call
        t = b["req_to_token"][b["pool_idx"][r], n - ext_lens[r] : n].long()
        new_locs.append(t)
        new_k.append(k_pool[t].clone())
        new_v.append(v_pool[t].clone())
        k_pool[t] = 0.0
        v_pool[t] = 0.0
    backend = tnb.TorchNativeAttnBackend.__new__(tnb.TorchNativeAttnBackend)
    backend.token_to_kv_pool = _FakePool(k_pool, v_pool)
    backend.req_to_token_pool = SimpleNamespace(req_to_token=b["req_to_token"])
    backend.swa_out_cache_loc = None
    layer = SimpleNamespace(
        qk_head_dim=d,
        v_head_dim=d,
        tp_q_head_num=hq,
        tp_k_head_num=hkv,
        is_cross_attention=False,
        attn_type=None,
        layer_id=0,
        scaling=scale,
        sliding_window_size=15,
    )
    fb = SimpleNamespace(
        out_cache_loc=torch.cat(new_locs),
        encoder_lens=None,
        req_pool_indices=b["pool_idx"],
        seq_lens=b["seq_lens"],
        extend_seq_lens=b["ext_lens"],
        extend_prefix_lens=b["seq_lens"] - b["ext_lens"],
    )
    o = backend.forward_extend(
        b["q"].reshape(-1, hq * d),
        torch.cat(new_k).reshape(-1, hkv * d),
        torch.cat(new_v).reshape(-1, hkv * d),
        layer,
        fb,
        sinks=b["sinks"],
    )
    expected = expected_new_rows(b, scale, 16)
    torch.testing.assert_close(o.view(-1, hq, d).double(), expected, **TOL)

    # decode: the last row of each request, its K/V already in the pool from the extend
    rows = torch.tensor([ext_lens[0] - 1, ext_lens[0] + ext_lens[1] - 1])
    last = torch.stack([new_locs[0][-1], new_locs[1][-1]])
    fb_dec = SimpleNamespace(**{**vars(fb), "out_cache_loc": last})
    o_dec = backend.forward_decode(
        b["q"][rows].reshape(-1, hq * d),
        torch.cat(new_k)[rows].reshape(-1, hkv * d),
        torch.cat(new_v)[rows].reshape(-1, hkv * d),
        layer,
        fb_dec,
        sinks=b["sinks"],
    )
    torch.testing.assert_close(o_dec.view(-1, hq, d).double(), expected[rows], **TOL)


def test_cross_attention_refused_with_a_reason():
    layer = SimpleNamespace(is_cross_attention=True)
    with pytest.raises(NotImplementedError, match="decoder self-attention"):
        tns.extend_for_layer(
            None, None, None, layer, SimpleNamespace(encoder_lens=None), None, True
        )


@pytest.mark.parametrize("seq_lens,ext_lens", CASES)
@pytest.mark.parametrize("block_elems", [None, 64])
def test_chunked_extend_and_decode_match_the_chunked_mask(seq_lens, ext_lens, block_elems):
    """Llama 4's chunked local attention (patch 0016), no sinks: each query sees the keys of
    its own chunk of 16 only; the global mask (what upstream's backend computed) misses."""
    hq, hkv, d, chunk = 4, 2, 16, 16
    scale = d**-0.5
    b = make_batch(seq_lens, ext_lens, hq, hkv, d)
    args = (b["k_cache"], b["v_cache"], b["req_to_token"], b["pool_idx"], b["seq_lens"])
    out = torch.full_like(b["q"], float("nan"))
    tns.extend_with_sinks(
        b["q"], out, *args, b["ext_lens"], None, scaling=scale, block_elems=block_elems, chunk=chunk
    )
    want = expected_new_rows(b, scale, None, chunk=chunk, sinks=False)
    torch.testing.assert_close(out.double(), want, **TOL)
    unchunked = expected_new_rows(b, scale, None, sinks=False)
    assert not torch.allclose(unchunked, want, atol=1e-2)
    d_lens = [1, 15, 16, 17, 70]
    bd = make_batch(d_lens, [1] * len(d_lens), hq, hkv, d, seed=3)
    dout = torch.empty_like(bd["q"])
    dargs = (bd["k_cache"], bd["v_cache"], bd["req_to_token"], bd["pool_idx"], bd["seq_lens"])
    tns.decode_with_sinks(bd["q"], dout, *dargs, None, scaling=scale, chunk=chunk)
    want = expected_new_rows(bd, scale, None, chunk=chunk, sinks=False)
    torch.testing.assert_close(dout.double(), want, **TOL)


def test_layer_chunk_reads_the_backend_and_the_layer():
    backend = SimpleNamespace(attention_chunk_size=8192)
    assert tns.layer_chunk(backend, SimpleNamespace(use_irope=True)) == 8192
    assert tns.layer_chunk(backend, SimpleNamespace(use_irope=False)) is None  # NoPE: global
    assert (
        tns.layer_chunk(SimpleNamespace(attention_chunk_size=None), SimpleNamespace(use_irope=True))
        is None
    )
    assert tns.layer_chunk(SimpleNamespace(), SimpleNamespace()) is None
