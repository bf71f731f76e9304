"""Find and rewrite the KV indices the radix tree holds (elastic KV, issue 15).

The prefix cache a plain server runs is upstream's ``UnifiedRadixCache``; its tree core is the
Rust one by default (``rust_tree_core/``) or the Python one (``unified_cache/unified_tree_core``).
Both name nodes by integer ids that are never re-minted and read a node's FULL (KV) device
value by id (``get_component_device_value``); neither lets FULL be set (the Rust core panics
"auxiliary components only", the Python one asserts), since the tree's sizes and leaf sets
follow the values. A resize keeps every value's length, so it rewrites the values in place:
the Rust core hands out a tensor that shares storage with the node's value (checked by
:func:`nodes_holding` before anything changes: two reads give one data pointer), the Python
core's node holds the tensor itself. Only the Python core can list its nodes
(``_node_arena``); for the Rust core the live nodes are found by probing ids upwards from the
root's (an unknown id raises ``KeyError``) until the values found account for every tree index
that has to move (``all_values_flatten``): the cost is one binding call per id minted so far, a
known limit (a listing call in the Rust core would remove it).
"""

from __future__ import annotations

from typing import List, Tuple

import torch

# A run of unknown ids this long past the last live node ends the probe (it would only happen
# if the tree lost count of its own values: then the resize is refused, nothing changed).
MAX_ID_GAP = 1 << 20


def _full():
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

    return ComponentType.FULL


def tree_core_of(tree_cache):
    """The tree core of a ``UnifiedRadixCache`` (None for a cache without one: disabled or
    another prefix cache, which holds no KV indices this module can rewrite)."""
    return getattr(tree_cache, "tree_core", None) if tree_cache is not None else None


def nodes_holding(tree_cache, mask: torch.Tensor) -> List[Tuple[int, torch.Tensor]]:
    """The tree nodes whose KV value holds an index ``i`` with ``mask[i]``.

    Args:
        tree_cache: the scheduler's prefix cache (``UnifiedRadixCache``) or None.
        mask: bool, shape ``(pool rows,)``: the token indices asked about.

    Returns:
        ``[(node_id, value)]``: ``value`` is the node's own tensor (int64, shape ``(node key
        length,)``); writing into it rewrites the node (:func:`rewrite`).

    Raises:
        RuntimeError: the probe could not account for every masked index in the tree, or the
            tree core hands out copies (its values cannot be rewritten in place).
    """
    core = tree_core_of(tree_cache)
    if core is None:
        return []
    full = _full()
    every = core.all_values_flatten().to(torch.int64)
    want = int(mask[every].sum()) if every.numel() else 0
    if want == 0:
        return []
    found: List[Tuple[int, torch.Tensor]] = []
    got = 0
    arena = getattr(core, "_node_arena", None)
    if arena is not None:  # the Python core lists its nodes
        for node_id in list(arena):
            value = core.get_component_device_value(node_id, full)
            if isinstance(value, torch.Tensor) and value.numel():
                hit = int(mask[value.to(torch.int64)].sum())
                if hit:
                    found.append((node_id, value))
                    got += hit
    else:
        node_id, gap = int(core.root_node_handle()), 0
        batch: List[Tuple[int, torch.Tensor]] = []

        def flush() -> int:
            # one vectorized membership test per batch of nodes (a tensor op per node would
            # cost more than the binding call)
            if not batch:
                return 0
            lens = torch.tensor([v.numel() for _, v in batch])
            hits = mask[torch.cat([v for _, v in batch]).to(torch.int64)].to(torch.int64)
            ends = torch.cumsum(lens, 0)
            per_node = torch.cumsum(hits, 0)[ends - 1] - torch.cat(
                [torch.zeros(1, dtype=torch.int64), torch.cumsum(hits, 0)[ends[:-1] - 1]]
            )
            n = 0
            for (nid, value), h in zip(batch, per_node.tolist()):
                if h:
                    again = core.get_component_device_value(nid, full)
                    if again.data_ptr() != value.data_ptr() or value.dtype != torch.int64:
                        raise RuntimeError(
                            "the tree core hands out copies of its KV values: they cannot be "
                            "rewritten in place"
                        )
                    found.append((nid, value))
                    n += h
            batch.clear()
            return n

        while got < want and gap < MAX_ID_GAP:
            node_id += 1
            try:
                value = core.get_component_device_value(node_id, full)
            except KeyError:
                gap += 1
                if batch and gap >= 64:  # past the newest nodes, perhaps: count what we have
                    got += flush()
                continue
            gap = 0
            if isinstance(value, torch.Tensor) and value.numel():
                batch.append((node_id, value))
                if len(batch) >= 512:
                    got += flush()
        got += flush()
    if got != want:
        raise RuntimeError(
            f"the radix tree holds {want} indices to move but its nodes account for {got}"
        )
    return found


def rewrite(nodes: List[Tuple[int, torch.Tensor]], remap: torch.Tensor) -> None:
    """Point every node of ``nodes`` (from :func:`nodes_holding`) at ``remap[value]``, in place.

    Args:
        remap: int64, shape ``(pool rows,)``: the new index of every old index.
    """
    for _, value in nodes:
        value.copy_(remap[value.to(torch.int64)].to(value.dtype))
