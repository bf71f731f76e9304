"""The prefill double buffer on the CPU (``expert_cache/prefill_stream.py``; FreeToken §3.1).

Forced on (``--expert-cache-prefill-stream force``), prefill passes run every MoE layer from
full-layer buffers borrowed from the slot pool; the outputs are bit-identical to the ordinary
path's (the same executor kernel per (token, expert) entry), the tables stay a valid cache
state, every entry that was not borrowed survives, the borrowed slots return empty, and
decode calls, calls out of layer order and resizes take the ordinary path.
"""

from __future__ import annotations

import pytest
import torch
from test_slot_cache import E, H, K, L, make_cache

from sglang.srt.layers.moe.expert_cache.config import ExpertCacheConfig
from sglang.srt.layers.moe.expert_cache.prefill_plan import PrefillPath
from sglang.srt.layers.moe.expert_cache.prefill_stream import PrefillStream


def passes(n: int, seed: int = 5):
    """``n`` forward passes, each a list of (layer, x, w, ids) over every layer in order:
    prefill passes of 2-40 tokens (some padded entries) and decode passes of one token."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        t = 1 if i % 3 == 2 else int(torch.randint(2, 41, (1,), generator=g))
        calls = []
        for layer in range(L):
            ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)]).to(
                torch.int32
            )
            if t > 2:
                ids[0, -1] = -1
            w = torch.rand(t, K, generator=g)
            x = torch.randn(t, H, generator=g).to(torch.bfloat16)
            calls.append((layer, x, w / w.sum(-1, keepdim=True), ids))
        out.append(calls)
    return out


def forced(size: str, path=None, policy: str = "qstar"):
    cache = make_cache(size, policy)
    cache.prefill_stream = PrefillStream(cache, "force", path=path)
    return cache


def entries(cache):
    return {s: g for s, g in enumerate(cache.tables.id_of_slot.tolist()) if g >= 0}


@pytest.mark.parametrize(
    "size,path",
    [
        ("100%", PrefillPath.TWO_BUFFERS),  # 48 slots: two layers of 16 and 16 entries survive
        ("75%", PrefillPath.TWO_BUFFERS),  # 36 slots
        ("50%", PrefillPath.ONE_BUFFER),  # 24 slots: one layer only
        ("25%", PrefillPath.SPLIT),  # 12 slots: not one layer; the decode path
    ],
)
def test_streamed_prefill_is_bit_identical_and_leaves_the_tables_intact(size, path):
    base = make_cache("100%", "fill")
    base.prefill_stream = PrefillStream(base, "off")
    cache = forced(size)
    nbuf = {PrefillPath.TWO_BUFFERS: 2, PrefillPath.ONE_BUFFER: 1, PrefillPath.SPLIT: 0}[path]
    streamed = 0
    borrowed, borrow = [], cache.prefill_stream._borrow  # the buffer slots of each pass
    cache.prefill_stream._borrow = lambda n: borrowed.append(borrow(n)) or borrowed[-1]
    for n, calls in enumerate(passes(12)):
        before = entries(cache)
        clock = int(cache.tables.clock.item())
        for layer, x, w, ids in calls:
            want = base.forward(layer, x, w, ids)
            got = cache.forward(layer, x, w, ids)
            assert torch.equal(got, want), f"pass {n}, layer {layer}"
        assert not cache.prefill_stream.active
        cache.check_invariants()
        assert int(cache.tables.clock.item()) == clock + L  # one tick per layer call
        prefill = calls[0][1].shape[0] > 1
        if prefill and nbuf:
            streamed += 1
            after = entries(cache)
            kept = {s: g for s, g in after.items() if s in borrowed[-1]}
            survivors = {s: g for s, g in after.items() if s not in kept}
            assert all(before.get(s) == g for s, g in survivors.items())
            # every entry that was not borrowed survives in its slot; the buffers came back
            # holding the last nbuf layers whole (the experts without a survivor slot), each
            # slot's bytes those of its expert's host-pool row
            assert len(survivors) == min(len(before), cache.num_slots - nbuf * E)
            assert {g // E for g in kept.values()} <= set(range(L - nbuf, L))
            resident = set(after.values())
            assert all(layer * E + e in resident for layer in range(L - nbuf, L) for e in range(E))
            for slot, g in kept.items():
                for name, bank in cache.slots.tensors.items():
                    assert torch.equal(bank[slot], cache.host.tensors[name][g]), (name, slot)
    assert cache.prefill_stream.passes[path] == sum(c[0][1].shape[0] > 1 for c in passes(12))
    assert cache.prefill_stream.abandoned == 0
    assert streamed == (cache.prefill_stream.passes[path] if nbuf else 0)


def test_compute_time_is_measured_and_enters_the_model():
    """A streamed pass measures the compute seconds per routed entry, and the next decision
    models ``C`` = routed x that rate: one buffer then costs ``X + C`` > two buffers'
    ``max(X, C)``, and the split at least ``C`` (``prefill_plan.path_times``)."""
    cache = forced("100%", PrefillPath.TWO_BUFFERS)
    stream = cache.prefill_stream
    assert stream.compute_s_per_entry is None
    for layer, x, w, ids in passes(1)[0]:  # one prefill pass over every layer
        cache.forward(layer, x, w, ids)
    rate = stream.compute_s_per_entry
    assert rate is not None and 0 < rate < 1.0
    tokens = 4096
    stream.decide(tokens)
    t, c = stream.last_times, tokens * K * rate
    x = t.one_buffer - c  # the layer's transfer time X
    assert x > 0 and t.two_buffers == pytest.approx(max(x, c))
    assert t.split >= c


def test_resident_experts_are_copied_slot_to_slot():
    cache = forced("100%", PrefillPath.TWO_BUFFERS)
    stream = cache.prefill_stream
    calls = passes(1)[0]
    survivors = len(entries(cache)) - 2 * E  # 16 entries outlive the borrow
    seen = []
    orig = stream._load

    def spy(p, index, b):
        orig(p, index, b)
        seen.append(p.link_bytes)

    stream._load = spy
    for layer, x, w, ids in calls:
        cache.forward(layer, x, w, ids)
    assert len(seen) == L
    streamed_rows = seen[-1] // cache.host.expert_bytes
    assert streamed_rows == L * E - survivors  # the survivors were not read from the host pool


def test_one_buffer_and_two_buffers_give_the_same_outputs():
    calls = [c for c in passes(6) if c[0][1].shape[0] > 1]
    outs = {}
    for path in (PrefillPath.TWO_BUFFERS, PrefillPath.ONE_BUFFER, PrefillPath.SPLIT):
        cache = forced("100%", path)
        outs[path] = [cache.forward(*c) for p in calls for c in p]
        assert cache.prefill_stream.passes[path] == len(calls)
    for path in outs:
        assert all(torch.equal(a, b) for a, b in zip(outs[path], outs[PrefillPath.SPLIT]))


def test_decode_calls_and_calls_out_of_order_take_the_ordinary_path():
    base = make_cache("100%", "fill")
    cache = forced("100%")
    stream = cache.prefill_stream
    calls = passes(1)[0]
    # a decode batch (one token outside a server forward) never streams
    one = [(layer, x[:1], w[:1], ids[:1]) for layer, x, w, ids in calls]
    for c in one:
        assert torch.equal(cache.forward(*c), base.forward(*c))
    assert sum(stream.passes.values()) == 0
    # a pass cut short: layer 0 streamed, then layer 2 -> abandoned, the ordinary path runs
    for c in (calls[0], calls[2]):
        assert torch.equal(cache.forward(*c), base.forward(*c))
    assert stream.abandoned == 1 and not stream.active
    assert stream.kept_entries == 0  # an abandoned pass keeps no buffer as entries
    cache.check_invariants()
    # a pass left open, then a resize at a safe point
    cache.forward(*calls[0])
    assert stream.active
    cache.resize_slots(2 * E)
    assert not stream.active and stream.abandoned == 2
    cache.check_invariants()
    for c in calls:
        assert torch.equal(cache.forward(*c), base.forward(*c))


def test_auto_is_off_on_a_cpu_only_machine_and_off_is_off():
    for mode in ("auto", "off"):
        cache = make_cache("100%", "fill")
        cache.prefill_stream = PrefillStream(cache, mode)
        assert not cache.prefill_stream.enabled
        for c in passes(1)[0]:
            cache.forward(*c)
        assert sum(cache.prefill_stream.passes.values()) == 0


def test_flag_is_read_from_the_server_args():
    class Moe:
        expert_cache_prefill_stream = "force"

    assert ExpertCacheConfig.from_server_args(Moe()).prefill_stream == "force"
    assert ExpertCacheConfig.from_server_args(object()).prefill_stream == "auto"
    Moe.expert_cache_prefill_stream = "always"
    with pytest.raises(ValueError, match="--expert-cache-prefill-stream"):
        ExpertCacheConfig.from_server_args(Moe())


class RecordingLane:
    """A copy lane that runs each load at once and records the handles, standing in for the
    CUDA lane's stream and events: which load each compute waits for, and which compute each
    load waits for."""

    def __init__(self):
        self.log = []
        self.n = 0

    def begin(self):
        self.log.append(("begin",))

    def load(self, fn, after):
        fn()
        self.n += 1
        handle = ("loaded", self.n)
        self.log.append(("load", handle, after))
        return handle

    def ready(self, handle):
        self.log.append(("wait", handle))

    def computed(self):
        self.n += 1
        handle = ("computed", self.n)
        self.log.append(("compute", handle))
        return handle

    def drain(self):
        self.log.append(("drain",))


@pytest.mark.parametrize("path", [PrefillPath.TWO_BUFFERS, PrefillPath.ONE_BUFFER])
def test_the_copy_lane_choreography(path):
    """The order the CUDA lane's events encode: with two buffers layers 0 and 1 load at the
    borrow and layer i + 2 loads into layer i's buffer after layer i's compute; with one
    buffer layer i + 1 loads after layer i's compute; each compute waits for its own layer's
    load; the pass ends with a drain."""
    cache = forced("100%", path)
    lane = cache.prefill_stream._lane = RecordingLane()
    loads = []
    orig = cache.prefill_stream._load

    def spy(p, index, b):
        loads.append((p.layers[index], b))
        orig(p, index, b)

    cache.prefill_stream._load = spy
    calls = passes(1)[0]
    for c in calls:
        cache.forward(*c)
    nbuf = 2 if path is PrefillPath.TWO_BUFFERS else 1
    assert loads == [(layer, layer % nbuf) for layer in range(L)]
    log = lane.log
    assert log[0] == ("begin",) and log[-1] == ("drain",)
    load_of = {}  # layer -> its load's handle
    done_of = {}  # layer -> its compute's handle
    it = iter(range(L))
    computed = 0
    for entry in log[1:-1]:
        if entry[0] == "load":
            layer = next(it)
            load_of[layer] = entry[1]
            # a buffer's next load waits for the compute of the layer that used it last
            prev = layer - nbuf
            assert entry[2] == (done_of[prev] if prev >= 0 else None), (layer, entry)
        elif entry[0] == "wait":
            assert entry[1] == load_of[computed], "a compute waits for its own layer's load"
        elif entry[0] == "compute":
            done_of[computed] = entry[1]
            computed += 1
    assert computed == L


def test_outside_a_server_forward_only_force_streams():
    """Without a server forward (no forward batch to read the mode from) ``force`` takes a call
    of more than one token as prefill and ``auto`` never streams, so that the eager layer calls
    of the CUDA tests keep the path they test."""
    cache = make_cache("100%", "fill")
    auto, force = PrefillStream(cache, "auto"), PrefillStream(cache, "force")
    assert auto._phase(40) is None and auto._phase(1) is None
    assert force._phase(40) == "prefill" and force._phase(1) == "decode"
