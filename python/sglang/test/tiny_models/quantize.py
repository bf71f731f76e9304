"""Quantizers that turn a tiny model's bf16 state dict into the layout of a released checkpoint.

``fp8``: block FP8 as in Qwen's official ``-FP8`` releases (Qwen3-30B-A3B-FP8 and its siblings):

* every projection ``*_proj.weight`` of the decoder (attention q/k/v/o, each routed expert's
  gate/up/down, dense and shared-expert MLPs) is stored as ``float8_e4m3fn`` ``[N, K]`` beside
  ``*_proj.weight_scale_inv`` ``[ceil(N / 128), ceil(K / 128)]``, one scale per 128 x 128
  block, stored in bfloat16 as the releases store it; the dequantized weight is
  ``fp8 * scale_inv`` per block (the name is DeepSeek-V3's: the scale that *undoes* the
  quantization);
* the embedding, ``lm_head``, the norms and the MoE router (``mlp.gate``) stay bfloat16;
* ``config.json`` gains ``quantization_config`` = ``{"quant_method": "fp8", "fmt": "e4m3",
  "activation_scheme": "dynamic", "weight_block_size": [128, 128], "modules_to_not_convert":
  [...]}``, which upstream SGLang's ``Fp8Config.from_config`` reads (``modules_to_not_convert``
  is its ``ignored_layers`` key).

A block's scale is ``amax(|w|) / 448`` (448 = largest finite e4m3fn), rounded to bfloat16 first
so that the stored scale is the one the weights were divided by; blocks at the edge of a tensor
whose size is not a multiple of 128 are partial, as upstream's loader expects (``ceil``).

``nvfp4``: the ModelOpt NVFP4 layout of NVIDIA's releases (nvidia/Qwen3-30B-A3B-FP4), written by
:mod:`.quantize_nvfp4` (``hf_quant_config.json`` beside an unchanged ``config.json``).
"""

from __future__ import annotations

from typing import Dict, List, Tuple

QUANTS = ("fp8", "nvfp4")
FP8_BLOCK = (128, 128)
FP8_E4M3_MAX = 448.0
SCALE_SUFFIX = "_scale_inv"


def fp8_quantized_names(state: Dict[str, object]) -> List[str]:
    """The tensors the FP8 releases quantize: 2-D ``*_proj.weight`` (the router ``mlp.gate``,
    embeddings, ``lm_head`` and norms are not projections of that name)."""
    return [n for n, t in state.items() if n.endswith("_proj.weight") and t.dim() == 2]


def block_quantize_fp8(w, block: Tuple[int, int] = FP8_BLOCK):
    """Quantize one weight to block FP8.

    Args:
        w: [N, K] float tensor (bf16 or fp32).
        block: (block_n, block_k), 128 x 128 in the releases.

    Returns:
        ``(q, scale_inv)``: q [N, K] ``float8_e4m3fn``; scale_inv [ceil(N/bn), ceil(K/bk)]
        bfloat16 with ``w ~= q * scale_inv`` per block (an all-zero block gets scale 1).
    """
    import torch

    bn, bk = block
    n, k = w.shape
    sn, sk = -(-n // bn), -(-k // bk)
    wf = w.float()
    padded = torch.zeros(sn * bn, sk * bk, dtype=torch.float32)
    padded[:n, :k] = wf
    blocks = padded.view(sn, bn, sk, bk)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
    scale = scale.to(torch.bfloat16)
    full = scale.float().repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:n, :k]
    q = (wf / full).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q.contiguous(), scale.contiguous()


def block_dequantize_fp8(q, scale_inv, block: Tuple[int, int] = FP8_BLOCK, dtype=None):
    """``q * scale_inv`` per block: [N, K] in ``dtype`` (default float64, the reference)."""
    import torch

    bn, bk = block
    n, k = q.shape
    dtype = dtype or torch.float64
    full = scale_inv.to(dtype).repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:n, :k]
    return q.to(dtype) * full


def quantize_state(
    state: Dict[str, object], cfg: dict, quant: str
) -> Tuple[Dict, dict, Dict[str, dict]]:
    """``(state, config, files)`` of the ``quant`` checkpoint made from a bf16 tiny model;
    ``files`` are further JSON files of the checkpoint by name (nvfp4: ``hf_quant_config.json``).

    Raises:
        ValueError: an unknown ``quant`` (names the supported list).
    """
    if quant not in QUANTS:
        raise ValueError(f"unknown quantization {quant!r}; choose from {QUANTS}")
    if quant == "nvfp4":
        from .quantize_nvfp4 import quantize_state_nvfp4

        out, hf_quant = quantize_state_nvfp4(state, cfg)
        return out, dict(cfg), {"hf_quant_config.json": hf_quant}
    out = dict(state)
    for name in fp8_quantized_names(state):
        q, s = block_quantize_fp8(state[name])
        out[name] = q
        out[name + SCALE_SUFFIX] = s
    keep = ["lm_head", "model.embed_tokens"] + [
        f"model.layers.{i}.mlp.gate" for i in range(cfg["num_hidden_layers"])
    ]
    cfg = dict(cfg)
    cfg["quantization_config"] = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "modules_to_not_convert": keep,
        "quant_method": "fp8",
        "weight_block_size": list(FP8_BLOCK),
    }
    return dict(sorted(out.items())), dict(sorted(cfg.items())), {}
