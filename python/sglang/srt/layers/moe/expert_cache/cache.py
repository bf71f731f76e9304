"""The expert-slot cache: one LRU pool of complete-expert slots shared by every MoE layer.

FreeToken §3.2 and §4.1. The host pool (:class:`ExpertBanks` on the CPU) holds every routed
expert and is the source of truth; the device holds ``S`` slots in the same bank layout. For
each MoE layer call:

1. ``sgl_kernel.expert_cache_control`` (one op; C++ on CPU, CUDA on GPU, no host sync)
   dedupes the routed ids, classifies hits and misses against the residency table, splits the
   ``m`` misses into ``q = round(m * B_P / B_H)`` fills (at least one) and ``m - q`` experts
   run on the CPU, picks ``q`` LRU victims in one pass, and rewrites each routed id into a
   slot id or a CPU id (the global id ``layer * E + expert``, a host-pool row).
2. ``sgl_kernel.expert_bank_copy`` copies the filled experts host -> slot, all banks in one
   launch, masked by the device-resident fill count.
3. The device computes hits and fills from the slots; the CPU executor
   (``sgl_kernel.moe_experts_cpu``) computes the CPU misses from the host pool; the two
   partial sums are added.

On a CPU-only machine the "device" is the CPU: both sides run in one ``moe_experts_cpu``
call over two bank sets, which computes every (token, k) entry identically whichever set
holds its expert and sums over k in a fixed order, so the output is bit-identical for any
cache size and policy (tested). On a GPU the device side is SGLang's Triton fused-MoE over
the slot table; the sum then matches the resident layer within the tolerance of a change
of MoE kernel.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Dict, Optional

import torch

from sglang.srt.layers.moe.expert_cache.bandwidth import (
    Bandwidths,
    profile_key,
    resolve_bandwidths,
    time_gbps,
)
from sglang.srt.layers.moe.expert_cache.banks import ExpertBanks, format_for_dtype
from sglang.srt.layers.moe.expert_cache.config import ExpertCacheConfig, MissPolicy

logger = logging.getLogger(__name__)

# Index of each counter in the op's cumulative ``stats`` tensor.
STAT_HITS, STAT_MISSES, STAT_FILLS, STAT_CPU = range(4)

# Batches up to this many tokens run their CPU branch as stream work (copy + host function +
# copy, capturable in a CUDA graph); page-locked staging costs tokens * (6 * H + 8 * K) bytes.
STREAM_BRANCH_MIN_TOKENS = 512
STREAM_TOKENS_ENV = "SGLANG_EXPERT_CACHE_STREAM_TOKENS"


def stream_branch_tokens() -> int:
    """Rows of the CPU branch's staging: ``$SGLANG_EXPERT_CACHE_STREAM_TOKENS`` if set, else the
    largest of 512 and the decode CUDA-graph batch size times the speculative draft tokens
    (every batch a graph may capture)."""
    env = os.environ.get(STREAM_TOKENS_ENV)
    if env:
        return max(1, int(env))
    n = STREAM_BRANCH_MIN_TOKENS
    try:
        from sglang.srt.runtime_context import get_server_args

        args = get_server_args()
        bs = max(
            getattr(args, f, None) or 0
            for f in ("cuda_graph_max_bs", "cuda_graph_max_bs_decode")
        )
        n = max(n, bs * max(1, getattr(args, "speculative_num_draft_tokens", None) or 1))
    except Exception:  # no server (tests, benchmarks)
        pass
    return n


def _ops():
    import sgl_kernel_fork  # noqa: F401  (registers torch.ops.sgl_kernel.*)

    return torch.ops.sgl_kernel


class ExpertSlotCache:
    """Host pool, device slots, residency tables and per-layer execution for one model.

    Args:
        config: the parsed flags.
        num_layers: decoder layers of the model; global expert ids are
            ``layer_id * num_experts + expert`` (rows of dense layers stay untouched).
        num_experts: routed experts per MoE layer (E).
        top_k: experts routed per token (K).
        hidden_size, intermediate_size: the expert shape (H, I).
        dtype: expert weight dtype (BF16 only for now).
        device: where the slots live (the model's device).

    Raises:
        ValueError: unsupported expert dtype.
    """

    def __init__(
        self,
        config: ExpertCacheConfig,
        *,
        num_layers: int,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        self.config = config
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.top_k = top_k
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.device = torch.device(device)
        self.format = format_for_dtype(dtype)
        self.host = ExpertBanks(
            self.format, hidden_size, intermediate_size, num_layers * num_experts, "cpu"
        )
        self.layer_ids: set[int] = set()
        self.slots: Optional[ExpertBanks] = None
        self.num_slots = 0
        self.policy = config.policy
        self.bandwidths: Optional[Bandwidths] = None
        self._eager_calls = 0  # Python-side calls (a graph replay adds none)
        self.clock: Optional[torch.Tensor] = None  # [1] int64 on the device: layer calls
        self._metrics = None
        self._branch = None  # (CpuBranchPlan, side stream) on CUDA, made on first use
        self.recorder = None
        if config.record_routing:
            from sglang.srt.layers.moe.expert_cache.routing_trace import RoutingRecorder

            self.recorder = RoutingRecorder(config.record_routing, num_experts, num_layers)

    # ------------------------------------------------------------------ setup
    def check_shape(self, num_experts, top_k, hidden_size, intermediate_size, dtype):
        """Raise ValueError unless a layer has the shape this cache was built for."""
        got = (num_experts, top_k, hidden_size, intermediate_size, dtype)
        want = (
            self.num_experts,
            self.top_k,
            self.hidden_size,
            self.intermediate_size,
            self.format.dtype,
        )
        if got != want:
            raise ValueError(
                "--enable-expert-cache needs every MoE layer to have the same expert shape "
                f"(experts, top-k, hidden, intermediate, dtype); got {got}, expected {want}. "
                "Serve this model without --enable-expert-cache"
            )

    def register_layer(self, layer_id: int) -> None:
        if not 0 <= layer_id < self.num_layers:
            raise ValueError(
                f"MoE layer id {layer_id} outside [0, {self.num_layers}) of the model config"
            )
        if self.finalized:
            raise RuntimeError("Expert cache: a MoE layer was created after the cache was built")
        self.layer_ids.add(layer_id)

    def host_rows(self, bank: str, layer_id: int) -> torch.Tensor:
        """The host-pool rows of one layer in ``bank``: a view [E, *row_shape]."""
        e = self.num_experts
        return self.host[bank][layer_id * e : (layer_id + 1) * e]

    @property
    def finalized(self) -> bool:
        return self.slots is not None

    @property
    def pool_experts(self) -> int:
        """Routed experts in the model: MoE layers x experts per layer."""
        return len(self.layer_ids) * self.num_experts

    def _auto_slots(self) -> int:
        """What ``--expert-cache-size auto`` means on this device.

        CPU: 0 slots. The "device" is the host, so a copy of an expert is never faster to
        execute than the pool row itself; every expert runs from the pool.
        CUDA: half of the free device memory after the weights (the other half is left to
        KV pages and activations), in whole experts.
        """
        if self.device.type != "cuda":
            return 0
        free, _ = torch.cuda.mem_get_info(self.device)
        return int(free * 0.5) // self.host.expert_bytes

    def finalize(self) -> None:
        """Size and fill the slots, pin the host pool, measure B_P / B_H. Called once all
        weights are loaded (the first layer's ``process_weights_after_loading``); later calls
        do nothing.

        Raises:
            ValueError: an explicit ``--expert-cache-size`` below the router's top-k.
        """
        if self.finalized:
            return
        cfg = self.config
        slots = cfg.size.resolve(
            self.pool_experts, self.host.expert_bytes, self._auto_slots()
        )
        if 0 < slots < self.top_k or (slots == 0 and not cfg.size.is_auto):
            if not cfg.size.is_auto:
                raise ValueError(
                    f"--expert-cache-size gives {slots} expert slots, fewer than one layer's "
                    f"top-k ({self.top_k}); give at least {self.top_k} slots "
                    f"({self.top_k * self.host.expert_bytes / 1e6:.1f} MB) or leave it at auto"
                )
            logger.warning(
                "Expert cache: only %d slots fit (top-k is %d); every expert runs on the CPU",
                slots,
                self.top_k,
            )
            slots = 0
        if self.device.type == "cuda" and slots > 0 and not self.host.pin():
            logger.warning(
                "Expert cache: the host pool cannot be pinned; every expert runs on the CPU "
                "(pure-CPU MoE fallback, FreeToken §4.2)"
            )
            slots = 0
        self.num_slots = slots
        self.slots = ExpertBanks(
            self.format, self.hidden_size, self.intermediate_size, slots, self.device
        )
        i32 = dict(dtype=torch.int32, device=self.device)
        i64 = dict(dtype=torch.int64, device=self.device)
        total_ids = self.num_layers * self.num_experts
        self.slot_of_id = torch.full((total_ids,), -1, **i32)
        self.id_of_slot = torch.full((slots,), -1, **i32)
        self.slot_last_use = torch.full((slots,), -1, **i64)
        self.clock = torch.zeros(1, **i64)
        self.stats = torch.zeros(4, **i64)
        self.counts = torch.zeros(4, **i32)
        self.max_fills = max(1, min(cfg.max_fills or 2 * self.top_k, max(slots, 1)))
        if self.device.type == "cuda" and slots > 0:
            self.max_fills = self._check_cuda_limits(self.max_fills)
        self.fill_src = torch.full((self.max_fills,), -1, **i32)
        self.fill_dst = torch.full((self.max_fills,), -1, **i32)
        self._place_at_load()
        if self.device.type == "cuda":
            self._cpu_branch()  # page-locked staging allocated before any graph capture
        threads = _ops().expert_pool_set_threads(cfg.cpu_threads)
        if slots:
            self.bandwidths = self._bandwidths(threads)
        else:
            # Every miss runs on the CPU: no q* split to set, and on CUDA the host pool was not
            # pinned, which the fill probe needs. Nothing is measured or cached.
            nan = float("nan")
            self.bandwidths = Bandwidths(nan, nan, "unused: no slots")
        logger.info(
            "Expert cache: %d slots (%.1f MB) for %d routed %s experts on %s, policy %s, "
            "B_P %.2f GB/s, B_H %.2f GB/s (%s), q*/m = %.2f, %d CPU threads",
            slots,
            slots * self.host.expert_bytes / 1e6,
            self.pool_experts,
            self.format.label,
            self.device,
            self.policy.name.lower(),
            self.bandwidths.fill_gbps,
            self.bandwidths.cpu_gbps,
            self.bandwidths.source,
            self.bandwidths.fill_ratio,
            threads,
        )

    def _check_cuda_limits(self, max_fills: int) -> int:
        """The CUDA control kernel's limits (``csrc/cuda/expert_cache.h``), checked at startup
        instead of at the first forward. Returns the fill-list capacity to use.

        Raises:
            RuntimeError: the CUDA kernels were not built.
            ValueError: more routed experts per layer than the kernel handles, or an explicit
                ``--expert-cache-max-fills`` above its fill-list capacity.
        """
        from sglang.srt.layers.moe.expert_cache.control import (
            CUDA_MAX_EXPERTS,
            CUDA_MAX_FILL,
        )

        if not torch._C._dispatch_has_kernel_for_dispatch_key(
            "sgl_kernel::expert_cache_control", "CUDA"
        ):
            raise RuntimeError(
                "--enable-expert-cache on CUDA needs sgl_kernel_fork built with its CUDA kernels "
                "(sgl_kernel_fork._C_cuda); rerun `make setup` on this machine with the CUDA "
                "toolkit (nvcc) installed"
            )
        if self.num_experts > CUDA_MAX_EXPERTS:
            raise ValueError(
                f"--enable-expert-cache on CUDA handles at most {CUDA_MAX_EXPERTS} routed experts "
                f"per layer; this model has {self.num_experts}. Serve it without the expert cache"
            )
        if max_fills <= CUDA_MAX_FILL:
            return max_fills
        if self.config.max_fills:
            raise ValueError(
                f"--expert-cache-max-fills {self.config.max_fills} is above the CUDA kernel's "
                f"fill-list capacity; give at most {CUDA_MAX_FILL}"
            )
        logger.info(
            "Expert cache: at most %d fills per layer call on CUDA (2 x top-k would be %d)",
            CUDA_MAX_FILL,
            max_fills,
        )
        return CUDA_MAX_FILL

    def _place_at_load(self) -> None:
        """Fill the slots with a neutral load-time placement: experts 0, 1, ... of every MoE
        layer in turn (each layer gets S / L slots). Policy ``cpu`` keeps it for good."""
        layers = sorted(self.layer_ids)
        if not self.num_slots or not layers:
            return
        ids = [
            layers[s % len(layers)] * self.num_experts + s // len(layers)
            for s in range(self.num_slots)
        ]
        src = torch.tensor(ids, dtype=torch.int64)
        for name, bank in self.slots.tensors.items():
            bank.copy_(self.host[name].index_select(0, src).to(self.device))
        self.id_of_slot.copy_(src.to(torch.int32))
        self.slot_of_id[src.to(self.device)] = torch.arange(
            self.num_slots, dtype=torch.int32, device=self.device
        )
        self.slot_last_use.fill_(0)

    def _bandwidths(self, threads: int) -> Bandwidths:
        cfg = self.config
        e = self.num_experts
        layers = sorted(self.layer_ids) or [0]
        # Every timed call reads n experts not read by the previous calls (a deterministic
        # walk over the whole pool, layers interleaved), so the figures are memory, not
        # last-level-cache, bandwidths on any pool larger than the LLC.
        n = min(self.top_k, self.pool_experts) or 1
        pool = torch.tensor(
            [l * e + x for x in range(e) for l in layers], dtype=torch.int32
        )
        walk = {"pos": 0}

        def next_probe() -> torch.Tensor:
            p = walk["pos"]
            walk["pos"] = (p + n) % max(1, pool.numel() - n + 1)
            return pool[p : p + n]

        nbytes = n * self.host.expert_bytes
        ops = _ops()

        def measure_fill() -> float:
            # Into scratch rows, so the load-time placement in the slots stays intact.
            scratch = ExpertBanks(
                self.format, self.hidden_size, self.intermediate_size, n, self.device
            )
            dst = torch.arange(n, dtype=torch.int32, device=self.device)
            count = torch.tensor([n, 0, 0, 0], dtype=torch.int32, device=self.device)

            def run() -> int:
                src = next_probe().to(self.device)
                ops.expert_bank_copy(
                    self.host.bank_list(), scratch.bank_list(), src, dst, count
                )
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                return nbytes

            return time_gbps(run)

        def measure_cpu() -> float:
            x = torch.randn(1, self.hidden_size, dtype=torch.float32).to(self.format.dtype)
            # Explicit dtypes: model loading runs under torch.set_default_dtype(model dtype).
            w = torch.full((1, n), 1.0 / n, dtype=torch.float32)
            out = torch.empty(1, self.hidden_size, dtype=torch.float32)

            def run() -> int:
                rows = next_probe().view(1, n)
                ops.moe_experts_cpu(
                    x, w, [rows], [self.host["w13"]], [self.host["w2"]], out, False
                )
                return nbytes

            return time_gbps(run)

        key = profile_key(
            self.device,
            self.format.label,
            f"H{self.hidden_size}xI{self.intermediate_size}",
            threads,
        )
        t0 = time.perf_counter()
        bw = resolve_bandwidths(
            key=key,
            fill_override=cfg.fill_gbps,
            cpu_override=cfg.cpu_gbps,
            measure_fill=measure_fill,
            measure_cpu=measure_cpu,
        )
        logger.info(
            "Expert cache: bandwidths %s in %.0f ms", bw.source, 1e3 * (time.perf_counter() - t0)
        )
        return bw

    # ---------------------------------------------------------------- forward
    def route(self, layer_id: int, topk_ids: torch.Tensor):
        """Run the control step and the fill copy for one layer call.

        Args:
            layer_id: the MoE layer.
            topk_ids: [T, K] int32 layer-local routed ids, -1 = padding.

        Returns:
            (slot_ids, cpu_ids): [T, K] int32 each; an entry is a slot (device side) in
            ``slot_ids`` or a host-pool row in ``cpu_ids``, -1 in the other (both -1 for
            padding).
        """
        slot_ids, cpu_ids = self.control(layer_id, topk_ids)
        self.fill()
        return slot_ids, cpu_ids

    def control(self, layer_id: int, topk_ids: torch.Tensor):
        """The control step alone (FreeToken §4 "Device-side cache control"): tables updated,
        routed ids rewritten, the fill work list of this call in ``fill_src`` / ``fill_dst`` /
        ``counts``, not yet copied (:meth:`fill`). Arguments and results as :meth:`route`.
        Advances ``clock`` by one per call, with or without slots (the call counter)."""
        e = self.num_experts
        if self.num_slots == 0:
            # Out-of-range ids are padding, as in the control op. The distinct routed experts
            # are counted on the device, without a host sync, so this path is capturable too.
            valid = (topk_ids >= 0) & (topk_ids < e)
            cpu_ids = torch.where(valid, topk_ids + layer_id * e, -1).to(torch.int32)
            seen = torch.zeros(e + 1, dtype=torch.bool, device=topk_ids.device)
            seen[torch.where(valid, topk_ids, e).long().flatten()] = True
            distinct = seen[:e].sum()
            self.stats[STAT_MISSES] += distinct
            self.stats[STAT_CPU] += distinct
            self.clock += 1
            return torch.full_like(cpu_ids, -1), cpu_ids
        slot_ids = torch.empty_like(topk_ids)
        cpu_ids = torch.empty_like(topk_ids)
        _ops().expert_cache_control(
            topk_ids,
            layer_id,
            e,
            self.slot_of_id,
            self.id_of_slot,
            self.slot_last_use,
            self.clock,
            slot_ids,
            cpu_ids,
            self.fill_src,
            self.fill_dst,
            self.counts,
            self.stats,
            float(self.bandwidths.fill_ratio),
            int(self.policy),
        )
        return slot_ids, cpu_ids

    def fill(self) -> None:
        """Copy the last control step's fills, host pool -> slots, every bank in one launch
        (masked on the device by ``counts``: no host sync)."""
        if self.num_slots == 0:
            return
        _ops().expert_bank_copy(
            self.host.bank_list(),
            self.slots.bank_list(),
            self.fill_src,
            self.fill_dst,
            self.counts,
        )

    def forward(
        self,
        layer_id: int,
        hidden_states: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        moe_runner_config=None,
    ) -> torch.Tensor:
        """The routed-expert output of one MoE layer call.

        Args:
            hidden_states: [T, H] bf16.
            topk_weights: [T, K] router weights (any float dtype; used in fp32).
            topk_ids: [T, K] layer-local expert ids (int32/int64), -1 = padding.
            moe_runner_config: the layer's runner config (needed on CUDA only).

        Returns:
            [T, H] in ``hidden_states.dtype``: sum_k weight[t, k] * expert_k(x[t]).
        """
        ids = topk_ids.to(torch.int32).contiguous()
        weights = topk_weights.to(torch.float32).contiguous()
        x = hidden_states.contiguous()
        capturing = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if self.recorder is not None and not capturing:  # the trace copy syncs the host
            self.recorder.record(layer_id, ids)
        self._eager_calls += 1
        if self._eager_calls % 64 == 0:
            self.publish_metrics()
        if self.device.type == "cuda":
            # The fills are copied after the CPU branch forks, so the two run in parallel
            # (the premise of the q* split, FreeToken §3.2).
            slot_ids, cpu_ids = self.control(layer_id, ids)
            return self._forward_cuda(x, weights, slot_ids, cpu_ids, moe_runner_config)
        slot_ids, cpu_ids = self.route(layer_id, ids)
        out = torch.empty(x.shape[0], self.hidden_size, dtype=torch.float32)
        _ops().moe_experts_cpu(
            x,
            weights,
            [slot_ids, cpu_ids],
            [self.slots["w13"], self.host["w13"]],
            [self.slots["w2"], self.host["w2"]],
            out,
            False,
        )
        return out.to(x.dtype)

    def _slot_experts(self, x, weights, slot_ids, moe_runner_config):
        """[T, H] device partial sum of the (t, k) entries served from slots (hits and fills)."""
        from dataclasses import replace

        from sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe import (
            fused_experts,
        )
        from sglang.srt.layers.moe.topk import StandardTopKOutput

        if self.num_slots == 0:
            return torch.zeros_like(x)
        masked = slot_ids < 0
        return fused_experts(
            x,
            self.slots["w13"],
            self.slots["w2"],
            StandardTopKOutput(
                topk_weights=weights.masked_fill(masked, 0.0),
                topk_ids=slot_ids,
                router_logits=None,
            ),
            replace(
                moe_runner_config,
                num_experts=None,  # makes the runner skip -1 (CPU / padding) entries
                num_local_experts=self.num_slots,
                inplace=False,
                no_combine=False,
            ),
        )

    def _cpu_branch(self):
        """(plan, side stream) of the stream CPU branch, made on first use."""
        if self._branch is None:
            from sgl_kernel_fork.cpu_executor import CpuBranchPlan

            plan = CpuBranchPlan(
                stream_branch_tokens(), self.top_k, self.host["w13"], self.host["w2"]
            )
            self._branch = (plan, torch.cuda.Stream(device=self.device))
        return self._branch

    def _forward_cuda(self, x, weights, slot_ids, cpu_ids, moe_runner_config):
        """GPU path. Batches of at most :func:`stream_branch_tokens` tokens (decode): the CPU
        branch goes on a side stream as copy + host function + copy (no host sync, capturable
        in a CUDA graph, FreeToken §4), forked before and joined after the device's slot
        experts. Larger batches (prefill chunks): the CPU ids are handed over with one sync,
        the executor is submitted, the device computes meanwhile, then the sum. Either way the
        fills (:meth:`fill`) are copied after the CPU branch has started. Not yet run on a GPU
        (this project's machines have none; ``test/expert_cache/test_cuda_cache.py``)."""
        T = x.shape[0]
        plan, side = self._cpu_branch()
        if T > plan.max_tokens and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"expert cache: a CUDA graph captures a batch of {T} tokens, more than the "
                f"{plan.max_tokens} rows of the CPU branch's staging; set "
                f"{STREAM_TOKENS_ENV}={T} (or lower the captured batch sizes)"
            )
        if T <= plan.max_tokens:
            main = torch.cuda.current_stream(self.device)
            cpu_part = torch.empty(T, self.hidden_size, dtype=torch.float32, device=x.device)
            cpu_ids = cpu_ids.contiguous()
            side.wait_stream(main)
            with torch.cuda.stream(side):
                plan.enqueue(x, weights, cpu_ids, cpu_part)
            # No record_stream: the join below orders every later use of these blocks on main
            # after the side stream's work (and record_stream would pin them for a whole capture).
            self.fill()
            device_part = self._slot_experts(x, weights, slot_ids, moe_runner_config)
            main.wait_stream(side)
            return (device_part.float() + cpu_part).to(x.dtype)

        ops = _ops()
        x_host = x.to("cpu", non_blocking=True)
        w_host = weights.to("cpu", non_blocking=True)
        cpu_host = cpu_ids.to("cpu", non_blocking=True)
        torch.cuda.current_stream().synchronize()
        out_host = torch.empty(x.shape[0], self.hidden_size, dtype=torch.float32)
        handle = ops.moe_experts_cpu_submit(
            x_host, w_host, [cpu_host], [self.host["w13"]], [self.host["w2"]], out_host, False
        )
        self.fill()
        device_part = self._slot_experts(x, weights, slot_ids, moe_runner_config)
        ops.moe_experts_cpu_wait(handle)
        return (device_part.float() + out_host.to(x.device, non_blocking=True)).to(x.dtype)

    # ---------------------------------------------------------------- metrics
    def snapshot(self) -> Dict[str, float]:
        """Cumulative counters (reads device tensors: a sync on a GPU).

        Keys: hits, misses, fills, cpu_experts (distinct experts per layer call, summed over
        calls), calls (layer calls), slots, occupied_slots, fill_ratio (B_P / B_H).
        """
        if not self.finalized:
            hits = misses = fills = cpu = calls = 0
        else:
            hits, misses, fills, cpu = (int(v) for v in self.stats.tolist())
            calls = int(self.clock.item())
        occupied = int((self.id_of_slot >= 0).sum()) if self.num_slots else 0
        return dict(
            hits=hits,
            misses=misses,
            fills=fills,
            cpu_experts=cpu,
            calls=calls,
            slots=self.num_slots,
            occupied_slots=occupied,
            fill_ratio=self.bandwidths.fill_ratio if self.bandwidths else float("nan"),
        )

    def publish_metrics(self) -> None:
        """Export the counters with SGLang's Prometheus metrics (``--enable-metrics``).
        Called every 64 eager layer calls and by the scheduler's periodic decode log (layer
        calls replayed from a CUDA graph run no Python); skipped inside a graph capture."""
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return
        if self._metrics is None:
            self._metrics = _Metrics.create()
            if self._metrics is None:
                self._metrics = False
        if not self._metrics:
            return
        self._metrics.update(self.snapshot())

    def check_invariants(self) -> None:
        """Assert the residency tables are consistent (tests and debugging).

        Raises:
            AssertionError: a slot holds two ids, or the tables are not inverse.
        """
        ids = self.id_of_slot.tolist()
        held = [g for g in ids if g >= 0]
        assert len(held) == len(set(held)), "a global expert id sits in two slots"
        slot_of = self.slot_of_id.tolist()
        for s, g in enumerate(ids):
            if g >= 0:
                assert slot_of[g] == s, f"slot {s} holds {g} but slot_of_id[{g}] = {slot_of[g]}"
        for g, s in enumerate(slot_of):
            if s >= 0:
                assert ids[s] == g, f"slot_of_id[{g}] = {s} but slot {s} holds {ids[s]}"


class _Metrics:
    """Prometheus counters of one cache, created only with ``--enable-metrics``."""

    def __init__(self, counters, gauges):
        self.counters = counters
        self.gauges = gauges
        self.last: Dict[str, float] = {}

    @classmethod
    def create(cls) -> Optional["_Metrics"]:
        try:
            from sglang.srt.runtime_context import get_observability

            if not get_observability().enable_metrics:
                return None
        except Exception:  # no server (unit tests, benchmarks)
            return None
        from prometheus_client import Counter, Gauge

        names = {
            "hits": "Routed experts found in a slot (distinct per layer call)",
            "misses": "Routed experts not in a slot (distinct per layer call)",
            "fills": "Experts copied host -> slot",
            "cpu_experts": "Experts executed on the CPU from the host pool",
            "calls": "MoE layer calls through the expert cache",
        }
        counters = {
            k: Counter(f"sglang:expert_cache_{k}_total", doc) for k, doc in names.items()
        }
        gauges = {
            "slots": Gauge("sglang:expert_cache_slots", "Expert slots", multiprocess_mode="mostrecent"),
            "occupied_slots": Gauge(
                "sglang:expert_cache_occupied_slots",
                "Slots holding an expert",
                multiprocess_mode="mostrecent",
            ),
            "fill_ratio": Gauge(
                "sglang:expert_cache_fill_ratio",
                "B_P / B_H, the share of misses filled under the qstar policy",
                multiprocess_mode="mostrecent",
            ),
            "fills_per_call": Gauge(
                "sglang:expert_cache_fills_per_layer_call",
                "Mean q (fills) per MoE layer call since start",
                multiprocess_mode="mostrecent",
            ),
        }
        return cls(counters, gauges)

    def update(self, snap: Dict[str, float]) -> None:
        for k, c in self.counters.items():
            delta = snap[k] - self.last.get(k, 0)
            if delta > 0:
                c.inc(delta)
        for k in ("slots", "occupied_slots", "fill_ratio"):
            self.gauges[k].set(snap[k])
        self.gauges["fills_per_call"].set(snap["fills"] / max(1, snap["calls"]))
        self.last = dict(snap)
