#!/usr/bin/env python
"""Replay MoE routing traces against expert-placement policies and print decode miss rates.

The question (paper §2.2, §3.2, §5.3 Fig. 4b): at a given GPU expert capacity, what fraction of
the experts that decode routes to are not resident, under FreeToken's shared LRU slot cache and
under the placements of existing engines?

    python benchmark/expert_cache/bench_missrate.py                      # synthetic trace (default)
    python benchmark/expert_cache/bench_missrate.py --trace routing.jsonl

Trace (``--trace``): JSONL, one line per MoE layer call, as the server's routing recorder writes
it::

    {"step": 12, "layer": 3, "phase": "decode", "tokens": 1, "experts": [5, 17, ...],
     "counts": [1, 1, ...], "num_experts": 128, "num_layers": 48}

``experts`` are the distinct routed expert ids of that (step, layer) call, sorted; ``counts`` the
tokens routed to each. Calls are replayed in (step, layer) order. Without ``--trace`` a synthetic
trace is generated (``--synthetic``; model and defaults in ``SynthParams``).

Simulated policies, all at the same capacity of S = round(capacity% x L x E) expert slots, all
keyed by the global id g = layer * E + expert:

* ``lru_shared`` (FreeToken): ONE LRU pool of S slots shared by every MoE layer, cold at load.
  Per (step, layer) call: the call's distinct experts already resident are hits and become most
  recent; every miss is filled ("fill" policy: the q* split of §3.2 decides which misses go over
  PCIe now and which run on the CPU, but each miss is one miss either way; simulating q* would
  only delay fills). Victims are the least recently used slots, never an expert routed in the
  current call, so a call with more misses than S - hits fills only that many (the rest stay on
  the CPU, unfilled). Within a call, hits and then fills are touched in priority order (tokens
  routed desc, id asc); that order also picks which misses are filled when not all fit. Prefill
  calls are replayed like decode calls (their routed experts pass through the same pool).
* ``lru_per_layer`` (upstream's per-layer paged experts): the same LRU, but S split into one
  pool per layer (S // L slots each, the first S % L layers one more).
* ``static`` (a placement fixed at load, frequency-informed): the S experts with the most routed
  tokens over a calibration prefix of the trace (the first ``--calib-frac`` of its steps),
  chosen globally across layers (not per-layer shares); ties and unseen experts by global id.
  The calibration prefix is excluded from the measured miss rates of EVERY policy (all policies
  still run through it, so the LRUs arrive warm).
* ``static_blind`` (llama.cpp-like, routing-blind, ``--n-cpu-moe``): whole layers resident, the
  last floor(S / E) layers, plus the S mod E lowest-id experts of the layer before them.
* ``refresh_prefill`` (KTransformers-like): cold at load; after each prefill step the placement
  becomes the S experts with the most tokens routed in that prefill (ties: experts already
  resident first, then global id), held fixed through the decode steps that follow. The prefill
  step itself is served by the placement that preceded it.

A miss is a routed distinct expert of a call that is not resident when the call starts. Miss
rate = sum of misses / sum of routed distinct experts over the measured calls; reported for
decode calls, for all calls, and per token entry for decode (each token->expert routing counted,
i.e. weighted by ``counts``). The last line is::

    expert_cache_missrate source=synthetic|trace lru_c25=.. static_c25=.. refresh_c25=.. \
        lru_c50=.. static_c50=.. refresh_c50=.. [blind_c25=.. lru_layer_c25=.. ...]

with decode miss rates at 25% and 50% capacity (``lru`` = ``lru_shared``, ``static`` = the
calibrated ``static``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Iterable, Optional, Sequence

import numpy as np

DEFAULT_CAPACITIES = (5, 10, 25, 50, 75, 100)
POLICIES = ("lru_shared", "lru_per_layer", "static", "static_blind", "refresh_prefill")
PHASES = ("prefill", "decode")


# --------------------------------------------------------------------------------------- trace
@dataclass(frozen=True)
class Call:
    """One MoE layer call of one forward step: its distinct routed experts and their counts."""

    step: int
    layer: int
    prefill: bool
    tokens: int
    experts: tuple[int, ...]
    counts: tuple[int, ...]


class Trace:
    """Calls sorted by (step, layer), stored flat. Per call i, entries ``offsets[i]:offsets[i+1]``
    of ``gids``/``counts`` are its distinct global expert ids in priority order (count desc,
    id asc)."""

    def __init__(self, num_layers: int, num_experts: int, calls: Iterable[Call]):
        self.num_layers, self.num_experts = num_layers, num_experts
        calls = sorted(calls, key=lambda c: (c.step, c.layer))
        E = num_experts
        self.step = np.array([c.step for c in calls], dtype=np.int64)
        self.layer = np.array([c.layer for c in calls], dtype=np.int64)
        self.prefill = np.array([c.prefill for c in calls], dtype=bool)
        self.tokens = np.array([c.tokens for c in calls], dtype=np.int64)
        gids, counts, offsets = [], [], [0]
        for c in calls:
            assert len(c.experts) == len(c.counts) > 0
            order = sorted(range(len(c.experts)), key=lambda j: (-c.counts[j], c.experts[j]))
            gids.extend(c.layer * E + c.experts[j] for j in order)
            counts.extend(c.counts[j] for j in order)
            offsets.append(len(gids))
        self.gids = np.array(gids, dtype=np.int64)
        self.counts = np.array(counts, dtype=np.int64)
        self.offsets = np.array(offsets, dtype=np.int64)
        self.sizes = np.diff(self.offsets)
        self.entry_call = np.repeat(np.arange(len(calls)), self.sizes)
        # a step is a prefill step if any of its calls is
        steps, inv = np.unique(self.step, return_inverse=True)
        step_prefill = np.zeros(len(steps), dtype=bool)
        np.logical_or.at(step_prefill, inv, self.prefill)
        self.steps, self.step_index, self.step_is_prefill = steps, inv, step_prefill

    @property
    def num_calls(self) -> int:
        return len(self.step)

    @property
    def pool(self) -> int:
        return self.num_layers * self.num_experts

    def calib_end_step(self, frac: float) -> int:
        """First step of the measured part: the first ``floor(frac * steps)`` distinct steps are
        the calibration prefix."""
        n = int(math.floor(frac * len(self.steps) + 1e-9))
        if n >= len(self.steps):
            raise ValueError(f"--calib-frac {frac} leaves no step to measure")
        return int(self.steps[n])


def _err(path, lineno: int, msg: str) -> ValueError:
    return ValueError(f"{path}: line {lineno}: {msg}")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def parse_trace_jsonl(path: str | Path) -> Trace:
    """Parse a routing trace (module docstring); malformed lines raise ValueError naming the
    line number. Blank lines are skipped."""
    calls: list[Call] = []
    shape: Optional[tuple[int, int]] = None
    seen: dict[tuple[int, int], int] = {}
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise _err(path, lineno, f"not JSON ({e.msg})") from None
            if not isinstance(rec, dict):
                raise _err(path, lineno, "not a JSON object")
            for key in (
                "step",
                "layer",
                "phase",
                "tokens",
                "experts",
                "counts",
                "num_experts",
                "num_layers",
            ):
                if key not in rec:
                    raise _err(path, lineno, f"missing key {key!r}")
            for key in ("step", "layer", "tokens", "num_experts", "num_layers"):
                if not _is_int(rec[key]) or rec[key] < 0:
                    raise _err(
                        path, lineno, f"{key!r} must be a non-negative int, got {rec[key]!r}"
                    )
            L, E = rec["num_layers"], rec["num_experts"]
            if L < 1 or E < 1:
                raise _err(path, lineno, "num_layers and num_experts must be >= 1")
            if shape is None:
                shape = (L, E)
            elif shape != (L, E):
                raise _err(
                    path,
                    lineno,
                    f"num_layers/num_experts {L}/{E} differ from earlier "
                    f"lines ({shape[0]}/{shape[1]})",
                )
            if rec["layer"] >= L:
                raise _err(path, lineno, f"layer {rec['layer']} out of range [0, {L})")
            if rec["phase"] not in PHASES:
                raise _err(path, lineno, f"phase must be one of {PHASES}, got {rec['phase']!r}")
            ex, ct = rec["experts"], rec["counts"]
            if not isinstance(ex, list) or not isinstance(ct, list):
                raise _err(path, lineno, "'experts' and 'counts' must be lists")
            if not ex:
                raise _err(path, lineno, "'experts' is empty")
            if len(ex) != len(ct):
                raise _err(path, lineno, f"'experts' has {len(ex)} ids but 'counts' {len(ct)}")
            if not all(_is_int(e) and 0 <= e < E for e in ex):
                raise _err(path, lineno, f"'experts' must be ints in [0, {E})")
            if any(a >= b for a, b in zip(ex, ex[1:])):
                raise _err(path, lineno, "'experts' must be distinct and sorted ascending")
            if not all(_is_int(c) and c >= 1 for c in ct):
                raise _err(path, lineno, "'counts' must be ints >= 1")
            key = (rec["step"], rec["layer"])
            if key in seen:
                raise _err(
                    path, lineno, f"duplicate (step, layer) = {key}, first on line {seen[key]}"
                )
            seen[key] = lineno
            calls.append(
                Call(
                    rec["step"],
                    rec["layer"],
                    rec["phase"] == "prefill",
                    rec["tokens"],
                    tuple(ex),
                    tuple(ct),
                )
            )
    if shape is None:
        raise ValueError(f"{path}: no trace lines")
    return Trace(shape[0], shape[1], calls)


# ----------------------------------------------------------------------------- synthetic model
@dataclass(frozen=True)
class SynthParams:
    """Routing model with temporal locality (shapes default to Qwen3-30B-A3B: 48 MoE layers,
    128 experts, top-8). Requests run one after another at batch size 1: one prefill step of
    ``prefill_tokens`` tokens, then ``decode_tokens`` decode steps of one token each.

    Token routing, per layer: expert e's log-weight is base[l, e] + topic[l, e]; base is Zipf
    (weight of popularity rank r = (r + 1) ** -zipf over a random per-layer ranking) and
    drifts: after every token each base log-weight takes an independent N(0, drift**2) step.
    topic: per request and layer, ``topic_experts`` random experts get + log(topic_boost).
    Each of the previous token's k experts in that layer (same request) is kept with
    probability ``persist``; the remaining slots are drawn without replacement from the
    weights (Gumbel top-k)."""

    num_layers: int = 48
    num_experts: int = 128
    top_k: int = 8
    requests: int = 12
    prefill_tokens: int = 512
    decode_tokens: int = 256
    zipf: float = 1.0
    drift: float = 0.01
    topic_experts: int = 16
    topic_boost: float = 4.0
    persist: float = 0.5
    seed: int = 0

    def describe(self) -> str:
        return " ".join(f"{k}={v}" for k, v in asdict(self).items())


def generate_synthetic(p: SynthParams) -> Trace:
    L, E, k = p.num_layers, p.num_experts, p.top_k
    assert 1 <= k <= E and p.topic_experts <= E and p.prefill_tokens >= 1
    rng = np.random.default_rng(p.seed)
    rank = np.argsort(rng.random((L, E)), axis=1)
    base = -p.zipf * np.log1p(rank.astype(np.float64))
    rows = np.arange(L)[:, None]
    calls: list[Call] = []
    step = 0

    for _ in range(p.requests):
        topic = np.zeros((L, E))
        if p.topic_experts:
            hot = np.argpartition(rng.random((L, E)), p.topic_experts - 1, axis=1)
            topic[rows, hot[:, : p.topic_experts]] = math.log(p.topic_boost)
        prev: Optional[np.ndarray] = None

        def route() -> np.ndarray:
            nonlocal prev, base
            scores = base + topic + rng.gumbel(size=(L, E))  # noqa: B023 (called in this iteration)
            if prev is not None and p.persist > 0:
                r, c = np.nonzero(rng.random((L, k)) < p.persist)
                scores[r, prev[r, c]] = np.inf
            prev = np.argpartition(-scores, k - 1, axis=1)[:, :k]
            if p.drift:
                base = base + rng.normal(0.0, p.drift, (L, E))
            return prev

        counts = np.zeros((L, E), dtype=np.int64)
        for _ in range(p.prefill_tokens):
            counts[rows, route()] += 1
        for l in range(L):
            ex = np.flatnonzero(counts[l])
            calls.append(
                Call(
                    step,
                    l,
                    True,
                    p.prefill_tokens,
                    tuple(ex.tolist()),
                    tuple(counts[l, ex].tolist()),
                )
            )
        step += 1
        for _ in range(p.decode_tokens):
            chosen = np.sort(route(), axis=1).tolist()
            for l in range(L):
                calls.append(Call(step, l, False, 1, tuple(chosen[l]), (1,) * k))
            step += 1
    return Trace(L, E, calls)


# ------------------------------------------------------------------------------------ policies
def capacity_slots(trace: Trace, capacity_pct: float) -> int:
    return int(round(capacity_pct / 100.0 * trace.pool))


def simulate_lru(
    trace: Trace,
    slots: int,
    per_layer: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """LRU slot cache(s) with the fill policy (module docstring). Returns per-call
    (missed distinct experts, missed token entries)."""
    L = trace.num_layers
    if per_layer:
        caps = [slots // L + (1 if l < slots % L else 0) for l in range(L)]
        caches = [OrderedDict() for _ in range(L)]
    else:
        caps, caches = [slots] * L, [OrderedDict()] * L  # one pool, seen from every layer
    gl, cl = trace.gids.tolist(), trace.counts.tolist()
    off, layers = trace.offsets.tolist(), trace.layer.tolist()
    n = trace.num_calls
    miss = np.zeros(n, dtype=np.int64)
    miss_tok = np.zeros(n, dtype=np.int64)
    for i in range(n):
        od, cap = caches[layers[i]], caps[layers[i]]
        fills = []
        mt = 0
        for j in range(off[i], off[i + 1]):
            g = gl[j]
            if g in od:
                od.move_to_end(g)
            else:
                fills.append(g)
                mt += cl[j]
        room = cap - (off[i + 1] - off[i] - len(fills))  # free + evictable slots
        # the hits of this call now sit at the MRU end; with at most `room` fills the
        # evictions below reach only slots this call did not route to
        for g in fills[: max(room, 0)]:
            if len(od) >= cap:
                od.popitem(last=False)
            od[g] = None
        miss[i], miss_tok[i] = len(fills), mt
    return miss, miss_tok


def simulate_placements(
    trace: Trace,
    placements: np.ndarray,
    version: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Fixed placements: call i is served by ``placements[version[i]]`` (a bool row over the
    L*E global ids). Returns per-call (missed distinct experts, missed token entries)."""
    missed = ~placements[version[trace.entry_call], trace.gids]
    n = trace.num_calls
    miss = np.bincount(trace.entry_call, weights=missed, minlength=n).astype(np.int64)
    miss_tok = np.bincount(trace.entry_call, weights=missed * trace.counts, minlength=n).astype(
        np.int64
    )
    return miss, miss_tok


def top_slots(score: np.ndarray, slots: int, prefer: Optional[np.ndarray] = None) -> np.ndarray:
    """Bool placement holding the ``slots`` highest-scoring global ids; ties go to ``prefer``
    (e.g. already resident) first, then to the lower id."""
    keys = [np.arange(len(score)), -score]
    if prefer is not None:
        keys.insert(1, ~prefer)
    order = np.lexsort(keys)
    out = np.zeros(len(score), dtype=bool)
    out[order[:slots]] = True
    return out


def token_counts(trace: Trace, call_mask: np.ndarray) -> np.ndarray:
    """Routed tokens per global id over the calls in ``call_mask``."""
    m = call_mask[trace.entry_call]
    return np.bincount(trace.gids[m], weights=trace.counts[m], minlength=trace.pool)


def static_calibrated(trace: Trace, slots: int, calib_end_step: int) -> np.ndarray:
    return top_slots(token_counts(trace, trace.step < calib_end_step), slots)


def static_blind(trace: Trace, slots: int) -> np.ndarray:
    """llama.cpp --n-cpu-moe: the last whole layers on the GPU, the rest of S from the layer
    before them by expert id. Global ids of the last layers are the highest, so: the top S."""
    out = np.zeros(trace.pool, dtype=bool)
    full, rest = divmod(slots, trace.num_experts)
    first = trace.num_layers - full
    out[first * trace.num_experts :] = True
    if rest:
        out[(first - 1) * trace.num_experts : (first - 1) * trace.num_experts + rest] = True
    return out


def refresh_prefill_placements(trace: Trace, slots: int) -> tuple[np.ndarray, np.ndarray]:
    """(placements, per-call version): version 0 is the empty placement at load; version v is
    the placement computed from the v-th prefill step, serving the steps after it."""
    prefill_steps = np.flatnonzero(trace.step_is_prefill)
    placements = np.zeros((len(prefill_steps) + 1, trace.pool), dtype=bool)
    for v, s in enumerate(prefill_steps, 1):
        cnt = token_counts(trace, trace.step_index == s)
        placements[v] = top_slots(cnt, slots, prefer=placements[v - 1])
    # steps served by version v: after the v-th prefill step, up to and including the next one
    version = np.searchsorted(prefill_steps, trace.step_index, side="left")
    return placements, version


def simulate_all(
    trace: Trace,
    capacity_pct: float,
    calib_end_step: int,
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per-call (misses, missed token entries) of every policy at one capacity."""
    S = capacity_slots(trace, capacity_pct)
    one = np.zeros(trace.num_calls, dtype=np.int64)
    placements, version = refresh_prefill_placements(trace, S)
    return {
        "lru_shared": simulate_lru(trace, S),
        "lru_per_layer": simulate_lru(trace, S, per_layer=True),
        "static": simulate_placements(
            trace, static_calibrated(trace, S, calib_end_step)[None], one
        ),
        "static_blind": simulate_placements(trace, static_blind(trace, S)[None], one),
        "refresh_prefill": simulate_placements(trace, placements, version),
    }


@dataclass(frozen=True)
class Rates:
    decode: float
    overall: float
    decode_token: float


def miss_rates(trace: Trace, miss: np.ndarray, miss_tok: np.ndarray, calib_end_step: int) -> Rates:
    measured = trace.step >= calib_end_step
    dec = measured & ~trace.prefill
    tok = np.bincount(trace.entry_call, weights=trace.counts, minlength=trace.num_calls)

    def rate(num: np.ndarray, den: np.ndarray, mask: np.ndarray) -> float:
        d = den[mask].sum()
        return float(num[mask].sum() / d) if d else float("nan")

    return Rates(
        rate(miss, trace.sizes, dec), rate(miss, trace.sizes, measured), rate(miss_tok, tok, dec)
    )


# ---------------------------------------------------------------------------------------- main
def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--trace", type=Path, help="routing trace JSONL recorded by the server")
    src.add_argument(
        "--synthetic",
        action="store_true",
        help="generate a synthetic trace (the default when no --trace)",
    )
    p.add_argument(
        "--capacities",
        default=",".join(map(str, DEFAULT_CAPACITIES)),
        help="capacities in %% of the L*E expert pool (default %(default)s; 25 and 50 "
        "are always added for the last line)",
    )
    p.add_argument(
        "--calib-frac",
        type=float,
        default=0.1,
        help="fraction of the trace's steps (from the start) that calibrate the static "
        "placement and are excluded from every policy's measured miss rate "
        "(default %(default)s)",
    )
    d = SynthParams()
    for f in fields(SynthParams):
        p.add_argument(
            "--" + f.name.replace("_", "-"),
            type=type(getattr(d, f.name)),
            default=getattr(d, f.name),
            help=f"synthetic: {f.name} (default %(default)s)",
        )
    a = p.parse_args(argv)
    try:
        caps = {float(x) for x in a.capacities.split(",") if x.strip()} | {25.0, 50.0}
    except ValueError:
        p.error(f"--capacities: not a comma-separated list of numbers: {a.capacities!r}")
    if not all(0 < c <= 100 for c in caps):
        p.error("--capacities must lie in (0, 100]")
    a.capacities = sorted(caps)
    if not 0 <= a.calib_frac < 1:
        p.error("--calib-frac must lie in [0, 1)")
    return a


def _fmt(x: float) -> str:
    return "nan" if math.isnan(x) else f"{x:.4f}"


def _pct(c: float) -> str:
    return f"{c:g}"


def main(argv: Optional[Sequence[str]] = None, out=print) -> int:
    a = parse_args(argv)
    t0 = time.perf_counter()
    if a.trace is not None:
        trace, source = parse_trace_jsonl(a.trace), "trace"
        desc = f"trace={a.trace}"
    else:
        sp = SynthParams(**{f.name: getattr(a, f.name) for f in fields(SynthParams)})
        trace, source, desc = generate_synthetic(sp), "synthetic", sp.describe()
    t_load = time.perf_counter() - t0
    end = trace.calib_end_step(a.calib_frac)
    measured = trace.step >= end
    n_calib = int(np.searchsorted(trace.steps, end))
    dec = measured & ~trace.prefill

    out(f"# expert_cache_missrate source={source} {desc}")
    out(
        f"# trace: L={trace.num_layers} E={trace.num_experts} pool={trace.pool} "
        f"steps={len(trace.steps)} (prefill {int(trace.step_is_prefill.sum())}) "
        f"calls={trace.num_calls} mean distinct experts per decode call="
        f"{trace.sizes[~trace.prefill].mean() if (~trace.prefill).any() else float('nan'):.2f}"
        f", per prefill call="
        f"{trace.sizes[trace.prefill].mean() if trace.prefill.any() else float('nan'):.2f}"
    )
    dec_steps = np.unique(trace.step[~trace.prefill])
    if len(dec_steps):
        ws = trace.sizes[~trace.prefill].sum() / len(dec_steps)
        out(
            f"# one decode step routes {ws:.1f} distinct experts over all layers "
            f"({100 * ws / trace.pool:.2f}% of the pool): a shared LRU pool short of that "
            f"sweeps cyclically across layers (the LRU pathology; every access misses once "
            f"the pool is a layer's share short of it)"
        )
    out(
        f"# calibration: first {n_calib} of {len(trace.steps)} steps (--calib-frac "
        f"{a.calib_frac}) give static its token counts and are excluded from every policy's "
        f"measured rates; measured: {int(measured.sum())} calls ({int(dec.sum())} decode)"
    )
    out(
        "# policies: lru_shared = one LRU pool of S slots over all layers, every miss filled, "
        "victims never routed in the current call; lru_per_layer = S/L slots per layer; "
        "static = top-S experts by calibration token counts, global across layers; "
        "static_blind = llama.cpp --n-cpu-moe (last whole layers); refresh_prefill = top-S of "
        "each prefill's token counts, fixed until the next prefill (cold before the first)"
    )

    results: dict[float, dict[str, Rates]] = {}
    for c in a.capacities:
        sims = simulate_all(trace, c, end)
        results[c] = {k: miss_rates(trace, *v, end) for k, v in sims.items()}

    head = f"{'cap%':>5} {'slots':>6} " + " ".join(f"{k:>15}" for k in POLICIES)
    tables = [
        ("decode miss rate (misses / routed distinct experts per call)", "decode"),
        ("overall miss rate (prefill + decode calls)", "overall"),
    ]
    if (trace.counts[dec[trace.entry_call]] > 1).any():
        tables.append(
            (
                "decode per-token-entry miss rate (token->expert routings whose expert "
                "is not resident)",
                "decode_token",
            )
        )
    for title, attr in tables:
        out(f"# {title}")
        out(head)
        for c in a.capacities:
            out(
                f"{_pct(c):>5} {capacity_slots(trace, c):>6} "
                + " ".join(f"{_fmt(getattr(results[c][k], attr)):>15}" for k in POLICIES)
            )
    if len(tables) == 2:
        out(
            "# decode per-token-entry miss rate: equal to the decode miss rate (every decode "
            "call routes each expert for one token)"
        )
    out(f"# wall {time.perf_counter() - t0:.1f}s (trace {t_load:.1f}s)")

    last = [f"expert_cache_missrate source={source}"]
    for c in (25.0, 50.0):
        r = results[c]
        last += [
            f"lru_c{_pct(c)}={_fmt(r['lru_shared'].decode)}",
            f"static_c{_pct(c)}={_fmt(r['static'].decode)}",
            f"refresh_c{_pct(c)}={_fmt(r['refresh_prefill'].decode)}",
        ]
    for c in (25.0, 50.0):
        r = results[c]
        last += [
            f"blind_c{_pct(c)}={_fmt(r['static_blind'].decode)}",
            f"lru_layer_c{_pct(c)}={_fmt(r['lru_per_layer'].decode)}",
        ]
    out(" ".join(last))
    return 0


if __name__ == "__main__":
    sys.exit(main())
