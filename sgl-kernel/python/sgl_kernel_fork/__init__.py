"""``sgl_kernel_fork``: this fork's operators, registered in the ``torch.ops.sgl_kernel`` namespace.

Two kinds of operators, one package:

* the CPU operators upstream sglang calls on a CPU-only machine. The registry's sgl-kernel
  wheels are CUDA-only, and upstream sglang's CPU path imports ops that only a source build of
  upstream sgl-kernel provides; these are written from scratch for this fork. On a CPU-only
  machine the install also provides the alias package ``sgl_kernel`` (``sgl-kernel/alias``),
  the name upstream imports;
* the fork's own operators (the expert-slot cache and the CPU executor), which our
  modules import as ``sgl_kernel_fork`` on every machine. On a CUDA machine upstream's
  ``sglang-kernel`` wheel owns the ``sgl_kernel`` import name and its ops; this package is
  installed beside it without the alias, and its registrations are ``TORCH_LIBRARY_FRAGMENT``s
  of op names upstream does not use, so both load into one process.

Contents:

* ``torch.ops.sgl_kernel.*`` (registered by the C++ extension ``sgl_kernel_fork._C``
  on import): ``fused_gdn_gating_cpu``, ``chunk_gated_delta_rule_cpu``,
  ``fused_sigmoid_gating_delta_rule_update_cpu``, ``causal_conv1d_fwd_cpu``,
  ``causal_conv1d_update_cpu``, ``fused_rmsnorm_gated_cpu``,
  ``fused_sigmoid_mul_cpu``, ``assign_req_to_token_pool_cpu``,
  ``copy_all_layer_kv_cache_cpu``, ``murmur_hash32_cpu``, ``extend_attention_cpu``
  (torch_native extend attention), plus ``cpu_isa`` / ``set_cpu_isa``. Each is documented
  in :mod:`sgl_kernel_fork.ops`.
* ``torch.ops.sgl_kernel.expert_cache_control`` / ``expert_bank_copy`` (CPU here,
  CUDA in ``sgl_kernel_fork._C_cuda``): the expert slot cache, documented in
  ``sglang/srt/layers/moe/expert_cache/control.py``.
* top-level Python functions ``assign_req_to_token_pool_cpu`` and
  ``copy_all_layer_kv_cache_cpu`` (memory management);
* :mod:`sgl_kernel_fork.mamba`: ``causal_conv1d_fn_cpu``,
  ``causal_conv1d_update_cpu``, ``chunk_gated_delta_rule_cpu``;
* :mod:`sgl_kernel_fork.cpu_executor`: the CPU executor
  (``moe_experts_cpu``, ``moe_experts_cpu_submit`` / ``moe_experts_cpu_wait``,
  ``expert_pool_set_threads``, ``expert_pool_info``,
  ``expert_pool_read_bandwidth``; ops of the same names in
  ``torch.ops.sgl_kernel``);
* speculative-decoding names upstream imports at module import time; they
  raise a RuntimeError when called (see :mod:`sgl_kernel_fork.speculative`).

The SIMD kernels are built for scalar, AVX2 and AVX-512 (plus AVX512_BF16 for
the CPU executor) and picked at run time (``cpu_isa()``;
``SGLANG_CPU_KERNEL_ISA=avx2`` etc. caps the choice).
"""

import importlib.util

import torch  # noqa: F401  (libtorch must be loaded before the extension)

from . import _C  # noqa: F401  (registers torch.ops.sgl_kernel.*)

if importlib.util.find_spec(__name__ + "._C_cuda") is not None:  # CUDA build only
    from . import _C_cuda  # noqa: F401

from . import cpu_executor, mamba, ops, speculative  # noqa: E402
from .ops import (  # noqa: E402
    assign_req_to_token_pool_cpu,
    copy_all_layer_kv_cache_cpu,
    cpu_isa,
    extend_attention,
    extend_attention_supported,
    set_cpu_isa,
)
from .speculative import (  # noqa: E402
    assign_draft_cache_locs_contiguous_cpu,
    assign_extend_cache_locs_cpu,
    build_draft_decode_metadata_cpu,
    build_tree_kernel_efficient_cpu,
    fill_accept_out_cache_loc_cpu,
    fill_bonus_tokens_cpu,
    rotate_input_ids_cpu,
    verify_tree_greedy_cpu,
)

__version__ = "0.1.0"

__all__ = [
    "assign_req_to_token_pool_cpu",
    "copy_all_layer_kv_cache_cpu",
    "cpu_isa",
    "extend_attention",
    "extend_attention_supported",
    "set_cpu_isa",
    "cpu_executor",
    "mamba",
    "ops",
    "speculative",
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "build_draft_decode_metadata_cpu",
    "build_tree_kernel_efficient_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "rotate_input_ids_cpu",
    "verify_tree_greedy_cpu",
]
