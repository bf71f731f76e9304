"""The CPU executor's calls over bank sets, in one place for every expert format.

``torch.ops.sgl_kernel.moe_experts_cpu`` (and ``_submit``, ``CpuBranchPlan``) take, per bank
set (the slots, the host pool, a resident layer), the ``w13`` and ``w2`` weight banks; a
block-FP8 format adds its ``w13_scale`` / ``w2_scale`` banks (upstream ``Fp8MoEMethod``'s
``w13_weight_scale_inv`` [rows, ceil(2I/128), ceil(H/128)] and ``w2_weight_scale_inv``
[rows, ceil(H/128), ceil(I/128)], float32) as trailing scale lists; ModelOpt NVFP4
(``ModelOptNvFp4FusedMoEMethod``: uint8 codes, ``w*_weight_scale`` float8_e4m3fn per 16) adds
its global scales ``w13_scale_2`` [rows, 2] / ``w2_scale_2`` [rows] float32 as well; MXFP4
(``Mxfp4MoEMethod``: uint8 codes, ``w*_weight_scale`` uint8 e8m0 per 32) only the two scale
banks. The format
follows from the banks a set holds (``formats.py`` has their table). Experts with biases
(gpt-oss) hold ``w13_bias`` [rows, 2I] (gate then up, de-interleaved like ``w13``) and
``w2_bias`` [rows, H] banks, float32 or bf16, passed as ``w13_bias`` / ``w2_bias``; the gated
activation (``silu``, gpt-oss's ``swiglu_oai``, DeepSeek-V4's ``swiglu_limit``) is a property of
the layer, not of a bank, and is passed by the caller. Callers pass bank sets;
this module builds the argument lists, so the cache's CPU path, its CUDA branch, the bandwidth
probe and the resident layer call the executor the same way.
"""

from __future__ import annotations

from typing import Dict, Mapping, Optional, Sequence, Union

import torch

BankSet = Mapping[str, torch.Tensor]


BIAS_BANKS = ("w13_bias", "w2_bias")


def executor_kwargs(
    bank_sets: Sequence[BankSet],
    activation: Union[str, int] = "silu",
    alpha: Optional[float] = None,
    limit: Optional[float] = None,
) -> Dict[str, object]:
    """The executor's weight arguments for ``bank_sets``: ``w13``, ``w2`` (one bank per set)
    and, when the sets hold scale banks, ``format`` (the executor's code of ``fp8``, or of
    ``nvfp4`` when they hold global scales too) with ``w13_scale`` / ``w2_scale`` (and
    ``w13_scale_2`` / ``w2_scale_2``), or of ``mxfp4`` when the scales are uint8 (e8m0,
    ``Mxfp4MoEMethod``); ``w13_bias`` / ``w2_bias`` when the sets hold bias banks
    (``w13_bias`` [rows, 2I], ``w2_bias`` [rows, H], float32 or bf16); ``activation``,
    ``alpha``, ``limit`` when the activation is not the default SiLU
    (``sgl_kernel_fork.cpu_executor.activation_args`` gives their meaning and defaults).

    Raises:
        ValueError: some sets hold a bias bank that others lack (every set of one layer must
            have the same banks); an activation the executor does not compute, or parameters
            it does not take.
    """
    kw: Dict[str, object] = {n: [b[n] for b in bank_sets] for n in ("w13", "w2")}
    for name in BIAS_BANKS:
        have = [name in b for b in bank_sets]
        if any(have) and not all(have):
            raise ValueError(
                f"bank sets disagree on {name}: sets {[i for i, h in enumerate(have) if not h]} lack "
                f"it; every bank set of a layer (slots, host pool) must hold the layer's bias banks"
            )
        if bank_sets and all(have):
            kw[name] = [b[name] for b in bank_sets]
    if activation != "silu" or alpha is not None or limit is not None:
        from sgl_kernel_fork.cpu_executor import activation_args

        kw["activation"], kw["alpha"], kw["limit"] = activation_args(activation, alpha, limit)
    if "w13_scale" in bank_sets[0]:
        from sgl_kernel_fork.cpu_executor import format_code

        scales = ("w13_scale", "w2_scale")
        if "w13_scale_2" in bank_sets[0]:
            scales += ("w13_scale_2", "w2_scale_2")
            name = "nvfp4"
        else:  # e8m0 scales are uint8 (MXFP4), block-FP8 scales float32
            name = "mxfp4" if bank_sets[0]["w13_scale"].dtype == torch.uint8 else "fp8"
        kw["format"] = format_code(name)
        kw.update({n: [b[n] for b in bank_sets] for n in scales})
    return kw


def run_experts_cpu(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: Sequence[torch.Tensor],
    bank_sets: Sequence[BankSet],
    out: torch.Tensor,
    activation: Union[str, int] = "silu",
    alpha: Optional[float] = None,
    limit: Optional[float] = None,
) -> None:
    """``out = sum_k weights[t, k] * expert(x[t])`` with expert ``ids[s][t, k]`` of bank set
    ``s`` (-1: not in that set), one ``moe_experts_cpu`` call.

    Args:
        x: [T, H] bf16; weights: [T, K] float32; ids: per bank set [T, K] int32.
        bank_sets: objects indexable by bank name (``ExpertBanks``, dicts of a layer's tensors),
            with bias banks for experts that have biases.
        out: [T, H] float32, written.
        activation, alpha, limit: the layer's gated activation (:func:`executor_kwargs`).

    Raises:
        ValueError: as :func:`executor_kwargs`.
    """
    torch.ops.sgl_kernel.moe_experts_cpu(
        x,
        weights,
        list(ids),
        out=out,
        accumulate=False,
        **executor_kwargs(bank_sets, activation, alpha, limit),
    )


def submit_experts_cpu(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: Sequence[torch.Tensor],
    bank_sets: Sequence[BankSet],
    out: torch.Tensor,
    activation: Union[str, int] = "silu",
    alpha: Optional[float] = None,
    limit: Optional[float] = None,
) -> int:
    """:func:`run_experts_cpu` handed to the executor's workers; returns the handle for
    ``moe_experts_cpu_wait``."""
    return torch.ops.sgl_kernel.moe_experts_cpu_submit(
        x,
        weights,
        list(ids),
        out=out,
        accumulate=False,
        **executor_kwargs(bank_sets, activation, alpha, limit),
    )
