"""CUDA expert-cache ops against the CPU ops (same semantics), including CUDA-graph replay.

Skipped without a GPU or without the CUDA kernels (``sgl_kernel_fork._C_cuda``, built by setup.py
when torch is a CUDA build and a toolkit is found).
"""

from __future__ import annotations

import random

import pytest
import torch
from ec_util import OpCache, as_lists, check_call, control, random_routing

HAS_CUDA_OP = torch.cuda.is_available() and torch._C._dispatch_has_kernel_for_dispatch_key(
    "sgl_kernel::expert_cache_control", "CUDA"
)
pytestmark = pytest.mark.skipif(
    not HAS_CUDA_OP,
    reason="needs a GPU and sgl_kernel_fork built with CUDA (torch.cuda unavailable here)",
)


def pair(L, E, S, F, K):
    return (
        OpCache(L, E, S, F, top_k=K, device="cpu"),
        OpCache(L, E, S, F, top_k=K, device="cuda"),
    )


def both(cpu, gpu, topk, layer, ratio, policy):
    before = cpu.state()
    want = cpu.control(topk, layer, ratio, policy)
    got = gpu.control(topk, layer, ratio, policy)
    assert got == want
    assert gpu.state() == cpu.state()
    check_call(topk, layer, cpu.E, before, cpu.state(), want)


@pytest.mark.parametrize("seed", range(16))
def test_random_sequences_match_cpu(seed):
    rng = random.Random(seed)
    L = rng.randint(1, 4)
    E = rng.choice([4, 8, 16, 64, 256, 1000])
    S = 0 if seed % 4 == 0 else rng.randint(1, L * E)  # S = 0: the no-slot path
    F = rng.randint(1, 32)
    K = rng.randint(1, min(8, E))
    cpu, gpu = pair(L, E, S, F, K)
    hot = {layer: rng.sample(range(E), max(K, E // 4)) for layer in range(L)}
    for _ in range(80):
        layer = rng.randrange(L)
        if rng.random() < 0.1:
            hot[layer] = rng.sample(range(E), max(K, E // 4))
        topk = random_routing(rng, rng.choice([0, 1, 2, 8, 33, 64]), K, E, hot[layer])
        both(cpu, gpu, topk, layer, rng.uniform(0, 3), rng.choice([0, 0, 1, 2]))


@pytest.mark.parametrize("seed", range(4))
def test_resized_pools_match_cpu(seed):
    """The live slot count as device data (``live_slots``): after each shrink or grow of the
    tables (``resize.resize_tables`` on each device), the CUDA kernel never hits or evicts a
    slot past it and matches the CPU op call by call."""
    rng = random.Random(100 + seed)
    L, E, K = 3, 64, 8
    S = L * E
    cpu, gpu = pair(L, E, S, rng.randint(1, 32), K)
    hot = {layer: rng.sample(range(E), 16) for layer in range(L)}
    for i in range(60):
        if i % 10 == 5:
            n = rng.choice([0, K, 17, S // 2, S])
            assert gpu.resize(n) == cpu.resize(n)
            assert gpu.state() == cpu.state()
        layer = rng.randrange(L)
        topk = random_routing(rng, rng.choice([1, 8, 64]), K, E, hot[layer])
        both(cpu, gpu, topk, layer, rng.uniform(0, 3), rng.choice([0, 1]))


@pytest.mark.parametrize("E, S, F", [(256, 3072, 16), (4096, 40000, 32), (64, 50000, 8)])
def test_large_tables_match_cpu(E, S, F):
    rng = random.Random(E)
    L = max(1, -(-S // E))  # enough layers for S <= L * E
    cpu, gpu = pair(L, E, S, F, 8)
    for _ in range(30):
        layer = rng.randrange(L)
        topk = random_routing(rng, rng.choice([1, 64, 512]), 8, E, rng.sample(range(E), 32))
        both(cpu, gpu, topk, layer, rng.uniform(0, 2), rng.choice([0, 1]))


def test_out_of_range_ids_are_padding_on_cuda():
    cpu, gpu = pair(2, 8, 4, 4, 2)
    got = gpu.control([[1, 8], [-5, 2]], 1, 1.0, 1)
    want = cpu.control([[1, -1], [-1, 2]], 1, 1.0, 1)
    assert got == want and gpu.state() == cpu.state()


def test_cuda_limits():
    with pytest.raises(RuntimeError, match="num_experts"):
        OpCache(1, 4097, 8, 4, top_k=1, device="cuda").control([[1]], 0, 1.0, 0)
    with pytest.raises(RuntimeError, match="fill lists"):
        g = OpCache(1, 8, 8, 33, top_k=1, device="cuda")
        g.control([[1]], 0, 1.0, 0)


def _banks(rows, device="cpu", pin=False):
    g = torch.Generator().manual_seed(rows)
    bs = [
        torch.randn(rows, 3, 5, generator=g).to(torch.bfloat16),
        torch.randn(rows, 257, generator=g),  # row bytes not a multiple of 16
        torch.randint(-128, 127, (rows, 4096), generator=g, dtype=torch.int8),
    ]
    if pin:
        return [b.pin_memory() for b in bs]
    return [b.to(device) for b in bs]


@pytest.mark.parametrize("src_kind", ["pinned", "cuda"])
def test_bank_copy_matches_cpu(src_kind):
    rows, slots, F = 40, 12, 8
    src_cpu = _banks(rows)
    src = _banks(rows, pin=True) if src_kind == "pinned" else _banks(rows, "cuda")
    rng = random.Random(1)
    for n in (0, 1, 5, F):
        fs = rng.sample(range(rows), F)
        fd = rng.sample(range(slots), F)
        fill_src = torch.tensor(fs[:n] + [-1] * (F - n), dtype=torch.int32)
        fill_dst = torch.tensor(fd[:n] + [-1] * (F - n), dtype=torch.int32)
        counts = torch.tensor([n, 0, 0, 0], dtype=torch.int32)
        dst_cpu = [torch.zeros((slots,) + b.shape[1:], dtype=b.dtype) for b in src_cpu]
        dst = [d.cuda() for d in dst_cpu]
        control.expert_bank_copy(src_cpu, dst_cpu, control.FillList(fill_src, fill_dst, counts))
        control.expert_bank_copy(
            src, dst, control.FillList(fill_src.cuda(), fill_dst.cuda(), counts.cuda())
        )
        torch.cuda.synchronize()
        for d, w in zip(dst, dst_cpu):
            assert torch.equal(d.cpu(), w)


def test_bank_copy_refuses_pageable_source():
    src = [torch.zeros(4, 8)]
    dst = [torch.zeros(2, 8, device="cuda")]
    z = torch.zeros(1, dtype=torch.int32, device="cuda")
    with pytest.raises(RuntimeError, match="pinned"):
        control.expert_bank_copy(src, dst, control.FillList(z, z, z))


def test_cuda_graph_replay_matches_cpu():
    """Control + copy captured once, replayed with new routing: same as the CPU ops each step."""
    L, E, S, F, T, K = 4, 64, 64, 8, 8, 4
    cpu, gpu = pair(L, E, S, F, K)
    src_cpu = _banks(L * E)
    src = _banks(L * E, pin=True)
    dst_cpu = [torch.zeros((S,) + b.shape[1:], dtype=b.dtype) for b in src_cpu]
    dst = [d.cuda() for d in dst_cpu]
    static_ids = torch.full((T, K), -1, dtype=torch.int32, device="cuda")
    layer, ratio, policy = 2, 0.5, 0
    captured = {}

    def body():
        r = control.expert_cache_control(static_ids, layer, E, gpu.tables, gpu.fills, ratio, policy)
        control.expert_bank_copy(src, dst, r.fills)
        captured["routing"] = r

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up outside the graph, then undo its effect on the state
        body()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    for t in (
        gpu.tables.slot_of_id,
        gpu.tables.id_of_slot,
        gpu.tables.slot_last_use,
        gpu.tables.clock,
        gpu.tables.stats,
    ):
        t.fill_(-1 if t.dtype == torch.int32 or t is gpu.tables.slot_last_use else 0)
    for d in dst:
        d.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    rng = random.Random(5)
    for _ in range(40):
        topk = random_routing(rng, T, K, E, rng.sample(range(E), 10))
        static_ids.copy_(torch.tensor(topk, dtype=torch.int32))
        graph.replay()
        want = cpu.control(topk, layer, ratio, policy)
        control.expert_bank_copy(src_cpu, dst_cpu, cpu.fills)
        torch.cuda.synchronize()
        assert as_lists(captured["routing"]) == want
        assert gpu.state() == cpu.state()
        for d, w in zip(dst, dst_cpu):
            assert torch.equal(d.cpu(), w)


# ---- the CPU branch as stream work: copy + host function + copy (CpuBranchPlan.enqueue) -------


def _branch_problem(T, K=8, H=128, I=64, N=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).bfloat16()
    w13 = (torch.randn(N, 2 * I, H, generator=g) / H**0.5).bfloat16()
    w2 = (torch.randn(N, H, I, generator=g) / I**0.5).bfloat16()
    tw = torch.rand(T, K, generator=g)
    rows = torch.randint(0, N, (T, K), generator=g).int()
    rows[torch.rand(T, K, generator=g) < 0.3] = -1
    return x, tw, rows, w13, w2


def test_cpu_branch_enqueue_matches_the_executor():
    from sgl_kernel_fork.cpu_executor import CpuBranchPlan, moe_experts_cpu

    x, tw, rows, w13, w2 = _branch_problem(5)
    plan = CpuBranchPlan(16, 8, w13, w2)
    out = torch.full((5, 128), float("nan"), device="cuda")
    plan.enqueue(x.cuda(), tw.cuda(), rows.cuda(), out)
    torch.cuda.synchronize()
    want = torch.empty(5, 128)
    moe_experts_cpu(x, tw, [rows], [w13], [w2], want)
    assert torch.equal(out.cpu(), want)


def test_cpu_branch_is_captured_in_a_cuda_graph_and_replays_new_inputs():
    """Fork to a side stream, enqueue, join: captured once, replayed on new routing."""
    from sgl_kernel_fork.cpu_executor import CpuBranchPlan, moe_experts_cpu

    x, tw, rows, w13, w2 = _branch_problem(4, seed=1)
    plan = CpuBranchPlan(8, 8, w13, w2)
    sx, stw, srows = x.cuda(), tw.cuda(), rows.cuda()
    out = torch.zeros(4, 128, device="cuda")
    side = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            plan.enqueue(sx, stw, srows, out)
        main.wait_stream(side)
    for seed in (2, 3):
        x2, tw2, rows2, _, _ = _branch_problem(4, seed=seed)
        sx.copy_(x2)
        stw.copy_(tw2)
        srows.copy_(rows2)
        graph.replay()
        torch.cuda.synchronize()
        want = torch.empty(4, 128)
        moe_experts_cpu(x2, tw2, [rows2], [w13], [w2], want)
        assert torch.equal(out.cpu(), want), f"replay {seed}"


def test_a_captured_graph_follows_the_live_fill_ratio():
    """``live_fill_ratio`` is device data: one captured control call, replayed after the ratio
    changed (as bandwidth_drift changes it), fills by the new q* (compared with the CPU op)."""
    E, S, F, K = 32, 32, 16, 8
    ids = torch.arange(K, dtype=torch.int32).reshape(1, K)
    live = torch.zeros(1, dtype=torch.float64, device="cuda")
    static_ids = ids.cuda()
    fills = {}
    for ratio in (0.25, 1.0):  # the CPU op with the same ratio, from an empty cache each time
        cpu, _ = pair(1, E, S, F, K)
        r = control.expert_cache_control(ids, 0, E, cpu.tables, cpu.fills, ratio, "qstar")
        fills[ratio] = int(r.fills.counts[control.Stat.FILLS])
    assert fills[0.25] == 2 and fills[1.0] == K
    _, gpu = pair(1, E, S, F, K)
    initial = [
        t.clone()
        for t in (
            gpu.tables.slot_of_id,
            gpu.tables.id_of_slot,
            gpu.tables.slot_last_use,
            gpu.tables.clock,
            gpu.tables.stats,
        )
    ]
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up outside the graph (the state is reset before replays)
        control.expert_cache_control(
            static_ids, 0, E, gpu.tables, gpu.fills, 0.0, "qstar", live_fill_ratio=live
        )
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(graph):
        r = control.expert_cache_control(
            static_ids, 0, E, gpu.tables, gpu.fills, 0.0, "qstar", live_fill_ratio=live
        )
    for ratio in (0.25, 1.0):
        for t, v in zip(
            (
                gpu.tables.slot_of_id,
                gpu.tables.id_of_slot,
                gpu.tables.slot_last_use,
                gpu.tables.clock,
                gpu.tables.stats,
            ),
            initial,
        ):
            t.copy_(v)
        live.fill_(ratio)
        graph.replay()
        torch.cuda.synchronize()
        assert int(r.fills.counts[control.Stat.FILLS]) == fills[ratio], ratio
