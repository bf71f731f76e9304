"""The names and call conventions upstream sglang (0.5.23) relies on on CPU, through the
``sgl_kernel`` alias that a CPU-only install provides (with CUDA torch, ``sgl_kernel`` is
upstream's sglang-kernel and this module is skipped)."""

import importlib

import pytest
import torch

pytestmark = pytest.mark.skipif(
    torch.version.cuda is not None,
    reason="with CUDA torch sgl_kernel is upstream's sglang-kernel; the alias is CPU-only",
)
if torch.version.cuda is None:
    import sgl_kernel

SPEC_NAMES = [
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "build_tree_kernel_efficient_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "verify_tree_greedy_cpu",
    "rotate_input_ids_cpu",
    "build_draft_decode_metadata_cpu",
]

TORCH_OPS = [
    "fused_gdn_gating_cpu",
    "chunk_gated_delta_rule_cpu",
    "fused_sigmoid_gating_delta_rule_update_cpu",
    "causal_conv1d_fwd_cpu",
    "causal_conv1d_update_cpu",
    "fused_rmsnorm_gated_cpu",
    "fused_sigmoid_mul_cpu",
    "assign_req_to_token_pool_cpu",
    "copy_all_layer_kv_cache_cpu",
    "murmur_hash32_cpu",
]


def test_upstream_imports():
    from sgl_kernel import assign_req_to_token_pool_cpu, copy_all_layer_kv_cache_cpu  # noqa: F401
    from sgl_kernel.mamba import (  # noqa: F401
        causal_conv1d_fn_cpu,
        causal_conv1d_update_cpu,
        chunk_gated_delta_rule_cpu,
    )

    for name in TORCH_OPS:
        assert hasattr(torch.ops.sgl_kernel, name), name
    for name in SPEC_NAMES:
        assert callable(getattr(sgl_kernel, name)), name


def test_sgl_kernel_is_the_fork_alias_on_cpu():
    """On a CPU-only machine ``sgl_kernel`` is the alias of ``sgl_kernel_fork``: the same module
    objects, so upstream's ``from sgl_kernel.mamba import ...`` reaches our ops."""
    import sgl_kernel_fork

    for name in ("cpu_executor", "mamba", "ops", "speculative"):
        assert importlib.import_module(f"sgl_kernel.{name}") is getattr(sgl_kernel_fork, name)
    assert all(getattr(sgl_kernel, n) is getattr(sgl_kernel_fork, n) for n in sgl_kernel.__all__)


def test_fork_ops_are_library_fragments():
    """Every definition is a TORCH_LIBRARY_FRAGMENT, so another library in the same process
    (upstream's sglang-kernel on a CUDA machine) may even own the namespace with its own
    TORCH_LIBRARY: torch refuses a second owner, never a fragment."""
    lib = torch.library.Library("sgl_kernel", "DEF")  # raises if our ops took ownership
    lib.define("fork_fragment_probe(Tensor x) -> Tensor")
    assert hasattr(torch.ops.sgl_kernel, "fork_fragment_probe")
    assert hasattr(torch.ops.sgl_kernel, "expert_cache_control")


def test_no_amx_backend_marker():
    # upstream's _is_intel_amx_backend_available() keys on this op: it must stay absent
    assert not hasattr(torch.ops.sgl_kernel, "convert_weight_packed")


@pytest.mark.parametrize("name", SPEC_NAMES)
def test_speculative_stubs_raise(name):
    with pytest.raises(
        RuntimeError, match="speculative decoding on CPU needs upstream's sgl-kernel CPU build"
    ):
        getattr(sgl_kernel, name)(torch.zeros(1))


def test_documented():
    for mod in ("sgl_kernel", "sgl_kernel.ops", "sgl_kernel.mamba", "sgl_kernel.speculative"):
        assert importlib.import_module(mod).__doc__
    for fn in (
        sgl_kernel.mamba.causal_conv1d_fn_cpu,
        sgl_kernel.mamba.causal_conv1d_update_cpu,
        sgl_kernel.mamba.chunk_gated_delta_rule_cpu,
        sgl_kernel.assign_req_to_token_pool_cpu,
        sgl_kernel.copy_all_layer_kv_cache_cpu,
    ):
        assert "Source" in fn.__doc__ or "source" in fn.__doc__, fn


def test_chunk_options():
    """inplace_update=False leaves the pool alone; scale and the final state."""
    T, H, HV, K, V = 20, 1, 2, 16, 16
    q, k, v = torch.randn(1, T, H, K), torch.randn(1, T, H, K), torch.randn(1, T, HV, V)
    g, beta = -torch.rand(1, T, HV), torch.rand(1, T, HV)
    pool = torch.randn(2, HV, V, K)
    pool0 = pool.clone()
    idx = torch.tensor([1], dtype=torch.int32)
    cu = torch.tensor([0, T], dtype=torch.int32)
    o1, st1, h1 = sgl_kernel.mamba.chunk_gated_delta_rule_cpu(
        q,
        k,
        v,
        g,
        beta,
        initial_state=pool,
        cu_seqlens=cu,
        use_qk_l2norm_in_kernel=True,
        initial_state_indices=idx,
        inplace_update=False,
        output_final_state=True,
        output_chunk_states=False,
    )
    assert torch.equal(pool, pool0) and h1 is None and st1.shape == (1, HV, V, K)
    o2, _, _ = sgl_kernel.mamba.chunk_gated_delta_rule_cpu(
        q,
        k,
        v,
        g,
        beta,
        initial_state=pool,
        cu_seqlens=cu,
        use_qk_l2norm_in_kernel=True,
        initial_state_indices=idx,
        scale=2 * K**-0.5,
    )
    torch.testing.assert_close(pool[1], st1[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(o2, 2 * o1, atol=1e-5, rtol=1e-5)  # o is linear in the query scale
    with pytest.raises(RuntimeError, match="head_first"):
        sgl_kernel.mamba.chunk_gated_delta_rule_cpu(
            q, k, v, g, beta, cu_seqlens=cu, head_first=True
        )
    with pytest.raises(RuntimeError, match="out of range"):
        sgl_kernel.mamba.chunk_gated_delta_rule_cpu(
            q,
            k,
            v,
            g,
            beta,
            initial_state=pool,
            cu_seqlens=cu,
            initial_state_indices=torch.tensor([7]),
        )


def test_unsupported_dtype_is_rejected():
    x = torch.randn(4, 8, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="float32 and bfloat16"):
        torch.ops.sgl_kernel.fused_rmsnorm_gated_cpu(x, torch.ones(8), None, 1e-6)


def test_isa_selection():
    assert torch.ops.sgl_kernel.set_cpu_isa("scalar") == "scalar"
    assert sgl_kernel.cpu_isa() == "scalar"
    with pytest.raises(RuntimeError):
        torch.ops.sgl_kernel.set_cpu_isa("sse9")
    best = torch.ops.sgl_kernel.set_cpu_isa("auto")
    assert best in ("avx512bf16", "avx512", "avx2", "scalar")
