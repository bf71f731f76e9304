"""compressed-tensors FP8 ("FP8-Dynamic"): the layout llm-compressor writes and its releases ship.

``ct-fp8`` reproduces llm-compressor's ``QuantizationModifier(targets="Linear",
scheme="FP8_DYNAMIC", ignore=["lm_head", "re:.*mlp.gate$"])`` saved with
``save_compressed=True`` (RedHatAI/Qwen3-30B-A3B-FP8-dynamic, the community GLM-4.5/4.6 and
GLM-5.1 FP8-Dynamic releases):

* every ``nn.Linear`` of the decoder that is not ignored (attention q/k/v/o, each routed
  expert's gate/up/down, dense and shared-expert MLPs; in the tiny models exactly the 2-D
  ``*_proj.weight`` tensors, :func:`.quantize.fp8_quantized_names`) is stored as
  ``P.weight`` ``float8_e4m3fn`` ``[N, K]`` beside ``P.weight_scale`` **float32** ``[N, 1]``,
  one scale per output channel, ``amax(|w[n]|) / 448`` (symmetric, ``observer: minmax``);
  biases (GLM's q/k/v) stay bf16 beside them. No ``input_scale``: the activations are
  quantized per token at run time (``dynamic: true``).
* the embedding, ``lm_head``, the norms and the routers (``mlp.gate``, GLM's
  ``e_score_correction_bias``) stay as in the bf16 model;
* ``config.json`` gains ``quantization_config`` = ``{"quant_method": "compressed-tensors",
  "format": "float-quantized", "quantization_status": "compressed", "kv_cache_scheme": null,
  "ignore": ["lm_head", "re:.*mlp.gate$"], "config_groups": {"group_0": {"targets":
  ["Linear"], "format": "float-quantized", "weights": {"num_bits": 8, "type": "float",
  "strategy": "channel", "symmetric": true, "dynamic": false, ...}, "input_activations":
  {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": true, "dynamic": true,
  ...}, "output_activations": null}}}``, which upstream's ``CompressedTensorsConfig`` reads
  (``CompressedTensorsW8A8Fp8`` for the linears, ``CompressedTensorsW8A8Fp8MoE`` for the
  experts).

``ct-fp8-block`` is llm-compressor's ``FP8_BLOCK`` scheme: the same, with ``"strategy":
"block", "block_structure": [128, 128]`` for the weights, ``"strategy": "group", "group_size":
128`` for the activations, and ``P.weight_scale`` float32 ``[ceil(N/128), ceil(K/128)]`` (the
name is ``weight_scale``, not block FP8's ``weight_scale_inv``; the value multiplies the FP8
weight in both).

``ct-fp8-tensor`` is llm-compressor's ``FP8`` scheme (static per-tensor: the "-FP8" releases
that are not "-FP8-dynamic", e.g. RedHatAI's Mixtral-8x7B-Instruct-v0.1-FP8): weights
``"strategy": "tensor"``, ``P.weight_scale`` float32 ``[1]`` = ``amax(|w|) / 448`` of the
whole tensor, and static activations (``"strategy": "tensor", "dynamic": false,
"observer": "minmax"``) with ``P.input_scale`` float32 ``[1]`` beside every FP8 weight.
llm-compressor calibrates the input scale on data; the tiny model has none, so it is
:data:`TENSOR_INPUT_SCALE` (FP8 activations up to ``448 * 0.05 = 22.4``; the CPU paths never
read it, upstream's CUDA kernels would).

What was confirmed (search of public sources, no downloads): the config keys and values of
the FP8-Dynamic groups (converters and tests that write them; TensorRT-LLM PR 17433:
"compressed-tensors stores weight_scale shaped [out, 1]"); the ignore patterns llm-compressor's
MoE examples use (``re:.*mlp.gate$``); upstream 0.5.23's scheme shapes
(``w13_weight_scale`` [E, 2I, 1], ``w2_weight_scale`` [E, H, 1]). Not confirmed: the scale
dtype of every release (float32 here; a bf16 scale loads the same, upstream's parameters are
float32).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Dict, Tuple

from .quantize import FP8_BLOCK, FP8_E4M3_MAX, block_dequantize_fp8, block_quantize_fp8

CT_QUANTS = ("ct-fp8", "ct-fp8-block", "ct-fp8-tensor")
SCALE_SUFFIX = "_scale"  # P.weight -> P.weight_scale
INPUT_SCALE = ".input_scale"  # P.weight -> P.input_scale (ct-fp8-tensor)
TENSOR_INPUT_SCALE = 0.05  # ct-fp8-tensor's static input scale (module docstring)
IGNORE = ["lm_head", "re:.*mlp.gate$"]


def channel_quantize_fp8(w):
    """Quantize one weight to FP8 with one scale per output channel (row).

    Args:
        w: [N, K] float tensor (bf16 or fp32).

    Returns:
        ``(q, scale)``: q [N, K] ``float8_e4m3fn``; scale [N, 1] float32 with
        ``w ~= q * scale`` per row (an all-zero row gets scale 1).
    """
    import torch

    wf = w.float()
    amax = wf.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
    q = (wf / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q.contiguous(), scale.contiguous()


def tensor_quantize_fp8(w):
    """Quantize one weight to FP8 with one scale for the whole tensor.

    Args:
        w: [N, K] float tensor (bf16 or fp32).

    Returns:
        ``(q, scale)``: q [N, K] ``float8_e4m3fn``; scale [1] float32 = ``amax(|w|) / 448``
        (1 for an all-zero tensor), ``w ~= q * scale``.
    """
    import torch

    wf = w.float()
    amax = wf.abs().amax().reshape(1)
    scale = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
    q = (wf / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q.contiguous(), scale.contiguous()


def ct_dequantize_fp8(q, scale, dtype=None):
    """The weight a compressed-tensors FP8 tensor encodes: ``q * scale`` per tensor (scale [1]
    or a scalar), per row (scale [N, 1]) or per 128 x 128 block (scale [ceil(N/128),
    ceil(K/128)]), in ``dtype`` (default float64, the reference).

    Raises:
        ValueError: a scale of neither shape (names both shapes).
    """
    import torch

    dtype = dtype or torch.float64
    n, k = q.shape
    if scale.numel() == 1 and scale.dim() <= 1:
        return q.to(dtype) * scale.to(dtype).reshape(())
    if tuple(scale.shape) == (n, 1):
        return q.to(dtype) * scale.to(dtype)
    want = (-(-n // FP8_BLOCK[0]), -(-k // FP8_BLOCK[1]))
    if tuple(scale.shape) != want:
        raise ValueError(
            f"weight_scale of shape {tuple(scale.shape)} for an FP8 weight {(n, k)}: neither "
            f"per tensor (1,), per channel ({n}, 1) nor per 128 x 128 block {want}"
        )
    return block_dequantize_fp8(q, scale, FP8_BLOCK, dtype)


def quantization_config(quant: str) -> dict:
    """The ``quantization_config`` llm-compressor writes for FP8_DYNAMIC (``ct-fp8``),
    FP8_BLOCK (``ct-fp8-block``) or FP8 (``ct-fp8-tensor``), every key it writes, sorted."""
    block, tensor = quant == "ct-fp8-block", quant == "ct-fp8-tensor"
    weights = {
        "actorder": None,
        "block_structure": list(FP8_BLOCK) if block else None,
        "dynamic": False,
        "group_size": None,
        "num_bits": 8,
        "observer": "minmax",
        "observer_kwargs": {},
        "strategy": "block" if block else "tensor" if tensor else "channel",
        "symmetric": True,
        "type": "float",
    }
    acts = {
        "actorder": None,
        "block_structure": None,
        "dynamic": not tensor,
        "group_size": FP8_BLOCK[1] if block else None,
        "num_bits": 8,
        "observer": "minmax" if tensor else None,
        "observer_kwargs": {},
        "strategy": "group" if block else "tensor" if tensor else "token",
        "symmetric": True,
        "type": "float",
    }
    return {
        "config_groups": {
            "group_0": {
                "format": "float-quantized",
                "input_activations": acts,
                "output_activations": None,
                "targets": ["Linear"],
                "weights": weights,
            }
        },
        "format": "float-quantized",
        "ignore": list(IGNORE),
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
    }


def quantize_state_ct_fp8(
    state: Dict[str, object], cfg: dict, quant: str
) -> Tuple[Dict[str, object], dict]:
    """``(state, config)`` of the ``ct-fp8`` / ``ct-fp8-block`` / ``ct-fp8-tensor`` checkpoint
    of a bf16 tiny model (module docstring).

    Raises:
        ValueError: ``quant`` not one of :data:`CT_QUANTS`.
    """
    from .quantize import fp8_quantized_names

    if quant not in CT_QUANTS:
        raise ValueError(
            f"unknown compressed-tensors quantization {quant!r}; choose from {CT_QUANTS}"
        )
    import torch

    out = dict(state)
    for name in fp8_quantized_names(state):
        if quant == "ct-fp8-block":
            q, s = block_quantize_fp8(state[name], scale_dtype=torch.float32)
        elif quant == "ct-fp8-tensor":
            q, s = tensor_quantize_fp8(state[name])
            out[name.removesuffix(".weight") + INPUT_SCALE] = torch.tensor(
                [TENSOR_INPUT_SCALE], dtype=torch.float32
            )
        else:
            q, s = channel_quantize_fp8(state[name])
        out[name] = q
        out[name + SCALE_SUFFIX] = s
    cfg = dict(cfg)
    cfg["quantization_config"] = quantization_config(quant)
    return dict(sorted(out.items())), dict(sorted(cfg.items()))


def dequantize_ct_fp8_checkpoint(src, dst, dtype=None):
    """Write the compressed-tensors FP8 checkpoint ``src`` dequantized into ``dst``: every FP8
    weight replaced by :func:`ct_dequantize_fp8` in ``dtype`` (default float32), its
    ``weight_scale`` (and ``input_scale``) dropped, every other tensor as stored, ``config.json`` without
    ``quantization_config``; the other files copied (the transformers oracle's checkpoint).

    Returns:
        ``dst`` as a ``Path``.

    Raises:
        ValueError: a config that is not compressed-tensors, or an FP8 weight without its
            ``weight_scale`` (names it).
    """
    import torch
    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    cfg = json.loads((src / "config.json").read_text())
    q = cfg.pop("quantization_config", None) or {}
    if q.get("quant_method") != "compressed-tensors":
        raise ValueError(f"{src}: quantization_config {q!r} is not compressed-tensors")
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, dst / f.name)
    state = load_file(str(src / "model.safetensors"))
    out = {}
    for name, t in state.items():
        if name.endswith((".weight" + SCALE_SUFFIX, INPUT_SCALE)):
            continue
        if t.dtype == torch.float8_e4m3fn:
            s = state.get(name + SCALE_SUFFIX)
            if s is None:
                raise ValueError(f"{name}: an FP8 weight without {name + SCALE_SUFFIX}")
            t = ct_dequantize_fp8(t, s, dtype or torch.float32)
        out[name] = t.contiguous()
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return dst
