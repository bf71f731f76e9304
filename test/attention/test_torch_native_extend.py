"""torch_native extend attention computes only the new rows (patch 0010).

Checks, on random batches (mixed prefix / extend lengths incl. prefix 0 and
extend 1, GQA, sliding window, non-causal, encoder offsets, fp32 and bf16):

* the result equals a plain full-sequence reference (attention over
  prefix + new rows in float64, new rows sliced out) and, where upstream's own
  loop is still present, upstream's ``_run_sdpa_forward_extend`` itself;
* the work done is proportional to the new rows: the summed
  query_rows x keys of every SDPA call is ~ sum(extend * seq_len), not
  sum(seq_len^2) as upstream, and each call stays under the block budget;
* ``TorchNativeAttnBackend.forward_extend`` is wired to the new path.
"""

import math
import random
import types
import unittest
from contextlib import contextmanager

import torch

from sglang.srt.layers.attention import torch_native_backend as tnb
from sglang.srt.layers.attention import torch_native_extend as tne
from sglang.srt.layers.radix_attention import AttentionType

POOL = 4096


def make_batch(prefix_lens, extend_lens, hq, hkv, d, dv, dtype, encoder_lens=None, seed=0):
    """Random KV pool + req_to_token tables; returns everything the extend
    function takes plus full-sequence queries (prefix rows are only used by the
    reference, to show that they do not matter)."""
    g = torch.Generator().manual_seed(seed)
    n = len(prefix_lens)
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    enc = encoder_lens or [0] * n
    max_ctx = max(s + x for s, x in zip(seq_lens, enc)) + 3
    k_cache = torch.randn(POOL, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(POOL, hkv, dv, generator=g).to(dtype)
    req_to_token = torch.zeros(n + 2, max_ctx, dtype=torch.int64)
    slots = torch.randperm(POOL, generator=g)
    pool_idx = list(range(n + 1, 1, -1))[:n]  # non-trivial pool indices
    used = 0
    for i in range(n):
        ln = seq_lens[i] + enc[i]
        req_to_token[pool_idx[i], :ln] = slots[used : used + ln]
        used += ln
    assert used <= POOL
    full_q = [torch.randn(s, hq, d, generator=g).to(dtype) for s in seq_lens]
    q_new = torch.cat([fq[p:] for fq, p in zip(full_q, prefix_lens)], 0)

    def t(x):
        return torch.tensor(x, dtype=torch.int64)

    args = dict(
        query=q_new,
        k_cache=k_cache,
        v_cache=v_cache,
        req_to_token=req_to_token,
        req_pool_indices=t(pool_idx),
        seq_lens=t(seq_lens),
        extend_prefix_lens=t(prefix_lens),
        extend_seq_lens=t(extend_lens),
        encoder_lens=t(encoder_lens) if encoder_lens is not None else None,
    )
    return args, full_q


def reference(args, full_q, prefix_lens, *, scale, causal, window=None, cross=False):
    """Full attention over the whole sequence in float64, new rows sliced."""
    outs = []
    enc = args["encoder_lens"]
    for i, fq in enumerate(full_q):
        s = int(args["seq_lens"][i])
        if enc is None:
            lo, hi = 0, s
        elif cross:
            lo, hi = 0, int(enc[i])
        else:
            lo, hi = int(enc[i]), int(enc[i]) + s
        tok = args["req_to_token"][int(args["req_pool_indices"][i]), lo:hi]
        k = args["k_cache"][tok].double()
        v = args["v_cache"][tok].double()
        rep = fq.shape[1] // k.shape[1]
        k = k.repeat_interleave(rep, 1).transpose(0, 1)  # [H, kv, d]
        v = v.repeat_interleave(rep, 1).transpose(0, 1)
        q = fq.double().transpose(0, 1)  # [H, s, d]
        sc = (q @ k.transpose(1, 2)) * scale
        if causal:
            qp = torch.arange(s).unsqueeze(1)
            kp = torch.arange(k.shape[1]).unsqueeze(0)
            m = kp <= qp
            if window is not None:
                m &= kp >= qp - window
            sc = sc.masked_fill(~m, float("-inf"))
        o = torch.softmax(sc, -1) @ v  # [H, s, dv]
        outs.append(o.transpose(0, 1)[prefix_lens[i] :])
    return torch.cat(outs, 0)


@contextmanager
def count_sdpa(module):
    """Record (heads, q_rows, kv_len, mask_numel) of every attention call made through
    ``module.scaled_dot_product_attention`` and, in torch_native_extend, ``flash_with_lse``
    (the mask-free causal path; its calls have no mask). ``calls.rows`` counts each new
    row once: the rows of masked SDPA calls and of causal flash calls (a prefix flash call
    covers the same rows again)."""
    calls = []
    calls_rows = []
    orig = module.scaled_dot_product_attention

    def wrapped(q, k, v, attn_mask=None, **kw):
        calls.append(
            (q.shape[-3], q.shape[-2], k.shape[-2], 0 if attn_mask is None else attn_mask.numel())
        )
        calls_rows.append(q.shape[-2])
        return orig(q, k, v, attn_mask=attn_mask, **kw)

    module.scaled_dot_product_attention = wrapped
    orig_flash = getattr(module, "flash_with_lse", None)
    if orig_flash is not None:

        def wrapped_flash(q, k, v, *, is_causal, scale):
            calls.append((q.shape[-3], q.shape[-2], k.shape[-2], 0))
            if is_causal:
                calls_rows.append(q.shape[-2])
            return orig_flash(q, k, v, is_causal=is_causal, scale=scale)

        module.flash_with_lse = wrapped_flash
    try:
        yield types.SimpleNamespace(calls=calls, rows=calls_rows)
    finally:
        module.scaled_dot_product_attention = orig
        if orig_flash is not None:
            module.flash_with_lse = orig_flash


def run_new(args, dv, **kw):
    out = torch.full(
        (args["query"].shape[0], args["query"].shape[1], dv),
        float("nan"),
        dtype=args["query"].dtype,
    )
    return tne.sdpa_extend_new_rows(output=out, **args, **kw)


def run_upstream(args, dv, **kw):
    backend = tnb.TorchNativeAttnBackend.__new__(tnb.TorchNativeAttnBackend)
    out = torch.full(
        (args["query"].shape[0], args["query"].shape[1], dv),
        float("nan"),
        dtype=args["query"].dtype,
    )
    return tnb.TorchNativeAttnBackend._run_sdpa_forward_extend(backend, output=out, **args, **kw)


HAS_UPSTREAM_LOOP = hasattr(tnb.TorchNativeAttnBackend, "_run_sdpa_forward_extend")


def test_upstream_loop_present():
    """The comparisons with upstream's loop below run only where it exists: on the pinned
    upstream (patch 0010 keeps it) it must, or they would stop checking anything silently."""
    assert HAS_UPSTREAM_LOOP, "TorchNativeAttnBackend._run_sdpa_forward_extend is gone"


# (prefix_lens, extend_lens): prefix 0, extend 1, long prefix + short extend, ...
BATCHES = [
    ([0, 37, 5, 120, 0, 64], [19, 1, 33, 7, 1, 40]),
    ([200, 0, 1], [3, 50, 1]),
]


class TestTorchNativeExtendNewRows(unittest.TestCase):
    def check(
        self,
        prefix,
        extend,
        hq,
        hkv,
        d,
        dv,
        dtype,
        *,
        causal=True,
        window=None,
        encoder_lens=None,
        cross=False,
        block_elems=None,
        seed=0,
    ):
        args, full_q = make_batch(prefix, extend, hq, hkv, d, dv, dtype, encoder_lens, seed)
        scale = 1.0 / math.sqrt(d) * 1.3
        kw = dict(
            scaling=scale,
            enable_gqa=hq != hkv,
            causal=causal,
            is_cross_attn=cross,
            sliding_window_size=window,
        )
        out = run_new(args, dv, block_elems=block_elems, **kw)
        ref = reference(
            args, full_q, prefix, scale=scale, causal=causal, window=window, cross=cross
        )
        tol = dict(atol=2e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
        self.assertFalse(out.isnan().any())
        torch.testing.assert_close(out.double(), ref, **tol)
        if HAS_UPSTREAM_LOOP and not cross:
            up = run_upstream(args, dv, **kw)
            torch.testing.assert_close(out.float(), up.float(), **tol)
        return args

    def test_causal_gqa_fp32_bf16(self):
        for dtype in (torch.float32, torch.bfloat16):
            for (prefix, extend), (hq, hkv) in zip(BATCHES, [(8, 2), (4, 4)]):
                with self.subTest(dtype=dtype, prefix=prefix, hq=hq, hkv=hkv):
                    self.check(prefix, extend, hq, hkv, 32, 32, dtype)

    def test_random_shapes_and_small_blocks(self):
        rng = random.Random(1)
        for it in range(6):
            n = rng.randint(1, 5)
            prefix = [rng.choice([0, rng.randint(1, 150)]) for _ in range(n)]
            extend = [rng.choice([1, rng.randint(1, 60)]) for _ in range(n)]
            hkv = rng.choice([1, 2, 4])
            hq = hkv * rng.choice([1, 2, 4])
            d = rng.choice([16, 64])
            dv = rng.choice([d, 16])  # qk_head_dim != v_head_dim too
            window = rng.choice([None, None, rng.randint(0, 40)])
            block = rng.choice([None, 1, 500, 3000])  # forces many query blocks
            with self.subTest(it=it, prefix=prefix, extend=extend, window=window, block=block):
                self.check(
                    prefix,
                    extend,
                    hq,
                    hkv,
                    d,
                    dv,
                    torch.float32,
                    window=window,
                    block_elems=block,
                    seed=it,
                )

    def test_sliding_window(self):
        for dtype in (torch.float32, torch.bfloat16):
            for window in (0, 1, 16, 1000):
                with self.subTest(dtype=dtype, window=window):
                    self.check(*BATCHES[0], 8, 2, 32, 32, dtype, window=window, block_elems=4096)

    def test_non_causal_and_encoder_offsets(self):
        prefix, extend = [0, 10, 3], [12, 5, 1]
        # encoder-only / non-causal self attention
        self.check(prefix, extend, 4, 2, 16, 16, torch.float32, causal=False, block_elems=200)
        # decoder self-attention with keys after the encoder tokens
        self.check(prefix, extend, 4, 2, 16, 16, torch.float32, encoder_lens=[7, 0, 30])
        # cross attention: keys are the encoder tokens, no causal mask
        args, full_q = make_batch(prefix, extend, 4, 2, 16, 16, torch.float32, [7, 4, 30])
        scale = 0.25
        out = run_new(args, 16, scaling=scale, enable_gqa=True, causal=False, is_cross_attn=True)
        ref = reference(args, full_q, prefix, scale=scale, causal=False, cross=True)
        torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)

    def test_work_proportional_to_new_rows(self):
        # One request with a long cached prefix and a short extend, plus a fresh one.
        prefix, extend = [1500, 0], [8, 24]
        hq, hkv, d = 4, 2, 16
        args, _ = make_batch(prefix, extend, hq, hkv, d, d, torch.float32)
        kw = dict(scaling=0.25, enable_gqa=True, causal=True)
        with count_sdpa(tne) as new:
            out = run_new(args, d, **kw)
        new_work = sum(q * k for _, q, k, _ in new.calls)
        needed = sum(e * (p + e) for p, e in zip(prefix, extend))
        full = sum((p + e) ** 2 for p, e in zip(prefix, extend))
        self.assertLessEqual(new_work, needed + sum(e * e for e in extend))
        self.assertLess(new_work * 50, full)
        if HAS_UPSTREAM_LOOP:
            with count_sdpa(tnb) as old:
                up = run_upstream(args, d, **kw)
            self.assertEqual(sum(q * k for _, q, k, _ in old.calls), full)
            torch.testing.assert_close(out, up, atol=2e-5, rtol=1e-4)
        print(
            f"\nSDPA q_rows*kv: new-rows path {new_work}, full-sequence {full} "
            f"(x{full / new_work:.0f})"
        )

    def test_blocks_bounded(self):
        # A long extend never builds a matrix over the budget at once: no mask at all on the
        # flash path (causal, no window, d == dv), the rows x keys mask on the masked path
        # (a sliding window), the heads x rows x keys scores with the math fallback (d != dv).
        hq, hkv, d = 4, 2, 16
        budget = 1 << 14
        for dv, window, heads_in_budget in ((d, None, False), (d, 64, False), (8, None, True)):
            kw = dict(scaling=0.25, enable_gqa=True, causal=True, sliding_window_size=window)
            args, full_q = make_batch([700, 0], [300, 200], hq, hkv, d, dv, torch.float32, seed=3)
            with count_sdpa(tne) as rec:
                out = run_new(args, dv, block_elems=budget, **kw)
            flash_path = (
                dv == d and window is None and tne.flash_supported(args["query"], args["v_cache"])
            )
            for h, q, k, m in rec.calls:
                if flash_path:
                    self.assertEqual(m, 0)
                    continue
                self.assertLessEqual(m, budget)
                self.assertLessEqual(q * k, budget)
                if heads_in_budget:
                    self.assertTrue(q == 1 or h * q * k <= budget, (h, q, k))
            if flash_path:  # prefix + diagonal for the first request, diagonal for the fresh one
                self.assertEqual(len(rec.calls), 3)
            else:
                self.assertGreater(len(rec.calls), 2)
            self.assertEqual(sum(rec.rows), 500)
            ref = reference(args, full_q, [700, 0], scale=0.25, causal=True, window=window)
            torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)

    def test_merge_partials_is_exact(self):
        # Attention over keys A + B equals the merge of attention over A and over B.
        g = torch.Generator().manual_seed(5)
        q = torch.randn(3, 7, 16, generator=g, dtype=torch.float64)
        k = torch.randn(3, 50, 16, generator=g, dtype=torch.float64) * 3  # large logits
        v = torch.randn(3, 50, 16, generator=g, dtype=torch.float64)

        def part(lo, hi):
            sc = q @ k[:, lo:hi].transpose(1, 2)
            return torch.softmax(sc, -1) @ v[:, lo:hi], torch.logsumexp(sc, -1)

        whole, _ = part(0, 50)
        for cut in (1, 20, 49):
            merged = tne.merge_partials(*part(0, cut), *part(cut, 50))
            torch.testing.assert_close(merged.double(), whole, atol=1e-6, rtol=1e-6)

    def test_long_prefix_takes_the_mask_free_path(self):
        # Causal, no window, d == dv: two flash calls per request with a prefix (whole prefix,
        # then the causal diagonal), none with a mask, bf16 and fp32 alike.
        for dtype in (torch.float32, torch.bfloat16):
            args, full_q = make_batch([900, 3], [40, 1], 8, 2, 32, 32, dtype, seed=7)
            self.assertTrue(tne.flash_supported(args["query"], args["v_cache"]))
            with count_sdpa(tne) as rec:
                out = run_new(args, 32, scaling=0.2, enable_gqa=True, causal=True)
            self.assertEqual(
                [(q, k) for _, q, k, _ in rec.calls], [(40, 40), (40, 900), (1, 1), (1, 3)]
            )
            ref = reference(args, full_q, [900, 3], scale=0.2, causal=True)
            tol = (
                dict(atol=2e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
            )
            torch.testing.assert_close(out.double(), ref, **tol)

    def test_forward_extend_uses_new_rows_path(self):
        prefix, extend = [300, 0], [4, 6]
        hq, hkv, d = 4, 2, 16
        args, full_q = make_batch(prefix, extend, hq, hkv, d, d, torch.float32)
        pool = types.SimpleNamespace(
            get_key_buffer=lambda i: args["k_cache"],
            get_value_buffer=lambda i: args["v_cache"],
        )
        backend = tnb.TorchNativeAttnBackend.__new__(tnb.TorchNativeAttnBackend)
        backend.token_to_kv_pool = pool
        backend.req_to_token_pool = types.SimpleNamespace(req_to_token=args["req_to_token"])
        backend.swa_out_cache_loc = None
        layer = types.SimpleNamespace(
            qk_head_dim=d,
            v_head_dim=d,
            tp_q_head_num=hq,
            tp_k_head_num=hkv,
            layer_id=0,
            is_cross_attention=False,
            attn_type=AttentionType.DECODER,
            scaling=0.25,
            sliding_window_size=-1,
        )
        fb = types.SimpleNamespace(
            req_pool_indices=args["req_pool_indices"],
            seq_lens=args["seq_lens"],
            extend_prefix_lens=args["extend_prefix_lens"],
            extend_seq_lens=args["extend_seq_lens"],
            encoder_lens=None,
            out_cache_loc=None,
        )
        q = args["query"].reshape(-1, hq * d)
        with count_sdpa(tne) as rec:
            o = backend.forward_extend(q, None, None, layer, fb, save_kv_cache=False)
        self.assertTrue(rec.calls, "forward_extend did not go through torch_native_extend")
        self.assertEqual(sum(rec.rows), sum(extend))
        ref = reference(args, full_q, prefix, scale=0.25, causal=True)
        torch.testing.assert_close(o.view(-1, hq, d).double(), ref, atol=2e-5, rtol=1e-4)


if __name__ == "__main__":
    unittest.main()
