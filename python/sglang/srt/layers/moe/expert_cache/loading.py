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
``w13_weight_scale_2``).
"""

from __future__ import annotations

import functools
from typing import Callable, List

import torch

from sglang.srt.layers.moe.expert_cache.banks import BankSpec

# FusedMoE shard ids (make_expert_params_mapping) -> the checkpoint projection.
_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


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


def missing_scales(rows: torch.Tensor, spec: BankSpec, layer_id: int) -> List[str]:
    """Checkpoint names of the scales never written into one layer's rows of a scale bank.

    Args:
        rows: [E, *spec.row_shape] the layer's rows (NaN where nothing was loaded; float32 or
            float8_e4m3fn).
        spec: the scale bank (``w13_scale``: gate scales then up scales; ``w2_scale``; nvfp4's
            ``w13_scale_2`` [E, 2] (gate, up) and ``w2_scale_2`` [E]).
    """
    nan = torch.isnan(rows.float())
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
