"""Decode linears on the CPU (patch ``0004-cpu-decode-linears``).

A decode step's dense linears (attention ``qkv_proj`` / ``o_proj``, the MoE router, shared
experts, the ``lm_head``) see one row per running request, so each reads its whole bf16 weight
once per step for 2 FLOPs per element: they are bound by memory bandwidth. Upstream's CPU path
(``F.linear`` / ``torch.matmul``: MKL's generic bf16 GEMV) reads them at 25-30 GB/s on a
machine whose cores stream 50-75 GB/s (issue 18's profile); :func:`decode_linear` runs them on
``dense_linear_cpu`` (``sgl-kernel/csrc/cpu/dense_linear.cpp``), the CPU executor's dot
kernels on its pinned pool, so dense and routed-expert work also share one set of threads.

Where it applies: ``UnquantizedLinearMethod.apply`` (after upstream's AMX branch, which keeps
its packed weights) and the logits processor's plain ``lm_head`` matmul, when ``x`` is a bf16
CPU tensor of at most ``SGLANG_CPU_DENSE_LINEAR_MAX_ROWS`` rows (default 4; 0 turns it off)
and the weight is bf16 ``[N, K]`` with unit stride along K. Prefill chunks (more rows) keep
upstream's GEMM, which reuses each weight tile over many rows. What is used is logged once.

Numerics: each output is one float32 dot of exact bf16 products (plus the bias in float32),
rounded once to bf16, as MKL's bf16 GEMM also does; only the summation order differs, so
outputs can differ from upstream's in the last bf16 bit (greedy tokens of the bf16 e2e check
stay identical: test/e2e/test_decode_linears.py).
"""

from __future__ import annotations

import logging
import os
from typing import Optional

import torch

logger = logging.getLogger(__name__)

MAX_ROWS_ENV = "SGLANG_CPU_DENSE_LINEAR_MAX_ROWS"
DEFAULT_MAX_ROWS = 4

_max_rows: Optional[int] = None  # resolved on the first call (see _resolve)
_op = None


def parse_max_rows(value: Optional[str], op_limit: int) -> int:
    """``SGLANG_CPU_DENSE_LINEAR_MAX_ROWS`` as a row count: unset or empty gives
    :data:`DEFAULT_MAX_ROWS`, ``0`` turns the op off.

    Raises:
        ValueError: not an integer, or outside ``[0, op_limit]`` (the op's own limit).
    """
    if value is None or value.strip() == "":
        return min(DEFAULT_MAX_ROWS, op_limit)
    try:
        n = int(value)
    except ValueError:
        raise ValueError(
            f"{MAX_ROWS_ENV}={value!r}: expected an integer row count in [0, {op_limit}] "
            f"(0 = upstream's linears)"
        ) from None
    if not 0 <= n <= op_limit:
        raise ValueError(
            f"{MAX_ROWS_ENV}={n}: must be in [0, {op_limit}] (0 = upstream's linears; "
            f"dense_linear_cpu takes at most {op_limit} rows)"
        )
    return n


def _resolve() -> int:
    global _max_rows, _op
    try:
        import sgl_kernel_fork  # noqa: F401  (registers torch.ops.sgl_kernel.dense_linear_cpu)

        op_limit = int(torch.ops.sgl_kernel.dense_linear_cpu_max_rows())
    except (ImportError, AttributeError, RuntimeError) as e:
        _max_rows = 0
        logger.info("CPU decode linears: upstream's F.linear (dense_linear_cpu unavailable: %s)", e)
        return 0
    n = parse_max_rows(os.environ.get(MAX_ROWS_ENV), op_limit)
    _op = torch.ops.sgl_kernel.dense_linear_cpu
    _max_rows = n
    if n == 0:
        logger.info("CPU decode linears: upstream's F.linear (%s=0)", MAX_ROWS_ENV)
    else:
        logger.info(
            "CPU decode linears: dense_linear_cpu for bf16 inputs of <= %d rows (%s), "
            "upstream's F.linear above; kernels %s",
            n,
            MAX_ROWS_ENV,
            torch.ops.sgl_kernel.cpu_isa(),
        )
    return n


def max_rows() -> int:
    """The row limit in effect (0: off); resolved and logged once per process."""
    return _resolve() if _max_rows is None else _max_rows


def decode_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None
) -> Optional[torch.Tensor]:
    """``x @ weight.T + bias`` on ``dense_linear_cpu`` when it applies, else None (the caller
    then runs upstream's path).

    Args:
        x: ``[..., K]``; taken when bf16 on the CPU with ``1 <= prod(x.shape[:-1]) <=``
            :func:`max_rows`.
        weight: ``[N, K]``; taken when bf16 with unit stride along K.
        bias: ``[N]`` bf16 / float32, or None.

    Returns:
        ``[..., N]`` bf16, or None when any condition above fails.
    """
    if x.device.type != "cpu":
        return None
    limit = _max_rows if _max_rows is not None else _resolve()
    if (
        limit == 0
        or x.dtype is not torch.bfloat16
        or weight.dtype is not torch.bfloat16
        or weight.dim() != 2
    ):
        return None
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if rows == 0 or rows > limit or weight.shape[1] != k or weight.stride(1) != 1:
        return None
    if bias is not None and bias.dtype not in (torch.bfloat16, torch.float32):
        return None
    x2 = x.reshape(rows, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    y = _op(x2, weight, bias)
    return y if x.dim() == 2 else y.view(*x.shape[:-1], weight.shape[0])
