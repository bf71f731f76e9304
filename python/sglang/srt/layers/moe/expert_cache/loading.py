"""Checks that a quantized checkpoint's expert tensors arrive whole and in shape, by name.

The host pool's rows are filled by upstream's ``FusedMoE.weight_loader`` (it copies a
checkpoint tensor into ``param.data[expert]``, narrowed to the gate / up half for ``w13``). A
mis-shaped tensor would fail there with a bare size mismatch, and a missing scale would leave
its rows as they were allocated, silently: :func:`checked_loader` names the checkpoint tensor
of a wrong shape before the copy, and :func:`missing_scales` finds the scale rows that no
tensor was written into (the scale banks start as NaN, which no real scale is).

Checkpoint names are the Hugging Face layout of the MoE models the cache serves
(``model.layers.{L}.mlp.experts.{e}.{gate,up,down}_proj.weight_scale_inv``, as in Qwen3-MoE,
DeepSeek-V3 and GLM-4.5 releases; ModelOpt NVFP4 releases: ``.weight_scale`` per 16 and the
per-tensor ``.weight_scale_2``, one per projection, loaded into column 0 (gate) / 1 (up) of
``w13_weight_scale_2``). gpt-oss (openai/gpt-oss-20b, MXFP4) ships each projection of a layer's
experts as one tensor (``model.layers.{L}.mlp.experts.gate_up_proj_blocks`` [E, 2I, H/32, 16],
``..._scales`` [E, 2I, H/32] e8m0, ``..._bias`` [E, 2I], and ``down_proj_*``), loaded with
``expert_id=None``, with the gate and up rows interleaved: :func:`deinterleaving_loader` checks
their shape and de-interleaves them into the pool's halves layout. Unloaded e8m0 scales read as
255 (e8m0's NaN encoding, which no real scale is).
"""

from __future__ import annotations

import functools
from typing import Callable, List

import torch

from sglang.srt.layers.moe.expert_cache.banks import BankSpec

# FusedMoE shard ids (make_expert_params_mapping) -> the checkpoint projection.
_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
# e8m0 (uint8) scale rows start as this: e8m0's NaN, never a checkpoint's scale.
E8M0_NAN = 255
# gpt-oss's fused expert tensors, by layer parameter (``_load_mxfp4_experts_weights``).
_FUSED = {
    "w13_weight": "gate_up_proj_blocks",
    "w13_weight_scale": "gate_up_proj_scales",
    "w13_weight_bias": "gate_up_proj_bias",
    "w2_weight": "down_proj_blocks",
    "w2_weight_scale": "down_proj_scales",
    "w2_weight_bias": "down_proj_bias",
}


def fill_unloaded(rows: torch.Tensor, spec: BankSpec) -> None:
    """Give one layer's host rows of a bank their value before loading: scale banks a value
    :func:`missing_scales` recognizes (NaN; :data:`E8M0_NAN` for uint8 e8m0 scales), bias
    banks 0 (what upstream's methods create them as, and keep when a checkpoint has none);
    weight banks are left untouched (their pages are committed as the checkpoint writes them)."""
    if "_scale" in spec.name:
        rows.fill_(E8M0_NAN if rows.dtype == torch.uint8 else float("nan"))
    elif spec.name.endswith("_bias"):
        rows.zero_()


def fused_checkpoint_name(layer_id: int, layer_param: str) -> str:
    """gpt-oss's checkpoint tensor that fills ``layer_param`` for every expert of a layer
    (``w13_weight_scale`` -> ``model.layers.{L}.mlp.experts.gate_up_proj_scales``)."""
    return f"model.layers.{layer_id}.mlp.experts.{_FUSED.get(layer_param, layer_param)}"


def deinterleaving_loader(
    loader: Callable, spec: BankSpec, layer_id: int, num_experts: int
) -> Callable:
    """``loader`` for a layer whose checkpoint interleaves the gate and up rows (gpt-oss:
    ``Mxfp4MoEMethod``'s layers load every expert at once, ``expert_id=None``): the loaded
    tensor's shape is checked against the layer's rows, and a ``w13`` tensor (weights, e8m0
    scales, bias; ``[E, 2I, ...]``) is de-interleaved (``formats.deinterleave_gate_up``) before
    the copy, so the host pool holds gate rows ``[0, I)`` then up rows ``[I, 2I)`` as the CPU
    executor reads them. A packed pool (``pack.py``) already holds these bytes.

    Raises (from the returned loader):
        ValueError: a tensor of another shape than ``[E, *spec.row_shape]`` (names the
            checkpoint tensor and both shapes), or one expert loaded at a time (the
            interleaved rows need the whole tensor; not a layout any release uses).
    """
    from sglang.srt.layers.moe.expert_cache.formats import deinterleave_gate_up

    @functools.wraps(loader)
    def load(param, loaded_weight, weight_name=None, shard_id=None, expert_id=None, **kw):
        name = fused_checkpoint_name(layer_id, spec.layer_param)
        if expert_id is not None:
            raise ValueError(
                f"{name}: loaded one expert at a time ({weight_name}, expert {expert_id}), but "
                "this MoE layer's gate/up rows are interleaved and load for all experts at once "
                "(the gpt-oss layout); convert the checkpoint to the released layout"
            )
        want = (num_experts, *spec.row_shape)
        got = tuple(loaded_weight.shape)
        if got != want:
            raise ValueError(
                f"{name}: shape {got} ({weight_name}), but this MoE layer expects {want} "
                "(experts, rows, ...); the checkpoint does not match its config"
            )
        if spec.name.startswith("w13"):
            loaded_weight = deinterleave_gate_up(loaded_weight)
        return loader(
            param, loaded_weight, weight_name=weight_name, shard_id=shard_id, expert_id=None, **kw
        )

    return load


def checkpoint_name(layer_id: int, expert: int, shard_id: str, layer_param: str) -> str:
    """The checkpoint tensor that fills ``layer_param``'s rows of one expert and shard
    (``w13_weight_scale_2`` -> ``weight_scale_2``, ``w2_weight_scale_inv`` ->
    ``weight_scale_inv``, ...)."""
    suffix = layer_param.split("_", 1)[1]
    return f"model.layers.{layer_id}.mlp.experts.{expert}.{_PROJ[shard_id]}.{suffix}"


def expected_shape(spec: BankSpec, shard_id: str) -> tuple:
    """The checkpoint tensor's shape for one shard of one expert's row of ``spec``: w13 rows
    are the gate rows then the up rows, half each; a per-tensor scale (``*_scale_2``, a row
    of at most one element per shard) is a scalar."""
    if len(spec.row_shape) < 2:
        return ()
    rows, cols = spec.row_shape
    return (rows // 2, cols) if shard_id in ("w1", "w3") else (rows, cols)


def checked_loader(loader: Callable, spec: BankSpec, layer_id: int, label: str) -> Callable:
    """``loader`` (``FusedMoE.weight_loader``) with the shape of each per-expert tensor checked
    first.

    Raises (from the returned loader):
        ValueError: the checkpoint tensor's shape is not the one the layer expects; the message
            names the tensor, both shapes and the format.
    """

    @functools.wraps(loader)
    def load(param, loaded_weight, weight_name, shard_id, expert_id, *args, **kwargs):
        if expert_id is not None and shard_id in _PROJ:
            want = expected_shape(spec, shard_id)
            got = tuple(loaded_weight.shape)
            if got != want and not (want == () and loaded_weight.numel() == 1):
                name = checkpoint_name(layer_id, int(expert_id), shard_id, spec.layer_param)
                raise ValueError(
                    f"{name}: shape {tuple(loaded_weight.shape)}, but this {label} MoE layer "
                    f"expects {want} (loading into {weight_name}); the checkpoint's "
                    "scales do not match its weights or its quantization config (block / group)"
                )
        return loader(param, loaded_weight, weight_name, shard_id, expert_id, *args, **kwargs)

    return load


def per_tensor_scale_loader(loader: Callable, spec: BankSpec, layer_id: int) -> Callable:
    """``loader`` for a scale bank of a per-tensor format (``formats.CT_FP8_TENSOR``): the
    checkpoint holds one scale per projection (``gate_proj.weight_scale`` [1]), the bank one
    per output row; the scale is written on every row of its projection (gate: rows
    ``[0, I)`` of ``w13_scale``, up: ``[I, 2I)``, down: all ``H`` rows of ``w2_scale``) by
    calling ``loader`` (``FusedMoE.weight_loader``, through :func:`checked_loader`) with the
    per-channel tensor ``[rows, 1]``; the bank's parameter is marked per channel so upstream
    loads it as one.

    Raises (from the returned loader):
        ValueError: a checkpoint scale with more than one element (names it and its shape).
    """

    @functools.wraps(loader)
    def load(param, loaded_weight, weight_name, shard_id, expert_id, *args, **kwargs):
        if expert_id is not None and shard_id in _PROJ:
            if loaded_weight.numel() != 1:
                name = checkpoint_name(layer_id, int(expert_id), shard_id, spec.layer_param)
                raise ValueError(
                    f"{name}: shape {tuple(loaded_weight.shape)}, but this per-tensor FP8 MoE "
                    "layer expects one scale per projection (shape [1]); the checkpoint's "
                    "scales do not match its quantization config (strategy: tensor)"
                )
            rows = expected_shape(spec, shard_id)[0]
            loaded_weight = loaded_weight.reshape(1, 1).float().expand(rows, 1)
        return loader(param, loaded_weight, weight_name, shard_id, expert_id, *args, **kwargs)

    return load


def missing_scales(
    rows: torch.Tensor, spec: BankSpec, layer_id: int, fused: bool = False
) -> List[str]:
    """Checkpoint names of the scales never written into one layer's rows of a scale bank.

    Args:
        rows: [E, *spec.row_shape] the layer's rows (NaN where nothing was loaded; float32 or
            float8_e4m3fn; :data:`E8M0_NAN` for uint8 e8m0 scales).
        spec: the scale bank (``w13_scale``: gate scales then up scales; ``w2_scale``; nvfp4's
            ``w13_scale_2`` [E, 2] (gate, up) and ``w2_scale_2`` [E]).
        fused: the checkpoint has one tensor per projection for all experts (gpt-oss): names
            are ``model.layers.{L}.mlp.experts.gate_up_proj_scales`` with the experts missing.
    """
    if rows.dtype == torch.uint8:
        nan = rows == E8M0_NAN
    else:
        nan = torch.isnan(rows.float())
    if fused:
        flat = nan.reshape(nan.shape[0], -1).any(dim=1)
        experts = torch.nonzero(flat).flatten().tolist()
        if not experts:
            return []
        shown = ", ".join(map(str, experts[:8])) + (" ..." if len(experts) > 8 else "")
        return [f"{fused_checkpoint_name(layer_id, spec.layer_param)} (experts {shown})"]
    if nan.dim() == 1:
        nan = nan[:, None]
    elif nan.dim() > 2:
        nan = nan.flatten(2).any(dim=2)  # [E, scale rows]
    out = []
    for e in torch.nonzero(nan.any(dim=1)).flatten().tolist():
        if spec.name.startswith("w13"):
            half = rows.shape[1] // 2
            shards = [
                s
                for s, sl in (("w1", slice(0, half)), ("w3", slice(half, None)))
                if nan[e, sl].any()
            ]
        else:
            shards = ["w2"]
        out += [checkpoint_name(layer_id, e, s, spec.layer_param) for s in shards]
    return out
