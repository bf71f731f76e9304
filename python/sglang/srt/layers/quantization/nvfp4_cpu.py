"""ModelOpt NVFP4 checkpoints on the CPU (patch ``0009-modelopt-nvfp4-cpu``).

Upstream 0.5.23 runs NVFP4 only on CUDA: ``ModelOptFp4LinearMethod`` needs SM100+ (or Marlin)
and ``ModelOptNvFp4FusedMoEMethod`` refuses any platform but Blackwell or Marlin; both kernels
quantize the activations to FP4 too (W4A4, with ``input_scale``). On the CPU:

* **dense linears** (attention q/k/v/o, dense and shared-expert MLPs) are dequantized to the
  model dtype once at load (:func:`dequantize_linear`) and run as upstream's
  ``UnquantizedLinearMethod``, as ``fp8_cpu.py`` does for block FP8: they are a small part of a
  MoE model's bytes. Logged once.
* **routed experts** stay NVFP4 in RAM (uint8 codes, e4m3 ``weight_scale`` per 16,
  ``weight_scale_2``) exactly as loaded; the CPU executor (``layers/moe/cpu_executor.py``)
  runs them with in-kernel dequantization.

Both are weight-only: activations stay bf16 and ``input_scale`` is loaded but not used (a GPU's
W4A4 kernels round activations to FP4 as well, so outputs differ from those by that rounding).

Dequantization: ``w[n, k] = e2m1[n, k] * fp8(weight_scale[n, k // 16]) * weight_scale_2[shard
of n]`` in float32, rounded once to the model dtype. Each fused shard (q/k/v, gate/up) keeps its
own ``weight_scale_2`` (upstream's CUDA path takes their max, which ModelOpt makes equal).

Unloaded scales are caught: :func:`prepare_linear` fills ``weight_scale`` and ``weight_scale_2``
with NaN (no real scale is NaN) and makes their loaders name the tensor on a shape mismatch.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

GROUP = 16
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # codes 0-7; code 8 + c is -value

_logged = False
_logged_fp8 = False
_logged_kv = False


def _name(layer: torch.nn.Module) -> str:
    return getattr(layer, "prefix", "") or "an NVFP4 linear layer"


def set_loader(param: torch.nn.Parameter, loader) -> None:
    """Replace a parameter's weight loader (``BasevLLMParameter`` keeps it in
    ``_weight_loader`` behind a read-only property)."""
    if isinstance(getattr(type(param), "weight_loader", None), property):
        param._weight_loader = loader
    else:
        param.weight_loader = loader


def prepare_linear(layer: torch.nn.Module) -> None:
    """After ``ModelOptFp4LinearMethod.create_weights`` on the CPU: ``weight_scale`` [N, K/16]
    float8_e4m3fn and ``weight_scale_2`` [shards] float32 start as NaN, and their loaders
    raise ``ValueError`` naming ``{prefix}.weight_scale`` (or ``_2``) and the shard when a
    checkpoint tensor does not fit (upstream asserts on the shapes alone)."""
    name = _name(layer)
    for attr in ("weight_scale", "weight_scale_2"):
        p = getattr(layer, attr)
        p.data.fill_(float("nan"))
        loader = p.weight_loader

        def load(param, loaded_weight, *args, _loader=loader, _attr=attr, **kwargs):
            try:
                return _loader(param, loaded_weight, *args, **kwargs)
            except (AssertionError, RuntimeError, ValueError) as e:
                shard = f" (shard {args[0]})" if args else ""
                raise ValueError(
                    f"{name}.{_attr}{shard}: the checkpoint's tensor of shape "
                    f"{tuple(loaded_weight.shape)} does not fit this NVFP4 layer ({e})"
                ) from e

        set_loader(p, load)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> float32 [..., K] (element 2j from the low nibble, sign in bit 3)."""
    mags = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32)
    lut = torch.cat([mags, -mags])
    codes = torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2).long()
    return lut[codes]


def _as_unquantized(layer: torch.nn.Module, weight: torch.Tensor, scales) -> None:
    """Make a dequantized linear run as an unquantized one: ``weight`` (the model dtype,
    [N, K]) becomes its parameter, the ``scales`` attributes go, and the layer's method
    becomes upstream's ``UnquantizedLinearMethod``."""
    from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod

    layer.weight = torch.nn.Parameter(weight.contiguous(), requires_grad=False)
    for attr in scales:
        if hasattr(layer, attr):
            delattr(layer, attr)
    layer.quant_method = UnquantizedLinearMethod()


def dequantize_linear(layer: torch.nn.Module) -> None:
    """Replace an NVFP4 linear's weight by its dequantization to the model dtype and make the
    layer run as an unquantized linear (``layer.quant_method`` becomes
    ``UnquantizedLinearMethod``).

    Args:
        layer: a ``LinearBase`` after loading: ``weight`` [N, K/2] uint8, ``weight_scale``
            [N, K/16] float8_e4m3fn, ``weight_scale_2`` [len(logical_widths)] float32 (one per
            fused shard), ``logical_widths`` the shards' rows, ``params_dtype`` the model dtype;
            ``prefix`` (patch 0009) its name in the checkpoint.

    Raises:
        ValueError: ``weight_scale`` of another shape, or scales the checkpoint never wrote
            (NaN, :func:`prepare_linear`); names the tensor.
    """
    global _logged

    name = _name(layer)
    w, s, s2 = layer.weight.data, layer.weight_scale.data, layer.weight_scale_2.data
    n, k = w.shape[0], w.shape[1] * 2
    if tuple(s.shape) != (n, k // GROUP):
        raise ValueError(
            f"{name}.weight_scale: shape {tuple(s.shape)}, but weight {tuple(w.shape)} "
            f"(packed e2m1) needs {(n, k // GROUP)}"
        )
    widths = list(getattr(layer, "logical_widths", [n]))
    rows = torch.nonzero(torch.isnan(s.float()).any(dim=1)).flatten().tolist()
    if rows:
        ends = torch.tensor(widths).cumsum(0).tolist()
        shards = sorted({next(i for i, e in enumerate(ends) if r < e) for r in rows})
        raise ValueError(
            f"{name}.weight_scale was not in the checkpoint for shard(s) {shards} of {widths} "
            f"rows (weight rows {rows[:4]}... have no scale): every NVFP4 weight needs its "
            "weight_scale"
        )
    if s2.numel() != len(widths) or torch.isnan(s2).any():
        raise ValueError(
            f"{name}.weight_scale_2 was not in the checkpoint for every shard (got "
            f"{s2.tolist()} for shards of {widths} rows): every NVFP4 weight needs its "
            "weight_scale_2"
        )
    row_global = torch.repeat_interleave(s2.float().flatten(), torch.tensor(widths))
    scale = s.float() * row_global[:, None]  # fp32(fp8 * global), as the CPU executor
    dtype = getattr(layer, "params_dtype", torch.bfloat16)
    deq = unpack_e2m1(w) * scale.repeat_interleave(GROUP, dim=1)
    _as_unquantized(layer, deq.to(dtype), ("weight_scale", "weight_scale_2", "input_scale"))
    if not _logged:
        _logged = True
        logger.info(
            "NVFP4 on the CPU: dense NVFP4 linears are dequantized to %s at load (routed "
            "experts stay NVFP4 for the CPU executor; activations stay %s, input_scale unused)",
            dtype,
            dtype,
        )


def prepare_moe(layer: torch.nn.Module) -> None:
    """After ``ModelOptNvFp4FusedMoEMethod.create_weights`` on the CPU without the expert cache:
    the per-expert scales (``w13_weight_scale`` / ``w2_weight_scale`` float8_e4m3fn,
    ``w13_weight_scale_2`` [E, 2] / ``w2_weight_scale_2`` [E] float32) start as NaN, and every
    per-expert tensor's loader checks the checkpoint tensor's shape first, naming it
    (``expert_cache.loading.checked_loader``; :func:`~sglang.srt.layers.moe.cpu_executor.
    check_nvfp4_layer` then names the scales never loaded)."""
    from sglang.srt.layers.moe.expert_cache.formats import NVFP4
    from sglang.srt.layers.moe.expert_cache.loading import checked_loader

    h, i = layer.w2_weight.shape[1], layer.w13_weight.shape[1] // 2
    for spec in NVFP4.banks(h, i):
        p = getattr(layer, spec.layer_param)
        if "_scale" in spec.name:
            p.data.fill_(float("nan"))
        set_loader(p, checked_loader(p.weight_loader, spec, layer.layer_id, NVFP4.label))


def dequantize_fp8_linear(layer: torch.nn.Module) -> None:
    """Replace a ModelOpt per-tensor FP8 linear's weight (``ModelOptFp8LinearMethod``: the FP8
    attention and gated-DeltaNet projections of nvidia/Qwen3.6-35B-A3B-NVFP4's
    ``MIXED_PRECISION`` checkpoint) by its dequantization to the model dtype and make the layer
    run as an unquantized linear (patch 0081; upstream requantizes it for an FP8 GEMM the CPU
    does not have).

    Args:
        layer: a ``LinearBase`` after loading: ``weight`` [N, K] float8_e4m3fn,
            ``weight_scale`` [len(logical_widths)] float32 (one per fused shard; upstream fills
            it with float32's min until loaded), ``logical_widths`` the shards' rows,
            ``orig_dtype`` the model dtype; ``prefix`` (patch 0009) its checkpoint name. The
            weight is ``fp8 * weight_scale`` per shard (ModelOpt's per-tensor FP8).

    Raises:
        ValueError: a shard whose ``weight_scale`` the checkpoint never wrote; names the
            tensor.
    """
    global _logged_fp8

    name = getattr(layer, "prefix", "") or "an FP8 linear layer"
    w, s = layer.weight.data, layer.weight_scale.data.float().flatten()
    widths = list(getattr(layer, "logical_widths", [w.shape[0]]))
    missing = [i for i, v in enumerate(s.tolist()) if v == torch.finfo(torch.float32).min]
    if s.numel() != len(widths) or missing:
        raise ValueError(
            f"{name}.weight_scale was not in the checkpoint for shard(s) {missing} of "
            f"{widths} rows: every FP8 weight needs its weight_scale"
        )
    row_scale = torch.repeat_interleave(s, torch.tensor(widths))
    dtype = getattr(layer, "orig_dtype", torch.bfloat16)
    deq = w.float() * row_scale[:, None]
    _as_unquantized(layer, deq.to(dtype), ("weight_scale", "input_scale"))
    if not _logged_fp8:
        _logged_fp8 = True
        logger.info(
            "ModelOpt FP8 on the CPU: per-tensor FP8 linears are dequantized to %s at load "
            "(activations stay %s, input_scale unused)",
            dtype,
            dtype,
        )


def cpu_keeps_checkpoint_kv_in_model_dtype(model_dtype: torch.dtype) -> bool:
    """Whether a checkpoint's FP8 KV-cache declaration (ModelOpt ``kv_cache_quant_algo: FP8``,
    e.g. nvidia/Qwen3.6-35B-A3B-NVFP4's ``hf_quant_config.json``) is not followed here, the KV
    cache staying in ``model_dtype`` (patch 0082): on a CPU without AMX, where upstream's CPU
    FP8 KV cache ("requires Intel AMX support" and the ``intel_amx`` backend) cannot run. Only
    the checkpoint's default (``--kv-cache-dtype auto``) is overridden; logged once.

    Returns:
        True on a CPU without AMX, else False (upstream's resolution applies).
    """
    global _logged_kv
    from sglang.srt.platforms import current_platform
    from sglang.srt.utils import cpu_has_amx_support

    if not current_platform.is_cpu() or cpu_has_amx_support():
        return False
    if not _logged_kv:
        _logged_kv = True
        logger.info(
            "The checkpoint declares an FP8 KV cache; this CPU has no AMX (upstream's CPU FP8 "
            "KV cache needs it): the KV cache stays %s",
            model_dtype,
        )
    return True
