"""The shared expert-slot cache end to end on the CPU, without a server.

One ``ExpertSlotCache`` per configuration (cache size x miss policy) runs the same random
routing sequence over several MoE layers. Checked:
* outputs are bit-identical across every size and policy (the CPU executor computes each
  (token, k) entry the same way from a slot or from the host pool and sums over k in order),
  and match a float64 torch reference of the MoE within bf16 rounding;
* the residency tables stay consistent after every call, and the counters add up;
* bad configurations fail with a clear error.
"""

import pytest
import torch

from sglang.srt.layers.moe.expert_cache.bandwidth import profile_path
from sglang.srt.layers.moe.expert_cache.cache import ExpertSlotCache
from sglang.srt.layers.moe.expert_cache.config import (
    CacheSize,
    ExpertCacheConfig,
    MissPolicy,
)

L, E, K, H, I = 3, 16, 4, 64, 48


def make_cache(size: str, policy: str, seed: int = 0, **kw) -> ExpertSlotCache:
    cfg = ExpertCacheConfig(
        size=CacheSize.parse(size),
        policy=MissPolicy.parse(policy),
        cpu_threads=kw.pop("cpu_threads", 2),
        fill_gbps=kw.pop("fill_gbps", 1.0),
        cpu_gbps=kw.pop("cpu_gbps", 2.0),
        record_routing=kw.pop("record_routing", None),
    )
    cache = ExpertSlotCache(
        cfg,
        num_layers=L,
        num_experts=E,
        top_k=K,
        hidden_size=H,
        intermediate_size=I,
        dtype=kw.pop("dtype", torch.bfloat16),
        device=kw.pop("device", "cpu"),
        host=kw.get("host"),
    )
    g = torch.Generator().manual_seed(seed)
    for layer in range(L):
        cache.register_layer(layer)
        for name in ("w13", "w2"):
            if kw.get("host") is None:  # a shared pool is already filled
                rows = cache.host_rows(name, layer)
                rows.copy_((torch.randn(rows.shape, generator=g) * 0.2).to(rows.dtype))
    cache.finalize()
    return cache


def runner_config():
    """The ``MoeRunnerConfig`` FusedMoE gives a Qwen3-MoE layer of this shape (``inplace=True``
    is upstream's default), for the tests of the device side."""
    from sglang.srt.layers.moe.moe_runner.base import MoeRunnerConfig

    return MoeRunnerConfig(
        num_experts=E,
        num_local_experts=E,
        hidden_size=H,
        intermediate_size_per_partition=I,
        top_k=K,
        params_dtype=torch.bfloat16,
        activation="silu",
        is_gated=True,
        inplace=True,
    )


def routing(steps: int, seed: int = 1):
    """(layer, x [T,H] bf16, weights [T,K] f32, ids [T,K] int32) per call, with some
    padding rows and a skewed expert popularity so hits and misses both happen."""
    g = torch.Generator().manual_seed(seed)
    calls = []
    popularity = torch.rand(E, generator=g) ** 3 + 0.01
    for step in range(steps):
        t = [1, 1, 2, 3, 7][step % 5]
        for layer in range(L):
            ids = torch.stack([torch.multinomial(popularity, K, generator=g) for _ in range(t)]).to(
                torch.int32
            )
            if step % 4 == 3:
                ids[-1] = -1  # a padded token
            w = torch.rand(t, K, generator=g)
            w = w / w.sum(-1, keepdim=True)
            x = torch.randn(t, H, generator=g).to(torch.bfloat16)
            calls.append((layer, x, w, ids))
    return calls


def reference(cache: ExpertSlotCache, layer, x, w, ids) -> torch.Tensor:
    out = torch.zeros(x.shape[0], H, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(K):
            e = int(ids[t, k])
            if e < 0:
                continue
            w13 = cache.host_rows("w13", layer)[e].double()
            w2 = cache.host_rows("w2", layer)[e].double()
            gu = w13 @ x[t].double()
            act = torch.nn.functional.silu(gu[:I]) * gu[I:]
            out[t] += float(w[t, k]) * (w2 @ act)
    return out


# ("100%", "fill") first: every expert resident from the load-time placement, the reference.
# Then every size from one layer's top-k to the whole pool under every miss policy, and auto
# (on a CPU device: no slots, everything on the CPU).
CONFIGS = (
    [("100%", "fill")]
    + [
        (size, policy)
        for size in (str(K), "25%", "50%", "100%")
        for policy in ("qstar", "fill", "cpu")
        if (size, policy) != ("100%", "fill")
    ]
    + [("auto", "qstar")]
)


def test_outputs_identical_across_sizes_and_policies():
    calls = routing(steps=12)
    outputs = {}
    for size, policy in CONFIGS:
        cache = make_cache(size, policy)
        outs = []
        distinct_total = 0
        for layer, x, w, ids in calls:
            outs.append(cache.forward(layer, x, w, ids))
            cache.check_invariants()
            distinct_total += int(torch.unique(ids[ids >= 0]).numel())
        snap = cache.snapshot()
        assert snap["hits"] + snap["misses"] == distinct_total
        assert snap["fills"] + snap["cpu_experts"] == snap["misses"]
        if policy == "cpu":
            assert snap["fills"] == 0
        if size == "100%":
            assert snap["misses"] == 0  # the load-time placement holds the whole pool
        elif cache.num_slots and policy != "cpu":
            assert snap["misses"] > 0 and snap["fills"] > 0
        if size == "auto":
            assert cache.num_slots == 0 and snap["cpu_experts"] == snap["misses"]
        outputs[(size, policy)] = outs
    base = outputs[CONFIGS[0]]
    for key, outs in outputs.items():
        for i, (a, b) in enumerate(zip(base, outs)):
            assert torch.equal(a, b), f"{key} differs from all-resident at call {i}"
    cache = make_cache("100%", "fill")
    for (layer, x, w, ids), got in zip(calls, base):
        ref = reference(cache, layer, x, w, ids)
        torch.testing.assert_close(got.double(), ref, atol=2e-2, rtol=1e-2)


def test_a_shared_host_pool_and_a_chunked_placement_change_nothing(monkeypatch):
    """A cache built over another cache's host pool (as the benchmarks build several) places
    and computes exactly as one with its own copy, also when the load-time placement is copied
    one row at a time; a pool of another shape is refused."""
    from sglang.srt.layers.moe.expert_cache import cache as cache_module

    own = make_cache("50%", "qstar")
    monkeypatch.setattr(cache_module, "PLACE_CHUNK_BYTES", 1)  # one row per copy
    shared = make_cache("50%", "qstar", host=own.host)
    assert shared.host is own.host
    for name in ("w13", "w2"):
        assert torch.equal(shared.slots[name], own.slots[name])
    assert torch.equal(shared.tables.id_of_slot, own.tables.id_of_slot)
    fresh = make_cache("50%", "qstar")  # same seed: same pool values, its own copy
    for layer, x, w, ids in routing(steps=4):
        assert torch.equal(shared.forward(layer, x, w, ids), fresh.forward(layer, x, w, ids))
    with pytest.raises(ValueError, match="this cache needs"):
        ExpertSlotCache(
            ExpertCacheConfig(),
            num_layers=L + 1,
            num_experts=E,
            top_k=K,
            hidden_size=H,
            intermediate_size=I,
            dtype=torch.bfloat16,
            device="cpu",
            host=own.host,
        )


@pytest.mark.parametrize("size,policy", [("100%", "fill"), (str(K), "qstar")])
def test_scale_multiplies_the_fp32_sum_before_its_one_rounding(size, policy):
    """``forward(scale=s)`` (the routed scaling factor where upstream applies it inside the
    layer, ``method.output_scale``): bf16(s * the fp32 routed sum), bit for bit, for any split
    between slots and host pool; the fp32 sum is the executor's over the host pool alone."""
    cache = make_cache(size, policy)
    for layer, x, w, ids in routing(steps=4):
        got = cache.forward(layer, x, w, ids, scale=2.5)
        fp32_sum = torch.empty(x.shape[0], H, dtype=torch.float32)
        host_ids = torch.where(ids >= 0, ids + layer * E, ids).to(torch.int32)
        torch.ops.sgl_kernel.moe_experts_cpu(
            x, w.float(), [host_ids], [cache.host["w13"]], [cache.host["w2"]], fp32_sum, False
        )
        assert torch.equal(got, (fp32_sum * 2.5).to(torch.bfloat16)), (size, policy, layer)


def test_qstar_splits_misses_by_bandwidth_ratio():
    """With B_P / B_H = 0.5 a call with m misses fills round(m / 2) (at least one)."""
    cache = make_cache(str(L * E), "qstar", fill_gbps=1.0, cpu_gbps=2.0)
    # Empty the cache so every routed expert misses.
    cache.tables.slot_of_id.fill_(-1)
    cache.tables.id_of_slot.fill_(-1)
    cache.tables.slot_last_use.fill_(-1)
    x = torch.randn(2, H).to(torch.bfloat16)
    w = torch.full((2, K), 1.0 / K)
    ids = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]], dtype=torch.int32)
    cache.forward(0, x, w, ids)
    snap = cache.snapshot()
    assert (snap["misses"], snap["fills"], snap["cpu_experts"]) == (8, 4, 4)
    cache.forward(1, x[:1], w[:1, :1], ids[:1, :1])
    snap = cache.snapshot()
    assert (snap["misses"], snap["fills"], snap["cpu_experts"]) == (9, 5, 4)


def test_size_parsing():
    assert CacheSize.parse(None).is_auto and CacheSize.parse("auto").is_auto
    assert CacheSize.parse("256").slots == 256
    assert CacheSize.parse("25%").fraction == 0.25
    assert CacheSize.parse("4GB").bytes == 4 * 10**9
    assert CacheSize.parse("512MiB").bytes == 512 * 2**20
    assert CacheSize.parse("25%").resolve(pool_experts=200, expert_bytes=10, auto_slots=0) == 50
    assert CacheSize.parse("1000").resolve(pool_experts=200, expert_bytes=10, auto_slots=0) == 200
    assert CacheSize.parse("1KB").resolve(pool_experts=200, expert_bytes=10, auto_slots=0) == 100
    for bad in ("-3", "0%", "150%", "2.5", "lots", "4 parsecs"):
        with pytest.raises(ValueError, match="--expert-cache-size"):
            CacheSize.parse(bad)
    with pytest.raises(ValueError, match="--expert-cache-policy"):
        MissPolicy.parse("random")


def test_cache_smaller_than_top_k_is_a_clear_error():
    with pytest.raises(ValueError, match="fewer than one layer's top-k"):
        make_cache(str(K - 1), "qstar")


def test_unsupported_expert_dtype_is_a_clear_error():
    with pytest.raises(ValueError, match="--dtype bfloat16"):
        make_cache("25%", "qstar", dtype=torch.float32)


def test_bandwidths_are_measured_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_EXPERT_CACHE_PROFILE_PATH", str(tmp_path / "bw.json"))
    assert profile_path() == tmp_path / "bw.json"
    first = make_cache("25%", "qstar", fill_gbps=None, cpu_gbps=None)
    assert first.bandwidths.source == "measured"
    assert first.bandwidths.fill_gbps > 0 and first.bandwidths.cpu_gbps > 0
    second = make_cache("25%", "qstar", fill_gbps=None, cpu_gbps=None)
    assert second.bandwidths.source == "cached"
    assert second.bandwidths.fill_ratio == first.bandwidths.fill_ratio
    third = make_cache("25%", "qstar", fill_gbps=None, cpu_gbps=3.0)
    assert third.bandwidths.cpu_gbps == 3.0 and third.bandwidths.source == "flags+cached"


def test_routing_trace_recorded(tmp_path):
    import json

    path = tmp_path / "routing.jsonl"
    cache = make_cache("25%", "qstar", record_routing=str(path))
    calls = routing(steps=2)
    for layer, x, w, ids in calls:
        cache.forward(layer, x, w, ids)
    cache.recorder.close()
    lines = [json.loads(s) for s in path.read_text().splitlines()]
    assert len(lines) == len(calls)
    for rec, (layer, _x, _w, ids) in zip(lines, calls):
        assert rec["layer"] == layer and rec["tokens"] == ids.shape[0]
        assert rec["experts"] == sorted(set(ids[ids >= 0].tolist()))
        assert sum(rec["counts"]) == int((ids >= 0).sum())
        assert rec["phase"] == ("decode" if ids.shape[0] == 1 else "prefill")
        assert (rec["num_experts"], rec["num_layers"]) == (E, L)
    assert [r["step"] for r in lines] == [i // L for i in range(len(calls))]


def test_no_slots_runs_every_expert_on_the_cpu_and_measures_nothing(tmp_path, monkeypatch):
    """With no slots every expert runs on the CPU: B_P / B_H are not measured (nor cached), and
    the control op (the same call as with slots, S = 0) counts a call's distinct routed experts
    as misses run on the CPU; an id outside [-1, E) is refused as with slots."""
    monkeypatch.setenv("SGLANG_EXPERT_CACHE_PROFILE_PATH", str(tmp_path / "bw.json"))
    cache = make_cache("auto", "qstar", fill_gbps=None, cpu_gbps=None)
    assert cache.num_slots == 0 and cache.bandwidths.source == "unused: no slots"
    assert not (tmp_path / "bw.json").exists()
    ids = torch.tensor([[3, 5, -1, 1], [5, 7, 3, -1]], dtype=torch.int32)
    r = cache.route(1, ids)
    assert (r.slot_ids == -1).all()
    assert r.cpu_ids.tolist() == [[E + 3, E + 5, -1, E + 1], [E + 5, E + 7, E + 3, -1]]
    snap = cache.snapshot()
    assert (snap["misses"], snap["cpu_experts"], snap["fills"], snap["hits"]) == (4, 4, 0, 0)
    assert snap["calls"] == 1
    with pytest.raises(RuntimeError, match=r"outside \[-1, 16\)"):
        cache.route(1, torch.tensor([[3, E, -1, 1]], dtype=torch.int32))


def test_cuda_kernel_limits_are_checked_at_startup(monkeypatch):
    """The CUDA control kernel's presence and limits (F <= 32, E <= 4096) are checked when the
    cache is sized, with what to change, not at the first forward (the kernel lookup is stubbed
    where no CUDA kernel is built)."""
    from sglang.srt.layers.moe.expert_cache.cuda_branch import check_cuda_support

    lookup = torch._C._dispatch_has_kernel_for_dispatch_key
    monkeypatch.setattr(torch._C, "_dispatch_has_kernel_for_dispatch_key", lambda op, key: False)
    with pytest.raises(RuntimeError, match="rerun `make setup`"):
        check_cuda_support(E, 16, None)
    monkeypatch.setattr(
        torch._C,
        "_dispatch_has_kernel_for_dispatch_key",
        lambda op, key: key == "CUDA" or lookup(op, key),
    )
    assert check_cuda_support(E, 16, None) == 16
    assert check_cuda_support(E, 40, None) == 32  # 2 x top-k of a top-20 model: clamped
    with pytest.raises(ValueError, match="--expert-cache-max-fills 40 .* at most 32"):
        check_cuda_support(E, 40, 40)
    with pytest.raises(ValueError, match="at most 4096 routed experts"):
        check_cuda_support(5000, 16, None)
