"""Anchor checkpoints emitted inside the ordinary prefill pass (``--anchor-checkpoint-mode emit``).

In this mode prefill chunks end where upstream ends them; the recurrent state at the positions
the planner wants is written by the gated-DeltaNet layers during the pass, into free slots of
upstream's mamba state pool, and the radix cache then owns each slot as the state of the tree
node ending there (:meth:`AnchorRadixCache.insert_emitted_states`).

Positions. The chunked kernel holds the exact state only between its 64-token chunks, counted
from the pass start of each sequence (``EMIT_GRID``), so a wanted position ``a`` becomes
``e = s + 64 * floor((a - s) / 64)`` (``s`` the request's first token of this pass), emitted when
``s < e`` and ``a - e <= min_gap``. The state there equals the final state of a pass that ends at
``e`` bit for bit (``test/sgl_kernel/test_gdn_emit.py``):

* SSM state: the chunk kernel stores the state at the start of chunk ``(e - s) / 64`` into the
  slot, rounded once from fp32 to the pool dtype: ``chunk_gated_delta_rule_cpu(state_emit_indices=
  ...)`` on the CPU, upstream's Triton ``chunk_gated_delta_rule`` on CUDA (patch 0048,
  ``test/sgl_kernel/test_gdn_emit_triton.py``);
* conv state: the last ``W - 1`` conv inputs before ``e``, ``mixed_qkv[e - W + 1 : e]`` of the
  pass (``W`` the conv width; ``e - s >= 64 > W - 1``, so all of them lie in this pass), copied
  before the conv runs, as upstream's extra-buffer tracking does (``gdn_backend.forward_extend``,
  ``track_conv_indices``).

Transport. The scheduler builds a :class:`StateEmission` for a prefill batch after
``prepare_for_extend`` (patch 0046) and publishes it here; the GDN backend of the same process
(the scheduler runs its model worker in-process, one per TP rank; the no-buffer strategy runs
without the overlap scheduler) takes it for the forward pass whose requests and extend lengths
it was made for (patch 0045) and marks it written. A plan that no pass took is never inserted:
its slots go back to the pool.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import torch

logger = logging.getLogger(__name__)

EMIT_GRID = 64  # the chunk of chunk_gated_delta_rule (FLA CHUNK_SIZE, gdn.cpp kChunk)

__all__ = ["EMIT_GRID", "RowEmission", "StateEmission", "grid_position", "publish", "take"]


def grid_position(start: int, anchor: int, min_gap: int) -> Optional[int]:
    """The emitted position for an anchor ``anchor`` of a request whose pass starts at ``start``:
    the last kernel-chunk boundary ``start + 64 j`` at or before it, or None when that is the
    pass start itself or lies more than ``min_gap`` tokens before the anchor."""
    e = start + (anchor - start) // EMIT_GRID * EMIT_GRID
    if e <= start or anchor - e > min_gap:
        return None
    return e


@dataclass
class RowEmission:
    """States one request of a batch emits: absolute positions (token counts, ascending) and the
    physical state-pool slot each is written into."""

    row: int
    start: int  # the request's first token in this pass (its prefix length)
    positions: List[int]
    slots: List[int]


@dataclass
class StateEmission:
    """The states one prefill pass emits (see the module doc).

    Attributes:
        req_pool_indices: the batch's request-pool rows, in batch order (what the pass must run).
        extend_lens: tokens of each of those requests in this pass.
        rows: one :class:`RowEmission` per request that emits anything.
        written: set by the backend once the pass has written the states.
    """

    req_pool_indices: Tuple[int, ...]
    extend_lens: Tuple[int, ...]
    rows: List[RowEmission]
    written: bool = False
    _tables: Optional[tuple] = field(default=None, repr=False)
    _taken_by: object = field(default=None, repr=False)

    def matches(self, req_pool_indices: Sequence[int], extend_lens: Sequence[int]) -> bool:
        """Whether a forward pass over these rows is the one this plan was made for (a mixed
        batch may append decode rows after the plan's)."""
        n = len(self.req_pool_indices)
        return (
            tuple(int(x) for x in req_pool_indices[:n]) == self.req_pool_indices
            and tuple(int(x) for x in extend_lens[:n]) == self.extend_lens
        )

    def tables(self, extend_lens: Sequence[int], conv_width: int, device) -> tuple:
        """``(chunk_slots, conv_rows, conv_slots)`` for the pass over ``extend_lens`` (all rows of
        the forward batch): ``chunk_slots`` ``[sum ceil(len / 64)]`` int64, the slot of each
        chunk-start state to emit (-1 none), the ``state_emit_indices`` of the kernel;
        ``conv_rows`` ``[M, conv_width - 1]`` int64 token rows of the pass whose conv inputs are
        each emitted conv state; ``conv_slots`` ``[M]`` int64. Built once, shared by the layers."""
        if self._tables is None:
            chunk_off, tok_off = [0], [0]
            for n in extend_lens:
                chunk_off.append(chunk_off[-1] + (int(n) + EMIT_GRID - 1) // EMIT_GRID)
                tok_off.append(tok_off[-1] + int(n))
            chunk_slots = torch.full((chunk_off[-1],), -1, dtype=torch.int64)
            conv_rows, conv_slots = [], []
            w = conv_width - 1
            for r in self.rows:
                for pos, slot in zip(r.positions, r.slots):
                    rel = pos - r.start
                    assert 0 < rel < int(extend_lens[r.row]) and rel % EMIT_GRID == 0, (pos, r)
                    chunk_slots[chunk_off[r.row] + rel // EMIT_GRID] = slot
                    end = tok_off[r.row] + rel
                    conv_rows.append(list(range(end - w, end)))
                    conv_slots.append(slot)
            self._tables = (
                chunk_slots.to(device),
                torch.tensor(conv_rows, dtype=torch.int64).view(-1, w).to(device),
                torch.tensor(conv_slots, dtype=torch.int64).to(device),
            )
        return self._tables

    def write_conv_states(
        self, conv_states: torch.Tensor, mixed_qkv: torch.Tensor, extend_lens: Sequence[int]
    ) -> None:
        """Copy each emitted position's conv state into its slot (plain torch indexing on the
        pool's device: the CPU, or CUDA before upstream's Triton conv;
        ``test_gdn_emit_triton.py`` checks it against that conv's state after a pass ending
        there).

        Args:
            conv_states: the layer's conv-state pool ``[num_slots, dim, W - 1]``.
            mixed_qkv: the pass's conv inputs ``[tokens, dim]`` (before the conv).
            extend_lens: tokens per row of the pass.
        """
        w = conv_states.shape[-1] + 1
        _, rows, slots = self.tables(extend_lens, w, mixed_qkv.device)
        if slots.numel():
            conv_states[slots] = mixed_qkv[rows].transpose(1, 2).to(conv_states.dtype)

    def chunk_slots(self, extend_lens: Sequence[int], conv_width: int, device) -> torch.Tensor:
        return self.tables(extend_lens, conv_width, device)[0]


_pending: Optional[StateEmission] = None


def publish(plan: Optional[StateEmission]) -> None:
    """Hand the next prefill pass its emission plan (None: nothing to emit). A plan no pass took
    stays unwritten; its owner frees its slots."""
    global _pending
    _pending = plan


def take(forward_batch) -> Optional[StateEmission]:
    """The plan for this forward pass, if it was made for it (patch 0045: the GDN backend calls
    this once per linear layer; every layer gets the same plan), else None."""
    plan = _pending
    if plan is None or not forward_batch.forward_mode.is_extend():
        return None
    if plan._taken_by is forward_batch:
        return plan
    lens = forward_batch.extend_seq_lens_cpu
    if lens is None or not plan.matches(forward_batch.req_pool_indices.tolist(), lens):
        if not plan.written:
            logger.warning("Anchor state emission: the pass does not match its plan; skipped.")
        publish(None)
        return None
    plan.written = True
    plan._taken_by = forward_batch
    return plan
