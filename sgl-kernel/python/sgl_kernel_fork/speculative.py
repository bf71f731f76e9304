"""Speculative-decoding names upstream sglang imports from ``sgl_kernel`` on CPU.

Upstream imports these at module import time when running on CPU
(``kernels/ops/speculative/cache_locs.py``, ``eagle.py``, ``spec_tree.py``,
``multi_layer_eagle.py``) or lazily (``srt/layers/attention/intel_amx_backend.py``),
so they must exist for ``import sglang...`` to succeed. Speculative decoding on
CPU is not supported by this fork: each function raises RuntimeError when called.
"""

_MSG = (
    "sgl_kernel.{name}: speculative decoding on CPU needs upstream's sgl-kernel "
    "CPU build, which this fork does not provide; run without --speculative-algorithm"
)


def _unsupported(name: str):
    def fn(*args, **kwargs):
        raise RuntimeError(_MSG.format(name=name))

    fn.__name__ = name
    fn.__qualname__ = name
    fn.__doc__ = f"Not provided by this fork (speculative decoding on CPU): raises RuntimeError.\n\n{_MSG.format(name=name)}"
    return fn


assign_draft_cache_locs_contiguous_cpu = _unsupported("assign_draft_cache_locs_contiguous_cpu")
assign_extend_cache_locs_cpu = _unsupported("assign_extend_cache_locs_cpu")
build_tree_kernel_efficient_cpu = _unsupported("build_tree_kernel_efficient_cpu")
fill_accept_out_cache_loc_cpu = _unsupported("fill_accept_out_cache_loc_cpu")
fill_bonus_tokens_cpu = _unsupported("fill_bonus_tokens_cpu")
verify_tree_greedy_cpu = _unsupported("verify_tree_greedy_cpu")
rotate_input_ids_cpu = _unsupported("rotate_input_ids_cpu")
build_draft_decode_metadata_cpu = _unsupported("build_draft_decode_metadata_cpu")

__all__ = [
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "build_tree_kernel_efficient_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "verify_tree_greedy_cpu",
    "rotate_input_ids_cpu",
    "build_draft_decode_metadata_cpu",
]
