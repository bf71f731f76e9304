"""The prefill double buffer: whole layers streamed into buffers borrowed from the slot pool.

FreeToken §3.1 ("Full-layer double buffering") and §5.3 ("Pipelined prefill"). A prefill pass
that routes enough tokens (:mod:`prefill_plan`) runs every routed expert of every MoE layer on
the device from a full-layer buffer instead of taking the decode path's hit / fill / CPU split:

1. **Borrow** (first MoE layer of the pass): the ``nbuf * E`` least recently used slots of the
   shared pool (empty ones first) are evicted and become ``nbuf`` buffers of ``E`` slots each
   (``nbuf`` = 2, or 1 when the pool cannot spare two layers). The tables stay a valid cache
   state throughout: a borrowed slot is an empty slot, every other entry is untouched, and no
   memory is allocated (never an out-of-memory). The residency of every layer is read once.
2. **Load** (on the copy lane: a CUDA stream, on the CPU one worker thread): layer ``j``'s
   experts into buffer ``b``, the non-resident ones from the host pool and the resident ones
   slot to slot (device to device), two :func:`control.expert_bank_copy` launches over every
   bank. Layer 0 (and 1) are loaded at the borrow; after layer ``i`` has computed from buffer
   ``b``, layer ``i + nbuf`` is loaded into ``b``, so with two buffers the copy of layer
   ``i + 1`` runs while layer ``i`` computes. No routing is needed in advance.
3. **Compute**: the routed ids become the buffer's slots (``buffer[b][expert]``) and the slot
   side computes them all: on CUDA upstream's Triton fused MoE (:func:`cuda_branch.slot_experts`),
   on the CPU ``moe_experts_cpu`` over the slot banks, the same kernel per (token, expert)
   entry as the ordinary path, so outputs are bit-identical to it.
4. **Return** (after the last MoE layer, or when a pass is abandoned): the copies are drained
   (on CUDA the main stream waits for the copy stream, no host sync) and the buffers return
   to the pool. After a completed pass they hold the last ``nbuf`` layers whole, and each of
   those experts that has no other slot becomes its buffer slot's cache entry (an abandoned
   pass leaves them empty); with the entries that were not borrowed they seed decode.

Decode and its CUDA graph are untouched: a captured call, a decode batch or a layer call out
of order takes the ordinary path (the latter abandons the pass first). Compared with upstream's
paged experts (``paged_experts/forward.py``, ``_scratch_prefill_apply``: two separate global
scratch banks, residency untouched), the buffers here are the cache's own slots, as FreeToken
borrows them from its global pool, at the price of evicting the pool's ``nbuf * E`` least
recently used entries for the pass.

On a CPU-only machine the slots are host memory and a load is a host copy that the executor
does not need; ``--expert-cache-prefill-stream force`` runs the path there anyway (tests), and
``link_gbps`` throttles each load to a simulated link's rate (the benchmark).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Dict, List, Optional

import torch

from sglang.srt.layers.moe.expert_cache.control import FillList, Stat, expert_bank_copy
from sglang.srt.layers.moe.expert_cache.prefill_plan import (
    PrefillPath,
    choose_prefill_path,
    parse_mode,
    path_times,
)

if TYPE_CHECKING:
    from sglang.srt.layers.moe.expert_cache.cache import ExpertSlotCache

logger = logging.getLogger(__name__)


class _HostLane:
    """The copy lane on a CPU-only machine: one worker thread; a load's handle is its future.
    Compute runs synchronously on the caller's thread, so a buffer is free once its layer's
    call has returned."""

    def __init__(self):
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="expert-prefill-copy")
        self.pending: List[Future] = []

    def begin(self) -> None:
        pass

    def load(self, fn, after) -> Future:
        fut = self.pool.submit(fn)
        self.pending.append(fut)
        return fut

    def ready(self, handle: Future) -> None:
        handle.result()  # re-raises a failed copy

    def computed(self):
        return None

    def drain(self) -> None:
        pending, self.pending = self.pending, []
        for fut in pending:
            fut.exception()  # wait; errors were raised at ready() or are moot now


class _CudaLane:
    """The copy lane on CUDA: a dedicated stream; a load waits for the event of the compute
    that last read its buffer, and its own event is what the compute waits for."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device=device)
        self.device = device

    def begin(self) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the borrow's tables

    def load(self, fn, after):
        with torch.cuda.stream(self.stream):
            if after is not None:
                self.stream.wait_event(after)
            fn()
            ev = torch.cuda.Event()
            ev.record(self.stream)
        return ev

    def ready(self, handle) -> None:
        torch.cuda.current_stream(self.device).wait_event(handle)

    def computed(self):
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def drain(self) -> None:
        torch.cuda.current_stream(self.device).wait_stream(self.stream)


@dataclass
class _Pass:
    """One streamed prefill pass: the borrowed buffers and the pipeline's handles."""

    path: PrefillPath
    layers: List[int]
    buffers: List[List[int]]  # per buffer, the slot of expert e
    buffer_ids: List[torch.Tensor]  # the same as int32 [E] tensors on the device
    resident: List[List[int]]  # per position in ``layers``, the slot of expert e or -1
    next_index: int = 0
    ready: Dict[int, object] = field(default_factory=dict)  # buffer -> load handle
    done: Dict[int, object] = field(default_factory=dict)  # buffer -> compute handle
    keep: List[object] = field(default_factory=list)  # fill lists alive until the drain
    link_bytes: int = 0  # host-pool bytes loaded (over the link)


class PrefillStream:
    """The prefill double buffer of one :class:`ExpertSlotCache` (module docstring).

    Args:
        cache: the finalized cache.
        mode: ``auto``, ``off`` or ``force`` (:func:`parse_mode`).
        path: with ``force``, the path to take when the pool allows it (benchmarks compare
            them); None = the most buffers the pool allows.
        link_gbps: a simulated link for the CPU benchmark: each load takes at least its
            host-pool bytes / ``link_gbps`` (the worker sleeps out the rest); None = as fast
            as the copy runs.
    """

    def __init__(
        self,
        cache: "ExpertSlotCache",
        mode: str = "auto",
        path: Optional[PrefillPath] = None,
        link_gbps: Optional[float] = None,
    ):
        self.cache = cache
        self.mode = parse_mode(mode)
        self.path = path
        self.link_gbps = link_gbps
        self.on_cuda = cache.device.type == "cuda"
        self._lane = None
        self._pass: Optional[_Pass] = None
        self._warned = False
        # Passes per path, and passes abandoned before their last layer.
        self.passes = {p: 0 for p in PrefillPath}
        self.abandoned = 0
        self.link_bytes = 0  # host-pool bytes loaded into buffers, all passes
        self.kept_entries = 0  # buffer slots kept as cache entries after passes, all passes
        # Measured compute seconds per routed entry of a streamed layer call (the ``C`` of
        # prefill_plan.path_times, as C = routed x this); None until a streamed pass measured
        # one. On CUDA the timing events are read at the next decision, once they completed.
        self.compute_s_per_entry: Optional[float] = None
        self._timings: List[tuple] = []  # CUDA: (start event, end event, entries) not yet read
        self.last_times = None  # the PathTimes of the last decision

    @property
    def enabled(self) -> bool:
        """``force``, or ``auto`` on CUDA (on a CPU-only machine streaming only copies)."""
        return self.mode == "force" or (self.mode == "auto" and self.on_cuda)

    @property
    def active(self) -> bool:
        return self._pass is not None

    # ------------------------------------------------------------------ decision
    def decide(self, num_tokens: int) -> PrefillPath:
        """The path of a prefill pass of ``num_tokens`` tokens (:mod:`prefill_plan`)."""
        c = self.cache
        E = c.num_experts
        bw = c.bandwidths
        layers = max(1, len(c.layer_ids))
        occupied = int((c.tables.id_of_slot[: c.num_slots] >= 0).sum()) if c.num_slots else 0
        self._read_timings()
        routed = num_tokens * c.top_k
        times = path_times(
            routed=routed,
            num_experts=E,
            expert_bytes=c.host.expert_bytes,
            fill_gbps=bw.fill_gbps if bw else float("nan"),
            cpu_gbps=bw.cpu_gbps if bw else float("nan"),
            max_fills=c.fills.fill_src.numel(),
            resident=occupied // layers,
            compute_s=routed * (self.compute_s_per_entry or 0.0),
        )
        self.last_times = times
        force = self.mode == "force"
        path = choose_prefill_path(times, spare_slots=c.num_slots, num_experts=E, force=force)
        if force and self.path is not None and path is not PrefillPath.SPLIT:
            if self.path is PrefillPath.SPLIT or c.num_slots >= E * _nbuf(self.path):
                path = self.path
        if force and c.num_slots < E and not self._warned:
            self._warned = True
            logger.warning(
                "Expert cache: --expert-cache-prefill-stream force, but %d slots cannot hold "
                "one layer's %d experts; prefill takes the decode path",
                c.num_slots,
                E,
            )
        return path

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        layer_id: int,
        x: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        moe_runner_config=None,
        scale: Optional[float] = None,
    ) -> Optional[torch.Tensor]:
        """The layer call through the buffers, or None when the ordinary path runs it.

        Args: as :meth:`ExpertSlotCache.forward` (``ids`` int32 [T, K], ``weights`` float32).
        """
        if not self.enabled:
            return None
        if self.on_cuda and torch.cuda.is_current_stream_capturing():
            return None
        c = self.cache
        layers = sorted(c.layer_ids)
        T = x.shape[0]
        if layer_id == layers[0]:
            self.abandon()  # a pass that never reached its last layer (a failed forward)
            if T == 0 or self._phase(T) != "prefill":
                return None
            path = self.decide(T)
            self.passes[path] += 1
            if path is PrefillPath.SPLIT:
                return None
            self._begin(path, layers)
            if self.passes[path] == 1:
                t = self.last_times
                logger.info(
                    "Expert cache: a prefill pass of %d tokens streamed through %s (the first; "
                    "%d slots, %d experts per layer; modelled ms per layer: two buffers %.2f, "
                    "one buffer %.2f, split %.2f)",
                    T,
                    _LABEL[path],
                    c.num_slots,
                    c.num_experts,
                    1e3 * t.two_buffers,
                    1e3 * t.one_buffer,
                    1e3 * t.split,
                )
        p = self._pass
        if p is None:
            return None
        if p.next_index >= len(p.layers) or p.layers[p.next_index] != layer_id:
            self.abandon()
            return None
        out = self._run_layer(p, x, weights, ids, moe_runner_config, scale)
        if p.next_index == len(p.layers):
            self._finish()
        return out

    def abandon(self) -> None:
        """End a pass before its last layer (a forward that failed, a layer call out of
        order, a resize at a safe point): the copies are drained and the buffers stay in the
        pool as empty slots. Nothing to do without a pass."""
        if self._pass is not None:
            self.abandoned += 1
            self._finish()

    def _phase(self, num_tokens: int) -> Optional[str]:
        """The batch's phase: the server forward's (``prefill`` = extend or mixed); outside a
        server forward (layer tests, benchmarks) ``force`` takes a call of more than one
        token as prefill, ``auto`` never streams (the eager calls of the CUDA tests stay
        on the path they test)."""
        from sglang.srt.layers.moe.expert_cache.routing_trace import (
            current_phase,
            forward_phase,
        )

        return current_phase(num_tokens) if self.mode == "force" else forward_phase()

    # ------------------------------------------------------------------ the pass
    def _begin(self, path: PrefillPath, layers: List[int]) -> None:
        c = self.cache
        E, nbuf = c.num_experts, _nbuf(path)
        if self._lane is None:
            self._lane = _CudaLane(c.device) if self.on_cuda else _HostLane()
        slots = self._borrow(nbuf * E)
        buffers = [slots[b * E : (b + 1) * E] for b in range(nbuf)]
        slot_of = c.tables.slot_of_id.view(c.num_layers, E)[layers].tolist()  # one sync
        p = _Pass(
            path=path,
            layers=layers,
            buffers=buffers,
            buffer_ids=[torch.tensor(b, dtype=torch.int32, device=c.device) for b in buffers],
            resident=slot_of,
        )
        self._pass = p
        self._lane.begin()
        for i in range(min(nbuf, len(layers))):
            self._load(p, i, i % nbuf)

    def _borrow(self, n: int) -> List[int]:
        """Evict the ``n`` least recently used slots (empty ones first, ties: lower slot) and
        return them: the tables then hold them as empty slots."""
        t, live = self.cache.tables, self.cache.num_slots
        order = torch.sort(t.slot_last_use[:live], stable=True).indices[:n]
        held = t.id_of_slot[order]
        t.slot_of_id[held[held >= 0].long()] = -1
        t.id_of_slot[order] = -1
        t.slot_last_use[order] = -1
        return order.tolist()

    def _load(self, p: _Pass, index: int, b: int) -> None:
        """Queue the load of ``p.layers[index]`` into buffer ``b`` on the copy lane."""
        c = self.cache
        E, layer = c.num_experts, p.layers[index]
        dst = p.buffers[b]
        resident = p.resident[index]
        host = [(layer * E + e, dst[e]) for e in range(E) if resident[e] < 0]
        local = [(resident[e], dst[e]) for e in range(E) if resident[e] >= 0]
        link_bytes = len(host) * c.host.expert_bytes
        p.link_bytes += link_bytes
        device, keep, gbps = c.device, p.keep, self.link_gbps

        def copy() -> None:
            start = time.perf_counter()
            for pairs, src_banks in ((host, c.host), (local, c.slots)):
                if pairs:
                    # Made on the copy lane (on CUDA inside its stream), kept until the drain.
                    fills = _fill_list(pairs, device)
                    keep.append(fills)
                    expert_bank_copy(src_banks.bank_list(), c.slots.bank_list(), fills)
            if gbps:
                wait = link_bytes / (gbps * 1e9) - (time.perf_counter() - start)
                if wait > 0:
                    time.sleep(wait)

        p.ready[b] = self._lane.load(copy, p.done.pop(b, None))

    def _run_layer(self, p: _Pass, x, weights, ids, moe_runner_config, scale) -> torch.Tensor:
        c = self.cache
        i = p.next_index
        nbuf = len(p.buffers)
        b = i % nbuf
        self._lane.ready(p.ready.pop(b))
        lut = p.buffer_ids[b]
        slot_ids = torch.where(ids >= 0, lut[ids.clamp(min=0).long()], -1).to(torch.int32)
        entries = ids.shape[0] * ids.shape[1]
        if self.on_cuda:
            from sglang.srt.layers.moe.expert_cache.cuda_branch import slot_experts

            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            part = slot_experts(
                c.slots, x, weights, slot_ids, moe_runner_config, c.host.format.weight_block_size
            )
            end.record()
            self._timings = self._timings[-(_MAX_TIMINGS - 1) :] + [(start, end, entries)]
            out = part.float()
        else:
            from sglang.srt.layers.moe.expert_cache.executor_args import run_experts_cpu

            out = torch.empty(x.shape[0], c.hidden_size, dtype=torch.float32)
            start = time.perf_counter()
            run_experts_cpu(x, weights, [slot_ids], [c.slots], out, **c.act_kwargs)
            self._add_compute_sample(time.perf_counter() - start, entries)
        if scale is not None:
            out.mul_(scale)
        c.tables.clock.add_(1)  # one layer call, as the control step counts them
        p.done[b] = self._lane.computed()
        p.next_index = i + 1
        if i + nbuf < len(p.layers):
            self._load(p, i + nbuf, b)
        return out.to(x.dtype)

    def _add_compute_sample(self, seconds: float, entries: int) -> None:
        """Fold one layer call's compute time into :attr:`compute_s_per_entry` (an
        exponential average, weight :data:`_EWMA`, of seconds per routed entry)."""
        if entries <= 0 or not seconds > 0:
            return
        rate = seconds / entries
        old = self.compute_s_per_entry
        self.compute_s_per_entry = rate if old is None else old + _EWMA * (rate - old)

    def _read_timings(self) -> None:
        """Fold in the CUDA timings whose end event has completed (``query``: no host sync);
        the others wait for a later decision."""
        pending = []
        for start, end, entries in self._timings:
            if end.query():
                self._add_compute_sample(start.elapsed_time(end) / 1e3, entries)
            else:
                pending.append((start, end, entries))
        self._timings = pending

    def _finish(self) -> None:
        p, self._pass = self._pass, None
        self._lane.drain()
        p.keep.clear()
        self.link_bytes += p.link_bytes
        if p.next_index == len(p.layers):
            self._keep_last_layers(p)

    def _keep_last_layers(self, p: _Pass) -> None:
        """After a completed pass (its copies drained) the buffers hold the last ``nbuf``
        layers whole: every expert there without a slot of its own (the survivors of the
        borrow keep theirs) becomes the cache entry of its buffer slot, used now, so decode
        starts with those layers resident; the other buffer slots stay empty."""
        c, t = self.cache, self.cache.tables
        E, nbuf, n = c.num_experts, len(p.buffers), len(p.layers)
        slots, ids = [], []
        for i in range(max(0, n - nbuf), n):
            layer, buf, resident = p.layers[i], p.buffers[i % nbuf], p.resident[i]
            for e in range(E):
                if resident[e] < 0:
                    slots.append(buf[e])
                    ids.append(layer * E + e)
        if not slots:
            return
        slot_t = torch.tensor(slots, dtype=torch.long, device=c.device)
        id_t = torch.tensor(ids, dtype=torch.long, device=c.device)
        t.slot_of_id[id_t] = slot_t.to(torch.int32)
        t.id_of_slot[slot_t] = id_t.to(torch.int32)
        t.slot_last_use[slot_t] = t.clock.expand(len(slots))
        self.kept_entries += len(slots)


_LABEL = {
    PrefillPath.TWO_BUFFERS: "two full-layer buffers",
    PrefillPath.ONE_BUFFER: "one full-layer buffer",
}


_EWMA = 0.25  # weight of a new layer call's compute time in compute_s_per_entry
_MAX_TIMINGS = 256  # CUDA timing pairs kept unread at most (the oldest are dropped)


def _nbuf(path: PrefillPath) -> int:
    return {PrefillPath.TWO_BUFFERS: 2, PrefillPath.ONE_BUFFER: 1}.get(path, 0)


def _fill_list(pairs, device) -> FillList:
    """A fill work list of ``(source row, destination slot)`` pairs, every entry valid."""
    src, dst = zip(*pairs)
    counts = [0] * len(Stat)
    counts[Stat.FILLS] = len(pairs)
    i32 = dict(dtype=torch.int32, device=device)
    return FillList(
        fill_src=torch.tensor(src, **i32),
        fill_dst=torch.tensor(dst, **i32),
        counts=torch.tensor(counts, **i32),
    )
