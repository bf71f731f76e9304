"""The whole GPU path of one MoE layer call, ``ExpertSlotCache.forward`` on CUDA, against the
same cache on the CPU: control kernel, bank copy, upstream's Triton fused MoE over the slots,
and the CPU branch as stream work (copy + host function + copy on a side stream), eager and
captured in one CUDA graph.

Skipped without a GPU, without this fork's CUDA kernels (``sgl_kernel_fork._C_cuda``) or
without sglang importable (the device side is upstream's fused MoE). Run by
``scripts/gpu_checks.sh`` on a lent GPU machine.
"""

from __future__ import annotations

import pytest
import torch

HAS_CUDA_OP = torch.cuda.is_available() and torch._C._dispatch_has_kernel_for_dispatch_key(
    "sgl_kernel::expert_cache_control", "CUDA"
)
pytestmark = pytest.mark.skipif(
    not HAS_CUDA_OP,
    reason="needs a GPU and sgl_kernel_fork built with CUDA (torch.cuda unavailable here)",
)


@pytest.fixture(scope="module")
def runner_config():
    """A Qwen3-MoE layer's runner config, with the server state upstream's fused MoE reads."""
    pytest.importorskip("sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe")
    from test_slot_cache import runner_config

    from sglang.srt.runtime_context import get_parallel
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy"))
    with get_parallel().override(tp_group=None):
        yield runner_config()


def _tolerance(ref: torch.Tensor) -> dict:
    # bf16 experts through Triton (bf16 intermediate) vs our CPU kernel (bf16 h, fp32 sums).
    return dict(atol=2e-2 * max(1.0, float(ref.abs().max())), rtol=2e-2)


@pytest.mark.parametrize("stream_tokens", ["512", "1"])  # "1": batches > 1 take the prefill path
@pytest.mark.parametrize(
    "size,policy",
    [("100%", "fill"), ("4", "qstar"), ("25%", "qstar"), ("25%", "cpu"), ("50%", "fill")],
)
def test_forward_on_cuda_matches_the_cpu_cache(
    runner_config, monkeypatch, size, policy, stream_tokens
):
    from test_slot_cache import make_cache, routing

    from sglang.srt.layers.moe.expert_cache.cuda_branch import STREAM_TOKENS_ENV

    monkeypatch.setenv(STREAM_TOKENS_ENV, stream_tokens)
    cpu = make_cache(size, policy)
    gpu = make_cache(size, policy, device="cuda")
    assert gpu.num_slots == cpu.num_slots and gpu.host._registered  # pinned by cudaHostRegister
    for layer, x, w, ids in routing(steps=8, seed=4):
        want = cpu.forward(layer, x, w, ids)
        x_gpu = x.cuda()
        got = gpu.forward(layer, x_gpu, w.cuda(), ids.cuda(), runner_config)
        torch.testing.assert_close(got.float().cpu(), want.float(), **_tolerance(want))
        assert torch.equal(x_gpu.cpu(), x), "the layer call wrote into hidden_states"
        gpu.check_invariants()
    assert gpu.snapshot() == cpu.snapshot()  # the same control decisions, call by call


def test_forward_captured_in_one_cuda_graph(runner_config):
    """A decode-size layer call captured once and replayed with new routing: the same outputs
    and counters as the CPU cache call by call (the CPU branch runs from the graph)."""
    from test_slot_cache import H, K, make_cache, routing

    cpu = make_cache("25%", "qstar")
    gpu = make_cache("25%", "qstar", device="cuda")
    T = 2
    static_x = torch.zeros(T, H, dtype=torch.bfloat16, device="cuda")
    static_w = torch.zeros(T, K, dtype=torch.float32, device="cuda")
    static_ids = torch.full((T, K), -1, dtype=torch.int32, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up (all -1 ids: touches no table entry)
        gpu.forward(0, static_x, static_w, static_ids, runner_config)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graphs, outs = {}, {}
    for layer in range(3):
        graphs[layer] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[layer]):
            outs[layer] = gpu.forward(layer, static_x, static_w, static_ids, runner_config)
    calls = [c for c in routing(steps=10, seed=6) if c[1].shape[0] == T]
    assert calls
    for layer, x, w, ids in calls:
        want = cpu.forward(layer, x, w, ids)
        static_x.copy_(x)
        static_w.copy_(w)
        static_ids.copy_(ids)
        graphs[layer].replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(outs[layer].float().cpu(), want.float(), **_tolerance(want))
        gpu.check_invariants()
    snap_gpu, snap_cpu = gpu.snapshot(), cpu.snapshot()
    for k in ("hits", "misses", "fills", "cpu_experts"):
        assert snap_gpu[k] == snap_cpu[k], k
