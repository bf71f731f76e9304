"""Expert-slot cache: serve an MoE model whose routed experts do not fit in device memory.

One LRU pool of complete-expert slots shared by all MoE layers, keyed by (layer, expert);
per layer a device-side control step splits the misses between cache fills and CPU
execution from the host pool (FreeToken §3.2, §4). Enabled with ``--enable-expert-cache``.

Modules, by job (see README.md beside them):

* ``config``: the flags, the cache size spec and the slot count;
* ``control`` / ``reference``: typed wrappers of the control op and the bank copy, and the
  op's executable specification (steps 1-9);
* ``banks``: the bank layout, the host pool and the slots;
* ``bandwidth`` / ``bandwidth_probe``: the B_P / B_H profile and its startup measurement;
* ``cache``: the shared cache and one layer call; ``cuda_branch``: that call on CUDA, with its
  CPU branch on a side stream; ``metrics``: the Prometheus export;
* ``routing_trace``: the routing recorder; ``method``: the ``FusedMoE`` wiring and its
  compatibility guard.
"""

__all__ = [
    "ExpertCacheMoEMethod",
    "get_expert_slot_cache",
    "make_for_layer",
    "reset_expert_slot_cache",
]


def __getattr__(name: str):
    # Lazy: ``method`` imports upstream's MoE layers, while ``control`` and ``reference`` need
    # only torch and sgl_kernel_fork (the GPU checks run them without upstream installed).
    if name in __all__:
        from sglang.srt.layers.moe.expert_cache import method

        return getattr(method, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
