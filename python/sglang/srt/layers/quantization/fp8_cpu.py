"""Block-FP8 checkpoints on a CPU without AMX (patch ``0003-fp8-cpu-without-amx``).

Upstream 0.5.23 runs FP8 on the CPU only through its AMX kernels (``fp8_scaled_mm_cpu``,
``fused_experts_cpu`` with ``CPUQuantMethod.FP8_W8A16``) and asserts AMX in
``Fp8LinearMethod`` / ``Fp8MoEMethod.process_weights_after_loading`` otherwise. Here:

* **dense linears** (attention projections, dense and shared-expert MLPs) are dequantized to
  the model dtype once at load (:func:`dequantize_linear`) and then run as upstream's
  ``UnquantizedLinearMethod``: they are a small part of a MoE model's bytes (Qwen3-30B-A3B:
  ~1.4 of 30.5 B parameters), so keeping them FP8 would save little RAM and need a second
  kernel. Logged once.
* **routed experts** stay FP8 in RAM, with their ``weight_scale_inv``, exactly as loaded; the
  CPU executor (``layers/moe/cpu_executor.py``) runs them with in-kernel dequantization.

Dequantization: ``w[n, k] = fp8[n, k] * weight_scale_inv[n // bn, k // bk]`` in float32, rounded
once to the model dtype (upstream's ``fp8_utils.block_quant_dequant``).
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

_logged = False
_logged_kv_b = False


def dequantize_linear(layer: torch.nn.Module, weight_block_size) -> None:
    """Replace a block-FP8 linear's weight by its bf16 dequantization and make the layer run as
    an unquantized linear (``layer.quant_method`` becomes ``UnquantizedLinearMethod``).

    Args:
        layer: a ``LinearBase`` after loading: ``weight`` [N, K] float8_e4m3fn,
            ``weight_scale_inv`` [ceil(N / bn), ceil(K / bk)] float32, ``orig_dtype`` the model
            dtype; ``prefix`` (set by patch 0003) its name in the checkpoint.
        weight_block_size: [bn, bk] from ``quantization_config``.

    Raises:
        ValueError: ``weight_scale_inv`` of another shape, or with rows the checkpoint never
            wrote (upstream initializes them to float32 min); names the tensor.
    """
    global _logged
    from sglang.srt.layers.quantization.fp8_utils import block_quant_dequant
    from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod

    name = getattr(layer, "prefix", "") or "an FP8 linear layer"
    w, s = layer.weight.data, layer.weight_scale_inv.data
    bn, bk = weight_block_size
    want = (-(-w.shape[0] // bn), -(-w.shape[1] // bk))
    if tuple(s.shape) != want:
        raise ValueError(
            f"{name}.weight_scale_inv: shape {tuple(s.shape)}, but weight {tuple(w.shape)} "
            f"with weight_block_size {[bn, bk]} needs {want}"
        )
    unset = s == torch.finfo(torch.float32).min
    if unset.any():
        rows = sorted({int(r) * bn for r in torch.nonzero(unset)[:, 0].tolist()})
        raise ValueError(
            f"{name}.weight_scale_inv was not in the checkpoint (weight rows {rows[:8]} have "
            "no scale): every FP8 weight needs its weight_scale_inv"
        )
    dtype = getattr(layer, "orig_dtype", torch.bfloat16)
    layer.weight = torch.nn.Parameter(
        block_quant_dequant(w, s, [bn, bk], dtype).contiguous(), requires_grad=False
    )
    del layer.weight_scale_inv
    layer.input_scale = None
    layer.quant_method = UnquantizedLinearMethod()
    if not _logged:
        _logged = True
        logger.info(
            "FP8 on a CPU without AMX: dense FP8 linears are dequantized to %s at load "
            "(routed experts stay FP8 for the CPU executor)",
            dtype,
        )


def name_scale_errors(layer: torch.nn.Module) -> None:
    """Make a block-FP8 linear's ``weight_scale_inv`` loader name the tensor when the
    checkpoint's scale does not fit (upstream's loader asserts on the shapes alone).

    Args:
        layer: a ``LinearBase`` after ``Fp8LinearMethod.create_weights``; ``prefix`` (patch
            0003) its name in the checkpoint.

    Raises (from the loader):
        ValueError: the scale's shape does not fit the shard it is loaded into; names
            ``{prefix}.weight_scale_inv`` and the shard, with upstream's message.
    """
    scale = getattr(layer, "weight_scale_inv", None)
    loader = getattr(scale, "_weight_loader", None)
    if loader is None:
        return
    name = getattr(layer, "prefix", "") or "an FP8 linear layer"

    def load(param, loaded_weight, *args, **kwargs):
        try:
            return loader(param, loaded_weight, *args, **kwargs)
        except (AssertionError, RuntimeError, ValueError) as e:
            shard = f" (shard {args[0]})" if args else ""
            raise ValueError(
                f"{name}.weight_scale_inv{shard}: the checkpoint's scale of shape "
                f"{tuple(loaded_weight.shape)} does not fit this FP8 layer ({e})"
            ) from e

    scale._weight_loader = load


def dequantize_mla_kv_b() -> bool:
    """Whether DeepSeek's ``post_load_weights`` should dequantize a block-FP8 ``kv_b_proj``
    to bf16 before splitting it into MLA's absorbed ``w_kc`` / ``w_vc`` (patch
    ``0017-deepseek-mla-fp8-cpu``): True on a CPU without AMX.

    There upstream took its generic branch, ``block_quant_to_tensor_quant``: the block-FP8
    weight requantized to FP8 with one scale per tensor (a second rounding, up to e4m3's
    relative step on every block whose scale is not the largest), then ``w_kc.to(bf16) *
    w_scale`` at every attention call. Dequantized once (``fp8_utils.block_quant_dequant``,
    as upstream's CUDA branch does for 128 x 128 blocks), the weights are the checkpoint's and
    the absorbed matmuls are plain bf16 ``torch.bmm``.
    """
    global _logged_kv_b
    from sglang.srt.utils import cpu_has_amx_support, is_cpu

    wanted = is_cpu() and not cpu_has_amx_support()
    if wanted and not _logged_kv_b:
        _logged_kv_b = True
        logger.info("MLA kv_b_proj: block FP8 dequantized to bf16 at load (CPU without AMX)")
    return wanted
