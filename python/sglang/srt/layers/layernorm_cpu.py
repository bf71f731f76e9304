"""RMSNorm on the CPU as one op per call, without AMX (patch ``0006-cpu-rmsnorm-without-amx``).

Upstream dispatches a ``BaseFusedOp`` to ``forward_cpu`` only on a CPU with AMX (where
``RMSNorm.forward_cpu`` calls ``torch.ops.sgl_kernel.rmsnorm_cpu`` / ``fused_add_rmsnorm_cpu``);
every other CPU ran ``RMSNorm.forward_native``: ~10 torch ops per norm (``to`` / ``add`` / ``pow`` / ``mean`` / ``rsqrt`` / ``mul`` / ``to``) and the
Python between them, twice per decoder layer plus the final norm (issue 18's CPU decode profile).
The fork's ``sgl-kernel/csrc/cpu/norm_rope.cpp`` provides the two ops (and upstream's
``fused_qk_norm_cpu`` / ``fused_qk_norm_rope_cpu``, which upstream's ``apply_qk_norm`` and
Qwen3-MoE's ``apply_qk_norm_rope`` already take whenever the op exists) with
``forward_native``'s formula and roundings. The patch's ``RMSNorm._resolve_forward_method``
hands upstream's choice to :func:`resolve_forward`, which replaces ``forward_native`` on the CPU
by :func:`forward` on them, ``forward_native`` still running every call :func:`forward`
declines.

Where it applies: the norm has none of ``forward_native``'s options the ops do not implement
(``variance_size_override``, ``override_orig_dtype``, ``fp32_residual``,
``cast_x_before_out_mul``, a ``post_residual_addition``), x (and the residual) are float32 /
bfloat16 / float16 CPU tensors with dense rows, the residual of x's shape and dtype. Otherwise
(None) upstream's ``forward_native`` runs as before.

Off switch: ``SGLANG_CPU_FUSED_NORM=0`` in the server's environment; ``sgl_kernel_fork`` then
does not register the four ops at all (read when its library loads), so this module and
upstream's ``hasattr`` checks all take upstream's torch paths. What is used is logged once.

Numerics: identical to ``forward_native`` except the order of the fp32 sum of squares (a
sequential sum against torch's vectorised ``mean``), which can move an output by one unit in
its last place (bf16 greedy tokens identical: test/e2e/test_cpu_fused_norm.py; float32
transformers parity: test/e2e/test_parity.py).
"""

from __future__ import annotations

import logging
import os
from typing import Callable, Optional, Tuple, Union

import torch

logger = logging.getLogger(__name__)

OFF_ENV = "SGLANG_CPU_FUSED_NORM"
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_ops: Optional[tuple] = None  # (rmsnorm_cpu, fused_add_rmsnorm_cpu) or () when unavailable


def _resolve() -> tuple:
    global _ops
    if os.environ.get(OFF_ENV) == "0":  # sgl_kernel_fork did not register the ops either
        _ops = ()
        logger.info("CPU fused norms: upstream's torch ops (%s=0)", OFF_ENV)
        return _ops
    try:
        import sgl_kernel_fork  # noqa: F401  (registers torch.ops.sgl_kernel.*_cpu)

        ns = torch.ops.sgl_kernel
        _ops = (ns.rmsnorm_cpu, ns.fused_add_rmsnorm_cpu)
        logger.info(
            "CPU fused norms: rmsnorm_cpu / fused_add_rmsnorm_cpu / fused_qk_norm_rope_cpu "
            "(sgl_kernel_fork; %s=0 for upstream's torch ops)",
            OFF_ENV,
        )
    except (ImportError, AttributeError, RuntimeError) as e:
        _ops = ()
        logger.info("CPU fused norms: upstream's torch ops (%s)", e)
    return _ops


def resolve_forward(norm: torch.nn.Module, method: Callable) -> Callable:
    """The forward ``norm`` (an upstream ``RMSNorm``) runs: ``method``, upstream's dispatch
    choice, unless it is ``norm.forward_native`` for a CPU weight while the fork's ops are
    registered; then a function trying :func:`forward` first and ``forward_native`` after."""
    if method != norm.forward_native or norm.weight.device.type != "cpu":
        return method
    ops = _ops if _ops is not None else _resolve()
    if not ops:
        return method
    native = norm.forward_native

    def forward_cpu_ops(x, residual=None, post_residual_addition=None, quant_linear=None):
        out = forward(norm, x, residual, post_residual_addition)
        if out is None:
            return native(x, residual, post_residual_addition)
        return out

    return forward_cpu_ops


def _dense_rows(t: torch.Tensor) -> bool:
    return t.dim() >= 1 and t.stride(-1) == 1 and t.is_contiguous()


def forward(
    norm: torch.nn.Module,
    x: torch.Tensor,
    residual: Optional[torch.Tensor] = None,
    post_residual_addition: Optional[torch.Tensor] = None,
) -> Optional[Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]]:
    """Upstream ``RMSNorm`` (``srt/layers/layernorm.py``) on the fork's CPU ops, or None.

    Args:
        norm: the ``RMSNorm`` module (``weight`` [hidden], ``variance_epsilon``).
        x: [..., hidden] float32 / bfloat16 / float16, CPU.
        residual: x's shape and dtype, or None.
        post_residual_addition: must be None for the ops (else None is returned).

    Returns:
        Without a residual: a new tensor of x's shape and dtype, ``x * rsqrt(mean(x^2) + eps) *
        weight`` in fp32 rounded once. With one: ``(x, residual)``, both written in place:
        residual <- x + residual (rounded to the dtype), x <- the norm of the fp32 sum.
        None when the ops are absent or the call is one they do not cover (see the module).
    """
    ops = _ops if _ops is not None else _resolve()
    if (
        not ops
        or post_residual_addition is not None
        or norm.variance_size_override is not None
        or norm.override_orig_dtype is not None
        or norm.fp32_residual
        or norm.cast_x_before_out_mul
        or x.dtype not in _DTYPES
        or x.device.type != "cpu"
        or x.shape[-1] != norm.hidden_size
    ):
        return None
    if residual is None:
        return ops[0](x, norm.weight.data, norm.variance_epsilon)
    if (
        residual.shape != x.shape
        or residual.dtype != x.dtype
        or not _dense_rows(x)
        or not _dense_rows(residual)
    ):
        return None
    ops[1](x, residual, norm.weight.data, norm.variance_epsilon)
    return x, residual
