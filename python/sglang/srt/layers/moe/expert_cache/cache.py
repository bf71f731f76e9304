"""The expert-slot cache: one LRU pool of complete-expert slots shared by every MoE layer.

FreeToken §3.2 and §4.1. The host pool (:class:`ExpertBanks` on the CPU) holds every routed
expert and is the source of truth; the device holds ``S`` slots in the same bank layout. For
each MoE layer call:

1. the control step (:func:`control.expert_cache_control`: one op, C++ on CPU, CUDA on GPU, no
   host sync) dedupes the routed ids, classifies hits and misses against the residency tables,
   splits the ``m`` misses into ``q = round(m * B_P / B_H)`` fills (at least one) and ``m - q``
   experts run on the CPU, picks ``q`` LRU victims in one pass, and rewrites each routed id into
   a slot id or a CPU id (the global id ``layer * E + expert``, a host-pool row);
2. the fill (:func:`control.expert_bank_copy`) copies the filled experts host -> slot, all banks
   in one launch, masked by the device-resident fill count;
3. the device computes hits and fills from the slots, the CPU executor
   (``sgl_kernel.moe_experts_cpu``) computes the CPU misses from the host pool, and the two
   partial sums are added.

On a CPU-only machine the "device" is the CPU: both sides run in one ``moe_experts_cpu`` call
over two bank sets, which computes every (token, k) entry identically whichever set holds its
expert and sums over k in a fixed order, so the output is bit-identical for any cache size and
policy. On a GPU the device side is SGLang's Triton fused MoE over the slot table
(:mod:`cuda_branch`); the sum then matches the resident layer within the tolerance of a change
of MoE kernel.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Callable, Dict, Optional, Tuple

import torch

from sglang.srt.layers.moe.expert_cache.bandwidth import Bandwidths
from sglang.srt.layers.moe.expert_cache.bandwidth_drift import (
    DECODE_SAMPLE_MAX_TOKENS,
    BandwidthDrift,
)
from sglang.srt.layers.moe.expert_cache.bandwidth_probe import probe_bandwidths
from sglang.srt.layers.moe.expert_cache.banks import (
    ExpertBanks,
    ExpertFormat,
    format_for_dtype,
)
from sglang.srt.layers.moe.expert_cache.config import ExpertCacheConfig, resolve_slots
from sglang.srt.layers.moe.expert_cache.control import (
    ExpertCacheTables,
    FillList,
    Routing,
    Stat,
    expert_bank_copy,
    expert_cache_control,
)
from sglang.srt.layers.moe.expert_cache.executor_args import run_experts_cpu
from sglang.srt.layers.moe.expert_cache.metrics import ExpertCacheMetrics

logger = logging.getLogger(__name__)

# Eager layer calls between two metric exports (graph-replayed calls run no Python: patch 0033).
METRICS_EVERY_CALLS = 64
# Host bytes per bank that one step of the load-time placement copy gathers.
PLACE_CHUNK_BYTES = 256 << 20


class ExpertSlotCache:
    """Host pool, device slots, residency tables and per-layer execution for one model.

    Args:
        config: the parsed flags.
        num_layers: decoder layers of the model; global expert ids are
            ``layer_id * num_experts + expert`` (rows of dense layers stay untouched).
        num_experts: routed experts per MoE layer (E).
        top_k: experts routed per token (K).
        hidden_size, intermediate_size: the expert shape (H, I).
        dtype: the activations' dtype (bf16); with ``fmt`` None also the experts' (BF16).
        device: where the slots live (the model's device).
        fmt: the experts' format when it is not ``dtype`` itself: a quantized format found on
            the layer (:func:`banks.format_from_layer`: block FP8 with its scale banks).
        host: an existing host pool of this shape to serve from instead of a new one (several
            caches over one filled pool, as the benchmarks build them); None = a new, empty
            pool that the model's weight loading fills through :meth:`host_rows`.
        activation: the experts' gated activation as the CPU executor takes it, ``(name,
            alpha, limit)`` (``method.expert_activation``: ``("silu", None, None)``, gpt-oss's
            ``("swiglu_oai", 1.702, 7.0)``, ``("swiglu_limit", None, limit)``); the bias
            banks, when the format has them, are part of every bank set.

    Raises:
        ValueError: unsupported expert dtype, or a ``host`` pool of another shape or format.
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
        host: Optional[ExpertBanks] = None,
        fmt: Optional[ExpertFormat] = None,
        activation: Tuple[str, Optional[float], Optional[float]] = ("silu", None, None),
    ):
        self.config = config
        self.policy = config.policy
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.top_k = top_k
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.device = torch.device(device)
        self.format = fmt if fmt is not None else format_for_dtype(dtype)
        self.activation = tuple(activation)
        name, alpha, limit = self.activation
        # the executor's keyword arguments (none for the default SiLU: the plain call)
        self.act_kwargs = {} if name == "silu" else dict(activation=name, alpha=alpha, limit=limit)
        rows = num_layers * num_experts
        if host is None:
            host = ExpertBanks(self.format, hidden_size, intermediate_size, rows, "cpu")
        elif (host.format, host.hidden_size, host.intermediate_size, host.rows) != (
            self.format,
            hidden_size,
            intermediate_size,
            rows,
        ) or host.device.type != "cpu":
            raise ValueError(
                f"host pool of {host.rows} {host.format.label} experts H{host.hidden_size} "
                f"x I{host.intermediate_size} on {host.device}; this cache needs {rows} "
                f"{self.format.label} experts H{hidden_size} x I{intermediate_size} on cpu"
            )
        self.host = host
        self.layer_ids: set[int] = set()
        # Set by finalize():
        self.slots: Optional[ExpertBanks] = None
        self.num_slots = 0
        self.tables: Optional[ExpertCacheTables] = None
        self.fills: Optional[FillList] = None
        self.bandwidths: Optional[Bandwidths] = None
        # B_P / B_H as the control step reads it: device data, so a captured graph follows a
        # ratio re-derived while serving (bandwidth_drift); 0 without slots.
        self._live_fill_ratio = torch.zeros(1, dtype=torch.float64, device=self.device)
        self._fill_ratio = 0.0
        self.drift: Optional[BandwidthDrift] = None  # set once B_P / B_H are known
        self._timer = time.perf_counter  # the clock of the drift samples (tests replace it)
        self._cuda = None  # cuda_branch.CudaForward on a CUDA device
        self.prefill_stream = None  # prefill_stream.PrefillStream, set by finalize()
        self._eager_calls = 0  # Python-side layer calls (a graph replay adds none)
        # Rebalances on request (module ``rebalance``): done, failed and rolled back, and the
        # last one's wall time in ms.
        self.rebalances = 0
        self.rebalance_failures = 0
        self.auto_rebalances = 0  # moves of --expert-cache-rebalance auto (managers module)
        # moves of --expert-cache-rebalance-reserve (managers/memory_pressure.py)
        self.pressure_rebalances = 0
        self.last_rebalance_ms = 0.0
        self.metrics = ExpertCacheMetrics(self.snapshot, self.device)
        self.recorder = None
        if config.record_routing:
            from sglang.srt.layers.moe.expert_cache.routing_trace import RoutingRecorder

            self.recorder = RoutingRecorder(config.record_routing, num_experts, num_layers)

    @property
    def fill_ratio(self) -> float:
        """``B_P / B_H`` as the control step uses it (paper Eq. 4); 0 without slots."""
        return self._fill_ratio

    @fill_ratio.setter
    def fill_ratio(self, value: float) -> None:
        """Set the ratio and its device copy (an asynchronous fill on CUDA: no host sync).

        Raises:
            ValueError: not finite or negative.
        """
        value = float(value)
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"fill ratio B_P / B_H must be finite and >= 0, got {value}")
        self._fill_ratio = value
        self._live_fill_ratio.fill_(value)

    def _start_drift(self) -> None:
        """Begin re-deriving B_P / B_H from the served layer calls (:mod:`bandwidth_drift`);
        a figure given by flag stays fixed. Nothing to do without valid bandwidths."""
        b = self.bandwidths
        if b is None or not (b.fill_gbps > 0 and b.cpu_gbps > 0):
            return
        self.drift = BandwidthDrift(
            b, adapt_fill=self.config.fill_gbps is None, adapt_cpu=self.config.cpu_gbps is None
        )

    def _observe(self, tokens: int, fills: FillList, fill_s: float, cpu_s: float) -> None:
        """One CPU-path layer call's sample for :attr:`drift` (decode-sized calls only)."""
        if self.drift is None or tokens > DECODE_SAMPLE_MAX_TOKENS:
            return
        counts = fills.counts.tolist()  # a CPU tensor here: no sync
        eb = self.host.expert_bytes
        executed = counts[Stat.HITS] + counts[Stat.MISSES]
        update = self.drift.observe(counts[Stat.FILLS] * eb, fill_s, executed * eb, cpu_s)
        if update is not None:
            self.bandwidths = update.after
            self.fill_ratio = update.after.fill_ratio
            logger.info("Expert cache: bandwidth drift: %s", update.describe())

    # ------------------------------------------------------------------ setup
    def check_shape(
        self, num_experts, top_k, hidden_size, intermediate_size, dtype, fmt=None, activation=None
    ) -> None:
        """Raise ValueError unless a layer has the shape (and, when given, the expert format
        and activation) this cache was built for."""
        got = (num_experts, top_k, hidden_size, intermediate_size, dtype)
        want = (
            self.num_experts,
            self.top_k,
            self.hidden_size,
            self.intermediate_size,
            self.format.act_dtype,
        )
        if fmt is not None and fmt != self.format:
            got, want = got + (fmt.label,), want + (self.format.label,)
        if activation is not None and tuple(activation) != self.activation:
            got, want = got + (tuple(activation),), want + (self.activation,)
        if got != want:
            raise ValueError(
                "--enable-expert-cache needs every MoE layer to have the same expert shape "
                f"(experts, top-k, hidden, intermediate, dtype); got {got}, expected {want}. "
                "Serve this model without --enable-expert-cache"
            )

    def register_layer(self, layer_id: int) -> None:
        """Count ``layer_id`` as a MoE layer whose experts live in the pool.

        Raises:
            ValueError: the id is outside the model's layers.
            RuntimeError: the cache is already built.
        """
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

    def finalize(self) -> None:
        """Size and fill the slots, pin the host pool, measure B_P / B_H. Called once all
        weights are loaded (the first layer's ``process_weights_after_loading``); later calls
        do nothing.

        Raises:
            ValueError: an explicit ``--expert-cache-size`` below the router's top-k, or a
                model or ``--expert-cache-max-fills`` beyond the CUDA kernel's limits.
            RuntimeError: CUDA without this fork's CUDA kernels.
        """
        if self.finalized:
            return
        cfg = self.config
        slots = resolve_slots(
            cfg.size,
            pool_experts=self.pool_experts,
            expert_bytes=self.host.expert_bytes,
            top_k=self.top_k,
            device=self.device,
        )
        on_cuda = self.device.type == "cuda"
        if on_cuda and slots > 0 and not self.host.pin():
            logger.warning(
                "Expert cache: the host pool cannot be pinned; every expert runs on the CPU "
                "(pure-CPU MoE fallback, FreeToken §4.2)"
            )
            slots = 0
        # Room for the largest pool :meth:`resize_slots` may grow to: on the CPU the whole
        # routed pool (reserved address space, committed as written); on CUDA today the
        # startup size (module ``resize``).
        capacity = slots if on_cuda else self.pool_experts
        max_fills = max(1, min(cfg.max_fills or 2 * self.top_k, max(capacity, 1)))
        if on_cuda:
            from sglang.srt.layers.moe.expert_cache.cuda_branch import check_cuda_support

            max_fills = check_cuda_support(self.num_experts, max_fills, cfg.max_fills)
        self.num_slots = slots
        self.slots = ExpertBanks(
            self.format,
            self.hidden_size,
            self.intermediate_size,
            capacity,
            self.device,
            reserve=True,
        )
        self.tables = ExpertCacheTables.allocate(
            self.num_layers, self.num_experts, capacity, self.device
        )
        self.tables.live_slots.fill_(slots)
        self.fills = FillList.allocate(max_fills, self.device)
        self._place_at_load()
        from sglang.srt.layers.moe.expert_cache.prefill_stream import PrefillStream

        self.prefill_stream = PrefillStream(self, cfg.prefill_stream)
        if on_cuda:
            from sglang.srt.layers.moe.expert_cache.cuda_branch import CudaForward

            self._cuda = CudaForward(self.host, self.top_k, self.device)  # staging before capture
        threads = torch.ops.sgl_kernel.expert_pool_set_threads(cfg.cpu_threads)
        if slots:
            self.bandwidths = self.measure_bandwidths(threads)
            self.fill_ratio = self.bandwidths.fill_ratio
            self._start_drift()
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

    def measure_bandwidths(self, threads: int) -> Bandwidths:
        """B_P and B_H of this cache's host pool and device with ``threads`` CPU executor
        threads: the flags, else the per-machine profile, else measured
        (:func:`bandwidth_probe.probe_bandwidths`)."""
        return probe_bandwidths(
            self.host,
            device=self.device,
            layer_ids=sorted(self.layer_ids),
            num_experts=self.num_experts,
            top_k=self.top_k,
            threads=threads,
            fill_override=self.config.fill_gbps,
            cpu_override=self.config.cpu_gbps,
        )

    def _place_at_load(self) -> None:
        """Fill the slots with a neutral load-time placement: experts 0, 1, ... of every MoE
        layer in turn (each layer gets S / L slots). Policy ``cpu`` keeps it for good.

        Copied in chunks of at most :data:`PLACE_CHUNK_BYTES` per bank, so the host never
        holds a second copy of the slots (at 100% that would be the whole pool again)."""
        layers = sorted(self.layer_ids)
        if not self.num_slots or not layers:
            return
        ids = [
            layers[s % len(layers)] * self.num_experts + s // len(layers)
            for s in range(self.num_slots)
        ]
        src = torch.tensor(ids, dtype=torch.int64)
        for name, bank in self.slots.tensors.items():
            host = self.host[name]
            rows = max(1, PLACE_CHUNK_BYTES // (host[0].numel() * host.element_size()))
            for lo in range(0, self.num_slots, rows):
                hi = min(lo + rows, self.num_slots)  # the banks reserve more rows than live
                bank[lo:hi].copy_(host.index_select(0, src[lo:hi]).to(self.device))
        t = self.tables
        t.id_of_slot[: self.num_slots].copy_(src.to(torch.int32))
        t.slot_of_id[src.to(self.device)] = torch.arange(
            self.num_slots, dtype=torch.int32, device=self.device
        )
        t.slot_last_use[: self.num_slots].fill_(0)

    @property
    def slot_capacity(self) -> int:
        """The most slots :meth:`resize_slots` can give (reserved at :meth:`finalize`)."""
        return self.tables.id_of_slot.numel() if self.finalized else 0

    def slot_release_bytes(self, num_slots: int) -> int:
        """Bytes a shrink to ``num_slots`` would return to the OS now: on the CPU the resident
        pages of slot rows ``[num_slots, self.num_slots)`` (``mincore``; a row never filled
        since the last shrink holds none), on CUDA 0 (one allocation of the startup size,
        :meth:`resize_slots`). The kept entries a shrink moves below the new end land in
        rows that held evicted entries or none; the latter commit pages again, so this is an
        upper bound when the cache is not full.

        Raises:
            ValueError: ``num_slots`` outside ``[0, self.num_slots]``.
        """
        if not 0 <= num_slots <= self.num_slots:
            raise ValueError(f"slot_release_bytes({num_slots}) outside [0, {self.num_slots}]")
        if not self.finalized or self.device.type != "cpu":
            return 0
        return self.slots.resident_bytes(num_slots, self.num_slots)

    def slot_footprint_bytes(self) -> int:
        """Bytes the slot pool holds now: the resident pages of the live slots on the CPU
        (``mincore``), ``num_slots * expert_bytes`` on CUDA."""
        if self.finalized and self.device.type == "cpu":
            return self.slots.resident_bytes(0, self.num_slots)
        return int(self.num_slots) * int(self.host.expert_bytes)

    def resize_slots(self, num_slots: int, on_step: Optional[Callable[[str], None]] = None) -> int:
        """Resize the slot pool at a safe point (no layer call in flight), keeping the most
        recently used entries; FreeToken §3.3 "Runtime cache reconfiguration" (module
        :mod:`resize`). A shrink moves kept entries below the new end (a row copy in every
        bank) and returns the tail's memory; a grow adds empty slots, filled by later misses.
        Outputs stay what they were: on the CPU bit for bit (the host pool is the source of
        truth).

        The steps (:data:`resize.RESIZE_STEPS`) are ``bandwidths`` (only for a grow from 0
        slots: B_P / B_H were never measured), ``plan`` (the table update computed on a copy of
        the tables), ``gather`` (the rows that move, read into new buffers: every allocation
        of the resize) -- nothing of the cache changes until here, so a failure leaves it as
        it was -- then ``commit``, the point of no return (rows scattered into their new slots
        and the tables copied in, no allocation: if it fails all the same, the cache goes back
        to its previous slot count with every slot empty, which changes speed, never
        results), then ``release`` (the tail's memory returned; a failure there is logged and
        the resize stands, with 0 bytes released).

        Args:
            num_slots: the new slot count: 0 (every expert on the CPU) or at least ``top_k``,
                at most :attr:`slot_capacity`.
            on_step: called with each step's name before the step runs (tests inject failures
                there); None = nothing.

        Returns:
            bytes of slot memory released to the OS (0 for a grow, and on CUDA for now): the
            resident pages of the rows between the new and the old end (``mincore``); a row
            never filled since the last shrink was never committed and returns nothing.

        Raises:
            RuntimeError: before :meth:`finalize`.
            ValueError: ``num_slots`` between 1 and ``top_k - 1`` or above the capacity; the
                cache is unchanged.
            Exception: whatever a step raised (an allocation failure, ...), after the rollback
                described above.
        """
        from sglang.srt.layers.moe.expert_cache.resize import copy_tables, resize_tables

        if not self.finalized:
            raise RuntimeError("Expert cache: resize_slots before the cache was built")
        if 0 < num_slots < self.top_k or not 0 <= num_slots <= self.slot_capacity:
            raise ValueError(
                f"expert cache size must be 0 or {self.top_k}..{self.slot_capacity} slots "
                f"(one layer's top-k up to the reserved pool), got {num_slots}"
            )
        step = on_step or (lambda name: None)
        self.prefill_stream.abandon()  # a streamed pass cut short by a failed forward
        # Dry run: everything that can fail, on copies.
        bandwidths, fill_ratio = self.bandwidths, self.fill_ratio
        if num_slots and not self.num_slots and self.fill_ratio == 0.0:
            step("bandwidths")
            bandwidths = self.measure_bandwidths(
                torch.ops.sgl_kernel.expert_pool_set_threads(self.config.cpu_threads)
            )
            fill_ratio = bandwidths.fill_ratio
        step("plan")
        scratch = copy_tables(self.tables)
        src, dst = resize_tables(scratch, num_slots)
        step("gather")
        rows = {n: b.index_select(0, src) for n, b in self.slots.tensors.items() if src.numel()}
        # The point of no return: no allocation from here on.
        try:
            step("commit")
            for name, moved in rows.items():
                self.slots.tensors[name].index_copy_(0, dst, moved)
            copy_tables(scratch, into=self.tables)
        except BaseException:
            self._empty_slots()
            logger.error(
                "Expert cache: resize to %d slots failed while committing; back to %d slots, "
                "all empty",
                num_slots,
                self.num_slots,
            )
            raise
        old, self.num_slots = self.num_slots, num_slots
        self.bandwidths, self.fill_ratio = bandwidths, fill_ratio
        if num_slots and self.drift is None:
            self._start_drift()
        released = 0
        if num_slots < old:
            try:
                step("release")
                # Resident pages past the new end (rows past the old end were released at a
                # shrink or never written after a grow); at most the rows [num_slots, old).
                released = min(
                    self.slots.release_rows(num_slots), (old - num_slots) * self.host.expert_bytes
                )
            except Exception as e:  # the resize stands; only the memory stays committed
                logger.warning("Expert cache: the shrunk tail was not released (%s)", e)
        logger.info(
            "Expert cache: %d -> %d slots (%d entries moved, %.1f MB released)",
            old,
            num_slots,
            src.numel(),
            released / 1e6,
        )
        return released

    def _empty_slots(self) -> None:
        """Every slot empty and never used, at the current :attr:`num_slots` (a valid state
        whatever the banks hold: a resize's commit failed halfway)."""
        t = self.tables
        t.id_of_slot.fill_(-1)
        t.slot_last_use.fill_(-1)
        t.slot_of_id.fill_(-1)
        t.live_slots.fill_(self.num_slots)

    # ---------------------------------------------------------------- forward
    def control(self, layer_id: int, topk_ids: torch.Tensor) -> Routing:
        """The control step of one layer call (FreeToken §4 "Device-side cache control"):
        tables updated, routed ids rewritten, the call's fill work list returned, not yet copied
        (:meth:`fill`). Advances the clock by one per call, with or without slots.

        Args:
            layer_id: the MoE layer.
            topk_ids: [T, K] int32 layer-local routed ids, -1 = padding.
        """
        return expert_cache_control(
            topk_ids,
            layer_id,
            self.num_experts,
            self.tables,
            self.fills,
            self.fill_ratio,
            self.policy,
            live_fill_ratio=self._live_fill_ratio,
        )

    def fill(self, fills: FillList) -> None:
        """Copy a control step's fills, host pool -> slots, every bank in one launch (masked on
        the device by the fill count: no host sync)."""
        if self.num_slots:
            expert_bank_copy(self.host.bank_list(), self.slots.bank_list(), fills)

    def route(self, layer_id: int, topk_ids: torch.Tensor) -> Routing:
        """:meth:`control` then :meth:`fill`: the slots hold every slot entry's expert."""
        routing = self.control(layer_id, topk_ids)
        self.fill(routing.fills)
        return routing

    def forward(
        self,
        layer_id: int,
        hidden_states: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        moe_runner_config=None,
        scale: Optional[float] = None,
    ) -> torch.Tensor:
        """The routed-expert output of one MoE layer call.

        Args:
            hidden_states: [T, H] bf16.
            topk_weights: [T, K] router weights (any float dtype; used in fp32).
            topk_ids: [T, K] layer-local expert ids (int32/int64), -1 = padding.
            moe_runner_config: the layer's runner config (needed on CUDA only).
            scale: a factor applied to the fp32 sum before its one rounding to
                ``hidden_states.dtype`` (the routed scaling factor where upstream applies it in
                the layer: :func:`method.output_scale`); None = 1.

        Returns:
            [T, H] in ``hidden_states.dtype``: scale * sum_k weight[t, k] * expert_k(x[t]),
            rounded once.
        """
        ids = topk_ids.to(torch.int32).contiguous()
        weights = topk_weights.to(torch.float32).contiguous()
        x = hidden_states.contiguous()
        capturing = self._cuda is not None and torch.cuda.is_current_stream_capturing()
        if self.recorder is not None and not capturing:  # the trace copy syncs the host
            self.recorder.record(layer_id, ids)
        self._eager_calls += 1
        if self._eager_calls % METRICS_EVERY_CALLS == 0:
            self.publish_metrics()
        # The prefill double buffer (§3.1) takes whole prefill passes; None = not this call.
        out = self.prefill_stream.forward(layer_id, x, weights, ids, moe_runner_config, scale)
        if out is not None:
            return out
        if self._cuda is not None:
            # The fills are copied after the CPU branch forks, so the two run in parallel.
            routing = self.control(layer_id, ids)
            return self._cuda.forward(
                x, weights, routing, self.fill, self.slots, moe_runner_config, scale
            )
        routing = self.control(layer_id, ids)
        t0 = self._timer()
        self.fill(routing.fills)
        t1 = self._timer()
        out = torch.empty(x.shape[0], self.hidden_size, dtype=torch.float32)
        run_experts_cpu(
            x,
            weights,
            [routing.slot_ids, routing.cpu_ids],
            [self.slots, self.host],
            out,
            **self.act_kwargs,
        )
        self._observe(x.shape[0], routing.fills, t1 - t0, self._timer() - t1)
        if scale is not None:
            out.mul_(scale)
        return out.to(x.dtype)

    # ---------------------------------------------------------------- metrics
    def snapshot(self) -> Dict[str, float]:
        """Cumulative counters (reads device tensors: a sync on a GPU).

        Keys: hits, misses, fills, cpu_experts (distinct experts per layer call, summed over
        calls), calls (layer calls), slots, occupied_slots, fill_ratio (B_P / B_H),
        slot_bytes (slots x bytes of one expert), rebalances, rebalance_failures,
        auto_rebalances (the moves of ``--expert-cache-rebalance auto``, also in rebalances),
        pressure_rebalances (the moves of ``--expert-cache-rebalance-reserve``, also in
        rebalances),
        last_rebalance_ms (module ``rebalance``), live_fill_gbps / live_cpu_gbps (B_P / B_H
        over the drift window, GB/s, nan before a sample) and bandwidth_updates (their
        re-derivations; module ``bandwidth_drift``).
        """
        stats = self.tables.stats.tolist() if self.finalized else [0] * len(Stat)
        return dict(
            hits=stats[Stat.HITS],
            misses=stats[Stat.MISSES],
            fills=stats[Stat.FILLS],
            cpu_experts=stats[Stat.CPU_EXPERTS],
            calls=int(self.tables.clock.item()) if self.finalized else 0,
            slots=self.num_slots,
            occupied_slots=int((self.tables.id_of_slot >= 0).sum()) if self.num_slots else 0,
            fill_ratio=self.bandwidths.fill_ratio if self.bandwidths else float("nan"),
            slot_bytes=self.num_slots * self.host.expert_bytes,
            rebalances=self.rebalances,
            rebalance_failures=self.rebalance_failures,
            auto_rebalances=self.auto_rebalances,
            pressure_rebalances=self.pressure_rebalances,
            last_rebalance_ms=self.last_rebalance_ms,
            live_fill_gbps=self.drift.live_fill_gbps if self.drift else float("nan"),
            live_cpu_gbps=self.drift.live_cpu_gbps if self.drift else float("nan"),
            bandwidth_updates=self.drift.updates if self.drift else 0,
        )

    def publish_metrics(self) -> None:
        """Export the counters with SGLang's Prometheus metrics (``--enable-metrics``): every
        :data:`METRICS_EVERY_CALLS` eager layer calls and at the scheduler's decode log."""
        self.metrics.publish()

    def check_invariants(self) -> None:
        """Assert the residency tables are consistent (tests and debugging).

        Raises:
            AssertionError: a slot holds two ids, or the tables are not inverse.
        """
        ids = self.tables.id_of_slot.tolist()
        tail = ids[self.num_slots :], self.tables.slot_last_use[self.num_slots :].tolist()
        assert int(self.tables.live_slots.item()) == self.num_slots, "live_slots != num_slots"
        assert all(g == -1 for g in tail[0]) and all(t == -1 for t in tail[1]), "tail not empty"
        held = [g for g in ids if g >= 0]
        assert len(held) == len(set(held)), "a global expert id sits in two slots"
        slot_of = self.tables.slot_of_id.tolist()
        for s, g in enumerate(ids):
            if g >= 0:
                assert slot_of[g] == s, f"slot {s} holds {g} but slot_of_id[{g}] = {slot_of[g]}"
        for g, s in enumerate(slot_of):
            if s >= 0:
                assert ids[s] == g, f"slot_of_id[{g}] = {s} but slot {s} holds {ids[s]}"
