"""The whole GPU path of one MoE layer call, ``ExpertSlotCache.forward`` on CUDA, against the
same cache on the CPU: control kernel, bank copy, upstream's Triton fused MoE over the slots,
and the CPU branch as stream work (copy + host function + copy on a side stream), eager and
captured in one CUDA graph; and the no-slot fallback on CUDA (pinning refused, or ``auto``
leaving fewer slots than top-k), eager and in a graph.

Outputs must match the CPU cache within ``TOL`` of the output's scale: max |GPU - CPU| <=
``TOL * max(1, max |CPU|)`` (bf16 experts through Triton with a bf16 intermediate, against our
CPU kernel's bf16 intermediate and float32 sums). The control decisions must be identical.

Skipped without a GPU or without this fork's CUDA kernels (``sgl_kernel_fork._C_cuda``). On a
machine without upstream's CUDA kernel wheel the fused MoE's glue ops are stood in for
(``sglang/test/bare_fused_moe.py``). Run by ``scripts/gpu_checks.sh`` on a lent GPU machine.
"""

from __future__ import annotations

import logging

import pytest
import torch

HAS_CUDA_OP = torch.cuda.is_available() and torch._C._dispatch_has_kernel_for_dispatch_key(
    "sgl_kernel::expert_cache_control", "CUDA"
)
pytestmark = pytest.mark.skipif(
    not HAS_CUDA_OP,
    reason="needs a GPU and sgl_kernel_fork built with CUDA (torch.cuda unavailable here)",
)

TOL = 2e-2  # of the output's scale; README.md (expert_cache) states this figure


@pytest.fixture(scope="module")
def runner_config():
    """A Qwen3-MoE layer's runner config, with the server state upstream's fused MoE reads."""
    from sglang.test.bare_fused_moe import install_cuda_standins, server_state

    install_cuda_standins()
    pytest.importorskip("sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe")
    from test_slot_cache import runner_config

    with server_state("cuda"):
        yield runner_config()


def assert_close_to_cpu(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    """max |got - want| <= TOL * max(1, max |want|), both read as float32 on the CPU."""
    got, want = got.float().cpu(), want.float()
    scale = max(1.0, float(want.abs().max()))
    err = float((got - want).abs().max()) / scale
    assert err <= TOL, f"{what}: GPU off the CPU cache by {err:.2e} of the scale (> {TOL})"


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
    assert all(t.is_pinned() for t in gpu.host.bank_list())  # as the bank copy checks
    for layer, x, w, ids in routing(steps=8, seed=4):
        want = cpu.forward(layer, x, w, ids)
        x_gpu = x.cuda()
        got = gpu.forward(layer, x_gpu, w.cuda(), ids.cuda(), runner_config)
        assert_close_to_cpu(got, want, f"{size}/{policy} layer {layer}")
        assert torch.equal(x_gpu.cpu(), x), "the layer call wrote into hidden_states"
        gpu.check_invariants()
    assert gpu.snapshot() == cpu.snapshot()  # the same control decisions, call by call


@pytest.mark.parametrize("size,policy", [("25%", "qstar"), ("100%", "fill")])
def test_scale_on_cuda_multiplies_the_sum_of_both_halves_once(runner_config, size, policy):
    """``forward(scale=s)`` on CUDA (the routed scaling factor of GLM / DeepSeek, which upstream
    applies inside the Triton combine there, ``method.output_scale``): the slot half runs
    unscaled and the fp32 sum of slot and CPU halves is scaled once, so the output matches the
    CPU cache's scaled output, and a factor applied twice (or to one half only) does not."""
    from test_slot_cache import make_cache, routing

    cpu = make_cache(size, policy)
    gpu = make_cache(size, policy, device="cuda")
    for layer, x, w, ids in routing(steps=6, seed=11):
        want = cpu.forward(layer, x, w, ids, scale=2.5)
        got = gpu.forward(layer, x.cuda(), w.cuda(), ids.cuda(), runner_config, scale=2.5)
        assert_close_to_cpu(got, want, f"scale 2.5, {size}/{policy} layer {layer}")
        twice = (want.float() * 2.5).to(want.dtype)
        if float(want.abs().max()) > 0.1:  # a factor applied twice is caught
            with pytest.raises(AssertionError):
                assert_close_to_cpu(got, twice, "factor twice")
    assert gpu.snapshot() == cpu.snapshot()


def replay_matches_cpu(cpu, gpu, runner_config, seed: int = 6, T: int = 2) -> None:
    """Capture one decode-size layer call per layer once, replay them with new routing: the
    same outputs and counters as the CPU cache call by call (the CPU branch runs from the
    graph, so nothing on the path may sync the host)."""
    from test_slot_cache import H, K, L, routing

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
    for layer in range(L):
        graphs[layer] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[layer]):
            outs[layer] = gpu.forward(layer, static_x, static_w, static_ids, runner_config)
    calls = [c for c in routing(steps=10, seed=seed) if c[1].shape[0] == T]
    assert calls
    before_gpu, before_cpu = gpu.snapshot(), cpu.snapshot()
    for layer, x, w, ids in calls:
        want = cpu.forward(layer, x, w, ids)
        static_x.copy_(x)
        static_w.copy_(w)
        static_ids.copy_(ids)
        graphs[layer].replay()
        torch.cuda.synchronize()
        assert_close_to_cpu(outs[layer], want, f"replay layer {layer}")
        gpu.check_invariants()
    snap_gpu, snap_cpu = gpu.snapshot(), cpu.snapshot()
    for k in ("hits", "misses", "fills", "cpu_experts"):
        assert snap_gpu[k] - before_gpu[k] == snap_cpu[k] - before_cpu[k], k


def test_forward_captured_in_one_cuda_graph(runner_config):
    from test_slot_cache import make_cache

    replay_matches_cpu(
        make_cache("25%", "qstar"), make_cache("25%", "qstar", device="cuda"), runner_config
    )


class _RefusingCudart:
    """``torch.cuda.cudart()`` whose ``cudaHostRegister`` fails, as a driver that cannot
    page-lock the pool does (cudaErrorMemoryAllocation = 2)."""

    def __init__(self, real):
        self._real = real
        self.refused = 0

    def cudaHostRegister(self, *_args):
        self.refused += 1
        return 2

    def cudaHostUnregister(self, *_args):
        return 0

    def __getattr__(self, name):
        return getattr(self._real, name)


@pytest.mark.parametrize("why", ["pinning refused", "auto below top-k"])
def test_no_slots_on_cuda_runs_every_expert_on_the_cpu(runner_config, monkeypatch, caplog, why):
    """The pure-CPU fallback on CUDA (README: Sizing): the server starts with 0 slots and a
    warning, every routed expert runs on the CPU branch, the control kernel still runs (with
    S = 0), and a decode call is still captured in one CUDA graph."""
    from test_slot_cache import K, make_cache, routing

    from sglang.srt.layers.moe.expert_cache import banks, config

    if why == "pinning refused":
        cudart = _RefusingCudart(torch.cuda.cudart())
        monkeypatch.setattr(banks.torch.cuda, "cudart", lambda: cudart)
        size, warning = "25%", "cannot be pinned"
    else:
        bytes_of = make_cache("25%", "qstar").host.expert_bytes
        total = torch.cuda.mem_get_info()[1]
        # auto takes half of the free memory: room for K - 1 experts
        monkeypatch.setattr(
            config.torch.cuda, "mem_get_info", lambda *_a: (2 * (K - 1) * bytes_of, total)
        )
        size, warning = "auto", "every expert runs on the CPU"
    with caplog.at_level(logging.WARNING):
        gpu = make_cache(size, "qstar", device="cuda")
    assert gpu.num_slots == 0 and gpu.slots["w13"].shape[0] == 0
    assert warning in caplog.text
    if why == "pinning refused":
        assert cudart.refused >= 1 and not gpu.host._registered
    monkeypatch.undo()  # graph capture and the CPU cache use the real driver calls
    cpu = make_cache("auto", "qstar")  # 0 slots on a CPU device
    for layer, x, w, ids in routing(steps=5, seed=9):
        want = cpu.forward(layer, x, w, ids)
        got = gpu.forward(layer, x.cuda(), w.cuda(), ids.cuda(), runner_config)
        assert_close_to_cpu(got, want, f"{why}: layer {layer}")
    snap, want = gpu.snapshot(), cpu.snapshot()
    del snap["fill_ratio"], want["fill_ratio"]  # nan without slots (nothing measured)
    assert snap == want
    assert snap["fills"] == snap["hits"] == 0 and snap["cpu_experts"] == snap["misses"] > 0
    replay_matches_cpu(cpu, gpu, runner_config, seed=10)
