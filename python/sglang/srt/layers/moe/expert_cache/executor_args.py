"""The CPU executor's calls over bank sets, in one place for every expert format.

``torch.ops.sgl_kernel.moe_experts_cpu`` (and ``_submit``, ``CpuBranchPlan``) take, per bank
set (the slots, the host pool, a resident layer), the ``w13`` and ``w2`` weight banks; a
block-FP8 format adds its ``w13_scale`` / ``w2_scale`` banks (upstream ``Fp8MoEMethod``'s
``w13_weight_scale_inv`` [rows, ceil(2I/128), ceil(H/128)] and ``w2_weight_scale_inv``
[rows, ceil(H/128), ceil(I/128)], float32) as trailing scale lists; ModelOpt NVFP4
(``ModelOptNvFp4FusedMoEMethod``: uint8 codes, ``w*_weight_scale`` float8_e4m3fn per 16) adds
its global scales ``w13_scale_2`` [rows, 2] / ``w2_scale_2`` [rows] float32 as well. The format
follows from the banks a set holds (``formats.py`` has their table). Callers pass bank sets;
this module builds the argument lists, so the cache's CPU path, its CUDA branch, the bandwidth
probe and the resident layer call the executor the same way.
"""

from __future__ import annotations

from typing import Dict, Mapping, Sequence

import torch

BankSet = Mapping[str, torch.Tensor]


def executor_kwargs(bank_sets: Sequence[BankSet]) -> Dict[str, object]:
    """The executor's weight arguments for ``bank_sets``: ``w13``, ``w2`` (one bank per set)
    and, when the sets hold scale banks, ``format`` (the executor's code of ``fp8``, or of
    ``nvfp4`` when they hold global scales too) with ``w13_scale`` / ``w2_scale`` (and
    ``w13_scale_2`` / ``w2_scale_2``)."""
    kw: Dict[str, object] = {n: [b[n] for b in bank_sets] for n in ("w13", "w2")}
    if "w13_scale" in bank_sets[0]:
        from sgl_kernel_fork.cpu_executor import format_code

        scales = ("w13_scale", "w2_scale")
        if "w13_scale_2" in bank_sets[0]:
            scales += ("w13_scale_2", "w2_scale_2")
        kw["format"] = format_code("nvfp4" if len(scales) == 4 else "fp8")
        kw.update({n: [b[n] for b in bank_sets] for n in scales})
    return kw


def run_experts_cpu(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: Sequence[torch.Tensor],
    bank_sets: Sequence[BankSet],
    out: torch.Tensor,
) -> None:
    """``out = sum_k weights[t, k] * expert(x[t])`` with expert ``ids[s][t, k]`` of bank set
    ``s`` (-1: not in that set), one ``moe_experts_cpu`` call.

    Args:
        x: [T, H] bf16; weights: [T, K] float32; ids: per bank set [T, K] int32.
        bank_sets: objects indexable by bank name (``ExpertBanks``, dicts of a layer's tensors).
        out: [T, H] float32, written.
    """
    torch.ops.sgl_kernel.moe_experts_cpu(
        x, weights, list(ids), out=out, accumulate=False, **executor_kwargs(bank_sets)
    )


def submit_experts_cpu(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: Sequence[torch.Tensor],
    bank_sets: Sequence[BankSet],
    out: torch.Tensor,
) -> int:
    """:func:`run_experts_cpu` handed to the executor's workers; returns the handle for
    ``moe_experts_cpu_wait``."""
    return torch.ops.sgl_kernel.moe_experts_cpu_submit(
        x, weights, list(ids), out=out, accumulate=False, **executor_kwargs(bank_sets)
    )
