"""Expert-slot cache: serve an MoE model whose routed experts do not fit in device memory.

One LRU pool of complete-expert slots shared by all MoE layers, keyed by (layer, expert);
per layer a device-side control step splits the misses between cache fills and CPU
execution from the host pool (FreeToken §3.2, §4). Enabled with ``--enable-expert-cache``.

Modules: ``config`` (flags, sizes), ``banks`` (bank layout, host pool and slots),
``control`` / ``reference`` (the control op and its Python model), ``bandwidth`` (B_P / B_H),
``cache`` (the shared cache and one layer call), ``method`` (the ``FusedMoE`` wiring).
"""

from sglang.srt.layers.moe.expert_cache.method import (
    ExpertCacheMoEMethod,
    get_expert_slot_cache,
    make_for_layer,
    reset_expert_slot_cache,
)

__all__ = [
    "ExpertCacheMoEMethod",
    "get_expert_slot_cache",
    "make_for_layer",
    "reset_expert_slot_cache",
]
