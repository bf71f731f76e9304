"""torch.ops.sgl_kernel.expert_bank_copy (CPU) against indexing, and with the control op."""

from __future__ import annotations

import random

import pytest
import torch
from ec_util import OpCache, control, random_routing

ROWS, SLOTS, F = 24, 10, 6


def banks(rows, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(rows, 3, 5, generator=g).to(torch.bfloat16),
        torch.randn(rows, 7, generator=g),
        torch.randint(-128, 127, (rows, 2, 2, 3), generator=g, dtype=torch.int8),
        torch.randint(0, 255, (rows, 1), generator=g, dtype=torch.uint8),  # 1-byte rows
        torch.randn(rows, 4, generator=g, dtype=torch.float64),
    ]


def reference_copy(src, dst, fill_src, fill_dst, n):
    out = [d.clone() for d in dst]
    for i in range(n):
        for s, d in zip(src, out):
            d[fill_dst[i]] = s[fill_src[i]]
    return out


@pytest.mark.parametrize("n", [0, 1, 3, F])
def test_matches_indexing(n):
    src = banks(ROWS)
    dst = [torch.zeros((SLOTS,) + s.shape[1:], dtype=s.dtype) for s in src]
    rng = random.Random(n)
    fs = rng.sample(range(ROWS), F)
    fd = rng.sample(range(SLOTS), F)
    # entries past the count are not read (may be -1 or anything)
    fill_src = torch.tensor(fs[:n] + [-1] * (F - n), dtype=torch.int32)
    fill_dst = torch.tensor(fd[:n] + [-1] * (F - n), dtype=torch.int32)
    counts = torch.tensor([n, 99, 99, 99], dtype=torch.int32)
    want = reference_copy(src, dst, fs, fd, n)
    control.expert_bank_copy(src, dst, control.FillList(fill_src, fill_dst, counts))
    for d, w in zip(dst, want):
        assert torch.equal(d, w)


def test_count_masks_valid_looking_entries():
    src = banks(ROWS)
    dst = [torch.zeros((SLOTS,) + s.shape[1:], dtype=s.dtype) for s in src]
    fill_src = torch.tensor([1, 2, 3, 4], dtype=torch.int32)
    fill_dst = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    control.expert_bank_copy(
        src, dst, control.FillList(fill_src, fill_dst, torch.tensor([2], dtype=torch.int32))
    )
    for s, d in zip(src, dst):
        assert torch.equal(d[:2], s[1:3]) and not d[2:].any()


def test_large_rows_parallel_path():
    src = [torch.randn(8, 64, 1024), torch.randn(8, 3, 1000).to(torch.bfloat16)]  # 256 KB rows
    dst = [torch.zeros((5,) + s.shape[1:], dtype=s.dtype) for s in src]
    fs, fd = [7, 0, 3, 5], [4, 1, 0, 2]
    want = reference_copy(src, dst, fs, fd, 4)
    fills = control.FillList(
        torch.tensor(fs, dtype=torch.int32),
        torch.tensor(fd, dtype=torch.int32),
        torch.tensor([4, 0, 0, 0], dtype=torch.int32),
    )
    control.expert_bank_copy(src, dst, fills)
    for d, w in zip(dst, want):
        assert torch.equal(d, w)


def _ok():
    src = banks(ROWS)[:2]
    dst = [torch.zeros((SLOTS,) + s.shape[1:], dtype=s.dtype) for s in src]
    return dict(
        src_banks=src,
        dst_banks=dst,
        fill_src=torch.tensor([0, 1], dtype=torch.int32),
        fill_dst=torch.tensor([0, 1], dtype=torch.int32),
        counts=torch.tensor([2], dtype=torch.int32),
    )


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda a: a.update(dst_banks=a["dst_banks"][:1]), "same length"),
        (
            lambda a: a.update(
                dst_banks=[torch.zeros(SLOTS, 3, 4, dtype=torch.bfloat16), a["dst_banks"][1]]
            ),
            "row shape",
        ),
        (lambda a: a.update(dst_banks=[torch.zeros(SLOTS, 3, 5), a["dst_banks"][1]]), "dtypes"),
        (
            lambda a: a.update(
                src_banks=[a["src_banks"][0].transpose(1, 2), a["src_banks"][1]],
                dst_banks=[torch.zeros(SLOTS, 5, 3, dtype=torch.bfloat16), a["dst_banks"][1]],
            ),
            "contiguous",
        ),
        (lambda a: a.update(fill_src=torch.tensor([0, ROWS], dtype=torch.int32)), "fill_src"),
        (lambda a: a.update(fill_dst=torch.tensor([-1, 1], dtype=torch.int32)), "fill_dst"),
        (lambda a: a.update(counts=torch.tensor([3], dtype=torch.int32)), "counts"),
        (lambda a: a.update(fill_dst=torch.tensor([0], dtype=torch.int32)), "fill_dst"),
        (lambda a: a.update(fill_src=torch.tensor([0, 1], dtype=torch.int64)), "int32"),
    ],
)
def test_errors(mutate, match):
    a = _ok()
    mutate(a)
    with pytest.raises(RuntimeError, match=match):
        torch.ops.sgl_kernel.expert_bank_copy(**a)


def test_no_banks_is_a_noop():
    torch.ops.sgl_kernel.expert_bank_copy(
        [],
        [],
        torch.zeros(2, dtype=torch.int32),
        torch.zeros(2, dtype=torch.int32),
        torch.ones(1, dtype=torch.int32),
    )


def test_control_then_copy_keeps_slots_equal_to_their_experts():
    """Driving the copy with the control op's lists: every occupied slot holds its expert's rows."""
    rng = random.Random(3)
    L, E, S, Fn, K = 3, 16, 12, 4, 4
    src = banks(L * E, seed=1)
    dst = [torch.zeros((S,) + s.shape[1:], dtype=s.dtype) for s in src]
    op = OpCache(L, E, S, Fn, top_k=K)
    for _ in range(50):
        layer = rng.randrange(L)
        topk = random_routing(rng, rng.randint(1, 16), K, E, rng.sample(range(E), 6))
        op.control(topk, layer, rng.uniform(0, 2), rng.choice([0, 1, 2]))
        control.expert_bank_copy(src, dst, op.fills)
        for s, g in enumerate(op.tables.id_of_slot.tolist()):
            if g >= 0:
                for sb, db in zip(src, dst):
                    assert torch.equal(db[s], sb[g])
