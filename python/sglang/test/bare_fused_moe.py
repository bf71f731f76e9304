"""Upstream's Triton fused MoE outside a server, on a GPU machine without upstream's CUDA kernels.

The expert cache's device side (``expert_cache.cuda_branch.slot_experts``) is upstream's
``fused_experts``: two Triton GEMMs and a Triton sum, plus glue ops that on CUDA come from
upstream's ``sglang-kernel`` wheel (``import sgl_kernel``) or from kernels JIT-compiled through
tvm-ffi at first use. The lent GPU machine (``scripts/gpu_checks.sh``) has torch, Triton and
nvcc but no package registry, and that wheel (~1.5 GB) cannot travel there.
:func:`install_cuda_standins` replaces exactly the glue ops our path reaches, each by an
equivalent, and says which it replaced:

* ``sgl_kernel.moe_align_block_size`` (slot tables of at most 63 slots, or more than 64 routed
  entries): up to :data:`ALIGN_MAX_ENTRIES` routed entries upstream's own Triton single-launch
  align, ``sglang.kernels.ops.moe.moe_align_small_numel``, which CUDA itself runs for decode
  batches on larger tables (its pairwise tensors grow as ``numel ** 2``); above that, prefill
  chunks, :func:`align_by_sort` (a stable sort by bucket, in torch ops that need no host sync).
  Both keep the "+1 offset" contract: a -1 entry lands in a block of expert -1, which the GEMMs
  skip;
* ``sgl_kernel.moe_sum_reduce`` (the top-k sum of batches above 32 tokens): the sum over k in
  float32, times the scaling factor, rounded once to the output dtype;
* ``fused_moe.silu_and_mul`` (a tvm-ffi JIT kernel): ``silu(gate) * up`` in float32, rounded
  once to the output dtype;
* any other name of ``sgl_kernel`` or of a submodule (upstream imports many at module import
  that this path never calls): a function that raises ``RuntimeError`` naming itself when
  called, so nothing is silently computed by a stub.

The GEMMs, the top-k sum of decode batches and the kernel configuration are upstream's,
unchanged. :func:`server_state` sets the little server state ``fused_experts`` reads.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.util
import sys
import types
from typing import Iterator, List

import torch

# Routed entries (tokens x top-k) above which the align stand-in refuses: its [NP, NP] pairwise
# tensors (NP = the next power of two) spill past 64 and would not fit one block far above this.
ALIGN_MAX_ENTRIES = 256

_INSTALLED: List[str] = []


def moe_align_block_size(
    topk_ids: torch.Tensor,
    num_experts: int,
    block_size: int,
    sorted_token_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_tokens_post_pad: torch.Tensor,
    cumsum_buffer: torch.Tensor,
    pad_sorted_token_ids: bool = False,
    ignore_invalid_expert: bool = False,
) -> None:
    """``sgl_kernel.moe_align_block_size``: upstream's Triton single-launch align up to
    :data:`ALIGN_MAX_ENTRIES` routed entries, :func:`align_by_sort` above.

    Args:
        topk_ids: [T, K] routed ids in ``[-1, num_experts - 1)``.
        num_experts: the bucket count ``E + 1`` of the "+1 offset" convention.
        block_size: rows per GEMM block (``BLOCK_SIZE_M``).
        sorted_token_ids, expert_ids, num_tokens_post_pad: the outputs, written in place.
        cumsum_buffer: unused (neither path needs the CUDA kernel's scratch).
        pad_sorted_token_ids: fill all of ``sorted_token_ids`` with ``T * K`` first, as the
            CUDA kernel does.

    Raises:
        NotImplementedError: ``ignore_invalid_expert`` (another contract).
    """
    if ignore_invalid_expert:
        raise NotImplementedError(
            "the stand-in moe_align_block_size (sglang/test/bare_fused_moe.py) handles the "
            "+1-offset contract only; got ignore_invalid_expert=True. Install upstream's "
            "sglang-kernel for that contract"
        )
    if pad_sorted_token_ids:
        sorted_token_ids.fill_(topk_ids.numel())
    if topk_ids.numel() > ALIGN_MAX_ENTRIES:
        align_by_sort(
            topk_ids, num_experts, block_size, sorted_token_ids, expert_ids, num_tokens_post_pad
        )
        return
    from sglang.kernels.ops.moe.moe_align_small_numel import moe_align_small_numel

    moe_align_small_numel(
        topk_ids, num_experts, block_size, sorted_token_ids, expert_ids, num_tokens_post_pad
    )


def align_by_sort(
    topk_ids: torch.Tensor,
    num_experts: int,
    block_size: int,
    sorted_token_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_tokens_post_pad: torch.Tensor,
) -> None:
    """The align of any batch by a stable sort on the bucket (``id + 1``), with the output
    contract of upstream's ``moe_align_small_numel``: bucket b's entries, in entry order, from
    ``offset[b]`` (the padded sizes of the buckets before it), each bucket padded to a multiple
    of ``block_size`` with ``numel``; ``expert_ids[j]`` = the bucket of block j minus one, for the
    blocks below ``num_tokens_post_pad[0]`` (the total); the rest of the outputs untouched.

    Args:
        topk_ids: [T, K] int ids in ``[-1, num_experts - 1)``, on any device.
        num_experts: the bucket count ``E + 1``.
        block_size: rows per block.
        sorted_token_ids: int32 [>= total]; expert_ids: int32 [>= total / block_size];
        num_tokens_post_pad: int32 [>= 1]; all written in place.

    Torch ops only, none with a host sync (no ``.item()``, no ``bincount``), so it can be
    captured in a CUDA graph. Cost: a sort of the T * K entries. Upstream's LoRA path has the
    same idea (``kernels/ops/lora/moe/virtual_experts._align_block_size_torch``), but it
    allocates its outputs and files invalid ids in a last sentinel bucket, where this contract
    writes into the caller's buffers and files -1 in bucket 0 as expert -1.
    """
    dev = topk_ids.device
    bucket = topk_ids.reshape(-1).to(torch.int64) + 1
    numel = bucket.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, bucket, torch.ones_like(bucket))
    padded = (counts + block_size - 1) // block_size * block_size
    ends = torch.cumsum(padded, 0)  # padded bucket ends
    starts = ends - padded
    order = torch.sort(bucket, stable=True).indices  # entries grouped by bucket, stable
    first = torch.cumsum(counts, 0) - counts  # each bucket's first index in ``order``
    sb = bucket[order]
    pos = starts[sb] + torch.arange(numel, device=dev) - first[sb]
    total = ends[-1:]
    fill = torch.full((sorted_token_ids.numel(),), numel, dtype=torch.int64, device=dev)
    used = torch.arange(sorted_token_ids.numel(), device=dev) < total
    sorted_token_ids.copy_(torch.where(used, fill, sorted_token_ids.to(torch.int64)))
    sorted_token_ids.scatter_(0, pos, order.to(sorted_token_ids.dtype))
    block_start = torch.arange(expert_ids.numel(), device=dev) * block_size
    block_bucket = torch.searchsorted(ends, block_start, right=True).clamp_(max=num_experts - 1)
    expert_ids.copy_(torch.where(block_start < total, block_bucket - 1, expert_ids.to(torch.int64)))
    num_tokens_post_pad[:1].copy_(total)


def moe_sum_reduce(x: torch.Tensor, out: torch.Tensor, routed_scaling_factor: float) -> None:
    """``sgl_kernel.moe_sum_reduce``: ``out[t] = scale * sum_k x[t, k]`` (x [T, K, H], out [T, H]),
    summed in float32 and rounded once."""
    out.copy_(x.float().sum(dim=1).mul_(float(routed_scaling_factor)))


def silu_and_mul(x: torch.Tensor, out: torch.Tensor, **_row_filter) -> torch.Tensor:
    """Upstream's JIT ``silu_and_mul``: ``out = silu(x[:, :d]) * x[:, d:]`` (x [N, 2d],
    out [N, d]) in float32, rounded once. The row filter (rows upstream may skip because the
    down GEMM never reads them) is ignored: every row is computed."""
    d = x.shape[-1] // 2
    g = x[..., :d].float()
    out.copy_(torch.nn.functional.silu(g) * x[..., d:].float())
    return out


class _Missing:
    """A name of upstream's wheel that this machine lacks: attributes are further such names
    (module-level code such as ``scalar_types.uint4b8`` reads them), a call raises."""

    def __init__(self, qualname: str):
        self._qualname = qualname

    def __getattr__(self, name: str) -> "_Missing":
        if name.startswith("__"):
            raise AttributeError(name)
        return _Missing(f"{self._qualname}.{name}")

    def __call__(self, *_args, **_kwargs):
        raise RuntimeError(
            f"{self._qualname} is upstream's CUDA kernel (the sglang-kernel wheel), absent on "
            "this machine; sglang/test/bare_fused_moe.py stands in only for the ops the expert "
            "cache's slot path calls"
        )

    def __repr__(self) -> str:
        return f"<missing {self._qualname}>"


class _StandinModule(types.ModuleType):
    """``sgl_kernel`` or a submodule: real stand-ins where set, else raising functions."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        missing = _Missing(f"{self.__name__}.{name}")
        setattr(self, name, missing)
        return missing


class _StandinFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name == "sgl_kernel" or name.startswith("sgl_kernel."):
            return importlib.util.spec_from_loader(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StandinModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        if module.__name__ == "sgl_kernel":
            module.moe_align_block_size = moe_align_block_size
            module.moe_sum_reduce = moe_sum_reduce


def has_real_package(name: str) -> bool:
    """Whether ``import name`` finds a module with code, not only a namespace package: a folder
    of that name on ``sys.path`` without ``__init__.py``, such as this repository's
    ``test/sgl_kernel/`` once pytest has put ``test/`` on the path."""
    loaded = sys.modules.get(name)
    if loaded is not None:
        return getattr(loaded, "__file__", None) is not None
    spec = importlib.util.find_spec(name)
    return spec is not None and spec.origin not in (None, "namespace")


def install_cuda_standins() -> List[str]:
    """Make upstream's fused MoE importable and runnable on CUDA without ``sglang-kernel``.

    Does nothing (and returns ``[]``) without CUDA, or where ``sgl_kernel`` imports (upstream's
    wheel; on a CPU-only machine our alias). Otherwise registers the stand-in ``sgl_kernel``,
    imports ``fused_moe`` and replaces its ``silu_and_mul``. Call it before anything imports
    upstream's MoE layers; later calls return the same list.

    Returns:
        One line per replaced op, naming what replaces it (for the GPU checks' summary).
    """
    if _INSTALLED or not torch.cuda.is_available():
        return list(_INSTALLED)
    if has_real_package("sgl_kernel"):
        return []  # upstream's wheel (or our CPU alias) is there: nothing to stand in for
    for name in [m for m in sys.modules if m == "sgl_kernel" or m.startswith("sgl_kernel.")]:
        del sys.modules[name]  # a namespace package imported before (test/sgl_kernel/)
    sys.meta_path.insert(0, _StandinFinder())
    fused = importlib.import_module("sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe")
    fused.silu_and_mul = silu_and_mul
    _INSTALLED.extend(
        [
            "sgl_kernel.moe_align_block_size -> upstream's Triton moe_align_small_numel (at most "
            f"{ALIGN_MAX_ENTRIES} routed entries), a torch stable sort above",
            "sgl_kernel.moe_sum_reduce -> torch float32 sum over top-k",
            "fused_moe.silu_and_mul (tvm-ffi JIT) -> torch float32 silu(gate) * up",
            "other sgl_kernel names -> raise RuntimeError when called",
        ]
    )
    return list(_INSTALLED)


@contextlib.contextmanager
def server_state(device: str) -> Iterator[None]:
    """The server state ``fused_experts`` reads outside a server: default server arguments on
    ``device`` (``cuda`` or ``cpu``) and no tensor-parallel group (one device)."""
    from sglang.srt.runtime_context import get_parallel
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", device=device))
    with get_parallel().override(tp_group=None):
        yield
