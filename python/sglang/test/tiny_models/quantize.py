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

``fp8`` for ``deepseek_v3``: the layout of deepseek-ai/DeepSeek-V3 (and R1, V3-0324), as its
``README_WEIGHTS.md`` and ``inference/model.py`` describe it (V3.1 and later also declare
``"scale_fmt": "ue8m0"``, power-of-two scales in the same float32 tensors; not written here):
the same 128 x 128 blocks over every projection of the decoder (MLA's ``q_a_proj``,
``q_b_proj``, ``kv_a_proj_with_mqa``, ``kv_b_proj``, ``o_proj``; the dense, routed and
shared-expert MLPs), but

* ``weight_scale_inv`` stored in **float32** (the block scale is ``amax / 448`` in float32, not
  rounded to bfloat16);
* ``quantization_config`` = ``{"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method":
  "fp8", "weight_block_size": [128, 128]}``, without ``modules_to_not_convert``: the release
  names no ignored layers (its router ``mlp.gate`` and ``lm_head`` are simply not FP8 in the
  file, and upstream's DeepSeek model builds them unquantized);
* the router ``mlp.gate.weight``, the embedding, ``lm_head`` and every RMSNorm (``q_a_layernorm``,
  ``kv_a_layernorm`` included) stay bfloat16, ``mlp.gate.e_score_correction_bias`` float32,
  as in the bf16 tiny model.

``nvfp4``: the ModelOpt NVFP4 layout of NVIDIA's releases (nvidia/Qwen3-30B-A3B-FP4), written by
:mod:`.quantize_nvfp4` (``hf_quant_config.json`` beside an unchanged ``config.json``); for
``qwen3_5_moe`` the ModelOpt ``MIXED_PRECISION`` layout of nvidia/Qwen3.6-35B-A3B-NVFP4
(W4A16 NVFP4 experts, shared expert and ``lm_head``; FP8 attention and DeltaNet projections),
written by :mod:`.quantize_modelopt_mixed`.

``ct-fp8`` / ``ct-fp8-block``: compressed-tensors FP8 as llm-compressor writes it (the
"FP8-Dynamic" releases: RedHatAI/Qwen3-30B-A3B-FP8-dynamic, GLM-4.5/4.6 FP8-Dynamic), per-channel
``weight_scale`` [N, 1] or 128 x 128 blocks, written by :mod:`.quantize_ct_fp8`; ``ct-fp8-tensor``
its static per-tensor "FP8" scheme (``weight_scale`` and ``input_scale`` [1]: RedHatAI's
Mixtral-8x7B-Instruct-v0.1-FP8).
"""

from __future__ import annotations

from typing import Dict, List, Tuple

QUANTS = ("fp8", "nvfp4", "ct-fp8", "ct-fp8-block", "ct-fp8-tensor")
# The architectures each quantization is written for (the releases it reproduces).
QUANT_ARCHS = {
    "fp8": ("qwen3_moe", "deepseek_v3"),
    "nvfp4": ("qwen3_moe", "qwen3_5_moe"),
    "ct-fp8": ("qwen3_moe", "glm4_moe"),
    "ct-fp8-block": ("qwen3_moe", "glm4_moe"),
    "ct-fp8-tensor": ("qwen3_moe",),
}
FP8_BLOCK = (128, 128)
FP8_E4M3_MAX = 448.0
SCALE_SUFFIX = "_scale_inv"


def fp8_quantized_names(state: Dict[str, object]) -> List[str]:
    """The tensors the FP8 releases quantize: the 2-D projections ``*_proj.weight`` and
    DeepSeek's ``kv_a_proj_with_mqa.weight`` (the router ``mlp.gate``, embeddings, ``lm_head``
    and norms are not projections of that name)."""
    suffixes = ("_proj.weight", "_proj_with_mqa.weight")
    return [n for n, t in state.items() if n.endswith(suffixes) and t.dim() == 2]


def block_quantize_fp8(w, block: Tuple[int, int] = FP8_BLOCK, scale_dtype=None):
    """Quantize one weight to block FP8.

    Args:
        w: [N, K] float tensor (bf16 or fp32).
        block: (block_n, block_k), 128 x 128 in the releases.
        scale_dtype: dtype of the stored scale: bfloat16 (default; Qwen's ``-FP8`` releases)
            or float32 (DeepSeek-V3's).

    Returns:
        ``(q, scale_inv)``: q [N, K] ``float8_e4m3fn``; scale_inv [ceil(N/bn), ceil(K/bk)]
        in ``scale_dtype`` with ``w ~= q * scale_inv`` per block (an all-zero block gets
        scale 1).
    """
    import torch

    scale_dtype = scale_dtype or torch.bfloat16

    bn, bk = block
    n, k = w.shape
    sn, sk = -(-n // bn), -(-k // bk)
    wf = w.float()
    padded = torch.zeros(sn * bn, sk * bk, dtype=torch.float32)
    padded[:n, :k] = wf
    blocks = padded.view(sn, bn, sk, bk)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
    scale = scale.to(scale_dtype)
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
    if quant == "nvfp4" and cfg.get("model_type") == "qwen3_5_moe":
        from .quantize_modelopt_mixed import quantize_state_qwen3_5_nvfp4

        out, cfg, hf_quant = quantize_state_qwen3_5_nvfp4(state, cfg)
        return out, cfg, {"hf_quant_config.json": hf_quant}
    if quant.startswith("ct-"):
        from .quantize_ct_fp8 import quantize_state_ct_fp8

        out, cfg = quantize_state_ct_fp8(state, cfg, quant)
        return out, cfg, {}
    if quant == "nvfp4":
        from .quantize_nvfp4 import quantize_state_nvfp4

        out, hf_quant = quantize_state_nvfp4(state, cfg)
        return out, dict(cfg), {"hf_quant_config.json": hf_quant}
    import torch

    deepseek = cfg.get("model_type") == "deepseek_v3"
    scale_dtype = torch.float32 if deepseek else torch.bfloat16
    out = dict(state)
    for name in fp8_quantized_names(state):
        q, s = block_quantize_fp8(state[name], scale_dtype=scale_dtype)
        out[name] = q
        out[name + SCALE_SUFFIX] = s
    qcfg = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": list(FP8_BLOCK),
    }
    if not deepseek:  # Qwen's releases list the modules left in bf16; DeepSeek's do not
        qcfg["modules_to_not_convert"] = ["lm_head", "model.embed_tokens"] + [
            f"model.layers.{i}.mlp.gate" for i in range(cfg["num_hidden_layers"])
        ]
    cfg = dict(cfg)
    cfg["quantization_config"] = dict(sorted(qcfg.items()))
    return dict(sorted(out.items())), dict(sorted(cfg.items())), {}


def dequantize_fp8_checkpoint(src, dst, dtype=None):
    """Write the block-FP8 checkpoint ``src`` dequantized into ``dst``: every FP8 weight
    replaced by ``q * weight_scale_inv`` per block (:func:`block_dequantize_fp8`) in ``dtype``
    (default float32), its scale dropped, every other tensor as stored, ``config.json`` without
    ``quantization_config``; the other files copied. The oracle's checkpoint: transformers
    loads it as the unquantized model whose weights the FP8 server computes with.

    Args:
        src, dst: model folders (``dst`` is created; existing files in it are replaced).
        dtype: a torch floating dtype.

    Returns:
        ``dst`` as a ``Path``.

    Raises:
        ValueError: an FP8 weight without its ``weight_scale_inv`` (names it), or a config
            whose ``quantization_config`` is not block ``fp8``.
    """
    import json
    import shutil
    from pathlib import Path

    import torch
    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    cfg = json.loads((src / "config.json").read_text())
    q = cfg.pop("quantization_config", None) or {}
    if q.get("quant_method") != "fp8" or not q.get("weight_block_size"):
        raise ValueError(f"{src}: quantization_config {q!r} is not block fp8")
    block = tuple(q["weight_block_size"])
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, dst / f.name)
    state = load_file(str(src / "model.safetensors"))
    out = {}
    for name, t in state.items():
        if name.endswith(SCALE_SUFFIX):
            continue
        if t.dtype == torch.float8_e4m3fn:
            s = state.get(name + SCALE_SUFFIX)
            if s is None:
                raise ValueError(f"{name}: an FP8 weight without {name + SCALE_SUFFIX}")
            t = block_dequantize_fp8(t, s, block, dtype or torch.float32)
        out[name] = t.contiguous()
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return dst
