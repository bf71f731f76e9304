"""MXFP4 experts (gpt-oss) on a CPU without AMX or triton_kernels (patch ``0011-gpt-oss-cpu``).

Upstream 0.5.23's ``Mxfp4MoEMethod.process_weights_after_loading`` keeps the MXFP4 bytes only
for kernels this CPU lacks (AMX's ``fused_experts_cpu``, triton_kernels' swizzled matmul); its
fallback dequantizes with ``triton_kernels.numerics_details.mxfp.upcast_from_mxfp``, which is
not installed on a CPU. :func:`dequantize_moe_weights` does that fallback's job in torch: the
experts become dense tensors of the model dtype once at load, and ``Mxfp4MoEMethod.apply`` runs
them through upstream's ``moe_forward_native`` on the CPU (per-expert ``F.linear``, the w13 /
w2 biases in float32, gpt-oss's clamped SwiGLU ``swiglu_gpt_oss_sigmoid_alpha`` with the
interleaved gate/up rows). Memory: 16x the MXFP4 bytes in bf16 (2x more in float32), which is
fine for small models and the reason this is not the path for gpt-oss-120b.

Format (OCP Microscaling v1.0; the gpt-oss release's ``*_blocks`` / ``*_scales``): ``w13_weight``
uint8 ``[E, N, K / 2]``, two e2m1 codes per byte, element ``2j`` of a row in the low nibble and
``2j + 1`` in the high one (bit 3 the sign, magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6); scales uint8
``[E, N, K / 32]``, e8m0 ``2 ** (s - 127)`` per 32 consecutive elements of a row. The
dequantized weight ``[E, N, K]`` is ``e2m1 * 2 ** (s - 127)``, exact in float32 and rounded once
to the model dtype.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

GROUP = 32
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # codes 0-7; code 8 + c is -value

_logged = False


def dequantize_mxfp4(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Dequantize MXFP4 weights.

    Args:
        codes: uint8 ``[..., N, K / 2]`` packed e2m1 codes (low nibble first).
        scales: uint8 ``[..., N, K / 32]`` e8m0 scales.
        dtype: output dtype.

    Returns:
        ``[..., N, K]`` of ``dtype`` (computed in float32, rounded once).

    Raises:
        ValueError: the tensors are not uint8, or their shapes do not describe the same rows
            with 32 elements per scale.
    """
    if codes.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(
            f"MXFP4 codes and scales must be uint8, got {codes.dtype} and {scales.dtype}: "
            "were the experts already dequantized or repacked by another path?"
        )
    k = codes.shape[-1] * 2
    if codes.shape[:-1] != scales.shape[:-1] or scales.shape[-1] * GROUP != k:
        raise ValueError(
            f"MXFP4 codes {tuple(codes.shape)} and scales {tuple(scales.shape)} do not match: "
            f"expected scales [..., N, K / {GROUP}] for codes [..., N, K / 2]"
        )
    lut = torch.tensor(E2M1_MAGNITUDES + tuple(-v for v in E2M1_MAGNITUDES), device=codes.device)
    out = torch.empty((*codes.shape[:-1], k), dtype=dtype, device=codes.device)
    # one expert at a time keeps the float32 temporary to one expert's size
    flat_codes = codes.reshape(-1, *codes.shape[-2:])
    flat_scales = scales.reshape(-1, *scales.shape[-2:])
    flat_out = out.view(-1, *out.shape[-2:])
    for e in range(flat_codes.shape[0]):
        c = flat_codes[e]
        vals = torch.stack([lut[(c & 0x0F).long()], lut[(c >> 4).long()]], -1).flatten(-2)
        s = torch.exp2(flat_scales[e].float() - 127.0)
        w = vals.view(*vals.shape[:-1], -1, GROUP) * s.unsqueeze(-1)
        flat_out[e] = w.flatten(-2).to(dtype)
    return out


def dequantize_moe_weights(layer: torch.nn.Module, dtype: torch.dtype) -> None:
    """Replace ``layer``'s MXFP4 expert tensors by dense ones of ``dtype``.

    ``layer.w13_weight`` / ``w2_weight`` (uint8 ``[E, N, K / 2]``) and their ``*_weight_scale``
    (uint8 ``[E, N, K / 32]``) become ``w13_weight`` ``[E, 2 * I, H]`` and ``w2_weight``
    ``[E, H, I]`` of ``dtype`` (the layout ``moe_forward_native`` reads); the scales are
    deleted; the biases are kept in float32 (``moe_forward_native`` adds them in float32).
    Logs once per process.

    Raises:
        ValueError: from :func:`dequantize_mxfp4` on mismatched tensors.
    """
    global _logged
    if not _logged:
        logger.info(
            "dequantizing MXFP4 experts to %s at load: no AMX / triton_kernels on this CPU "
            "(upstream's torch MoE path runs them)",
            str(dtype).removeprefix("torch."),
        )
        _logged = True
    for name in ("w13", "w2"):
        w = dequantize_mxfp4(
            getattr(layer, f"{name}_weight").data,
            getattr(layer, f"{name}_weight_scale").data,
            dtype,
        )
        delattr(layer, f"{name}_weight")
        delattr(layer, f"{name}_weight_scale")
        layer.register_parameter(f"{name}_weight", torch.nn.Parameter(w, requires_grad=False))
        bias = getattr(layer, f"{name}_weight_bias", None)
        if bias is not None:
            setattr(
                layer,
                f"{name}_weight_bias",
                torch.nn.Parameter(bias.data.float(), requires_grad=False),
            )
