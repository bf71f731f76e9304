"""Where a prefill chunk ends so that the recurrent state at an anchor gets saved.

A recurrent (gated DeltaNet / Mamba) layer's exact state at position ``p`` exists only when a
forward pass ends at ``p``. Upstream's no-buffer hybrid radix cache already inserts the state at
every prefill chunk end (``checkpoint_kv_cache``) and at the request end, so ending a chunk at an
anchor is all it takes to store an exact checkpoint there: the tree node ending at the anchor
gets a copy of the state, and a later prompt that shares the prefix up to the anchor matches it
(the mamba match validator stops at the deepest node holding a state, on any position).

The planner is the one seam into the scheduler: ``PrefillAdder`` asks :meth:`AnchorPlanner.cut`
how long the next chunk of a request may be. Cuts are spaced by the distance to the prompt end:
an anchor is used only if it lies at least ``gap(s) = max(min_gap, (n - s) // SPACING_DIVISOR)``
tokens after the chunk start ``s`` (the previous cut or the restored prefix; ``n`` the prompt
length). So cuts are dense (every ``min_gap`` tokens) near the end of a prompt, where agent
harnesses edit (the trailing message, the last turn's thinking, the newest tool output), and
thin out geometrically deeper in: each cut shrinks the distance to the end by at least
``1 / SPACING_DIVISOR``, so a prompt of ``n`` new tokens costs at most about
``SPACING_DIVISOR * (ln(n / (SPACING_DIVISOR * min_gap)) + 1)`` extra forward passes (a
100K-token prompt with an anchor every 10 tokens: 55 passes at 4096-token chunks, against 25
without anchors and about 1,560 with uniform ``min_gap`` spacing; ``test_planner.py``). Every
anchor keeps a saved state fewer than ``gap`` tokens before it: a restore at distance ``d``
from the end of the prompt that saved it loses fewer than ``max(min_gap, d / (SPACING_DIVISOR - 1))``
tokens, a small share of the ``d`` tokens after the edit that must be prefilled anyway.
Anchors in the last ``TAIL_TOKENS`` tokens of a prompt are not cut: the prompt end is saved
anyway.

Decode: a model generates markers too (``</think>``, ``<tool_call>``), and a harness that
re-serializes the turn (tool-call arguments re-formatted, content after the reasoning replaced)
shares the prefix only up to such an anchor inside the generated text. No chunk can end there,
so :meth:`AnchorPlanner.decode_anchor` is asked after every decode step whether the tokens fed so
far end at an anchor; the cache then copies the request's live state into the tree
(``AnchorRadixCache.checkpoint_decode_anchors``). The end of a generation is always at distance
0 from the end, so the spacing there is ``min_gap``: an anchor is saved if it lies at least
``min_gap`` tokens after the request's last saved state (the prompt end or the previous decode
anchor), and every generated anchor keeps a saved state fewer than ``min_gap`` tokens before it,
the same bound as near the end of a prompt.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, List, Optional

import numpy as np

from sglang.srt.mem_cache.anchor_checkpoints.emit import EMIT_GRID, grid_position
from sglang.srt.mem_cache.anchor_checkpoints.markers import AnchorScanner

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req

logger = logging.getLogger(__name__)

TAIL_TOKENS = 8
SPACING_DIVISOR = 8


class AnchorPlanner:
    """Chooses anchor cuts per request and remembers them for the cache (see module doc)."""

    def __init__(
        self, scanner: AnchorScanner, min_gap: int, stats=None, *, emit: bool = False
    ) -> None:
        assert min_gap >= 1, min_gap
        self.scanner = scanner
        self.min_gap = min_gap
        self.stats = stats  # AnchorStats or None
        # emit: chunks end where upstream ends them; the states at the anchors are emitted
        # inside the pass instead (emit.py, emit_positions); cut: chunks end at anchors.
        self.emit = emit

    # ---- per-request anchor positions --------------------------------------------------

    def positions(self, req: Req, start: int) -> np.ndarray:
        """Anchor positions of the request's fill ids from ``start`` on, cached on the request:
        its fill ids only grow (output tokens of a retracted request), so a scan stays valid
        while their length does."""
        ids = req.full_untruncated_fill_ids
        cached = getattr(req, "_anchor_positions", None)
        if cached is not None and cached[0] == len(ids) and cached[1] <= start:
            return cached[2]
        pos = self.scanner.scan(ids, start)
        req._anchor_positions = (len(ids), start, pos)
        return pos

    def gap(self, total: int, start: int) -> int:
        """Least distance from a chunk start ``start`` to a cut, in a prompt of ``total``
        tokens (see the module doc)."""
        return max(self.min_gap, (total - start) // SPACING_DIVISOR)

    def next_cut(self, req: Req, prefix_len: int, extend_len: int) -> Optional[int]:
        """The first usable anchor in ``(prefix_len, prefix_len + extend_len)``, or None."""
        if extend_len <= self.min_gap or req.multimodal_inputs is not None:
            return None
        return self._next_anchor(req, prefix_len, prefix_len, prefix_len + extend_len)

    def _next_anchor(self, req: Req, scan_from: int, start: int, end: int) -> Optional[int]:
        """The first anchor at least ``gap`` after ``start`` and before ``end`` (and the last
        ``TAIL_TOKENS`` tokens), from the scan of the request's fill ids from ``scan_from``."""
        total = len(req.full_untruncated_fill_ids)
        limit = min(end, total - TAIL_TOKENS + 1)
        lo = start + self.gap(total, start)
        if lo >= limit:
            return None
        pos = self.positions(req, scan_from)
        i = int(np.searchsorted(pos, lo, side="left"))
        if i < len(pos) and pos[i] < limit:
            return int(pos[i])
        return None

    def emit_positions(self, req: Req, prefix_len: int, extend_len: int) -> List[int]:
        """Positions (ascending, absolute) whose recurrent state the pass over
        ``[prefix_len, prefix_len + extend_len)`` of ``req`` emits (emit mode): for every anchor
        the cut planner would end a chunk at (the same ``gap`` spacing, measured from the
        previous anchor), its kernel-chunk boundary (:func:`emit.grid_position`); and, when the
        pass reaches the end of the fill ids, the last boundary before it, so a resent identical
        prompt reuses all but fewer than 64 of its tokens. Each is marked (:meth:`mark`) when it
        is an anchor's. None for requests with images or passes of at most 64 tokens."""
        if extend_len <= EMIT_GRID or req.multimodal_inputs is not None:
            return []
        end = prefix_len + extend_len
        out: List[int] = []
        s = prefix_len
        while (a := self._next_anchor(req, prefix_len, s, end)) is not None:
            e = grid_position(prefix_len, a, self.min_gap)
            if e is not None and (not out or e > out[-1]):
                out.append(e)
                self.mark(req, e)
            s = a
        if end == len(req.full_untruncated_fill_ids):
            last = prefix_len + (end - 1 - prefix_len) // EMIT_GRID * EMIT_GRID
            if last > prefix_len and (not out or last > out[-1]):
                out.append(last)
        return out

    # ---- the scheduler seam ------------------------------------------------------------

    def admit(self, req: Req, prefix_len: int, extend_len: int, *, may_cut: bool = True) -> int:
        """Length of the first chunk of ``req``, being admitted with ``prefix_len`` tokens
        matched: ``extend_len``, or shorter so that it ends at an anchor (only if ``may_cut``:
        the scheduler tracks one chunked request at a time)."""
        self._on_admission(req, prefix_len)
        return self.cut(req, prefix_len, extend_len) if may_cut else extend_len

    def cut(self, req: Req, prefix_len: int, extend_len: int) -> int:
        """Length of the next chunk of ``req``: ``extend_len``, or shorter so that it ends at an
        anchor (never shorter in emit mode)."""
        if self.emit:
            return extend_len
        at = self.next_cut(req, prefix_len, extend_len)
        if at is None:
            return extend_len
        self.mark(req, at)
        return at - prefix_len

    def decode_anchor(self, req: Req, fed: int) -> bool:
        """Whether the state of a decoding request after its first ``fed`` tokens is to be saved:
        ``fed`` is an anchor of ``origin_input_ids + output_ids`` (the newest output token, not
        yet fed, is read: a before-anchor is at its start) and lies at least ``min_gap`` tokens
        after the request's last saved state (``req.kv.cache_protected_len``).

        ``fed`` must equal ``len(origin_input_ids) + len(output_ids) - 1`` (a decode step's result
        was just appended); otherwise False. A marker of several tokens whose before-anchor is
        ``fed`` is found only when its last token is the newest one: earlier, its text is
        incomplete, and later, the state has moved on (single-token markers are always found).
        Cost: O(1) unless the boundary's tokens hold a marker's first or last byte; then one
        scan of ``scanner.lookback`` tokens.
        """
        if fed - req.kv.cache_protected_len < self.min_gap:
            return False
        out, prompt = req.output_ids, req.origin_input_ids
        if not out or fed != len(prompt) + len(out) - 1:
            return False
        prev = out[-2] if len(out) >= 2 else prompt[-1]
        if not self.scanner.may_anchor_between(prev, out[-1]):
            return False
        lo = max(0, fed - self.scanner.lookback)
        n_in = len(prompt)
        window = list(out[lo - n_in :]) if lo >= n_in else list(prompt[lo:]) + list(out)
        # scan() reads tokens up to ``end``: end one past ``fed`` to read the newest token.
        found = self.scanner.scan(window, fed - lo, fed - lo + 1)
        return bool(len(found)) and int(found[0]) == fed - lo

    def mark(self, req: Req, at: int) -> None:
        """Record that the state of ``req`` at ``at`` is saved for an anchor (see :meth:`is_cut`)."""
        cuts = getattr(req, "_anchor_cuts", None)
        if cuts is None:
            cuts = req._anchor_cuts = set()
        cuts.add(at)

    def is_cut(self, req: Req, up_to: int) -> bool:
        """Whether a chunk of ``req`` was ended at ``up_to`` for an anchor, or its decode state at
        ``up_to`` is being saved for one."""
        cuts = getattr(req, "_anchor_cuts", None)
        return cuts is not None and up_to in cuts

    def _on_admission(self, req: Req, prefix_len: int) -> None:
        # Admission may be retried (no memory, a changed match): the latest attempt's figures
        # wait on the request until its prefill runs (AnchorRadixCache.checkpoint counts them).
        if self.stats is not None:
            req._anchor_admission = self.stats.on_admission(req, prefix_len)


def anchor_planner_of(tree_cache, *, dllm_config, rem_chunk_tokens) -> Optional[AnchorPlanner]:
    """The planner a ``PrefillAdder`` consults (patch 0041), or None when it may not cut chunks.

    None when anchors are off for this cache (it is no ``AnchorRadixCache``), for a diffusion LM
    (``dllm_config`` set: its blocks fix the chunking) and with chunked prefill off
    (``rem_chunk_tokens`` None). The adder fixes both at construction, so asking once there
    covers its admissions and its continuing chunk alike.

    Args:
        tree_cache: the adder's tree cache.
        dllm_config: the adder's ``dllm_config``.
        rem_chunk_tokens: the adder's chunk budget (None: chunked prefill off).
    """
    if dllm_config is not None or rem_chunk_tokens is None:
        return None
    return getattr(tree_cache, "anchor_planner", None)
